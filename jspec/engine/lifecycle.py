"""Request admission (chunked prefill) and retirement (release), both jitted over a padded batch.

A prompt is prefilled in chunks (sglang ``--chunked-prefill-size``): each call takes up to
``Bp`` requests with one chunk each, padded to ``[Bp, Cq]`` (``chunk_lens == 0`` marks a padding
entry), so a call's activations are bounded by the chunk, not the prompt. Per entry::

    start = tokens of the prompt already prefilled (0: the first chunk)
    every chunk:   the KV backend's prepare_prefill backs row[start : start+len] (jspec's:
                   a first chunk takes a req_to_token row, kept in its batch slot; then
                   alloc_extend(prefix=start, seq=start+len, last_loc=row[start-1]))
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

Release hands each finished request back to the KV backend (jspec's frees its pages
``row[0:allocated_len]`` and its row) and clears its batch slot.
"""

from __future__ import annotations

from typing import Literal, overload

import jax
import jax.numpy as jnp

from jspec._jit import jit
from jspec._pytree import replace
from jspec.engine import guards
from jspec.engine.attention import AttnPlan
from jspec.engine.kv_backend import row_metadata
from jspec.engine.model_calls import draft_topk, run_draft, run_target, target_logits
from jspec.engine.runner import Runner, Weights, jit_step
from jspec.engine.sampling import SamplingBatch, next_tokens
from jspec.engine.state import EngineState, commit_carry, scatter_slots
from jspec.engine.step_types import PrefillOutput


def prefill_chunk_body(
    runner: Runner,
    weights: Weights,
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
      runner: static config, models (``draft`` None for a plain greedy engine) and KV backend.
      weights: ``Weights(target_params, draft_params)``.
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
    bp, cq = token_ids.shape
    ok_in = guards.validate_prefill(
        runner.kv.slot_status(state.kv),
        slot_idx,
        token_ids,
        chunk_lens,
        vocab_size=runner.target.vocab_size,
        starts=starts,
        max_start=runner.max_prefix_len,
    )
    valid = (chunk_lens > 0) & ok_in
    lens = jnp.where(valid, chunk_lens, 0).astype(jnp.int32)
    starts = jnp.where(valid, starts, 0).astype(jnp.int32)
    kv, view, ok = runner.kv.prepare_prefill(
        state.kv, slot_idx, starts, starts + lens, valid, chunk_width=cq
    )
    ok = ok & ok_in
    # Failed call: every entry is padding (row 0, nothing written but the padding page).
    valid = view.valid
    is_last = valid & is_last
    starts, lens = view.seq_lens, jnp.where(valid, lens, 0)
    ends = starts + lens
    col = jnp.arange(cq, dtype=jnp.int32)
    tok_valid = col[None, :] < lens[:, None]  # [Bp, Cq]
    pos = starts[:, None] + col[None, :]
    write = jnp.where(tok_valid, view.slot_ids(pos), 0)
    meta = row_metadata(
        runner.ecfg.spec, view, ends, q_lens=lens, causal=True, max_prefix_len=runner.max_prefix_len
    )
    plan = AttnPlan(write_slot_ids=write.reshape(-1), passes=(meta,))
    positions = jnp.where(tok_valid, pos, 0).reshape(-1)
    tpool, hidden, feature = run_target(
        runner, weights, kv.target_pool, token_ids.reshape(-1), positions, plan
    )
    last = jnp.clip(lens - 1, 0, cq - 1)
    hidden_last = hidden.reshape(bp, cq, -1)[jnp.arange(bp), last]
    logits = target_logits(runner, weights, hidden_last)
    guards.probe_target_logits(logits, is_last, "prefill")
    # the first new token sits at position prompt_len (= ends on the last chunk)
    first = next_tokens(logits, sampling, ends, tp_axis=runner.ecfg.tp_axis)
    first = jnp.where(is_last, first, 0)
    kv = runner.kv.commit(replace(kv, target_pool=tpool), slot_idx, valid, ends, is_last)
    carry = state.carry
    if runner.draft is None:
        carry = replace(
            carry, bonus_tokens=scatter_slots(carry.bonus_tokens, slot_idx, is_last, first)
        )
        return EngineState(kv=kv, carry=carry), PrefillOutput(first_tokens=first, ok=ok)
    # EAGLE: draft position p consumes (embed(x[p+1]), target_feature[p]).
    shifted = jnp.concatenate([token_ids[:, 1:], jnp.zeros((bp, 1), jnp.int32)], 1)
    shifted = shifted.at[jnp.arange(bp), last].set(jnp.where(is_last, first, next_ids))
    dpool, dhidden = run_draft(
        runner, weights, kv.draft_pool, shifted.reshape(-1), feature, positions, plan
    )
    dlast = dhidden.reshape(bp, cq, -1)[jnp.arange(bp), last]
    topk_p, topk_index = draft_topk(runner, weights, dlast)
    carry = commit_carry(carry, slot_idx, is_last, first, topk_p, topk_index, dlast)
    kv = replace(kv, draft_pool=dpool)
    return EngineState(kv=kv, carry=carry), PrefillOutput(first_tokens=first, ok=ok)


# The public call: the body jitted (runner static, state donated); the engines map the body.
prefill_chunk = jit_step(prefill_chunk_body)


def prefill_body(
    runner: Runner,
    weights: Weights,
    state: EngineState,
    slot_idx: jax.Array,
    prompt_ids: jax.Array,
    prompt_lens: jax.Array,
    sampling: SamplingBatch | None = None,
) -> tuple[EngineState, PrefillOutput]:
    """Admit up to ``Bp`` whole prompts into free batch slots of one shard (one chunk each:
    :func:`prefill_chunk` with ``start = 0``; that for longer prompts).

    Args:
      runner, weights, state (donated), sampling: as :func:`prefill_chunk`.
      slot_idx: i32[Bp] batch slot per prompt (any value for padding entries).
      prompt_ids: i32[Bp, Lp] token ids in [0, target.vocab_size) (padding: any valid id).
      prompt_lens: i32[Bp]; 0 marks a padding entry.

    Returns:
      (state, :class:`PrefillOutput`).
    """
    zeros = jnp.zeros(prompt_lens.shape, jnp.int32)
    return prefill_chunk_body(
        runner, weights, state, slot_idx, prompt_ids, prompt_lens, zeros, prompt_lens > 0,
        zeros, sampling,
    )  # fmt: skip


prefill = jit_step(prefill_body)


def release_body(
    runner: Runner,
    weights: Weights | None,
    state: EngineState,
    slot_idx: jax.Array,
    finished: jax.Array,
) -> tuple[EngineState, jax.Array]:
    """The unjitted release (the engines' shared body signature; the weights are unused).

    A finished entry's slot may be live or prefilling (between chunks, e.g. a preempted
    request). Returns ``(state, ok: bool[])``; all or nothing (``ok`` False: state unchanged)."""
    del weights
    ok_in = guards.validate_step_slots(
        runner.kv.slot_status(state.kv), slot_idx, finished, "release", "finished", want="held"
    )
    kv, ok = runner.kv.release(state.kv, slot_idx, finished & ok_in)
    return replace(state, kv=kv), ok & ok_in


@jit(static_argnames=("runner",), donate_argnames=("state",))
def _release(
    runner: Runner, state: EngineState, slot_idx: jax.Array, finished: jax.Array
) -> tuple[EngineState, jax.Array]:
    return release_body(runner, None, state, slot_idx, finished)


# NOTE: overloads on the static return_ok give a caller's type checker the exact return type.
@overload
def release(
    runner: Runner,
    state: EngineState,
    slot_idx: jax.Array,
    finished: jax.Array,
    *,
    return_ok: Literal[False] = False,
) -> EngineState: ...


@overload
def release(
    runner: Runner,
    state: EngineState,
    slot_idx: jax.Array,
    finished: jax.Array,
    *,
    return_ok: Literal[True],
) -> tuple[EngineState, jax.Array]: ...


def release(
    runner: Runner,
    state: EngineState,
    slot_idx: jax.Array,
    finished: jax.Array,
    *,
    return_ok: bool = False,
) -> EngineState | tuple[EngineState, jax.Array]:
    """Free the memory of the finished requests and clear their batch slots.

    All or nothing: if a finished entry names a slot out of range, twice or holding no request
    (``jspec.engine.guards``), or its memory is not the KV backend's to take back, nothing is
    released (``ok`` False, the state unchanged; a probe names it when on).

    Args:
      runner: static (only its KV backend is used).
      slot_idx: i32[Bb] batch slots; finished: bool[Bb] which of them to release.
      return_ok: static; also return the ``ok`` flag.

    Returns:
      The state, or ``(state, ok: bool[])`` with ``return_ok``.
    """
    state, ok = _release(runner, state, slot_idx, finished)
    return (state, ok) if return_ok else state
