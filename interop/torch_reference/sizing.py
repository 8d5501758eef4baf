"""Python references of sglang's decode allocation sizing (``mem_cache/allocation_sizing.py``, SPEC.md §3).

sglang reads ``server_args``; here the same quantities are keyword arguments::

    get_alloc_len_per_decode      no spec: 1
                                  P_alloc == 1 or K == 1 or NGRAM : max(S*K, ndt_max)
                                  else (spec-v2 tree)             : max(ceil((P-1+S)/P) * P * K, ndt_max)
    get_alloc_reserve_per_decode  2 * get_alloc_len_per_decode     (overlap double buffer)
    page_aligned_decode_alloc_lens  nxt = max(cur, ceil_P(committed + reserve)); need = sum(nxt - cur)

``P_alloc = page_size * attn_dcp_size``; ``ndt_max = max(num_draft_tokens, max_num_draft_tokens)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def get_alloc_len_per_decode(
    *,
    page_size: int,
    topk: int | None,
    num_steps: int | None,
    num_draft_tokens: int,
    max_num_draft_tokens: int = 0,
    algorithm: str | None = "EAGLE",
    attn_dcp_size: int = 1,
) -> int:
    """Slots one request may need per decode step (SPEC.md §3)."""
    if algorithm is None:
        return 1
    steps = num_steps or 1
    k = topk or 1
    ndt_max = max(num_draft_tokens, max_num_draft_tokens)
    if algorithm == "UNO":
        return ndt_max + 1
    p_alloc = page_size * attn_dcp_size
    if p_alloc == 1 or k == 1 or algorithm == "NGRAM":
        return max(steps * k, ndt_max)
    nnp_worst = ((p_alloc - 1) + steps + p_alloc - 1) // p_alloc
    return max(nnp_worst * p_alloc * k, ndt_max)


def get_alloc_reserve_per_decode(**kwargs: Any) -> int:
    """``2 * get_alloc_len_per_decode(...)`` (double buffer for the overlap scheduler's lag)."""
    return 2 * get_alloc_len_per_decode(**kwargs)


def _req_lens(req: Any) -> tuple[int, int]:
    kv = getattr(req, "kv", req)
    return int(req.kv_committed_len), int(kv.kv_allocated_len)


def page_aligned_decode_alloc_lens(
    reqs: Sequence[Any], reserve: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per request ``cur = kv_allocated_len``, ``nxt = max(cur, ceil_P(committed + reserve))``.

    ``reqs`` items have ``kv_committed_len`` and ``kv.kv_allocated_len`` (sglang) or a flat
    ``kv_allocated_len``. Returns ``(cur i64[B], nxt i64[B], need)`` with ``need = sum(nxt-cur)``.
    """
    cur, nxt = [], []
    for req in reqs:
        committed, allocated = _req_lens(req)
        target = -(-(committed + reserve) // page_size) * page_size
        cur.append(allocated)
        nxt.append(max(allocated, target))
    cur_t = torch.tensor(cur, dtype=torch.int64)
    nxt_t = torch.tensor(nxt, dtype=torch.int64)
    return cur_t, nxt_t, int((nxt_t - cur_t).sum())
