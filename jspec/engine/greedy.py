"""Plain greedy decoding of the target alone over a KV backend (the lossless baseline).

One decode step for a padded bucket of batch slots (``slot_idx: i32[Bb]``, ``live: bool[Bb]``)::

    L = committed_len, x = bonus token (last generated, no KV yet)
    row[L] = a token slot                    KV backend prepare_decode(num_tokens=1) (jspec's:
                                             alloc_decode, a new page iff (L+1) % P == 1)
    target forward on x at position L: K/V -> slot, attention over row[0..L]
    x' = argmax(logits); L' = L + 1                                KV backend commit

Given a ``sampling`` batch, ``x'`` is sampled instead (``jspec.engine.sampling``). Padding
entries allocate nothing, read the padding row 0 and write slot 0. The step is a no-op
(``ok`` False) when the pages are short or a live entry names a slot out of range, twice or not
live (``jspec.engine.guards``): every entry then becomes padding (no ``lax.cond``, so the donated
pool is updated in place rather than copied for a skip branch).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jspec._pytree import replace
from jspec.engine import guards
from jspec.engine.attention import AttnPlan
from jspec.engine.kv_backend import KVView, row_metadata
from jspec.engine.model_calls import run_target, target_logits
from jspec.engine.runner import Runner, Weights, jit_step
from jspec.engine.sampling import SamplingBatch, next_tokens
from jspec.engine.state import EngineState, gather_slots, scatter_slots
from jspec.engine.step_types import GreedyStepOutput


def decode_one(
    runner: Runner,
    weights: Weights,
    state: EngineState,
    slot_idx: jax.Array,
    live: jax.Array,
    sampling: SamplingBatch | None,
    *,
    what: str,
    num_tokens: int,
    feature: bool,
) -> tuple[Any, KVView, jax.Array, jax.Array, AttnPlan, jax.Array]:
    """The target's next token after each live entry's bonus token x (at position L): the
    guards, the KV backend's ``prepare_decode(num_tokens)``, the target at L (K/V -> row[L])
    and the argmax (or sample at position L + 1). Shared by the greedy and the plain step;
    ``feature``: also compute the draft's input from the target (the plain step's).

    Returns:
      ``(kv, view, ok bool[], next i32[Bb] (0 on padding), write_plan AttnPlan, feature
      dtype[Bb, Hd])``; ``view.valid`` the entries that stepped.
    """
    status = runner.kv.slot_status(state.kv)
    ok_in = guards.validate_step_slots(status, slot_idx, live, what)
    kv, view, ok = runner.kv.prepare_decode(state.kv, slot_idx, live & ok_in, num_tokens=num_tokens)
    ok = ok & ok_in
    live, seq = view.valid, view.seq_lens
    tokens = gather_slots(state.carry.bonus_tokens, slot_idx, live)
    slot = view.slot_ids(seq[:, None])[:, 0]
    meta = row_metadata(runner.ecfg.spec, view, jnp.where(live, seq + 1, 0))
    plan = AttnPlan(write_slot_ids=slot, passes=(meta,))
    pool, hidden, feature = run_target(
        runner, weights, kv.target_pool, tokens, seq, plan, feature=feature
    )
    logits = target_logits(runner, weights, hidden)
    guards.probe_target_logits(logits, live, what)
    # the token after x (at L) sits at position L + 1
    nxt = next_tokens(logits, sampling, seq + 1, tp_axis=runner.ecfg.tp_axis)
    nxt = jnp.where(live, nxt, 0)
    return replace(kv, target_pool=pool), view, ok, nxt, plan, feature


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
      runner: static config, target and KV backend (``Runner(ecfg, target)``; ``spec.topk``
        etc. unused).
      weights: ``Weights(target_params)``.
      state: engine state (donated).
      slot_idx: i32[Bb] batch slots (padding entries: any value); live: bool[Bb].
      sampling: None (argmax) or the entries' sampling parameters
        (:class:`jspec.engine.sampling.SamplingBatch`, rows as ``slot_idx``).

    Returns:
      (state, :class:`GreedyStepOutput`).
    """
    kv, view, ok, nxt, _, _ = decode_one(
        runner,
        weights,
        state,
        slot_idx,
        live,
        sampling,
        what="greedy_step",
        num_tokens=1,
        feature=False,
    )
    live = view.valid
    kv = runner.kv.commit(kv, slot_idx, live, view.seq_lens + 1, live)
    carry = replace(
        state.carry, bonus_tokens=scatter_slots(state.carry.bonus_tokens, slot_idx, live, nxt)
    )
    return EngineState(kv=kv, carry=carry), GreedyStepOutput(next_tokens=nxt, ok=ok)


# The public call: the body jitted (runner static, state donated); the engines map the body.
greedy_step = jit_step(greedy_step_body)
