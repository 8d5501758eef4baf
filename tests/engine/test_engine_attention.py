"""Paged attention passes: masked softmax vs numpy (both impls), LSE merge, slot-id expansion.

The Pallas kernel against its reference over many shapes: tests/engine/test_paged_attention.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.engine.attention import (
    AttnPass,
    AttnPlan,
    attend,
    causal_mask,
    length_mask,
    merge_states,
    page_table_slot_ids,
    run_plan,
)


def _np_attend(q, k_pool, v_pool, slots, mask):
    bp, qp, hq, d = q.shape
    hkv = k_pool.shape[1]
    out = np.zeros((bp, qp, hq, d))
    lse = np.full((bp, qp, hq), -np.inf)
    for r in range(bp):
        for i in range(qp):
            keys = [slots[r, w] for w in range(slots.shape[1]) if mask[r, i, w]]
            if not keys:
                continue
            for h in range(hq):
                kv = h // (hq // hkv)
                s = np.array([q[r, i, h] @ k_pool[key, kv] for key in keys]) / np.sqrt(d)
                m = s.max()
                e = np.exp(s - m)
                out[r, i, h] = (e[:, None] * v_pool[keys, kv]).sum(0) / e.sum()
                lse[r, i, h] = m + np.log(e.sum())
    return out, lse


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_attend_matches_numpy_with_empty_rows(impl):
    rng = np.random.default_rng(0)
    num_slots, hkv, hq, d = 40, 2, 4, 8
    k_pool = rng.standard_normal((num_slots, hkv, d)).astype(np.float32)
    v_pool = rng.standard_normal((num_slots, hkv, d)).astype(np.float32)
    q = rng.standard_normal((3, 2, hq, d)).astype(np.float32)
    slots = rng.permutation(num_slots)[:18].reshape(3, 6).astype(np.int32)
    mask = rng.random((3, 2, 6)) < 0.6
    mask[1, 0] = False  # a query that sees nothing
    out, lse = attend(
        jnp.asarray(q),
        jnp.asarray(k_pool),
        jnp.asarray(v_pool),
        jnp.asarray(slots),
        jnp.asarray(mask),
        impl=impl,
    )
    ref_out, ref_lse = _np_attend(q, k_pool, v_pool, slots, mask)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[1, 0] == 0) and np.all(np.isneginf(np.asarray(lse)[1, 0]))


def test_split_passes_merge_to_single_pass():
    """Any split of the visible keys into two passes, merged by LSE, equals one pass."""
    rng = np.random.default_rng(1)
    num_slots, hkv, hq, d, width = 64, 2, 4, 8, 12
    k_pool = jnp.asarray(rng.standard_normal((num_slots, hkv, d)), jnp.float32)
    v_pool = jnp.asarray(rng.standard_normal((num_slots, hkv, d)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((4 * 3, hq, d)), jnp.float32)
    slots = jnp.asarray(rng.permutation(num_slots)[: 4 * width].reshape(4, width), jnp.int32)
    mask = rng.random((4, 3, width)) < 0.7
    split = rng.random((4, 3, width)) < 0.5
    split[0] = True  # pass B empty for request 0
    one = run_plan(
        AttnPlan(jnp.zeros(12, jnp.int32), (AttnPass(slots, jnp.asarray(mask)),)),
        k_pool[None],
        v_pool[None],
        0,
        q,
    )
    two = run_plan(
        AttnPlan(
            jnp.zeros(12, jnp.int32),
            (
                AttnPass(slots, jnp.asarray(mask & split)),
                AttnPass(slots, jnp.asarray(mask & ~split)),
            ),
        ),
        k_pool[None],
        v_pool[None],
        0,
        q,
    )
    np.testing.assert_allclose(np.asarray(two), np.asarray(one), rtol=1e-5, atol=1e-5)


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


def test_page_table_slot_ids_and_masks():
    pt = jnp.asarray([[3, 1], [0, 5]], jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(page_table_slot_ids(pt, 4)),
        [[12, 13, 14, 15, 4, 5, 6, 7], [0, 1, 2, 3, 20, 21, 22, 23]],
    )
    np.testing.assert_array_equal(
        np.asarray(length_mask(jnp.asarray([2, 0]), 1, 3)),
        [[[True, True, False]], [[False, False, False]]],
    )
    np.testing.assert_array_equal(
        np.asarray(causal_mask(jnp.asarray([1]), 2, 4, lengths=jnp.asarray([3]))),
        [[[True, True, False, False], [True, True, True, False]]],
    )
