"""Data-parallel shards (shard_map over 4 host devices) give the one-device outputs.

XLA's host device count must be set before JAX starts, so the check runs in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import sys
    sys.path.insert(0, {helpers!r})
    import jax
    from engine_helpers import (TINY, CONTEXT_LEN, MAX_PROMPT, MAX_NEW, greedy_baseline,
                                tiny_model, tiny_prompts)
    from jspec.engine.scheduler import Engine
    from jspec.engine.state import make_engine_config

    assert len(jax.devices()) == 4, jax.devices()
    params, draft = tiny_model()
    ecfg = make_engine_config(TINY, page_size=16, topk=4, num_steps=3, num_draft_tokens=8,
                              context_len=CONTEXT_LEN, max_running_requests=1,
                              max_prompt_len=MAX_PROMPT, batch_buckets=(1,))
    lens = (3, 17, 9, 30, 5, 12)
    prompts = tiny_prompts(lens)
    arrivals = [0, 0, 1, 2, 3, 3]
    out4, st4 = Engine(ecfg, params, draft, num_devices=4).generate(prompts, MAX_NEW,
                                                                    arrivals=arrivals)
    out1, st1 = Engine(ecfg, params, draft, num_devices=1).generate(prompts, MAX_NEW,
                                                                    arrivals=arrivals)
    assert out4 == out1, (out4, out1)
    assert out4 == [list(o) for o in greedy_baseline(lens)]
    assert st4.request_accept_lens == st1.request_accept_lens
    assert st4.leak_check.startswith("ok: 4 x"), st4.leak_check
    print("MULTIDEVICE OK", st4.num_decode_steps, st1.num_decode_steps)
""")


def test_four_shards_equal_one_device():
    helpers = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT.format(helpers=helpers)], env=env,
                          check=False,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MULTIDEVICE OK" in proc.stdout
