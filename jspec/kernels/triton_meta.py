"""Raw Triton kernels for the draft-decode attention metadata (sources only).

Two kernels, the same algorithms as the Pallas ones (see their modules for the semantics):

* ``_expand_page_table_triton_kernel``: SPEC.md §5.1 (``jspec.kernels.expand_page_table``);
* ``_draft_kv_indices_triton_kernel``: SPEC.md §6.1 (``jspec.kernels.draft_kv_indices``).

Each op module plans a launch (``triton_launch``: kernel, grid, constexprs and launch options)
and runs it on JAX arrays through ``jax_triton`` (GPU only); the same plans reach PyTorch callers
through ``jspec.attention_meta``'s ``*_triton_launch`` (``interop.triton_meta``: Triton's
interpreter on CPU, the bench's "torch + same Triton kernel" row on CUDA). This module imports
triton; the op modules import it only when a Triton launch is planned.

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
from typing import Any

import triton.language as tl

from jspec.kernels import _common


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
