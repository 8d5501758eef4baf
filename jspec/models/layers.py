"""Building blocks shared by the Llama target and the EAGLE heads (pure functions of arrays).

Attention is injected: a model calls ``attn_fn(layer, pool, q, k, v) -> (pool, out)``, which
writes this layer's K/V at the slots jspec chose and attends through jspec's metadata
(:data:`jspec.engine.protocol.AttnFn`). Model code never sees a slot id or a page id.

Matmul precision follows the weights' dtype (the engine's rule,
:func:`jspec.engine.protocol.matmul_precision`): f32 models use ``Precision.HIGHEST`` (the GPU's
default f32 matmul is TF32, ~1e-3 error, which breaks the lossless tests); bf16 / f16 models use
the default precision with a bf16 / f16 result, upcast afterwards where f32 is needed (logits).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec.engine.protocol import AttnFn, matmul_precision
from jspec.engine.protocol import model_scope as _protocol_scope
from jspec.kernels.rms_norm import IMPLS as RMS_NORM_IMPLS
from jspec.kernels.rms_norm import fused_add_rmsnorm
from jspec.kernels.rms_norm import rms_norm as _rms_norm
from jspec.models.hf_config import RopeScaling


def model_scope(part: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: run the function under :func:`jspec.engine.protocol.model_scope` (``part``:
    "target" / "draft"; how bench/e2e.py splits a fused step's device time)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with _protocol_scope(part):
                return fn(*args, **kwargs)

        return wrapped

    return decorate


# XLA's GPU compiler rewrites a dot with a one-row operand (a vector once XLA drops the unit
# dimension) whose two operands hold fewer than 10M elements together into a multiply and a
# reduce (GpuAlgebraicSimplifierVisitor::ShouldStrengthReduceDotToReduce with
# IsMatrixMultiplicationTooSmallForRewriting's threshold 10 000 000): the multiply writes the
# whole [K, N] product to memory and the reduce reads it back, in the operands' dtype. A
# tensor-parallel shard of the 8B's o_proj (2048 x 4096) at batch 1 took 11.5 + 9.7 us that
# way, 64 launches a greedy step; a GEMV reads the same 16 MiB once. Below GEMV_PAD_MIN_ELEMENTS
# the product is too small for the detour to matter and the dot is left as it is.
STRENGTH_REDUCE_MAX_ELEMENTS = 10_000_000
GEMV_PAD_MIN_ELEMENTS = 1 << 20


def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` in ``a``'s dtype, at the precision :func:`jspec.engine.protocol.matmul_precision` gives.

    ``a: dtype[M, K]``, ``b: dtype[K, N]`` -> dtype[M, N]. A one-row product whose operands
    hold between :data:`GEMV_PAD_MIN_ELEMENTS` and :data:`STRENGTH_REDUCE_MAX_ELEMENTS`
    elements runs as a two-row one (a zero row appended, its result row dropped), so that XLA
    keeps it a GEMM instead of writing the [K, N] product (the note above); row 0 is the same
    product either way."""
    prec = matmul_precision(a.dtype)
    b = b.astype(a.dtype)
    if a.ndim == 2 and a.shape[0] == 1:
        if GEMV_PAD_MIN_ELEMENTS <= a.size + b.size < STRENGTH_REDUCE_MAX_ELEMENTS:
            return jnp.matmul(jnp.pad(a, ((0, 1), (0, 0))), b, precision=prec)[:1]
    return jnp.matmul(a, b, precision=prec)


def lm_logits(hidden: jax.Array, lm_head: jax.Array, *, transposed: bool = False) -> jax.Array:
    """f32[T, V] logits of ``hidden: dtype[T, H]``.

    Args:
      lm_head: dtype[H, V], or dtype[V, H] with ``transposed=True`` (a tied embedding).
    """
    dims = (((1,), (1 if transposed else 0,)), ((), ()))
    prec = matmul_precision(hidden.dtype)
    if jnp.dtype(hidden.dtype) == jnp.float32:
        return jax.lax.dot_general(
            hidden,
            lm_head.astype(hidden.dtype),
            dims,
            precision=prec,
            preferred_element_type=jnp.float32,
        )
    return jax.lax.dot_general(hidden, lm_head.astype(hidden.dtype), dims, precision=prec).astype(
        jnp.float32
    )


def tp_sum(x: jax.Array, tp_axis: str | None) -> jax.Array:
    """Sum the row-parallel partial products over the tensor-parallel mesh axis (if any)."""
    return x if tp_axis is None else jax.lax.psum(x, tp_axis)


def check_tensor_parallel(
    tensor_parallel: int, *, num_kv_heads: int, intermediate_size: int
) -> None:
    """ValueError unless ``tensor_parallel`` splits the KV heads (hence the query heads) and the
    MLP width into equal contiguous blocks (the Megatron layout of ``param_specs``)."""
    if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel={tensor_parallel!r} must be an int >= 1")
    for name, value in (("num_kv_heads", num_kv_heads), ("intermediate_size", intermediate_size)):
        if value % tensor_parallel:
            raise ValueError(f"tensor_parallel={tensor_parallel} must divide {name}={value}")


def check_rms_norm_impl(impl: str) -> str:
    """``impl`` if it names an RMSNorm kernel (``ValueError`` naming ``rms_norm_impl``)."""
    if impl not in RMS_NORM_IMPLS:
        raise ValueError(f"rms_norm_impl={impl!r} must be one of {RMS_NORM_IMPLS}")
    return impl


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, impl: str = "xla") -> jax.Array:
    """``x * rsqrt(mean(x^2) + eps) * weight`` in f32, cast back to ``x.dtype`` (``x: [..., H]``).

    ``impl``: ``"xla"`` (the jnp reference) or ``"triton"`` (one launch instead of XLA's
    reduction + normalize; GPU only: :mod:`jspec.kernels.rms_norm`). A model passes its
    ``rms_norm_impl`` (the engine's ``KernelPolicy.rms_norm``)."""
    flat = x.reshape(-1, x.shape[-1])
    return _rms_norm(flat, weight, eps, impl=impl).reshape(x.shape)


def add_rms_norm(
    residual: jax.Array,
    delta: jax.Array | None,
    weight: jax.Array,
    eps: float,
    *,
    impl: str = "xla",
) -> tuple[jax.Array, jax.Array]:
    """The pre-norm step of a residual stream: ``residual' = residual + delta`` (in the stream's
    dtype; ``delta`` None: the stream as it is), ``(rms_norm(residual'), residual')``.

    ``residual, delta: dtype[T, H]``. ``impl="triton"``: one launch on the GPU
    (:func:`jspec.kernels.rms_norm.fused_add_rmsnorm`); ``"xla"``: the jnp reference.
    """
    if delta is None:
        return rms_norm(residual, weight, eps, impl=impl), residual
    return fused_add_rmsnorm(delta.astype(residual.dtype), residual, weight, eps, impl=impl)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """f32[head_dim // 2] RoPE inverse frequencies (a static constant of the model).

    ``llama3`` scaling rescales them once: wavelength ``2*pi/f`` above
    ``original / low_freq_factor`` -> ``f / factor``; below ``original / high_freq_factor`` ->
    unchanged; in between, ``(1 - s) * f / factor + s * f`` with
    ``s = (original / wavelength - low) / (high - low)``.
    """
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    inv_freq = inv_freq.astype(np.float64)
    if scaling is not None:
        old = scaling.original_max_position_embeddings
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / scaling.factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding, HF ``rotate_half`` convention (halves, not interleaved pairs).

    Args:
      x: dtype[T, heads, D].
      positions: i32[T] token positions.
      inv_freq: f32[D // 2] from :func:`rope_inv_freq`.
    """
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    emb = jnp.concatenate([angles, angles], -1)  # [T, D]
    cos, sin = jnp.cos(emb)[:, None, :], jnp.sin(emb)[:, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], -1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def attention_block(
    wqkv: jax.Array,
    wo: jax.Array,
    h: jax.Array,
    layer: int,
    pool: Any,
    positions: jax.Array,
    attn_fn: AttnFn,
    *,
    inv_freq: np.ndarray,
    tp_axis: str | None = None,
) -> tuple[Any, jax.Array]:
    """GQA self-attention with RoPE over flat tokens, through the injected ``attn_fn``.

    Args:
      wqkv: dtype[Hin, Hkv, G + 2, D] the fused projections (``LayerParams.wqkv``: per KV head
        its G query heads, then K, then V; this shard's KV heads under tensor parallelism);
        wo: dtype[Hkv * G * D, H]. Head counts and D are read from the weights.
      h: dtype[T, Hin] the (normed) input; positions: i32[T]; layer: the pool layer.

    Returns:
      (pool, out dtype[T, H]): ``wo`` applied and summed over ``tp_axis``.
    """
    num_tokens = h.shape[0]
    hin, hkv, width, dim = wqkv.shape
    qkv = matmul(h, wqkv.reshape(hin, -1)).reshape(num_tokens, hkv, width, dim)
    q = apply_rope(qkv[:, :, :-2].reshape(num_tokens, -1, dim), positions, inv_freq)
    k = apply_rope(qkv[:, :, -2], positions, inv_freq)
    pool, attn = attn_fn(layer, pool, q, k, qkv[:, :, -1])
    return pool, tp_sum(matmul(attn.astype(h.dtype).reshape(num_tokens, -1), wo), tp_axis)


def mlp_block(
    w_gate_up: jax.Array, w_down: jax.Array, h: jax.Array, tp_axis: str | None = None
) -> jax.Array:
    """SwiGLU MLP ``down(silu(gate(h)) * up(h))`` over ``h: dtype[T, H]``, summed over tp.

    ``w_gate_up: dtype[H, 2, I]`` (gate, up; one matmul), ``w_down: dtype[I, H]``."""
    hid, _, inter = w_gate_up.shape
    gate_up = matmul(h, w_gate_up.reshape(hid, 2 * inter)).reshape(-1, 2, inter)
    return tp_sum(matmul(jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], w_down), tp_axis)
