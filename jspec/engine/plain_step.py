"""One plain decode step of a speculative engine: the target alone emits the token, the draft
keeps up (adaptive speculation, :class:`jspec.engine.scheduler.Engine` ``adaptive=``).

When speculation does not pay (the draft's proposals are rarely accepted), the engine decodes
a request greedily instead; but the next spec step needs the draft's state to be current: its
KV for every position and its proposal for the next tree's first level. So this step is the
plain greedy step (``jspec.engine.greedy``) plus one draft forward, what the spec step's draft
extend does for one accepted token::

    L = committed_len, x = bonus token (position L, no KV yet)
    KV backend prepare_decode(reserve)              the spec step's reserve (row[L] backed)
    target at L: K/V -> row[L]; x' = argmax (or sampled at position L + 1)
    draft at L:  (embed(x'), target feature at L) -> draft K/V at row[L]; its hidden h_L
    topk_p, topk_index <- the draft's top-K over h_L (TARGET ids); draft_hidden <- h_L
    L' = L + 1, bonus' = x'

The state after it is exactly what a spec step that accepted one token would leave, so spec and
plain steps interleave freely; tokens are the target's argmax either way (lossless).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec._pytree import replace
from jspec.engine.greedy import decode_one
from jspec.engine.model_calls import draft_topk, run_draft
from jspec.engine.runner import Runner, Weights
from jspec.engine.sampling import SamplingBatch
from jspec.engine.state import EngineState, commit_carry
from jspec.engine.step_types import SpecStepOutput


def plain_step_body(
    runner: Runner,
    weights: Weights,
    state: EngineState,
    slot_idx: jax.Array,
    live: jax.Array,
    sampling: SamplingBatch | None = None,
) -> tuple[EngineState, SpecStepOutput]:
    """The unjitted plain step of a spec engine (module docstring).

    Args:
      slot_idx: i32[Bb] batch slots; live: bool[Bb] (as the spec step's).
      sampling: None (argmax) or the entries' sampling parameters.

    Returns:
      (state, :class:`SpecStepOutput` with one token per live entry: ``accept_lens`` 1).
    """
    spec = runner.ecfg.spec
    kv, view, ok, nxt, plan, feature = decode_one(
        runner, weights, state, slot_idx, live, sampling, what="plain_step",
        num_tokens=spec.alloc_reserve_per_decode, feature=True,
    )  # fmt: skip
    live, seq = view.valid, view.seq_lens
    # EAGLE: draft position L consumes (embed(x'), the target's feature at L).
    dpool, dhidden = run_draft(runner, weights, kv.draft_pool, nxt, feature, seq, plan)
    topk_p, topk_index = draft_topk(runner, weights, dhidden)
    kv = runner.kv.commit(replace(kv, draft_pool=dpool), slot_idx, live, seq + 1, live)
    carry = commit_carry(state.carry, slot_idx, live, nxt, topk_p, topk_index, dhidden)
    width = min(spec.num_steps, spec.num_draft_tokens - 1) + 1
    tokens_out = jnp.zeros((slot_idx.shape[0], width), jnp.int32).at[:, 0].set(nxt)
    return EngineState(kv=kv, carry=carry), SpecStepOutput(
        accept_tokens=tokens_out, accept_lens=live.astype(jnp.int32), ok=ok
    )
