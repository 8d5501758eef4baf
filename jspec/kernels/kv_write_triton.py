"""One layer's K and V rows written into the pool in one raw Triton launch (GPU).

``set_kv_buffer`` (:func:`jspec.kv.pool.set_kv_buffer`, ``impl="triton"``) as one kernel for K
and V together: XLA writes them as two scatters (two dynamic-update-slices for one row), a
launch each per layer and forward. Grid = (token blocks, column blocks); each program copies
``BLOCK_T`` rows of ``Hkv * D`` values into ``pool[layer, slot]`` of both pools, in place
(``input_output_aliases``; jax-triton 0.3.1 passes the aliased outputs as extra pointers after
the inputs: the pools' own buffers).

Slots outside ``[0, num_slots)`` (negative included) write nothing, or with ``ROUTE_PAD`` (the
one-row case of ``set_kv_buffer``) write the padding slot ``PAD_SLOT`` instead: the same
pools as the XLA path, bit for bit.

``jax_triton`` is imported lazily (:func:`jspec.kernels._common.jax_triton_call`); on CPU the
kernel runs in Triton's interpreter on torch tensors (tests/kv/test_kv_write_triton.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import triton.language as tl

from jspec.config import next_power_of_2
from jspec.kernels import _common

# Values (K or V) per program and launch: BLOCK_T rows x the row's BLOCK_C columns.
TILE = 4096


def _set_kv_rows_kernel(
    kv_ptr,  # dtype[2, T, C] the new K rows, then the new V rows (C = Hkv * D)
    slot_ptr,  # i32[T] token slots
    layer_ptr,  # i32[1]
    k_pool_ptr,  # dtype[L, S, C] (aliased: the same buffer as k_out_ptr)
    v_pool_ptr,  # dtype[L, S, C] (aliased: the same buffer as v_out_ptr)
    k_out_ptr,  # dtype[L, S, C] (out, in place)
    v_out_ptr,  # dtype[L, S, C] (out, in place)
    T: tl.constexpr,
    C: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    PAD_SLOT: tl.constexpr,
    ROUTE_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    row_ok = rows < T
    col_ok = cols < C
    slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
    in_range = (slot >= 0) & (slot < NUM_SLOTS)
    if ROUTE_PAD:
        slot = tl.where(in_range, slot, PAD_SLOT)
        write = row_ok
    else:
        write = row_ok & in_range
    layer = tl.load(layer_ptr).to(tl.int64)
    src = rows.to(tl.int64)[:, None] * C + cols[None, :]
    dst = (layer * NUM_SLOTS + slot.to(tl.int64))[:, None] * C + cols[None, :]
    mask = write[:, None] & col_ok[None, :]
    tl.store(k_out_ptr + dst, tl.load(kv_ptr + src, mask=mask), mask=mask)
    tl.store(v_out_ptr + dst, tl.load(kv_ptr + T * C + src, mask=mask), mask=mask)


def get_kernel() -> Any:
    """``triton.jit`` of the kernel for the current mode (:func:`_common.triton_jit`)."""
    return _common.triton_jit(_set_kv_rows_kernel)


def launch_plan(
    num_tokens: int, row_width: int, num_slots: int, pad_slot: int, route_pad: bool
) -> tuple[tuple[int, int], dict[str, Any]]:
    """Static ``(grid, constexprs)``: ``BLOCK_C`` covers the row (at most :data:`TILE`),
    ``BLOCK_T`` rows fill the rest of the tile."""
    block_c = min(TILE, next_power_of_2(row_width))
    block_t = max(1, min(TILE // block_c, next_power_of_2(num_tokens)))
    grid = (-(-num_tokens // block_t), -(-row_width // block_c))
    meta = {
        "T": num_tokens,
        "C": row_width,
        "NUM_SLOTS": num_slots,
        "PAD_SLOT": pad_slot,
        "ROUTE_PAD": bool(route_pad),
        "BLOCK_T": block_t,
        "BLOCK_C": block_c,
    }
    return grid, meta


def set_kv_rows_triton(
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: int,
    slot_ids: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    pad_slot: int,
    route_pad: bool,
) -> tuple[jax.Array, jax.Array]:
    """``k_pool[layer, slot_ids] = k`` and the same for V, one launch, in place (GPU only).

    Args:
      k_pool, v_pool: dtype[L, S, Hkv, D] (donated by the caller: updated in place).
      layer: static layer index; slot_ids: i32[T]; k, v: dtype[T, Hkv, D] (the pool dtype).
      pad_slot, route_pad: out-of-range slots write ``pad_slot`` when ``route_pad``, else
        nothing.

    Returns:
      ``(k_pool, v_pool)`` updated.
    """
    _common.resolve_impl("triton", ("triton",), "set_kv_buffer")  # a GPU backend, or ValueError
    _, num_slots, hkv, dim = k_pool.shape
    num_tokens = slot_ids.shape[0]
    if num_tokens == 0:
        return k_pool, v_pool
    grid, meta = launch_plan(num_tokens, hkv * dim, num_slots, pad_slot, route_pad)
    pool_shape = jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype)
    # NOTE: K and V go in as one [2, T, C] operand: XLA writes it in the fusion that computes
    # K (RoPE) and slices V out of the projections; two operands would each need a copy of
    # their own (V is a strided slice of the fused projection's output): one launch more.
    # The layer is a literal (a jnp.full would be a broadcast launch of its own).
    return _common.jax_triton_call(
        jnp.stack([k, v]).reshape(2, num_tokens, hkv * dim),
        slot_ids,
        np.full((1,), layer, np.int32),
        k_pool,
        v_pool,
        kernel=get_kernel(),
        out_shape=(pool_shape, pool_shape),
        grid=grid,
        input_output_aliases={3: 0, 4: 1},
        name="jspec_set_kv_rows",
        num_warps=4,
        num_stages=1,
        **meta,
    )
