"""Index checks shared by every public entry that takes a slot, row or page index.

A traced index can be out of range, negative, repeated or point at a dead entry; jnp indexing
would clamp or wrap it onto a real entry (another request's row, pages or KV). These helpers
compute, per entry of a padded batch, whether it is bad; callers fold ``~any(bad)`` into their
``ok`` flag and return the state unchanged when it is False::

    idx    [ 3  9  3  -1  0 ]      valid [1 1 1 1 0]    range [0, 8)
    out_of_range -> [0 1 0 1 0]    repeated -> [1 0 1 0 0]   (invalid entries never count)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec import probes

__all__ = ["first_bad", "flat_ids", "int32_ids", "out_of_range", "repeated", "valid_mask"]


def valid_mask(valid: jax.Array | None, shape: tuple[int, ...]) -> jax.Array:
    """bool[shape]: ``valid`` (its shape checked at trace time: ``ValueError`` naming it), or
    every entry when None."""
    if valid is None:
        return jnp.ones(shape, bool)
    probes.static_check_shape(valid, shape, "valid")
    return valid.astype(bool)


def flat_ids(ids: jax.Array, valid: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """``(ids i32[M], valid bool[M])``, both flattened; ``valid`` None means every entry.

    ``ValueError`` naming ``valid`` at trace time unless it holds the ``M`` entries of ``ids``.
    """
    ids = ids.reshape(-1).astype(jnp.int32)
    valid = jnp.ones(ids.shape, bool) if valid is None else valid.astype(bool).reshape(-1)
    probes.static_check_shape(valid, ids.shape, "valid")
    return ids, valid


def int32_ids(ids: jax.Array, name: str) -> jax.Array:
    """i32[n]: ``ids`` (slot, row or page ids of any integer dtype) cast to int32; trace-time
    ``ValueError`` naming ``name`` unless it is 1-D with an integer dtype."""
    probes.static_check(ids.ndim == 1, f"{name}.shape={tuple(ids.shape)} must be 1-D")
    probes.static_check(
        jnp.issubdtype(ids.dtype, jnp.integer),
        f"{name}.dtype={ids.dtype} must be an integer dtype (int32)",
    )
    return ids.astype(jnp.int32)


def out_of_range(idx: jax.Array, valid: jax.Array, low: int, high: int) -> jax.Array:
    """bool[B]: valid entries with ``idx`` outside ``[low, high)``."""
    return valid & ((idx < low) | (idx >= high))


# Batches up to this many entries compare every pair (one fusible elementwise + reduce, no
# scatter: the step guards run every decode step); larger ones count in a size-long histogram.
PAIRWISE_MAX = 256


def repeated(idx: jax.Array, valid: jax.Array, size: int) -> jax.Array:
    """bool[B]: valid entries whose ``idx`` (in ``[0, size)``) another valid entry also holds.

    Entries outside ``[0, size)`` never count (check them with :func:`out_of_range`).
    """
    live = valid & (idx >= 0) & (idx < size)
    if idx.shape[0] <= PAIRWISE_MAX:
        same = (idx[:, None] == idx[None, :]) & live[:, None] & live[None, :]
        return jnp.sum(same.astype(jnp.int32), axis=1) > 1  # self + another
    # NOTE: dead entries go to bucket ``size`` (dropped); a negative index would wrap.
    bucket = jnp.where(live, idx, size)
    counts = jnp.zeros((size + 1,), jnp.int32).at[bucket].add(1, mode="drop")
    return live & (counts[bucket] > 1)


def first_bad(bad: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(entry, value) of the first True in ``bad`` (entry 0 if none): a probe's message."""
    at = jnp.argmax(bad)
    return at, values[at]
