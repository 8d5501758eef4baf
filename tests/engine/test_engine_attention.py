"""The engine's attention seam: AttentionMetadata passes through a backend, the LSE merge, page
tables from request rows, and a foreign backend driving attn_fn.

The op itself (reference vs an independent loop oracle, the Triton kernel vs the reference):
tests/engine/test_paged_attention.py and test_paged_attention_triton.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.attention_meta import AttentionMetadata, causal_tail_mask, row_page_table
from jspec.engine.attention import (
    AttnPlan,
    PagedAttentionBackend,
    make_attn_fn,
    merge_states,
    run_plan,
)
from jspec.kv.pool import KVPool

P, HKV, HQ, D = 4, 2, 4, 8


def _pool(rng, num_pages: int) -> KVPool:
    shape = (1, (num_pages + 1) * P, HKV, D)
    return KVPool(
        k=jnp.asarray(rng.standard_normal(shape), jnp.float32),
        v=jnp.asarray(rng.standard_normal(shape), jnp.float32),
        page_size=P,
    )


def test_two_passes_over_split_pages_merge_to_one_pass():
    """A row's prefix read as pass A (its first full pages) + pass B (the remaining pages),
    merged by log-sum-exp, equals one pass over the whole prefix (the FA3 cascade's premise)."""
    rng = np.random.default_rng(1)
    pool = _pool(rng, 24)
    lens = np.array([13, 4, 0, 9], np.int32)  # straddling pages; an empty row
    table = rng.permutation(np.arange(1, 25))[:16].reshape(4, 4).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((4 * 3, HQ, D)), jnp.float32)
    backend = PagedAttentionBackend("xla")
    one = run_plan(
        AttnPlan(
            jnp.zeros(12, jnp.int32), (AttentionMetadata(jnp.asarray(table), lens, page_size=P),)
        ),
        backend,
        pool,
        0,
        q,
    )
    full = (lens // P) * P  # pass A: full pages
    rest = np.zeros_like(table)
    for b in range(4):
        tail_pages = table[b, lens[b] // P :]
        rest[b, : len(tail_pages)] = tail_pages
    two = run_plan(
        AttnPlan(
            jnp.zeros(12, jnp.int32),
            (
                AttentionMetadata(jnp.asarray(table), jnp.asarray(full), page_size=P),
                AttentionMetadata(jnp.asarray(rest), jnp.asarray(lens - full), page_size=P),
            ),
        ),
        backend,
        pool,
        0,
        q,
    )
    np.testing.assert_allclose(np.asarray(two), np.asarray(one), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(one).reshape(4, 3, HQ, D)[2] == 0)  # the empty row


def test_tail_equals_the_same_slots_read_through_the_row():
    """Verify / extend: prefix pages + a causal tail of the next N row slots equals a causal
    pass over the row extended by N (the window's slots are the row's next positions)."""
    rng = np.random.default_rng(2)
    pool = _pool(rng, 32)
    b, n = 3, 4
    lens = jnp.asarray([5, 8, 1], jnp.int32)
    table = jnp.asarray(rng.permutation(np.arange(1, 33))[: b * 4].reshape(b, 4), jnp.int32)
    pos = lens[:, None] + jnp.arange(n)[None, :]
    tail = table[jnp.arange(b)[:, None], pos // P] * P + pos % P
    q = jnp.asarray(rng.standard_normal((b * n, HQ, D)), jnp.float32)
    backend = PagedAttentionBackend("xla")
    with_tail = AttentionMetadata(
        table, lens, tail_slot_ids=tail, tail_mask=causal_tail_mask(b, n), page_size=P
    )
    causal = AttentionMetadata(
        table, lens + n, q_lens=jnp.full((b,), n, jnp.int32), page_size=P, causal=True
    )
    a = run_plan(AttnPlan(jnp.zeros(b * n, jnp.int32), (with_tail,)), backend, pool, 0, q)
    c = run_plan(AttnPlan(jnp.zeros(b * n, jnp.int32), (causal,)), backend, pool, 0, q)
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-5)


def test_merge_states_ignores_empty_pass():
    out = jnp.ones((2, 3, 4))
    lse = jnp.zeros((2, 3))
    merged, m_lse = merge_states(out, lse, jnp.zeros((2, 3, 4)), jnp.full((2, 3), -jnp.inf))
    np.testing.assert_array_equal(np.asarray(merged), np.ones((2, 3, 4)))
    np.testing.assert_array_equal(np.asarray(m_lse), np.zeros((2, 3)))
    both_empty, _ = merge_states(
        jnp.zeros((1, 1, 2)),
        jnp.full((1, 1), -jnp.inf),
        jnp.zeros((1, 1, 2)),
        jnp.full((1, 1), -jnp.inf),
    )
    assert np.all(np.asarray(both_empty) == 0)


def test_row_page_table_reads_the_first_slot_of_each_row_page():
    r2t = np.zeros((3, 12), np.int32)
    r2t[1, :8] = np.r_[np.arange(20, 24), np.arange(8, 12)]  # pages 5, 2
    r2t[2, :5] = np.arange(12, 17)  # page 3, then page 4's first slot
    table = row_page_table(jnp.asarray(r2t), jnp.asarray([1, 0, 2]), page_size=4, max_pages=3)
    np.testing.assert_array_equal(np.asarray(table), [[5, 2, 0], [0, 0, 0], [3, 4, 0]])
    with pytest.raises(ValueError, match="max_pages=4"):
        row_page_table(jnp.asarray(r2t), jnp.asarray([1]), page_size=4, max_pages=4)


@dataclasses.dataclass(frozen=True)
class _RecordingBackend:
    """A foreign backend: jspec's reference math, its own write (counts layers it saw)."""

    inner: PagedAttentionBackend = PagedAttentionBackend("xla")

    def write_kv(self, pool, layer, slot_ids, k, v):
        return self.inner.write_kv(pool, layer, slot_ids, k, v)

    def attend(self, pool, layer, q, meta):
        return self.inner.attend(pool, layer, q, meta)


def test_make_attn_fn_writes_then_reads_through_any_backend():
    rng = np.random.default_rng(3)
    pool = _pool(rng, 8)
    table = jnp.asarray([[2, 5]], jnp.int32)
    slots = jnp.asarray([2 * P + 0, 2 * P + 1, 2 * P + 2], jnp.int32)  # positions 0..2
    meta = AttentionMetadata(
        table, jnp.asarray([3]), q_lens=jnp.asarray([3]), page_size=P, causal=True
    )
    q = jnp.asarray(rng.standard_normal((3, HQ, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((3, HKV, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, HKV, D)), jnp.float32)
    outs = []
    for backend in (PagedAttentionBackend("xla"), _RecordingBackend()):
        new_pool, out = jax.jit(make_attn_fn(AttnPlan(slots, (meta,)), backend), static_argnums=0)(
            0, pool, q, k, v
        )
        np.testing.assert_array_equal(np.asarray(new_pool.k[0, slots]), np.asarray(k))
        outs.append(np.asarray(out))
    np.testing.assert_array_equal(outs[0], outs[1])
    # query 0 sees only key 0: its output is v[0] (GQA: query heads 0, 1 read KV head 0)
    np.testing.assert_allclose(outs[0][0, :2], np.asarray(v)[0, [0, 0]], rtol=1e-6)


def test_plan_without_passes_is_a_value_error():
    """An AttnPlan with no pass once gave the model None as its attention output."""
    pool = _pool(np.random.default_rng(0), 2)
    q = jnp.zeros((4, HQ, D), jnp.float32)
    with pytest.raises(ValueError, match=r"plan.passes=\(\) is empty"):
        run_plan(AttnPlan(jnp.zeros(4, jnp.int32), ()), PagedAttentionBackend(), pool, 0, q)
