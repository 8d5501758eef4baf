"""Sampled tree verification: the target-only sibling walk (SPEC.md §8.2), exact for any draft.

Target-only speculative sampling over the draft tree (sgl_kernel's FlashInfer-derived
``tree_speculative_sampling_target_only``; draft probabilities are not used). Per request, with
``q_r`` the processed target distribution after node ``r`` (:mod:`jspec.tree.sampling_probs`)::

    removed = {}; prob_acc = 0; coin = coins[b, 0]; last = root
    at each depth (<= S): walk the children c of `last` in sibling order:
        q_c = q_last[token(c)] - (q_last[token(c)] if token(c) in removed else 0)
        prob_acc += q_c
        accept c if  q_c > 0  and  (coin < prob_acc / threshold_acc  or  q_c >= threshold_single)
            -> predicts[last] = token(c); accept_index[b, ++n] = retrive_index[b, c]
               removed = {}; prob_acc = 0; coin = coins[b, c]; last = c
        else: removed += {token(c)}
    bonus: predicts[last] = a draw with coin_final from relu(q_last - removed)
           (= q_last without the rejected children's tokens)

**Why it is exact** (thresholds 1, the default). At ``last`` the coin is fresh (it was never
used to decide anything the tree depends on: :mod:`jspec.tree.sampling_keys`). The children's
distinct tokens own disjoint half-open intervals ``[a, a + q_c)`` of ``[0, 1)``, so child ``c``
is accepted with probability exactly ``q_last[token(c)]`` and, given that, the walk continues
at ``c`` with a fresh coin, i.e. the next token is drawn from ``q_c``. With probability
``1 - sum q_c`` none is accepted, and the bonus is drawn from ``q_last`` conditioned on not
being a child's token, which is the residual renormalised. Together: the emitted token after
``last`` has law ``q_last``, whatever the tree; by induction over depth the emitted sequence has
the law of sampling ``q`` autoregressively, for ANY draft (the draft only decides how many
tokens a step emits). The tests prove it by chi-square against the exact joint law
(tests/tree/test_sampling_exact.py, tests/engine/test_engine_sampling_exact.py).

Three departures from sglang 0.5.23's kernel (:func:`tree_speculative_sampling_target_only`
keeps that kernel's semantics for interop parity; the engine calls :func:`tree_sampling_verify`):

* half-open ``coin < prob_acc``, and ``q_c > 0`` required (sglang #35798): with ``<=``, a
  zero-probability candidate walked with ``prob_acc == coin`` (e.g. the first sibling and a
  coin of 0) was accepted: a token the target forbids (top-k / top-p cut, -inf logit);
* a sibling whose token an earlier sibling already had (duplicate siblings: a non-injective
  draft-to-target vocab map, a custom draft) counts ``q = 0``: sglang added its probability
  again, double-counting the token's mass (a bias the tests show, see ``_MUTANTS`` there);
* the lossy thresholds are only reachable through an explicit :class:`LossyThresholds`.

Implementation: vectorised jnp over the batch, ``N`` node visits (each node is visited at most
once), unrolled (no device loop); deterministic.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec import probes
from jspec._jit import jit
from jspec._tree_walk import at_node, finish_predicts, start_walk, step_walk
from jspec.tree.sampling_probs import target_probs_from_logits

__all__ = [
    "LossyThresholds",
    "sample_from_probs",
    "target_probs_from_logits",
    "tree_sampling_verify",
    "tree_speculative_sampling_target_only",
]

# FlashInfer caps threshold_acc away from 0 (division).
_MIN_THRESHOLD_ACC = 1e-9


@dataclasses.dataclass(frozen=True)
class LossyThresholds:
    """sglang's ``threshold_single`` / ``threshold_acc``: **changes the output distribution**.

    A candidate is accepted when its probability reaches ``threshold_single`` or the coin falls
    below ``prob_acc / threshold_acc``; values below 1 accept more (faster, no longer the target's
    distribution). Exact sampling has no thresholds: pass ``lossy=None``.
    """

    threshold_single: float = 1.0
    threshold_acc: float = 1.0

    def __post_init__(self) -> None:
        for name in ("threshold_single", "threshold_acc"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name}={value!r} must be a float in [0, 1]")
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}={value} must be in [0, 1]")


def _inverse_cdf(weights: jax.Array, coins: jax.Array, *, exact: bool = True) -> jax.Array:
    """i32[B]: the first ``v`` with ``cumsum(weights)[v] > coin * sum(weights)`` and
    ``weights[v] > 0`` (FlashInfer's rule; ``weights: f32[B, V] >= 0``, ``coins: f32[B]`` in
    ``[0, 1)``). When no entry qualifies: the last ``v`` with ``weights[v] > 0``
    (FlashInfer's ``last_valid_id``; ``exact`` False: ``V - 1``, sglang 0.5.23's kernel), and
    ``V - 1`` for an all-zero row.

    NOTE: a row with mass can have no qualifying entry: ``sum`` and ``cumsum``'s last entry
    are rounded in different orders, so a coin near 1 can give ``coin * sum >= cumsum[-1]``;
    ``V - 1`` there is a token of probability 0 as often as not.
    """
    v = weights.shape[-1]
    u = coins.astype(jnp.float32) * jnp.sum(weights, axis=-1)
    positive = weights > 0
    hit = (jnp.cumsum(weights, axis=-1) > u[:, None]) & positive
    # argmax of the reversed row: the last positive entry (V - 1 when there is none).
    past_end = v - 1 - jnp.argmax(positive[:, ::-1], axis=-1) if exact else v - 1
    return jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), past_end).astype(jnp.int32)


@jit()
def sample_from_probs(probs: jax.Array, coins: jax.Array) -> jax.Array:
    """Plain sampling by inverse CDF: one token per row of ``probs``.

    Args:
      probs: f32[B, V] distributions (e.g. ``target_probs_from_logits(...)[:, 0]``).
      coins: f32[B] uniform coins in ``[0, 1)`` (:func:`jspec.tree.sampling_keys.uniform_coins`).

    Returns:
      i32[B]: token ``v`` with probability ``probs[b, v]``; never a zero-probability token
      (a row with no positive entry gives its argmax).
    """
    probs = jnp.maximum(probs.astype(jnp.float32), 0.0)
    ok = jnp.any(probs > 0, axis=-1)
    return jnp.where(ok, _inverse_cdf(probs, coins), jnp.argmax(probs, axis=-1)).astype(jnp.int32)


def _sibling_walk(
    candidates: jax.Array,
    retrive_index: jax.Array,
    next_token: jax.Array,
    next_sibling: jax.Array,
    coins: jax.Array,
    final_coins: jax.Array,
    target_probs: jax.Array,
    *,
    num_spec_steps: int,
    t_single: float | jax.Array,
    t_acc: float | jax.Array,
    exact: bool,
    predicts_init: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The walk of the module docstring (shapes as :func:`tree_sampling_verify`); ``exact``
    False is sglang 0.5.23's kernel (:func:`tree_speculative_sampling_target_only`)."""
    bsz, n = candidates.shape
    v = target_probs.shape[-1]
    probes.static_check_shape(target_probs, (bsz, n, v), "target_probs")
    probes.static_check_shape(coins, (bsz, n), "uniform_samples")
    probes.static_check_shape(final_coins, (bsz,), "uniform_samples_for_final_sampling")
    probes.static_check(
        isinstance(num_spec_steps, int) and num_spec_steps >= 1,
        f"num_spec_steps={num_spec_steps!r} must be an int >= 1 (S+1)",
    )
    probes.detect_nan(target_probs, "tree sampling: target_probs")
    probes.detect_oob(candidates, 0, v, "tree sampling: candidates vs vocab")
    candidates, retrive_index, next_token, next_sibling = (
        x.astype(jnp.int32) for x in (candidates, retrive_index, next_token, next_sibling)
    )
    target_probs = target_probs.astype(jnp.float32)
    coins = coins.astype(jnp.float32)
    t_single = jnp.asarray(t_single, jnp.float32)
    t_acc = jnp.maximum(jnp.asarray(t_acc, jnp.float32), _MIN_THRESHOLD_ACC)
    max_depth = num_spec_steps - 1
    rows = jnp.arange(bsz)
    nodes = jnp.arange(n)

    # Per request: the walk (jspec._tree_walk: cur, last, depth, num, done, pred / written,
    # acc), prob_acc, coin, rejected (bool[B, N]: children of `last` rejected so far).
    walk = start_walk(next_token, retrive_index, num_spec_steps=num_spec_steps)
    prob_acc, coin = jnp.zeros((bsz,), jnp.float32), coins[:, 0]
    rejected = jnp.zeros((bsz, n), bool)
    for _ in range(n):  # each node is visited at most once: N visits suffice
        cur_ok = walk.cur_ok(n)
        cur, last = walk.cur, walk.last
        token = at_node(candidates, cur)
        q_tok = target_probs[rows, jnp.clip(last, 0, n - 1), jnp.clip(token, 0, v - 1)]
        if exact:
            seen = jnp.any(rejected & (candidates == token[:, None]), axis=-1)
            q_tok = jnp.where(seen, 0.0, q_tok)
            prob_acc = jnp.where(cur_ok, prob_acc + q_tok, prob_acc)
            hit = (coin < prob_acc / t_acc) | (q_tok >= t_single)
            match = cur_ok & (q_tok > 0) & hit
        else:
            prob_acc = jnp.where(cur_ok, prob_acc + q_tok, prob_acc)
            match = cur_ok & ((coin <= prob_acc / t_acc) | (q_tok >= t_single))
        onehot_cur = nodes[None, :] == cur[:, None]
        rejected = jnp.where(
            match[:, None], False, rejected | ((cur_ok & ~match)[:, None] & onehot_cur)
        )
        prob_acc = jnp.where(match, 0.0, prob_acc)
        coin = jnp.where(match, at_node(coins, cur), coin)
        walk = step_walk(
            walk, match, token, retrive_index, next_token, next_sibling, max_depth=max_depth
        )
    # Bonus: a draw from relu(q_last - removed) = q_last without the rejected children's tokens.
    q_last = jnp.maximum(target_probs[rows, walk.last], 0.0)  # (B, V)
    rej_tokens = jnp.where(rejected, candidates, v)  # v = out of range (dropped)
    removed = jnp.zeros((bsz, v), bool).at[rows[:, None], rej_tokens].set(True, mode="drop")
    residual = jnp.where(removed, 0.0, q_last)
    if exact:  # NOTE: rounding can leave no mass (coin ~ 1 walked past every token): q_last
        residual = jnp.where(jnp.any(residual > 0, axis=-1, keepdims=True), residual, q_last)
    sampled = _inverse_cdf(residual, final_coins, exact=exact)
    predicts = finish_predicts(walk, sampled, retrive_index, predicts_init=predicts_init)
    return predicts, walk.acc, walk.num.astype(jnp.int32)


@jit(static_argnames=("num_spec_steps", "lossy", "predicts_init"))
def tree_sampling_verify(
    candidates: jax.Array,
    retrive_index: jax.Array,
    retrive_next_token: jax.Array,
    retrive_next_sibling: jax.Array,
    coins: jax.Array,
    final_coins: jax.Array,
    target_probs: jax.Array,
    *,
    num_spec_steps: int,
    lossy: LossyThresholds | None = None,
    predicts_init: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Exact sampled tree verification (module docstring): the engine's sampled accept.

    Args:
      candidates: i32[B, N] tree tokens (node 0 the root); retrive_index: i32[B, N] global node
        ids; retrive_next_token, retrive_next_sibling: i32[B, N] local links (-1 = none).
      coins: f32[B, N] in ``[0, 1)``: column c is the coin used among c's children.
      final_coins: f32[B] in ``[0, 1)``: the bonus draw's coin.
      target_probs: f32[B, N, V] processed target distribution after each node (local order).
      num_spec_steps: static ``max depth + 1`` (``accept_index`` width).
      lossy: static; None (default) is exact. :class:`LossyThresholds` changes the
        distribution.
      predicts_init: static value of never-written ``predicts`` entries.

    Returns:
      ``(predicts i32[B*N], accept_index i32[B, S+1] (-1 padded), accept_token_num i32[B])``
      as :func:`jspec.tree.verify.verify_tree_greedy`: ``predicts[g]`` is the token emitted
      after accepted node ``g`` (the bonus after the last).
    """
    lossy = lossy or LossyThresholds()
    return _sibling_walk(
        candidates,
        retrive_index,
        retrive_next_token,
        retrive_next_sibling,
        coins,
        final_coins,
        target_probs,
        num_spec_steps=num_spec_steps,
        t_single=lossy.threshold_single,
        t_acc=lossy.threshold_acc,
        exact=True,
        predicts_init=predicts_init,
    )


@jit(static_argnames=("num_spec_steps", "deterministic", "predicts_init"))
def tree_speculative_sampling_target_only(
    candidates: jax.Array,
    retrive_index: jax.Array,
    retrive_next_token: jax.Array,
    retrive_next_sibling: jax.Array,
    uniform_samples: jax.Array,
    uniform_samples_for_final_sampling: jax.Array,
    target_probs: jax.Array,
    *,
    num_spec_steps: int,
    threshold_single: float | jax.Array = 1.0,
    threshold_acc: float | jax.Array = 1.0,
    deterministic: bool = True,
    predicts_init: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """sgl_kernel ``tree_speculative_sampling_target_only`` as of sglang 0.5.23 (interop parity).

    The walk of the module docstring with that kernel's rules: ``coin <= prob_acc /
    threshold_acc``, no positive-probability requirement, duplicate siblings counted again, the
    bonus ``V - 1`` when the residual is empty. Not exact (module docstring); the engine uses
    :func:`tree_sampling_verify`.

    Args:
      candidates: i32[B, N] draft tokens; retrive_index: i32[B, N] global node ids;
      retrive_next_token, retrive_next_sibling: i32[B, N] local links (-1 = none).
      uniform_samples: f32[B, N] coins in [0, 1); column c is used after accepting node c.
      uniform_samples_for_final_sampling: f32[B] the final (bonus) coin.
      target_probs: f32[B, N, V] target distribution after each node (local node order).
      num_spec_steps: static ``S + 1``.
      threshold_single, threshold_acc: acceptance thresholds (scalars).
      deterministic: accepted for parity; this implementation is always deterministic.
      predicts_init: static value of never-written ``predicts`` entries.

    Returns:
      ``(predicts i32[B*N], accept_index i32[B, S+1] (-1 padded), accept_token_num i32[B])``.
    """
    del deterministic
    return _sibling_walk(
        candidates,
        retrive_index,
        retrive_next_token,
        retrive_next_sibling,
        uniform_samples,
        uniform_samples_for_final_sampling,
        target_probs,
        num_spec_steps=num_spec_steps,
        t_single=threshold_single,
        t_acc=threshold_acc,
        exact=False,
        predicts_init=predicts_init,
    )
