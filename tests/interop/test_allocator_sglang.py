"""PagedTokenToKVPoolAllocator drop-in: sglang 0.5.23's methods, debug mode and groups.

Expected slot / page ids are worked out by hand from sglang's free-list rules (pages 1..n, taken
from the front; frees prepended, ``unique`` for ``free``, representatives ``free_index[::P]``
for ``free_segment``). Every test runs on the drop-in and on the PyTorch reference.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from interop import torch_api as api
from interop.kv import reference_allocator as ref

I64 = torch.int64
CLASSES = (ref.PagedTokenToKVPoolAllocator, api.PagedTokenToKVPoolAllocator)
IDS = ("reference", "dropin")


def _t(x, dtype=I64):
    return torch.tensor(x, dtype=dtype)


def _make(cls, pages=8, p=4, need_sort=False, debug=False, kvcache=None):
    return cls(pages * p, p, torch.float32, "cpu", kvcache, need_sort, debug_mode=debug)


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_alloc_takes_whole_pages_without_debug(cls):
    a = _make(cls)
    assert a.alloc(6).tolist() == [4, 5, 6, 7]  # sglang: need_size // P pages, no check
    assert a.free_pages.tolist() == [2, 3, 4, 5, 6, 7, 8]
    with pytest.raises(AssertionError, match="page-aligned"):
        _make(cls, debug=True).alloc(6)


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_alloc_extend_num_new_pages_hint(cls):
    a = _make(cls)
    args = (_t([0, 3]), _t([0, 3]), _t([5, 6]), _t([5, 6]), _t([-1, 14]))
    # request 0: pages 1, 2 (5 slots); request 1 continues slot 15 then page 3
    out = a.alloc_extend(*args, 8, 3)
    assert out.tolist() == [4, 5, 6, 7, 8, 15, 12, 13]
    assert a.free_pages.tolist() == [4, 5, 6, 7, 8]
    out = _make(cls).alloc_extend(*args, 8, num_new_pages=None)
    assert out.tolist() == [4, 5, 6, 7, 8, 15, 12, 13]


def test_alloc_extend_wrong_hint_is_refused():
    a = _make(api.PagedTokenToKVPoolAllocator)
    with pytest.raises(ValueError, match="num_new_pages=2 but the batch needs 3"):
        a.alloc_extend(_t([0, 3]), _t([0, 3]), _t([5, 6]), _t([5, 6]), _t([-1, 14]), 8, 2)
    assert a.available_size() == 8 * 4


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_free_segment_free_segments_and_free_page_ids(cls):
    a = _make(cls, pages=8)
    row = a.alloc(16)  # pages 1..4: slots 4..19
    a.free_segment(row[4:10], start_pos=4)  # pages 2, 3 (reps row[4], row[8])
    assert a.free_pages.tolist()[:2] == [2, 3]
    a.free_segments([(row[0:4], 0), (row[12:14], 12)])  # page 1, then page 4
    assert a.free_pages.tolist()[:4] == [4, 1, 2, 3]
    with pytest.raises(AssertionError, match="shares a page"):
        a.free_segments([(row[0:6], 0), (row[4:8], 4)])
    with pytest.raises(AssertionError, match="not page-aligned"):
        a.free_segment(row[2:6], start_pos=2)
    b = _make(cls)
    b.alloc(8)
    b.free_page_ids(_t([2, 1]))
    assert b.free_pages.tolist()[:2] == [2, 1]  # exactly these pages, in order


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_free_group_order_and_nesting(cls):
    a = _make(cls)
    row = a.alloc(12)  # pages 1, 2, 3
    a.free_group_begin()
    with pytest.raises(AssertionError, match="cannot be nested"):
        a.free_group_begin()
    a.free(row[:4])  # page 1, deferred
    a.free_segment(row[8:12], start_pos=8)  # page 3, deferred as a page id
    assert a.available_size() == 5 * 4
    a.free_group_end()
    assert a.free_pages.tolist()[:2] == [3, 1]  # token frees first, then the page ids
    assert a.free_group is None and a.available_size() == 7 * 4


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_debug_mode_catches_double_free_and_malformed_blocks(cls, monkeypatch):
    monkeypatch.setenv("SGLANG_DEBUG_MEMORY_POOL", "1")
    a = cls(8 * 4, 4, torch.float32, "cpu", None, False)
    assert a.debug_mode
    row = a.alloc(8)
    a.free(row[:4])
    with pytest.raises(AssertionError):
        a.free(row[:2])  # page 1 again
    b = _make(cls, debug=True)
    slots = b.alloc(8)
    bad = torch.cat([slots[:2], slots[4:6]])  # pages 1, 2 but reps [::4] name only page 1
    with pytest.raises(AssertionError):
        b.free_segment(bad, start_pos=0)
    c = _make(cls, debug=True)
    c.alloc(8)
    c.free_group_begin()
    c.free_page_ids(_t([1]))
    c.free_page_ids(_t([1]))
    with pytest.raises(AssertionError):
        c.free_group_end()  # the double free only shows across the group's calls
    with pytest.raises(AssertionError):
        _make(cls, debug=True).alloc_extend(_t([3]), _t([3]), _t([5]), _t([5]), _t([8]), 2)
    monkeypatch.setenv("SGLANG_DEBUG_MEMORY_POOL", "0")
    assert not cls(8 * 4, 4, torch.float32, "cpu", None, False).debug_mode


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_cpu_copies_are_delegated_to_the_kvcache(cls):
    calls = []

    class Cache:
        def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
            calls.append(("get", indices.tolist(), mamba_indices, req_pool_index))
            return "host"

        def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
            calls.append(("load", kv_cache_cpu, indices.tolist(), mamba_indices, req_pool_index))

    a = _make(cls, kvcache=Cache())
    assert a.get_cpu_copy(_t([4, 5]), req_pool_index=3) == "host"
    a.load_cpu_copy("host", _t([4]), _t([1]))
    assert calls[0] == ("get", [4, 5], None, 3)
    assert calls[1][:3] == ("load", "host", [4]) and calls[1][4] is None
    assert isinstance(a.get_kvcache(), Cache)


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_need_sort_staging_and_merge(cls):
    a = _make(cls, pages=6, p=2, need_sort=True)
    a.alloc(10)  # pages 1..5
    a.free(_t([8, 2]))  # pages 4, 1 -> staged (unique ascending: [1, 4])
    assert a.num_staged_pages == 2 and a.get_all_free_pages().tolist() == [6, 1, 4]
    assert a.alloc(4).tolist() == [2, 3, 8, 9]  # short: merged and sorted first
    assert a.staged_pages == [] and a.free_pages.tolist() == [6]


@pytest.mark.parametrize("need_sort", [False, True], ids=["prepend", "need_sort"])
def test_dropin_non_debug_bad_free_keeps_the_live_pages(need_sort):
    """Issue 22: outside debug mode ``free([already_free, live])`` was rejected whole by jspec,
    so the live page was lost (a leak). sglang frees it (and lists the other page twice); the
    drop-in frees the live pages and skips the bad ones (page 0, out of range, already free,
    named twice), so no page is lost and none is listed twice."""
    a = _make(api.PagedTokenToKVPoolAllocator, need_sort=need_sort)
    row = a.alloc(12)  # pages 1, 2, 3
    a.free(row[:4])  # page 1 back
    a.free(torch.cat([row[:1], row[4:5]]))  # page 1 (already free) + page 2 (live)
    pages = a.get_all_free_pages().tolist()
    assert sorted(pages) == [1, 2, 4, 5, 6, 7, 8] and len(set(pages)) == len(pages)
    a.free_page_ids(_t([3, 3, 0, 9, 1]))  # page 3 twice, page 0, out of range, free page 1
    pages = a.get_all_free_pages().tolist()
    assert sorted(pages) == list(range(1, 9)) and a.available_size() == 8 * 4
