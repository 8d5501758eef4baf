"""sglang's ``PagedTokenToKVPoolAllocator`` interface backed by jspec's functional allocator.

The state is a :class:`jspec.kv.allocator.PagedAllocator` pytree; every method converts its
torch arguments through the DLPack shim, calls the jitted jspec function and keeps the new
state. Returned slot ids are int64 torch tensors like sglang's (jspec computes int32).

Static capacities (``max_slots``, ``max_new_slots``, free-list input lengths) are rounded up to
a power of 2 so that varying sizes reuse a few compiled variants; the padding is masked.
Free groups are kept host side, exactly as sglang and the torch reference do: frees inside a
group are cloned and released by one ``free`` at ``free_group_end``.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import torch

from interop._adapt import to_jax_default
from interop.dlpack import to_torch
from jspec.kernels._common import next_power_of_2


def _kv_alloc():
    import jspec.kv.allocator as mod  # resolved per call: tests may patch it

    return mod


def _padded(t: torch.Tensor, what: str) -> tuple[Any, Any]:
    """(i32[pow2] ids, bool[pow2] valid) from a 1-D torch tensor (padded in torch: no per-size
    JAX compile)."""
    flat = t.reshape(-1)
    n = flat.numel()
    cap = next_power_of_2(max(n, 1))
    padded = torch.zeros(cap, dtype=flat.dtype, device=flat.device)
    padded[:n] = flat
    valid = torch.arange(cap, device=flat.device) < n
    return to_jax_default(padded, what), to_jax_default(valid, what)


def _padded_batch(*tensors: torch.Tensor, fill: tuple[int, ...]) -> list[Any]:
    """Per-request tensors padded to a power-of-2 batch (``fill`` per tensor) as JAX arrays."""
    n = tensors[0].numel()
    cap = next_power_of_2(max(n, 1))
    out = []
    for t, value in zip(tensors, fill):
        padded = torch.full((cap,), value, dtype=t.dtype, device=t.device)
        padded[:n] = t.reshape(-1)
        out.append(to_jax_default(padded, "batch input"))
    return out


class PagedTokenToKVPoolAllocator:
    """Same constructor and methods as sglang's (and :mod:`interop.torch_reference.allocator`)."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype = torch.bfloat16,
        device: Any = "cpu",
        kvcache: Any = None,
        need_sort: bool = False,
        *,
        impl: str = "xla",
        merge_rule: str = "exact",
    ) -> None:
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        self._kvcache = kvcache
        self.need_sort = need_sort
        self.num_pages = size // page_size
        self.impl = impl
        self.merge_rule = merge_rule
        self.clear()

    # ---- state -----------------------------------------------------------------------------
    def clear(self) -> None:
        self.state = _kv_alloc().init_allocator(
            self.num_pages, self.page_size, need_sort=self.need_sort
        )
        self.is_not_in_free_group = True
        self.free_group: list[torch.Tensor] = []

    def available_size(self) -> int:
        return int(_kv_alloc().available_size(self.state))

    def get_kvcache(self) -> Any:
        return self._kvcache

    @property
    def free_pages(self) -> torch.Tensor:
        """i64 live free list (a copy), sglang order."""
        return self._live(self.state.free_pages, self.state.num_free)

    @property
    def release_pages(self) -> torch.Tensor:
        """i64 staged pages (need_sort mode), a copy."""
        return self._live(self.state.staged_pages, self.state.num_staged)

    def _live(self, pages: Any, count: Any) -> torch.Tensor:
        return self._slots(pages, int(count))

    def _slots(self, slot_ids: Any, n: int) -> torch.Tensor:
        return to_torch(slot_ids)[:n].to(device=self.device, dtype=torch.int64)

    def merge_and_sort_free(self) -> None:
        self.state = _kv_alloc().merge_and_sort_free(self.state)

    # ---- alloc -----------------------------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        assert need_size % self.page_size == 0, "The allocation size should be page-aligned"
        state, slot_ids, ok = _kv_alloc().alloc(
            self.state, jnp.int32(need_size), max_slots=next_power_of_2(max(need_size, 1))
        )
        if not bool(ok):
            return None
        self.state = state
        return self._slots(slot_ids, need_size)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        # padding rows have seq == prefix: they take nothing
        prefix, seq, last = _padded_batch(prefix_lens, seq_lens, last_loc, fill=(0, 0, -1))
        state, slot_ids, ok = _kv_alloc().alloc_extend(
            self.state,
            prefix,
            seq,
            last,
            max_new_slots=next_power_of_2(max(int(extend_num_tokens), 1)),
            impl=self.impl,
            merge_rule=self.merge_rule,
        )
        if not bool(ok):
            return None
        self.state = state
        return self._slots(slot_ids, int(extend_num_tokens))

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        n = seq_lens.numel()
        seq, last, valid = _padded_batch(
            seq_lens, last_loc, torch.ones(n, dtype=torch.bool), fill=(1, -1, 0)
        )
        state, slot_ids, ok = _kv_alloc().alloc_decode(
            self.state, seq, last, valid=valid, impl=self.impl, merge_rule=self.merge_rule
        )
        if not bool(ok):
            return None
        self.state = state
        return self._slots(slot_ids, seq_lens.numel())

    # ---- free ------------------------------------------------------------------------------
    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(free_index.clone())
            return
        slots, valid = _padded(free_index, "free_index")
        self.state = _kv_alloc().free(self.state, slots, valid=valid)

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        if page_ids.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(page_ids.to(torch.int64) * self.page_size)
            return
        pages, valid = _padded(page_ids, "page_ids")
        self.state = _kv_alloc().free_page_ids(self.state, pages, valid=valid)

    def free_segment(self, idx: torch.Tensor, start_pos: int) -> None:
        assert int(start_pos) % self.page_size == 0, (
            f"free_segment: start_pos={int(start_pos)} is not page aligned (page_size="
            f"{self.page_size})"
        )
        if idx.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_page_ids(idx[:: self.page_size].to(torch.int64) // self.page_size)
            return
        row, _ = _padded(idx, "idx")
        self.state = _kv_alloc().free_segment(self.state, row, jnp.int32(0), jnp.int32(idx.numel()))

    def free_group_begin(self) -> None:
        assert self.is_not_in_free_group, "free_group_begin: nested free groups are forbidden"
        self.is_not_in_free_group = False
        self.free_group = []

    def free_group_end(self) -> None:
        self.is_not_in_free_group = True
        if self.free_group:
            self.free(torch.cat(self.free_group))
        self.free_group = []


def get_last_loc(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor
) -> torch.Tensor:
    """sglang ``get_last_loc`` through jspec: ``row[prefix-1]`` or -1, dtype of ``prefix_lens``."""
    from jspec.kv import req_to_token as mod

    out = mod.get_last_loc(
        to_jax_default(req_to_token, "req_to_token"),
        to_jax_default(req_pool_indices, "req_pool_indices"),
        to_jax_default(prefix_lens, "prefix_lens"),
    )
    return to_torch(out).to(device=prefix_lens.device, dtype=prefix_lens.dtype)
