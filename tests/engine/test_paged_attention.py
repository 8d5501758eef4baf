"""``paged_attention``: the Pallas kernel against its reference, the reference against numpy.

Random pools and permuted slot ids; widths and query counts that are not powers of 2; masks
of every shape the engine builds (length, causal, tree, random) with rows that see nothing.
Pool rows the pass does not list, and every other layer, are poisoned with NaN: a kernel that
reads one row too many fails. The kernel runs in interpret mode on CPU and compiled with
JSPEC_TEST_GPU=1.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.kernels.paged_attention import paged_attention, paged_attention_reference

# (Bp, Qp, Hq, Hkv, D, W): decode, draft pass A/B, verify tree, prefill, MQA, MHA, odd D.
SHAPES = [
    pytest.param(4, 1, 4, 2, 32, 64, id="decode-gqa"),
    pytest.param(3, 8, 4, 2, 32, 48, id="passA-k8"),
    pytest.param(6, 1, 4, 2, 32, 80, id="passB-w80"),
    pytest.param(2, 32, 4, 2, 32, 32, id="tree-n32"),
    pytest.param(2, 40, 4, 2, 8, 64, id="prefill-q40-d8"),
    pytest.param(3, 5, 8, 1, 16, 37, id="mqa-w37"),
    pytest.param(2, 3, 2, 2, 24, 19, id="mha-d24"),
    pytest.param(2, 4, 8, 2, 128, 40, id="gqa4-d128"),
    pytest.param(2, 3, 4, 2, 80, 33, id="d80-chunk-tail"),
]


def _numpy_attention(q, k_layer, v_layer, slots, mask):
    """Independent loop oracle in f64."""
    bp, qp, hq, d = q.shape
    group = hq // k_layer.shape[1]
    out = np.zeros((bp, qp, hq, d))
    lse = np.full((bp, qp, hq), -np.inf)
    for b in range(bp):
        for i in range(qp):
            keys = slots[b][mask[b, i]]
            if keys.size == 0:
                continue
            for h in range(hq):
                k = k_layer[keys, h // group].astype(np.float64)
                s = k @ q[b, i, h].astype(np.float64) / np.sqrt(d)
                e = np.exp(s - s.max())
                out[b, i, h] = e @ v_layer[keys, h // group] / e.sum()
                lse[b, i, h] = s.max() + np.log(e.sum())
    return out, lse


def _case(
    rng, bp, qp, hq, hkv, d, w, *, num_layers=3, layer=1, mask_kind="random", dtype=np.float32
):
    num_slots = bp * w + 16
    k_pool = np.full((num_layers, num_slots, hkv, d), np.nan, np.float32)
    v_pool = np.full((num_layers, num_slots, hkv, d), np.nan, np.float32)
    slots = rng.permutation(np.arange(1, num_slots))[: bp * w].reshape(bp, w).astype(np.int32)
    # Listed rows of the read layer get real values (listed-but-masked ones too: large, finite).
    k_pool[layer, slots] = rng.standard_normal((bp, w, hkv, d))
    v_pool[layer, slots] = rng.standard_normal((bp, w, hkv, d))
    q = rng.standard_normal((bp, qp, hq, d)).astype(np.float32)
    cols = np.arange(w)
    if mask_kind == "length":
        lens = rng.integers(0, w + 1, bp)
        mask = np.broadcast_to((cols[None, :] < lens[:, None])[:, None, :], (bp, qp, w)).copy()
    elif mask_kind == "causal":
        start = rng.integers(0, max(w - qp, 0) + 1, bp)
        mask = cols[None, None, :] <= (start[:, None] + np.arange(qp)[None, :])[:, :, None]
    else:
        mask = rng.random((bp, qp, w)) < 0.6
    mask = np.array(mask)
    mask[0, 0] = False  # one query sees nothing: out 0, lse -inf
    hidden = ~mask.any(axis=1)  # [bp, w] listed keys nobody sees: poison with big values
    for b in range(bp):
        k_pool[layer, slots[b][hidden[b]]] = 1e4
        v_pool[layer, slots[b][hidden[b]]] = -1e4
    return (q.astype(dtype), k_pool.astype(dtype), v_pool.astype(dtype), slots, mask)


def _check(got, want_out, want_lse, rtol):
    out, lse = (np.asarray(x) for x in got)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(out, want_out, rtol=rtol, atol=rtol)
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=rtol, atol=rtol)


@pytest.mark.parametrize("mask_kind", ["random", "length", "causal"])
@pytest.mark.parametrize("bp,qp,hq,hkv,d,w", SHAPES)
def test_reference_matches_numpy(bp, qp, hq, hkv, d, w, mask_kind):
    rng = np.random.default_rng(hash((bp, qp, w, mask_kind)) % 2**32)
    q, k_pool, v_pool, slots, mask = _case(rng, bp, qp, hq, hkv, d, w, mask_kind=mask_kind)
    got = paged_attention_reference(
        jnp.asarray(q),
        jnp.asarray(k_pool),
        jnp.asarray(v_pool),
        1,
        jnp.asarray(slots),
        jnp.asarray(mask),
    )
    # NOTE: the reference's padded einsum multiplies masked probabilities (0) by every listed
    # V row, so listed rows must be finite (the poison here is); the kernel has no such need.
    _check(got, *_numpy_attention(q, k_pool[1], v_pool[1], slots, mask), rtol=2e-5)


@pytest.mark.parametrize("mask_kind", ["random", "length", "causal"])
@pytest.mark.parametrize("bp,qp,hq,hkv,d,w", SHAPES)
def test_kernel_matches_reference(interpret, bp, qp, hq, hkv, d, w, mask_kind):
    rng = np.random.default_rng(hash((bp, qp, w, mask_kind, 1)) % 2**32)
    q, k_pool, v_pool, slots, mask = _case(rng, bp, qp, hq, hkv, d, w, mask_kind=mask_kind)
    args = (
        jnp.asarray(q),
        jnp.asarray(k_pool),
        jnp.asarray(v_pool),
        1,
        jnp.asarray(slots),
        jnp.asarray(mask),
    )
    want = [np.asarray(x) for x in paged_attention_reference(*args)]
    _check(paged_attention(*args, impl="pallas", interpret=interpret), *want, rtol=2e-5)


@pytest.mark.parametrize(
    "block_q,block_w,block_d,num_warps",
    [(16, 16, 16, 1), (None, 64, 32, 4), (32, 128, 64, 8), (16, 32, 128, 4)],
)
def test_kernel_tuning_and_bf16_pool(interpret, block_q, block_w, block_d, num_warps):
    """Other query / key / head-dim blocks and warps; a bf16 pool (computed in f32)."""
    rng = np.random.default_rng(block_w)
    q, k_pool, v_pool, slots, mask = _case(
        rng, 3, 12, 4, 2, 96, 100, num_layers=2, layer=0, dtype=jnp.bfloat16
    )
    args = (
        jnp.asarray(q),
        jnp.asarray(k_pool),
        jnp.asarray(v_pool),
        0,
        jnp.asarray(slots),
        jnp.asarray(mask),
    )
    want = [np.asarray(x) for x in paged_attention_reference(*args)]
    got = paged_attention(
        *args,
        impl="pallas",
        interpret=interpret,
        block_q=block_q,
        block_w=block_w,
        block_d=block_d,
        num_warps=num_warps,
    )
    _check(got, *want, rtol=2e-5)


def test_kernel_reads_only_listed_rows_of_its_layer(interpret):
    """Every unlisted row and every other layer is NaN: the outputs stay finite."""
    rng = np.random.default_rng(7)
    q, k_pool, v_pool, slots, mask = _case(rng, 2, 4, 4, 2, 16, 24, num_layers=4, layer=2)
    mask[:] = True
    mask[0, 0] = False
    out, lse = paged_attention(
        jnp.asarray(q),
        jnp.asarray(k_pool),
        jnp.asarray(v_pool),
        2,
        jnp.asarray(slots),
        jnp.asarray(mask),
        impl="pallas",
        interpret=interpret,
    )
    assert np.isfinite(np.asarray(out)).all()
    assert np.isneginf(np.asarray(lse)[0, 0]).all() and np.isfinite(np.asarray(lse)[1:]).all()


def test_empty_shapes():
    q = jnp.zeros((0, 1, 4, 8), jnp.float32)
    pool = jnp.zeros((1, 8, 2, 8), jnp.float32)
    out, lse = paged_attention(
        q, pool, pool, 0, jnp.zeros((0, 5), jnp.int32), jnp.zeros((0, 1, 5), bool), impl="pallas"
    )
    assert out.shape == (0, 1, 4, 8) and lse.shape == (0, 1, 4)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"q": (2, 1, 3, 8)}, "multiple of Hkv"),
        ({"q": (2, 1, 4, 16)}, "head_dim"),
        ({"slots": (3, 5)}, "kv_slot_ids.shape"),
        ({"mask": (2, 2, 5)}, "kv_mask.shape"),
        ({"layer": 2}, "layer=2"),
        ({"block_w": 24}, "block_w=24"),
        ({"block_d": 0}, "block_d=0"),
        ({"block_q": 3}, "block_q=3"),
        ({"impl": "cuda"}, "impl='cuda'"),
    ],
)
def test_static_validation(kwargs, match):
    q = jnp.zeros(kwargs.get("q", (2, 1, 4, 8)), jnp.float32)
    pool = jnp.zeros((2, 8, 2, 8), jnp.float32)
    slots = jnp.zeros(kwargs.get("slots", (2, 5)), jnp.int32)
    mask = jnp.zeros(kwargs.get("mask", (2, 1, 5)), bool)
    with pytest.raises(ValueError, match=match):
        paged_attention(
            q,
            pool,
            pool,
            kwargs.get("layer", 0),
            slots,
            mask,
            impl=kwargs.get("impl", "pallas"),
            block_w=kwargs.get("block_w"),
            block_d=kwargs.get("block_d"),
            block_q=kwargs.get("block_q"),
        )
