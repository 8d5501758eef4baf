"""Request admission (prefill) and retirement (release), both jitted over a padded batch.

Prefill of up to ``prefill_batch`` prompts (padded to ``max_prompt_len``; ``prompt_len == 0``
marks a padding entry):

1. ``alloc_req_rows`` gives each prompt a req_to_token row;
2. ``alloc_extend(prefix=0, seq=prompt_len, last_loc=-1)`` gives its slots, written into
   ``row[0:prompt_len]`` by ``assign_req_to_token_pool``;
3. the target runs the prompt (KV into the target pool at those slots, causal attention read
   back through the row) and emits the first token ``x[n]`` (greedy, or sampled given a
   ``sampling`` batch: ``jspec.engine.sampling``);
4. with a draft: the draft runs positions ``0..n-1`` on the shifted ids ``x[1..n]`` and the
   target's feature (EAGLE-1: the final hidden; EAGLE-3: the aux of ``draft.capture_layers``),
   writing the draft pool at the same slots; its last row gives the first tree level
   ``topk_p/topk_index`` (target ids) and ``draft_hidden``.

If the rows or pages are short, nothing changes and ``ok`` is False (the scheduler retries the
prompt after other requests finish).

Release frees each finished request's pages ``row[0:allocated_len]`` (page-aligned segment,
sglang ``free_segment``: jspec has no prefix cache, so the committed part is freed too) and its
row, and clears its batch slot.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jspec._pytree import replace
from jspec.config import ceil_to_multiple
from jspec.engine.attention import AttnPass, AttnPlan, causal_mask, row_slot_ids
from jspec.engine.model_calls import draft_topk, run_draft, run_target, target_logits
from jspec.engine.sampling import SamplingBatch, sample_plain
from jspec.engine.state import (
    EngineConfig,
    EngineState,
    check_engine_models,
    gather_req_kv_state,
    gather_slots,
    scatter_slots,
)
from jspec.engine.step_types import PrefillOutput
from jspec.kv.allocator import alloc_extend
from jspec.kv.decode_alloc import release_kv_cache
from jspec.kv.req_to_token import alloc_req_rows, assign_req_to_token_pool, free_req_rows


def prefill_body(
    ecfg: EngineConfig,
    target: Any,
    params: Any,
    draft: Any,
    draft_params: Any,
    state: EngineState,
    slot_idx: jax.Array,
    prompt_ids: jax.Array,
    prompt_lens: jax.Array,
    sampling: SamplingBatch | None = None,
) -> tuple[EngineState, PrefillOutput]:
    """The unjitted prefill (what :func:`prefill` jits and the sharded engine maps)."""
    check_engine_models(ecfg, target, draft)
    spec = ecfg.spec
    bp, lp = prompt_ids.shape
    valid = prompt_lens > 0
    lens = jnp.where(valid, prompt_lens, 0).astype(jnp.int32)
    zeros = jnp.zeros((bp,), jnp.int32)
    req_rows, rows, ok_rows = alloc_req_rows(
        state.req_rows, jnp.sum(valid.astype(jnp.int32)), max_rows=bp
    )
    rank = jnp.clip(jnp.cumsum(valid.astype(jnp.int32)) - 1, 0, bp - 1)
    rpi = jnp.where(valid, rows[rank], 0)
    allocator, slots, ok_alloc = alloc_extend(
        state.allocator,
        zeros,
        lens,
        jnp.full((bp,), -1, jnp.int32),
        max_new_slots=bp * ceil_to_multiple(lp, spec.page_size),
        impl=ecfg.kernel_impl,
    )
    ok = ok_rows & ok_alloc

    def run(state: EngineState):
        r2t = assign_req_to_token_pool(
            state.req_to_token, rpi, zeros, lens, slots, impl=ecfg.kernel_impl
        )
        pos = jnp.arange(lp, dtype=jnp.int32)
        tok_valid = pos[None, :] < lens[:, None]
        row = row_slot_ids(r2t, rpi, lp)  # i32[Bp, Lp]
        plan = AttnPlan(
            write_slot_ids=jnp.where(tok_valid, row, 0).reshape(-1),
            passes=(AttnPass(row, causal_mask(zeros, lp, lp, lengths=lens)),),
        )
        positions = jnp.tile(pos, bp)
        tpool, hidden, feature = run_target(
            ecfg, target, params, state.target_pool, prompt_ids.reshape(-1), positions, plan, draft
        )
        hidden = hidden.reshape(bp, lp, -1)
        last = jnp.clip(lens - 1, 0, lp - 1)
        logits = target_logits(target, params, hidden[jnp.arange(bp), last])
        if sampling is None:
            first = jnp.argmax(logits, -1).astype(jnp.int32)
        else:  # the first new token sits at position prompt_len
            first = sample_plain(logits, sampling, lens, tp_axis=ecfg.tp_axis)
        new = replace(
            state,
            allocator=allocator,
            req_rows=req_rows,
            req_to_token=r2t,
            target_pool=tpool,
            committed_lens=scatter_slots(state.committed_lens, slot_idx, valid, lens),
            allocated_lens=scatter_slots(state.allocated_lens, slot_idx, valid, lens),
            req_pool_indices=scatter_slots(state.req_pool_indices, slot_idx, valid, rpi),
            live=scatter_slots(state.live, slot_idx, valid, valid),
            bonus_tokens=scatter_slots(state.bonus_tokens, slot_idx, valid, first),
        )
        if draft is None:
            return new, first
        # EAGLE: draft position p consumes (embed(x[p+1]), target_hidden[p]).
        shifted = jnp.concatenate([prompt_ids[:, 1:], jnp.zeros((bp, 1), jnp.int32)], 1)
        shifted = shifted.at[jnp.arange(bp), last].set(first)
        dpool, dhidden = run_draft(
            ecfg,
            draft,
            draft_params,
            params,
            state.draft_pool,
            shifted.reshape(-1),
            feature,
            positions,
            plan,
        )
        dlast = dhidden.reshape(bp, lp, -1)[jnp.arange(bp), last]
        topk_p, topk_index = draft_topk(ecfg, draft, draft_params, params, dlast)
        new = replace(
            new,
            draft_pool=dpool,
            topk_p=scatter_slots(new.topk_p, slot_idx, valid, topk_p),
            topk_index=scatter_slots(new.topk_index, slot_idx, valid, topk_index),
            draft_hidden=scatter_slots(new.draft_hidden, slot_idx, valid, dlast),
        )
        return new, first

    def skip(state: EngineState):
        return state, jnp.zeros((bp,), jnp.int32)

    state, first = jax.lax.cond(ok, run, skip, state)
    return state, PrefillOutput(first_tokens=first, ok=ok)


@functools.partial(jax.jit, static_argnames=("ecfg", "target", "draft"), donate_argnames=("state",))
def prefill(
    ecfg: EngineConfig,
    target: Any,
    params: Any,
    draft: Any,
    draft_params: Any,
    state: EngineState,
    slot_idx: jax.Array,
    prompt_ids: jax.Array,
    prompt_lens: jax.Array,
    sampling: SamplingBatch | None = None,
) -> tuple[EngineState, PrefillOutput]:
    """Admit up to ``Bp`` prompts into free batch slots of one shard.

    Args:
      ecfg: static engine config.
      target, draft: static models (``jspec.engine.protocol``; ``draft`` None for a plain
        greedy engine); params, draft_params: their weights (draft_params None without draft).
      state: engine state (donated), from ``init_engine_state(ecfg, draft)``.
      slot_idx: i32[Bp] batch slot per prompt (any value for padding entries).
      prompt_ids: i32[Bp, max_prompt_len] token ids in [0, target.vocab_size) (padding: any
        valid id).
      prompt_lens: i32[Bp]; 0 marks a padding entry.
      sampling: None (the first token is the argmax) or the prompts' sampling parameters
        (:class:`jspec.engine.sampling.SamplingBatch`, rows as ``slot_idx``).

    Returns:
      (state, :class:`PrefillOutput`).
    """
    return prefill_body(
        ecfg,
        target,
        params,
        draft,
        draft_params,
        state,
        slot_idx,
        prompt_ids,
        prompt_lens,
        sampling,
    )


def release_body(
    ecfg: EngineConfig,
    target: Any,
    params: Any,
    draft: Any,
    draft_params: Any,
    state: EngineState,
    slot_idx: jax.Array,
    finished: jax.Array,
) -> tuple[EngineState, tuple]:
    """The unjitted release (the engines' shared body signature; the models are unused)."""
    del target, params, draft, draft_params
    rpi = gather_slots(state.req_pool_indices, slot_idx, finished)
    reqs = gather_req_kv_state(state, slot_idx, finished)
    allocator, _ = release_kv_cache(state.allocator, state.req_to_token, reqs, finished)
    req_rows = free_req_rows(state.req_rows, rpi, valid=finished)
    zero = jnp.zeros(slot_idx.shape, jnp.int32)
    return replace(
        state,
        allocator=allocator,
        req_rows=req_rows,
        committed_lens=scatter_slots(state.committed_lens, slot_idx, finished, zero),
        allocated_lens=scatter_slots(state.allocated_lens, slot_idx, finished, zero),
        req_pool_indices=scatter_slots(state.req_pool_indices, slot_idx, finished, zero),
        live=scatter_slots(state.live, slot_idx, finished, jnp.zeros(slot_idx.shape, bool)),
    ), ()


@functools.partial(jax.jit, static_argnames=("ecfg",), donate_argnames=("state",))
def release(
    ecfg: EngineConfig, state: EngineState, slot_idx: jax.Array, finished: jax.Array
) -> EngineState:
    """Free the pages and rows of the finished requests and clear their batch slots.

    Args:
      slot_idx: i32[Bb] batch slots; finished: bool[Bb] which of them to release.
    """
    return release_body(ecfg, None, None, None, None, state, slot_idx, finished)[0]
