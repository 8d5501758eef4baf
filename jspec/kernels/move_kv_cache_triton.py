"""``move_kv_cache`` as raw Triton kernels launched through ``jax_triton`` (GPU only).

The same algorithm as the Pallas kernels in :mod:`jspec.kernels.move_kv_cache` (see there for
the semantics and the stash pass): grid = (layer, row block, column tile), 64-bit offsets, the
pool viewed as ``[num_layers, num_slots, row_width]`` and updated in place.

``jax_triton`` (0.3.1) is imported lazily inside :func:`move_kv_triton`, so this module imports
on CPU; the kernels are tested there with ``TRITON_INTERPRET=1`` on torch tensors.
jax-triton 0.3.1 passes aliased outputs as extra pointer parameters after the inputs
(``k_out_ptr``, ``v_out_ptr``): they are the pool's own buffers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from jspec.kernels._common import jax_triton_call
from jspec.kernels.move_kv_plan import (
    MODE_DIRECT,
    MODE_SKIP,
    MODE_STASH,
    LaunchPlan,
    pair_modes,
)

_MODE_SKIP = tl.constexpr(MODE_SKIP)
_MODE_DIRECT = tl.constexpr(MODE_DIRECT)
_MODE_STASH = tl.constexpr(MODE_STASH)


@triton.jit
def _tile(
    N: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, ROW_WIDTH: tl.constexpr
):
    layer = tl.program_id(0).to(tl.int64)
    pairs = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(2) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    return layer, pairs, pairs < N, cols, cols < ROW_WIDTH


@triton.jit
def stash_kv_rows_kernel(
    src_ptr,
    mode_ptr,
    k_ptr,
    v_ptr,
    stash_k_ptr,
    stash_v_ptr,
    N: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    N_PAD: tl.constexpr,
    ROW_WIDTH: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # src_ptr, mode_ptr: i32[N]
    # k_ptr, v_ptr: dtype[num_layers, NUM_SLOTS, ROW_WIDTH]        (the pool, read only)
    # stash_k_ptr, stash_v_ptr: dtype[num_layers, N_PAD, ROW_WIDTH] (rows of stashed pairs)
    layer, pairs, pair_ok, cols, col_ok = _tile(N, BLOCK_ROWS, BLOCK_COLS, ROW_WIDTH)
    src = tl.load(src_ptr + pairs, mask=pair_ok, other=0).to(tl.int64)
    mode = tl.load(mode_ptr + pairs, mask=pair_ok, other=_MODE_SKIP)
    stash = (mode == _MODE_STASH)[:, None] & col_ok[None, :]
    pool_off = (layer * NUM_SLOTS + src[:, None]) * ROW_WIDTH + cols[None, :]
    stash_off = (layer * N_PAD + pairs.to(tl.int64)[:, None]) * ROW_WIDTH + cols[None, :]
    val_k = tl.load(k_ptr + pool_off, mask=stash, other=0)
    val_v = tl.load(v_ptr + pool_off, mask=stash, other=0)
    tl.store(stash_k_ptr + stash_off, val_k, mask=stash)
    tl.store(stash_v_ptr + stash_off, val_v, mask=stash)


@triton.jit
def move_kv_rows_kernel(
    tgt_ptr,
    src_ptr,
    mode_ptr,
    stash_k_ptr,
    stash_v_ptr,
    k_ptr,
    v_ptr,
    k_out_ptr,
    v_out_ptr,
    N: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    N_PAD: tl.constexpr,
    ROW_WIDTH: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    STASHED: tl.constexpr,
):
    # tgt_ptr, src_ptr: i32[N]                    (self and padding pairs are skipped)
    # mode_ptr: i32[N]; stash_k_ptr, stash_v_ptr: dtype[num_layers, N_PAD, ROW_WIDTH]
    #                                             (unused unless STASHED)
    # k_ptr, v_ptr: the pool's input buffers (aliased to k_out_ptr, v_out_ptr; unused)
    # k_out_ptr, v_out_ptr: dtype[num_layers, NUM_SLOTS, ROW_WIDTH] (the pool, in place)
    layer, pairs, pair_ok, cols, col_ok = _tile(N, BLOCK_ROWS, BLOCK_COLS, ROW_WIDTH)
    tgt = tl.load(tgt_ptr + pairs, mask=pair_ok, other=0).to(tl.int64)
    src = tl.load(src_ptr + pairs, mask=pair_ok, other=0).to(tl.int64)
    if STASHED:
        mode = tl.load(mode_ptr + pairs, mask=pair_ok, other=_MODE_SKIP)
    else:
        mode = (tgt != src).to(tl.int32)  # MODE_DIRECT or MODE_SKIP
    direct = (mode == _MODE_DIRECT)[:, None] & col_ok[None, :]
    move = (mode != _MODE_SKIP)[:, None] & col_ok[None, :]
    src_off = (layer * NUM_SLOTS + src[:, None]) * ROW_WIDTH + cols[None, :]
    tgt_off = (layer * NUM_SLOTS + tgt[:, None]) * ROW_WIDTH + cols[None, :]
    val_k = tl.load(k_out_ptr + src_off, mask=direct, other=0)
    val_v = tl.load(v_out_ptr + src_off, mask=direct, other=0)
    if STASHED:
        from_stash = (mode == _MODE_STASH)[:, None] & col_ok[None, :]
        stash_off = (layer * N_PAD + pairs.to(tl.int64)[:, None]) * ROW_WIDTH + cols[None, :]
        val_k = tl.where(
            from_stash, tl.load(stash_k_ptr + stash_off, mask=from_stash, other=0), val_k
        )
        val_v = tl.where(
            from_stash, tl.load(stash_v_ptr + stash_off, mask=from_stash, other=0), val_v
        )
    # Every thread of the program has read its source rows before any target row is written.
    tl.debug_barrier()
    tl.store(k_out_ptr + tgt_off, val_k, mask=move)
    tl.store(v_out_ptr + tgt_off, val_v, mask=move)


def move_kv_triton(
    plan: LaunchPlan,
    k3: jax.Array,
    v3: jax.Array,
    tgt: jax.Array,
    src: jax.Array,
    *,
    num_warps: int,
) -> tuple[jax.Array, jax.Array]:
    """Raw-Triton ``move_kv_cache`` on the pool viewed as ``dtype[num_layers, num_slots, H*D]``.

    Args:
      plan: the static launch plan (:func:`jspec.kernels.move_kv_plan.plan_launch`).
      k3, v3: the pool's buffers (aliased to the outputs: updated in place under donation).
      tgt, src: i32[n] target and source token slots, n >= 1, num_layers >= 1.
      num_warps: static tuning, as in ``move_kv_cache``.

    Returns:
      ``(k3, v3)`` with rows ``src`` copied to rows ``tgt`` in every layer.
    """
    num_layers, num_slots, row_width, n, rows, cols, n_pad, grid = plan
    static = {
        "N": n,
        "NUM_SLOTS": num_slots,
        "N_PAD": n_pad,
        "ROW_WIDTH": row_width,
        "BLOCK_ROWS": rows,
        "BLOCK_COLS": cols,
    }
    stashed = plan.stashed
    if stashed:
        mode = pair_modes(tgt, src, num_slots, rows)
        stash_shape = jax.ShapeDtypeStruct((num_layers, n_pad, row_width), k3.dtype)
        stash = jax_triton_call(
            src,
            mode,
            k3,
            v3,
            kernel=stash_kv_rows_kernel,
            out_shape=(stash_shape, stash_shape),
            grid=grid,
            num_warps=num_warps,
            num_stages=1,
            **static,
        )
    else:  # unused pointers
        mode = src
        stash = (jnp.zeros((1,), k3.dtype), jnp.zeros((1,), k3.dtype))
    pool_shape = jax.ShapeDtypeStruct(k3.shape, k3.dtype)
    k3, v3 = jax_triton_call(
        tgt,
        src,
        mode,
        *stash,
        k3,
        v3,
        kernel=move_kv_rows_kernel,
        out_shape=(pool_shape, pool_shape),
        grid=grid,
        input_output_aliases={5: 0, 6: 1},
        num_warps=num_warps,
        num_stages=1,
        STASHED=stashed,
        **static,
    )
    return k3, v3
