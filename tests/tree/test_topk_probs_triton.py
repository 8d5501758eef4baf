"""The chunked raw Triton ``topk_probs`` kernel (``jspec.kernels.topk_probs_triton``).

On CPU the kernel runs in Triton's interpreter on torch tensors (``TRITON_INTERPRET=1`` must be
set before triton is first imported: ``triton_interpret``, imported first, sets it; if triton
was already imported compiled by an earlier module of the same pytest process, the file re-runs
itself in a fresh subprocess). With ``JSPEC_TEST_GPU=1`` it runs compiled through ``jax_triton`` as
``topk_probs(..., impl="triton")`` (and ``"pallas"`` on wide rows).

Oracle: test_topk_probs's stable-argsort loop with an f64 softmax; outputs are poisoned (NaN /
-1) before the launches, so an unwritten entry fails.
"""

from __future__ import annotations

# isort: off
from triton_interpret import (  # first: sets TRITON_INTERPRET before triton is imported
    in_process,
    rerun_here,
    rerun_in_fresh_process,
)
# isort: on

import jax.numpy as jnp
import numpy as np
import pytest
from test_topk_probs import _mixed_logits, _oracle

torch = pytest.importorskip("torch")

from jspec.kernels import topk_probs_triton as tpt
from jspec.kernels.policy import resolve_kernel_policy
from jspec.kernels.topk_probs import topk_probs

# (R, V, K, tuning): one chunk (single launch); several chunks with a short tail chunk; the
# EAGLE-3 hot vocabulary; chunks narrower than K (picks run past a chunk's columns); a tail
# chunk with fewer real columns than K.
CASES = [
    pytest.param(7, 100, 4, {}, id="one-chunk-v100"),
    pytest.param(10, 5000, 8, {}, id="chunks-v5000"),
    pytest.param(5, 32000, 4, {}, id="v32000"),
    pytest.param(6, 70, 37, {"block_cols": 16}, id="k37-chunks16"),
    pytest.param(5, 2050, 4, {"block_cols": 1024}, id="tail2-k4"),
]


def _check(p, index, want_p, want_index, rtol):
    np.testing.assert_array_equal(np.asarray(index), want_index)
    np.testing.assert_allclose(np.asarray(p), want_p, rtol=rtol, atol=0)  # NaN == NaN here


def _launch_interpreted(logits, topk: int, **tuning):
    """The raw kernel on a torch float[R, V] tensor (Triton's interpreter; tuning as
    ``tpt.launch_plan``): torch ``(topk_p f32[R, K], topk_index i32[R, K])``, with outputs and
    partials NaN / -1 poisoned before the launches."""
    num_rows = logits.shape[0]
    meta, merge, opts = tpt.launch_plan(logits.shape[1], topk, **tuning)
    k, bk, c = meta["K"], meta["BLOCK_K"], meta["C"]

    def full(shape, value, dtype=torch.float32):
        return torch.full(shape, value, dtype=dtype, device=logits.device)

    p, index = full((num_rows, k), float("nan")), full((num_rows, k), -1, torch.int32)
    unused_i, unused_f = full((1,), -1, torch.int32), full((1,), float("nan"))
    unused = (unused_i, unused_f, unused_f)
    kernel = tpt.get_kernel()
    if not merge:
        kernel[(num_rows, 1)](
            logits.contiguous(), *unused, p, index, unused_f, unused_f, **meta, **opts
        )
        return p, index
    parts = (
        full((num_rows, c, bk), float("nan")),
        full((num_rows, c, bk), -1, torch.int32),
        full((num_rows, c), float("nan")),
        full((num_rows, c), float("nan")),
    )
    kernel[(num_rows, c)](logits.contiguous(), *unused, *parts, **meta, **opts)
    kernel[(num_rows, 1)](*parts, p, index, unused_f, unused_f, **merge, num_warps=1, num_stages=1)
    return p, index


@rerun_here
def test_rerun_in_fresh_process():
    rerun_in_fresh_process(__file__, timeout=900)


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_rows,vocab,topk,tuning", CASES)
def test_interpreted_kernel_vs_oracle(num_rows, vocab, topk, tuning, dtype):
    x = _mixed_logits(np.random.default_rng(vocab + topk), num_rows, vocab)
    x = torch.from_numpy(x).to(dtype)
    want_p, want_index = _oracle(x.to(torch.float32).numpy(), topk)
    p, index = _launch_interpreted(x, topk, **tuning)
    _check(p, index, want_p, want_index, rtol=2e-6)


@in_process
def test_interpreted_inf_and_nan_rows():
    x = np.full((4, 3000), -np.inf, np.float32)
    x[0, [2, 1500, 2999]] = [1.0, 2.0, 1.0]  # 3 finite, in 3 chunks; picks 4..6 are -inf
    x[2, 2500] = np.inf  # +inf: p NaN there, 0 elsewhere (jax.nn.logsumexp)
    x[3, [1, 2048]] = [5.0, np.nan]  # NaN row: p NaN, indices in range
    p, index = _launch_interpreted(torch.from_numpy(x), 6, block_cols=1024)
    p, index = p.numpy(), index.numpy()
    assert index[0].tolist() == [1500, 2, 2999, 0, 1, 3] and index[1].tolist() == list(range(6))
    assert index[2].tolist() == [2500, 0, 1, 2, 3, 4]
    e = np.exp(np.array([2.0, 1.0, 1.0]) - 2.0)
    np.testing.assert_allclose(p[0], list(e / e.sum()) + [0, 0, 0], rtol=1e-6)
    assert np.isnan(p[1]).all() and np.isnan(p[2, 0]) and (p[2, 1:] == 0).all()
    assert np.isnan(p[3]).all() and ((index[3] >= 0) & (index[3] < 3000)).all()


def test_launch_plan():
    meta, merge, opts = tpt.launch_plan(32000, 4)
    assert meta["C"] * meta["BLOCK"] >= 32000 and meta["BLOCK"] == tpt.DEFAULT_BLOCK_COLS
    assert merge["MODE"] == tpt.MERGE.value and merge["BLOCK"] >= meta["C"]
    assert opts["num_warps"] == meta["BLOCK"] // tpt.COLS_PER_WARP
    meta, merge, _ = tpt.launch_plan(100, 8)  # one chunk: one launch
    assert meta["C"] == 1 and meta["MODE"] == tpt.SINGLE.value and merge == {}
    meta, _, _ = tpt.launch_plan(5000, 37, block_cols=16)
    assert meta["C"] == 313 and meta["BLOCK_K"] == 64


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_rows,vocab,topk,tuning", CASES)
def test_jax_triton_vs_oracle_on_gpu(num_rows, vocab, topk, tuning, dtype):
    x = jnp.asarray(_mixed_logits(np.random.default_rng(vocab + topk), num_rows, vocab), dtype)
    want_p, want_index = _oracle(np.asarray(x.astype(jnp.float32)), topk)
    p, index = topk_probs(x, topk, impl="triton", **tuning)
    assert p.dtype == jnp.float32 and index.dtype == jnp.int32
    _check(p, index, want_p, want_index, rtol=1e-5)


@pytest.mark.gpu
def test_the_policy_takes_triton_for_wide_rows_on_gpu():
    """The engine's call on the EAGLE-3 hot vocabulary (R = bs x topk branches): on the GPU
    the kernel policy picks Triton for rows wider than a Pallas tile, and ``impl="pallas"``
    itself refuses them (it never swaps kernels behind the caller's back)."""
    policy = resolve_kernel_policy(vocab_size=32000)
    assert policy.bookkeeping == "pallas" and policy.topk_probs == "triton"
    rng = np.random.default_rng(11)
    for num_rows in (1, 4, 256):
        x = jnp.asarray(rng.standard_normal((num_rows, 32000)) * 4, jnp.float32)
        want_p, want_index = _oracle(np.asarray(x), 4)
        _check(*topk_probs(x, 4, impl=policy.topk_probs), want_p, want_index, rtol=1e-5)
        with pytest.raises(ValueError, match="impl='pallas' takes rows of at most"):
            topk_probs(x, 4, impl="pallas")
