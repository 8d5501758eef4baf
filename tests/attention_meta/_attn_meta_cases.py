"""Test helpers for attention metadata: a realistic draft batch and independent loop oracles.

Everything here is plain numpy/python, written from SPEC.md §4.2, §5, §6.1 without looking at
the jspec implementation.
"""

from __future__ import annotations

import numpy as np


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def ext_start(seq_len: int, branch: int, *, topk: int, num_steps: int, page_size: int) -> int:
    """Row position of branch ``branch``'s step-0 draft slot (SPEC.md §4.2)."""
    if page_size == 1 or topk == 1:
        return seq_len + branch * num_steps
    lp = seq_len % page_size
    base = seq_len - lp
    nnp = ceil_div(lp + num_steps, page_size)
    return base + branch * nnp * page_size + lp


def make_draft_batch(
    rng: np.random.Generator,
    seq_lens: list[int],
    *,
    topk: int,
    num_steps: int,
    page_size: int,
    num_req_rows: int | None = None,
    row_slack: int = 3,
) -> dict[str, np.ndarray]:
    """A batch laid out like sglang's allocator + ``prepare_for_draft``.

    Request ``b`` gets a random req_to_token row in ``1 .. num_req_rows-1`` (row 0 stays the
    all-zero padding row). Row page ``k`` maps to a random physical page ``>= 1`` (page 0 is the
    dummy page), offset = position % P, so the page-correspondence invariant holds.
    """
    seq_lens = [int(x) for x in seq_lens]
    num_seqs = len(seq_lens)
    P, K, S = page_size, topk, num_steps
    need = []
    for L in seq_lens:
        end = max(L + K * S, ext_start(L, K - 1, topk=K, num_steps=S, page_size=P) + S)
        need.append(ceil_div(end, P) * P)
    row_width = (max(need, default=P) // P + row_slack) * P
    num_req_rows = num_req_rows or num_seqs + 2
    rows = rng.permutation(np.arange(1, num_req_rows))[:num_seqs]
    total_pages = sum(n // P for n in need)
    pages = rng.permutation(np.arange(1, total_pages + 1))
    req_to_token = np.zeros((num_req_rows, row_width), np.int32)
    cursor = 0
    for b in range(num_seqs):
        for k in range(need[b] // P):
            req_to_token[rows[b], k * P : (k + 1) * P] = pages[cursor] * P + np.arange(P)
            cursor += 1
    out_cache_loc = np.zeros((num_seqs, K, S), np.int32)
    for b, L in enumerate(seq_lens):
        for t in range(K):
            e = ext_start(L, t, topk=K, num_steps=S, page_size=P)
            out_cache_loc[b, t] = req_to_token[rows[b], e : e + S]
    return {
        "req_to_token": req_to_token,
        "req_pool_indices": rows.astype(np.int32),
        "seq_lens": np.asarray(seq_lens, np.int32),
        "out_cache_loc": out_cache_loc,
    }


def expand_loop(
    last_page_lens,
    cache_loc,
    *,
    decode_length: int,
    topk: int,
    page_size: int,
    width: int,
    num_cols: int | None = None,
):
    """Loop oracle of ``draft_decode_set_expand_metadata`` over ``num_cols`` columns."""
    cache_loc = np.asarray(cache_loc)
    num_rows = cache_loc.shape[0]
    num_cols = cache_loc.shape[1] if num_cols is None else num_cols
    seqlens = np.zeros(num_rows, np.int32)
    table = np.zeros((num_rows, width), np.int32)
    for r in range(num_rows):
        seqlens[r] = decode_length + int(last_page_lens[r // topk])
        distinct: list[int] = []
        for c in range(num_cols):
            page = int(cache_loc[r, c]) // page_size
            if not distinct or distinct[-1] != page:
                distinct.append(page)
        table[r, : len(distinct)] = distinct
    return seqlens, table


def normal_loop(
    req_to_token, req_pool_indices, seq_lens, *, page_size: int, topk: int, max_pages: int
):
    """Loop oracle of FA3 pass-A metadata (jspec conventions: zeros past the full pages)."""
    num_seqs = len(seq_lens)
    cache_seqlens = np.zeros(num_seqs, np.int32)
    table = np.zeros((num_seqs, max_pages), np.int32)
    for b in range(num_seqs):
        L = int(seq_lens[b])
        cache_seqlens[b] = L - L % page_size
        for k in range(cache_seqlens[b] // page_size):
            table[b, k] = req_to_token[req_pool_indices[b], k * page_size] // page_size
    cu_q = np.array([b * topk for b in range(num_seqs + 1)], np.int32)
    cu_k = np.concatenate([[0], np.cumsum(cache_seqlens)]).astype(np.int32)
    return cache_seqlens, cu_q, cu_k, table


def kv_indices_loop(
    req_to_token,
    req_pool_indices,
    seq_lens,
    *,
    topk: int,
    num_steps: int,
    page_size: int,
    width: int,
    fill: int = 0,
):
    """SPEC.md §6.1 as a sequential loop with a running write cursor (writes past W dropped)."""
    num_seqs = len(seq_lens)
    kv_indices = np.full((num_steps, width), fill, np.int64)
    kv_indptr = np.zeros((num_steps, num_seqs * topk + 1), np.int64)
    for i in range(num_steps):
        cursor = 0
        for b in range(num_seqs):
            row = req_to_token[req_pool_indices[b]]
            L = int(seq_lens[b])
            for t in range(topk):
                kv_indptr[i, b * topk + t] = cursor
                e = ext_start(L, t, topk=topk, num_steps=num_steps, page_size=page_size)
                segment = [int(row[j]) for j in range(L)] + [int(row[e + s]) for s in range(i + 1)]
                for value in segment:
                    if cursor < width:
                        kv_indices[i, cursor] = value
                    cursor += 1
        kv_indptr[i, num_seqs * topk] = cursor
    return kv_indices.astype(np.int32), kv_indptr.astype(np.int32)
