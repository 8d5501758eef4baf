"""Property test of one full decode iteration's bookkeeping over (P, K, S) and ragged lengths.

prefill -> prepare_for_decode -> draft layout + hole duplication (real draft KVPool) -> verify
window + accepted-KV move (real target KVPool) -> commit -> prepare_for_decode -> release.
Properties (SPEC.md §4, §9, §10): every draft slot is inside the allocated row; no slot is shared
between branches, requests or with the committed prefix; after duplication the holes hold
exactly the prefix-tail KV and nothing else changed; accepted KV ends at ``row[L : L+acc]``;
the allocator balances (``available + owned == total``) and drains to full.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jspec.config import SpecConfig
from jspec.kv.allocator import alloc_extend, init_allocator
from jspec.kv.decode_alloc import (
    ReqKVState,
    commit_kv_lens,
    init_req_kv_state,
    prepare_for_decode,
    release_kv_cache,
)
from jspec.kv.integrity import check_integrity, owned_page_mask
from jspec.kv.pool import KVPool, init_kv_pool
from jspec.kv.req_to_token import assign_req_to_token_pool, init_req_to_token
from jspec.tree.accept import move_accept_tokens_to_target_kvcache, verify_out_cache_loc
from jspec.tree.layout import draft_out_cache_loc, prepare_for_draft
from tree_geometry import geom

MAX_BATCH = 3


def prefill(allocator, r2t, reqs, new, rows, prompt_lens):
    """Admit requests (bool[B] ``new``) at ``rows`` with ``prompt_lens`` committed tokens."""
    zeros = jnp.zeros_like(prompt_lens)
    seq = jnp.where(new, prompt_lens, 0)
    allocator, slot_ids, ok = alloc_extend(
        allocator, zeros, seq, jnp.full_like(seq, -1), max_new_slots=MAX_BATCH * 256
    )
    assert bool(ok)
    r2t = assign_req_to_token_pool(r2t, jnp.where(new, rows, 0), zeros, seq, slot_ids)
    return (
        allocator,
        r2t,
        ReqKVState(
            committed_lens=jnp.where(new, prompt_lens, 0),
            allocated_lens=jnp.where(new, prompt_lens, 0),
            req_pool_indices=jnp.where(new, rows, 0),
            valid=new,
        ),
    )


@st.composite
def decode_case(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 16, 64]))
    topk = draw(st.sampled_from([1, 2, 4, 8]))
    num_steps = draw(st.integers(1, 6))
    max_nodes = 1 + topk + (num_steps - 1) * topk * topk
    n_draft = draw(st.integers(2, min(max_nodes, 16)))
    batch = draw(st.integers(1, MAX_BATCH))
    # lengths straddling page boundaries: k*P + {-1, 0, 1}, or anything small
    near = st.builds(
        lambda k, d: max(1, k * page_size + d), st.integers(0, 3), st.sampled_from([-1, 0, 1])
    )
    lens = draw(
        st.lists(st.one_of(near, st.integers(1, 4 * page_size + 3)), min_size=batch, max_size=batch)
    )
    seed = draw(st.integers(0, 2**16))
    return page_size, topk, num_steps, n_draft, lens, seed


def _random_pool(cfg: SpecConfig, rng) -> KVPool:
    shape = init_kv_pool(cfg).k.shape
    return KVPool(
        k=jnp.asarray(rng.standard_normal(shape), jnp.float32),
        v=jnp.asarray(rng.standard_normal(shape), jnp.float32),
        page_size=cfg.page_size,
    )


def _owned(r2t, reqs, cfg):
    return owned_page_mask(
        r2t,
        reqs.req_pool_indices,
        reqs.allocated_lens,
        num_pages=cfg.num_pages,
        page_size=cfg.page_size,
        valid=reqs.valid,
    )


@settings(max_examples=10)
@given(decode_case())
def test_decode_iteration_properties(case) -> None:
    page_size, topk, num_steps, n_draft, lens, seed = case
    rng = np.random.default_rng(seed)
    batch = len(lens)
    context_len = 4 * page_size + 8
    probe_cfg = SpecConfig(
        page_size=page_size,
        topk=topk,
        num_steps=num_steps,
        num_draft_tokens=n_draft,
        context_len=context_len,
    )
    pages_per_req = -(-(context_len + probe_cfg.alloc_reserve_per_decode) // page_size) + 1
    cfg = SpecConfig(
        page_size=page_size,
        topk=topk,
        num_steps=num_steps,
        num_draft_tokens=n_draft,
        context_len=context_len,
        max_running_requests=MAX_BATCH,
        num_pages=MAX_BATCH * pages_per_req,
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        dtype="float32",
    )
    # requests in random req_to_token rows; pad the batch to MAX_BATCH (static shapes)
    rows = np.zeros(MAX_BATCH, np.int64)
    rows[:batch] = rng.permutation(np.arange(1, MAX_BATCH + 1))[:batch]
    prompt = np.zeros(MAX_BATCH, np.int64)
    prompt[:batch] = lens
    new = np.arange(MAX_BATCH) < batch
    allocator = init_allocator(cfg.num_pages, page_size)
    r2t = init_req_to_token(cfg)
    reqs = init_req_kv_state(MAX_BATCH)
    allocator, r2t, reqs = prefill(
        allocator,
        r2t,
        reqs,
        jnp.asarray(new),
        jnp.asarray(rows, jnp.int32),
        jnp.asarray(prompt, jnp.int32),
    )
    allocator, r2t, reqs, ok = prepare_for_decode(allocator, r2t, reqs, cfg)
    assert bool(ok)
    check_integrity(allocator, _owned(r2t, reqs, cfg), what="after prepare_for_decode")

    # ---- draft layout + hole duplication -----------------------------------------------------
    rpi, seq, valid = reqs.req_pool_indices, reqs.committed_lens, reqs.valid
    draft = _random_pool(cfg, rng)
    before = np.stack([np.asarray(draft.k), np.asarray(draft.v)])
    draft, out, positions = prepare_for_draft(
        jax.tree.map(jnp.copy, draft),
        r2t,
        rpi,
        seq,
        geometry=geom(topk=topk, num_steps=num_steps, page_size=page_size),
        valid=valid,
    )
    after = np.stack([np.asarray(draft.k), np.asarray(draft.v)])
    out = np.asarray(out)
    np.testing.assert_array_equal(np.asarray(positions), np.repeat(np.asarray(seq), topk))
    r2t_np = np.asarray(r2t)
    alloc_lens = np.asarray(reqs.allocated_lens)
    all_draft, expect = [], before.copy()
    for b in range(batch):
        row = r2t_np[rows[b]]
        length = lens[b]
        owned = set(row[: alloc_lens[b]].tolist())
        prefix = set(row[:length].tolist())
        slots = out[b].reshape(-1).tolist()
        assert set(slots) <= owned  # inside the allocated row
        assert not set(slots) & prefix  # never the committed KV
        all_draft += slots
        lp, base = length % page_size, length - length % page_size
        region = -(-(lp + num_steps) // page_size) * page_size
        for t in range(1, topk if page_size > 1 else 1):
            holes = row[base + t * region : base + t * region + lp]
            assert not set(holes.tolist()) & (prefix | set(slots))
            expect[:, :, holes] = before[:, :, row[base : base + lp]]
    assert len(set(all_draft)) == len(all_draft)  # no slot shared
    assert not out[batch:].any()  # padding rows -> slot 0
    np.testing.assert_array_equal(after, expect)  # holes = prefix tail, only

    # ---- verify + accepted-KV move ------------------------------------------------------------
    width = num_steps + 1
    accept_index = np.full((MAX_BATCH, width), -1, np.int64)
    accept_lens = np.zeros(MAX_BATCH, np.int64)
    for b in range(batch):
        acc = int(rng.integers(1, min(width, n_draft) + 1))
        nodes = np.sort(rng.choice(np.arange(1, n_draft), acc - 1, replace=False))
        accept_index[b, :acc] = b * n_draft + np.concatenate([[0], nodes])
        accept_lens[b] = acc
    window = verify_out_cache_loc(r2t, rpi, seq, num_draft_tokens=n_draft, valid=valid)
    target = _random_pool(cfg, rng)
    t_before = np.asarray(target.k)
    target = move_accept_tokens_to_target_kvcache(
        jax.tree.map(jnp.copy, target),
        r2t,
        rpi,
        seq,
        window,
        jnp.asarray(accept_index, jnp.int32),
        jnp.asarray(accept_lens, jnp.int32),
        valid=valid,
    )
    t_after = np.asarray(target.k)
    window = np.asarray(window)
    for b in range(batch):
        row = r2t_np[rows[b]]
        dst = row[lens[b] : lens[b] + accept_lens[b]]
        assert set(dst.tolist()) <= set(row[: alloc_lens[b]].tolist())
        np.testing.assert_array_equal(
            t_after[:, dst], t_before[:, window[accept_index[b, : accept_lens[b]]]]
        )

    # ---- commit, next step, drain --------------------------------------------------------------
    reqs = commit_kv_lens(reqs, jnp.asarray(accept_lens, jnp.int32))
    allocator, r2t, reqs, ok = prepare_for_decode(allocator, r2t, reqs, cfg)
    assert bool(ok)
    check_integrity(allocator, _owned(r2t, reqs, cfg), what="second step")
    out2 = np.asarray(
        draft_out_cache_loc(
            r2t,
            reqs.req_pool_indices,
            reqs.committed_lens,
            geometry=geom(topk=topk, num_steps=num_steps, page_size=page_size),
            valid=reqs.valid,
        )
    )
    r2t_np = np.asarray(r2t)
    for b in range(batch):
        owned = set(r2t_np[rows[b], : int(reqs.allocated_lens[b])].tolist())
        assert set(out2[b].reshape(-1).tolist()) <= owned
    allocator, reqs = release_kv_cache(allocator, r2t, reqs, jnp.ones((MAX_BATCH,), bool))
    assert int(allocator.num_free) == cfg.num_pages
    check_integrity(allocator, _owned(r2t, reqs, cfg), what="drained")
