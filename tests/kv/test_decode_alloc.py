# Over 400 lines: sizing, SPEC §14 end to end, failure paths and the long run share one fixture set.
"""Decode-step allocation, the SPEC §14 worked example end to end, and a long random run.

Oracles: SPEC §3/§14 numbers, a python loop for the sizing, and helper A's integrity check
(``available + owned == total`` with no page both owned and free) for the long run.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import probes
from jspec.config import SpecConfig
from jspec.kv.allocator import alloc_extend, available_size, init_allocator
from jspec.kv.decode_alloc import (
    ReqKVState,
    commit_kv_lens,
    init_req_kv_state,
    page_aligned_decode_alloc_lens,
    prepare_for_decode,
    release_kv_cache,
)
from jspec.kv.integrity import check_integrity, owned_page_mask
from jspec.kv.pool import KVPool, init_kv_pool
from jspec.kv.req_to_token import (
    alloc_req_rows,
    assign_req_to_token_pool,
    free_req_rows,
    init_req_rows,
    init_req_to_token,
)
from jspec.tree.accept import (
    accept_kv_move_pairs,
    move_accept_tokens_to_target_kvcache,
    verify_out_cache_loc,
)
from jspec.tree.layout import (
    draft_out_cache_loc,
    duplicate_prefix_tail_to_draft_branches,
    prefix_tail_copy_pairs,
)
from tree_geometry import with_geometry

POISON = -7
# static capacity of the test prefill (one compile for every call)
PREFILL_SLOTS = 256


def copy_tree(x):
    return jax.tree.map(jnp.copy, x)


def prefill(allocator, r2t, reqs, new, rows, prompt_lens):
    """Admit requests (bool[B] ``new``) at ``rows`` with ``prompt_lens`` committed tokens."""
    zeros = jnp.zeros_like(prompt_lens)
    seq = jnp.where(new, prompt_lens, 0)
    allocator, slot_ids, ok = alloc_extend(
        allocator, zeros, seq, jnp.full_like(seq, -1), max_new_slots=PREFILL_SLOTS
    )
    assert bool(ok)
    r2t = assign_req_to_token_pool(r2t, jnp.where(new, rows, 0), zeros, seq, slot_ids)
    reqs = ReqKVState(
        committed_lens=jnp.where(new, prompt_lens, reqs.committed_lens),
        allocated_lens=jnp.where(new, prompt_lens, reqs.allocated_lens),
        req_pool_indices=jnp.where(new, rows, reqs.req_pool_indices),
        valid=reqs.valid | new,
    )
    return allocator, r2t, reqs


def spec14_config(**kw) -> SpecConfig:
    base = {
        "page_size": 4,
        "topk": 2,
        "num_steps": 3,
        "num_draft_tokens": 4,
        "context_len": 16,
        "max_running_requests": 2,
        "num_pages": 32,
        "num_layers": 2,
        "num_kv_heads": 1,
        "head_dim": 4,
        "dtype": "float32",
    }
    return SpecConfig(**(base | kw))


def random_pool(cfg: SpecConfig, seed: int) -> KVPool:
    pool = init_kv_pool(cfg)
    kv = np.random.default_rng(seed).standard_normal(pool.k.shape).astype(np.float32)
    return KVPool(k=jnp.asarray(kv), v=jnp.asarray(kv + 100), page_size=cfg.page_size)


# ---- sizing -------------------------------------------------------------------------------------
def test_page_aligned_decode_alloc_lens_matches_loop() -> None:
    rng = np.random.default_rng(0)
    for page_size in (1, 4, 16):
        committed = rng.integers(0, 100, size=8)
        allocated = committed + rng.integers(0, 80, size=8)
        valid = rng.random(8) > 0.3
        cur, nxt, need = page_aligned_decode_alloc_lens(
            jnp.asarray(committed, jnp.int32),
            jnp.asarray(allocated, jnp.int32),
            reserve=32,
            page_size=page_size,
            valid=jnp.asarray(valid),
        )
        want_nxt, want_need = [], 0
        for c, a, v in zip(committed, allocated, valid):
            n = max(a, -(-(c + 32) // page_size) * page_size) if v else a
            want_nxt.append(n)
            want_need += n - a
        np.testing.assert_array_equal(np.asarray(cur), allocated)
        np.testing.assert_array_equal(np.asarray(nxt), want_nxt)
        assert int(need) == want_need


# ---- SPEC §14 end to end -----------------------------------------------------------------------
def test_spec14_end_to_end() -> None:
    cfg = spec14_config()
    assert cfg.alloc_len_per_decode == 16 and cfg.alloc_reserve_per_decode == 32
    assert cfg.req_to_token_width == cfg.context_len + 35
    allocator = init_allocator(cfg.num_pages, cfg.page_size)
    r2t = init_req_to_token(cfg)
    reqs = init_req_kv_state(2)
    new = jnp.array([True, False])
    allocator, r2t, reqs = prefill(
        allocator, r2t, reqs, new, jnp.array([1, 0], jnp.int32), jnp.array([7, 0], jnp.int32)
    )
    # prefill took pages 1, 2: row[0..6] = slots 4..10.
    np.testing.assert_array_equal(np.asarray(r2t[1, :7]), np.arange(4, 11))
    free_before = int(allocator.num_free)

    allocator, r2t, reqs, ok = prepare_for_decode(allocator, r2t, reqs, cfg)
    assert bool(ok)
    assert np.asarray(reqs.allocated_lens).tolist() == [40, 0]
    # alloc_extend(pre=7, seq=40): 1 slot continuing page 2 (slot 11), then 8 full pages 3..10.
    assert free_before - int(allocator.num_free) == 8
    row = np.asarray(r2t[1])
    assert row[7] == row[6] + 1 == 11
    np.testing.assert_array_equal(row[8:40], np.arange(12, 44))
    assert not row[40:].any() and not np.asarray(r2t[0]).any()

    rpi, seq = reqs.req_pool_indices[:1], reqs.committed_lens[:1]
    kw = {"topk": 2, "num_steps": 3, "page_size": 4}
    out = draft_out_cache_loc(r2t, rpi, seq, **with_geometry(kw))
    np.testing.assert_array_equal(np.asarray(out).reshape(-1), row[[7, 8, 9, 15, 16, 17]])
    tgt, src, n = prefix_tail_copy_pairs(r2t, rpi, seq, max_pairs=3, **with_geometry(kw))
    assert int(n) == 3
    np.testing.assert_array_equal(np.asarray(tgt), row[[12, 13, 14]])
    np.testing.assert_array_equal(np.asarray(src), row[[4, 5, 6]])
    draft = random_pool(cfg, 1)
    before = np.asarray(draft.k)
    draft = duplicate_prefix_tail_to_draft_branches(
        copy_tree(draft), r2t, rpi, seq, **with_geometry(kw)
    )
    after = np.asarray(draft.k)
    np.testing.assert_array_equal(after[:, row[[12, 13, 14]]], before[:, row[[4, 5, 6]]])
    touched = np.zeros(cfg.num_slots, bool)
    touched[row[[12, 13, 14]]] = True
    np.testing.assert_array_equal(after[:, ~touched], before[:, ~touched])

    window = verify_out_cache_loc(r2t, rpi, seq, num_draft_tokens=4)
    np.testing.assert_array_equal(np.asarray(window), row[7:11])
    accept_index = jnp.array([[0, 2, -1, -1]], jnp.int32)
    accept_lens = jnp.array([2], jnp.int32)
    tgt, src, _ = accept_kv_move_pairs(r2t, rpi, seq, window, accept_index, accept_lens)
    np.testing.assert_array_equal(np.asarray(src)[:2], row[[7, 9]])
    np.testing.assert_array_equal(np.asarray(tgt)[:2], row[[7, 8]])
    target = random_pool(cfg, 2)
    before = np.asarray(target.k)
    target = move_accept_tokens_to_target_kvcache(
        copy_tree(target), r2t, rpi, seq, window, accept_index, accept_lens
    )
    np.testing.assert_array_equal(np.asarray(target.k)[:, row[[7, 8]]], before[:, row[[7, 9]]])

    reqs = commit_kv_lens(reqs, jnp.array([2, 0], jnp.int32))
    assert np.asarray(reqs.committed_lens).tolist() == [9, 0]
    allocator, r2t, reqs, ok = prepare_for_decode(allocator, r2t, reqs, cfg)
    assert bool(ok) and np.asarray(reqs.allocated_lens).tolist() == [44, 0]  # ceil4(9+32)
    np.testing.assert_array_equal(np.asarray(r2t[1, 40:44]), np.arange(44, 48))

    allocator, reqs = release_kv_cache(allocator, r2t, reqs, jnp.array([True, False]))
    assert int(allocator.num_free) == cfg.num_pages
    assert not bool(reqs.valid.any()) and not np.asarray(reqs.allocated_lens).any()
    check_integrity(
        allocator,
        owned_page_mask(
            r2t,
            reqs.req_pool_indices,
            reqs.allocated_lens,
            num_pages=cfg.num_pages,
            page_size=4,
            valid=reqs.valid,
        ),
    )


# ---- failure paths: state unchanged ------------------------------------------------------------
def _two_requests(cfg: SpecConfig, prompt=(7, 5)):
    allocator = init_allocator(cfg.num_pages, cfg.page_size)
    r2t = init_req_to_token(cfg)
    reqs = init_req_kv_state(3)
    new = jnp.array([True, True, False])
    return prefill(
        allocator,
        r2t,
        reqs,
        new,
        jnp.array([1, 2, 0], jnp.int32),
        jnp.array(list(prompt) + [0], jnp.int32),
    )


@pytest.mark.parametrize("page_size", [1, 4])
def test_exhaustion_leaves_state_unchanged(page_size) -> None:
    reserve = spec14_config(page_size=page_size).alloc_reserve_per_decode  # 32 (P=4), 12 (P=1)
    # prompts take 4 pages (P=4) / 12 slots (P=1); each request then needs >= reserve more.
    cfg = spec14_config(page_size=page_size, num_pages=(16 + reserve + 4) // page_size)
    allocator, r2t, reqs = _two_requests(cfg)
    state = copy_tree((allocator, r2t, reqs))
    new_alloc, new_r2t, new_reqs, ok = prepare_for_decode(allocator, r2t, reqs, cfg)
    assert not bool(ok)
    chex.assert_trees_all_equal((new_alloc, new_r2t, new_reqs), state)
    # with a bigger pool it succeeds
    cfg = spec14_config(page_size=page_size, num_pages=(16 + 2 * reserve + 8) // page_size)
    allocator, r2t, reqs = _two_requests(cfg)
    _, _, _, ok = prepare_for_decode(allocator, r2t, reqs, cfg)
    assert bool(ok)


def test_max_new_slots_too_small_is_not_ok() -> None:
    cfg = spec14_config()
    allocator, r2t, reqs = _two_requests(cfg)
    state = copy_tree((allocator, r2t, reqs))
    out = prepare_for_decode(allocator, r2t, reqs, cfg, max_new_slots=40)
    assert not bool(out[3])
    chex.assert_trees_all_equal(out[:3], state)


def test_row_width_trace_time_error() -> None:
    cfg = spec14_config()
    allocator, r2t, reqs = _two_requests(cfg)
    narrow = r2t[:, : cfg.context_len + 32]  # ceil4(16 + 32) = 48 fits; 47 does not
    prepare_for_decode(allocator, narrow, reqs, cfg)
    with pytest.raises(
        ValueError,
        match=r"ceil_P\(context_len \+ alloc_reserve_per_decode\) = 48 "
        r"exceeds the req_to_token row width 47 "
        r"\(cfg.req_to_token_width=51",
    ):
        prepare_for_decode(allocator, r2t[:, :47], reqs, cfg)


def test_dynamic_row_width_overflow_not_ok_and_probe() -> None:
    cfg = spec14_config()
    allocator, r2t, reqs = _two_requests(cfg)
    width = r2t.shape[1]
    # committed past context_len (a scheduler bug): nxt = ceil4(30 + 32) = 64 > 51.
    reqs = ReqKVState(
        committed_lens=jnp.array([30, 5, 0], jnp.int32),
        allocated_lens=jnp.array([30, 5, 0], jnp.int32),
        req_pool_indices=reqs.req_pool_indices,
        valid=reqs.valid,
    )
    state = copy_tree((allocator, r2t, reqs))
    out = prepare_for_decode(allocator, r2t, reqs, cfg)
    assert not bool(out[3])
    chex.assert_trees_all_equal(out[:3], state)
    with pytest.raises(
        probes.ProbeError, match=f"max\\(nxt\\)=64 exceeds req_to_token row width {width}"
    ):
        probes.checked(lambda *a: prepare_for_decode(*a, cfg))(allocator, r2t, reqs)


def test_padding_rows_allocate_nothing() -> None:
    cfg = spec14_config()
    allocator, r2t, reqs = _two_requests(cfg)
    r2t = r2t.at[0].set(POISON)  # the padding row must stay untouched
    reqs = ReqKVState(
        committed_lens=reqs.committed_lens.at[2].set(9),
        allocated_lens=reqs.allocated_lens.at[2].set(9),
        req_pool_indices=reqs.req_pool_indices,
        valid=reqs.valid,
    )
    free_before = int(allocator.num_free)
    allocator, r2t, new_reqs, ok = prepare_for_decode(allocator, r2t, reqs, cfg)
    assert bool(ok)
    assert (np.asarray(r2t[0]) == POISON).all()
    assert np.asarray(new_reqs.allocated_lens).tolist() == [40, 40, 9]
    # 7 -> 40: 8 new pages; 5 -> 40: 8 new pages (5 continues page 2 of its row).
    assert free_before - int(allocator.num_free) == 16


# ---- long random run -----------------------------------------------------------------------------
def _owned(r2t, reqs, cfg):
    return owned_page_mask(
        r2t,
        reqs.req_pool_indices,
        reqs.allocated_lens,
        num_pages=cfg.num_pages,
        page_size=cfg.page_size,
        valid=reqs.valid,
    )


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("topk", [1, 4])
def test_long_random_run_returns_every_page(page_size, topk) -> None:
    num_steps, n_draft = 3, 4 if topk == 1 else 8
    batch = 4
    cfg = SpecConfig(
        page_size=page_size,
        topk=topk,
        num_steps=num_steps,
        num_draft_tokens=n_draft,
        context_len=96,
        max_running_requests=6,
        num_pages=(batch + 1) * 300 // page_size,
        num_layers=0,
        num_kv_heads=1,
        head_dim=4,
        dtype="float32",
    )
    rng = np.random.default_rng(page_size * 10 + topk)
    allocator = init_allocator(cfg.num_pages, cfg.page_size)
    r2t = init_req_to_token(cfg)
    rows_alloc = init_req_rows(cfg)
    reqs = init_req_kv_state(batch)
    kw = {"topk": topk, "num_steps": num_steps, "page_size": page_size}
    finished_total = 0
    for step in range(40):
        # arrivals into free batch slots
        free_slots = ~np.asarray(reqs.valid)
        new = free_slots & (rng.random(batch) < 0.5) if step < 30 else np.zeros(batch, bool)
        if new.any():
            rows_alloc, rows, ok = alloc_req_rows(rows_alloc, int(new.sum()), max_rows=batch)
            assert bool(ok)
            row_ids = np.zeros(batch, np.int64)
            row_ids[new] = np.asarray(rows)[: int(new.sum())]
            prompt = rng.integers(1, 3 * page_size + 6, size=batch)
            allocator, r2t, reqs = prefill(
                allocator,
                r2t,
                reqs,
                jnp.asarray(new),
                jnp.asarray(row_ids, jnp.int32),
                jnp.asarray(prompt, jnp.int32),
            )
        allocator, r2t, reqs, ok = prepare_for_decode(allocator, r2t, reqs, cfg)
        assert bool(ok), f"step {step}: pool exhausted (available={int(available_size(allocator))})"
        valid = np.asarray(reqs.valid)
        alloc_lens = np.asarray(reqs.allocated_lens)
        committed = np.asarray(reqs.committed_lens)
        rpi = np.asarray(reqs.req_pool_indices)
        assert (alloc_lens[valid] % page_size == 0).all()
        # every draft slot and the verify window lie inside the allocated row
        out = np.asarray(
            draft_out_cache_loc(
                r2t,
                reqs.req_pool_indices,
                reqs.committed_lens,
                valid=reqs.valid,
                **with_geometry(kw),
            )
        )
        window = np.asarray(
            verify_out_cache_loc(
                r2t,
                reqs.req_pool_indices,
                reqs.committed_lens,
                num_draft_tokens=n_draft,
                valid=reqs.valid,
            )
        ).reshape(batch, n_draft)
        r2t_np = np.asarray(r2t)
        for b in np.flatnonzero(valid):
            owned = set(r2t_np[rpi[b], : alloc_lens[b]].tolist())
            assert set(out[b].reshape(-1).tolist()) <= owned
            assert set(window[b].tolist()) <= owned
            assert 0 not in owned
        check_integrity(allocator, _owned(r2t, reqs, cfg), what=f"step {step}")
        # verify: random accept lengths, commit
        accept = np.where(valid, rng.integers(1, num_steps + 2, size=batch), 0)
        reqs = commit_kv_lens(reqs, jnp.asarray(accept, jnp.int32))
        committed = np.asarray(reqs.committed_lens)
        finished = valid & (
            (rng.random(batch) < 0.15) | (committed > cfg.context_len - 6) | (step == 39)
        )
        if finished.any():
            finished_total += int(finished.sum())
            rows_alloc = free_req_rows(
                rows_alloc, jnp.asarray(rpi, jnp.int32), valid=jnp.asarray(finished)
            )
            allocator, reqs = release_kv_cache(allocator, r2t, reqs, jnp.asarray(finished))
            check_integrity(allocator, _owned(r2t, reqs, cfg), what=f"release {step}")
    assert not bool(reqs.valid.any()) and finished_total > batch
    assert int(allocator.num_free) == cfg.num_pages
    assert int(rows_alloc.num_free) == cfg.max_running_requests
    check_integrity(allocator, _owned(r2t, reqs, cfg), what="drained")


def test_pallas_impl_matches_xla(interpret) -> None:
    cfg = spec14_config()
    allocator, r2t, reqs = _two_requests(cfg, prompt=(7, 12))
    want = prepare_for_decode(allocator, r2t, reqs, cfg)
    got = prepare_for_decode(allocator, r2t, reqs, cfg, impl="pallas", interpret=interpret)
    assert bool(got[3])
    chex.assert_trees_all_equal(got, want)
