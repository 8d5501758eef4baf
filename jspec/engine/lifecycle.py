"""Request admission (chunked prefill) and retirement (release), both jitted over a padded batch.

A prompt is prefilled in chunks (sglang ``--chunked-prefill-size``): each call takes up to
``Bp`` requests with one chunk each, padded to ``[Bp, Cq]`` (``chunk_lens == 0`` marks a padding
entry), so a call's activations are bounded by the chunk, not the prompt. Per entry::

    start = tokens of the prompt already prefilled (0: the first chunk)
    first chunk:   alloc_req_rows gives the request a req_to_token row (kept in its batch slot)
    every chunk:   alloc_extend(prefix=start, seq=start+len, last_loc=row[start-1]) gives the
                   chunk's slots, written into row[start : start+len]
                   the target runs the chunk at positions start.. (K/V into the target pool,
                   causal attention over the row's pages: kv_lens = start+len, q_lens = len)
                   with a draft: the draft runs the same positions on the shifted ids
                   x[p+1] (``next_ids`` for the chunk's last position, the first generated
                   token for the prompt's) and the target's feature, into the draft pool
    last chunk:    the first token x[n] (greedy argmax, or sampled given a ``sampling``
                   batch: ``jspec.engine.sampling``) becomes the slot's bonus token, the
                   draft's last row its first tree level; the slot goes live (decodable)

Between chunks the slot holds the request (row, ``committed_lens = start``) but is not live:
decode steps skip it, so long prompts interleave with running decodes.

If the rows or pages are short, an entry names a bad slot or token id (``jspec.engine.guards``),
or an entry does not continue its slot (a later chunk whose slot holds no prefilling request at
``start``), nothing changes and ``ok`` is False (the
scheduler retries after other requests finish). No ``lax.cond``: a failed call runs the forward
over padding (writes go to the padding page), so the donated pools are updated in place.

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
from jspec.attention_meta.metadata import AttentionMetadata, row_page_table
from jspec.config import ceil_div, ceil_to_multiple
from jspec.engine import guards
from jspec.engine.attention import AttnPlan
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
from jspec.kv.req_to_token import (
    alloc_req_rows,
    assign_req_to_token_pool,
    free_req_rows,
    get_last_loc,
)


def _select(ok: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda x, y: jnp.where(ok, x, y), new, old)


def prefill_chunk_body(
    ecfg: EngineConfig,
    target: Any,
    params: Any,
    draft: Any,
    draft_params: Any,
    state: EngineState,
    slot_idx: jax.Array,
    token_ids: jax.Array,
    chunk_lens: jax.Array,
    starts: jax.Array,
    is_last: jax.Array,
    next_ids: jax.Array,
    sampling: SamplingBatch | None = None,
) -> tuple[EngineState, PrefillOutput]:
    """The unjitted chunk prefill (what :func:`prefill_chunk` jits and the engine maps)."""
    check_engine_models(ecfg, target, draft)
    spec = ecfg.spec
    p = spec.page_size
    bp, cq = token_ids.shape
    ok_in = guards.validate_prefill(
        state,
        slot_idx,
        token_ids,
        chunk_lens,
        vocab_size=target.vocab_size,
        first=starts == 0,
    )
    valid = (chunk_lens > 0) & ok_in
    lens = jnp.where(valid, chunk_lens, 0).astype(jnp.int32)
    starts = jnp.where(valid, starts, 0).astype(jnp.int32)
    is_last = valid & is_last
    first_chunk = valid & (starts == 0)
    cont = valid & ~first_chunk
    # A later chunk must continue its slot: a row, not live, exactly ``start`` tokens in.
    old_rpi = gather_slots(state.req_pool_indices, slot_idx, cont)
    ok_cont = jnp.all(
        ~cont
        | (
            (old_rpi > 0)
            & ~gather_slots(state.live, slot_idx, cont)
            & (gather_slots(state.committed_lens, slot_idx, cont) == starts)
        )
    )
    req_rows, new_rows, ok_rows = alloc_req_rows(
        state.req_rows, jnp.sum(first_chunk.astype(jnp.int32)), max_rows=bp
    )
    rank = jnp.clip(jnp.cumsum(first_chunk.astype(jnp.int32)) - 1, 0, bp - 1)
    rpi = jnp.where(first_chunk, new_rows[rank], old_rpi)
    ends = starts + lens
    last_loc = get_last_loc(state.req_to_token, rpi, starts)
    allocator, slots, ok_alloc = alloc_extend(
        state.allocator,
        starts,
        ends,
        last_loc,
        max_new_slots=bp * (ceil_to_multiple(cq, p) + p),
        valid=valid,
        impl=ecfg.kernels.bookkeeping,
    )
    ok = ok_rows & ok_alloc & ok_cont & ok_in
    # Failed call: every entry is padding (row 0, nothing written but the padding page).
    valid, is_last = valid & ok, is_last & ok
    lens, starts = jnp.where(valid, lens, 0), jnp.where(valid, starts, 0)
    ends, rpi = starts + lens, jnp.where(valid, rpi, 0)
    allocator = _select(ok, allocator, state.allocator)
    req_rows = _select(ok, req_rows, state.req_rows)
    r2t = assign_req_to_token_pool(
        state.req_to_token,
        rpi,
        starts,
        ends,
        jnp.where(ok, slots, 0),
        impl=ecfg.kernels.bookkeeping,
    )
    col = jnp.arange(cq, dtype=jnp.int32)
    tok_valid = col[None, :] < lens[:, None]  # [Bp, Cq]
    pos = starts[:, None] + col[None, :]
    write = r2t[rpi[:, None], jnp.clip(pos, 0, r2t.shape[1] - 1)]
    meta = AttentionMetadata(
        page_table=row_page_table(r2t, rpi, page_size=p, max_pages=ceil_div(spec.context_len, p)),
        kv_lens=ends,
        q_lens=lens,
        page_size=p,
        causal=True,
    )
    plan = AttnPlan(write_slot_ids=jnp.where(tok_valid, write, 0).reshape(-1), passes=(meta,))
    positions = jnp.where(tok_valid, pos, 0).reshape(-1)
    tpool, hidden, feature = run_target(
        ecfg,
        target,
        params,
        state.target_pool,
        token_ids.reshape(-1),
        positions,
        plan,
        draft,
        draft_params,
    )
    last = jnp.clip(lens - 1, 0, cq - 1)
    hidden_last = hidden.reshape(bp, cq, -1)[jnp.arange(bp), last]
    logits = target_logits(target, params, hidden_last)
    guards.probe_target_logits(logits, is_last, "prefill")
    if sampling is None:
        first = jnp.argmax(logits, -1).astype(jnp.int32)
    else:  # the first new token sits at position prompt_len (= ends on the last chunk)
        first = sample_plain(logits, sampling, ends, tp_axis=ecfg.tp_axis)
    first = jnp.where(is_last, first, 0)
    new = replace(
        state,
        allocator=allocator,
        req_rows=req_rows,
        req_to_token=r2t,
        target_pool=tpool,
        committed_lens=scatter_slots(state.committed_lens, slot_idx, valid, ends),
        allocated_lens=scatter_slots(state.allocated_lens, slot_idx, valid, ends),
        req_pool_indices=scatter_slots(state.req_pool_indices, slot_idx, valid, rpi),
        live=scatter_slots(state.live, slot_idx, valid, is_last),
        bonus_tokens=scatter_slots(state.bonus_tokens, slot_idx, is_last, first),
    )
    if draft is None:
        return new, PrefillOutput(first_tokens=first, ok=ok)
    # EAGLE: draft position p consumes (embed(x[p+1]), target_feature[p]).
    shifted = jnp.concatenate([token_ids[:, 1:], jnp.zeros((bp, 1), jnp.int32)], 1)
    shifted = shifted.at[jnp.arange(bp), last].set(jnp.where(is_last, first, next_ids))
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
    dlast = dhidden.reshape(bp, cq, -1)[jnp.arange(bp), last]
    topk_p, topk_index = draft_topk(ecfg, draft, draft_params, params, dlast)
    new = replace(
        new,
        draft_pool=dpool,
        topk_p=scatter_slots(new.topk_p, slot_idx, is_last, topk_p),
        topk_index=scatter_slots(new.topk_index, slot_idx, is_last, topk_index),
        draft_hidden=scatter_slots(new.draft_hidden, slot_idx, is_last, dlast),
    )
    return new, PrefillOutput(first_tokens=first, ok=ok)


@functools.partial(jax.jit, static_argnames=("ecfg", "target", "draft"), donate_argnames=("state",))
def prefill_chunk(
    ecfg: EngineConfig,
    target: Any,
    params: Any,
    draft: Any,
    draft_params: Any,
    state: EngineState,
    slot_idx: jax.Array,
    token_ids: jax.Array,
    chunk_lens: jax.Array,
    starts: jax.Array,
    is_last: jax.Array,
    next_ids: jax.Array,
    sampling: SamplingBatch | None = None,
) -> tuple[EngineState, PrefillOutput]:
    """Prefill one chunk of up to ``Bp`` prompts into batch slots of one shard (module doc).

    Args:
      ecfg: static engine config.
      target, draft: static models (``jspec.engine.protocol``; ``draft`` None for a plain
        greedy engine); params, draft_params: their weights (draft_params None without draft).
      state: engine state (donated).
      slot_idx: i32[Bp] batch slot per entry (a free slot for a first chunk, the request's
        slot for a later one; any value for padding entries).
      token_ids: i32[Bp, Cq] the chunk's prompt ids (positions ``start ..``), padded with any
        valid id.
      chunk_lens: i32[Bp] tokens in the chunk; 0 marks a padding entry.
      starts: i32[Bp] prompt tokens prefilled by earlier chunks (0: the first chunk).
      is_last: bool[Bp] the chunk ends the prompt (emit the first token, go live).
      next_ids: i32[Bp] the prompt id after the chunk (read by the draft when not ``is_last``).
      sampling: None (the first token is the argmax) or the entries' sampling parameters
        (:class:`jspec.engine.sampling.SamplingBatch`, rows as ``slot_idx``).

    Returns:
      (state, :class:`PrefillOutput`): ``first_tokens`` for ``is_last`` entries (0 otherwise).
    """
    return prefill_chunk_body(
        ecfg,
        target,
        params,
        draft,
        draft_params,
        state,
        slot_idx,
        token_ids,
        chunk_lens,
        starts,
        is_last,
        next_ids,
        sampling,
    )


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
    """Whole prompts as one chunk each (:func:`prefill_chunk_body` with ``start = 0``)."""
    bp = prompt_ids.shape[0]
    zeros = jnp.zeros((bp,), jnp.int32)
    return prefill_chunk_body(
        ecfg,
        target,
        params,
        draft,
        draft_params,
        state,
        slot_idx,
        prompt_ids,
        prompt_lens,
        zeros,
        prompt_lens > 0,
        zeros,
        sampling,
    )


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
    """Admit up to ``Bp`` whole prompts into free batch slots of one shard (one chunk each;
    :func:`prefill_chunk` for longer prompts).

    Args:
      ecfg: static engine config.
      target, draft: static models (``jspec.engine.protocol``; ``draft`` None for a plain
        greedy engine); params, draft_params: their weights (draft_params None without draft).
      state: engine state (donated), from ``init_engine_state(ecfg, draft)``.
      slot_idx: i32[Bp] batch slot per prompt (any value for padding entries).
      prompt_ids: i32[Bp, Lp] token ids in [0, target.vocab_size) (padding: any valid id).
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
) -> tuple[EngineState, jax.Array]:
    """The unjitted release (the engines' shared body signature; the models are unused).

    A finished entry's slot may be live or prefilling (between chunks, e.g. a preempted
    request). Returns ``(state, ok: bool[])``; all or nothing (``ok`` False: state unchanged)."""
    del target, params, draft, draft_params
    ok_in = guards.validate_step_slots(
        state, slot_idx, finished, "release", "finished", want="held"
    )
    finished = finished & ok_in
    rpi = gather_slots(state.req_pool_indices, slot_idx, finished)
    reqs = gather_req_kv_state(state, slot_idx, finished)
    allocator, _, ok_kv = release_kv_cache(
        state.allocator, state.req_to_token, reqs, finished, return_ok=True
    )
    req_rows, ok_rows = free_req_rows(state.req_rows, rpi, valid=finished, return_ok=True)
    ok = ok_in & ok_kv & ok_rows
    finished = finished & ok
    zero = jnp.zeros(slot_idx.shape, jnp.int32)
    new = replace(
        state,
        allocator=_select(ok, allocator, state.allocator),
        req_rows=_select(ok, req_rows, state.req_rows),
        committed_lens=scatter_slots(state.committed_lens, slot_idx, finished, zero),
        allocated_lens=scatter_slots(state.allocated_lens, slot_idx, finished, zero),
        req_pool_indices=scatter_slots(state.req_pool_indices, slot_idx, finished, zero),
        live=scatter_slots(state.live, slot_idx, finished, jnp.zeros(slot_idx.shape, bool)),
    )
    return new, ok


@functools.partial(jax.jit, static_argnames=("ecfg", "return_ok"), donate_argnames=("state",))
def release(
    ecfg: EngineConfig,
    state: EngineState,
    slot_idx: jax.Array,
    finished: jax.Array,
    *,
    return_ok: bool = False,
) -> Any:
    """Free the pages and rows of the finished requests and clear their batch slots.

    All or nothing: if a finished entry names a slot out of range, twice or holding no request
    (``jspec.engine.guards``), or its pages / row are not the allocator's to take back, nothing
    is released (``ok`` False, the state unchanged; a probe names it when on).

    Args:
      slot_idx: i32[Bb] batch slots; finished: bool[Bb] which of them to release.
      return_ok: static; also return the ``ok`` flag.

    Returns:
      The state, or ``(state, ok: bool[])`` with ``return_ok``.
    """
    state, ok = release_body(ecfg, None, None, None, None, state, slot_idx, finished)
    return (state, ok) if return_ok else state
