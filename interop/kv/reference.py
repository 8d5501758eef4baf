"""PyTorch references of sglang's req_to_token pool, MHA KV pool and decode sizing (SPEC.md §3,
§4.1, §9.2, §10).

* ``assign_req_to_token_pool_func``: sglang's Triton kernel launcher as a loop (same arguments).
* ``MHATokenToKVPool``: per-layer K and V buffers ``[size + page_size, head_num, head_dim]``;
  slots ``0..P-1`` are the padding page. ``move_kv_cache`` is gather-then-scatter, so
  overlapping ``tgt``/``src`` in one call is safe (reverse shift ``tgt=[1,2,3,4]``,
  ``src=[0,1,2,3]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def assign_req_to_token_pool_func(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    batch_size: int,
) -> None:
    """In place: ``req_to_token[req_pool_indices[b], start[b]:end[b]] = out_cache_loc[cu[b]:...]``.

    ``cu`` is the exclusive cumsum of ``end - start`` in batch order (requests' slots packed in
    ``out_cache_loc``). Rows with ``start == end`` write nothing.
    """
    cu = 0
    for b in range(batch_size):
        row = int(req_pool_indices[b])
        start, end = int(start_offset[b]), int(end_offset[b])
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[cu : cu + n].to(req_to_token.dtype)
        cu += max(n, 0)


class MHATokenToKVPool:
    """Per-layer K/V buffers indexed by token slot id."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: Any = "cpu",
        *,
        fill: float = 0.0,
    ) -> None:
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = device
        shape = (size + page_size, head_num, head_dim)
        self.k_buffer = [
            torch.full(shape, fill, dtype=dtype, device=device) for _ in range(layer_num)
        ]
        self.v_buffer = [
            torch.full(shape, fill, dtype=dtype, device=device) for _ in range(layer_num)
        ]

    @staticmethod
    def _layer_id(layer: Any) -> int:
        return int(getattr(layer, "layer_id", layer))

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(
        self,
        layer: Any,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale: Any = None,
        v_scale: Any = None,
        layer_id_override: int | None = None,
    ) -> None:
        """Write ``cache_k``/``cache_v`` ``[T, H, D]`` at slots ``loc`` of one layer."""
        layer_id = layer_id_override if layer_id_override is not None else self._layer_id(layer)
        loc = loc.to(torch.int64)
        self.k_buffer[layer_id][loc] = cache_k.to(self.dtype)
        self.v_buffer[layer_id][loc] = cache_v.to(self.dtype)

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """All layers, K and V: ``buf[tgt] = buf[src]``, gather then scatter."""
        move_kv_cache(self.k_buffer, self.v_buffer, tgt_loc, src_loc)


def move_kv_cache(
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """In place over every buffer: gather rows ``src_loc`` first, then scatter them to ``tgt_loc``.

    With duplicate ``tgt_loc`` entries the winning write is unspecified (as in sglang).
    """
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.to(torch.int64), src_loc.to(torch.int64)
    for buf in list(k_buffers) + list(v_buffers):
        rows = buf[src].clone()
        buf[tgt] = rows


# ---- decode sizing (``mem_cache/allocation_sizing.py``, SPEC §3) ------------------------------
# Python references of sglang's decode allocation sizing (``mem_cache/allocation_sizing.py``, SPEC.md §3).
#
# sglang reads ``server_args``; here the same quantities are keyword arguments::
#
#     get_alloc_len_per_decode      no spec: 1
#                                   P_alloc == 1 or K == 1 or NGRAM : max(S*K, ndt_max)
#                                   else (spec-v2 tree)             : max(ceil((P-1+S)/P) * P * K, ndt_max)
#     get_alloc_reserve_per_decode  2 * get_alloc_len_per_decode     (overlap double buffer)
#     page_aligned_decode_alloc_lens  nxt = max(cur, ceil_P(committed + reserve)); need = sum(nxt - cur)
#
# ``P_alloc = page_size * attn_dcp_size``; ``ndt_max = max(num_draft_tokens, max_num_draft_tokens)``.


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
    reqs: Sequence[Any], *, reserve: int, page_size: int
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
