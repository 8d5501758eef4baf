"""Static launch plan and per-pair modes shared by the ``move_kv_cache`` kernels.

Both back ends (the Pallas kernels of :mod:`jspec.kernels.move_kv_cache` and the raw Triton ones
of :mod:`jspec.kernels.move_kv_cache_triton`) view the pool as ``[num_layers, num_slots, H*D]``
and tile it the same way: grid = (layer, row block, column tile). A pair whose source row is
the target of a pair in another row block is stashed first (``MODE_STASH``); see
:mod:`jspec.kernels.move_kv_cache` for the semantics.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jspec import probes
from jspec.config import next_power_of_2

# Per-pair modes (i32), computed in XLA before the kernels.
MODE_SKIP = 0  # self pair (t -> t) or padding: nothing to do
MODE_DIRECT = 1  # read the source row from the pool
MODE_STASH = 2  # read the source row from the stash (another row block writes it)
# pair_modes: n x n compare up to this n, a per-slot scatter above.
DENSE_HAZARD_MAX = 4096


def plan_blocks(
    n: int, row_width: int, *, block_rows: int, block_elems: int, single_block_rows: int
) -> tuple[int, int, int, int]:
    """Static launch plan ``(block_rows, block_cols, n_pad, num_col_tiles)``.

    One row block of ``next_pow2(n)`` rows when that is <= ``single_block_rows`` (no stash
    pass), else ``block_rows`` rows per block. ``block_cols`` = block_elems // rows, capped at
    next_pow2(row_width); ``n_pad`` = n rounded up to a multiple of the rows per block.
    """
    for name, value in (
        ("block_rows", block_rows),
        ("block_elems", block_elems),
        ("single_block_rows", single_block_rows),
    ):
        probes.static_check_power_of_2(value, name)
    rows = next_power_of_2(n)
    if rows > single_block_rows:
        rows = min(block_rows, rows)
    cols = max(1, min(next_power_of_2(row_width), block_elems // rows))
    n_pad = -(-n // rows) * rows
    return rows, cols, n_pad, -(-row_width // cols)


class LaunchPlan(NamedTuple):
    """Static launch geometry shared by the Pallas and the raw Triton move kernels."""

    num_layers: int
    num_slots: int
    row_width: int  # elements per slot row (num_kv_heads * head_dim)
    n: int  # pairs
    block_rows: int
    block_cols: int
    n_pad: int  # n rounded up to a multiple of block_rows
    grid: tuple[int, int, int]  # (layer, row block, column tile)

    @property
    def stashed(self) -> bool:
        """More than one row block: sources overwritten by another block go through a stash."""
        return self.n_pad > self.block_rows


def plan_launch(
    k: jax.Array, n: int, *, block_rows: int, block_elems: int, single_block_rows: int
) -> LaunchPlan:
    """:class:`LaunchPlan` for moving ``n`` pairs in a pool buffer ``k: dtype[L, slots, ...]``."""
    num_layers, num_slots = k.shape[:2]
    row_width = k.size // (num_layers * num_slots)
    rows, cols, n_pad, num_col_tiles = plan_blocks(
        n,
        row_width,
        block_rows=block_rows,
        block_elems=block_elems,
        single_block_rows=single_block_rows,
    )
    return LaunchPlan(
        num_layers,
        num_slots,
        row_width,
        n,
        rows,
        cols,
        n_pad,
        (num_layers, n_pad // rows, num_col_tiles),
    )


def pair_modes(
    tgt: jax.Array,
    src: jax.Array,
    num_slots: int,
    block_rows: int,
    *,
    dense_max: int = DENSE_HAZARD_MAX,
) -> jax.Array:
    """i32[n] per-pair mode: MODE_SKIP, MODE_DIRECT, or MODE_STASH.

    A moving pair (``tgt != src``) is stashed when its source slot is the target of a moving
    pair in another row block (``block_rows`` pairs per block); duplicate targets written from
    several blocks count too. For n <= ``dense_max`` this is one fused n x n compare-and-reduce;
    above, a per-slot min and max of the writing block id over ``num_slots``.
    """
    n = tgt.shape[0]
    moving = tgt != src
    block = jnp.arange(n, dtype=jnp.int32) // block_rows
    if n <= dense_max:
        hit = (tgt[None, :] == src[:, None]) & moving[None, :] & (block[None, :] != block[:, None])
        stash = moving & jnp.any(hit, axis=1)
    else:
        num_blocks = -(-n // block_rows)
        lo = (
            jnp.full((num_slots,), num_blocks, jnp.int32)
            .at[tgt]
            .min(jnp.where(moving, block, num_blocks), mode="drop")
        )
        hi = (
            jnp.full((num_slots,), -1, jnp.int32)
            .at[tgt]
            .max(jnp.where(moving, block, -1), mode="drop")
        )
        lo_src = lo.at[src].get(mode="fill", fill_value=num_blocks)
        hi_src = hi.at[src].get(mode="fill", fill_value=-1)
        stash = moving & (hi_src >= 0) & ((lo_src != block) | (hi_src != block))
    return jnp.where(stash, MODE_STASH, moving.astype(jnp.int32))
