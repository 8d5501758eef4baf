"""PyTorch references of sglang's req_to_token pool and MHA KV pool (SPEC.md §4.1, §9.2, §10).

* ``ReqToTokenPool``: ``req_to_token`` int32 ``[size + 1, max_context_len]``; row 0 is the
  padding row (never handed out), rows ``1..size`` are allocated from the front of a list.
* ``assign_req_to_token_pool``: sglang's Triton kernel as a loop (same argument order).
* ``MHATokenToKVPool``: per-layer K and V buffers ``[size + page_size, head_num, head_dim]``;
  slots ``0..P-1`` are the padding page. ``move_kv_cache`` is gather-then-scatter, so
  overlapping ``tgt``/``src`` in one call is safe (reverse shift ``tgt=[1,2,3,4]``,
  ``src=[0,1,2,3]``).
"""

from __future__ import annotations

from typing import Any

import torch


class ReqToTokenPool:
    """Request rows mapping a token position to a KV slot id (int32)."""

    def __init__(self, size: int, max_context_len: int, device: Any = "cpu") -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros(
            (size + 1, max_context_len), dtype=torch.int32, device=device
        )
        self.clear()

    def clear(self) -> None:
        self.free_slots = list(range(1, self.size + 1))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> list[int] | None:
        if need_size > len(self.free_slots):
            return None
        rows, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return rows

    def free(self, free_index: int | list[int]) -> None:
        rows = [free_index] if isinstance(free_index, int) else list(free_index)
        self.free_slots.extend(rows)

    def write(self, indices: Any, values: torch.Tensor) -> None:
        self.req_to_token[indices] = values


def assign_req_to_token_pool(
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
        fill: float | None = 0.0,
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
