"""req_to_token table ops and the request-row allocator (SPEC §4.1, §10)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import probes
from jspec.config import SpecConfig
from jspec.kv import allocator as A
from jspec.kv import req_to_token as T

POISON = -7


def _arr(xs):
    return jnp.asarray(xs, jnp.int32)


def _numpy_assign(table, rows, start, end, locs):
    table = np.array(table)
    k = 0
    for r, s, e in zip(rows, start, end):
        table[r, s:e] = locs[k : k + e - s]
        k += e - s
    return table


def test_init_req_to_token_shape() -> None:
    cfg = SpecConfig(
        page_size=4, topk=2, num_steps=3, num_draft_tokens=4, context_len=64, max_running_requests=3
    )
    table = T.init_req_to_token(cfg)
    assert table.shape == (4, 64 + 35) and table.dtype == jnp.int32  # SPEC §14: ctx + 35
    assert not np.asarray(table).any()


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_assign_matches_numpy_loop(impl: str) -> None:
    table = np.full((5, 12), POISON, np.int32)
    rows, start, end = [3, 0, 1, 4], [2, 0, 0, 11], [7, 0, 4, 12]  # row 0 = padding entry
    locs = np.arange(100, 112, dtype=np.int32)  # 10 used, 2 spare
    got = T.assign_req_to_token_pool(
        jnp.asarray(table), _arr(rows), _arr(start), _arr(end), jnp.asarray(locs), impl=impl
    )
    want = _numpy_assign(table, rows, start, end, locs)
    np.testing.assert_array_equal(got, want)
    assert (np.asarray(got)[0] == POISON).all() and (np.asarray(got)[2] == POISON).all()


def test_get_last_loc() -> None:
    table = _arr([[0] * 6, [10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]])
    got = T.get_last_loc(table, _arr([1, 2, 0, 2]), _arr([3, 0, 0, 6]))
    assert got.dtype == jnp.int32
    assert list(np.asarray(got)) == [12, -1, -1, 25]


def test_spec14_decode_allocation_round_trip() -> None:
    """SPEC §4.1 flow: get_last_loc -> alloc_extend -> assign; row page k -> one physical page."""
    p = 4
    table = jnp.zeros((3, 48), jnp.int32)
    a = A.init_allocator(32, p)
    a, slots, _ = A.alloc(a, jnp.int32(8), max_slots=8)
    table = T.assign_req_to_token_pool(table, _arr([2]), _arr([0]), _arr([7]), slots)
    cur, nxt = _arr([7, 0]), _arr([40, 0])  # second entry: padding row 0
    rows = _arr([2, 0])
    last = T.get_last_loc(table, rows, cur)
    assert list(np.asarray(last)) == [10, -1]
    a, new, ok = A.alloc_extend(a, cur, nxt, last, max_new_slots=40)
    assert bool(ok)
    for impl in ("xla", "pallas"):
        out = np.asarray(T.assign_req_to_token_pool(table, rows, cur, nxt, new, impl=impl))
        row = out[2, :40]
        assert list(row) == list(range(4, 44))
        assert (row % p == np.arange(40) % p).all()
        assert not out[0].any() and not out[2, 40:].any()


# ---- row allocator ------------------------------------------------------------------------------
def test_req_rows_alloc_free_order() -> None:
    r = T.init_req_rows(SpecConfig(max_running_requests=4))
    assert list(np.asarray(r.free_rows)) == [1, 2, 3, 4]
    r, rows, ok = T.alloc_req_rows(r, jnp.int32(3), max_rows=4)
    assert bool(ok) and list(np.asarray(rows)) == [1, 2, 3, 0]
    r = T.free_req_rows(r, _arr([2, 9, 1]), valid=jnp.array([True, False, True]))
    assert int(r.num_free) == 3 and list(np.asarray(r.free_rows)[:3]) == [4, 2, 1]  # appended
    before = r
    r2, rows, ok = T.alloc_req_rows(r, jnp.int32(4), max_rows=4)
    assert not bool(ok) and not np.asarray(rows).any()
    chex.assert_trees_all_equal(r2, before)
    _r3, rows, ok = T.alloc_req_rows(r, jnp.int32(2), max_rows=1)  # max_rows too small
    assert not bool(ok)
    r4, rows, ok = T.alloc_req_rows(r, jnp.int32(2), max_rows=2)
    assert list(np.asarray(rows)) == [4, 2] and list(np.asarray(r4.free_rows)) == [1, 0, 0, 0]


# ---- probes -------------------------------------------------------------------------------------
def _probe_cases():
    table = jnp.zeros((3, 8), jnp.int32)
    locs = jnp.arange(10, dtype=jnp.int32)
    return [
        pytest.param(
            lambda: T.assign_req_to_token_pool(table, _arr([1]), _arr([4]), _arr([9]), locs),
            r"end_offset \(row width\): max value 9 > high bound 8",
            id="row_width",
        ),
        pytest.param(
            lambda: T.assign_req_to_token_pool(table, _arr([1]), _arr([5]), _arr([3]), locs),
            r"start > end at request 0",
            id="start_gt_end",
        ),
        pytest.param(  # request 0 an empty write (start == end): the probe names request 1
            lambda: T.assign_req_to_token_pool(
                table, _arr([0, 1]), _arr([2, 5]), _arr([2, 3]), locs
            ),
            r"start > end at request 1",
            id="start_gt_end_second",
        ),
        pytest.param(
            lambda: T.assign_req_to_token_pool(table, _arr([3]), _arr([0]), _arr([2]), locs),
            r"req_pool_indices: max value 3 >= high bound 3",
            id="bad_row",
        ),
        pytest.param(
            lambda: T.assign_req_to_token_pool(
                table, _arr([1, 2]), _arr([0, 0]), _arr([8, 8]), locs
            ),
            r"sum\(end-start\)=16 > len\(out_cache_loc\)=10",
            id="too_few_locs",
        ),
        pytest.param(
            lambda: T.get_last_loc(table, _arr([1]), _arr([9])),
            r"get_last_loc: prefix_lens: max value 9 > high bound 8",
            id="last_loc",
        ),
        pytest.param(  # -1 would wrap to the last row, 3 clamp to it: both read row 2
            lambda: T.get_last_loc(table, _arr([-1]), _arr([1])),
            r"get_last_loc: req_pool_indices: min value -1 < low bound 0",
            id="last_loc_row_negative",
        ),
        pytest.param(
            lambda: T.get_last_loc(table, _arr([1, 3]), _arr([1, 1])),
            r"get_last_loc: req_pool_indices: max value 3 >= high bound 3",
            id="last_loc_row_past",
        ),
        pytest.param(
            lambda: T.free_req_rows(T.init_req_rows(SpecConfig(max_running_requests=4)), _arr([0])),
            r"free_req_rows: rows: min value 0 < low bound 1",
            id="free_row0",
        ),
    ]


@pytest.mark.parametrize("call,pattern", _probe_cases())
def test_probes_fire_when_checked(call, pattern) -> None:
    with pytest.raises(probes.ProbeError, match=pattern):
        probes.checked(call)()


@pytest.mark.parametrize("call,pattern", _probe_cases())
def test_probes_silent_when_off(call, pattern) -> None:
    del pattern
    jax.block_until_ready(call())


def test_probes_silent_at_the_row_edges() -> None:
    """Legal edges with the probes on: an empty write at the row's end (``start == end == W``)
    and a last location at ``prefix == W`` fire nothing."""
    table = jnp.arange(24, dtype=jnp.int32).reshape(3, 8)
    out = probes.checked(T.assign_req_to_token_pool)(
        table, _arr([1]), _arr([8]), _arr([8]), _arr([5])
    )
    np.testing.assert_array_equal(out, table)
    last = probes.checked(T.get_last_loc)(table, _arr([2]), _arr([8]))
    assert list(np.asarray(last)) == [23]


def test_probes_off_leave_jaxpr_clean() -> None:
    table = jnp.zeros((3, 8), jnp.int32)

    def fn(e):
        return T.assign_req_to_token_pool(table, _arr([1]), _arr([0]), e, _arr([5, 6]))

    assert "check" not in str(jax.make_jaxpr(fn)(_arr([2])))
    np.testing.assert_array_equal(probes.checked(fn)(_arr([2]))[1, :3], [5, 6, 0])
