"""jspec behind sglang's signatures: drop-in torch functions computed by jspec.

Every function here has the signature and in-place convention of its torch reference in
:mod:`interop.torch_reference` (and of sglang): inputs go through the DLPack shim (zero-copy
where DLPack allows; sglang's int64 index tensors are range-checked and cast to int32), the jspec
op runs (``impl=`` picks its kernel), and results are written back into the caller's tensors
(``tensor.copy_(to_torch(result))``) or returned with sglang's dtypes (int64 indices).

Write-back follows sglang exactly, including what it leaves alone:

* ``draft_decode_set_expand_metadata``: page_table columns past each row's distinct-page count
  keep their old values (jspec itself returns zeros there).
* ``generate_draft_decode_kv_indices``: kv_indices entries past the used length and
  ``kv_indptr[:, 0]`` keep their old values; ``positions`` is not read (jspec derives it from
  ``paged_kernel_lens``, which equals sglang's ``repeat_interleave(seq_lens, K)``).
* ``verify_tree_greedy`` / ``tree_speculative_sampling_target_only``: only the accepted nodes'
  ``predicts`` and the written ``accept_index`` entries change. ``draft_probs`` is not written
  (jspec's target-only sampler keeps the rejected mass internally).

The KV, layout and accept adapters live in :mod:`interop.torch_api_kv` and the allocator in
:mod:`interop.torch_api_allocator`; both are re-exported here.

jspec modules are looked up at call time (``jspec.tree.verify.verify_tree_greedy`` etc.), so a
test can monkeypatch an op and see the adapter use the patched version.
"""

from __future__ import annotations

from typing import Any

import torch

from interop._adapt import jspec_module as _mod
from interop._adapt import to_jax_default as _j
from interop._adapt import to_torch_as as _t
from interop.dlpack import to_jax, to_torch
from interop.torch_api_allocator import (  # noqa: F401  (re-exported sglang names)
    PagedTokenToKVPoolAllocator,
    get_last_loc,
)
from interop.torch_api_kv import (  # noqa: F401  (re-exported sglang names)
    assign_req_to_token_pool,
    duplicate_prefix_tail_to_draft_branches,
    move_accept_tokens_to_target_kvcache,
    move_kv_cache,
    prepare_for_draft,
)
from jspec.kernels._common import next_power_of_2


# ---- tree ------------------------------------------------------------------------------------------
def select_top_k_tokens(
    i: int,
    topk_p: torch.Tensor,
    topk_index: torch.Tensor,
    hidden_states: torch.Tensor,
    scores: torch.Tensor | None,
    topk: int,
):
    """``(input_ids i64, hidden, scores, (score_entry, tokens i64, parents i64))``."""
    out = _mod("jspec.tree.select").select_top_k_tokens(
        i,
        _j(topk_p, "topk_p"),
        _j(topk_index, "topk_index"),
        _j(hidden_states, "hidden"),
        None if scores is None else _j(scores, "scores"),
        topk=topk,
    )
    ids, hidden, new_scores, (entry, tokens, parents) = out
    f = topk_p.dtype
    return (
        _t(ids, topk_p),
        _t(hidden, hidden_states, hidden_states.dtype),
        _t(new_scores, topk_p, f),
        (_t(entry, topk_p, f), _t(tokens, topk_p), _t(parents, topk_p)),
    )


def organize_draft_results(
    score_list: list[torch.Tensor],
    token_list: list[torch.Tensor],
    parents_list: list[torch.Tensor],
    num_draft_tokens: int,
):
    """``(parent_list i64, top_scores_index i64, draft_tokens i64)``."""
    parent_list, sel, draft = _mod("jspec.tree.select").organize_draft_results(
        [_j(s, "score") for s in score_list],
        [_j(t, "tokens") for t in token_list],
        [_j(p, "parents") for p in parents_list],
        num_draft_tokens=num_draft_tokens,
    )
    like = score_list[0]
    return _t(parent_list, like), _t(sel, like), _t(draft, like, token_list[0].dtype)


def build_tree_kernel_efficient(
    verified_id: torch.Tensor,
    parent_list: torch.Tensor,
    top_scores_index: torch.Tensor,
    draft_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_sum: int,
    topk: int,
    spec_steps: int,
    num_verify_tokens: int,
    tree_mask_mode: int = 0,
    tree_mask_buf: torch.Tensor | None = None,
    position_buf: torch.Tensor | None = None,
    fill_prefix_mask: bool = True,
    *,
    impl: str = "xla",
    interpret: bool | None = None,
):
    """sglang's 6-tuple; FULL_MASK is flattened to sglang's ragged ``ΣL·N + B·N²`` layout."""
    build = _mod("jspec.tree.build")
    mode = build.TreeMaskMode(int(tree_mask_mode))
    n = num_verify_tokens
    max_len = None
    if mode == build.TreeMaskMode.FULL_MASK:
        max_len = next_power_of_2(int(seq_lens.max()) if seq_lens.numel() else 1)
    out = build.build_tree_kernel_efficient(
        _j(verified_id, "verified_id"),
        _j(parent_list, "parent_list"),
        _j(top_scores_index, "top_scores_index"),
        _j(draft_tokens, "draft_tokens"),
        _j(seq_lens, "seq_lens"),
        topk=topk,
        num_steps=spec_steps,
        num_draft_tokens=n,
        mode=mode,
        max_seq_len=max_len,
        fill_prefix_mask=fill_prefix_mask,
        impl=impl,
        interpret=interpret,
    )
    mask = to_torch(out.tree_mask)
    if mode == build.TreeMaskMode.FULL_MASK:
        lens = seq_lens.tolist()
        mask = torch.cat(
            [mask[b, :, : lens[b] + n].reshape(-1) for b in range(len(lens))]
            or [torch.zeros(0, dtype=torch.bool)]
        )
    mask = mask.reshape(-1).to(seq_lens.device)
    if tree_mask_buf is not None:
        tree_mask_buf.view(-1)[: mask.numel()].copy_(mask)
        mask = tree_mask_buf
    positions = _t(out.positions, seq_lens)
    if position_buf is not None:
        position_buf.view(-1)[: positions.numel()].copy_(positions)
        positions = position_buf
    return (
        mask,
        positions,
        _t(out.retrive_index, seq_lens),
        _t(out.retrive_next_token, seq_lens),
        _t(out.retrive_next_sibling, seq_lens),
        _t(out.draft_tokens, seq_lens, torch.promote_types(verified_id.dtype, draft_tokens.dtype)),
    )


def _write_accept(
    predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor, out: tuple
) -> None:
    """sglang's write set: accepted nodes' predicts, written accept_index entries, counts."""
    new_predicts, new_accept, new_num = (to_torch(x).to(predicts.device) for x in out)
    written = new_accept != -1
    accept_index[written] = new_accept[written].to(accept_index.dtype)
    ids = new_accept[written].to(torch.int64)
    predicts[ids] = new_predicts[ids].to(predicts.dtype)
    accept_token_num.copy_(new_num)


def verify_tree_greedy(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
    *,
    impl: str = "xla",
    interpret: bool | None = None,
) -> None:
    """In place into ``predicts``, ``accept_index`` and ``accept_token_num`` (as sgl_kernel)."""
    out = _mod("jspec.tree.verify").verify_tree_greedy(
        _j(candidates, "candidates"),
        _j(retrive_index, "retrive_index"),
        _j(retrive_next_token, "retrive_next_token"),
        _j(retrive_next_sibling, "retrive_next_sibling"),
        _j(target_predict, "target_predict"),
        num_spec_steps=accept_index.shape[1],
        impl=impl,
        interpret=interpret,
    )
    _write_accept(predicts, accept_index, accept_token_num, out)


def tree_speculative_sampling_target_only(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """In place like :func:`verify_tree_greedy` (``draft_probs`` is not written)."""
    out = _mod("jspec.tree.sampling").tree_speculative_sampling_target_only(
        _j(candidates, "candidates"),
        _j(retrive_index, "retrive_index"),
        _j(retrive_next_token, "retrive_next_token"),
        _j(retrive_next_sibling, "retrive_next_sibling"),
        _j(uniform_samples, "coins"),
        _j(uniform_samples_for_final_sampling, "final coins"),
        _j(target_probs, "target_probs"),
        num_spec_steps=accept_index.shape[1],
        threshold_single=threshold_single,
        threshold_acc=threshold_acc,
        deterministic=deterministic,
    )
    _write_accept(predicts, accept_index, accept_token_num, out)


# ---- attention metadata ------------------------------------------------------------------------------
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
    width = page_table.shape[1]
    seqlens, table = _mod("jspec.kernels.expand_page_table").expand_page_table(
        _j(last_page_lens, "last_page_lens"),
        _j(loc, "cache_loc"),
        decode_length=decode_length,
        topk=topk,
        page_size=page_size,
        page_table_width=max(width, cols),
        impl=impl,
        interpret=interpret,
    )
    cache_seqlens_int32.copy_(to_torch(seqlens))
    pages = loc // page_size
    distinct = 1 + (pages[:, 1:] != pages[:, :-1]).sum(dim=1) if cols else torch.zeros(rows)
    written = torch.arange(width, device=loc.device)[None, :] < distinct[:, None]
    new = to_torch(table)[:, :width].to(page_table.device, page_table.dtype)
    page_table[:rows] = torch.where(written, new, page_table[:rows])


def generate_draft_decode_kv_indices(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    paged_kernel_lens: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    positions: torch.Tensor,
    pool_len: int,
    kv_indices_stride: int,
    kv_indptr_stride: int,
    bs: int,
    iter_upper: int,
    num_tokens_upper: int,
    page_size: int,
    *,
    topk: int | None = None,
    num_steps: int | None = None,
    impl: str = "xla",
    interpret: bool | None = None,
) -> None:
    """In place into ``kv_indices`` [S, W] and ``kv_indptr`` [S, >= B*K+1] (see module doc)."""
    num_seqs = req_pool_indices.numel()
    if bs < num_seqs:
        raise ValueError(f"bs={bs} must be >= the number of sequences {num_seqs}")
    num_steps = kv_indices.shape[0] if num_steps is None else num_steps
    topk = positions.numel() // max(num_seqs, 1) if topk is None else topk
    indices, indptr = _mod("jspec.attention_meta.kv_indices").generate_draft_decode_kv_indices(
        _j(req_pool_indices, "req_pool_indices"),
        _j(req_to_token, "req_to_token"),
        _j(paged_kernel_lens[:num_seqs], "paged_kernel_lens"),
        topk=topk,
        num_steps=num_steps,
        page_size=page_size,
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


# ---- sizing ----------------------------------------------------------------------------------------
def get_alloc_len_per_decode(
    *,
    page_size: int,
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
    max_num_draft_tokens: int = 0,
) -> int:
    """jspec's ``SpecConfig.alloc_len_per_decode`` (EAGLE, no DCP)."""
    cfg = _mod("jspec.config").SpecConfig(
        page_size=page_size,
        topk=topk,
        num_steps=num_steps,
        num_draft_tokens=num_draft_tokens,
        max_num_draft_tokens=max_num_draft_tokens,
    )
    return cfg.alloc_len_per_decode


def page_aligned_decode_alloc_lens(reqs: list[Any], reserve: int, page_size: int):
    """``(cur i64[B], nxt i64[B], need)`` through ``jspec.kv.decode_alloc``."""
    committed = torch.tensor([int(r.kv_committed_len) for r in reqs], dtype=torch.int32)
    allocated = torch.tensor(
        [int(getattr(r, "kv", r).kv_allocated_len) for r in reqs], dtype=torch.int32
    )
    cur, nxt, need = _mod("jspec.kv.decode_alloc").page_aligned_decode_alloc_lens(
        _j(committed, "committed"), _j(allocated, "allocated"), reserve=reserve, page_size=page_size
    )
    return _t(cur, device="cpu"), _t(nxt, device="cpu"), int(need)
