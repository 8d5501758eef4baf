"""Non-greedy tree verification: ``tree_speculative_sampling_target_only`` (SPEC.md §8.2).

Target-only speculative sampling over the draft tree (sgl_kernel's FlashInfer-derived kernel;
draft probabilities are all zero). Per request, with ``q_r = target_probs[b, r]`` the target
distribution after node r::

    prob_acc = 0; coin = coins[b, 0]; last = root
    at each depth (<= S): walk the children of `last` in sibling order:
        prob_acc += q_last[token(c)]
        accept c if  coin <= prob_acc / max(threshold_acc, 1e-9)  or  q_last[token(c)] >= threshold_single
            -> predicts[last] = token(c); accept_index[b, ++n] = retrive_index[b, c]
               prob_acc = 0; coin = coins[b, c]; last = c
        else: mark token(c) rejected at row `last` (draft_probs[last, token] = q_last[token])
    final: residual = relu(q_last - draft_probs_last)  (= q_last with the rejected children's
           tokens zeroed; nothing is subtracted when every depth accepted)
           predicts[last] = first v with cumsum(residual)[v] > coin_final * sum(residual)
                            and residual[v] > 0, else V-1            (FlashInfer's rule)

With ``threshold_single = threshold_acc = 1`` and distinct sibling tokens this is exact
sampling from ``q``: one coin walks the siblings' CDF; past it, the residual is ``q`` renormalised
without them. Implementation: vectorised jnp over the batch, a static-trip ``fori_loop`` of
``N`` node visits (like the greedy reference), deterministic (``deterministic`` is accepted for
API parity). ``predicts`` entries never written keep ``predicts_init`` (sglang: undefined).

NOTE: newer upstream sgl_kernel changed the (0, 0)-threshold behaviour (zero-probability
candidates are no longer accepted); this follows the SPEC (sglang 0.5.23 / §13.3 golden).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jspec import probes
from jspec.sentinels import NOT_ACCEPTED

# FlashInfer caps threshold_acc away from 0 (division).
_MIN_THRESHOLD_ACC = 1e-9


@functools.partial(jax.jit, static_argnames=("num_spec_steps", "deterministic", "predicts_init"))
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
    """Sampling-based tree verification (sgl_kernel ``tree_speculative_sampling_target_only``).

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
    bsz, n = candidates.shape
    v = target_probs.shape[-1]
    probes.static_check_shape(target_probs, (bsz, n, v), "target_probs")
    probes.static_check_shape(uniform_samples, (bsz, n), "uniform_samples")
    probes.static_check_shape(
        uniform_samples_for_final_sampling, (bsz,), "uniform_samples_for_final_sampling"
    )
    probes.static_check(
        isinstance(num_spec_steps, int) and num_spec_steps >= 1,
        f"num_spec_steps={num_spec_steps!r} must be an int >= 1 (S+1)",
    )
    probes.detect_nan(target_probs, "tree_speculative_sampling_target_only: target_probs")
    probes.detect_oob(
        candidates, 0, v, "tree_speculative_sampling_target_only: candidates vs vocab"
    )
    candidates, retrive_index, next_token, next_sibling = (
        x.astype(jnp.int32)
        for x in (candidates, retrive_index, retrive_next_token, retrive_next_sibling)
    )
    target_probs = target_probs.astype(jnp.float32)
    coins = uniform_samples.astype(jnp.float32)
    t_single = jnp.asarray(threshold_single, jnp.float32)
    t_acc = jnp.maximum(jnp.asarray(threshold_acc, jnp.float32), _MIN_THRESHOLD_ACC)
    max_depth = num_spec_steps - 1
    rows = jnp.arange(bsz)
    nodes = jnp.arange(n)

    def at(x, i):
        return x[rows, jnp.clip(i, 0, n - 1)]

    def body(_, state):
        cur, last, depth, num, done, prob_acc, coin, rejected, pred, written, acc = state
        cur_ok = ~done & (cur >= 0) & (cur < n)
        token = at(candidates, cur)
        q_tok = target_probs[rows, jnp.clip(last, 0, n - 1), jnp.clip(token, 0, v - 1)]
        prob_acc = jnp.where(cur_ok, prob_acc + q_tok, prob_acc)
        match = cur_ok & ((coin <= prob_acc / t_acc) | (q_tok >= t_single))
        reject = cur_ok & ~match
        onehot_last = nodes[None, :] == last[:, None]
        pred = jnp.where(match[:, None] & onehot_last, token[:, None], pred)
        written = written | (match[:, None] & onehot_last)
        num = num + match
        acc = jnp.where(
            match[:, None] & (jnp.arange(num_spec_steps)[None, :] == num[:, None]),
            at(retrive_index, cur)[:, None],
            acc,
        )
        # Rejected children of the current row (reset when a child is accepted).
        onehot_cur = nodes[None, :] == cur[:, None]
        rejected = jnp.where(match[:, None], False, rejected | (reject[:, None] & onehot_cur))
        prob_acc = jnp.where(match, 0.0, prob_acc)
        coin = jnp.where(match, at(coins, cur), coin)
        last = jnp.where(match, cur, last)
        depth = depth + match
        cur = jnp.where(match, at(next_token, cur), jnp.where(cur_ok, at(next_sibling, cur), cur))
        done = done | ~cur_ok | (match & (depth > max_depth))
        return cur, last, depth, num, done, prob_acc, coin, rejected, pred, written, acc

    zeros = jnp.zeros((bsz,), jnp.int32)
    acc0 = jnp.full((bsz, num_spec_steps), NOT_ACCEPTED, jnp.int32)
    acc0 = acc0.at[:, 0].set(retrive_index[:, 0])
    state = (
        next_token[:, 0],
        zeros,
        zeros + 1,
        zeros,
        jnp.full((bsz,), max_depth == 0),
        jnp.zeros((bsz,), jnp.float32),
        coins[:, 0],
        jnp.zeros((bsz, n), bool),
        jnp.zeros((bsz, n), jnp.int32),
        jnp.zeros((bsz, n), bool),
        acc0,
    )
    state = jax.lax.fori_loop(0, n, body, state)
    _, last, _, num, _, _, _, rejected, pred, written, acc = state
    # Final sample from relu(q_last - draft_probs_last): rejected tokens' mass removed.
    q_last = target_probs[rows, last]  # (B, V)
    rej_tokens = jnp.where(rejected, candidates, v)  # v = out of range (dropped)
    removed = jnp.zeros((bsz, v), bool).at[rows[:, None], rej_tokens].set(True, mode="drop")
    residual = jnp.where(removed, 0.0, jnp.maximum(q_last, 0.0))
    u = uniform_samples_for_final_sampling.astype(jnp.float32) * jnp.sum(residual, axis=-1)
    hit = (jnp.cumsum(residual, axis=-1) > u[:, None]) & (residual > 0)
    sampled = jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), v - 1).astype(jnp.int32)
    onehot_last = nodes[None, :] == last[:, None]
    pred = jnp.where(onehot_last, sampled[:, None], pred)
    written = written | onehot_last
    total = bsz * n
    dest = jnp.where(written, retrive_index, total)
    predicts = (
        jnp.full((total,), predicts_init, jnp.int32)
        .at[dest.reshape(-1)]
        .set(pred.reshape(-1), mode="drop")
    )
    return predicts, acc, num.astype(jnp.int32)


def _renorm(probs: jax.Array, keep: jax.Array) -> jax.Array:
    kept = jnp.where(keep, probs, 0.0)
    return kept / jnp.sum(kept, axis=-1, keepdims=True)


@jax.jit
def target_probs_from_logits(
    logits: jax.Array,
    temperatures: jax.Array,
    top_ks: jax.Array | None = None,
    top_ps: jax.Array | None = None,
) -> jax.Array:
    """``softmax(logits / T)`` then optional top-k / top-p renormalisation (per request).

    Args:
      logits: f32[B, N, V] or f32[B*N, V] target logits (node-major per request).
      temperatures: f32[B] (or [B, 1]).
      top_ks: i32[B] or None; ``k <= 0`` or ``k >= V`` keeps everything.
      top_ps: f32[B] or None; keeps the smallest top set whose mass reaches ``p``.

    Returns:
      f32[B, N, V]. Ties: every token whose probability equals the k-th largest (or the
      top-p cut-off) is kept (FlashInfer's pivot rule keeps ties the same way).
    """
    temps = temperatures.reshape(-1).astype(jnp.float32)
    b = temps.shape[0]
    v = logits.shape[-1]
    logits = logits.astype(jnp.float32).reshape(b, -1, v)
    probes.detect_nan(logits, "target_probs_from_logits: target logits")
    probs = jax.nn.softmax(logits / temps[:, None, None], axis=-1)
    probes.detect_nan(probs, "target_probs_from_logits: target_probs after softmax")
    if top_ks is not None or top_ps is not None:
        desc = -jnp.sort(-probs, axis=-1)
    if top_ks is not None:
        k = top_ks.reshape(-1).astype(jnp.int32)
        active = (k > 0) & (k < v)
        kth = jnp.take_along_axis(desc, jnp.clip(k - 1, 0, v - 1)[:, None, None], axis=-1)
        probs = jnp.where(active[:, None, None], _renorm(probs, probs >= kth), probs)
        probes.detect_nan(probs, "target_probs_from_logits: target_probs after top-k")
        desc = -jnp.sort(-probs, axis=-1)
    if top_ps is not None:
        p = top_ps.reshape(-1).astype(jnp.float32)[:, None, None]
        cum = jnp.cumsum(desc, axis=-1)
        # Cut-off: the first sorted position whose cumulative mass reaches p.
        cut = jnp.argmax(cum >= p, axis=-1)
        cut = jnp.where(jnp.any(cum >= p, axis=-1), cut, v - 1)
        pivot = jnp.take_along_axis(desc, cut[..., None], axis=-1)
        probs = jnp.where(p < 1.0, _renorm(probs, probs >= pivot), probs)
        probes.detect_nan(probs, "target_probs_from_logits: target_probs after top-p")
    return probs
