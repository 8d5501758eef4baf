"""RMSNorm with an optional fused residual add: pure-jnp reference and a raw Triton kernel.

The same function as sglang's ``rmsnorm`` / ``fused_add_rmsnorm`` (sgl_kernel), functional::

    residual' = residual + x                       (in the stream's dtype; skipped without one)
    out       = (r * rsqrt(mean(r^2) + eps) * weight)   with r = f32(residual'), cast back

jspec's precision (as :func:`jspec.models.layers.rms_norm` always had): the normalize and the
weight product in f32, one rounding to the stream's dtype at the end (HF casts before the weight
product; the two differ by at most one rounding of the product).

Why a kernel (measured on the H200, bench/RESULTS.md): at one decode row XLA emits a residual
add, an f32 sum-of-squares reduction and a normalize as three fusions of 1.1-1.3 us each, twice
per layer (64 x 3 launches per 8B step); the Triton kernel does the three in one launch, one
program per row.

``impl``: ``"xla"`` the reference; ``"triton"`` the kernel through ``jax_triton``
(:mod:`jspec.kernels.rms_norm_triton`, imported on first use; GPU only: on CPU the same source
runs in Triton's interpreter on torch tensors, tests/models/test_rms_norm.py). The engine's
kernel policy (:func:`jspec.kernels.policy.resolve_kernel_policy`) takes the kernel only when
named (``rms_norm_impl="triton"``): its "auto" is XLA's fusion, which the engine's command
buffers capture (the policy module says what that was measured to save); the op itself never
guesses.

NOTE (shared/PLATFORM.md): no checks inside the kernel; a NaN / Inf row gives NaN / Inf outputs
in that row only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.kernels import _common

IMPLS = ("xla", "triton")
MAX_HIDDEN = 32768  # one program holds a whole row: 64 f32 per lane at 16 warps


def _validate(x: jax.Array, residual: jax.Array | None, weight: jax.Array, impl: str) -> None:
    _common.resolve_impl(impl, IMPLS, "rms_norm")  # an unknown impl; "triton" off a GPU
    if x.ndim != 2:
        raise ValueError(f"x.shape={tuple(x.shape)} must be [T, H]")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight.shape={tuple(weight.shape)} must be ({x.shape[1]},)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual {residual.dtype}{list(residual.shape)} must match x {x.dtype}{list(x.shape)}"
        )


def rms_norm_reference(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``dtype[T, H]``: ``x * rsqrt(mean(x^2) + eps) * weight`` in f32, cast to ``x.dtype``."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def _use_triton(x: jax.Array, impl: str) -> bool:
    """The kernel for ``impl="triton"`` (an empty ``x`` launches nothing: same empty result)."""
    if impl == "triton" and x.shape[1] > MAX_HIDDEN:
        raise ValueError(
            f"impl='triton' takes rows of at most MAX_HIDDEN={MAX_HIDDEN} columns; "
            f"x.shape={tuple(x.shape)}: use impl='xla'"
        )
    return impl == "triton" and x.shape[0] > 0


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, impl: str = "xla") -> jax.Array:
    """sglang ``rmsnorm``: ``x: dtype[T, H]``, ``weight: [H]`` -> ``dtype[T, H]``.

    Raises:
      ValueError: an unknown ``impl`` (or ``"triton"`` off a GPU or for rows wider than
        :data:`MAX_HIDDEN`), ``x`` not 2-D, ``weight`` not ``[H]``.
    """
    _validate(x, None, weight, impl)
    if not _use_triton(x, impl):
        return rms_norm_reference(x, weight, eps)
    from jspec.kernels.rms_norm_triton import rms_norm_triton

    out, _ = rms_norm_triton(x, None, weight, eps)
    return out


def fused_add_rmsnorm(
    x: jax.Array, residual: jax.Array, weight: jax.Array, eps: float, *, impl: str = "xla"
) -> tuple[jax.Array, jax.Array]:
    """sglang ``fused_add_rmsnorm``, functional: ``residual' = residual + x`` (``dtype[T, H]``,
    rounded to ``dtype``), ``out = rms_norm(residual', weight)``.

    Returns:
      ``(out dtype[T, H], residual' dtype[T, H])`` (sglang's ``RMSNorm.forward(x, residual)``
      order).

    Raises:
      ValueError: as :func:`rms_norm`, or ``residual`` not of ``x``'s shape and dtype.
    """
    _validate(x, residual, weight, impl)
    if not _use_triton(x, impl):
        new_residual = residual + x
        return rms_norm_reference(new_residual, weight, eps), new_residual
    from jspec.kernels.rms_norm_triton import rms_norm_triton

    return rms_norm_triton(x, residual, weight, eps)
