"""The host-side half of sglang 0.5.23's ``PagedTokenToKVPoolAllocator``, shared by the PyTorch
reference (:mod:`interop.kv.reference_allocator`) and the drop-in (:mod:`interop.kv.dropin_allocator`).

sglang ``srt/mem_cache/allocator/paged.py`` + ``base.py``: free groups (``free`` and
``free_page_ids`` deferred until ``free_group_end``, which releases the token frees first and the
page ids second; no nesting), ``free_segment`` (page representatives ``free_index[::P]``, start
page-aligned), ``free_segments`` (page-disjoint segments), the debug-mode checks
(``SGLANG_DEBUG_MEMORY_POOL``), the KV-cache host copies and sglang's constructor. A subclass
keeps the free list and provides ``clear()`` (called last by the constructor), ``free_pages``,
``staged_pages``, ``_free_now(free_index)`` and ``_free_page_ids_now(page_ids)``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch


def debug_mode_from_env() -> bool:
    """sglang's ``get_bool_env_var("SGLANG_DEBUG_MEMORY_POOL")``."""
    return os.environ.get("SGLANG_DEBUG_MEMORY_POOL", "false").strip().lower() in ("true", "1")


class SglangAllocatorAPI:
    """Free groups, segment frees, debug checks and host copies (see the module docstring)."""

    page_size: int
    debug_mode: bool
    _kvcache: Any

    if TYPE_CHECKING:
        # NOTE: read-only here: the reference keeps them as attributes, the drop-in as
        # properties (views of jspec's state). Declared for the checker only: a runtime
        # property here would block the reference's assignments.

        @property
        def free_pages(self) -> torch.Tensor: ...  # i64 free page ids, sglang order

        @property
        def staged_pages(self) -> list[torch.Tensor]: ...  # need_sort: pages awaiting a merge

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        device: Any,
        kvcache: Any,
        need_sort: bool,
        *,
        debug_mode: bool | None = None,
    ) -> None:
        """sglang's constructor (its fields, then ``clear()``); ``debug_mode=None`` reads
        ``SGLANG_DEBUG_MEMORY_POOL``."""
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        self._kvcache = kvcache
        self.need_sort = need_sort
        self.num_pages = size // page_size
        self.debug_mode = debug_mode_from_env() if debug_mode is None else bool(debug_mode)
        self.clear()

    def clear(self) -> None:
        raise NotImplementedError

    def _free_now(self, free_index: torch.Tensor) -> None:
        raise NotImplementedError

    def _free_page_ids_now(self, page_ids: torch.Tensor) -> None:
        raise NotImplementedError

    def _reset_groups(self) -> None:
        self.free_group: list[torch.Tensor] | None = None
        self.free_page_ids_group: list[torch.Tensor] = []

    def get_kvcache(self) -> Any:
        return self._kvcache

    def get_all_free_pages(self) -> torch.Tensor:
        return torch.cat((self.free_pages, *self.staged_pages))

    def free(self, free_index: torch.Tensor) -> None:
        """Free the pages ``unique(free_index // P)`` (deferred inside a free group)."""
        if free_index.numel() == 0:
            return
        if self.free_group is None:
            self._free_now(free_index)
        else:
            self.free_group.append(free_index.clone())
        if self.debug_mode:
            self._debug_check_no_duplicate_pages()

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        """Free exactly these pages; no page twice, no dedup."""
        if page_ids.numel() == 0:
            return
        if self.free_group is None:
            self._free_page_ids_now(page_ids)
            if self.debug_mode:
                self._debug_check_no_duplicate_pages()
        else:
            self.free_page_ids_group.append(page_ids.clone())

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """Free ``kv_row[start_pos : start_pos + n]``: pages ``free_index[::P] // P`` (no unique)."""
        if free_index.numel() == 0:
            return
        ps = self.page_size
        assert start_pos % ps == 0, f"segment start {start_pos} is not page-aligned"
        reps = free_index[::ps]
        if self.debug_mode:
            assert torch.equal(
                torch.sort(reps.cpu() // ps)[0], torch.unique(free_index.cpu() // ps)
            ), f"free_segment: malformed page block (pages {(free_index.cpu() // ps).tolist()})"
        self.free_page_ids(reps // ps)

    def free_segments(self, segments: Any) -> None:
        """Several ``(free_index, start_pos)`` segments of one request's row, page-disjoint."""
        ps = self.page_size
        prev_end = None
        for free_index, start_pos in segments:
            n = free_index.numel()
            if n == 0:
                continue
            assert prev_end is None or start_pos // ps > (prev_end - 1) // ps, (
                f"segment at {start_pos} shares a page with the one ending at {prev_end}"
            )
            prev_end = start_pos + n
            self.free_segment(free_index, start_pos=start_pos)

    def _debug_check_no_duplicate_pages(self) -> None:
        pages = self.get_all_free_pages()
        assert len(torch.unique(pages)) == len(pages), (
            f"double free: a page is twice among the free pages {pages.tolist()}"
        )

    def free_group_begin(self) -> None:
        assert self.free_group is None, "free groups cannot be nested"
        self.free_group = []
        self.free_page_ids_group = []

    def free_group_end(self) -> None:
        pending, self.free_group = self.free_group, None
        if pending:
            self.free(torch.cat(pending))
        if self.free_page_ids_group:
            group, self.free_page_ids_group = self.free_page_ids_group, []
            self._free_page_ids_now(torch.cat(group))
        if self.debug_mode:
            self._debug_check_no_duplicate_pages()

    def get_cpu_copy(self, indices: Any, mamba_indices: Any = None, req_pool_index: Any = None):
        return self._kvcache.get_cpu_copy(
            indices, mamba_indices=mamba_indices, req_pool_index=req_pool_index
        )

    def load_cpu_copy(
        self, kv_cache_cpu: Any, indices: Any, mamba_indices: Any = None, req_pool_index: Any = None
    ):
        return self._kvcache.load_cpu_copy(
            kv_cache_cpu, indices, mamba_indices=mamba_indices, req_pool_index=req_pool_index
        )
