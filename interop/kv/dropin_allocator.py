"""Drop-in ``PagedTokenToKVPoolAllocator`` and ``get_last_loc`` backed by jspec's allocator.

sglang 0.5.23 ``srt/mem_cache/allocator/paged.py`` (+ ``base.py``): same constructor, methods,
argument names, defaults and return values. The state is a :class:`jspec.kv.allocator.PagedAllocator`
pytree; every method converts its torch arguments through the DLPack shim, calls the jitted jspec
function (through :func:`interop._adapt.run_jspec`: checked when jspec probes are on) and keeps
the new state. Returned slot ids are int64 like sglang's (jspec computes int32).

Free groups, ``free_segment(s)``, the debug checks and the host copies are
:class:`interop.kv._allocator_api.SglangAllocatorAPI` (shared with the reference). Debug mode
(``SGLANG_DEBUG_MEMORY_POOL=1`` at construction, or ``debug_mode=True``) runs sglang's debug
assertions, all as ``AssertionError``: ``alloc`` sizes page-aligned; ``alloc_extend`` /
``alloc_decode`` ``last_loc`` aligned with the lengths and returned slots unique; after every free
(``free``, ``free_page_ids``, ``free_segment``, ``free_group_end``) no page twice among the free
and staged pages (a double free); ``free_segment`` page representatives ``free_index[::P]``
equal to ``unique(free_index // P)`` (a malformed page block).

Differences from sglang: a ``num_new_pages`` hint must equal the exact count and
``extend_num_tokens`` the sum of the extend lengths (ValueError; sglang trusts both); outside debug mode a free naming a bad page (already free, page 0, out of range)
frees its good pages and skips the bad ones (sglang lists the bad page twice, a corrupt free
list; jspec alone would reject the call whole and lose the good pages); a failed need_sort allocation follows :mod:`jspec.kv.allocator` (input state returned
unchanged; sglang keeps the merge it did first); ``staged_pages`` is one tensor (sglang: one per free call, same pages in the same order).

Static capacities (``max_slots``, ``max_new_slots``, free-list input lengths) are rounded up to a
power of 2 so that varying sizes reuse a few compiled variants; the padding is masked.
"""

from __future__ import annotations

import operator
from typing import Any

import jax.numpy as jnp
import torch

from interop._adapt import jspec_module, run_jspec, to_jax_default
from interop.dlpack import to_torch
from interop.kv._allocator_api import SglangAllocatorAPI
from jspec.config import next_power_of_2


def _kv_alloc() -> Any:
    return jspec_module("jspec.kv.allocator")  # resolved per call: tests may patch it


def _padded(t: torch.Tensor, what: str) -> tuple[Any, Any]:
    """(i32[pow2] ids, bool[pow2] valid) from a 1-D torch tensor (padded in torch: no per-size
    JAX compile)."""
    flat = t.reshape(-1)
    n = flat.numel()
    cap = next_power_of_2(n)
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


def _check_batch(**tensors: torch.Tensor) -> None:
    """Per-request tensors of one batch: equal lengths (ValueError naming them). Padding a shorter
    one to the batch would hand its missing requests made-up lengths."""
    lens = {name: t.numel() for name, t in tensors.items()}
    if len(set(lens.values())) > 1:
        raise ValueError(f"per-request tensors must have one length, got numel {lens}")


def _num_new_pages_extend(prefix_cpu: torch.Tensor, seq_cpu: torch.Tensor, page_size: int) -> int:
    """sglang ``get_num_new_pages(seq_lens, page_size, prefix_lens)``."""
    after = (seq_cpu.to(torch.int64) + page_size - 1) // page_size
    before = (prefix_cpu.to(torch.int64) + page_size - 1) // page_size
    return int((after - before).sum())


class PagedTokenToKVPoolAllocator(SglangAllocatorAPI):
    """sglang 0.5.23's paged allocator over jspec (see the module docstring).

    Keyword-only extras (not in sglang): ``impl`` (jspec kernel), ``merge_rule`` (jspec's
    need_sort merge trigger; ``"sglang"`` = sglang's quick bounds) and ``debug_mode`` (None: read
    ``SGLANG_DEBUG_MEMORY_POOL`` like sglang).
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        device: str,
        kvcache: Any,
        need_sort: bool,
        *,
        impl: str = "xla",
        merge_rule: str = "sglang",
        debug_mode: bool | None = None,
    ) -> None:
        self.impl = impl
        self.merge_rule = merge_rule
        super().__init__(size, page_size, dtype, device, kvcache, need_sort, debug_mode=debug_mode)

    # ---- state -----------------------------------------------------------------------------
    def clear(self) -> None:
        self.state = run_jspec(
            _kv_alloc().init_allocator, self.num_pages, self.page_size, need_sort=self.need_sort
        )
        self._reset_groups()

    def available_size(self) -> int:
        return int(_kv_alloc().available_size(self.state))

    @property
    def free_pages(self) -> torch.Tensor:
        """i64 live free list (a copy), sglang order."""
        return self._live(self.state.free_pages, self.state.num_free)

    @property
    def staged_pages(self) -> list[torch.Tensor]:
        """need_sort: freed pages waiting for a merge (sglang keeps a list of tensors)."""
        staged = self.release_pages
        return [staged] if staged.numel() else []

    @property
    def num_staged_pages(self) -> int:
        return int(self.state.num_staged)

    @property
    def release_pages(self) -> torch.Tensor:
        """i64 staged pages in staging order (jspec's name), a copy."""
        return self._live(self.state.staged_pages, self.state.num_staged)

    def _live(self, pages: Any, count: Any) -> torch.Tensor:
        return self._slots(pages, int(count))

    def _slots(self, slot_ids: Any, n: int) -> torch.Tensor:
        return to_torch(slot_ids)[:n].to(device=self.device, dtype=torch.int64)

    def merge_and_sort_free(self) -> None:
        self.state = run_jspec(_kv_alloc().merge_and_sort_free, self.state)

    # ---- alloc -----------------------------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        try:
            need_size = operator.index(need_size)
        except TypeError:
            raise TypeError(
                f"need_size={need_size!r} must be an int, got {type(need_size).__name__}"
            ) from None
        if need_size < 0:
            raise ValueError(f"need_size={need_size} must be >= 0")
        if self.debug_mode:
            assert need_size % self.page_size == 0, "The allocation size should be page-aligned"
        num_slots = need_size // self.page_size * self.page_size  # sglang: whole pages only
        state, slot_ids, ok = run_jspec(
            _kv_alloc().alloc,
            self.state,
            jnp.int32(num_slots),
            max_slots=next_power_of_2(max(num_slots, 1)),
        )
        if not bool(ok):
            return None
        self.state = state
        return self._slots(slot_ids, num_slots)

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
        p = self.page_size
        _check_batch(
            prefix_lens=prefix_lens,
            prefix_lens_cpu=prefix_lens_cpu,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            last_loc=last_loc,
        )
        extend_lens = seq_lens_cpu.reshape(-1).to(torch.int64) - prefix_lens_cpu.reshape(-1)
        if bool((extend_lens < 0).any()):
            raise ValueError(f"seq_lens_cpu - prefix_lens_cpu={extend_lens.tolist()} must be >= 0")
        if int(extend_num_tokens) != int(extend_lens.sum()):
            raise ValueError(
                f"extend_num_tokens={extend_num_tokens} must equal sum(seq_lens - prefix_lens)="
                f"{int(extend_lens.sum())} (sglang sizes its output by it)"
            )
        if self.debug_mode:
            assert torch.all((last_loc + 1) % p == prefix_lens % p)
        if num_new_pages is not None:
            exact = _num_new_pages_extend(prefix_lens_cpu, seq_lens_cpu, p)
            if int(num_new_pages) != exact:
                raise ValueError(
                    f"num_new_pages={num_new_pages} but the batch needs {exact} new pages "
                    "(sglang trusts the hint and would corrupt its free list)"
                )
        # padding rows have seq == prefix: they take nothing
        prefix, seq, last = _padded_batch(prefix_lens, seq_lens, last_loc, fill=(0, 0, -1))
        state, slot_ids, ok = run_jspec(
            _kv_alloc().alloc_extend,
            self.state,
            prefix,
            seq,
            last,
            max_new_slots=next_power_of_2(max(int(extend_num_tokens), 1)),
            impl=self.impl,
            merge_rule=self.merge_rule,
        )
        return self._take_slots(state, slot_ids, ok, int(extend_num_tokens))

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        _check_batch(seq_lens=seq_lens, seq_lens_cpu=seq_lens_cpu, last_loc=last_loc)
        if self.debug_mode:
            assert torch.all((last_loc + 2) % self.page_size == seq_lens % self.page_size)
        n = seq_lens.numel()
        seq, last, valid = _padded_batch(
            seq_lens, last_loc, torch.ones(n, dtype=torch.bool), fill=(1, -1, 0)
        )
        state, slot_ids, ok = run_jspec(
            _kv_alloc().alloc_decode,
            self.state,
            seq,
            last,
            valid=valid,
            impl=self.impl,
            merge_rule=self.merge_rule,
        )
        return self._take_slots(state, slot_ids, ok, n)

    def _take_slots(self, state: Any, slot_ids: Any, ok: Any, n: int) -> torch.Tensor | None:
        """``alloc_extend`` / ``alloc_decode``'s result: None (state kept) when jspec refused the
        call, else the first ``n`` slot ids (i64; unique in debug mode, sglang's check) and
        ``state`` kept as the new state."""
        if not bool(ok):
            return None
        out = self._slots(slot_ids, n)
        if self.debug_mode:
            assert len(torch.unique(out)) == len(out)
        self.state = state
        return out

    # ---- free (groups, segments and debug checks: SglangAllocatorAPI) -----------------------
    def _free_now(self, free_index: torch.Tensor) -> None:
        slots, valid = _padded(free_index, "free_index")
        pages = free_index.reshape(-1).to(torch.int64).cpu() // self.page_size
        self._apply_free(_kv_alloc().free, slots, valid, "free", free_index, pages)

    def _free_page_ids_now(self, page_ids: torch.Tensor) -> None:
        ids, valid = _padded(page_ids, "page_ids")
        pages = page_ids.reshape(-1).to(torch.int64).cpu()
        self._apply_free(_kv_alloc().free_page_ids, ids, valid, "free_page_ids", page_ids, pages)

    def _apply_free(
        self, fn: Any, ids: Any, valid: Any, what: str, given: torch.Tensor, pages: torch.Tensor
    ) -> None:
        """jspec rejects a bad free whole (state unchanged, ``ok=False``) where sglang would put a
        page on the free list twice; debug mode raises what sglang's debug check raises then.

        Outside debug mode the good pages of a rejected free are freed again on their own (the
        bad ones skipped: :meth:`_freeable`), so a live page named beside a bad one is not lost.
        """
        self.state, ok = run_jspec(fn, self.state, ids, valid=valid, return_ok=True)
        if bool(ok):
            return
        if self.debug_mode:
            raise AssertionError(
                f"double free: {what}({given.tolist()}) names a page already free, page 0 or "
                f"a page outside [1, {self.num_pages}]"
            )
        keep = self._freeable(pages)
        if keep.any():
            cap = int(valid.shape[0])
            mask = torch.zeros(cap, dtype=torch.bool)
            mask[: keep.numel()] = keep
            self.state = run_jspec(fn, self.state, ids, valid=to_jax_default(mask, "valid"))

    def _freeable(self, pages: torch.Tensor) -> torch.Tensor:
        """bool[n]: entries naming a live page in ``[1, num_pages]``, not free or staged, first
        occurrence of each page only (repeats of a freed page are no double free)."""
        free = self.get_all_free_pages().cpu()
        ok = (pages >= 1) & (pages <= self.num_pages) & ~torch.isin(pages, free)
        first = torch.zeros_like(ok)
        seen: set[int] = set()
        for i, page in enumerate(pages.tolist()):
            if ok[i] and page not in seen:
                seen.add(page)
                first[i] = True
        return first


def get_last_loc(
    req_to_token: torch.Tensor,
    req_pool_indices_tensor: torch.Tensor,
    prefix_lens_tensor: torch.Tensor,
) -> torch.Tensor:
    """sglang ``get_last_loc`` through jspec: ``row[prefix-1]`` or -1, dtype of the prefix lens."""
    out = run_jspec(
        jspec_module("jspec.kv.req_to_token").get_last_loc,
        to_jax_default(req_to_token, "req_to_token"),
        to_jax_default(req_pool_indices_tensor, "req_pool_indices"),
        to_jax_default(prefix_lens_tensor, "prefix_lens"),
    )
    return to_torch(out).to(device=prefix_lens_tensor.device, dtype=prefix_lens_tensor.dtype)
