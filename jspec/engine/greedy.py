"""Plain greedy decoding of the target alone over the paged KV pool (the lossless baseline).

One decode step for a padded bucket of batch slots (``slot_idx: i32[Bb]``, ``live: bool[Bb]``)::

    L = committed_len, x = bonus token (last generated, no KV yet)
    slot = alloc_decode(seq_lens = L + 1, last_loc = row[L-1])     # new page iff (L+1) % P == 1
    row[L] = slot                                                  # assign_req_to_token_pool
    target forward on x at position L: K/V -> slot, attention over row[0..L]
    x' = argmax(logits); L' = L + 1

Given a ``sampling`` batch, ``x'`` is sampled instead (``jspec.engine.sampling``). Padding
entries allocate nothing, read the padding row 0 and write slot 0. The step is a no-op
(``ok`` False) when the pages are short or a live entry names a slot out of range, twice or not
live (``jspec.engine.guards``): every entry then becomes padding (no ``lax.cond``, so the donated
pool is updated in place rather than copied for a skip branch).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jspec._pytree import replace
from jspec.attention_meta.metadata import AttentionMetadata, row_page_table
from jspec.config import ceil_div
from jspec.engine import guards
from jspec.engine.attention import AttnPlan
from jspec.engine.model_calls import run_target, target_logits
from jspec.engine.sampling import SamplingBatch, sample_plain
from jspec.engine.state import (
    EngineConfig,
    EngineState,
    check_engine_models,
    gather_slots,
    pack_valid,
    scatter_slots,
)
from jspec.engine.step_types import GreedyStepOutput
from jspec.kv.allocator import alloc_decode
from jspec.kv.req_to_token import assign_req_to_token_pool, get_last_loc


def greedy_step_body(
    ecfg: EngineConfig,
    target: Any,
    params: Any,
    draft: Any,
    draft_params: Any,
    state: EngineState,
    slot_idx: jax.Array,
    live: jax.Array,
    sampling: SamplingBatch | None = None,
) -> tuple[EngineState, GreedyStepOutput]:
    """The unjitted step (what :func:`greedy_step` jits and the sharded engine maps); the draft
    arguments are ignored (the engines share one body signature)."""
    del draft, draft_params
    check_engine_models(ecfg, target)
    spec = ecfg.spec
    ok_in = guards.validate_step_slots(state, slot_idx, live, "greedy_step")
    live = live & ok_in
    seq = gather_slots(state.committed_lens, slot_idx, live)
    rpi = gather_slots(state.req_pool_indices, slot_idx, live)
    tokens = gather_slots(state.bonus_tokens, slot_idx, live)
    last_loc = get_last_loc(state.req_to_token, rpi, seq)
    allocator, slots, ok = alloc_decode(
        state.allocator, seq + 1, last_loc, valid=live, impl=ecfg.kernels.bookkeeping
    )
    ok = ok & ok_in
    live = live & ok
    seq, rpi = jnp.where(live, seq, 0), jnp.where(live, rpi, 0)
    r2t = assign_req_to_token_pool(
        state.req_to_token,
        rpi,
        seq,
        jnp.where(live, seq + 1, 0),
        pack_valid(slots, live),
        impl=ecfg.kernels.bookkeeping,
    )
    p = spec.page_size
    meta = AttentionMetadata(
        page_table=row_page_table(r2t, rpi, page_size=p, max_pages=ceil_div(spec.context_len, p)),
        kv_lens=jnp.where(live, seq + 1, 0),
        page_size=p,
    )
    plan = AttnPlan(write_slot_ids=jnp.where(live, slots, 0), passes=(meta,))
    pool, hidden, _ = run_target(ecfg, target, params, state.target_pool, tokens, seq, plan)
    logits = target_logits(target, params, hidden)
    guards.probe_target_logits(logits, live, "greedy_step")
    if sampling is None:
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
    else:  # the token after x (at L) sits at position L + 1
        nxt = sample_plain(logits, sampling, seq + 1, tp_axis=ecfg.tp_axis)
    nxt = jnp.where(live, nxt, 0)
    state = replace(
        state,
        allocator=allocator,
        req_to_token=r2t,
        target_pool=pool,
        committed_lens=scatter_slots(state.committed_lens, slot_idx, live, seq + 1),
        allocated_lens=scatter_slots(state.allocated_lens, slot_idx, live, seq + 1),
        bonus_tokens=scatter_slots(state.bonus_tokens, slot_idx, live, nxt),
    )
    return state, GreedyStepOutput(next_tokens=nxt, ok=ok)


@functools.partial(jax.jit, static_argnames=("ecfg", "target"), donate_argnames=("state",))
def greedy_step(
    ecfg: EngineConfig,
    target: Any,
    params: Any,
    state: EngineState,
    slot_idx: jax.Array,
    live: jax.Array,
    sampling: SamplingBatch | None = None,
) -> tuple[EngineState, GreedyStepOutput]:
    """One plain greedy (or sampled) decode step over a padded bucket of one shard.

    Args:
      ecfg: static engine config (``spec.topk`` etc. unused).
      target: static target model (``jspec.engine.protocol.TargetModel``); params: its weights.
      state: engine state (donated).
      slot_idx: i32[Bb] batch slots (padding entries: any value); live: bool[Bb].
      sampling: None (argmax) or the entries' sampling parameters
        (:class:`jspec.engine.sampling.SamplingBatch`, rows as ``slot_idx``).

    Returns:
      (state, :class:`GreedyStepOutput`).
    """
    return greedy_step_body(ecfg, target, params, None, None, state, slot_idx, live, sampling)
