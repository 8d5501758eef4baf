"""Plain decoding: the target alone emits one token per request (the lossless baseline), over a
KV backend; with a draft in the runner the draft keeps up (adaptive speculation).

One decode step for a padded bucket of batch slots (``slot_idx: i32[Bb]``, ``live: bool[Bb]``)::

    L = committed_len, x = bonus token (last generated, position L, no KV yet)
    row[L] backed                 KV backend prepare_decode: 1 token without a draft (jspec's:
                                  alloc_decode, a new page iff (L+1) % P == 1); the spec step's
                                  reserve with one
    target at L: K/V -> row[L], attention over row[0..L]; x' = argmax (or sampled at L + 1)
    with a draft:                 draft at L: (embed(x'), target feature at L) -> draft K/V at
                                  row[L]; topk_p / topk_index / draft_hidden <- its top-K and
                                  hidden h_L (what the spec step's draft extend does for one
                                  accepted token)
    L' = L + 1, bonus' = x'       KV backend commit; the carry

With a draft the state after it is exactly what a spec step that accepted one token would leave,
so spec and plain steps interleave freely (``Engine(adaptive=True)`` decodes so while
speculation does not pay); tokens are the target's argmax either way (lossless). Given a
``sampling`` batch, ``x'`` is sampled instead (``jspec.engine.sampling``). Padding entries
allocate nothing, read the padding row 0 and write slot 0. The step is a no-op (``ok`` False)
when the pages are short or a live entry names a slot out of range, twice or not live
(``jspec.engine.guards``): every entry then becomes padding (no ``lax.cond``, so the donated
pool is updated in place rather than copied for a skip branch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec._pytree import replace
from jspec.engine import guards
from jspec.engine.attention import AttnPlan
from jspec.engine.kv_backend import row_metadata
from jspec.engine.model_calls import draft_topk, run_draft, run_target, target_logits
from jspec.engine.runner import Runner, Weights, jit_step
from jspec.engine.sampling import SamplingBatch, next_tokens
from jspec.engine.state import EngineState, commit_carry, gather_slots, scatter_slots
from jspec.engine.step_types import GreedyStepOutput


def greedy_step_body(
    runner: Runner,
    weights: Weights,
    state: EngineState,
    slot_idx: jax.Array,
    live: jax.Array,
    sampling: SamplingBatch | None = None,
) -> tuple[EngineState, GreedyStepOutput]:
    """One plain greedy (or sampled) decode step over a padded bucket of one shard.

    Args:
      runner: static config, target and KV backend (``Runner(ecfg, target)``); with a draft
        (``Runner(ecfg, target, draft)``) the draft's KV and next proposal are kept current.
      weights: ``Weights(target_params)`` (``Weights(target_params, draft_params)``).
      state: engine state (donated).
      slot_idx: i32[Bb] batch slots (padding entries: any value); live: bool[Bb].
      sampling: None (argmax) or the entries' sampling parameters
        (:class:`jspec.engine.sampling.SamplingBatch`, rows as ``slot_idx``).

    Returns:
      (state, :class:`GreedyStepOutput`).
    """
    return _plain_step(runner, weights, state, slot_idx, live, sampling, keep_draft=True)


def target_only_step_body(
    runner: Runner,
    weights: Weights,
    state: EngineState,
    slot_idx: jax.Array,
    live: jax.Array,
    sampling: SamplingBatch | None = None,
) -> tuple[EngineState, GreedyStepOutput]:
    """:func:`greedy_step_body` over a spec runner's state without running its draft (a plain
    greedy step's cost): the draft's KV, proposals and hidden of these requests go stale, so
    they must not speculate again (``SpecPolicy`` retires the draft for good)."""
    return _plain_step(runner, weights, state, slot_idx, live, sampling, keep_draft=False)


def _plain_step(runner, weights, state, slot_idx, live, sampling, *, keep_draft: bool):
    spec_state = runner.draft is not None
    has_draft = spec_state and keep_draft
    reserve = runner.ecfg.spec.alloc_reserve_per_decode if spec_state else 1
    ok_in = guards.validate_step_slots(
        runner.kv.slot_status(state.kv), slot_idx, live, "greedy_step"
    )
    kv, view, ok = runner.kv.prepare_decode(state.kv, slot_idx, live & ok_in, num_tokens=reserve)
    ok = ok & ok_in
    live, seq = view.valid, view.seq_lens
    tokens = gather_slots(state.carry.bonus_tokens, slot_idx, live)
    meta = row_metadata(
        runner.ecfg.spec, view, jnp.where(live, seq + 1, 0), max_kv_len=runner.max_kv_len
    )
    plan = AttnPlan(write_slot_ids=view.slot_ids(seq[:, None])[:, 0], passes=(meta,))
    tpool, hidden, feature = run_target(
        runner, weights, kv.target_pool, tokens, seq, plan, feature=has_draft
    )
    logits = target_logits(runner, weights, hidden)
    guards.probe_target_logits(logits, live, "greedy_step")
    # the token after x (at L) sits at position L + 1
    nxt = next_tokens(logits, sampling, seq + 1, tp_axis=runner.ecfg.tp_axis)
    nxt = jnp.where(live, nxt, 0)
    kv = runner.kv.commit(replace(kv, target_pool=tpool), slot_idx, live, seq + 1, live)
    carry = state.carry
    if not has_draft:
        carry = replace(carry, bonus_tokens=scatter_slots(carry.bonus_tokens, slot_idx, live, nxt))
        return EngineState(kv=kv, carry=carry), GreedyStepOutput(next_tokens=nxt, ok=ok)
    # EAGLE: draft position L consumes (embed(x'), the target's feature at L).
    dpool, dhidden = run_draft(runner, weights, kv.draft_pool, nxt, feature, seq, plan)
    topk_p, topk_index = draft_topk(runner, weights, dhidden)
    carry = commit_carry(carry, slot_idx, live, nxt, topk_p, topk_index, dhidden)
    kv = replace(kv, draft_pool=dpool)
    return EngineState(kv=kv, carry=carry), GreedyStepOutput(next_tokens=nxt, ok=ok)


# The public call: the body jitted (runner static, state donated); the engines map the body.
greedy_step = jit_step(greedy_step_body)
