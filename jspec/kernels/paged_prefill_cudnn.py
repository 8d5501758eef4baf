"""Causal prefill chunks through cuDNN's flash attention (GPU, bf16 / f16).

:func:`jspec.kernels.paged_attention.paged_attention` with ``impl="cudnn"`` sends its causal
passes without a tail here (every other pass goes to the Triton kernels). cuDNN's fused
attention (the kernel behind ``jax.nn.dot_product_attention(implementation="cudnn")``) reads
dense ``[B, T, H, D]`` operands and aligns its causal mask top-left (call query ``i`` sees call
key ``j`` iff ``j <= i``), while a chunk's query ``i`` sits at row position ``start + i``
(``start = kv_lens - q_lens``, the prompt prefilled by earlier chunks). So one pass is two cuDNN
calls over K / V gathered from the pool's pages, merged by log-sum-exp::

    diagonal  keys at positions start + j (j < Qp): causal; query and key lengths q_lens
    prefix    keys at positions [0, start) (static width W): no causal mask; key length start
    out = the two merged by cuDNN's f32 softmax statistics (a row with start = 0: the diagonal)

With ``max_prefix_len`` (a static bound on every row's ``start``, from a caller that knows its
rows: the engine's scheduler for calls of first chunks), the prefix is gathered only that wide,
and at 0 its call and the merge are skipped; a row whose ``start`` is past the bound gets NaN
outputs, never a wrong number.

The gathered operands hold only positions a query of the row sees (the rest are zeros read
from slot 0), so a NaN elsewhere in the pool never reaches an output (as in the Triton kernel).
``W`` is the page table's width ``C * P``, or ``max_prefix_len`` where smaller (``max_kv_len``,
the Triton plan's hint, is not a bound and is not read here). The gathers cost ``B x (Qp + W)``
K/V rows written and read once per pass; the attention itself runs at cuDNN's rate
(bench/RESULTS.md).

NOTE: jax 0.11's public ``jax.nn.dot_product_attention(return_residual=True)`` casts the
log-sum-exp to the output dtype (bf16: ~1% error in a merge weight), so this calls the function
underneath it, ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``, whose
statistics are f32. :func:`unavailable` checks, once, that this jax has it with the keywords
used here; the kernel policy asks it before choosing cuDNN (a jax without it: ``"auto"`` takes
Triton, ``attention_impl="cudnn"`` raises ``ValueError`` naming the field).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

import jax
import jax.numpy as jnp

from jspec.kernels.merge_state import merge_states

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
# The engine's attention backend (``jspec.engine.attention.PagedAttentionBackend("cudnn")``)
# sends causal chunks of at least this many queries here, shorter ones to the Triton kernel.
# Measured on the H200 (2026-11-27, bench/RESULTS.md, 8B heads, an engine whose page tables are
# 33k keys wide): time to first token, Triton -> cuDNN, 1 x 2k 47.0 -> 48.8 ms (the prefix
# gather of the table's whole width costs more than cuDNN saves on 2k queries), 1 x 8k 210.5 ->
# 206.7, 1 x 32k (four 8k chunks) 1321 -> 1238.
CUDNN_MIN_QUERIES = 4096
# Head dims cuDNN's flash attention takes on every GPU jax supports it on (multiples of 8 up to
# 128; Hopper also takes up to 256).
MAX_HEAD_DIM = 128


def takes_dtype(dtype: Any) -> bool:
    """Whether cuDNN's flash attention takes a pool (and model) of ``dtype``: bf16 / f16."""
    return jnp.dtype(dtype) in map(jnp.dtype, SUPPORTED_DTYPES)


def supports(dtype: Any, head_dim: int) -> bool:
    """Whether :func:`paged_prefill_cudnn` takes a pool of ``dtype`` and ``head_dim``."""
    return takes_dtype(dtype) and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM


# What this module calls of jax's cuDNN module: a jax whose function lacks one of these
# keywords (or whose MaskType lacks these masks) is refused by :func:`unavailable`.
_MODULE = "jax._src.cudnn.fused_attention_stablehlo"
_KEYWORDS = ("q_seqlen", "kv_seqlen", "scale", "mask_type", "return_residual")
_MASKS = ("PADDING", "PADDING_CAUSAL")


@functools.cache
def unavailable() -> str | None:
    """Why this jax cannot run :func:`paged_prefill_cudnn` (None: it can).

    The module calls a private jax function (module doc); a jax that moved or changed it is
    caught here, once, before anything is traced: the kernel policy's ``"auto"`` then picks
    Triton and an explicit ``attention_impl="cudnn"`` fails with this reason
    (:func:`jspec.kernels.policy.resolve_kernel_policy`). Whether cuDNN itself is installed is
    the GPU backend's to say (jax's GPU wheels bring it).
    """
    try:
        fa = importlib.import_module(_MODULE)
    except ImportError as err:
        return f"jax {jax.__version__} has no {_MODULE} ({err})"
    fn = getattr(fa, "dot_product_attention", None)
    masks = getattr(fa, "MaskType", None)
    if fn is None or masks is None:
        return f"jax {jax.__version__}'s cuDNN module has no dot_product_attention / MaskType"
    params = inspect.signature(fn).parameters
    missing = [k for k in _KEYWORDS if k not in params]
    missing += [f"MaskType.{m}" for m in _MASKS if not hasattr(masks, m)]
    if missing:
        return f"jax {jax.__version__}'s cuDNN dot_product_attention lacks {', '.join(missing)}"
    return None


def _cudnn_attention() -> tuple[Any, Any]:
    """``(dot_product_attention, MaskType)`` of jax's cuDNN module (``ValueError`` if
    :func:`unavailable`)."""
    reason = unavailable()
    if reason is not None:
        raise ValueError(f"impl='cudnn': {reason}")
    fa = importlib.import_module(_MODULE)
    return fa.dot_product_attention, fa.MaskType


def _gather(
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: Any,
    page_table: jax.Array,
    pos: jax.Array,
    ok: jax.Array,
    page_size: int,
) -> tuple[jax.Array, jax.Array]:
    """K and V of ``layer`` at row positions ``pos: i32[B, T]``, zeros where ``~ok``:
    ``dtype[B, T, Hkv, D]`` each. Page-table columns are read only where ``ok``."""
    col = jnp.where(ok, pos // page_size, 0)
    page = jnp.take_along_axis(page_table, col, axis=1)
    slot = jnp.where(ok, page * page_size + pos % page_size, 0)
    keep = ok[:, :, None, None]
    # NOTE: pool[layer, slot], one gather over the 4-D pool (no copy of the layer).
    zero = jnp.zeros((), k_pool.dtype)
    return jnp.where(keep, k_pool[layer, slot], zero), jnp.where(keep, v_pool[layer, slot], zero)


def paged_prefill_cudnn(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: Any,
    page_table: jax.Array,
    kv_lens: jax.Array,
    q_lens: jax.Array | None = None,
    *,
    page_size: int,
    max_prefix_len: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """A causal pass of :func:`jspec.kernels.paged_attention.paged_attention` (no tail) through
    cuDNN (GPU only; validated by ``paged_attention``).

    Args:
      q: float[B, Qp, Hq, D] queries (cast to the pool dtype, which must be bf16 or f16).
      k_pool, v_pool: dtype[L, S, Hkv, D].
      layer: an int or a traced i32 scalar.
      page_table: i32[B, C] page ids; kv_lens: i32[B]; q_lens: i32[B] (None: ``Qp``).
      page_size: static ``P``.
      max_prefix_len: static bound on ``kv_lens - q_lens`` (None: the table's width): the
        prefix is gathered this wide, skipped at 0; a row past it: NaN outputs.

    Returns:
      ``(out f32[B, Qp, Hq, D], lse f32[B, Qp, Hq])``; a query ``i >= q_lens``: 0, -inf.
    """
    if not supports(k_pool.dtype, q.shape[-1]):
        raise ValueError(
            f"impl='cudnn' takes a bf16 / f16 pool and a head dim that is a multiple of 8 up to "
            f"{MAX_HEAD_DIM}, not {k_pool.dtype} x {q.shape[-1]}"
        )
    attention, mask_type = _cudnn_attention()
    bsz, qp, hq, dim = q.shape
    width = page_table.shape[1] * page_size
    bounded = False
    if max_prefix_len is not None and max_prefix_len < width:
        bounded, width = True, max_prefix_len
    q = q.astype(k_pool.dtype)
    q_lens = jnp.full((bsz,), qp, jnp.int32) if q_lens is None else jnp.minimum(q_lens, qp)
    start = kv_lens - q_lens  # i32[B] keys before the chunk
    scale = dim**-0.5

    def call(k, v, kv_len, mask):
        # cuDNN wants lengths >= 1; rows without a query or a key are dropped below.
        out, stat = attention(
            q,
            k,
            v,
            q_seqlen=jnp.maximum(q_lens, 1),
            kv_seqlen=jnp.maximum(kv_len, 1),
            scale=scale,
            mask_type=mask,
            return_residual=True,
        )
        return out.astype(jnp.float32), jnp.swapaxes(stat, 1, 2)  # stat: f32[B, Hq, Qp]

    j = jnp.arange(qp, dtype=jnp.int32)[None, :]
    diag_ok = j < q_lens[:, None]
    pos = start[:, None] + j
    k, v = _gather(k_pool, v_pool, layer, page_table, pos, diag_ok, page_size)
    out, lse = call(k, v, q_lens, mask_type.PADDING_CAUSAL)
    if width > 0:
        w = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (bsz, width))
        pre_ok = w < start[:, None]
        k, v = _gather(k_pool, v_pool, layer, page_table, w, pre_ok, page_size)
        out_p, lse_p = call(k, v, start, mask_type.PADDING)
        lse_p = jnp.where((start > 0)[:, None, None], lse_p, -jnp.inf)
        out, lse = merge_states(out, lse, out_p, lse_p)
    has_query = diag_ok[:, :, None]  # every real query sees at least its own key
    out = jnp.where(has_query[..., None], out, 0.0)
    lse = jnp.where(has_query, lse, -jnp.inf)
    if bounded:  # a row past the bound read part of its prefix: NaN, not a wrong number
        past = (start > width)[:, None, None]
        out = jnp.where(past[..., None], jnp.nan, out)
        lse = jnp.where(past, jnp.nan, lse)
    return out, lse
