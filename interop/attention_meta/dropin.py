"""Drop-ins for sglang's draft-decode attention metadata, computed by jspec.

Signatures and in-place conventions of sglang 0.5.23 (see :mod:`interop.tree.dropin` for the
conversion rules). Write-back follows sglang exactly, including what it leaves alone:

* ``draft_decode_set_expand_metadata`` (``flashattention_backend.py``): page_table columns past
  each row's distinct-page count keep their old values (jspec itself returns zeros there).
* ``generate_draft_decode_kv_indices`` (the Triton kernel of ``kernels/ops/speculative/
  cache_locs.py``, launched over ``(num_steps, num_seqs, topk)``; the grid is inferred:
  ``num_steps = NUM_STEPS or kv_indices.shape[0]``, ``num_seqs = req_pool_indices.numel()``,
  ``topk = positions.numel() // num_seqs``, or pass ``num_steps=`` / ``topk=``): kv_indices
  entries past the used length and ``kv_indptr[:, 0]`` keep their old values; ``positions`` is not
  read (jspec derives it from ``paged_kernel_lens``, which equals sglang's
  ``repeat_interleave(seq_lens, K)``). The optional 0.5.23 launch features (``window_size``,
  ``sink_size``, ``ENTRY_PAGE_SIZE``, ``v2p``/``TRANSLATE``) are not implemented: a non-default
  value raises ``NotImplementedError``; ``NUM_STEPS`` (token-block tiling) changes no values.
"""

from __future__ import annotations

from typing import Any

import torch

from interop._adapt import jspec_module as _mod
from interop._adapt import run_jspec, tree_geometry
from interop._adapt import to_jax_default as _j
from interop.attention_meta.reference import check_default_launch, launch_grid
from interop.dlpack import to_jax, to_torch

__all__ = ["draft_decode_set_expand_metadata", "generate_draft_decode_kv_indices"]


def draft_decode_set_expand_metadata(
    cache_seqlens_int32: torch.Tensor,
    page_table: torch.Tensor,
    last_page_lens: torch.Tensor,
    decode_length: int,
    cache_loc: torch.Tensor,
    topk: int,
    page_size: int,
    *,
    impl: str = "xla",
    interpret: bool | None = None,
) -> None:
    """In place into ``cache_seqlens_int32`` and ``page_table`` over all of ``cache_loc``'s
    columns (sglang's function; callers slice ``cache_loc`` to the live steps, PR #27360)."""
    loc = cache_loc.unsqueeze(0) if cache_loc.dim() == 1 else cache_loc
    rows, cols = loc.shape
    # NOTE: checked before any work: cache_seqlens_int32 is written first, so a page_table
    # found too small afterwards would leave it half-updated.
    if tuple(cache_seqlens_int32.shape) != (rows,):
        raise ValueError(
            f"cache_seqlens_int32.shape={tuple(cache_seqlens_int32.shape)} must be ({rows},), "
            f"one entry per cache_loc row"
        )
    if page_table.dim() != 2 or page_table.shape[0] < rows:
        raise ValueError(
            f"page_table.shape={tuple(page_table.shape)} must be 2-D with >= {rows} rows "
            f"(cache_loc.shape={tuple(cache_loc.shape)})"
        )
    width = page_table.shape[1]
    seqlens, table = run_jspec(
        _mod("jspec.attention_meta.page_table").draft_decode_set_expand_metadata,
        _j(last_page_lens, "last_page_lens"),
        decode_length,
        _j(loc, "cache_loc"),
        geometry=tree_geometry(topk=topk, page_size=page_size),
        page_table_width=max(width, cols),
        num_cols=cols,
        impl=impl,
        interpret=interpret,
    )
    cache_seqlens_int32.copy_(to_torch(seqlens))
    pages = loc // page_size
    distinct = 1 + (pages[:, 1:] != pages[:, :-1]).sum(dim=1) if cols else torch.zeros(rows)
    written = torch.arange(width, device=loc.device)[None, :] < distinct[:, None]
    new = to_torch(table)[:, :width].to(page_table.device, page_table.dtype)
    page_table[:rows] = torch.where(written, new, page_table[:rows])


def _check_kv_buffers(
    kv_indices: torch.Tensor, kv_indptr: torch.Tensor, num_steps: int, rows: int
) -> None:
    """Both output buffers' shapes before any work (kv_indices is written first, so a kv_indptr
    found too small afterwards would leave the call half-done)."""
    if kv_indices.dim() != 2 or kv_indices.shape[0] < num_steps:
        raise ValueError(
            f"kv_indices.shape={tuple(kv_indices.shape)} must be 2-D with >= num_steps="
            f"{num_steps} rows"
        )
    if kv_indptr.dim() != 2 or kv_indptr.shape[0] < num_steps or kv_indptr.shape[1] < rows + 1:
        raise ValueError(
            f"kv_indptr.shape={tuple(kv_indptr.shape)} must be 2-D with >= num_steps="
            f"{num_steps} rows and >= num_seqs*topk+1={rows + 1} columns"
        )


def generate_draft_decode_kv_indices(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    paged_kernel_lens: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    positions: torch.Tensor,
    row_stride: int,
    kv_indices_stride: int,
    kv_indptr_stride: int,
    bs_upper: int,
    iter_upper: int,
    num_tokens_upper: int,
    page_size: int,
    window_size: int = 0,
    sink_size: int = 0,
    NUM_STEPS: int = 0,
    ENTRY_PAGE_SIZE: int = 1,
    v2p: Any = None,
    TRANSLATE: bool = False,
    *,
    topk: int | None = None,
    num_steps: int | None = None,
    impl: str = "xla",
    interpret: bool | None = None,
) -> None:
    """In place into ``kv_indices`` [S, W] and ``kv_indptr`` [S, >= B*K+1] (see module doc)."""
    check_default_launch(window_size, sink_size, ENTRY_PAGE_SIZE, v2p, TRANSLATE)
    if req_pool_indices.numel() == 0:
        return  # sglang launches an empty grid: nothing is written
    num_seqs, num_steps, topk = launch_grid(
        req_pool_indices, kv_indices, positions, bs_upper, NUM_STEPS, num_steps, topk
    )
    _check_kv_buffers(kv_indices, kv_indptr, num_steps, num_seqs * topk)
    indices, indptr = run_jspec(
        _mod("jspec.attention_meta.kv_indices").generate_draft_decode_kv_indices,
        _j(req_pool_indices, "req_pool_indices"),
        _j(req_to_token, "req_to_token"),
        _j(paged_kernel_lens[:num_seqs], "paged_kernel_lens"),
        geometry=tree_geometry(topk=topk, num_steps=num_steps, page_size=page_size),
        kv_indices_width=kv_indices.shape[1],
        kv_indices_buffer=to_jax(
            kv_indices[:num_steps], safe_for_donation=True, what="kv_indices", device="default"
        ),
        impl=impl,
        interpret=interpret,
    )
    kv_indices[:num_steps].copy_(to_torch(indices))
    rows = num_seqs * topk
    kv_indptr[:num_steps, 1 : rows + 1] = to_torch(indptr)[:, 1:].to(
        kv_indptr.device, kv_indptr.dtype
    )
