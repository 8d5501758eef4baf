"""Torch launchers of jspec's raw Triton metadata kernels (``impl="triton"``'s kernels).

``expand_page_table_torch`` / ``draft_kv_indices_torch`` launch the same kernels as jspec's
``impl="triton"`` (handed out by ``jspec.attention_meta.expand_page_table_triton_launch`` /
``draft_kv_indices_triton_launch``) on torch int32 tensors. On CPU this runs Triton's interpreter
(``TRITON_INTERPRET=1`` must be set **before triton is first imported**: ``triton.language``'s own
``@jit`` helpers such as ``tl.sum`` are decorated at import time; the first launch imports it).
The bench uses them on CUDA as the "torch + same Triton kernel" row.
"""

from __future__ import annotations

from typing import Any

from jspec.attention_meta import draft_kv_indices_triton_launch, expand_page_table_triton_launch
from jspec.config import TreeGeometry

__all__ = ["draft_kv_indices_torch", "expand_page_table_torch"]


def expand_page_table_torch(
    last_page_lens: Any,
    cache_loc: Any,
    *,
    decode_length: int,
    topk: int,
    page_size: int,
    page_table_width: int | None = None,
    num_cols: int | None = None,
    block_rows: int = 128,
    out: tuple[Any, Any] | None = None,
) -> tuple[Any, Any]:
    """The Triton expand kernel on torch int32 tensors (contiguous); no validation.

    ``out``: optional ``(cache_seqlens i32[B*K], page_table i32[B*K, width])`` buffers written
    in place (sglang style); by default fresh ones are allocated.
    """
    import torch

    cache_loc = cache_loc.contiguous()
    num_rows, row_stride = cache_loc.shape
    num_cols = row_stride if num_cols is None else num_cols
    width = num_cols if page_table_width is None else page_table_width
    if out is None:
        out = (
            torch.empty((num_rows,), dtype=torch.int32, device=cache_loc.device),
            torch.empty((num_rows, width), dtype=torch.int32, device=cache_loc.device),
        )
    cache_seqlens, page_table = out
    if num_rows == 0:
        return cache_seqlens, page_table
    kernel, grid, options = expand_page_table_triton_launch(
        num_rows,
        row_stride,
        decode_length=decode_length,
        # num_steps / num_draft_tokens: not read by this kernel.
        geometry=TreeGeometry(topk=topk, num_steps=1, num_draft_tokens=1, page_size=page_size),
        page_table_width=width,
        num_cols=num_cols,
        block_rows=block_rows,
    )
    kernel[grid](last_page_lens.contiguous(), cache_loc, cache_seqlens, page_table, **options)
    return cache_seqlens, page_table


def draft_kv_indices_torch(
    req_pool_indices: Any,
    req_to_token: Any,
    seq_lens: Any,
    *,
    topk: int,
    num_steps: int,
    page_size: int,
    kv_indices_width: int,
    kv_indices_buffer: Any | None = None,
    kv_indptr_out: Any | None = None,
    block_tokens: int = 1024,
) -> tuple[Any, Any]:
    """The Triton kv_indices kernel on torch int32 tensors; writes into ``kv_indices_buffer``.

    Without a buffer a zeroed ``(S, W)`` one is allocated; ``kv_indptr_out`` (i32[S, B*K+1],
    every entry written) likewise. No validation.
    """
    import torch

    device = seq_lens.device
    num_seqs = seq_lens.shape[0]
    if kv_indices_buffer is None:
        kv_indices_buffer = torch.zeros(
            (num_steps, kv_indices_width), dtype=torch.int32, device=device
        )
    kv_indptr = kv_indptr_out
    if kv_indptr is None:
        kv_indptr = torch.zeros((num_steps, num_seqs * topk + 1), dtype=torch.int32, device=device)
    if num_seqs == 0:
        return kv_indices_buffer, kv_indptr
    req_to_token = req_to_token.contiguous()
    kernel, grid, options = draft_kv_indices_triton_launch(
        num_seqs,
        kv_indices_width,
        req_to_token.shape[1],
        geometry=TreeGeometry(
            topk=topk, num_steps=num_steps, num_draft_tokens=1, page_size=page_size
        ),
        block_tokens=block_tokens,
    )
    kernel[grid](
        req_pool_indices.contiguous(),
        req_to_token,
        seq_lens.contiguous(),
        kv_indices_buffer,
        kv_indices_buffer,
        kv_indptr,
        **options,
    )
    return kv_indices_buffer, kv_indptr
