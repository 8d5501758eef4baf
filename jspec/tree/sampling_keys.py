"""Counter-based coins for sampling: ``coin = U(seed, stream, position, node)``, reproducible.

Every uniform draw a sampled request makes is a pure function of its own 64-bit seed and of
counters that describe *what* is being drawn, never of *where* it is computed (the batch it
shares, its slot, the bucket, the data-parallel shard or the tensor-parallel rank)::

    key  = (seed >> 32, seed & 0xFFFFFFFF)                    u32[2]
    key' = threefry2x32(key,  (stream, position))             u32[2]
    bits = threefry2x32(key', (node, 0))[0]                   u32
    coin = (bits >> 8) * 2**-24                               f32 in [0, 1), exact

Threefry-2x32 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11; the hash
behind ``jax.random``) is called directly (``jax.extend.random.threefry2x32_p``), so the coins do
not depend on ``jax_threefry_partitionable`` or any other PRNG setting, and are bit-identical on
CPU and GPU. The 24 bits kept make every coin an exact f32 multiple of ``2**-24``.

Streams (one draw is never reused for another purpose)::

    STREAM_PLAIN  position p = the index of the token being sampled   prefill's first token,
                  (the prompt length for the first), node 0           the plain sampled step
    STREAM_NODE   position L = the committed length at the step's     the sibling walk: the coin
                  start (the tree root's position), node j = local    used at node j to choose
                  tree node                                           among j's children
    STREAM_BONUS  position L, node 0                                  the residual (bonus) draw

A speculative step starts at a committed length strictly greater than any earlier step of the
same request (every step emits at least one token), so no (stream, position, node) is drawn
twice by one request: every coin a step uses is fresh, independent of everything that decided
the step's tree. That is what makes the sampled tree step exact for any draft
(:mod:`jspec.tree.sampling`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

STREAM_PLAIN = 0
STREAM_NODE = 1
STREAM_BONUS = 2
MAX_SEED = (1 << 64) - 1
# Coins keep the top 24 bits: exact in f32, uniform on {0, 2**-24, ..., 1 - 2**-24}.
_COIN_BITS = 24


def seed_words(seed: int) -> tuple[int, int]:
    """A 64-bit seed as its threefry key words ``(hi, lo)`` (host side, no device work).

    Raises:
      ValueError naming ``seed`` unless it is an int in ``[0, 2**64)``.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed={seed!r} must be an int in [0, 2**64)")
    if not 0 <= int(seed) <= MAX_SEED:
        raise ValueError(f"seed={int(seed)} must be in [0, 2**64)")
    seed = int(seed)
    return seed >> 32, seed & 0xFFFFFFFF


def _hash(k0: jax.Array, k1: jax.Array, x0: jax.Array, x1: jax.Array) -> list[jax.Array]:
    """Threefry-2x32 of the counter ``(x0, x1)`` under the key ``(k0, k1)``, elementwise."""
    args = jnp.broadcast_arrays(*(jnp.asarray(a).astype(jnp.uint32) for a in (k0, k1, x0, x1)))
    return threefry2x32_p.bind(*args)


def uniform_coins(
    seeds: jax.Array, stream: int, positions: jax.Array, num_nodes: int | None = None
) -> jax.Array:
    """Counter-based uniform coins (module docstring).

    Args:
      seeds: u32[B, 2] per-request seed words (:func:`seed_words`).
      stream: static, one of ``STREAM_PLAIN`` / ``STREAM_NODE`` / ``STREAM_BONUS``.
      positions: i32[B] the counter's position (see the stream table); must be >= 0.
      num_nodes: static; None gives one coin per request (node 0), an int ``n`` gives the coins
        of nodes ``0 .. n-1``.

    Returns:
      f32[B] (``num_nodes`` None) or f32[B, num_nodes], every value in ``[0, 1)``.
    """
    seeds = jnp.asarray(seeds).astype(jnp.uint32)
    hi, lo = seeds[:, 0], seeds[:, 1]
    k0, k1 = _hash(hi, lo, jnp.uint32(stream), positions)
    if num_nodes is None:
        nodes = jnp.zeros_like(k0)
    else:
        nodes = jnp.arange(num_nodes, dtype=jnp.uint32)[None, :]
        k0, k1 = k0[:, None], k1[:, None]
    bits, _ = _hash(k0, k1, nodes, jnp.uint32(0))
    scale = jnp.float32(2.0**-_COIN_BITS)
    return (bits >> (32 - _COIN_BITS)).astype(jnp.float32) * scale
