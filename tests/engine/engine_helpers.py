"""Shared fixtures for the engine tests: one tiny f32 model, prompts, and a cached baseline.

The model is the toy: a :class:`jspec.models.LlamaTarget` with :func:`toy_llama_params` and
its :func:`toy_eagle1` head.

The tiny target (vocab 64, hidden 32, 2 layers, GQA 4/2 heads) has ``residual_scale=1.5`` and
its draft ``hidden_mix=1.0``: the draft is right often enough that multi-token accepts happen
(exercising the accepted-KV move and compaction) and wrong often enough that rejections at
every depth happen too. Everything is f32 (bf16 can flip a near-tied argmax between verify and
plain decode, which are different computations of the same logits).
"""

from __future__ import annotations

import functools

import numpy as np

from jspec.models import Eagle1Draft, LlamaConfig, LlamaTarget, toy_eagle1, toy_llama_params

TINY = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)
TARGET, DRAFT = LlamaTarget(TINY), Eagle1Draft(TINY)  # DRAFT: the model toy_eagle1 returns
# Prompt lengths straddle page boundaries of 16 and stay under one page of 64.
PROMPT_LENS = (3, 17, 9, 30)
ARRIVALS = (0, 0, 2, 4)
MAX_NEW = 10
CONTEXT_LEN = 64
MAX_PROMPT = 32


@functools.cache
def tiny_model():
    params = toy_llama_params(TARGET, 0, residual_scale=1.5)
    _, draft = toy_eagle1(TARGET, params, 1, hidden_mix=1.0)
    return params, draft


def tiny_prompts(lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY.vocab_size, n).tolist() for n in lens]


@functools.cache
def greedy_baseline(lens=PROMPT_LENS, max_new: int = MAX_NEW) -> tuple[tuple[int, ...], ...]:
    """Plain greedy tokens of the paged greedy engine (P=1), validated against the dense oracle
    in test_engine_greedy.py."""
    from jspec.engine.scheduler import Engine
    from jspec.engine.state import make_engine_config

    params, _ = tiny_model()
    ecfg = make_engine_config(
        TINY,
        page_size=1,
        topk=1,
        num_steps=1,
        num_draft_tokens=2,
        context_len=CONTEXT_LEN,
        max_running_requests=4,
        max_prompt_len=MAX_PROMPT,
        batch_buckets=(4,),
    )
    out, _ = Engine(ecfg, TARGET, params).generate(tiny_prompts(lens), max_new)
    return tuple(tuple(o) for o in out)


def tiny_engine(ecfg, spec: bool = True, **kwargs):
    """An Engine over the tiny toy target (and its EAGLE-1 head when ``spec``)."""
    from jspec.engine.scheduler import Engine

    params, draft = tiny_model()
    if spec:
        return Engine(ecfg, TARGET, params, DRAFT, draft, **kwargs)
    return Engine(ecfg, TARGET, params, **kwargs)


def snapshot(state):
    """A host copy of an engine state (the steps donate theirs)."""
    import jax

    return jax.tree.map(np.array, state)


def assert_same_state(before, after, page_size: int, *, float_tol=None) -> None:
    """Bit-identical but for the pools' padding page (slots ``0..P-1``, the write sink of padding
    entries). ``float_tol=(rtol, atol)``: float leaves to that tolerance instead (two programs
    compiled apart), integers and masks still exactly."""
    import jax

    def same(path, b, a):
        name = jax.tree_util.keystr(path)
        a, b = np.asarray(a), np.asarray(b)
        if name.startswith((".kv.target_pool", ".kv.draft_pool")):
            b, a = b[:, page_size:], a[:, page_size:]
        if float_tol is not None and np.issubdtype(a.dtype, np.floating):
            rtol, atol = float_tol
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)

    jax.tree_util.tree_map_with_path(same, before, after)


def check_engine_state(ecfg, state, what: str = "") -> None:
    """``jspec.kv.integrity`` on one shard's state: pages (no leak, no page both owned and free)
    and request rows (free + live == all), against the live slots."""
    from jspec.kv.integrity import check_integrity, check_req_rows_integrity, owned_page_mask

    spec, kv = ecfg.spec, state.kv
    live = np.asarray(kv.live)
    owned = owned_page_mask(
        kv.req_to_token,
        kv.req_pool_indices,
        kv.allocated_lens,
        num_pages=spec.num_pages,
        page_size=spec.page_size,
        valid=kv.live,
    )
    check_integrity(kv.allocator, owned, what=what)
    check_req_rows_integrity(kv.req_rows, np.asarray(kv.req_pool_indices)[live], what=what)
