"""PyTorch references of sglang's draft slot layout and accepted-KV moves (SPEC.md §4, §9).

Same names and argument order as sglang (``eagle_worker_common.py``, V1 ``cache_locs.py``,
``spec_utils.py``); index outputs are int64 like sglang's. The tree ops (``select_top_k_tokens``,
``organize_draft_results``, ``build_tree_kernel_efficient``, ``verify_tree_greedy``,
``tree_speculative_sampling_target_only``) live in :mod:`.tree` and are re-exported here.

Holey draft layout for P > 1 and K > 1 (one request; ``lp = L % P``, ``base = L - lp``,
``nnp = ceil((lp + S) / P)``)::

    row positions     [base + t*nnp*P, base + (t+1)*nnp*P)      region of branch t
      [0, lp)         holes: t=0 the real prefix tail; t>=1 a copy of it (draft pool only)
      [lp, lp+S)      draft slots for steps s = 0..S-1  -> out_cache_loc[b, t, s]
      [lp+S, nnp*P)   padding (allocated, unused)

For P == 1 or K == 1: ``out_cache_loc[b, t, s] = row[L + t*S + s]`` (contiguous).
"""

from __future__ import annotations

from typing import Any

import torch

from interop.tree.reference import (  # noqa: F401  (re-exports, see module docstring)
    TreeMaskMode,
    build_tree_kernel_efficient,
    organize_draft_results,
    select_top_k_tokens,
    tree_speculative_sampling_target_only,
    verify_tree_greedy,
)


def prepare_for_draft(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    page_size: int,
    draft_token_to_kv_pool: Any = None,
) -> torch.Tensor:
    """Draft write targets ``out_cache_loc`` i64 ``[B*K*S]`` (flattened ``(B, K, S)``).

    With a ``draft_token_to_kv_pool`` (P > 1 and K > 1) it also copies the prefix tail into
    every branch's holes (:func:`duplicate_prefix_tail_to_draft_branches`).
    """
    rows = req_to_token[req_pool_indices.to(torch.int64)].to(torch.int64)
    seq = seq_lens.to(torch.int64)
    branch = torch.arange(topk, dtype=torch.int64, device=seq.device)
    step = torch.arange(num_steps, dtype=torch.int64, device=seq.device)
    if page_size == 1 or topk == 1:
        pos = seq[:, None, None] + branch[None, :, None] * num_steps + step[None, None, :]
    else:
        last_page = seq % page_size
        base = seq - last_page
        nnp = (last_page + num_steps + page_size - 1) // page_size
        pos = (
            base[:, None, None]
            + branch[None, :, None] * (nnp * page_size)[:, None, None]
            + last_page[:, None, None]
            + step[None, None, :]
        )
    out = torch.gather(rows, 1, pos.reshape(rows.shape[0], -1)).reshape(-1)
    if draft_token_to_kv_pool is not None and page_size > 1 and topk > 1:
        duplicate_prefix_tail_to_draft_branches(
            draft_token_to_kv_pool, rows, base, last_page, nnp, topk, page_size
        )
    return out


def duplicate_prefix_tail_to_draft_branches(
    token_to_kv_pool: Any,
    rows: torch.Tensor,
    prefix_base: torch.Tensor,
    last_page: torch.Tensor,
    num_new_pages: torch.Tensor,
    topk: int,
    page_size: int,
) -> None:
    """Copy each request's prefix-tail KV into the holes of branches 1..K-1 (draft pool).

    One ``move_kv_cache`` of the ``(tgt, src)`` i64 slot pairs, in order b-major, then branch
    t = 1..K-1, then hole o < lp.
    """
    if topk <= 1:
        return
    tgt, src = [], []
    for b in range(rows.shape[0]):
        base, lp, nnp = int(prefix_base[b]), int(last_page[b]), int(num_new_pages[b])
        for t in range(1, topk):
            for o in range(min(lp, page_size)):
                src.append(int(rows[b, base + o]))
                tgt.append(int(rows[b, base + t * nnp * page_size + o]))
    if tgt:
        token_to_kv_pool.move_kv_cache(
            torch.tensor(tgt, dtype=torch.int64, device=rows.device),
            torch.tensor(src, dtype=torch.int64, device=rows.device),
        )


# ---- V1 verify bookkeeping (SPEC §9.3) ---------------------------------------------------------
def get_src_tgt_cache_loc(
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_index: torch.Tensor,
    accept_length: torch.Tensor,
    draft_token_num: int,
    page_size: int,
):
    """``(src, tgt zeros, to_free_num_slots)``; ``accept_index`` is flat with the -1s removed and
    ``accept_length`` is the number of correct drafts per request."""
    src = out_cache_loc[accept_index.to(torch.int64)]
    tgt = torch.zeros_like(src)
    extended = seq_lens + draft_token_num
    keep = torch.minimum(
        (seq_lens + accept_length + 1 + page_size - 1) // page_size * page_size, extended
    )
    return src, tgt, extended - keep


def get_target_cache_loc(
    tgt_cache_loc: torch.Tensor,
    to_free_slots: torch.Tensor,
    accept_length: torch.Tensor,
    to_free_num_slots: torch.Tensor,
    out_cache_loc: torch.Tensor,
    num_verify_tokens: int,
) -> None:
    """In place: per request the first ``accept_length+1`` verify slots packed into ``tgt``, the
    last ``to_free_num_slots`` packed into ``to_free_slots``."""
    tgt_off = free_off = 0
    for b in range(accept_length.numel()):
        row = out_cache_loc[b * num_verify_tokens : (b + 1) * num_verify_tokens]
        keep, drop = int(accept_length[b]) + 1, int(to_free_num_slots[b])
        tgt_cache_loc[tgt_off : tgt_off + keep] = row[:keep]
        if drop > 0:
            to_free_slots[free_off : free_off + drop] = row[num_verify_tokens - drop :]
        tgt_off += keep
        free_off += drop


# ---- V2 accepted-KV move (SPEC §9.1) ----------------------------------------------------------
def move_accept_tokens_to_target_kvcache(
    token_to_kv_pool: Any,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_index: torch.Tensor,
    accept_lens: torch.Tensor,
):
    """Move accepted nodes' target KV to ``row[L : L+accept_len]``; returns ``(tgt, src)``.

    ``accept_lens`` = accepted nodes per request (num_correct_drafts + 1). sglang passes the
    batch object; its fields are spelled out here. ``(tgt, src)`` i64 ``[B*(S+1)]``: tgt packs
    ``row[L:L+accept_len]``, src packs ``out_cache_loc[accept_index != -1]`` in (b, k) order;
    the unused tail is ``(0 -> 0)``.
    """
    bs, width = accept_index.shape
    tgt = torch.zeros(bs * width, dtype=torch.int64, device=out_cache_loc.device)
    src = torch.zeros_like(tgt)
    t_off = 0
    for b in range(bs):
        row, length, n = int(req_pool_indices[b]), int(seq_lens[b]), int(accept_lens[b])
        tgt[t_off : t_off + n] = req_to_token[row, length : length + n].to(torch.int64)
        t_off += n
    picked = accept_index.reshape(-1)
    picked = picked[picked != -1].to(torch.int64)
    src[: picked.numel()] = out_cache_loc[picked].to(torch.int64)
    token_to_kv_pool.move_kv_cache(tgt, src)
    return tgt, src
