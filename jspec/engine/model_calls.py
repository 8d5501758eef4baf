"""The engine's only calls into a model: protocol methods under the model named scopes.

Every step (prefill, greedy, speculative) reaches the target and the draft through these four
functions, so a model is any object following :mod:`jspec.engine.protocol`, and every model
op lands under ``jspec_model/target`` or ``jspec_model/draft`` (bench/e2e.py's device split).
"""

from __future__ import annotations

from typing import Any

import jax

from jspec.engine.attention import AttnPlan, make_attn_fn
from jspec.engine.protocol import DraftModel, model_scope
from jspec.engine.runner import Runner, Weights
from jspec.kernels.topk_probs import topk_probs


def require_draft(runner: Runner, caller: str) -> DraftModel:
    """``runner.draft``, or ValueError naming ``caller`` when the runner has none (a call that
    runs the draft: the speculative step, its phases)."""
    if runner.draft is None:
        raise ValueError(
            f"{caller}: runner.draft is None; speculative decoding needs a draft head "
            "(Runner(ecfg, target, draft)), a runner without one steps with greedy_step"
        )
    return runner.draft


def run_target(
    runner: Runner,
    weights: Weights,
    pool: Any,
    token_ids: jax.Array,
    positions: jax.Array,
    plan: AttnPlan,
    *,
    feature: bool = True,
) -> tuple[Any, jax.Array, jax.Array]:
    """The target over flat tokens, its K/V written and read through ``plan``.

    Args:
      token_ids, positions: i32[T].
      feature: compute the draft's input (False, or no draft: none).

    Returns:
      (pool, hidden dtype[T, H], feature): ``feature`` is the draft's hidden input
      dtype[T, Hd], ``draft.combine_hidden_states`` of the aux of ``draft.capture_layers``
      (EAGLE-3) or of ``hidden`` (EAGLE-1); ``hidden`` itself without one.
    """
    draft = runner.draft if feature else None
    capture = tuple(draft.capture_layers) if draft is not None else ()
    attn_fn = make_attn_fn(plan, runner.ecfg.attention)
    with model_scope("target"):
        pool, hidden, aux = runner.target.forward(
            weights.target,
            pool,
            token_ids,
            positions,
            attn_fn,
            capture_layers=capture,
            tp_axis=runner.ecfg.tp_axis,
        )
    if draft is None:
        return pool, hidden, hidden
    with model_scope("draft"):
        draft_in = draft.combine_hidden_states(weights.draft, hidden if aux is None else aux)
    return pool, hidden, draft_in


def target_logits(runner: Runner, weights: Weights, hidden: jax.Array) -> jax.Array:
    """f32[T, V] target logits of hidden dtype[T, H]."""
    with model_scope("target"):
        return runner.target.logits(weights.target, hidden)


def run_draft(
    runner: Runner,
    weights: Weights,
    pool: Any,
    token_ids: jax.Array,
    hidden_in: jax.Array,
    positions: jax.Array,
    plan: AttnPlan,
) -> tuple[Any, jax.Array]:
    """The draft over flat tokens (TARGET ids i32[T], hidden_in dtype[T, Hd]: a feature from
    :func:`run_target` or the draft's own previous hidden_out).

    Returns:
      (pool, hidden_out dtype[T, Hd]).
    """
    draft = require_draft(runner, "run_draft")
    attn_fn = make_attn_fn(plan, runner.ecfg.attention)
    with model_scope("draft"):
        return draft.forward(
            weights.draft,
            weights.target,
            pool,
            token_ids,
            hidden_in,
            positions,
            attn_fn,
            tp_axis=runner.ecfg.tp_axis,
        )


def draft_topk(runner: Runner, weights: Weights, hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Top-K over the draft's logits, mapped to target ids.

    Args:
      hidden: dtype[T, Hd] draft hidden states.

    Returns:
      (topk_p f32[T, K], topk_index i32[T, K] TARGET ids): the top-K of the draft vocab's
      softmax, then ``draft.to_target_ids`` (sglang's ``hot_token_id`` / d2t mapping).
    """
    ecfg, draft = runner.ecfg, require_draft(runner, "draft_topk")
    with model_scope("draft"):
        logits = draft.logits(weights.draft, weights.target, hidden)
    topk_p, draft_ids = topk_probs(logits, ecfg.spec.topk, impl=ecfg.kernels.topk_probs)
    with model_scope("draft"):
        return topk_p, draft.to_target_ids(weights.draft, draft_ids).astype(draft_ids.dtype)
