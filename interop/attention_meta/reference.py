"""PyTorch references of sglang's draft-decode attention metadata (SPEC.md §5.1, §6.1).

* ``draft_decode_set_expand_metadata`` (FA3 expand pass): pure torch ops as in sglang; writes
  into its first two arguments.
* ``generate_draft_decode_kv_indices`` (FlashInfer / Triton draft backends): sglang's Triton
  kernel, grid ``(S, B, K)``, as plain loops writing into the preallocated ``kv_indices``
  ``[S, W]`` and ``kv_indptr`` ``[S, >= B*K+1]`` buffers. Entries it does not write (the tail past
  the used length, ``kv_indptr[:, 0]``) keep their previous values.

Segment layout of step row ``i`` (``it = i + 1`` draft tokens visible)::

    [ (b=0,t=0): row_0[0:L_0] | draft_0,0[0:it] ][ (b=0,t=1): ... ] ... [ (b=B-1,t=K-1) ]
    off(b, t) = K*sum(L[:b]) + b*it*K + t*(L_b + it)
    draft slots: row_b[ext + 0 .. ext + it), ext = L_b + t*S            (P == 1 or K == 1)
                                             ext = base + t*nnp*P + lp  (holey, P > 1 and K > 1)
    kv_indptr[i, z] = sum(L[z' // K] for z' < z) + z*it, z = b*K + t in 1..B*K
"""

from __future__ import annotations

import torch


def draft_decode_set_expand_metadata(
    cache_seqlens_int32: torch.Tensor,
    page_table: torch.Tensor,
    last_page_lens: torch.Tensor,
    decode_length: int,
    cache_loc: torch.Tensor,
    topk: int,
    page_size: int,
) -> None:
    """In place: ``cache_seqlens_int32[:] = d + repeat(lp, K)``; ``page_table[r, :]`` gets the
    consecutive-deduplicated page ids ``cache_loc[r] // P`` (columns past them untouched)."""
    cache_seqlens_int32.copy_(
        (decode_length + torch.repeat_interleave(last_page_lens, topk)).to(torch.int32)
    )
    pages = (cache_loc // page_size).to(torch.int32)
    if pages.dim() == 1:
        pages = pages.unsqueeze(0)
    is_new = torch.ones_like(pages, dtype=torch.bool)
    is_new[:, 1:] = pages[:, 1:] != pages[:, :-1]
    col = torch.cumsum(is_new.to(torch.int64), dim=1) - 1
    page_table[: pages.shape[0], :].scatter_(1, col, pages.to(page_table.dtype))


def check_default_launch(window_size, sink_size, entry_page_size, v2p, translate) -> None:
    """sglang 0.5.23's optional launch features are not modelled: a non-default raises."""
    extras = {
        "window_size": (window_size, 0),
        "sink_size": (sink_size, 0),
        "ENTRY_PAGE_SIZE": (entry_page_size, 1),
        "v2p": (v2p, None),
        "TRANSLATE": (translate, False),
    }
    for name, (value, default) in extras.items():
        if value is not default and value != default:
            raise NotImplementedError(
                f"generate_draft_decode_kv_indices: {name}={value!r} (sglang 0.5.23's optional "
                f"launch feature) is not implemented; only {name}={default!r}"
            )


def launch_grid(
    req_pool_indices: torch.Tensor,
    kv_indices: torch.Tensor,
    positions: torch.Tensor,
    bs_upper: int,
    NUM_STEPS: int,
    num_steps: int | None,
    topk: int | None,
) -> tuple[int, int, int]:
    """The grid ``(num_seqs, num_steps, topk)`` that sglang 0.5.23 launches implicitly:
    ``num_steps = NUM_STEPS or kv_indices.shape[0]`` and ``topk = positions.numel() // num_seqs``
    unless given; ``ValueError`` unless ``bs_upper >= num_seqs``."""
    num_seqs = req_pool_indices.numel()
    if bs_upper < num_seqs:
        raise ValueError(f"bs_upper={bs_upper} must be >= the number of sequences {num_seqs}")
    if num_steps is None:
        num_steps = NUM_STEPS or kv_indices.shape[0]
    topk = positions.numel() // max(num_seqs, 1) if topk is None else topk
    return num_seqs, num_steps, topk


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
    v2p: object = None,
    TRANSLATE: bool = False,
    *,
    topk: int | None = None,
    num_steps: int | None = None,
) -> None:
    """In place, the Triton kernel's grid ``(num_steps, num_seqs, topk)`` as loops.

    Args follow sglang 0.5.23's launch: ``bs_upper`` / ``iter_upper`` / ``num_tokens_upper`` are
    the kernel's power-of-2 block bounds (``bs_upper >= num_seqs`` is checked, the others are
    unused); ``row_stride`` is ``req_to_token``'s row width; strides are the buffers' row
    strides. ``num_steps`` defaults to ``NUM_STEPS or kv_indices.shape[0]`` and ``topk`` to
    ``positions.numel() // num_seqs`` (the grid dims sglang passes implicitly). The optional
    launch features (window, ENTRY_PAGE_SIZE, TRANSLATE) are not modelled: non-defaults raise.
    """
    check_default_launch(window_size, sink_size, ENTRY_PAGE_SIZE, v2p, TRANSLATE)
    num_seqs, num_steps, topk = launch_grid(
        req_pool_indices, kv_indices, positions, bs_upper, NUM_STEPS, num_steps, topk
    )
    assert row_stride == req_to_token.shape[1], (row_stride, tuple(req_to_token.shape))
    flat_indices = kv_indices.reshape(-1)
    flat_indptr = kv_indptr.reshape(-1)
    lens = [int(x) for x in paged_kernel_lens[:num_seqs]]
    pos = [int(x) for x in positions]
    for i in range(num_steps):
        it = i + 1
        cum = 0
        for b in range(num_seqs):
            seq_len = lens[b]
            row = req_to_token[int(req_pool_indices[b])]
            lp = seq_len % page_size
            nnp = (lp + num_steps + page_size - 1) // page_size
            for t in range(topk):
                off = i * kv_indices_stride + cum * topk + b * it * topk + t * (seq_len + it)
                if page_size == 1 or topk == 1:
                    ext = seq_len + t * num_steps
                else:
                    ext = seq_len - lp + t * nnp * page_size + lp  # holey layout (§4.2)
                flat_indices[off : off + seq_len] = row[:seq_len].to(flat_indices.dtype)
                flat_indices[off + seq_len : off + seq_len + it] = row[ext : ext + it].to(
                    flat_indices.dtype
                )
                z = b * topk + t
                if z == 0:
                    z = num_seqs * topk  # program (0, 0) writes the last entry
                flat_indptr[i * kv_indptr_stride + z] = sum(pos[:z]) + z * it
            cum += seq_len
