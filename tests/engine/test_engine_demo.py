"""``jspec demo`` end to end on a tiny configuration (probes on via --checkify)."""

from __future__ import annotations

from jspec.apps.demo import main

TINY_ARGS = [
    "--vocab-size",
    "64",
    "--hidden-size",
    "32",
    "--intermediate-size",
    "64",
    "--num-layers",
    "2",
    "--num-heads",
    "4",
    "--num-kv-heads",
    "2",
    "--head-dim",
    "8",
    "--num-prompts",
    "3",
    "--max-new-tokens",
    "12",
    "--max-running",
    "1",
    "--no-progress",
]


def test_demo_checkify_tiny(capsys):
    assert main(TINY_ARGS + ["--checkify", "--staggered"]) == 0
    out = capsys.readouterr().out
    assert "lossless check: PASS" in out
    assert "checkify: all probes on, none fired" in out
    assert "allocator balance: spec ok" in out
    mean = float(out.split("mean acceptance length:")[1].split()[0])
    assert mean > 1.5, out
    # The sampled run (default T 1, request i seeded 0 + i): plain and spec, both checkified.
    sampled = out.split("sampled (T 1, seed 0 + i): ")[1].splitlines()[0]
    assert "mean acceptance length" in sampled and float(sampled.split()[-2]) >= 1.0, out


def test_checkify_engine_reports_a_fired_probe():
    """A NaN draft head: the draft ``topk_p`` NaN probe fires, naming itself."""
    import jax.numpy as jnp
    import pytest
    from engine_helpers import (
        CONTEXT_LEN,
        DRAFT,
        MAX_PROMPT,
        TARGET,
        TINY,
        tiny_model,
        tiny_prompts,
    )

    from jspec import probes
    from jspec._pytree import replace
    from jspec.engine.scheduler import Engine
    from jspec.engine.state import make_engine_config

    params, draft = tiny_model()
    bad = replace(draft, fc=draft.fc * jnp.nan)
    ecfg = make_engine_config(
        TINY,
        page_size=16,
        topk=2,
        num_steps=2,
        num_draft_tokens=3,
        context_len=CONTEXT_LEN,
        max_running_requests=1,
        max_prompt_len=MAX_PROMPT,
        batch_buckets=(1,),
    )
    with probes.probes_enabled(True):
        engine = Engine(ecfg, TARGET, params, DRAFT, bad, checkify=True)
        with pytest.raises(probes.ProbeError, match="draft topk_p: .*NaN"):
            engine.generate(tiny_prompts()[:1], 4)


def test_demo_with_the_probe_switch_env():
    """JSPEC_ENABLE_ASYNC_ASSERT=1 (issue 11 §1): the engine runs its steps checkified, so the
    demo passes instead of dying on an unfunctionalized checkify.check."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "JSPEC_ENABLE_ASYNC_ASSERT": "1", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jspec.cli",
            "demo",
            *TINY_ARGS,
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "6",
            "--temperature",
            "0",  # the switch is the point; sampled checkified runs: test_demo_checkify_tiny
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "lossless check: PASS" in proc.stdout
    assert "checkify: all probes on, none fired" in proc.stdout
