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

need_sort merges follow 0.5.23's quick bounds: ``alloc_extend`` merges when
``extend_num_tokens // P + bs + 1 > len(free_pages)``, ``alloc_decode`` when ``bs > len(free_pages)``,
``alloc`` when the exact page count is short; a call that then fails keeps the merge.

Debug mode (``SGLANG_DEBUG_MEMORY_POOL``, or ``debug_mode=``) adds sglang's debug assertions.
"""

from __future__ import annotations

import torch

from interop.kv._allocator_api import SglangAllocatorAPI


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PagedTokenToKVPoolAllocator(SglangAllocatorAPI):
    """Paged token-slot allocator: slots ``page*P + offset`` for pages ``1..size//P``
    (constructor: :class:`SglangAllocatorAPI`'s, sglang's signature)."""

    free_pages: torch.Tensor
    staged_pages: list[torch.Tensor]

    # ---- state -----------------------------------------------------------------------------
    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self.staged_pages = []
        self.num_staged_pages = 0
        self._reset_groups()

    @property
    def release_pages(self) -> torch.Tensor:
        """The staged pages as one tensor (jspec's name for sglang's ``staged_pages``)."""
        return torch.cat(
            [torch.empty(0, dtype=torch.int64, device=self.device), *self.staged_pages]
        )

    def available_size(self) -> int:
        return (len(self.free_pages) + self.num_staged_pages) * self.page_size

    def merge_and_sort_free(self) -> None:
        if not self.staged_pages:
            return
        self.free_pages = torch.sort(self.get_all_free_pages()).values
        self.staged_pages = []
        self.num_staged_pages = 0

    def _page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    # ---- alloc -----------------------------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size // P`` whole pages from the front of the free list."""
        if self.debug_mode:
            assert need_size % self.page_size == 0, "The allocation size should be page-aligned"
        num_pages = need_size // self.page_size
        if num_pages > len(self.free_pages):
            self.merge_and_sort_free()
        if num_pages > len(self.free_pages):
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
        num_new_pages: int | None = None,
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
            assert all((ll + 1) % P == p % P for ll, p in zip(last, pre))
        new_pages = [_ceil_div(s, P) - _ceil_div(p, P) for p, s in zip(pre, seq)]
        exact = sum(new_pages)
        bound = extend_num_tokens // P + len(pre) + 1
        if bound > len(self.free_pages):
            self.merge_and_sort_free()
        need = exact if num_new_pages is None else num_new_pages
        if bound > len(self.free_pages) and need > len(self.free_pages):
            return None  # the bound could not prove the pool deep enough: exact count first
        free = [int(x) for x in self.free_pages[:exact]]
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
        if self.debug_mode:
            assert len(set(out)) == len(out)
        self.free_pages = self.free_pages[exact if num_new_pages is None else num_new_pages :]
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """One slot per request at position ``seq_lens[b] - 1`` (``alloc_decode_naive``)."""
        P = self.page_size
        seq = [int(x) for x in seq_lens_cpu]
        last = [int(x) for x in last_loc.cpu()]
        if self.debug_mode:
            assert all((ll + 2) % P == s % P for ll, s in zip(last, seq))
        if len(seq) > len(self.free_pages):
            self.merge_and_sort_free()
        needs_page = [_ceil_div(s, P) - _ceil_div(s - 1, P) for s in seq]
        num_new_pages = sum(needs_page)
        if num_new_pages > len(self.free_pages):
            return None
        out, rank = [], 0
        for s, ll, new in zip(seq, last, needs_page):
            if new:
                out.append(int(self.free_pages[rank]) * P)
                rank += 1
            else:
                out.append(ll + 1)
        if self.debug_mode:
            assert len(set(out)) == len(out)
        self.free_pages = self.free_pages[num_new_pages:]
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    # ---- free (groups, segments and debug checks: SglangAllocatorAPI) -----------------------
    def _release_page_ids(self, page_ids: torch.Tensor) -> None:
        if self.need_sort:
            self.staged_pages.append(page_ids)
            self.num_staged_pages += page_ids.numel()
        else:
            self.free_pages = torch.cat((page_ids, self.free_pages))

    def _free_now(self, free_index: torch.Tensor) -> None:
        self._release_page_ids(torch.unique(free_index.to(torch.int64) // self.page_size))

    def _free_page_ids_now(self, page_ids: torch.Tensor) -> None:
        self._release_page_ids(page_ids.to(torch.int64))


def get_last_loc(
    req_to_token: torch.Tensor,
    req_pool_indices_tensor: torch.Tensor,
    prefix_lens_tensor: torch.Tensor,
) -> torch.Tensor:
    """``row[prefix - 1]`` if ``prefix > 0`` else -1, in ``prefix_lens``'s dtype."""
    req_pool_indices, prefix_lens = req_pool_indices_tensor, prefix_lens_tensor
    rows = req_to_token[req_pool_indices.to(torch.int64)]
    col = (prefix_lens.to(torch.int64) - 1).clamp(min=0)
    last = torch.gather(rows, 1, col[:, None])[:, 0].to(prefix_lens.dtype)
    return torch.where(prefix_lens > 0, last, torch.full_like(last, -1))
