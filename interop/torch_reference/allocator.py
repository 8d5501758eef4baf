"""PyTorch reference of sglang's ``PagedTokenToKVPoolAllocator`` (SPEC.md §10, 0.5.23 semantics).

Same class name, constructor and method signatures as sglang (``srt/mem_cache/allocator/paged.py``);
the Triton kernels are replaced by the pure-torch ``alloc_extend_naive`` / ``alloc_decode_naive``
loops, so it runs on CPU. Slot ids are int64 like sglang (jspec's are int32).

Free-list order (what makes jspec and this reference hand out identical slot ids)::

    clear()            free_pages = [1, 2, ..., num_pages]        page 0 = padding, never handed out
    alloc / extend /   pop pages from the FRONT of free_pages; if short and need_sort, first
    decode             merge_and_sort_free(); still short -> None, state unchanged
    free(idx)          unique(idx // P) (ascending) PREPENDED to free_pages
                       (need_sort: APPENDED to release_pages instead)
    free_group_*       frees inside a group are deferred and released by one free() at the end

need_sort merges follow sglang 0.5.23's bounds, not the exact page count: ``alloc`` merges when
``pages > len(free_pages)``, ``alloc_extend`` when ``extend_num_tokens // P + bs + 1 >
len(free_pages)``, ``alloc_decode`` when ``bs > len(free_pages)`` (then the exact count decides
None).
"""

from __future__ import annotations

from typing import Any

import torch


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PagedTokenToKVPoolAllocator:
    """Paged token-slot allocator: slots ``page*P + offset`` for pages ``1..size//P``."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype = torch.bfloat16,
        device: Any = "cpu",
        kvcache: Any = None,
        need_sort: bool = False,
    ) -> None:
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        self._kvcache = kvcache
        self.need_sort = need_sort
        self.num_pages = size // page_size
        self.debug_mode = True
        self.clear()

    # ---- state -----------------------------------------------------------------------------
    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self.release_pages = torch.empty(0, dtype=torch.int64, device=self.device)
        self.is_not_in_free_group = True
        self.free_group: list[torch.Tensor] = []

    def available_size(self) -> int:
        return (len(self.free_pages) + len(self.release_pages)) * self.page_size

    def get_kvcache(self) -> Any:
        return self._kvcache

    def merge_and_sort_free(self) -> None:
        if len(self.release_pages) > 0:
            merged = torch.cat((self.free_pages, self.release_pages))
            self.free_pages = torch.sort(merged).values
            self.release_pages = torch.empty(0, dtype=torch.int64, device=self.device)

    def _ensure_pages(self, num_pages: int, bound: int | None = None) -> bool:
        """Merge first (need_sort) when ``bound`` (sglang's quick bound; default the exact
        ``num_pages``) exceeds the free list; then say whether ``num_pages`` fit."""
        if self.need_sort and (num_pages if bound is None else bound) > len(self.free_pages):
            self.merge_and_sort_free()
        return num_pages <= len(self.free_pages)

    def _page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    # ---- alloc -----------------------------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` (a multiple of P) slots on whole pages from the front of the free list."""
        if self.debug_mode:
            assert need_size % self.page_size == 0, "The allocation size should be page-aligned"
        num_pages = need_size // self.page_size
        if not self._ensure_pages(num_pages):
            return None
        pages = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        return self._page_slots(pages)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """Slots for positions ``[prefix_lens[b], seq_lens[b])`` of every request, packed.

        Per request (``alloc_extend_naive``): part 1 continues the partial last page at
        ``last_loc + 1``; part 2 fills whole new pages; part 3 starts one more new page.
        New pages are taken in batch order from the front of the free list.
        """
        P = self.page_size
        pre = [int(x) for x in prefix_lens_cpu]
        seq = [int(x) for x in seq_lens_cpu]
        last = [int(x) for x in last_loc.cpu()]
        if self.debug_mode:
            for b in range(len(pre)):
                assert (last[b] + 1) % P == pre[b] % P, f"last_loc misaligned for request {b}"
        new_pages = [_ceil_div(s, P) - _ceil_div(p, P) for p, s in zip(pre, seq)]
        num_new_pages = sum(new_pages)
        # NOTE: 0.5.23 checks the exact count before launching (the Aug kernel could read OOB).
        bound = extend_num_tokens // P + len(pre) + 1
        if not self._ensure_pages(num_new_pages, bound):
            return None
        free = [int(x) for x in self.free_pages[:num_new_pages]]
        out: list[int] = []
        start = 0
        for p, s, ll, nb in zip(pre, seq, last, new_pages):
            part1 = min(s, _ceil_div(p, P) * P) - p
            out.extend(ll + 1 + j for j in range(part1))
            if nb > 0:
                first_new = _ceil_div(p, P) * P  # first position on a new page
                for k in range(nb):
                    page = free[start + k]
                    count = min(P, s - (first_new + k * P))  # parts 2 (full) and 3 (partial)
                    out.extend(page * P + j for j in range(count))
            start += nb
        assert len(out) == extend_num_tokens, (len(out), extend_num_tokens)
        self.free_pages = self.free_pages[num_new_pages:]
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """One slot per request at position ``seq_lens[b] - 1`` (``alloc_decode_naive``)."""
        P = self.page_size
        seq = [int(x) for x in seq_lens_cpu]
        last = [int(x) for x in last_loc.cpu()]
        if self.debug_mode:
            for b in range(len(seq)):
                assert (last[b] + 2) % P == seq[b] % P, f"last_loc misaligned for request {b}"
        needs_page = [_ceil_div(s, P) - _ceil_div(s - 1, P) for s in seq]
        num_new_pages = sum(needs_page)
        if not self._ensure_pages(num_new_pages, len(seq)):
            return None
        out, rank = [], 0
        for s, ll, new in zip(seq, last, needs_page):
            if new:
                out.append(int(self.free_pages[rank]) * P)
                rank += 1
            else:
                out.append(ll + 1)
        self.free_pages = self.free_pages[num_new_pages:]
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    # ---- free ------------------------------------------------------------------------------
    def _release(self, page_ids: torch.Tensor) -> None:
        if self.need_sort:
            self.release_pages = torch.cat((self.release_pages, page_ids))
        else:
            self.free_pages = torch.cat((page_ids, self.free_pages))
        if self.debug_mode:
            all_free = torch.cat((self.free_pages, self.release_pages))
            assert len(torch.unique(all_free)) == len(all_free), "double free detected"

    def free(self, free_index: torch.Tensor) -> None:
        """Free the pages ``unique(free_index // P)`` (deferred inside a free group)."""
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(free_index.clone())
            return
        self._release(torch.unique(free_index.to(torch.int64) // self.page_size))

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        """Free exactly these pages (no ``unique``)."""
        if page_ids.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(page_ids.to(torch.int64) * self.page_size)
            return
        self._release(page_ids.to(torch.int64))

    def free_segment(self, idx: torch.Tensor, start_pos: int) -> None:
        """Free a row segment ``idx = row[start_pos:end]`` (``start_pos`` page aligned)."""
        assert int(start_pos) % self.page_size == 0, (
            f"free_segment: start_pos={int(start_pos)} is not page aligned (page_size="
            f"{self.page_size})"
        )
        if idx.numel() == 0:
            return
        self.free_page_ids(idx[:: self.page_size].to(torch.int64) // self.page_size)

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
    """``row[prefix - 1]`` if ``prefix > 0`` else -1, in ``prefix_lens``'s dtype."""
    rows = req_to_token[req_pool_indices.to(torch.int64)]
    col = (prefix_lens.to(torch.int64) - 1).clamp(min=0)
    last = torch.gather(rows, 1, col[:, None])[:, 0].to(prefix_lens.dtype)
    return torch.where(prefix_lens > 0, last, torch.full_like(last, -1))
