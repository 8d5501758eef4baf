"""The public annotations have power: mypy (the lint extra's pinned one) run over adopter code
flags exactly the misuses in it, and passes the same calls written right (the steps, the
models, the jitted ops).

jspec ships ``py.typed``; ``make lint`` type-checks jspec, interop and examples/ (clean). This
test is the other half: an annotation erased to ``Any`` (a step jitted into
``Callable[..., Any]``, a dataclass decorator the checker cannot read) would let the marked lines
through, and a protocol an ordinary model does not satisfy would flag the unmarked ones.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("mypy")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each line ending in "# E" must get an error; no other line may.
ADOPTER = textwrap.dedent(
    """
    import jax

    from jspec.engine import (
        EngineState,
        Runner,
        SamplingParams,
        Weights,
        decode_rounds,
        greedy_step,
        make_engine_config,
        prefill,
        release,
        spec_decode_step,
    )
    from jspec.kv import assign_req_to_token_pool
    from jspec.models import Eagle1Draft, LlamaConfig, LlamaTarget


    def build() -> Runner:
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
        )
        target = LlamaTarget(config)
        LlamaTarget(config, rms_norm_impl=2)  # E
        draft = Eagle1Draft(target.config)
        ecfg = make_engine_config(target, draft=draft, page_size=4, topk=2, num_steps=2)
        return Runner(ecfg, target, draft)


    def loop(
        runner: Runner, weights: Weights, state: EngineState, slots: jax.Array, live: jax.Array
    ) -> jax.Array:
        state, out = spec_decode_step(runner, weights, state, slots, live)
        state, plain = greedy_step(runner, weights, state, slots, live)
        print(out.accept_lens, plain.next_tokens, SamplingParams(temperature=0.7, seed=1))
        out.next_tokens  # E
        spec_decode_step(runner, state, weights, slots, live)  # E
        greedy_step(runner, weights, state, slots)  # E
        weights = Weights(weights.target, draft=weights.draft)
        Weights(1, 2, 3)  # E
        SamplingParams(temperature=0.7, seed="one")  # E
        runner.kv = None  # E
        state, first = prefill(runner, weights, state, slots, slots, slots)
        print(first.first_tokens)
        prefill(runner, weights, state, slots, slots)  # E
        state, ok = release(runner, state, slots, live, return_ok=True)
        state = release(runner, state, slots, live)
        state, ok = release(runner, state, slots, live)  # E
        assign_req_to_token_pool(slots, slots, slots, slots, slots)
        assign_req_to_token_pool(slots, slots, slots, slots)  # E
        state, rounds = decode_rounds(
            spec_decode_step, runner, weights, state, slots, live, live, live, 4
        )
        return rounds.tokens
    """
)


def test_mypy_flags_exactly_the_misuses(tmp_path):
    path = tmp_path / "adopter.py"
    path.write_text(ADOPTER)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--hide-error-context", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    flagged = {int(m.group(1)) for m in re.finditer(r"adopter\.py:(\d+): error:", proc.stdout)}
    marked = {i for i, line in enumerate(ADOPTER.splitlines(), 1) if line.endswith("# E")}
    assert flagged == marked, proc.stdout + proc.stderr
