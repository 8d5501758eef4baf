"""jspec.kv.allocator vs an independent list-based model of sglang's paged allocator (SPEC §10)."""

from __future__ import annotations

import pathlib
import random
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import probes
from jspec.config import SpecConfig
from jspec.kv import allocator as A
from jspec.kv.free_group import FreeGroup

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _alloc_model import (
    Harness,
    ModelAllocator,
    assert_same_state,
    assert_state_identical,
    state_lists,
)

I32 = jnp.int32
OP_WEIGHTS = {
    "extend": 5,
    "decode": 3,
    "alloc": 2,
    "free": 2,
    "free_segment": 2,
    "free_page_ids": 1,
    "merge": 1,
}


def _arr(xs):
    return jnp.asarray(xs, I32)


# ---- random call sequences vs the model ---------------------------------------------------------
@pytest.mark.parametrize("need_sort", [False, True], ids=["fifo", "need_sort"])
@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
def test_random_sequences_match_model(page_size: int, need_sort: bool) -> None:
    rng = random.Random(1000 * page_size + need_sort)
    h = Harness(page_size, need_sort, num_pages=10)
    for _ in range(40):
        h.step(rng.choices(list(OP_WEIGHTS), list(OP_WEIGHTS.values()))[0], rng)
    assert h.failures > 0  # exhaustion was exercised


def test_random_sequence_pallas_impl() -> None:
    rng = random.Random(7)
    h = Harness(4, False, num_pages=12, impl="pallas")
    for _ in range(12):
        h.step(rng.choices(list(OP_WEIGHTS), list(OP_WEIGHTS.values()))[0], rng)


# ---- construction -------------------------------------------------------------------------------
def test_init_and_available_size() -> None:
    a = A.init_allocator(5, 4)
    assert state_lists(a) == ([1, 2, 3, 4, 5], [])
    assert int(A.available_size(a)) == 20
    cfg = SpecConfig(page_size=16, num_pages=32)
    b = A.allocator_from_config(cfg, need_sort=True)
    assert (b.page_size, b.num_pages, b.need_sort) == (16, 32, True)
    assert int(A.available_size(b)) == cfg.pool_size


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_pages": 0, "page_size": 4}, "num_pages=0"),
        ({"num_pages": 4, "page_size": 3}, "page_size=3"),
        ({"num_pages": 2**30, "page_size": 4}, "num_pages=1073741824"),
    ],
)
def test_init_rejects_bad_static_args(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        A.init_allocator(**kwargs)


def test_bad_static_kwargs() -> None:
    a = A.init_allocator(4, 4)
    with pytest.raises(ValueError, match="merge_rule='nope'"):
        A.alloc_extend(a, _arr([0]), _arr([4]), _arr([-1]), max_new_slots=8, merge_rule="nope")
    with pytest.raises(ValueError, match="impl='triton' is not available"):
        A.alloc_extend(a, _arr([0]), _arr([4]), _arr([-1]), max_new_slots=8, impl="triton")
    with pytest.raises(ValueError, match=r"seq_lens.shape=\(2,\) must be \(1,\)"):
        A.alloc_extend(a, _arr([0]), _arr([4, 4]), _arr([-1]), max_new_slots=8)


# ---- hand-checked vectors -----------------------------------------------------------------------
def test_spec14_worked_example() -> None:
    """SPEC §14: P=4, committed=allocated=7 -> alloc_extend(pre=7, seq=40), then seq 44."""
    a = A.init_allocator(32, 4)
    a, first, ok = A.alloc(a, I32(8), max_slots=8)  # pages 1, 2 -> slots 4..11
    assert bool(ok) and list(np.asarray(first)) == list(range(4, 12))
    row = list(np.asarray(first))[:7]  # positions 0..6
    a, slots, ok = A.alloc_extend(a, _arr([7]), _arr([40]), _arr([row[6]]), max_new_slots=64)
    slots = list(np.asarray(slots))
    assert bool(ok)
    assert slots[0] == 11  # part 1: continues page 2
    assert slots[1:33] == list(range(12, 44))  # 8 full pages 3..10
    assert slots[33:] == [0] * 31
    row += slots[:33]
    a, more, ok = A.alloc_extend(a, _arr([40]), _arr([44]), _arr([row[39]]), max_new_slots=8)
    assert list(np.asarray(more)) == [44, 45, 46, 47, 0, 0, 0, 0]
    assert state_lists(a)[0] == list(range(12, 33))


def test_alloc_extend_three_parts_batch() -> None:
    """P=4 batch with a partial prefix page, a padding row, an in-page growth and a fresh row."""
    a = A.free_page_ids(A.init_allocator(8, 4), _arr([]))
    a = A.alloc(a, I32(8), max_slots=8)[0]  # pages 1,2 taken: free 3..8
    pre = [5, 0, 2, 0]
    seq = [14, 0, 3, 6]
    last = [24, -1, 33, -1]  # slots of positions pre-1
    a, slots, ok = A.alloc_extend(a, _arr(pre), _arr(seq), _arr(last), max_new_slots=20)
    want = (
        [25, 26, 27]
        + [12, 13, 14, 15]
        + [16, 17]  # req 0: part1, page 3, page 4 tail
        + [34]  # req 2: inside its page
        + [20, 21, 22, 23, 24, 25]
    )  # req 3: page 5, page 6 head
    want[-2:] = [24, 25]
    assert bool(ok)
    assert list(np.asarray(slots)) == want + [0] * (20 - len(want))
    assert state_lists(a)[0] == [7, 8]


def test_alloc_decode_vector() -> None:
    a = A.init_allocator(6, 4)
    seq = [5, 6, 1, 9, 3]  # 5, 1, 9 start pages
    last = [7, 12, -1, 30, 41]
    valid = [True, True, True, False, True]
    a, slots, ok = A.alloc_decode(a, _arr(seq), _arr(last), valid=jnp.asarray(valid))
    assert bool(ok)
    assert list(np.asarray(slots)) == [4, 13, 8, 0, 42]
    assert state_lists(a)[0] == [3, 4, 5, 6]


def test_alloc_decode_page_size_1_always_new_page() -> None:
    a = A.init_allocator(4, 1)
    a, slots, _ok = A.alloc_decode(a, _arr([3, 7]), _arr([5, 9]))
    assert list(np.asarray(slots)) == [1, 2] and state_lists(a)[0] == [3, 4]


# ---- exhaustion ---------------------------------------------------------------------------------
@pytest.mark.parametrize("need_sort", [False, True])
def test_exhaustion_leaves_state_unchanged(need_sort: bool) -> None:
    a = A.init_allocator(4, 4, need_sort=need_sort)
    a, _, ok = A.alloc(a, I32(12), max_slots=16)
    a = A.free(a, _arr([4, 5]))  # page 1 free (staged if need_sort)
    before = a
    for new, slots, ok in [
        A.alloc(before, I32(12), max_slots=16),
        A.alloc_extend(before, _arr([0, 0]), _arr([8, 5]), _arr([-1, -1]), max_new_slots=16),
        A.alloc_decode(before, _arr([1, 5, 9]), _arr([-1, 3, 7])),
        A.alloc_extend(before, _arr([0]), _arr([4]), _arr([-1]), max_new_slots=3),  # too small
    ]:
        assert not bool(ok)
        assert not np.asarray(slots).any()
        assert_state_identical(new, before)


def test_alloc_exact_fit_and_zero() -> None:
    a = A.init_allocator(3, 2)
    a0, slots, ok = A.alloc(a, I32(0), max_slots=4)
    assert bool(ok) and not np.asarray(slots).any()
    assert_state_identical(a0, a)
    a1, slots, ok = A.alloc(a, I32(6), max_slots=6)
    assert bool(ok) and list(np.asarray(slots)) == [2, 3, 4, 5, 6, 7]
    assert int(a1.num_free) == 0 and int(A.available_size(a1)) == 0


# ---- need_sort ----------------------------------------------------------------------------------
def test_need_sort_stages_then_merges_sorted() -> None:
    a = A.init_allocator(6, 4, need_sort=True)
    a, slots, _ = A.alloc(a, I32(20), max_slots=24)  # pages 1..5, free [6]
    a = A.free(a, _arr([17, 8, 9]))  # pages 2, 4 -> staged
    a = A.free(a, _arr([5]))  # page 1 -> staged after them
    assert state_lists(a) == ([6], [2, 4, 1])
    a1, slots, ok = A.alloc(a, I32(4), max_slots=4)  # enough: no merge
    assert bool(ok)
    assert list(np.asarray(slots)) == [24, 25, 26, 27] and state_lists(a1) == ([], [2, 4, 1])
    a2, slots, _ = A.alloc(a, I32(8), max_slots=8)  # short: merge -> [1, 2, 4, 6]
    assert list(np.asarray(slots)) == [4, 5, 6, 7, 8, 9, 10, 11]
    assert state_lists(a2) == ([4, 6], [])
    assert state_lists(A.merge_and_sort_free(a)) == ([1, 2, 4, 6], [])


def test_merge_rule_sglang_quick_bound() -> None:
    """sglang merges when ``tokens//P + bs + 1 > len(free)`` even if the exact count fits."""
    a = A.init_allocator(6, 4, need_sort=True)
    a = A.alloc(a, I32(16), max_slots=16)[0]  # free [5, 6]
    a = A.free(a, _arr([4]))  # staged [1]
    args = (a, _arr([0]), _arr([4]), _arr([-1]))
    _, exact, _ = A.alloc_extend(*args, max_new_slots=4, merge_rule="exact")
    _, quick, _ = A.alloc_extend(*args, max_new_slots=4)  # default: sglang 0.5.23
    assert list(np.asarray(exact)) == [20, 21, 22, 23]  # page 5, no merge
    assert list(np.asarray(quick)) == [4, 5, 6, 7]  # 1 + 1 + 1 > 2: merged, page 1
    dec_args = (a, _arr([1, 2, 1]), _arr([-1, 100, -1]))
    _, exact, _ = A.alloc_decode(*dec_args, merge_rule="exact")
    _, quick, _ = A.alloc_decode(*dec_args)
    assert list(np.asarray(exact)) == [20, 101, 24]  # 2 new pages fit: no merge
    assert list(np.asarray(quick)) == [4, 101, 20]  # bs 3 > 2: merged first


# ---- freeing ------------------------------------------------------------------------------------
def test_free_prepends_unique_sorted_pages() -> None:
    a = A.init_allocator(6, 4)
    a = A.alloc(a, I32(24), max_slots=24)[0]
    a = A.free(a, _arr([13, 22, 12, 21, 13, 99]), valid=jnp.array([1, 1, 1, 1, 1, 0], bool))
    assert state_lists(a)[0] == [3, 5]
    a = A.free(a, _arr([4, 27]))
    assert state_lists(a)[0] == [1, 6, 3, 5]
    a2 = A.free(a, _arr([4]), valid=jnp.zeros(1, bool))  # nothing valid: no-op
    assert_state_identical(a2, a)


def test_free_segment_page_representatives() -> None:
    p = 4
    a = A.init_allocator(8, p)
    a = A.alloc(a, I32(32), max_slots=32)[0]
    # A row whose pages are 7, 2, 5 (positions 0..11), holey tail.
    row = [28, 29, 30, 31, 8, 9, 10, 11, 20, 21, 22, 0, 0, 0, 0, 0]
    for start, end, want in [(4, 11, [2, 5]), (0, 5, [7, 2]), (8, 8, []), (0, 12, [7, 2, 5])]:
        got = A.free_segment(a, _arr(row), I32(start), I32(end))
        model = ModelAllocator(8, p)
        model.free_pages = []
        model.free_segment(row, start, end)
        assert state_lists(got)[0] == want == model.free_pages
    used = A.alloc(A.init_allocator(8, p, need_sort=True), I32(32), max_slots=32)[0]
    staged = A.free_segment(used, _arr(row), I32(4), I32(12))
    assert state_lists(staged) == ([], [2, 5])


def test_free_page_ids_keeps_order() -> None:
    a = A.init_allocator(6, 2)
    a = A.alloc(a, I32(12), max_slots=12)[0]
    a = A.free_page_ids(a, _arr([5, 1, 3, 2]), valid=jnp.array([1, 1, 0, 1], bool))
    assert state_lists(a)[0] == [5, 1, 2]


def test_free_group_defers_and_dedups() -> None:
    a = A.init_allocator(6, 4)
    a = A.alloc(a, I32(24), max_slots=24)[0]
    group = FreeGroup()
    group.begin()
    with pytest.raises(RuntimeError, match="nested"):
        group.begin()
    group.add(_arr([20, 21]))
    group.add(_arr([22, 8, 4]), valid=jnp.array([1, 1, 0], bool))
    assert group.active and state_lists(a)[0] == []
    a = group.end(a)
    assert state_lists(a)[0] == [2, 5]  # one free() over everything
    assert not group.active
    with pytest.raises(RuntimeError, match="without free_group_begin"):
        group.end(a)
    group.begin()
    assert_state_identical(group.end(a), a)  # empty group: no-op


def test_model_agrees_with_direct_calls() -> None:
    """Sanity of the model itself on the SPEC §14 numbers."""
    m = ModelAllocator(32, 4)
    assert m.alloc(8) == list(range(4, 12))
    out = m.alloc_extend([7], [40], [10])
    assert out == [11] + list(range(12, 44))
    a = A.alloc_extend(
        A.alloc(A.init_allocator(32, 4), I32(8), max_slots=8)[0],
        _arr([7]),
        _arr([40]),
        _arr([10]),
        max_new_slots=33,
    )[0]
    assert_same_state(a, m)


# ---- probes -------------------------------------------------------------------------------------
def _probe_cases():
    a = A.init_allocator(8, 4)
    a_used = A.alloc(a, I32(16), max_slots=16)[0]
    return [
        pytest.param(
            lambda: A.alloc_extend(a, _arr([7]), _arr([9]), _arr([12]), max_new_slots=4),
            r"alloc_extend: last_loc 12 not aligned with prefix_len 7",
            id="extend",
        ),
        pytest.param(
            lambda: A.alloc_decode(a, _arr([6, 7]), _arr([12, 10])),
            r"alloc_decode: last_loc 10 not aligned with seq_len 7",
            id="decode",
        ),
        pytest.param(
            lambda: A.free(a_used, _arr([5, 2])),
            r"free: slot_ids: min value 2 < low bound 4",
            id="free_page0",
        ),
        pytest.param(
            lambda: A.free(a_used, _arr([40])),
            r"free: slot_ids: max value 40 >= high bound 36",
            id="free_oob",
        ),
        pytest.param(
            lambda: A.free(a_used, _arr([4, 20])), r"free: double free of page 5", id="double_free"
        ),
        pytest.param(
            lambda: A.free_page_ids(a_used, _arr([2, 2])),
            r"free_page_ids: page 2 freed twice",
            id="dup_page_ids",
        ),
        pytest.param(
            lambda: A.free_segment(a_used, _arr([4, 5, 6, 7, 8, 9]), I32(2), I32(6)),
            r"free_segment: start: value 2 .* not a multiple of page_size=4",
            id="segment_misaligned",
        ),
        pytest.param(
            lambda: A.alloc(a, I32(6), max_slots=8),
            r"alloc: num_slots: value 6 .* not a multiple of page_size=4",
            id="alloc_misaligned",
        ),
    ]


@pytest.mark.parametrize("call,pattern", _probe_cases())
def test_probes_fire_when_checked(call, pattern) -> None:
    with pytest.raises(probes.ProbeError, match=pattern):
        probes.checked(call)()


@pytest.mark.parametrize("call,pattern", _probe_cases())
def test_probes_silent_when_off(call, pattern) -> None:
    del pattern
    assert not probes.probes_on()
    jax.block_until_ready(call())  # no error, garbage in/garbage out


def test_probes_pass_on_clean_inputs_and_leave_jaxpr_clean() -> None:
    a = A.init_allocator(8, 4)
    a, slots, _ = probes.checked(lambda: A.alloc(a, I32(8), max_slots=8))()
    a, _, ok = probes.checked(
        lambda: A.alloc_extend(
            a, _arr([7, 0]), _arr([13, 0]), _arr([slots[6], -1]), max_new_slots=8
        )
    )()
    assert bool(ok)
    probes.checked(lambda: A.free(a, slots))()
    jaxpr = str(jax.make_jaxpr(lambda s: A.free(a, s))(slots))
    assert "check" not in jaxpr
    with probes.probes_enabled():
        assert "check" in str(jax.make_jaxpr(lambda s: A.free(a, s))(slots))
