"""The guarantee: greedy speculative decoding emits exactly the target's plain greedy tokens.

For page_size in {1, 16, 64}, topk in {1, 4, 8}, num_steps 1..5, with a batch mix of prompt
lengths straddling page boundaries and staggered arrivals (continuous batching). CI runs a
representative subset; the full grid is ``-m slow``. f32 throughout (see engine_helpers).
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from engine_helpers import (
    ARRIVALS,
    CONTEXT_LEN,
    DRAFT,
    MAX_NEW,
    MAX_PROMPT,
    TARGET,
    TINY,
    greedy_baseline,
    tiny_model,
    tiny_prompts,
)

from jspec.engine.scheduler import Engine
from jspec.engine.state import make_engine_config


def _num_draft_tokens(topk: int, steps: int) -> int:
    # Full chain for topk 1; a pruned tree (N-1 < K + (S-1)K^2) otherwise.
    return min(topk * steps + 1, 16)


def _run(
    page_size,
    topk,
    steps,
    num_draft_tokens,
    *,
    draft_attention="cascade",
    max_running=4,
    check_every_step=False,
    impl="auto",
    attention_impl="auto",
):
    params, draft = tiny_model()
    ecfg = make_engine_config(
        TINY,
        page_size=page_size,
        topk=topk,
        num_steps=steps,
        num_draft_tokens=num_draft_tokens,
        context_len=CONTEXT_LEN,
        max_running_requests=max_running,
        max_prompt_len=MAX_PROMPT,
        batch_buckets=(max_running,),
        draft_attention=draft_attention,
        impl=impl,
        attention_impl=attention_impl,
    )
    engine = Engine(ecfg, TARGET, params, DRAFT, draft, check_every_step=check_every_step)
    out, stats = engine.generate(tiny_prompts(), MAX_NEW, arrivals=ARRIVALS)
    return out, stats


def _check(out, stats, steps):
    assert out == [list(o) for o in greedy_baseline()]
    assert stats.leak_check.startswith("ok")
    assert all(1 <= a <= steps + 1 for a in stats.accept_lens)


CI_GRID = [
    pytest.param(1, 1, 1, 2, id="p1-k1-s1"),
    pytest.param(1, 4, 2, 6, id="p1-k4-s2"),
    pytest.param(16, 4, 3, 8, id="p16-k4-s3-demo"),
    pytest.param(16, 1, 4, 5, id="p16-k1-s4"),
    pytest.param(64, 8, 5, 16, id="p64-k8-s5"),
]


@pytest.mark.parametrize("page_size,topk,steps,num_draft_tokens", CI_GRID)
def test_lossless_ci_grid(page_size, topk, steps, num_draft_tokens):
    out, stats = _run(page_size, topk, steps, num_draft_tokens, check_every_step=(page_size == 16))
    _check(out, stats, steps)
    if steps > 1:
        # The tiny draft is good but not perfect: both multi-token accepts and rejections.
        counts = np.bincount(stats.accept_lens, minlength=steps + 2)
        assert counts[1] > 0 and counts[2:].sum() > 0, counts


def test_lossless_kv_indices_draft_attention_matches_cascade():
    """FlashInfer-style kv_indices and FA3 cascade read the same keys: same drafts."""
    out, stats = _run(16, 4, 3, 8, draft_attention="kv_indices")
    _check(out, stats, 3)
    _, cascade = _run(16, 4, 3, 8)
    assert stats.request_accept_lens == cascade.request_accept_lens


@pytest.mark.parametrize("draft_attention", ["cascade", "kv_indices"])
def test_lossless_with_the_kernels(draft_attention, monkeypatch):
    """impl="pallas": every bookkeeping op of the step through its Pallas kernel (interpret mode
    on CPU, compiled on GPU) gives the same tokens and the same accept lengths as the refs.
    The accepted-KV move into the target pool (``jspec.tree.accept``) takes the policy's impl
    too: it once ran XLA's gather and scatter whatever the policy said."""
    from jspec.tree import accept

    moves = []

    def recording_move(*args, **kwargs):
        moves.append(kwargs.get("impl"))
        return move_kv_cache(*args, **kwargs)

    move_kv_cache = accept.move_kv_cache
    monkeypatch.setattr(accept, "move_kv_cache", recording_move)
    jax.clear_caches()  # an earlier test's engine of the same config: its steps traced again
    out, stats = _run(16, 4, 3, 8, draft_attention=draft_attention, impl="pallas")
    _check(out, stats, 3)
    assert moves and set(moves) == {"pallas"}, moves
    moves.clear()
    _, ref = _run(16, 4, 3, 8, draft_attention=draft_attention, impl="xla")
    assert stats.request_accept_lens == ref.request_accept_lens
    assert moves and set(moves) == {"xla"}, moves


@pytest.mark.gpu
def test_lossless_with_the_attention_kernel():
    """attention_impl="triton" (GPU): every attention pass of every forward (prefill chunks,
    draft passes, verify, extend) through the page-table Triton kernels (IEEE f32 dots for this
    f32 model): the greedy tokens of the baseline, and the accept lengths of the reference-
    attention spec run."""
    out, stats = _run(16, 4, 3, 8, attention_impl="triton")
    _check(out, stats, 3)
    _, ref = _run(16, 4, 3, 8, attention_impl="xla")
    assert stats.request_accept_lens == ref.request_accept_lens


FULL_GRID = [
    pytest.param(p, k, s, _num_draft_tokens(k, s), id=f"p{p}-k{k}-s{s}")
    for p, k, s in itertools.product((1, 16, 64), (1, 4, 8), range(1, 6))
]


@pytest.mark.slow
@pytest.mark.parametrize("page_size,topk,steps,num_draft_tokens", FULL_GRID)
def test_lossless_full_grid(page_size, topk, steps, num_draft_tokens, request):
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("full grid: run with -m slow")
    out, stats = _run(page_size, topk, steps, num_draft_tokens)
    _check(out, stats, steps)
