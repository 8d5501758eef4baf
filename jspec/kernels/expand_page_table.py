"""FA3 pass-B ("expand") page table for draft decode: sglang ``draft_decode_set_expand_metadata``.

SPEC.md §5.1. For each of the ``B*K`` draft branches (rows ordered ``(b, t)``), the row of draft
slot ids ``cache_loc[r, :]`` is turned into page ids (``slot >> log2(page_size)``), consecutive
duplicates are dropped (a vectorized ``torch.unique_consecutive``) and the distinct pages are
packed to the left of the page-table row::

    cache_loc row (slots, P=4)   23 24 | 28         (d = 3)
    page ids                      5  6    7
    is_new                        1  1    1
    column = cumsum(is_new) - 1   0  1    2
    page_table row               [5, 6, 7, 0]      (width 4; columns past the distinct count: 0)

    cache_seqlens[r] = decode_length + last_page_lens[r // topk]

This module implements exactly sglang's function over the first ``num_cols`` columns of
``cache_loc`` (default: all of them, as sglang's function does). The #27360 fix (only the
``decode_length`` live columns) is ``num_cols=decode_length``, which is what
``jspec.attention_meta.page_table.draft_decode_set_expand_metadata`` passes; the kernels read the
columns in place (row stride = ``cache_loc.shape[1]``), so the slice costs no copy.

Width bound: a row of ``n = num_cols`` slots has at most ``n`` distinct consecutive pages, so a
page table ``width >= n`` can never be written past, whatever the slots are (sglang's always-on
assert ``cache_loc.shape[1] <= page_table.shape[1]``). A narrower width is a trace-time
``ValueError``.

NOTE: deviation. sglang scatters into a caller buffer and leaves columns past the distinct-page
count stale (callers start from zeros); jspec returns a fresh table with those columns **0**.

Kernels (``impl=``): ``"xla"`` (the reference), ``"pallas"`` (one program per block of rows; the
row is tiny, so the columns are unrolled and the table is built in registers with
compare-and-select, no scatter), ``"triton"`` (the same algorithm as a raw Triton kernel,
``jspec.kernels.triton_meta``, planned by :func:`triton_launch`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec import probes
from jspec._jit import jit
from jspec.config import TreeGeometry, ceil_div, check_geometry, next_power_of_2
from jspec.kernels import _common
from jspec.kernels._common import TritonLaunch

# Rows per Pallas program (power of 2). B*K <= 2048 at bs=256, K=8: 16 programs.
BLOCK_ROWS = 128
# Smallest row block: tiny blocks are legal but waste lanes for nothing.
MIN_BLOCK_ROWS = 16
NUM_WARPS = 4
IMPLS = ("xla", "pallas", "triton")


def _log2(page_size: int) -> int:
    return int(page_size).bit_length() - 1


def validate_expand_args(
    last_page_lens: jax.Array,
    cache_loc: jax.Array,
    *,
    decode_length: int,
    geometry: TreeGeometry,
    page_table_width: int,
    num_cols: int,
) -> None:
    """Trace-time checks shared by every impl; raises ``ValueError`` naming the argument."""
    check_geometry(geometry, "validate_expand_args")
    topk, page_size = geometry.topk, geometry.page_size
    probes.static_check_int(decode_length, "decode_length")
    probes.static_check(
        cache_loc.ndim == 2,
        f"cache_loc.ndim={cache_loc.ndim} must be 2 (i32[num_seqs*topk, num_cols])",
    )
    probes.static_check(
        last_page_lens.ndim == 1,
        f"last_page_lens.ndim={last_page_lens.ndim} must be 1 (i32[num_seqs])",
    )
    probes.static_check_dtype(cache_loc, jnp.int32, "cache_loc")
    probes.static_check_dtype(last_page_lens, jnp.int32, "last_page_lens")
    num_rows = last_page_lens.shape[0] * topk
    probes.static_check(
        cache_loc.shape[0] == num_rows,
        f"cache_loc.shape[0]={cache_loc.shape[0]} must be "
        f"last_page_lens.shape[0] * topk = {num_rows}",
    )
    probes.static_check(
        isinstance(num_cols, int) and 0 <= num_cols <= cache_loc.shape[1],
        f"num_cols={num_cols!r} must be an int in [0, cache_loc.shape[1]="
        f"{cache_loc.shape[1]}] (cache_loc too narrow for decode_length="
        f"{decode_length}?)",
    )
    # NOTE: the exact never-OOB bound: n slots give at most n distinct consecutive pages.
    probes.static_check(
        isinstance(page_table_width, int) and page_table_width >= num_cols,
        f"draft expand page_table too narrow: cache_loc width {num_cols} (live "
        f"columns) > "
        f"page_table_width={page_table_width} columns; page_size={page_size}, "
        f"topk={topk}, decode_length={decode_length}",
    )


# ---- reference ------------------------------------------------------------------------------
def expand_page_table_reference(
    last_page_lens: jax.Array,
    cache_loc: jax.Array,
    *,
    decode_length: int,
    geometry: TreeGeometry,
    page_table_width: int,
    num_cols: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp oracle of sglang's ``draft_decode_set_expand_metadata``.

    Args:
      last_page_lens: i32[B], ``seq_lens % page_size``.
      cache_loc: i32[B*K, W] draft slot ids, rows ordered (seq, branch); columns
        ``[0, num_cols)`` are used (default all).
      decode_length: static; draft tokens visible at this step.
      geometry: static :class:`jspec.config.TreeGeometry` (reads ``topk`` and ``page_size``).
      page_table_width: static, ``>= num_cols``.
      num_cols: static; live columns (``decode_length`` for the #27360 slice).

    Returns:
      cache_seqlens: i32[B*K] = ``decode_length + last_page_lens[r // topk]``.
      page_table: i32[B*K, page_table_width] page ids, distinct pages left-packed, 0 after.
    """
    check_geometry(geometry, "expand_page_table_reference")
    topk, page_size = geometry.topk, geometry.page_size
    if num_cols is not None:
        cache_loc = cache_loc[:, :num_cols]
    num_rows, num_cols = cache_loc.shape
    cache_seqlens = decode_length + jnp.repeat(last_page_lens, topk, total_repeat_length=num_rows)
    pages = cache_loc // page_size
    is_new = jnp.concatenate(
        [jnp.ones((num_rows, min(num_cols, 1)), bool), pages[:, 1:] != pages[:, :-1]], axis=1
    )
    col = jnp.cumsum(is_new, axis=1, dtype=jnp.int32) - 1
    # Only the first slot of each run writes (duplicates would write the same page anyway).
    col = jnp.where(is_new, col, page_table_width)
    rows = jnp.arange(num_rows, dtype=jnp.int32)[:, None]
    page_table = jnp.zeros((num_rows, page_table_width), jnp.int32)
    page_table = page_table.at[rows, col].set(pages, mode="drop")
    return cache_seqlens.astype(jnp.int32), page_table


# ---- Pallas kernel ---------------------------------------------------------------------------
def _expand_page_table_kernel(
    last_page_lens_ref,  # i32[B]
    cache_loc_ref,  # i32[B*K, W]; columns [0, num_cols) read
    cache_seqlens_ref,  # i32[B*K] (out)
    page_table_ref,  # i32[B*K, width] (out)
    *,
    num_rows: int,
    num_cols: int,
    decode_length: int,
    topk: int,
    page_shift: int,
    width: int,
    block_rows: int,
    block_cols: int,
):
    row0 = pl.program_id(0) * block_rows
    rows = row0 + jnp.arange(block_rows, dtype=jnp.int32)  # [BR]
    row_ok = rows < num_rows
    last_page_len = pltriton.load(last_page_lens_ref.at[rows // topk], mask=row_ok, other=0)
    pltriton.store(
        cache_seqlens_ref.at[pl.ds(row0, block_rows)], last_page_len + decode_length, mask=row_ok
    )

    cols = jnp.arange(block_cols, dtype=jnp.int32)[None, :]  # [1, BC]
    table = jnp.zeros((block_rows, block_cols), jnp.int32)  # [BR, BC]
    count = jnp.zeros((block_rows,), jnp.int32)  # distinct pages so far, per row
    prev_page = jnp.zeros((block_rows,), jnp.int32)
    # The row is tiny (n <= num_steps): unroll the columns. NOTE: static scalar indices are
    # jnp.int32 (a Python int indexer breaks interpret mode in jax 0.10).
    for c in range(num_cols):
        slot = pltriton.load(
            cache_loc_ref.at[pl.ds(row0, block_rows), jnp.int32(c)], mask=row_ok, other=0
        )  # [BR]
        page = jax.lax.shift_right_arithmetic(slot, jnp.int32(page_shift))  # floor(slot / P)
        is_new = (page != prev_page) if c > 0 else jnp.ones_like(row_ok)
        count = count + is_new.astype(jnp.int32)
        hit = is_new[:, None] & (cols == (count - 1)[:, None])
        table = jnp.where(hit, page[:, None], table)
        prev_page = page
    pltriton.store(
        page_table_ref.at[pl.ds(row0, block_rows), pl.ds(0, block_cols)],
        table,
        mask=row_ok[:, None] & (cols < width),
    )


def _block_rows(num_rows: int, block_rows: int) -> int:
    return min(next_power_of_2(block_rows), max(MIN_BLOCK_ROWS, next_power_of_2(num_rows)))


# ---- raw Triton (the kernel source is jspec.kernels.triton_meta's) ----------------------------
def triton_launch(
    num_rows: int,
    row_stride: int,
    *,
    decode_length: int,
    geometry: TreeGeometry,
    page_table_width: int | None = None,
    num_cols: int | None = None,
    block_rows: int = BLOCK_ROWS,
) -> TritonLaunch:
    """The raw Triton kernel behind ``impl="triton"``, planned for one call.

    Launch ``kernel[grid](last_page_lens i32[B], cache_loc i32[num_rows, row_stride],
    cache_seqlens i32[num_rows] (out), page_table i32[num_rows, page_table_width] (out),
    **options)`` on contiguous buffers (a caller's own tensors: ``interop.triton_meta``): the
    values of :func:`expand_page_table` over ``num_cols`` columns (default ``row_stride``: all,
    as sglang's function), ``page_table_width`` default ``num_cols``. No validation. Imports
    triton: set ``TRITON_INTERPRET=1`` before its first import to run in Triton's interpreter.
    """
    check_geometry(geometry, "triton_launch")
    topk, page_size = geometry.topk, geometry.page_size
    from jspec.kernels import triton_meta  # imports triton

    num_cols = row_stride if num_cols is None else num_cols
    width = num_cols if page_table_width is None else page_table_width
    options = {
        "NUM_ROWS": num_rows,
        "NUM_COLS": num_cols,
        "ROW_STRIDE": row_stride,
        "DECODE_LENGTH": decode_length,
        "TOPK": topk,
        "PAGE_SHIFT": _log2(page_size),
        "WIDTH": width,
        "BLOCK_ROWS": next_power_of_2(block_rows),
        "BLOCK_COLS": next_power_of_2(width),
        "num_warps": NUM_WARPS,
        "num_stages": 1,
    }
    grid = (ceil_div(num_rows, options["BLOCK_ROWS"]),)
    return TritonLaunch(triton_meta.get_kernel("expand_page_table"), grid, options)


# ---- public wrapper --------------------------------------------------------------------------
@jit(
    static_argnames=(
        "decode_length",
        "geometry",
        "page_table_width",
        "num_cols",
        "impl",
        "interpret",
        "block_rows",
    ),
)
def expand_page_table(
    last_page_lens: jax.Array,
    cache_loc: jax.Array,
    *,
    decode_length: int,
    geometry: TreeGeometry,
    page_table_width: int | None = None,
    num_cols: int | None = None,
    impl: str = "xla",
    interpret: bool | None = None,
    block_rows: int = BLOCK_ROWS,
) -> tuple[jax.Array, jax.Array]:
    """sglang's ``draft_decode_set_expand_metadata`` over the first ``num_cols`` columns.

    Args:
      last_page_lens: i32[B] ``seq_lens % page_size`` per request.
      cache_loc: i32[B*K, W] draft slot ids (sglang's int64 ``out_cache_loc`` is int32 here),
        rows ordered (seq, branch).
      decode_length: static; tokens added to ``cache_seqlens``.
      geometry: static :class:`jspec.config.TreeGeometry` (reads ``topk`` and ``page_size``).
      page_table_width: static output width (default ``num_cols``); must be ``>= num_cols``.
      num_cols: static; columns of ``cache_loc`` used (default ``W``: sglang's function).
      impl: ``"xla"`` | ``"pallas"`` | ``"triton"`` (GPU only).
      interpret: Pallas interpret mode; ``None`` means interpret off the GPU.
      block_rows: static; rows per Pallas/Triton program (power of 2).

    Returns:
      ``(cache_seqlens i32[B*K], page_table i32[B*K, page_table_width])``; page ids, distinct
      consecutive pages left-packed, padding columns 0. Empty batches give empty outputs.
    """
    check_geometry(geometry, "expand_page_table")
    topk = geometry.topk
    num_cols = cache_loc.shape[1] if num_cols is None else num_cols
    width = num_cols if page_table_width is None else page_table_width
    validate_expand_args(
        last_page_lens,
        cache_loc,
        decode_length=decode_length,
        geometry=geometry,
        page_table_width=width,
        num_cols=num_cols,
    )
    impl = _common.resolve_impl(impl, IMPLS, "expand_page_table")
    num_rows = cache_loc.shape[0]
    if num_rows == 0 or num_cols == 0:
        # Empty batch (or no columns): nothing to launch.
        seqlens = decode_length + jnp.repeat(last_page_lens, topk, total_repeat_length=num_rows)
        return seqlens.astype(jnp.int32), jnp.zeros((num_rows, width), jnp.int32)
    # NOTE: Any values: the keywords of two differently typed signatures, passed whole.
    kwargs: dict[str, Any] = {
        "decode_length": decode_length,
        "geometry": geometry,
        "page_table_width": width,
        "num_cols": num_cols,
    }
    if impl == "xla":
        return expand_page_table_reference(last_page_lens, cache_loc, **kwargs)
    # Pallas and Triton: one program per block of rows, the same two outputs.
    block_rows = _block_rows(num_rows, block_rows)
    out_shape = (
        jax.ShapeDtypeStruct((num_rows,), jnp.int32),
        jax.ShapeDtypeStruct((num_rows, width), jnp.int32),
    )
    if impl == "pallas":
        kernel = functools.partial(
            _expand_page_table_kernel,
            num_rows=num_rows,
            num_cols=num_cols,
            decode_length=decode_length,
            topk=topk,
            page_shift=_log2(geometry.page_size),
            width=width,
            block_rows=block_rows,
            block_cols=next_power_of_2(width),
        )
        return _common.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=(pl.cdiv(num_rows, block_rows),),
            interpret=interpret,
            num_warps=NUM_WARPS,
            name="jspec_expand_page_table",
        )(last_page_lens, cache_loc)
    launch = triton_launch(num_rows, cache_loc.shape[1], **kwargs, block_rows=block_rows)
    return _common.triton_call(
        launch,
        last_page_lens,
        cache_loc,
        out_shape=out_shape,
        name="jspec_expand_page_table_triton",
    )
