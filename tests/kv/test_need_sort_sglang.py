"""need_sort merges where sglang 0.5.23 merges (issue 11 §3): jspec and the torch reference.

sglang 0.5.23's ``PagedTokenToKVPoolAllocator`` merges staged pages (``merge_and_sort_free``)
before ``alloc_extend`` when ``extend_num_tokens // P + bs + 1 > len(free_pages)`` and before
``alloc_decode`` when ``bs > len(free_pages)`` (quick bounds, not the exact page count).

The sequence (P=64, 13 pages, two requests A and B), every value derived by hand:

1. extend [0,0]->[147,154]: A gets pages 1,2,3 (slots 64..210), B pages 4,5,6 (256..409).
2. extend [147,154]->[339,311]: A continues page 3 (211..255) then pages 7,8,9 (448..594);
   B continues page 6 (410..447) then pages 10,11 (640..758). Free [12, 13].
3. decode from last slots [594, 758] (seq [340, 312]): slots [595, 759], no page.
4. free_segment(row B, 192..312): pages 10, 11 staged.
5. decode B from last slot 447 (seq 193 = 3*64+1): new page 12, slot 768. Free [13].
6. free all 533 remaining slots (A: 340, B: 193): pages 1-9 and 12 staged (12 staged, 1 free).
7. extend [0]->[13]: one page needed, one free; sglang's bound 13//64 + 1 + 1 = 2 > 1 merges
   first, so it returns slots 64..76 (page 1) and leaves pages 2..13 free, none staged. The
   exact-count rule would not merge: page 13 (slots 832..844), 0 free, 12 staged.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.kv import allocator as A

P, NUM_PAGES = 64, 13
ROW_A = list(range(64, 211)) + list(range(211, 256)) + list(range(448, 595)) + [595]
ROW_B = list(range(256, 410)) + list(range(410, 448)) + list(range(640, 759)) + [759]
LAST_SLOTS = list(range(64, 77))
FREE_AFTER = list(range(2, 14))


def _i32(xs):
    return jnp.asarray(xs, jnp.int32)


def _lists(a):
    nf, ns = int(a.num_free), int(a.num_staged)
    return [int(x) for x in a.free_pages[:nf]], sorted(int(x) for x in a.staged_pages[:ns])


def _run_jspec(merge_rule: str):
    a = A.init_allocator(NUM_PAGES, P, need_sort=True)
    ext = {"max_new_slots": 512, "merge_rule": merge_rule}
    a, s, ok = A.alloc_extend(a, _i32([0, 0]), _i32([147, 154]), _i32([-1, -1]), **ext)
    assert bool(ok) and np.asarray(s[:301]).tolist() == ROW_A[:147] + ROW_B[:154]
    a, s, ok = A.alloc_extend(a, _i32([147, 154]), _i32([339, 311]), _i32([210, 409]), **ext)
    assert bool(ok) and np.asarray(s[:349]).tolist() == ROW_A[147:339] + ROW_B[154:311]
    assert _lists(a) == ([12, 13], [])
    a, s, ok = A.alloc_decode(a, _i32([340, 312]), _i32([594, 758]), merge_rule=merge_rule)
    assert bool(ok) and np.asarray(s).tolist() == [595, 759]
    a, ok = A.free_segment(a, _i32(ROW_B + [0] * 8), 192, 312, return_ok=True)
    assert bool(ok) and _lists(a) == ([12, 13], [10, 11])
    a, s, ok = A.alloc_decode(a, _i32([193]), _i32([447]), merge_rule=merge_rule)
    assert bool(ok) and np.asarray(s).tolist() == [768]
    a, ok = A.free(a, _i32(ROW_A + ROW_B[:192] + [768]), return_ok=True)
    assert bool(ok) and _lists(a) == ([13], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    a, s, ok = A.alloc_extend(a, _i32([0]), _i32([13]), _i32([-1]), **ext)
    assert bool(ok)
    return np.asarray(s[:13]).tolist(), _lists(a)


def test_jspec_merges_like_sglang() -> None:
    slots, (free, staged) = _run_jspec("sglang")
    assert slots == LAST_SLOTS and free == FREE_AFTER and staged == []
    # The exact-count rule (jspec's old default) parts from sglang on the last call only.
    slots, (free, staged) = _run_jspec("exact")
    assert slots == list(range(832, 845)) and free == [] and len(staged) == 12


def test_torch_reference_merges_like_sglang() -> None:
    torch = pytest.importorskip("torch")
    from interop.kv.reference_allocator import PagedTokenToKVPoolAllocator

    def t(xs):
        return torch.tensor(xs, dtype=torch.int64)

    r = PagedTokenToKVPoolAllocator(NUM_PAGES * P, P, torch.float16, "cpu", None, need_sort=True)
    out = r.alloc_extend(t([0, 0]), t([0, 0]), t([147, 154]), t([147, 154]), t([-1, -1]), 301)
    assert out.tolist() == ROW_A[:147] + ROW_B[:154]
    out = r.alloc_extend(
        t([147, 154]), t([147, 154]), t([339, 311]), t([339, 311]), t([210, 409]), 349
    )
    assert out.tolist() == ROW_A[147:339] + ROW_B[154:311]
    assert r.alloc_decode(t([340, 312]), t([340, 312]), t([594, 758])).tolist() == [595, 759]
    r.free_segment(t(ROW_B[192:312]), start_pos=192)
    assert r.alloc_decode(t([193]), t([193]), t([447])).tolist() == [768]
    r.free(t(ROW_A + ROW_B[:192] + [768]))
    assert len(r.free_pages) == 1 and len(r.release_pages) == 12
    out = r.alloc_extend(t([0]), t([0]), t([13]), t([13]), t([-1]), 13)
    assert out.tolist() == LAST_SLOTS
    assert r.free_pages.tolist() == FREE_AFTER and len(r.release_pages) == 0


def test_padding_rows_do_not_count_in_bs() -> None:
    """A drop-in pads sglang's batch; ``valid`` keeps the padding out of sglang's ``bs``."""
    a = A.init_allocator(6, 4, need_sort=True)
    a = A.alloc(a, 16, max_slots=16)[0]  # free [5, 6]
    a = A.free(a, _i32([4]))  # staged [1]
    # sglang, one request 0 -> 1: 1//4 + 1 + 1 = 2 > 2 is False: no merge, page 5.
    _, s, ok = A.alloc_extend(
        a,
        _i32([0, 0]),
        _i32([1, 0]),
        _i32([-1, -1]),
        max_new_slots=4,
        valid=jnp.array([True, False]),
    )
    assert bool(ok) and np.asarray(s).tolist() == [20, 0, 0, 0]
    # Counted as a row of sglang's batch, the padding would trigger the merge: page 1.
    _, s, ok = A.alloc_extend(a, _i32([0, 0]), _i32([1, 0]), _i32([-1, -1]), max_new_slots=4)
    assert bool(ok) and np.asarray(s).tolist() == [4, 0, 0, 0]
