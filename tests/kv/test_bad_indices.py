"""Bad indices and loose types through the public kv API (issue 22): every reproduced input gives
``ok=False`` with the state bit-identical (a probe names it when on), or a ``ValueError`` naming
the field for a static mistake. Expected values are by hand.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import probes
from jspec.config import SpecConfig
from jspec.kv import allocator as A
from jspec.kv import decode_alloc as D
from jspec.kv import integrity as I
from tree_geometry import geom, with_geometry

CFG = SpecConfig(
    page_size=4,
    topk=2,
    num_steps=3,
    num_draft_tokens=4,
    context_len=16,
    max_running_requests=2,
    num_pages=32,
    num_layers=1,
    num_kv_heads=1,
    head_dim=2,
    dtype="float32",
)


def _i32(xs):
    return jnp.asarray(xs, jnp.int32)


def _reqs(committed, allocated, rows, valid):
    return D.ReqKVState(
        committed_lens=_i32(committed),
        allocated_lens=_i32(allocated),
        req_pool_indices=_i32(rows),
        valid=jnp.asarray(valid, bool),
    )


def _one_request():
    """Row 1 owns positions 0..7 = slots 4..11 (pages 1, 2); 30 pages free."""
    a = A.init_allocator(CFG.num_pages, CFG.page_size)
    a, slots, ok = A.alloc(a, 8, max_slots=8)
    assert bool(ok)
    r2t = jnp.zeros((CFG.num_req_rows, CFG.req_to_token_width), jnp.int32)
    r2t = r2t.at[1, :8].set(slots)
    return a, r2t


# ---- prepare_for_decode: a row out of range / padding / repeated takes nothing ------------------
@pytest.mark.parametrize(
    "rows,valid,committed,allocated",
    [
        ([7, 0], [True, False], [0, 0], [0, 0]),  # row 7 of 3
        ([-1, 0], [True, False], [0, 0], [0, 0]),  # wraps to the last row
        ([0, 0], [True, False], [0, 0], [0, 0]),  # the padding row
        ([1, 1], [True, True], [5, 5], [8, 8]),  # one row twice
        ([1, 0], [True, False], [9, 0], [8, 0]),  # committed > allocated
        ([1, 0], [True, False], [-3, 0], [8, 0]),  # negative length
    ],
    ids=["row_past_end", "row_minus1", "padding_row", "row_twice", "committed_gt_alloc", "neg"],
)
def test_prepare_for_decode_bad_rows_take_nothing(rows, valid, committed, allocated) -> None:
    a, r2t = _one_request()
    reqs = _reqs(committed, allocated, rows, valid)
    a2, r2t2, reqs2, ok = D.prepare_for_decode(a, r2t, reqs, CFG)
    assert not bool(ok)
    chex.assert_trees_all_equal((a2, r2t2, reqs2), (a, r2t, reqs))


def test_prepare_for_decode_probe_names_the_row() -> None:
    a, r2t = _one_request()
    reqs = _reqs([0, 0], [0, 0], [7, 0], [True, False])
    with pytest.raises(probes.ProbeError, match=r"prepare_for_decode: .*row 7"):
        probes.checked(D.prepare_for_decode)(a, r2t, reqs, cfg=CFG)


# ---- release_kv_cache: all or nothing ------------------------------------------------------------
def _two_requests():
    """Row 1: slots 4..15 (pages 1, 2, 3); row 2: slots 16..19 (page 4); 28 pages free."""
    a = A.init_allocator(CFG.num_pages, CFG.page_size)
    a, slots, ok = A.alloc(a, 16, max_slots=16)
    assert bool(ok)
    r2t = jnp.zeros((CFG.num_req_rows, CFG.req_to_token_width), jnp.int32)
    r2t = r2t.at[1, :12].set(slots[:12]).at[2, :4].set(slots[12:])
    return a, r2t, _reqs([12, 4], [12, 4], [1, 2], [True, True])


def _owned(r2t, reqs):
    return I.owned_page_mask(
        r2t,
        reqs.req_pool_indices,
        reqs.allocated_lens,
        num_pages=CFG.num_pages,
        page_size=CFG.page_size,
        valid=reqs.valid,
    )


@pytest.mark.parametrize("row", [-1, 3, 0], ids=["minus1_wraps_to_last_row", "past_end", "pad"])
def test_release_kv_cache_bad_row_frees_nothing(row) -> None:
    a, r2t, reqs = _two_requests()
    bad = D.ReqKVState(
        committed_lens=reqs.committed_lens,
        allocated_lens=reqs.allocated_lens,
        req_pool_indices=_i32([1, row]),
        valid=reqs.valid,
    )
    a2, reqs2, ok = D.release_kv_cache(a, r2t, bad, jnp.array([False, True]), return_ok=True)
    assert not bool(ok)
    chex.assert_trees_all_equal((a2, reqs2), (a, bad))
    I.check_integrity(a2, _owned(r2t, reqs))  # row 1 still owns pages 1..3, row 2 page 4


def test_release_kv_cache_one_page_already_free_loses_nothing() -> None:
    """Pages 1, 2, 3 with page 2 already free: released whole or not at all (was: marked
    released while pages 1 and 3 were lost)."""
    a, r2t, reqs = _two_requests()
    a = A.free_page_ids(a, _i32([2]))
    a2, reqs2, ok = D.release_kv_cache(a, r2t, reqs, jnp.array([True, False]), return_ok=True)
    assert not bool(ok)
    chex.assert_trees_all_equal((a2, reqs2), (a, reqs))
    a3, reqs3 = D.release_kv_cache(a, r2t, reqs, jnp.array([True, False]))  # default return
    chex.assert_trees_all_equal((a3, reqs3), (a, reqs))
    with pytest.raises(probes.ProbeError, match="double free of page 2"):
        probes.checked(D.release_kv_cache)(a, r2t, reqs, jnp.array([True, False]))


def test_release_kv_cache_a_full_row_is_legal() -> None:
    """``allocated == W`` (the whole row) and ``committed == allocated`` are in bounds: the
    request's 13 pages all come back."""
    width = CFG.req_to_token_width  # 51: 13 pages of 4, the last one partly in the row
    a = A.init_allocator(CFG.num_pages, CFG.page_size)
    a, slots, ok = A.alloc(a, 52, max_slots=52)
    assert bool(ok) and int(a.num_free) == CFG.num_pages - 13
    r2t = jnp.zeros((CFG.num_req_rows, width), jnp.int32).at[1].set(slots[:width])
    reqs = _reqs([width, 0], [width, 0], [1, 0], [True, False])
    a2, reqs2, ok = D.release_kv_cache(a, r2t, reqs, jnp.array([True, False]), return_ok=True)
    assert bool(ok) and int(a2.num_free) == CFG.num_pages
    assert not bool(reqs2.valid[0])


def test_release_kv_cache_good_release_still_works() -> None:
    a, r2t, reqs = _two_requests()
    a2, reqs2, ok = D.release_kv_cache(a, r2t, reqs, jnp.array([True, False]), return_ok=True)
    assert bool(ok) and int(a2.num_free) == 31
    assert np.asarray(reqs2.valid).tolist() == [False, True]
    I.check_integrity(a2, _owned(r2t, reqs2))


# ---- loose types: a float / bool / wide int count, accept lengths, draft layout ------------------
@pytest.mark.parametrize(
    "num_slots,match",
    [
        (4.9, r"num_slots=4.9 must be an integer"),
        (np.float32(8.0), r"num_slots=.*must be an integer"),
        (True, r"num_slots=True must be an integer, not a bool"),
        (np.int64(2**32 + 4), r"num_slots=4294967300 does not fit int32"),
        (2**31, r"num_slots=2147483648 does not fit int32"),
        (jnp.asarray(8.0), r"num_slots=.*integer"),
    ],
    ids=["float", "np_float", "bool", "np_int64_wraps", "py_int_wraps", "float_array"],
)
def test_alloc_loose_count_is_a_value_error(num_slots, match) -> None:
    """Was: 4.9 truncated to 4 and 2**32 + 4 wrapped to 4 (one page handed out)."""
    a = A.init_allocator(4, 4)
    with pytest.raises(ValueError, match=match):
        A.alloc(a, num_slots, max_slots=8)
    from jspec.kv import req_to_token as T

    with pytest.raises(ValueError, match=match.replace("num_slots", "num")):
        T.alloc_req_rows(T.init_req_rows(CFG), num_slots, max_rows=2)
    _, slots, ok = A.alloc(a, np.int64(4), max_slots=8)  # an in-range NumPy int is fine
    assert bool(ok) and np.asarray(slots)[:4].tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("accept", [[5, 0], [-1, 0]], ids=["past_allocation", "negative"])
def test_commit_kv_lens_bad_accept_commits_nothing(accept) -> None:
    reqs = _reqs([4, 0], [8, 0], [1, 0], [True, False])
    new, ok = D.commit_kv_lens(reqs, _i32(accept), return_ok=True)
    assert not bool(ok)
    chex.assert_trees_all_equal(new, reqs)
    with pytest.raises(probes.ProbeError, match=r"commit_kv_lens: accept_len -?\d+ at row 0"):
        probes.checked(D.commit_kv_lens)(reqs, _i32(accept))
    new, ok = D.commit_kv_lens(reqs, _i32([4, 0]), return_ok=True)
    assert bool(ok) and np.asarray(new.committed_lens).tolist() == [8, 0]


def _draft_setup():
    """A draft pool whose slot s holds s; row 1 maps positions to slots 4.., row 2 to 72.."""
    from jspec.kv.pool import KVPool, init_kv_pool

    pool = init_kv_pool(CFG)
    ids = jnp.arange(pool.num_slots, dtype=jnp.float32)[None, :, None, None]
    pool = KVPool(k=pool.k + ids, v=pool.v - ids, page_size=pool.page_size)
    width = CFG.req_to_token_width
    r2t = jnp.zeros((CFG.num_req_rows, width), jnp.int32)
    r2t = r2t.at[1].set(jnp.arange(4, 4 + width, dtype=jnp.int32))
    r2t = r2t.at[2].set(jnp.arange(72, 72 + width, dtype=jnp.int32) % pool.num_slots)
    return pool, r2t


@pytest.mark.parametrize(
    "rows,lens",
    [([2, 1], [5, -3]), ([2, 5], [5, 5]), ([2, 1], [5, 50])],
    ids=["negative_len", "row_past_end", "footprint_past_row"],
)
def test_prepare_for_draft_bad_row_is_a_no_op(rows, lens) -> None:
    """Was: a negative length read the previous row and copied another request's KV."""
    from jspec.tree.layout import prepare_for_draft

    pool, r2t = _draft_setup()
    kw = {"topk": 2, "num_steps": 3, "page_size": 4, "impl": "xla", "move_impl": "xla"}
    before = jax_copy(pool)
    out, loc, _, ok = prepare_for_draft(
        pool, r2t, _i32(rows), _i32(lens), return_ok=True, **with_geometry(kw)
    )
    assert not bool(ok) and not np.asarray(loc).any()
    chex.assert_trees_all_equal(out, before)


def test_prepare_for_draft_page_size_must_be_the_pools() -> None:
    from jspec.tree.layout import prepare_for_draft

    pool, r2t = _draft_setup()
    with pytest.raises(ValueError, match=r"page_size=2 must be the draft pool's page_size=4"):
        prepare_for_draft(
            pool, r2t, _i32([1]), _i32([5]), geometry=geom(topk=2, num_steps=3, page_size=2)
        )


def jax_copy(tree):
    import jax

    return jax.tree.map(jnp.copy, tree)


def test_free_group_end_reports_a_refused_group() -> None:
    """Issue 22 (release paths atomic or ok=False): a group naming a page already free frees
    nothing, and ``end(return_ok=True)`` says so (was: the refusal was silent)."""
    from jspec.kv.free_group import FreeGroup

    a = A.alloc(A.init_allocator(4, 4), 8, max_slots=8)[0]  # pages 1, 2
    group = FreeGroup()
    group.begin()
    group.add(_i32([4, 5]))  # page 1
    group.add(_i32([12]))  # page 3: already free
    a2, ok = group.end(a, return_ok=True)
    assert not bool(ok)
    chex.assert_trees_all_equal(a2, a)
    group.begin()
    group.add(_i32([4, 8]))
    a3, ok = group.end(a, return_ok=True)
    assert bool(ok) and int(a3.num_free) == 4
