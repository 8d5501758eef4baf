"""The paged greedy baseline vs the dense (no KV cache) oracle."""

from __future__ import annotations

from engine_helpers import (
    ARRIVALS,
    CONTEXT_LEN,
    MAX_NEW,
    MAX_PROMPT,
    TARGET,
    TINY,
    greedy_baseline,
    tiny_model,
    tiny_prompts,
)

from jspec.engine.reference import dense_greedy_generate
from jspec.engine.scheduler import Engine
from jspec.engine.state import make_engine_config


def _dense():
    params, _ = tiny_model()
    return [
        dense_greedy_generate(TARGET, params, p, MAX_NEW, max_len=MAX_PROMPT + MAX_NEW)
        for p in tiny_prompts()
    ]


def test_paged_greedy_p1_matches_dense_oracle():
    assert [list(o) for o in greedy_baseline()] == _dense()


def test_paged_greedy_p64_continuous_batching_matches_dense_oracle():
    params, _ = tiny_model()
    ecfg = make_engine_config(
        TINY,
        page_size=64,
        topk=1,
        num_steps=1,
        num_draft_tokens=2,
        context_len=CONTEXT_LEN,
        max_running_requests=2,
        max_prompt_len=MAX_PROMPT,
        batch_buckets=(2,),
        prefill_batch=2,
    )
    engine = Engine(ecfg, TARGET, params, check_every_step=True)
    out, stats = engine.generate(tiny_prompts(), MAX_NEW, arrivals=ARRIVALS)
    assert out == [list(o) for o in greedy_baseline()]
    assert stats.leak_check.startswith("ok")
    assert max(stats.batch_sizes) == 2 and stats.num_tokens == 4 * MAX_NEW
