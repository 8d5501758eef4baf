"""Raw Triton kernels for the draft-decode attention metadata, plus their launchers.

Two kernels, the same algorithms as the Pallas ones (see their modules for the semantics):

* ``_expand_page_table_triton_kernel``: SPEC.md §5.1 (``jspec.kernels.expand_page_table``);
* ``_draft_kv_indices_triton_kernel``: SPEC.md §6.1 (``jspec.kernels.draft_kv_indices``).

Launchers: ``expand_page_table_triton`` / ``draft_kv_indices_triton`` take JAX arrays through
``jax_triton.triton_call`` (GPU only; ``jax_triton`` is imported inside them, because it cannot
be imported on a CPU-only machine). The torch-tensor launchers of the same kernels (Triton's
interpreter on CPU, the bench's "torch + same Triton kernel" row on CUDA) are
``interop.triton_meta``'s.

The kernel functions are plain Python functions here and are wrapped with ``triton.jit`` on
first use (:func:`get_kernel`), so whichever mode (compiled or interpreted) is active at that
moment is the one used.

Parameter order (both launch paths): input pointers, output pointers, then ``tl.constexpr``
metaparameters (jax_triton appends the output pointers after the inputs; with
``input_output_aliases`` the aliased input still has its own pointer parameter, jax-triton 0.3.1).
Every shape-derived value is a constexpr, so there are no runtime scalar parameters (this also
sidesteps jax-triton's ``== 1`` scalar specialization).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import triton
import triton.language as tl

from jspec.config import next_power_of_2
from jspec.kernels import _common

NUM_WARPS = 4


# ---- kernels ---------------------------------------------------------------------------------
def _expand_page_table_triton_kernel(
    last_page_lens_ptr,  # i32[B]
    cache_loc_ptr,  # i32[B*K, ROW_STRIDE]; columns [0, NUM_COLS) read
    cache_seqlens_ptr,  # i32[B*K] (out)
    page_table_ptr,  # i32[B*K, WIDTH] (out)
    NUM_ROWS: tl.constexpr,
    NUM_COLS: tl.constexpr,
    ROW_STRIDE: tl.constexpr,
    DECODE_LENGTH: tl.constexpr,
    TOPK: tl.constexpr,
    PAGE_SHIFT: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    row0 = tl.program_id(0) * BLOCK_ROWS
    rows = row0 + tl.arange(0, BLOCK_ROWS)  # [BR]
    row_ok = rows < NUM_ROWS
    last_page_len = tl.load(last_page_lens_ptr + rows // TOPK, mask=row_ok, other=0)
    tl.store(cache_seqlens_ptr + rows, last_page_len + DECODE_LENGTH, mask=row_ok)

    cols = tl.arange(0, BLOCK_COLS)[None, :]  # [1, BC]
    table = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.int32)
    count = tl.zeros((BLOCK_ROWS,), dtype=tl.int32)
    prev_page = tl.zeros((BLOCK_ROWS,), dtype=tl.int32)
    row_ptr = cache_loc_ptr + rows.to(tl.int64) * ROW_STRIDE
    for c in tl.static_range(NUM_COLS):
        slot = tl.load(row_ptr + c, mask=row_ok, other=0)
        page = slot >> PAGE_SHIFT  # arithmetic shift: floor(slot / page_size)
        is_new = (page != prev_page) | (c == 0)
        count += is_new.to(tl.int32)
        hit = is_new[:, None] & (cols == (count - 1)[:, None])
        table = tl.where(hit, page[:, None], table)
        prev_page = page
    out_ptr = page_table_ptr + rows.to(tl.int64)[:, None] * WIDTH + cols
    tl.store(out_ptr, table, mask=row_ok[:, None] & (cols < WIDTH))


def _draft_kv_indices_triton_kernel(
    req_pool_indices_ptr,  # i32[B]
    req_to_token_ptr,  # i32[num_req_rows, ROW_WIDTH]
    seq_lens_ptr,  # i32[B]
    kv_indices_in_ptr,  # i32[S, WIDTH] (aliased to kv_indices_ptr; unused)
    kv_indices_ptr,  # i32[S, WIDTH] (out)
    kv_indptr_ptr,  # i32[S, B*K+1] (out)
    NUM_SEQS: tl.constexpr,
    TOPK: tl.constexpr,
    NUM_STEPS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    WIDTH: tl.constexpr,
    ROW_WIDTH: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    BLOCK_SEQS: tl.constexpr,
    BLOCK_STEPS: tl.constexpr,
):
    seq = tl.program_id(0)
    branch = tl.program_id(1)
    seq_ids = tl.arange(0, BLOCK_SEQS)
    all_lens = tl.load(seq_lens_ptr + seq_ids, mask=seq_ids < NUM_SEQS, other=0)  # [BS]
    cum_len = tl.sum(tl.where(seq_ids < seq, all_lens, 0))  # sum_{b' < b} L_b'
    total_len = tl.sum(all_lens)
    seq_len = tl.load(seq_lens_ptr + seq)
    req = tl.load(req_pool_indices_ptr + seq)
    z = seq * TOPK + branch
    seg_base = cum_len * TOPK + branch * seq_len  # segment (b, t) of row i: seg_base + z*(i+1)
    indptr_width: tl.constexpr = NUM_SEQS * TOPK + 1

    for i in tl.static_range(NUM_STEPS):
        tl.store(kv_indptr_ptr + i * indptr_width + z, seg_base + z * (i + 1))
    if (seq == NUM_SEQS - 1) & (branch == TOPK - 1):
        for i in tl.static_range(NUM_STEPS):
            tl.store(
                kv_indptr_ptr + i * indptr_width + NUM_SEQS * TOPK,
                total_len * TOPK + NUM_SEQS * TOPK * (i + 1),
            )

    # Prefix: each token block is loaded once and stored into all S step rows.
    row_ptr = req_to_token_ptr + req.to(tl.int64) * ROW_WIDTH
    copy_len = tl.minimum(seq_len, ROW_WIDTH)
    # NOTE: a while loop, not range(0, seq_len, ...): Triton's interpreter cannot take a tensor
    # range bound under numpy >= 2.4 (its loaded scalars are 1-element arrays).
    tok0 = seq_len * 0
    while tok0 < seq_len:
        tok = tok0 + tl.arange(0, BLOCK_TOKENS)  # [BT]
        slots = tl.load(row_ptr + tok, mask=tok < copy_len, other=0)
        for i in tl.static_range(NUM_STEPS):
            start = seg_base + z * (i + 1)
            tl.store(
                kv_indices_ptr + i * WIDTH + start + tok,
                slots,
                mask=(tok < seq_len) & (start + tok < WIDTH),
            )
        tok0 += BLOCK_TOKENS

    # Draft slots: row[ext + s] for s <= i, right after the prefix. NOTE: jspec._layout's
    # draft_ext_start spelled out in tl code (a Triton kernel calls only triton.jit functions).
    if PAGE_SIZE == 1 or TOPK == 1:
        ext = seq_len + branch * NUM_STEPS
    else:
        last_page_len = seq_len % PAGE_SIZE
        num_new_pages = (last_page_len + NUM_STEPS + PAGE_SIZE - 1) // PAGE_SIZE
        ext = seq_len - last_page_len + branch * num_new_pages * PAGE_SIZE + last_page_len
    step = tl.arange(0, BLOCK_STEPS)
    pos = ext + step
    draft_slots = tl.load(
        row_ptr + pos, mask=(step < NUM_STEPS) & (pos >= 0) & (pos < ROW_WIDTH), other=0
    )
    for i in tl.static_range(NUM_STEPS):
        start = seg_base + z * (i + 1) + seq_len
        tl.store(
            kv_indices_ptr + i * WIDTH + start + step,
            draft_slots,
            mask=(step <= i) & (start + step < WIDTH),
        )


_KERNELS: dict[str, Callable[..., Any]] = {
    "expand_page_table": _expand_page_table_triton_kernel,
    "draft_kv_indices": _draft_kv_indices_triton_kernel,
}


def get_kernel(name: str) -> Any:
    """``triton.jit`` of the named kernel for the current mode (:func:`_common.triton_jit`)."""
    return _common.triton_jit(_KERNELS[name])


class TritonLaunch(NamedTuple):
    """One launch of a raw Triton kernel: ``kernel[grid](*pointers, **options)``.

    The pointers follow the kernel's parameter order (inputs, then outputs: module docstring);
    ``jax_triton.triton_call`` takes the same three as ``kernel=``, ``grid=`` and keywords.
    """

    kernel: Any  # the ``triton.jit`` kernel of the current mode (:func:`get_kernel`)
    grid: tuple[int, ...]
    options: dict[str, int]  # constexpr metaparameters, num_warps, num_stages


def expand_launch(
    num_rows: int,
    row_stride: int,
    *,
    decode_length: int,
    topk: int,
    page_size: int,
    page_table_width: int,
    num_cols: int,
    block_rows: int,
) -> TritonLaunch:
    """The expand kernel over ``cache_loc i32[num_rows, row_stride]`` (both launchers)."""
    options = {
        "NUM_ROWS": num_rows,
        "NUM_COLS": num_cols,
        "ROW_STRIDE": row_stride,
        "DECODE_LENGTH": decode_length,
        "TOPK": topk,
        "PAGE_SHIFT": int(page_size).bit_length() - 1,
        "WIDTH": page_table_width,
        "BLOCK_ROWS": next_power_of_2(block_rows),
        "BLOCK_COLS": next_power_of_2(page_table_width),
        "num_warps": NUM_WARPS,
        "num_stages": 1,
    }
    grid = (triton.cdiv(num_rows, options["BLOCK_ROWS"]),)
    return TritonLaunch(get_kernel("expand_page_table"), grid, options)


def kv_indices_launch(
    num_seqs: int,
    width: int,
    row_width: int,
    *,
    topk: int,
    num_steps: int,
    page_size: int,
    block_tokens: int,
) -> TritonLaunch:
    """The kv_indices kernel: ``num_seqs`` rows of ``req_to_token i32[*, row_width]`` into
    ``kv_indices i32[num_steps, width]`` (both launchers)."""
    options = {
        "NUM_SEQS": num_seqs,
        "TOPK": topk,
        "NUM_STEPS": num_steps,
        "PAGE_SIZE": page_size,
        "WIDTH": width,
        "ROW_WIDTH": row_width,
        "BLOCK_TOKENS": next_power_of_2(block_tokens),
        "BLOCK_SEQS": next_power_of_2(num_seqs),
        "BLOCK_STEPS": next_power_of_2(num_steps),
        "num_warps": NUM_WARPS,
        "num_stages": 1,
    }
    return TritonLaunch(get_kernel("draft_kv_indices"), (num_seqs, topk), options)


# ---- JAX launchers (jax_triton, GPU only) -----------------------------------------------------
def expand_page_table_triton(
    last_page_lens: Any,
    cache_loc: Any,
    *,
    decode_length: int,
    topk: int,
    page_size: int,
    page_table_width: int,
    num_cols: int,
    block_rows: int,
) -> tuple[Any, Any]:
    """``expand_page_table`` through ``jax_triton.triton_call``; inputs already validated."""
    import jax
    import jax.numpy as jnp

    jt = _common.import_jax_triton()

    num_rows = cache_loc.shape[0]
    launch = expand_launch(
        num_rows,
        cache_loc.shape[1],
        decode_length=decode_length,
        topk=topk,
        page_size=page_size,
        page_table_width=page_table_width,
        num_cols=num_cols,
        block_rows=block_rows,
    )
    return jt.triton_call(
        last_page_lens,
        cache_loc,
        kernel=launch.kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_rows,), jnp.int32),
            jax.ShapeDtypeStruct((num_rows, page_table_width), jnp.int32),
        ),
        grid=launch.grid,
        name="jspec_expand_page_table_triton",
        **launch.options,
    )


def draft_kv_indices_triton(
    req_pool_indices: Any,
    req_to_token: Any,
    seq_lens: Any,
    kv_indices_buffer: Any,
    *,
    topk: int,
    num_steps: int,
    page_size: int,
    block_tokens: int,
) -> tuple[Any, Any]:
    """``draft_kv_indices`` through ``jax_triton.triton_call``; the buffer is aliased."""
    import jax
    import jax.numpy as jnp

    jt = _common.import_jax_triton()

    num_seqs = seq_lens.shape[0]
    width = kv_indices_buffer.shape[1]
    launch = kv_indices_launch(
        num_seqs,
        width,
        req_to_token.shape[1],
        topk=topk,
        num_steps=num_steps,
        page_size=page_size,
        block_tokens=block_tokens,
    )
    return jt.triton_call(
        req_pool_indices,
        req_to_token,
        seq_lens,
        kv_indices_buffer,
        kernel=launch.kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_steps, width), jnp.int32),
            jax.ShapeDtypeStruct((num_steps, num_seqs * topk + 1), jnp.int32),
        ),
        grid=launch.grid,
        input_output_aliases={3: 0},
        name="jspec_draft_kv_indices_triton",
        **launch.options,
    )
