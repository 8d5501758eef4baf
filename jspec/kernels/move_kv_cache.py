"""``move_kv_cache`` kernels: copy token-slot rows of every layer's K and V (SPEC.md §9.2).

Array level: ``k, v`` in, ``k, v`` out. The ``KVPool`` entry point is
:func:`jspec.kv.pool.move_kv_cache`, which calls :func:`move_kv_cache` here.

Semantics (sglang ``MHATokenToKVPool.move_kv_cache`` / ``copy_all_layer_kv_cache_tiled``)::

    for every layer:  k[layer, tgt] = k[layer, src];  v[layer, tgt] = v[layer, src]

**gather-then-scatter**: every source row is read before any target row is written, so
overlapping ``tgt``/``src`` in one call is safe (``tgt=[1,2,3,4], src=[0,1,2,3]``). Unlike
sglang, which guarantees this only within chunks of 256 (or 128) pairs, jspec guarantees it for
the whole call. Self pairs (``t == t``, including the ``(0 -> 0)`` padding pairs) are no-ops. With
duplicate targets, which write wins is undefined (as in sglang).

Pallas kernel (Triton lowering). The pool is viewed as ``[num_layers, num_slots, H*D]`` (a free
reshape) and updated in place (``input_output_aliases``). Grid = (layer, row block, column
tile); each program gathers ``block_rows`` source rows x ``block_cols`` columns of K and V
(16-byte vector loads), waits at a CTA barrier, then scatters them to the target rows, so pairs
of one row block never race. When ``next_pow2(n) <= single_block_rows`` every pair is in one row
block: one launch, no XLA work (skip = ``tgt == src`` in the kernel, tail pairs masked).
Otherwise pairs of *different* row blocks race only when one's source is the other's target:
``pair_modes`` finds those in XLA (one fused n x n compare for n <= 4096, a per-slot scatter
above) and a stash kernel first copies their source rows to a side buffer
``[num_layers, n_pad, H*D]`` that the move kernel reads instead. Moved bytes are read and
written once except for stashed pairs (random slots: almost none; packed per-request windows:
only windows that straddle a row block). The launch plan and the pair modes shared with the raw
Triton kernels are in :mod:`jspec.kernels.move_kv_plan`.

Interpret mode (CPU) caveat: masked-out tail pairs store back to slot 0 (the padding slot), so
a real pair that targets slot 0 may lose its write there; compiled masked stores write nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec import probes
from jspec._index import int32_ids
from jspec._jit import jit
from jspec.kernels._common import pallas_call, resolve_impl, resolve_interpret
from jspec.kernels.move_kv_plan import (
    MODE_DIRECT,
    MODE_SKIP,
    MODE_STASH,
    LaunchPlan,
    pair_modes,
    plan_launch,
)

# bench/move_kv_cache.py on the H200 measured pallas and triton within noise of each other
# (both ~3 TB/s at n=4096); the engine's policy uses its bookkeeping impl (pallas on GPU).
IMPLS = ("xla", "pallas", "triton")
# Default tuning (H200, 2 KB rows; bench/move_kv_cache.py --sweep): rows per program,
# K-or-V elements per program, warps, and the largest n (rounded up to a power of 2) moved by
# a single row block (then there is no stash pass and no XLA work at all).
BLOCK_ROWS = 16
BLOCK_ELEMS = 8192
NUM_WARPS = 8
SINGLE_BLOCK_ROWS = 64
# The static arguments of move_kv_cache: impl and the tuning knobs above (jspec.kv.pool's
# move_kv_cache takes and forwards the same ones).
STATIC_ARGNAMES = (
    "impl",
    "interpret",
    "block_rows",
    "block_elems",
    "num_warps",
    "single_block_rows",
)


# ---- kernels --------------------------------------------------------------------------------
def _tile_ids(row0, col0, block_rows: int, block_cols: int):
    """(i32[block_rows, 1] pair ids, i32[1, block_cols] column ids) of one program's tile."""
    rows = row0 + lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
    cols = col0 + lax.broadcasted_iota(jnp.int32, (1, block_cols), 1)
    return rows, cols


def _col_mask(cols, row_width: int):
    """bool[1, block_cols] column-tail mask, or None when row_width % block_cols == 0."""
    if row_width % cols.shape[1] == 0:
        return None
    return cols < row_width


def _and(mask, other):
    return mask if other is None else mask & other


def _load_pairs(refs, row0, n: int, block_rows: int):
    """Load i32[block_rows, 1] slices of each per-pair ref; pairs >= n read 0 (a skip)."""
    pairs = pl.ds(row0, block_rows)
    if n % block_rows == 0:
        return [ref[pairs][:, None] for ref in refs]
    ok = row0 + lax.broadcasted_iota(jnp.int32, (block_rows,), 0) < n
    return [pltriton.load(ref.at[pairs], mask=ok, other=0)[:, None] for ref in refs]


def _stash_kv_kernel(
    src_ref,
    mode_ref,
    k_ref,
    v_ref,
    stash_k_ref,
    stash_v_ref,
    *,
    n: int,
    block_rows: int,
    block_cols: int,
    row_width: int,
):
    # src_ref, mode_ref: i32[n]
    # k_ref, v_ref: dtype[num_layers, num_slots, row_width]           (the pool, read only)
    # stash_k_ref, stash_v_ref: dtype[num_layers, n_pad, row_width]   (rows of stashed pairs)
    layer = pl.program_id(0)
    row0 = pl.program_id(1) * block_rows
    rows, cols = _tile_ids(row0, pl.program_id(2) * block_cols, block_rows, block_cols)
    src, mode = _load_pairs((src_ref, mode_ref), row0, n, block_rows)
    stash = _and(mode == MODE_STASH, _col_mask(cols, row_width))
    stash = jnp.broadcast_to(stash, (block_rows, block_cols))
    for buf_ref, out_ref in ((k_ref, stash_k_ref), (v_ref, stash_v_ref)):
        val = pltriton.load(buf_ref.at[layer, src, cols], mask=stash, other=0)
        pltriton.store(out_ref.at[layer, rows, cols], val, mask=stash)


def _move_kv_kernel(
    tgt_ref,
    src_ref,
    *refs,
    n: int,
    block_rows: int,
    block_cols: int,
    row_width: int,
    stashed: bool,
    barrier: bool,
):
    # tgt_ref, src_ref: i32[n]                        (self and padding pairs are skipped)
    # [mode_ref: i32[n]; stash_k_ref, stash_v_ref: dtype[num_layers, n_pad, row_width]]
    #                                                 (only when stashed, i.e. > 1 row block)
    # k_in, v_in: dtype[num_layers, num_slots, row_width]   (aliased to k_ref, v_ref; unused)
    # k_ref, v_ref: dtype[num_layers, num_slots, row_width] (the pool, updated in place)
    if stashed:
        mode_ref, stash_k_ref, stash_v_ref, _, _, k_ref, v_ref = refs
    else:
        _, _, k_ref, v_ref = refs
    layer = pl.program_id(0)
    row0 = pl.program_id(1) * block_rows
    rows, cols = _tile_ids(row0, pl.program_id(2) * block_cols, block_rows, block_cols)
    shape = (block_rows, block_cols)
    col_ok = _col_mask(cols, row_width)
    if stashed:
        tgt, src, mode = _load_pairs((tgt_ref, src_ref, mode_ref), row0, n, block_rows)
        direct, move = mode == MODE_DIRECT, mode != MODE_SKIP
    else:
        tgt, src = _load_pairs((tgt_ref, src_ref), row0, n, block_rows)
        direct = move = tgt != src
    direct = jnp.broadcast_to(_and(direct, col_ok), shape)
    move = jnp.broadcast_to(_and(move, col_ok), shape)
    vals = []
    for buf_ref, stash_ref in (
        (k_ref, stash_k_ref if stashed else None),
        (v_ref, stash_v_ref if stashed else None),
    ):
        val = pltriton.load(buf_ref.at[layer, src, cols], mask=direct, other=0)
        if stash_ref is not None:
            from_stash = jnp.broadcast_to(_and(mode == MODE_STASH, col_ok), shape)
            stashed_val = pltriton.load(stash_ref.at[layer, rows, cols], mask=from_stash, other=0)
            val = jnp.where(from_stash, stashed_val, val)
        vals.append(val)
    # Every thread of the program has read its source rows before any target row is written
    # (interpret mode runs a program's ops in order and has no lowering for the barrier).
    if barrier:
        pltriton.debug_barrier()
    for buf_ref, val in zip((k_ref, v_ref), vals):
        pltriton.store(buf_ref.at[layer, tgt, cols], val, mask=move)


def _move_pallas(
    plan: LaunchPlan,
    k3: jax.Array,
    v3: jax.Array,
    tgt: jax.Array,
    src: jax.Array,
    *,
    interpret: bool,
    num_warps: int,
) -> tuple[jax.Array, jax.Array]:
    """The Pallas passes on the pool viewed as ``k3, v3: dtype[num_layers, num_slots, H*D]``."""
    num_layers, num_slots, row_width, n, rows, cols, n_pad, grid = plan
    static = {"n": n, "block_rows": rows, "block_cols": cols, "row_width": row_width}
    stashed = plan.stashed
    extra = ()
    if stashed:
        mode = pair_modes(tgt, src, num_slots, rows)
        stash_shape = jax.ShapeDtypeStruct((num_layers, n_pad, row_width), k3.dtype)
        stash = pallas_call(
            functools.partial(_stash_kv_kernel, **static),
            out_shape=(stash_shape, stash_shape),
            grid=grid,
            interpret=interpret,
            num_warps=num_warps,
            name="stash_kv_rows",
        )(src, mode, k3, v3)
        extra = (mode, *stash)
    first = 2 + len(extra)
    pool_shape = jax.ShapeDtypeStruct(k3.shape, k3.dtype)
    return pallas_call(
        functools.partial(_move_kv_kernel, stashed=stashed, barrier=not interpret, **static),
        out_shape=(pool_shape, pool_shape),
        grid=grid,
        interpret=interpret,
        num_warps=num_warps,
        input_output_aliases={first: 0, first + 1: 1},
        name="move_kv_rows",
    )(tgt, src, *extra, k3, v3)


# ---- public wrapper and reference -----------------------------------------------------------
@jit(static_argnames=STATIC_ARGNAMES, donate_argnames=("k", "v"))
def move_kv_cache(
    k: jax.Array,
    v: jax.Array,
    tgt_slot_ids: jax.Array,
    src_slot_ids: jax.Array,
    *,
    impl: str = "xla",
    interpret: bool | None = None,
    block_rows: int = BLOCK_ROWS,
    block_elems: int = BLOCK_ELEMS,
    num_warps: int = NUM_WARPS,
    single_block_rows: int = SINGLE_BLOCK_ROWS,
) -> tuple[jax.Array, jax.Array]:
    """Copy K and V rows ``src -> tgt`` in every layer (gather-then-scatter), in place.

    Args:
      k: dtype[num_layers, num_slots, num_kv_heads, head_dim] (donated: updated in place
        outside an outer ``jit``).
      v: same shape and dtype as ``k`` (donated).
      tgt_slot_ids: i32[n] target token slots (int32; sglang's are int64). Padding pairs are
        ``(0 -> 0)``. Probe: in ``[0, num_slots)``.
      src_slot_ids: i32[n] source token slots. Probe: in ``[0, num_slots)``.
      impl: static; ``"xla"`` (the reference), ``"pallas"`` (Triton lowering; interpret mode
        off GPU) or ``"triton"`` (raw Triton through jax_triton, GPU only).
      interpret: static; Pallas interpret mode (None: interpret unless on GPU).
      block_rows, block_elems, num_warps, single_block_rows: static kernel tuning (powers
        of 2): pairs per program, K-or-V elements per program, warps per program, and the
        largest ``next_pow2(n)`` handled by one row block (no stash pass).

    Returns:
      ``(k, v)`` with ``k[:, tgt] = k[:, src]`` and ``v[:, tgt] = v[:, src]``, every source row
      read before any target row is written. Zero layers or n == 0: unchanged.

    NOTE: with more than one row block the kernels allocate a stash of
    ``2 * num_layers * n_pad * H*D`` elements (512 MiB for n=4096, 32 layers, 2 KB rows),
    sized for the worst case although only stashed pairs use it.
    """
    tgt = int32_ids(tgt_slot_ids, "tgt_slot_ids")
    src = int32_ids(src_slot_ids, "src_slot_ids")
    probes.static_check(
        tgt.shape == src.shape,
        f"tgt_slot_ids.shape={tgt.shape} must equal src_slot_ids.shape={src.shape}",
    )
    probes.static_check(
        k.shape == v.shape and k.ndim == 4,
        f"k.shape={k.shape} and v.shape={v.shape} must be equal and 4-D "
        "[num_layers, num_slots, num_kv_heads, head_dim]",
    )
    impl = resolve_impl(impl, IMPLS, "move_kv_cache")
    num_slots = k.shape[1]
    probes.detect_oob(tgt, 0, num_slots, "move_kv_cache: tgt_slot_ids out of range")
    probes.detect_oob(src, 0, num_slots, "move_kv_cache: src_slot_ids out of range")
    if k.shape[0] == 0 or tgt.shape[0] == 0:
        return k, v
    if impl == "xla":
        return move_kv_cache_reference(k, v, tgt, src)
    plan = plan_launch(
        k,
        tgt.shape[0],
        block_rows=block_rows,
        block_elems=block_elems,
        single_block_rows=single_block_rows,
    )
    view = (plan.num_layers, plan.num_slots, plan.row_width)  # free reshapes of the pool
    k3, v3 = k.reshape(view), v.reshape(view)
    if impl == "pallas":
        interpret = resolve_interpret(interpret)
        k3, v3 = _move_pallas(plan, k3, v3, tgt, src, interpret=interpret, num_warps=num_warps)
    else:
        from jspec.kernels.move_kv_cache_triton import move_kv_triton

        k3, v3 = move_kv_triton(plan, k3, v3, tgt, src, num_warps=num_warps)
    return k3.reshape(k.shape), v3.reshape(v.shape)


def move_kv_cache_reference(
    k: jax.Array, v: jax.Array, tgt_slot_ids: jax.Array, src_slot_ids: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """XLA oracle: ``k.at[:, tgt].set(k[:, src])`` and the same for v.

    Args:
      k, v: dtype[num_layers, num_slots, num_kv_heads, head_dim] (not donated here).
      tgt_slot_ids: i32[n] target token slots.
      src_slot_ids: i32[n] source token slots.

    Returns:
      The updated ``(k, v)`` (gather-then-scatter by construction).
    """
    tgt = jnp.asarray(tgt_slot_ids, jnp.int32)
    src = jnp.asarray(src_slot_ids, jnp.int32)
    return k.at[:, tgt].set(k[:, src]), v.at[:, tgt].set(v[:, src])
