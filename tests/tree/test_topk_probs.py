"""topk_probs: reference vs a numpy loop oracle, Pallas kernel vs reference, validation.

Oracle: per row, a stable argsort of ``-logits`` (ties -> lower index, -inf last) and an f64
softmax. The Pallas kernel runs in interpret mode on CPU and compiled with JSPEC_TEST_GPU=1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.kernels.topk_probs import MAX_COLS, topk_probs, topk_probs_reference

NEG_INF = -np.inf


def _oracle(logits: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray]:
    """Loop oracle: stable descending sort by index, f64 softmax (NaN for all -inf rows)."""
    x = np.asarray(logits, np.float64)
    p = np.empty((x.shape[0], topk))
    index = np.empty((x.shape[0], topk), np.int64)
    for r, row in enumerate(x):
        order = np.argsort(-row, kind="stable")[:topk]
        with np.errstate(invalid="ignore"):
            e = np.exp(row - row.max())
            p[r] = e[order] / e.sum()
        index[r] = order
    return p, index


def _mixed_logits(rng: np.random.Generator, num_rows: int, vocab: int) -> np.ndarray:
    """Rows cycling through: integer ties, f32 normal, sparse -inf mask, mostly -inf, all -inf."""
    x = np.empty((num_rows, vocab), np.float32)
    for r in range(num_rows):
        kind = r % 5
        if kind == 0:  # many ties
            x[r] = rng.integers(-2, 3, vocab)
        elif kind == 1:
            x[r] = rng.standard_normal(vocab) * 3
        elif kind == 2:  # a few masked tokens, ties among the rest
            x[r] = rng.integers(0, 4, vocab)
            x[r, rng.random(vocab) < 0.3] = NEG_INF
        elif kind == 3:  # all -inf except 3 (K may reach into the -inf entries)
            x[r] = NEG_INF
            x[r, rng.choice(vocab, 3, replace=False)] = [1.0, 2.0, 1.0]
        else:  # all -inf
            x[r] = NEG_INF
    return x


def _check(got, want_p, want_index, rtol):
    p, index = got
    assert p.shape == want_p.shape and p.dtype == jnp.float32
    assert index.shape == want_index.shape and index.dtype == jnp.int32
    np.testing.assert_array_equal(index, want_index)
    np.testing.assert_allclose(p, want_p, rtol=rtol, atol=0)  # NaN == NaN here


# ---- reference vs oracle ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "num_rows,vocab,topk",
    [
        pytest.param(10, 37, 8, id="v37_k8"),
        pytest.param(7, 16, 1, id="k1"),
        pytest.param(6, 23, 23, id="k_eq_v"),
        pytest.param(5, 512, 8, id="v512"),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_oracle(num_rows, vocab, topk, seed):
    x = _mixed_logits(np.random.default_rng(seed * 100 + vocab), num_rows, vocab)
    want_p, want_index = _oracle(x, topk)
    _check(topk_probs_reference(jnp.asarray(x), topk), want_p, want_index, rtol=1e-5)


def test_reference_golden():
    x = jnp.asarray([[1.0, 3.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    p, index = topk_probs_reference(x, 3)
    assert index.tolist() == [[1, 2, 3], [0, 1, 2]]
    e = np.exp([1.0, 3.0, 3.0, 2.0])
    np.testing.assert_allclose(p, [e[[1, 2, 3]] / e.sum(), [0.25] * 3], rtol=1e-6)


# ---- Pallas kernel vs reference --------------------------------------------------------------
@pytest.mark.parametrize(
    "num_rows,vocab,topk,block_rows,dtype",
    [
        # 13 rows in blocks of 4: a partial last block; V not a power of 2; -inf rows.
        pytest.param(13, 37, 8, 4, jnp.float32, id="r13_v37_k8_br4"),
        pytest.param(3, 16, 1, None, jnp.float32, id="k1_v16"),
        # K = V > MAX_UNROLL: the fori_loop selection path; picks run into the -inf entries.
        pytest.param(5, 37, 37, 2, jnp.float32, id="k_eq_v37_fori"),
        pytest.param(6, 512, 8, None, jnp.float32, id="v512_k8"),
        pytest.param(4, 100, 8, None, jnp.bfloat16, id="bf16"),
    ],
)
def test_kernel_matches_reference(interpret, num_rows, vocab, topk, block_rows, dtype):
    x = jnp.asarray(_mixed_logits(np.random.default_rng(vocab + topk), num_rows, vocab), dtype)
    want_p, want_index = topk_probs_reference(x, topk)
    got = topk_probs(x, topk, impl="pallas", interpret=interpret, block_rows=block_rows)
    # NOTE: p depends on the lse through exp(top - lse): one f32 ulp of |lse| ~ 10 is a ~1e-6
    # relative error, so the compiled kernel (other reduction order, libdevice exp/log) gets
    # 1e-5.
    _check(got, np.asarray(want_p), np.asarray(want_index), rtol=1e-6 if interpret else 1e-5)


def test_kernel_inf_and_nan_rows(interpret):
    x = np.full((4, 10), NEG_INF, np.float32)
    x[0, [2, 5, 7]] = [1.0, 2.0, 1.0]  # 3 finite: picks 4..6 are -inf by index, p = 0
    x[2, 3] = np.inf  # +inf: p NaN there, 0 elsewhere (jax.nn.logsumexp)
    x[3, [1, 4]] = [5.0, np.nan]  # NaN row
    x = jnp.asarray(x)
    p, index = topk_probs(x, 6, impl="pallas", interpret=interpret)
    want_p, want_index = topk_probs_reference(x, 6)
    np.testing.assert_array_equal(index[:3], want_index[:3])
    assert index[0].tolist() == [5, 2, 7, 0, 1, 3] and index[1].tolist() == list(range(6))
    assert index[2].tolist() == [3, 0, 1, 2, 4, 5]
    np.testing.assert_allclose(p[:3], want_p[:3], rtol=1e-5)
    assert np.isnan(p[1]).all() and np.isnan(p[2, 0]) and (p[2, 1:] == 0).all()
    # NaN row: p NaN everywhere (every impl); pallas indices only promised in range.
    assert np.isnan(p[3]).all() and np.isnan(want_p[3]).all()
    assert ((index[3] >= 0) & (index[3] < 10)).all()


def test_kernel_shape_edge_cases(interpret):
    # Empty batch: no launch.
    p, index = topk_probs(jnp.zeros((0, 8)), 2, impl="pallas", interpret=interpret)
    assert p.shape == (0, 2) and index.shape == (0, 2) and index.dtype == jnp.int32
    # Wider than one tile: Pallas refuses (no silent switch); the kernel policy picks the
    # chunked Triton kernel on GPU (tests/tree/test_topk_probs_triton.py) or the reference.
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, MAX_COLS + 1)), jnp.float32)
    with pytest.raises(ValueError, match=r"impl='pallas' takes rows of at most MAX_COLS"):
        topk_probs(x, 4, impl="pallas", interpret=interpret)


def test_topk_probs_impls_and_default():
    """The engine's call (``topk_probs(logits, K, impl=ecfg.kernels.topk_probs)``), both impls."""
    x = jnp.asarray(_mixed_logits(np.random.default_rng(7), 6, 48), jnp.float32)
    want_p, want_index = _oracle(np.asarray(x), 4)
    for impl in ("xla", "pallas"):
        _check(topk_probs(x, 4, impl=impl), want_p, want_index, rtol=1e-5)
    # Default: today's XLA path, bit for bit. NOTE: against the reference compiled as one jit;
    # on the GPU the eager (op by op) logsumexp can differ by an ulp.
    ref = jax.jit(topk_probs_reference, static_argnums=1)(x, 4)
    for g, r in zip(topk_probs(x, 4), ref):
        np.testing.assert_array_equal(g, r)


# ---- validation ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape,dtype,topk,kwargs,match",
    [
        pytest.param((4, 8), jnp.float32, 0, {}, r"topk=0", id="topk0"),
        pytest.param((4, 8), jnp.float32, 9, {}, r"topk=9 .*V=8", id="topk_gt_v"),
        pytest.param((8,), jnp.float32, 2, {}, r"logits.shape=\(8,\)", id="1d"),
        pytest.param((2, 4, 8), jnp.float32, 2, {}, r"logits.shape", id="3d"),
        pytest.param((4, 8), jnp.int32, 2, {}, r"logits.dtype=int32", id="int"),
        pytest.param((4, 8), jnp.float32, 2, {"block_rows": 3}, r"block_rows=3", id="block_rows"),
        pytest.param((4, 8), jnp.float32, 2, {"num_warps": 0}, r"num_warps=0", id="num_warps"),
        pytest.param((4, 8), jnp.float32, 2, {"impl": "cuda"}, r"impl='cuda'", id="impl"),
        pytest.param((4, 8), jnp.float32, 2, {"block_cols": 48}, r"block_cols=48", id="block_cols"),
    ],
)
def test_validation(shape, dtype, topk, kwargs, match):
    with pytest.raises(ValueError, match=match):
        topk_probs(jnp.zeros(shape, dtype), topk, **kwargs)
