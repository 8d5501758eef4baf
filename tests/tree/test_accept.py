"""Verify window and accepted-KV move (SPEC.md §9, §14), V2 and the removed V1 bookkeeping.

Oracles: SPEC §14 / §9.3 worked examples and independent python loops from SPEC §9.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import probes
from jspec.config import SpecConfig
from jspec.kv.pool import init_kv_pool
from jspec.tree.accept import (
    accept_kv_move_pairs,
    get_src_tgt_cache_loc,
    move_accept_tokens_to_target_kvcache,
    verify_out_cache_loc,
)


# ---- independent oracles -------------------------------------------------------------------------
def loop_v2_pairs(r2t, rpi, seq_lens, out_cache_loc, accept_index, accept_lens, valid):
    size = accept_index.size
    tgt, src = [], []
    for b in range(len(rpi)):
        if not valid[b]:
            continue
        for r in range(int(accept_lens[b])):
            tgt.append(r2t[rpi[b], seq_lens[b] + r])
        for k in range(accept_index.shape[1]):
            if accept_index[b, k] != -1:
                src.append(out_cache_loc[accept_index[b, k]])
    n = len(tgt)
    return np.array(tgt + [0] * (size - n)), np.array(src + [0] * (size - len(src))), n


def loop_v1(seq_lens, out_cache_loc, accept_index, ncd, n_draft, page_size):
    size = accept_index.size
    src = [out_cache_loc[i] for i in accept_index.reshape(-1) if i != -1]
    tgt, free = [], []
    for b in range(len(seq_lens)):
        window = list(out_cache_loc[b * n_draft : (b + 1) * n_draft])
        tgt += window[: ncd[b] + 1]
        extended = seq_lens[b] + n_draft
        keep = min(-(-(seq_lens[b] + ncd[b] + 1) // page_size) * page_size, extended)
        num_free = extended - keep
        free += window[n_draft - num_free :] if num_free else []

    def pad(x, m):
        return np.array(x + [0] * (m - len(x)))

    return pad(src, size), pad(tgt, size), pad(free, len(out_cache_loc)), len(free)


def random_accept(rng, batch, n_draft, width):
    """accept_index rows: root (b*N) then increasing distinct tree nodes, then -1."""
    accept_index = np.full((batch, width), -1, np.int64)
    accept_lens = rng.integers(1, width + 1, size=batch)
    for b in range(batch):
        nodes = np.sort(rng.choice(np.arange(1, n_draft), accept_lens[b] - 1, replace=False))
        accept_index[b, : accept_lens[b]] = b * n_draft + np.concatenate([[0], nodes])
    return accept_index, accept_lens


def random_rows(rng, rows, width):
    r2t = np.zeros((rows, width), np.int64)
    r2t[1:] = (rng.permutation((rows - 1) * width) + 1).reshape(rows - 1, width)
    return r2t


# ---- SPEC §14 ----------------------------------------------------------------------------------
def test_spec14_verify_window_and_move_pairs() -> None:
    row = 1000 + np.arange(48)
    r2t = jnp.asarray(np.stack([np.zeros(48), row]).astype(np.int32))
    rpi, seq = jnp.array([1], jnp.int32), jnp.array([7], jnp.int32)
    out = verify_out_cache_loc(r2t, rpi, seq, num_draft_tokens=4)
    np.testing.assert_array_equal(np.asarray(out), row[7:11])
    accept_index = jnp.array([[0, 2, -1, -1]], jnp.int32)
    tgt, src, n = accept_kv_move_pairs(r2t, rpi, seq, out, accept_index, jnp.array([2], jnp.int32))
    assert int(n) == 2
    np.testing.assert_array_equal(np.asarray(src), [row[7], row[9], 0, 0])
    np.testing.assert_array_equal(np.asarray(tgt), [row[7], row[8], 0, 0])


def test_v1_comment_example() -> None:
    # SPEC §9.3: out [0 1 2|3 4 5|6 7 8], accept [0 -1 2|3 4 -1|6 -1 -1] (P=1).
    out = jnp.arange(9, dtype=jnp.int32)
    accept_index = jnp.array([[0, -1, 2], [3, 4, -1], [6, -1, -1]], jnp.int32)
    src, tgt, free, num_free = get_src_tgt_cache_loc(
        jnp.array([10, 20, 30], jnp.int32),
        out,
        accept_index,
        jnp.array([1, 1, 0], jnp.int32),
        num_draft_tokens=3,
        page_size=1,
    )
    np.testing.assert_array_equal(np.asarray(src)[:5], [0, 2, 3, 4, 6])
    np.testing.assert_array_equal(np.asarray(tgt)[:5], [0, 1, 3, 4, 6])
    assert int(num_free) == 4
    np.testing.assert_array_equal(np.asarray(free), [2, 5, 7, 8, 0, 0, 0, 0, 0])


# ---- random cases vs the loops ----------------------------------------------------------------
@pytest.mark.parametrize("n_draft,num_steps", [(4, 3), (8, 5), (6, 2), (1, 1)])
def test_v2_pairs_match_loop(n_draft, num_steps) -> None:
    rng = np.random.default_rng(n_draft * 10 + num_steps)
    width = min(num_steps + 1, n_draft)
    for _ in range(4):
        batch, rows, row_w = int(rng.integers(1, 6)), 8, 64
        r2t = random_rows(rng, rows, row_w)
        rpi = rng.permutation(np.arange(1, rows))[:batch]
        seq = rng.integers(0, row_w - n_draft, size=batch)
        valid = rng.random(batch) > 0.25
        rpi = np.where(valid, rpi, 0)
        accept_index, accept_lens = random_accept(rng, batch, n_draft, width)
        accept_index[~valid] = -1  # padding rows accept nothing
        out = verify_out_cache_loc(
            jnp.asarray(r2t, jnp.int32),
            jnp.asarray(rpi, jnp.int32),
            jnp.asarray(seq, jnp.int32),
            num_draft_tokens=n_draft,
            valid=jnp.asarray(valid),
        )
        want_out = np.concatenate(
            [
                r2t[rpi[b], seq[b] : seq[b] + n_draft] if valid[b] else np.zeros(n_draft, np.int64)
                for b in range(batch)
            ]
        )
        np.testing.assert_array_equal(np.asarray(out), want_out)
        got = accept_kv_move_pairs(
            jnp.asarray(r2t, jnp.int32),
            jnp.asarray(rpi, jnp.int32),
            jnp.asarray(seq, jnp.int32),
            out,
            jnp.asarray(accept_index, jnp.int32),
            jnp.asarray(accept_lens, jnp.int32),
            jnp.asarray(valid),
        )
        want = loop_v2_pairs(r2t, rpi, seq, want_out, accept_index, accept_lens, valid)
        np.testing.assert_array_equal(np.asarray(got[0]), want[0])
        np.testing.assert_array_equal(np.asarray(got[1]), want[1])
        assert int(got[2]) == want[2]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_v1_matches_loop(page_size) -> None:
    rng = np.random.default_rng(page_size)
    n_draft, width = 8, 5
    for _ in range(4):
        batch = int(rng.integers(1, 6))
        seq = rng.integers(0, 50, size=batch)
        out = rng.permutation(batch * n_draft * 3)[: batch * n_draft] + 1
        accept_index, accept_lens = random_accept(rng, batch, n_draft, width)
        got = get_src_tgt_cache_loc(
            jnp.asarray(seq, jnp.int32),
            jnp.asarray(out, jnp.int32),
            jnp.asarray(accept_index, jnp.int32),
            jnp.asarray(accept_lens - 1, jnp.int32),
            num_draft_tokens=n_draft,
            page_size=page_size,
        )
        want = loop_v1(seq, out, accept_index, accept_lens - 1, n_draft, page_size)
        for g, w in zip(got[:3], want[:3]):
            np.testing.assert_array_equal(np.asarray(g), w)
        assert int(got[3]) == want[3]


# ---- the move on a real pool --------------------------------------------------------------------
def test_move_accept_on_pool() -> None:
    rng = np.random.default_rng(11)
    cfg = SpecConfig(
        page_size=4,
        topk=2,
        num_steps=3,
        num_draft_tokens=4,
        context_len=32,
        max_running_requests=4,
        num_pages=32,
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        dtype="float32",
    )
    pool = init_kv_pool(cfg)
    kv = rng.standard_normal(pool.k.shape).astype(np.float32)
    pool = type(pool)(k=jnp.asarray(kv), v=jnp.asarray(-kv), page_size=pool.page_size)
    batch, n_draft = 3, 4
    # Each request owns a disjoint set of slots: row r maps position i -> a slot of its own.
    perm = rng.permutation(np.arange(4, cfg.num_slots))
    r2t = np.zeros((cfg.num_req_rows, 32), np.int64)
    r2t[1:] = perm[: 4 * 32].reshape(4, 32)
    rpi = np.array([2, 0, 4])
    valid = np.array([True, False, True])
    seq = np.array([5, 9, 13])
    accept_index, accept_lens = random_accept(rng, batch, n_draft, 4)
    accept_index[1] = -1
    args = [jnp.asarray(x, jnp.int32) for x in (r2t, rpi, seq)]
    out = verify_out_cache_loc(*args, num_draft_tokens=n_draft, valid=jnp.asarray(valid))
    new = move_accept_tokens_to_target_kvcache(
        jax.tree.map(jnp.copy, pool),
        *args,
        out,
        jnp.asarray(accept_index, jnp.int32),
        jnp.asarray(accept_lens, jnp.int32),
        valid=jnp.asarray(valid),
        impl="xla",
    )
    out = np.asarray(out)
    want_k = kv.copy()
    for b in np.flatnonzero(valid):
        for r in range(accept_lens[b]):
            want_k[:, r2t[rpi[b], seq[b] + r]] = kv[:, out[accept_index[b, r]]]
    np.testing.assert_array_equal(np.asarray(new.k), want_k)
    np.testing.assert_array_equal(np.asarray(new.v), -want_k)


# ---- probes --------------------------------------------------------------------------------------
def test_probe_accept_index_out_of_range() -> None:
    r2t = jnp.arange(64, dtype=jnp.int32).reshape(2, 32)
    args = (r2t, jnp.array([1], jnp.int32), jnp.array([3], jnp.int32))
    out = verify_out_cache_loc(*args, num_draft_tokens=4)

    def fn(ai, lens):
        return accept_kv_move_pairs(*args, out, ai, lens)

    probes.checked(fn)(jnp.array([[0, 3, -1]], jnp.int32), jnp.array([2], jnp.int32))
    with pytest.raises(probes.ProbeError, match=r"accept_index: max value 4 >= high bound 4"):
        probes.checked(fn)(jnp.array([[0, 4, -1]], jnp.int32), jnp.array([2], jnp.int32))
    with pytest.raises(probes.ProbeError, match=r"accept_index: min value -2 < low bound -1"):
        probes.checked(fn)(jnp.array([[0, -2, -1]], jnp.int32), jnp.array([1], jnp.int32))
    with pytest.raises(probes.ProbeError, match=r"accept_lens != count"):
        probes.checked(fn)(jnp.array([[0, 1, -1]], jnp.int32), jnp.array([3], jnp.int32))


def test_probes_off_add_nothing() -> None:
    r2t = jnp.arange(64, dtype=jnp.int32).reshape(2, 32)
    args = (r2t, jnp.array([1], jnp.int32), jnp.array([3], jnp.int32))
    out = verify_out_cache_loc(*args, num_draft_tokens=4)
    jaxpr = str(
        jax.make_jaxpr(lambda ai: accept_kv_move_pairs(*args, out, ai, jnp.array([2], jnp.int32)))(
            jnp.array([[0, 3, -1]], jnp.int32)
        )
    )
    assert "check" not in jaxpr
