"""One plain decode step of a speculative engine: the target alone emits the token, the draft
keeps up (adaptive speculation, :class:`jspec.engine.scheduler.Engine` ``adaptive=``).

When speculation does not pay (the draft's proposals are rarely accepted), the engine decodes
a request greedily instead; but the next spec step needs the draft's state to be current: its
KV for every position and its proposal for the next tree's first level. So this step is the
plain greedy step (``jspec.engine.greedy``) plus one draft forward, what the spec step's draft
extend does for one accepted token::

    L = committed_len, x = bonus token (position L, no KV yet)
    prepare_for_decode                              the spec engine's page reserve (row[L] backed)
    target at L: K/V -> row[L]; x' = argmax (or sampled at position L + 1)
    draft at L:  (embed(x'), target feature at L) -> draft K/V at row[L]; its hidden h_L
    topk_p, topk_index <- the draft's top-K over h_L (TARGET ids); draft_hidden <- h_L
    L' = L + 1, bonus' = x'

The state after it is exactly what a spec step that accepted one token would leave, so spec and
plain steps interleave freely; tokens are the target's argmax either way (lossless).
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
from jspec.engine.step_types import SpecStepOutput
from jspec.kv.decode_alloc import ReqKVState, prepare_for_decode


def plain_step_body(
    ecfg: EngineConfig,
    target: Any,
    params: Any,
    draft: Any,
    draft_params: Any,
    state: EngineState,
    slot_idx: jax.Array,
    live: jax.Array,
    sampling: SamplingBatch | None = None,
    *,
    keep_draft: bool = True,
) -> tuple[EngineState, SpecStepOutput]:
    """The unjitted plain step of a spec engine (module docstring).

    Args:
      slot_idx: i32[Bb] batch slots; live: bool[Bb] (as the spec step's).
      sampling: None (argmax) or the entries' sampling parameters.
      keep_draft: False skips the draft forward (the target alone, a greedy step's cost): the
        draft's KV, proposals and hidden of these requests go stale, so they must not
        speculate again (:class:`jspec.engine.scheduler.SpecPolicy` retires the draft).

    Returns:
      (state, :class:`SpecStepOutput` with one token per live entry: ``accept_lens`` 1).
    """
    check_engine_models(ecfg, target, draft)
    spec = ecfg.spec
    p = spec.page_size
    ok_in = guards.validate_step_slots(state, slot_idx, live, "plain_step")
    live = live & ok_in
    reqs = gather_req_kv_state(state, slot_idx, live)
    allocator, r2t, reqs, ok = prepare_for_decode(
        state.allocator, state.req_to_token, reqs, spec, impl=ecfg.kernels.bookkeeping
    )
    ok = ok & ok_in
    live = live & ok
    seq = jnp.where(live, reqs.committed_lens, 0)
    rpi = jnp.where(live, reqs.req_pool_indices, 0)
    tokens = gather_slots(state.bonus_tokens, slot_idx, live)
    slot = jnp.where(live, r2t[rpi, jnp.clip(seq, 0, r2t.shape[1] - 1)], 0)
    meta = AttentionMetadata(
        page_table=row_page_table(r2t, rpi, page_size=p, max_pages=ceil_div(spec.context_len, p)),
        kv_lens=jnp.where(live, seq + 1, 0),
        page_size=p,
    )
    plan = AttnPlan(write_slot_ids=slot, passes=(meta,))
    tpool, hidden, feature = run_target(
        ecfg, target, params, state.target_pool, tokens, seq, plan, draft, draft_params
    )
    logits = target_logits(target, params, hidden)
    guards.probe_target_logits(logits, live, "plain_step")
    if sampling is None:
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)
    else:  # the token after x (at L) sits at position L + 1
        nxt = sample_plain(logits, sampling, seq + 1, tp_axis=ecfg.tp_axis)
    nxt = jnp.where(live, nxt, 0)
    if keep_draft:  # EAGLE: draft position L consumes (embed(x'), the target's feature at L).
        dpool, dhidden = run_draft(
            ecfg, draft, draft_params, params, state.draft_pool, nxt, feature, seq, plan
        )
        topk_p, topk_index = draft_topk(ecfg, draft, draft_params, params, dhidden)
    else:  # the draft's carry stays as it was (stale)
        dpool = state.draft_pool
        dhidden = gather_slots(state.draft_hidden, slot_idx, live)
        topk_p = gather_slots(state.topk_p, slot_idx, live)
        topk_index = gather_slots(state.topk_index, slot_idx, live)
    committed = ReqKVState(
        committed_lens=seq + 1,
        allocated_lens=reqs.allocated_lens,
        req_pool_indices=rpi,
        valid=live,
    )

    def put(x, v):
        return scatter_slots(x, slot_idx, live, v)

    state = replace(
        state,
        allocator=allocator,
        req_to_token=r2t,
        target_pool=tpool,
        draft_pool=dpool,
        committed_lens=put(state.committed_lens, committed.committed_lens),
        allocated_lens=put(state.allocated_lens, committed.allocated_lens),
        bonus_tokens=put(state.bonus_tokens, nxt),
        topk_p=put(state.topk_p, topk_p),
        topk_index=put(state.topk_index, topk_index),
        draft_hidden=put(state.draft_hidden, dhidden),
    )
    width = min(spec.num_steps, spec.num_draft_tokens - 1) + 1
    tokens_out = jnp.zeros((slot_idx.shape[0], width), jnp.int32).at[:, 0].set(nxt)
    return state, SpecStepOutput(
        accept_tokens=tokens_out, accept_lens=live.astype(jnp.int32), ok=ok
    )


# The target-only variant (a stable object: the rounds loop caches its compile by body).
target_only_step_body = functools.partial(plain_step_body, keep_draft=False)
