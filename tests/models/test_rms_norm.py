"""RMSNorm and the fused residual add + RMSNorm (``jspec.kernels.rms_norm``).

The reference against an f64 numpy oracle; the raw Triton kernel against the reference: on CPU
in Triton's interpreter on torch tensors (``triton_interpret``, imported first, sets
``TRITON_INTERPRET``; the file re-runs itself in a fresh subprocess if triton was already
imported compiled), with ``JSPEC_TEST_GPU=1`` compiled through ``jax_triton``. Outputs are
NaN-poisoned before the launches, so an unwritten element fails.

NOTE: Triton's interpreter rounds f32 -> bf16 by truncation (compiled Triton rounds to nearest),
so interpreted bf16 results are held to one bf16 ulp; compiled ones are compared with the
reference compiled on the same device.
"""

from __future__ import annotations

# isort: off
from triton_interpret import (  # first: sets TRITON_INTERPRET before triton is imported
    in_process,
    rerun_here,
    rerun_in_fresh_process,
)
# isort: on

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jspec.kernels import rms_norm as rn
from jspec.kernels import rms_norm_triton as rnt
from jspec.kernels.policy import resolve_kernel_policy

EPS = 1e-5
# (T, H): a decode row at the 8B width, a few rows at a non-power-of-two width (masked tail).
SHAPES = [(1, 4096), (5, 5120), (3, 100)]


def _inputs(num_rows, hidden, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_rows, hidden)).astype(np.float32) * 2
    residual = rng.standard_normal((num_rows, hidden)).astype(np.float32) * 3
    weight = (1 + 0.2 * rng.standard_normal(hidden)).astype(np.float32)
    return x, residual, weight


def _oracle(x, weight, residual=None):
    """f64: (out, residual')."""
    r = x.astype(np.float64) + (0 if residual is None else residual.astype(np.float64))
    out = r / np.sqrt(np.mean(r * r, axis=-1, keepdims=True) + EPS) * weight.astype(np.float64)
    return out, r


def _ulp_close(got, want, dtype):
    """Within one rounding of ``dtype`` (plus f32 noise)."""
    got = np.asarray(got, np.float32)
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(got, want, rtol=eps, atol=1e-6)


@pytest.mark.parametrize("num_rows,hidden", SHAPES)
def test_reference_vs_oracle(num_rows, hidden):
    x, residual, weight = _inputs(num_rows, hidden, hidden)
    want, want_res = _oracle(x, weight, residual)
    out, res = rn.fused_add_rmsnorm(
        jnp.asarray(x), jnp.asarray(residual), jnp.asarray(weight), EPS, impl="xla"
    )
    np.testing.assert_allclose(np.asarray(res), want_res, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-6, atol=1e-6)
    plain = rn.rms_norm(jnp.asarray(x), jnp.asarray(weight), EPS, impl="xla")
    np.testing.assert_allclose(np.asarray(plain), _oracle(x, weight)[0], rtol=2e-6, atol=1e-6)


def test_reference_rounds_the_stream_once_bf16():
    """bf16: residual' is the rounded sum; out is one rounding of the f32 normalize-and-scale."""
    x, residual, weight = (jnp.asarray(a, jnp.bfloat16) for a in _inputs(4, 256, 3))
    out, res = rn.fused_add_rmsnorm(x, residual, weight, EPS, impl="xla")
    want_res = (residual.astype(jnp.float32) + x.astype(jnp.float32)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(res, np.float32), np.asarray(want_res, np.float32))
    want, _ = _oracle(np.asarray(res, np.float32), np.asarray(weight, np.float32))
    _ulp_close(out, want, jnp.bfloat16)


def test_bad_input_raises_naming_the_field():
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="impl="):
        rn.rms_norm(x, jnp.ones(8), EPS, impl="pallas")
    with pytest.raises(ValueError, match=r"weight.shape=\(7,\)"):
        rn.rms_norm(x, jnp.ones(7), EPS)
    with pytest.raises(ValueError, match=r"x.shape=\(8,\)"):
        rn.rms_norm(x[0], jnp.ones(8), EPS)
    with pytest.raises(ValueError, match="residual"):
        rn.fused_add_rmsnorm(x, jnp.ones((2, 8), jnp.bfloat16), jnp.ones(8), EPS)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="needs a GPU"):
            rn.rms_norm(x, jnp.ones(8), EPS, impl="triton")


def test_auto_is_the_reference_off_gpu_and_for_f32():
    x, residual, weight = (jnp.asarray(a) for a in _inputs(2, 64, 5))
    text = jax.jit(lambda a, r, w: rn.fused_add_rmsnorm(a, r, w, EPS)).lower(x, residual, weight)
    assert "triton_kernel_call" not in text.as_text()  # f32 (any backend) takes the reference


def test_launch_meta():
    meta = rnt.launch_meta(5120, 1e-6, True)
    assert meta["BLOCK"] == 8192 and meta["H"] == 5120 and meta["num_warps"] == 8
    assert rnt.launch_meta(100, 1e-6, False)["num_warps"] == 1


def _launch_interpreted(x, weight, eps: float, residual=None):
    """The raw kernel on torch tensors (Triton's interpreter); outputs NaN-poisoned first.

    Returns torch ``(out, residual')`` (``residual'`` is None without ``residual``).
    """
    add = residual is not None
    out = torch.full_like(x, float("nan"))
    res_out = (
        torch.full_like(x, float("nan")) if add else torch.full((1,), float("nan"), dtype=x.dtype)
    )
    rnt.get_kernel()[(x.shape[0],)](
        x.contiguous(),
        residual.contiguous() if add else x,
        weight.contiguous(),
        out,
        res_out,
        **rnt.launch_meta(x.shape[1], eps, add),
    )
    return out, (res_out if add else None)


@rerun_here
def test_rerun_in_fresh_process():
    rerun_in_fresh_process(__file__, timeout=600)


@in_process
@pytest.mark.parametrize("add", [True, False], ids=["add", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_rows,hidden", SHAPES)
def test_interpreted_kernel_vs_oracle(num_rows, hidden, dtype, add):
    x, residual, weight = _inputs(num_rows, hidden, hidden + add)
    t = lambda a: torch.from_numpy(a).to(dtype)  # noqa: E731
    out, res = _launch_interpreted(t(x), t(weight), EPS, residual=t(residual) if add else None)
    # The oracle of what the kernel read: the inputs rounded to dtype; residual' as it stored it.
    xr, rr, wr = (t(a).to(torch.float32).numpy() for a in (x, residual, weight))
    if add:
        _, want_res = _oracle(xr, wr, rr)
        _ulp_close(
            res.to(torch.float32),
            want_res,
            jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32,
        )
        want, _ = _oracle(res.to(torch.float32).numpy(), wr)
    else:
        assert res is None
        want, _ = _oracle(xr, wr)
    tol = jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32
    _ulp_close(out.to(torch.float32), want, tol)


@in_process
def test_interpreted_nan_row_stays_in_its_row():
    x, residual, weight = _inputs(3, 128, 9)
    x[1, 7] = np.nan
    out, res = _launch_interpreted(
        torch.from_numpy(x), torch.from_numpy(weight), EPS, residual=torch.from_numpy(residual)
    )
    out, res = out.numpy(), res.numpy()
    assert np.isnan(out[1]).all() and np.isnan(res[1, 7]) and np.isfinite(res[1, :7]).all()
    assert np.isfinite(out[[0, 2]]).all() and np.isfinite(res[[0, 2]]).all()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"]
)
@pytest.mark.parametrize("num_rows,hidden", SHAPES + [(512, 4096)])
def test_jax_triton_vs_reference_on_gpu(num_rows, hidden, dtype):
    x, residual, weight = (jnp.asarray(a, dtype) for a in _inputs(num_rows, hidden, hidden))
    fused = jax.jit(lambda a, r, w: rn.fused_add_rmsnorm(a, r, w, EPS, impl="triton"))
    ref = jax.jit(lambda a, r, w: rn.fused_add_rmsnorm(a, r, w, EPS, impl="xla"))
    (out, res), (want, want_res) = fused(x, residual, weight), ref(x, residual, weight)
    np.testing.assert_array_equal(np.asarray(res, np.float32), np.asarray(want_res, np.float32))
    _ulp_close(out, np.asarray(want, np.float32), dtype)
    plain = jax.jit(lambda a, w: rn.rms_norm(a, w, EPS, impl="triton"))(x, weight)
    _ulp_close(plain, np.asarray(rn.rms_norm(x, weight, EPS, impl="xla"), np.float32), dtype)


@pytest.mark.gpu
def test_the_policy_takes_the_kernel_only_when_named_on_gpu():
    """On the GPU the kernel policy's "auto" is XLA's fusion (a launch the command buffers
    capture); a named "triton" lowers to the Triton launch (the op itself never guesses)."""
    assert resolve_kernel_policy(hidden_size=4096).rms_norm == "xla"
    named = resolve_kernel_policy(hidden_size=4096, rms_norm_impl="triton").rms_norm
    x, residual, weight = (jnp.asarray(a, jnp.bfloat16) for a in _inputs(1, 4096, 1))

    def lowered(**kw):
        f = jax.jit(lambda a, r, w: rn.fused_add_rmsnorm(a, r, w, EPS, **kw))
        return f.lower(x, residual, weight).as_text()

    assert "triton_kernel_call" in lowered(impl=named)
    assert "triton_kernel_call" not in lowered()
