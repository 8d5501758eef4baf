"""The raw Triton kernel behind :func:`jspec.kernels.rms_norm.fused_add_rmsnorm` (GPU).

One program per row holds the whole row (``BLOCK`` = the next power of two of ``H``, masked):
loads ``x`` (and the residual), stores ``residual' = residual + x`` rounded to the stream's
dtype, reduces ``mean(r^2)`` in f32, stores ``r * rsqrt(mean + eps) * weight`` rounded once.
Validation and the choice of impl: :mod:`jspec.kernels.rms_norm`.

``jax_triton`` (0.3.1) is imported lazily; the kernel is wrapped with ``triton.jit`` on first use
(:func:`get_kernel`), so it runs in Triton's interpreter when ``TRITON_INTERPRET=1`` is set
before triton is imported (CPU tests on torch tensors: tests/models/test_rms_norm.py).
"""

from __future__ import annotations

from typing import Any

import jax
import triton.language as tl

from jspec.config import next_power_of_2
from jspec.kernels import _common

# One warp per 1024 columns (32 per lane), 1..16 warps. Measured on the H200 (2026-11-24, one
# bf16 row of 4096, fused add): 1 / 2 / 4 / 8 / 16 warps 1.94 / 1.58 / 1.35 / 1.41 / 1.48 us;
# XLA's add + reduction + normalize 2.26 us.
COLS_PER_WARP = 1024


def _rms_norm_kernel(
    x_ptr,  # dtype[T, H]
    res_ptr,  # dtype[T, H] (ADD) or unused
    w_ptr,  # [H]
    out_ptr,  # dtype[T, H] (out)
    res_out_ptr,  # dtype[T, H] (out, ADD) or unused [1]
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    EPS: tl.constexpr,
    ADD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    # Every load first (the weight is cold in L2 at a decode step): one memory round trip.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        r = tl.load(res_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        stream = (r + x).to(res_out_ptr.dtype.element_ty)  # the residual stream keeps its dtype
        tl.store(res_out_ptr + row * H + cols, stream, mask=mask)
        x = stream.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / H
    y = x * tl.math.rsqrt(mean_sq + EPS)
    tl.store(out_ptr + row * H + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def get_kernel() -> Any:
    """``triton.jit`` of the kernel for the current mode (:func:`_common.triton_jit`)."""
    return _common.triton_jit(_rms_norm_kernel)


def launch_meta(hidden: int, eps: float, add: bool) -> dict[str, Any]:
    """Static constexprs and launch options of one call (one program per row)."""
    block = next_power_of_2(hidden)
    return {
        "H": hidden,
        "BLOCK": block,
        "EPS": float(eps),
        "ADD": bool(add),
        "num_warps": min(16, max(1, block // COLS_PER_WARP)),
        "num_stages": 1,
    }


def rms_norm_triton(
    x: jax.Array, residual: jax.Array | None, weight: jax.Array, eps: float
) -> tuple[jax.Array, jax.Array]:
    """``(out, residual')`` through ``jax_triton`` (``residual`` None: ``residual'`` is ``x``).
    Inputs as validated by :mod:`jspec.kernels.rms_norm` (``T >= 1``)."""
    add = residual is not None
    res_out = jax.ShapeDtypeStruct(x.shape if add else (1,), x.dtype)
    out, new_residual = _common.jax_triton_call(
        x,
        residual if add else x,
        weight,
        kernel=get_kernel(),
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), res_out),
        grid=(x.shape[0],),
        name="jspec_fused_add_rmsnorm" if add else "jspec_rmsnorm",
        **launch_meta(x.shape[1], eps, add),
    )
    return out, (new_residual if add else x)
