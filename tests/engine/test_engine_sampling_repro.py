"""Sampled tokens are a function of (prompt, parameters, seed) only.

One sampled request gives the same tokens alone, in a full batch beside greedy and other
sampled requests, on another batch slot (arriving later), in another bucket, in a second run,
and on 1 x 1 / 4 x 1 / 2 x 2 / 1 x 4 (data x tensor parallel) CPU layouts; greedy requests in
a sampled batch keep the greedy engine's tokens; a greedy-only batch never compiles the
sampled step. The toy Llama (f32) is used: its logits depend on the whole context, so the
accepted-KV bookkeeping of sampled paths is exercised too.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
from engine_helpers import (
    CONTEXT_LEN,
    MAX_NEW,
    MAX_PROMPT,
    TINY,
    greedy_baseline,
    tiny_engine,
    tiny_prompts,
)

from jspec.engine import SamplingParams, make_engine_config
from jspec.engine.inputs import InputError

SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, top_k=20, seed=1234)
OTHERS = [
    SamplingParams(temperature=1.2, min_p=0.02, seed=7),
    None,  # greedy
    SamplingParams(temperature=0.6, seed=99),
]


def _ecfg(spec_buckets=(1, 4)):
    return make_engine_config(
        TINY,
        page_size=16,
        topk=4,
        num_steps=3,
        num_draft_tokens=8,
        context_len=CONTEXT_LEN,
        max_running_requests=4,
        max_prompt_len=MAX_PROMPT,
        batch_buckets=spec_buckets,
    )


@pytest.mark.parametrize("spec", [True, False], ids=["spec", "plain"])
def test_one_request_same_tokens_alone_batched_other_slot(spec):
    prompts = tiny_prompts()  # lens 3, 17, 9, 30
    engine = tiny_engine(_ecfg(), spec=spec)
    alone, stats = engine.generate([prompts[2]], MAX_NEW, sampling=[SAMPLED])
    assert stats.sampling == [SAMPLED]
    # Full batch: the request is entry 2 (slot 2), beside greedy and other sampled requests.
    batch = [OTHERS[0], OTHERS[1], SAMPLED, OTHERS[2]]
    full, _ = engine.generate(prompts, MAX_NEW, sampling=batch)
    # Another slot: it arrives after the others are admitted (slot 0 is taken by then).
    late, _ = engine.generate(prompts, MAX_NEW, sampling=batch, arrivals=[0, 1, 3, 0])
    again, _ = engine.generate([prompts[2]], MAX_NEW, sampling=[SAMPLED])
    assert full[2] == alone[0] == late[2] == again[0], (alone, full[2], late[2])
    assert full == late  # every request, wherever it ran
    # The greedy request in the sampled batch is the greedy engine's.
    assert full[1] == list(greedy_baseline()[1])
    assert alone[0] != list(greedy_baseline()[2])  # it really sampled


def test_greedy_only_batches_skip_the_sampled_step():
    """No request samples: no SamplingBatch is built, the compiled step is today's."""
    engine = tiny_engine(_ecfg((4,)))
    out, _ = engine.generate(tiny_prompts(), MAX_NEW, sampling=[None, SamplingParams()] * 2)
    assert out == [list(o) for o in greedy_baseline()]
    # One trace per jitted call (prefill, step, release): the sampled variants never traced.
    assert {key[0].__name__ for key in engine._fns} >= {"prefill_chunk_body", "release_body"}
    assert all(fn._cache_size() == 1 for fn in engine._fns.values())


def test_bad_sampling_fails_before_compiling():
    engine = tiny_engine(_ecfg((4,)))
    with pytest.raises(InputError, match="sampling has 1 entries for 4 requests"):
        engine.generate(tiny_prompts(), MAX_NEW, sampling=[SAMPLED])
    with pytest.raises(InputError, match=r"sampling\[1\]"):
        engine.generate(tiny_prompts()[:2], MAX_NEW, sampling=[SAMPLED, {"temperature": 1}])
    assert not engine._fns  # nothing compiled


def test_unseeded_requests_draw_and_report_a_seed():
    # SAMPLED's config and filters without its seed: the steps compiled for its lone run above
    # (the property is the seed's, not the filters')
    engine = tiny_engine(_ecfg())
    params = dataclasses.replace(SAMPLED, seed=None)
    out, stats = engine.generate([tiny_prompts()[0]], 4, sampling=params)
    seed = stats.sampling[0].seed
    assert seed is not None and 0 <= seed < 2**63
    replay, _ = engine.generate([tiny_prompts()[0]], 4, sampling=stats.sampling)
    assert replay == out


_LAYOUT_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import json, sys
    sys.path.insert(0, {helpers!r})
    import jax
    from engine_helpers import CONTEXT_LEN, MAX_PROMPT, MAX_NEW, tiny_prompts
    from jspec.engine import Engine, SamplingParams, make_engine_config
    from jspec.models import LlamaConfig, LlamaTarget, toy_eagle1, toy_llama_params

    assert len(jax.devices()) == 4, jax.devices()
    wide = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=8, num_kv_heads=4, head_dim=8)
    target = LlamaTarget(wide)
    params = toy_llama_params(target, 0, residual_scale=1.5)
    draft_model, draft = toy_eagle1(target, params, 1, hidden_mix=1.0)
    lens = (3, 17, 9, 30, 5, 12)
    prompts = tiny_prompts(lens)
    arrivals = [0, 0, 1, 2, 3, 3]
    # One filter set (top-p) for every sampled request: one sampled compile per layout (mixed
    # filter sets are covered on one device above; here the layouts are the point).
    sampling = [SamplingParams(temperature=0.9, top_p=0.95, seed=11), None,
                SamplingParams(temperature=1.3, top_p=0.9, seed=12),
                SamplingParams(temperature=0.7, top_p=0.8, seed=13), None,
                SamplingParams(temperature=1.0, top_p=0.99, seed=14)]
    outs = {{}}
    for dp, tp in [(1, 1), (2, 2), (1, 4)]:
        ecfg = make_engine_config(target, page_size=16, topk=4, num_steps=3, num_draft_tokens=8,
                                  context_len=CONTEXT_LEN, max_running_requests=2,
                                  max_prompt_len=MAX_PROMPT, batch_buckets=(2,),
                                  tensor_parallel=tp)
        out, stats = Engine(ecfg, target, params, draft_model, draft, num_devices=dp).generate(
            prompts, MAX_NEW, arrivals=arrivals, sampling=sampling)
        assert stats.leak_check.startswith("ok"), stats.leak_check
        outs[f"{{dp}}x{{tp}}"] = out
    print("LAYOUTS" + json.dumps(outs))
""")


def test_same_tokens_on_every_device_layout():
    """1x1, 2x2, 1x4 (data x tensor parallel, 4 CPU devices): identical tokens per
    request, sampled and greedy mixed (tp > 1 takes the sampled outputs of tp rank 0)."""
    import json

    helpers = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-c", _LAYOUT_SCRIPT.format(helpers=helpers)],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("LAYOUTS"))
    outs = json.loads(line[len("LAYOUTS") :])
    ref = outs.pop("1x1")
    for layout, out in outs.items():
        assert out == ref, (layout, out, ref)
