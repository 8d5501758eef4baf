"""The processed target distribution: temperature, top-k, min-p and top-p, in one function.

:func:`target_probs_from_logits` is the one place a sampled request's logits become the
distribution it samples from: the plain sampler (prefill's first token, the plain decode step)
and the tree verification (:mod:`jspec.tree.sampling`) both read its output, so the two sides
of speculative sampling can never disagree on it (vLLM #10198 applied top-k / top-p to one side
only and biased acceptance). Per row, with ``T`` the request's temperature::

    T <= 0   q = one_hot(argmax(logits))                    (greedy; first index on ties)
    T  > 0   p = softmax(logits / T)
             pre = max(kth_largest(p, top_k) if 0 < top_k < V else 0,  min_p * max(p))
             Z   = sum(p[p >= pre])
             tau = the largest value t with sum(p[p >= t]) >= top_p * Z   (top_p < 1; else 0)
             q   = p * [p >= max(pre, tau)], renormalised

i.e. top-k and min-p cut the sorted distribution, then top-p keeps the smallest top set of
*that* renormalised distribution whose mass reaches ``top_p`` (sglang's speculative path:
``top_k_renorm_prob`` then ``top_p_renorm_prob``; vLLM's order). Every cut is a threshold on
the probability value, so ties at a cut are all kept (FlashInfer's pivot rule) and the result
does not depend on a sort's tie order.

Sort-free: each threshold (the k-th largest value, the top-p pivot) is the largest f32 bit
pattern ``b`` with ``count(p >= b) >= k`` (``mass(p >= b) >= top_p * Z``): a 16-way search over
the bit patterns of ``[0, max(p)]`` (non-negative f32 order like their int32 bits), 8 passes of
fused masked reductions over the row, exact (the answer is a value of the row). A full-vocab
sort per verify row (``B * N`` rows of ``V``) cost far more on the GPU. Presence is static:
``top_ks`` / ``top_ps`` / ``min_ps`` None skip their work entirely.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec import probes
from jspec._jit import jit

# Threshold search: ways per pass (each pass compares every row value against ways - 1
# candidates: fewer ways, fewer reads in all but more passes; ``bench/sampling_filters.py``),
# and the bit-pattern width of [0, 1.0f] it must resolve.
SEARCH_WAYS = 16
_ONE_BITS = 0x3F800000


def _num_passes(width: int, ways: int) -> int:
    """Passes of the ``ways``-way search that shrink ``width`` candidates to one."""
    n = 0
    while width > 1:
        width = -(-width // ways)
        n += 1
    return n


def _largest_reaching(hi: jax.Array, reaches, ways: int) -> jax.Array:
    """Per row, the largest ``b`` in ``[0, hi)`` with ``reaches(b)`` (``reaches`` monotone
    non-increasing in ``b`` and true at 0).

    Args:
      hi: i32[R] exclusive upper bound (``reaches`` is false from there on).
      reaches: ``f(cand i32[R, W]) -> bool[R, W]`` (``W = ways - 1``).
      ways: static, >= 2.

    Returns:
      i32[R]: the threshold, as a bit pattern.
    """
    if not isinstance(ways, int) or ways < 2:
        raise ValueError(f"ways={ways!r} must be an int >= 2")
    lo = jnp.zeros_like(hi)
    offsets = jnp.arange(1, ways, dtype=jnp.int32)
    for _ in range(_num_passes(_ONE_BITS + 1, ways)):  # static: unrolled, no device loop
        step = (hi - lo + ways - 1) // ways  # >= 1 while hi > lo + 1
        cand = lo[:, None] + offsets[None, :] * step[:, None]  # i32[R, W]
        valid = cand < hi[:, None]
        ok = reaches(cand) & valid  # a prefix of the ways (monotone)
        num_ok = jnp.sum(ok, axis=-1, dtype=jnp.int32)
        below = jnp.take_along_axis(cand, jnp.maximum(num_ok - 1, 0)[:, None], -1)[:, 0]
        above = jnp.take_along_axis(cand, jnp.minimum(num_ok, ways - 2)[:, None], -1)[:, 0]
        new_hi = jnp.where((num_ok < ways - 1) & (above < hi), above, hi)
        lo = jnp.where(num_ok > 0, below, lo)
        hi = new_hi
    return lo


def _bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.int32)


def kth_largest(probs: jax.Array, k: jax.Array, *, ways: int = SEARCH_WAYS) -> jax.Array:
    """f32[R]: the ``k``-th largest value of each row (``probs: f32[R, V] >= 0``; ``k: i32[R]``
    in ``[1, V]``), exact, sort-free; ``ways``: the search's ways per pass (static)."""
    bits = _bits(probs)
    hi = jnp.max(bits, axis=-1) + 1

    def reaches(cand):
        count = jnp.sum(bits[:, None, :] >= cand[:, :, None], axis=-1, dtype=jnp.int32)
        return count >= k[:, None]

    return jax.lax.bitcast_convert_type(_largest_reaching(hi, reaches, ways), jnp.float32)


def mass_pivot(probs: jax.Array, target: jax.Array, *, ways: int = SEARCH_WAYS) -> jax.Array:
    """f32[R]: the largest value ``t`` of each row with ``sum(probs[probs >= t]) >= target``
    (``probs: f32[R, V] >= 0``; ``target: f32[R]`` in ``(0, sum(probs)]``), exact, sort-free;
    ``ways`` as :func:`kth_largest`."""
    bits = _bits(probs)
    hi = jnp.max(bits, axis=-1) + 1

    def reaches(cand):
        keep = bits[:, None, :] >= cand[:, :, None]
        mass = jnp.sum(jnp.where(keep, probs[:, None, :], 0.0), axis=-1)
        return mass >= target[:, None]

    return jax.lax.bitcast_convert_type(_largest_reaching(hi, reaches, ways), jnp.float32)


def _per_row(x: jax.Array, rows_per_request: int, dtype) -> jax.Array:
    return jnp.repeat(jnp.asarray(x).reshape(-1).astype(dtype), rows_per_request)


@jit()
def target_probs_from_logits(
    logits: jax.Array,
    temperatures: jax.Array,
    top_ks: jax.Array | None = None,
    top_ps: jax.Array | None = None,
    min_ps: jax.Array | None = None,
) -> jax.Array:
    """The processed target distribution (module docstring), per request.

    Args:
      logits: f32[B, N, V] or f32[B*N, V] target logits (N rows per request, request-major).
      temperatures: f32[B] (or [B, 1]); ``<= 0`` is greedy (one-hot argmax).
      top_ks: i32[B] or None; ``k <= 0`` or ``k >= V`` keeps everything.
      top_ps: f32[B] or None, in ``(0, 1]``; 1 keeps everything.
      min_ps: f32[B] or None, in ``[0, 1]``; keeps ``p >= min_p * max(p)``; 0 keeps everything.

    Returns:
      f32[B, N, V], every row a distribution (sums to 1 up to rounding).
    """
    temps = temperatures.reshape(-1).astype(jnp.float32)
    b = temps.shape[0]
    v = logits.shape[-1]
    logits = logits.astype(jnp.float32).reshape(b, -1, v)
    n = logits.shape[1]
    probes.detect_nan(logits, "target_probs_from_logits: target logits")
    greedy = (temps <= 0)[:, None, None]
    scaled = logits / jnp.where(greedy, 1.0, temps[:, None, None])
    probs = jax.nn.softmax(scaled, axis=-1)
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
    probs = jnp.where(greedy, onehot, probs)
    probes.detect_nan(probs, "target_probs_from_logits: target_probs after softmax")
    if top_ks is None and top_ps is None and min_ps is None:
        return probs
    # NOTE: one materialised copy of the row values for every threshold and the final compare.
    # Without the barrier XLA's GPU fusions recompute the softmax inside their consumers, each
    # rounding its own way: a pivot read from one copy (the k-th largest, the top-p token)
    # could exceed its own value in another by an ulp and drop it (H200: top_k=2 kept one).
    rows = jax.lax.optimization_barrier(probs.reshape(b * n, v))
    pmax = jnp.max(rows, axis=-1)
    pivot = jnp.zeros((b * n,), jnp.float32)
    if top_ks is not None:
        k = _per_row(top_ks, n, jnp.int32)
        active = (k > 0) & (k < v)
        kth = kth_largest(rows, jnp.clip(k, 1, v))
        pivot = jnp.where(active, jnp.maximum(pivot, kth), pivot)
    if min_ps is not None:
        pivot = jnp.maximum(pivot, _per_row(min_ps, n, jnp.float32) * pmax)
    if top_ps is not None:
        p = _per_row(top_ps, n, jnp.float32)
        kept_mass = jnp.sum(jnp.where(rows >= pivot[:, None], rows, 0.0), axis=-1)
        tau = mass_pivot(rows, jnp.minimum(p, 1.0) * kept_mass)
        pivot = jnp.where(p < 1.0, jnp.maximum(pivot, tau), pivot)
    # NOTE: pivot <= max(p) always (every cut keeps the largest value), so no row empties.
    kept = jnp.where(rows >= jnp.minimum(pivot, pmax)[:, None], rows, 0.0)
    probs = (kept / jnp.sum(kept, axis=-1, keepdims=True)).reshape(b, n, v)
    probes.detect_nan(probs, "target_probs_from_logits: target_probs after top-k/min-p/top-p")
    return probs
