"""Allocator integrity: owned-page mask, violation counts, sglang-like error messages."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.kv import allocator as A
from jspec.kv import integrity as I

P = 4
NUM_PAGES = 8


def _arr(xs):
    return jnp.asarray(xs, jnp.int32)


def _setup():
    """Two requests: row 1 owns pages 1, 2 (7 positions), row 2 owns page 3 (4 positions)."""
    a = A.init_allocator(NUM_PAGES, P)
    a, slots, _ = A.alloc(a, jnp.int32(12), max_slots=12)  # pages 1, 2, 3
    table = np.zeros((3, 12), np.int32)
    table[1, :7] = np.asarray(slots)[:7]
    table[2, :4] = np.asarray(slots)[8:12]
    table[2, 4:8] = 99  # stale past allocated len
    owned = I.owned_page_mask(
        jnp.asarray(table), _arr([1, 2]), _arr([7, 4]), num_pages=NUM_PAGES, page_size=P
    )
    return a, table, owned


def _numpy_owned(table, rows, lens, valid):
    mask = np.zeros(NUM_PAGES + 1, bool)
    for r, n, v in zip(rows, lens, valid):
        if v:
            mask[table[r, :n] // P] = True
    return mask


def test_owned_page_mask_matches_numpy() -> None:
    _a, table, owned = _setup()
    assert list(np.nonzero(np.asarray(owned))[0]) == [1, 2, 3]
    rng = np.random.default_rng(0)
    table = rng.integers(P, (NUM_PAGES + 1) * P, (4, 10)).astype(np.int32)
    rows, lens, valid = [3, 1, 0, 2], [10, 0, 5, 3], [True, True, False, True]
    got = I.owned_page_mask(
        jnp.asarray(table),
        _arr(rows),
        _arr(lens),
        num_pages=NUM_PAGES,
        page_size=P,
        valid=jnp.asarray(valid),
    )
    np.testing.assert_array_equal(got, _numpy_owned(table, rows, lens, valid))


def test_healthy_state_has_no_violations() -> None:
    a, _, owned = _setup()
    counts = {k: int(v) for k, v in I.integrity_violations(a, owned).items()}
    assert counts == {
        "duplicate_free": 0,
        "page0_free": 0,
        "out_of_range_free": 0,
        "num_free": 5,
        "owned_and_free": 0,
        "lost": 0,
        "num_owned": 3,
    }
    I.check_integrity(a, owned, what="healthy")
    I.check_integrity(a)


def test_leak_detected() -> None:
    a, table, _ = _setup()
    # Request 2 "forgot" its page: it owns nothing, yet page 3 never came back.
    owned = I.owned_page_mask(
        jnp.asarray(table), _arr([1, 2]), _arr([7, 0]), num_pages=NUM_PAGES, page_size=P
    )
    assert int(I.integrity_violations(a, owned)["lost"]) == 1
    with pytest.raises(
        I.AllocatorIntegrityError,
        match=r"step 3: token_to_kv_pool_allocator memory leak detected! "
        r"available=20 owned=8 total=32 .*lost: \[3\]",
    ):
        I.check_integrity(a, owned, what="step 3")


def test_use_after_free_detected() -> None:
    a, _, owned = _setup()
    a = A.free(a, _arr([8]))  # page 2 freed, still owned
    assert int(I.integrity_violations(a, owned)["owned_and_free"]) == 1
    with pytest.raises(
        I.AllocatorIntegrityError, match=r"use-after-free: page ids \[2\] are both owned and free"
    ):
        I.check_integrity(a, owned)
    I.check_integrity(a)  # free lists alone are fine


@pytest.mark.parametrize("need_sort", [False, True])
def test_double_free_detected(need_sort: bool) -> None:
    a = A.init_allocator(NUM_PAGES, P, need_sort=need_sort)
    a = A.alloc(a, jnp.int32(8), max_slots=8)[0]
    a = A.free(a, _arr([4]))
    again, ok = A.free(a, _arr([5]), return_ok=True)  # page 1 again: refused
    assert not bool(ok) and int(I.integrity_violations(again)["duplicate_free"]) == 0
    # A state corrupted some other way (page 1 listed twice) is caught after the fact.
    if need_sort:
        a = dataclasses.replace(
            a, staged_pages=a.staged_pages.at[1].set(1), num_staged=a.num_staged + 1
        )
    else:
        a = dataclasses.replace(
            a, free_pages=a.free_pages.at[a.num_free].set(1), num_free=a.num_free + 1
        )
    assert int(I.integrity_violations(a)["duplicate_free"]) == 1
    with pytest.raises(I.AllocatorIntegrityError, match=r"duplicate free pages \[1\]"):
        I.check_integrity(a)


def test_page0_and_range_detected() -> None:
    a = A.init_allocator(NUM_PAGES, P)
    a = A.alloc(a, jnp.int32(8), max_slots=8)[0]
    refused, ok = A.free(a, _arr([2]), return_ok=True)  # page 0: refused
    assert not bool(ok) and int(I.integrity_violations(refused)["page0_free"]) == 0
    bad = dataclasses.replace(a, free_pages=a.free_pages.at[0].set(0))  # corrupted elsewhere
    counts = I.integrity_violations(bad)
    assert int(counts["page0_free"]) == 1 and int(counts["out_of_range_free"]) == 0
    with pytest.raises(I.AllocatorIntegrityError, match=r"outside \[1, 8\]: \[0\]"):
        I.check_integrity(bad)
    worse = dataclasses.replace(a, free_pages=a.free_pages.at[0].set(-3))
    assert int(I.integrity_violations(worse)["out_of_range_free"]) == 1
    with pytest.raises(I.AllocatorIntegrityError, match=r"\[-3\]"):
        I.check_integrity(worse)


def test_error_is_an_assertion_error() -> None:
    assert issubclass(I.AllocatorIntegrityError, AssertionError)


def test_row_minus_one_write_is_a_leak_after_the_fact() -> None:
    """The old ``assign_req_to_token_pool`` bug's state: a new request passed row id -1, so its
    page went into the last row (another request's) and that request's own page was lost."""
    a, table, _ = _setup()  # rows 1, 2 live: pages 1, 2 / 3
    a, slots, _ = A.alloc(a, jnp.int32(4), max_slots=4)  # page 4 for a new request
    table = np.concatenate([table, np.zeros((1, 12), np.int32)])  # row 3: the new request
    table[[1, 3]] = table[[3, 1]]  # live rows 3 (pages 1, 2) and 2 (page 3); row 1 is new
    table[-1, :4] = np.asarray(slots)  # what row id -1 wrote: row 3 now maps page 4
    owned = I.owned_page_mask(
        jnp.asarray(table), _arr([3, 2, 1]), _arr([7, 4, 4]), num_pages=NUM_PAGES, page_size=P
    )
    with pytest.raises(I.AllocatorIntegrityError, match=r"leak detected.*pages lost: \[1\]"):
        I.check_integrity(a, owned)


@pytest.mark.parametrize(
    "num_free,num_staged", [(NUM_PAGES + 1, 0), (-1, 0), (0, NUM_PAGES + 1), (0, -1)]
)
def test_bad_free_list_counts_detected(num_free, num_staged) -> None:
    """A count outside ``[0, num_pages]`` is named before any list is read."""
    a = dataclasses.replace(
        A.init_allocator(NUM_PAGES, P),
        num_free=jnp.int32(num_free),
        num_staged=jnp.int32(num_staged),
    )
    want = rf"bad free-list counts num_free={num_free} num_staged={num_staged} \(num_pages=8\)"
    with pytest.raises(I.AllocatorIntegrityError, match=want):
        I.check_integrity(a)


def test_full_and_empty_free_lists_are_healthy() -> None:
    """``num_free == 0`` (every page taken) and ``num_free == num_pages`` are in range."""
    a = A.init_allocator(NUM_PAGES, P)
    I.check_integrity(a)
    full, _, ok = A.alloc(a, jnp.int32(NUM_PAGES * P), max_slots=NUM_PAGES * P)
    assert bool(ok) and int(full.num_free) == 0
    I.check_integrity(full)
