"""Stream compaction and packed scatters, in one place.

Every "pack the live entries to the front of a fixed-capacity buffer, pad the tail" in jspec is
one of these two (static shapes: outputs are capacity-sized buffers plus counts)::

    values  [a  b  c  d  e]          keep [1 0 1 1 0]
    compact -> [a  c  d  fill fill]  (stable: live entries keep their order)

    pack_to: values[i] -> out[dst[i]] where live[i]; other entries, and dst >= size, dropped
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["compact", "pack_to"]


def pack_to(
    dst: jax.Array,
    values: jax.Array,
    live: jax.Array,
    size: int,
    *,
    fill: int = 0,
    dtype: jnp.dtype = jnp.int32,
) -> jax.Array:
    """Scatter ``values`` where ``live`` to positions ``dst`` of a ``fill``-ed buffer.

    Args:
      dst: int[...] destination positions (entries ``>= size`` are dropped).
      values: [...] values, same shape as ``dst`` (cast to ``dtype``).
      live: bool[...] entries to write.
      size: static output length.
      fill: value of the positions nobody writes.
      dtype: output dtype.

    Returns:
      dtype[size]; duplicate live destinations: which write wins is undefined.
    """
    dst = jnp.where(live & (dst < size), dst, size).reshape(-1)
    vals = values.reshape(-1).astype(dtype)
    return jnp.full((size,), fill, dtype).at[dst].set(vals, mode="drop")


def compact(
    values: jax.Array,
    keep: jax.Array,
    size: int | None = None,
    *,
    fill: int = 0,
    dtype: jnp.dtype | None = None,
) -> jax.Array:
    """Stable compaction: the ``keep`` entries of ``values`` (row-major) to the front.

    Args:
      values: [...] values.
      keep: bool[...] same shape as ``values``.
      size: static output length (default ``values.size``); live entries past it are dropped.
      fill: tail value.
      dtype: output dtype (default ``values.dtype``).

    Returns:
      dtype[size]: ``values[keep]`` in order, then ``fill``.
    """
    keep = keep.reshape(-1)
    size = keep.shape[0] if size is None else size
    rank = jnp.cumsum(keep.astype(jnp.int32)) - 1
    return pack_to(
        rank, values, keep, size, fill=fill, dtype=values.dtype if dtype is None else dtype
    )
