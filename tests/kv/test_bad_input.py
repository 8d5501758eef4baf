"""Bad input through the public kv API (issue 11 §2): a flag and the state unchanged, a probe
when on, ``check_integrity`` after the fact, ``ValueError`` naming the field for static mistakes.

Every expected value is by hand. Poisoned tables (``POISON``) show rows were left untouched.
"""

from __future__ import annotations

import dataclasses
import re

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import probes
from jspec.config import SpecConfig
from jspec.kv import allocator as A
from jspec.kv import integrity as I
from jspec.kv import req_to_token as T

POISON = -7


def _i32(xs):
    return jnp.asarray(xs, jnp.int32)


def _lists(a):
    nf, ns = int(a.num_free), int(a.num_staged)
    return [int(x) for x in a.free_pages[:nf]], [int(x) for x in a.staged_pages[:ns]]


# ---- alloc: unaligned size ----------------------------------------------------------------------
def test_alloc_unaligned_size_is_refused() -> None:
    a = A.init_allocator(4, 4)
    a2, slots, ok = A.alloc(a, 6, max_slots=8)
    assert not bool(ok) and not np.asarray(slots).any()
    chex.assert_trees_all_equal(a2, a)
    a3, slots, ok = A.alloc(a, 8, max_slots=8)  # aligned: pages 1, 2
    assert bool(ok) and np.asarray(slots).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert _lists(a3) == ([3, 4], [])
    with pytest.raises(probes.ProbeError, match=r"alloc: num_slots: value 6 .* page_size=4"):
        probes.checked(A.alloc)(a, 6, max_slots=8)


def test_check_integrity_sees_a_handed_out_page_still_free() -> None:
    """The old bug's state: page 1 handed out (owned by a row) but still on the free list."""
    a = A.init_allocator(4, 4)
    table = np.zeros((2, 8), np.int32)
    table[1, :6] = [4, 5, 6, 7, 8, 9]  # pages 1, 2
    owned = I.owned_page_mask(jnp.asarray(table), _i32([1]), _i32([6]), num_pages=4, page_size=4)
    bad = dataclasses.replace(a, free_pages=_i32([2, 3, 4, 1]), num_free=jnp.int32(3))
    with pytest.raises(I.AllocatorIntegrityError, match=r"use-after-free: page ids \[2\]"):
        I.check_integrity(bad, owned)


# ---- free: padding page / out of range / double free ----------------------------------------------
@pytest.mark.parametrize(
    "slots",
    [[0, 1, 2, 3], [4, 20], [-4], [8, 2]],
    ids=["page0", "out_of_range", "negative", "mixed_page0"],
)
def test_free_bad_slots_rejected_whole(slots) -> None:
    a = A.init_allocator(4, 4)
    a = A.alloc(a, 16, max_slots=16)[0]  # all 4 pages used
    a2, ok = A.free(a, _i32(slots), return_ok=True)
    assert not bool(ok)
    chex.assert_trees_all_equal(a2, a)
    chex.assert_trees_all_equal(A.free(a, _i32(slots)), a)  # default return: state only
    _, _, ok = A.alloc(a2, 4, max_slots=4)
    assert not bool(ok)  # page 0 never handed out


def test_free_double_free_rejected() -> None:
    a = A.init_allocator(4, 4)
    a = A.alloc(a, 8, max_slots=8)[0]  # pages 1, 2 used
    a = A.free(a, _i32([4]))  # page 1 back: [1, 3, 4]
    assert _lists(a) == ([1, 3, 4], [])
    a2, ok = A.free(a, _i32([5, 8]), return_ok=True)  # page 1 again + page 2
    assert not bool(ok)
    chex.assert_trees_all_equal(a2, a)
    a3, ok = A.free_page_ids(a, _i32([2, 2]), return_ok=True)  # twice in one call
    assert not bool(ok)
    chex.assert_trees_all_equal(a3, a)
    a4, ok = A.free_page_ids(a, _i32([2]), return_ok=True)
    assert bool(ok) and _lists(a4) == ([2, 1, 3, 4], [])


def test_free_segment_bad_input_rejected() -> None:
    a = A.init_allocator(4, 4)
    a = A.alloc(a, 8, max_slots=8)[0]  # pages 1, 2
    row = _i32([4, 5, 6, 7, 8, 9, 10, 11])
    for start, end in [(2, 8), (4, 12), (8, 4), (-4, 4)]:  # unaligned / bounds
        a2, ok = A.free_segment(a, row, start, end, return_ok=True)
        assert not bool(ok)
        chex.assert_trees_all_equal(a2, a)
    for start, end in [(4, 12), (8, 4), (-4, 4)]:  # a probe names the bounds
        want = f"free_segment: need 0 <= start <= end <= 8, got start={start} end={end}"
        with pytest.raises(probes.ProbeError, match=re.escape(want)):
            probes.checked(A.free_segment)(a, row, start, end)
    a2, ok = A.free_segment(a, _i32([0, 1, 2, 3, 8, 9, 10, 11]), 0, 8, return_ok=True)
    assert not bool(ok)  # page 0 in the row
    chex.assert_trees_all_equal(a2, a)
    a2, ok = A.free_segment(a, row, 4, 8, return_ok=True)
    assert bool(ok) and _lists(a2) == ([2, 3, 4], [])


def test_check_integrity_sees_page0_after_the_fact() -> None:
    a = A.init_allocator(4, 4)
    bad = dataclasses.replace(a, free_pages=_i32([0, 1, 2, 3]))
    with pytest.raises(I.AllocatorIntegrityError, match=r"outside \[1, 4\]: \[0\]"):
        I.check_integrity(bad)


def test_free_probes_name_the_page() -> None:
    a = A.alloc(A.init_allocator(4, 4), 8, max_slots=8)[0]
    with pytest.raises(probes.ProbeError, match=r"free: slot_ids: min value 0 < low bound 4"):
        probes.checked(A.free)(a, _i32([0, 1, 2, 3]))
    with pytest.raises(probes.ProbeError, match=r"free: double free of page 3"):
        probes.checked(A.free)(a, _i32([12]))


@pytest.mark.parametrize("fn", [A.free, A.free_page_ids], ids=["free", "free_page_ids"])
def test_empty_and_single_frees_trace_with_probes_on(fn) -> None:
    """An empty id array once failed to trace under probes (argmax of an empty array)."""
    a = A.alloc(A.init_allocator(4, 4), 8, max_slots=8)[0]
    b, ok = probes.checked(fn)(a, _i32([]), return_ok=True)
    assert bool(ok) and _lists(b) == _lists(a)
    one = 8 if fn is A.free else 2  # slot 8 lies on page 2
    b, ok = probes.checked(fn)(a, _i32([one]), return_ok=True)
    assert bool(ok) and _lists(b)[0] == [2, 3, 4]
    with pytest.raises(probes.ProbeError, match="double free of page 3"):
        probes.checked(fn)(a, _i32([12 if fn is A.free else 3]))


# ---- alloc_extend / alloc_decode row contracts -------------------------------------------------
def test_alloc_rows_contracts_rejected() -> None:
    a = A.init_allocator(4, 4)
    for pre, seq, last in [([3], [2], [2]), ([2], [5], [7]), ([-4], [4], [-5])]:
        a2, slots, ok = A.alloc_extend(a, _i32(pre), _i32(seq), _i32(last), max_new_slots=8)
        assert not bool(ok) and not np.asarray(slots).any()
        chex.assert_trees_all_equal(a2, a)
    for seq, last in [([0], [-2]), ([6], [7])]:
        a2, slots, ok = A.alloc_decode(a, _i32(seq), _i32(last))
        assert not bool(ok) and not np.asarray(slots).any()
        chex.assert_trees_all_equal(a2, a)


# ---- assign_req_to_token_pool: bad rows ---------------------------------------------------------
@pytest.mark.parametrize(
    "rows,start,end",
    [
        ([1, -1], [0, 0], [2, 2]),
        ([1, 3], [0, 0], [2, 2]),
        ([1, 2], [0, 3], [2, 2]),
        ([1, 2], [0, 5], [2, 7]),
    ],
    ids=["row_minus1", "row_past_end", "start_gt_end", "end_past_width"],
)
def test_assign_bad_rows_write_nothing(rows, start, end) -> None:
    table = jnp.full((3, 6), POISON, jnp.int32)
    locs = _i32([11, 12, 13, 14, 15, 16, 17])
    out, ok = T.assign_req_to_token_pool(
        table, _i32(rows), _i32(start), _i32(end), locs, return_ok=True
    )
    assert not bool(ok)
    assert (np.asarray(out) == POISON).all()
    assert (
        np.asarray(T.assign_req_to_token_pool(table, _i32(rows), _i32(start), _i32(end), locs))
        == POISON
    ).all()


def test_assign_good_rows_and_padding_rows() -> None:
    table = jnp.full((3, 6), POISON, jnp.int32)
    out, ok = T.assign_req_to_token_pool(
        table, _i32([2, -1]), _i32([1, 0]), _i32([3, 0]), _i32([11, 12]), return_ok=True
    )
    assert bool(ok)  # a padding row (start == end) may say -1
    want = np.full((3, 6), POISON)
    want[2, 1:3] = [11, 12]
    np.testing.assert_array_equal(out, want)


def test_assign_probe_names_the_row() -> None:
    table = jnp.zeros((3, 6), jnp.int32)
    with pytest.raises(probes.ProbeError, match=r"req_pool_indices: min value -1 < low bound 0"):
        probes.checked(T.assign_req_to_token_pool)(
            table, _i32([1, -1]), _i32([0, 0]), _i32([2, 2]), _i32([1, 2, 3, 4])
        )


# ---- request rows: double free -------------------------------------------------------------------
CFG = SpecConfig(max_running_requests=4)


def test_req_rows_double_free_rejected() -> None:
    r = T.init_req_rows(CFG)  # free [1, 2, 3, 4]
    r, rows, ok = T.alloc_req_rows(r, 2, max_rows=2)
    assert bool(ok) and np.asarray(rows).tolist() == [1, 2]  # free [3, 4]
    r = T.free_req_rows(r, _i32([2]))  # free [3, 4, 2]
    for bad in ([2], [1, 1], [0], [5]):  # double / twice / range
        r2, ok = T.free_req_rows(r, _i32(bad), return_ok=True)
        assert not bool(ok)
        chex.assert_trees_all_equal(r2, r)
    _, rows, ok = T.alloc_req_rows(T.free_req_rows(r, _i32([2])), 3, max_rows=3)
    assert bool(ok) and np.asarray(rows).tolist() == [3, 4, 2]  # distinct rows
    with pytest.raises(probes.ProbeError, match=r"free_req_rows: double free of row 2"):
        probes.checked(T.free_req_rows)(r, _i32([2]))


def test_check_req_rows_integrity() -> None:
    r = T.init_req_rows(CFG)
    r, _, _ = T.alloc_req_rows(r, 2, max_rows=2)  # live 1, 2
    I.check_req_rows_integrity(r, [1, 2], what="ok")
    dup = dataclasses.replace(r, free_rows=_i32([3, 4, 2, 2]), num_free=jnp.int32(4))
    with pytest.raises(I.AllocatorIntegrityError, match=r"duplicate free request rows \[2\]"):
        I.check_req_rows_integrity(dup)
    both = dataclasses.replace(r, free_rows=_i32([3, 4, 2, 0]), num_free=jnp.int32(3))
    with pytest.raises(I.AllocatorIntegrityError, match=r"rows \[2\] are both free and live"):
        I.check_req_rows_integrity(both, [1, 2])
    with pytest.raises(I.AllocatorIntegrityError, match=r"leak detected.*rows lost: \[2\]"):
        I.check_req_rows_integrity(r, [1])
    last = dataclasses.replace(r, num_free=jnp.int32(1))  # free [3]: the last row, 4, lost
    with pytest.raises(I.AllocatorIntegrityError, match=r"leak detected.*rows lost: \[4\]"):
        I.check_req_rows_integrity(last, [1, 2])
    for bad in (-1, 5):
        with pytest.raises(
            I.AllocatorIntegrityError, match=rf"bad request-row count num_free={bad}"
        ):
            I.check_req_rows_integrity(dataclasses.replace(r, num_free=jnp.int32(bad)))
    with pytest.raises(I.AllocatorIntegrityError, match=r"outside \[1, 4\]: \[0\]"):
        I.check_req_rows_integrity(dataclasses.replace(r, num_free=jnp.int32(3)))


# ---- static mistakes: ValueError naming the field -------------------------------------------------
def test_static_mistakes_name_the_field() -> None:
    a = A.init_allocator(4, 4)
    with pytest.raises(ValueError, match="max_slots=-1"):
        A.alloc(a, 4, max_slots=-1)
    with pytest.raises(ValueError, match="max_new_slots=2.5"):
        A.alloc_extend(a, _i32([0]), _i32([4]), _i32([-1]), max_new_slots=2.5)
    with pytest.raises(ValueError, match=r"seq_lens.shape=\(2,\) must be \(1,\)"):
        A.alloc_extend(a, _i32([0]), _i32([4, 4]), _i32([-1]), max_new_slots=8)
    with pytest.raises(ValueError, match=r"valid.shape=\(3,\) must be \(2,\)"):
        A.alloc_decode(a, _i32([1, 1]), _i32([-1, -1]), valid=jnp.ones(3, bool))
    with pytest.raises(ValueError, match="row_slot_ids must be 1-D"):
        A.free_segment(a, jnp.zeros((2, 4), jnp.int32), 0, 4)
    with pytest.raises(ValueError, match="req_to_token.ndim=1 must be 2"):
        T.assign_req_to_token_pool(
            jnp.zeros(6, jnp.int32), _i32([1]), _i32([0]), _i32([1]), _i32([5])
        )
    with pytest.raises(ValueError, match=r"end_offset.shape=\(2,\) must be \(1,\)"):
        T.assign_req_to_token_pool(
            jnp.zeros((2, 6), jnp.int32), _i32([1]), _i32([0]), _i32([1, 1]), _i32([5])
        )
