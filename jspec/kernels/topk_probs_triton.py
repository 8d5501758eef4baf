"""``topk_probs`` for wide vocabularies: a chunked raw Triton kernel through ``jax_triton`` (GPU).

The same function as :func:`jspec.kernels.topk_probs.topk_probs_reference` (top-K of each
logits row with its softmax probability, ties to the lower index), for any width: the row is
cut into chunks of ``BLOCK`` columns, one program per (row, chunk), and a second launch of the
same kernel (``MODE`` MERGE) merges the chunks::

    stage 1, grid (R, C):  x = logits[r, c*BC : (c+1)*BC]  (tail columns read as -inf)
        m[r, c] = max(x);  s[r, c] = sum(exp(x - m'))          # m' = m, or 0 if not finite
        K rounds of "max, lowest column attaining it, mark taken" (as the Pallas kernel)
        -> cand_val / cand_idx[r, c, :K] (global columns; unused slots -inf / BIG)
    stage 2, grid (R,):    M = max_c m[r, c];  lse = M' + log(sum_c s * exp(m' - M'))
        K rounds over the C*K candidates, ties to the lowest global column
        -> topk_p[r] = exp(top - lse), topk_index[r]

A chunk's top-K (value descending, column ascending) is a prefix of the row's order restricted
to that chunk, so the union of the chunks' top-K holds the row's top-K; the merge reproduces
``lax.top_k``'s order exactly, and the log-sum-exp is ``jax.nn.logsumexp``'s (a non-finite max
shifts by 0: an all -inf row gives lse = -inf and p = NaN, a +inf entry p = NaN and the rest 0).
With one chunk (``V <= BLOCK``, ``MODE`` SINGLE) stage 1 writes the result itself (one launch).

Why (measured on the H200, bench/RESULTS.md): the EAGLE-3 draft's 32000-word hot vocabulary is
wider than the Pallas kernel's one tile (:data:`jspec.kernels.topk_probs.MAX_COLS`), and XLA's
``lax.top_k`` there is a ``__gpu$TopK`` custom call of ~21 us even for 1-4 rows (three per spec
step at bs 1).

``jax_triton`` (0.3.1) is imported lazily; the kernel is wrapped with ``triton.jit`` on first
use (:func:`get_kernel`), so it runs in Triton's interpreter when ``TRITON_INTERPRET=1`` is set
before triton is imported (CPU tests on torch tensors: tests/tree/test_topk_probs_triton.py).

NOTE (shared/PLATFORM.md): no checks inside the kernel. A row holding NaN gets p = NaN in all K
columns; its indices are in ``[0, V)`` but otherwise unspecified (as the Pallas kernel's).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import triton.language as tl

from jspec.config import next_power_of_2
from jspec.kernels import _common

# Columns per program (a row narrower than this is one chunk). Measured on the H200
# (bench/topk_probs.py, bench/RESULTS.md, 2026-11-24, V=32000, K=4): 1024 is best or within
# 3% at every row count (R=1: 4.2 us vs 4.9 at 4096 and 26.8 for lax.top_k; R=256: 25.3 vs
# 28.4 and 60.7; R=512: 45.8 vs 51.4 and 128.6).
DEFAULT_BLOCK_COLS = 1024
COLS_PER_WARP = 512  # one warp per 512 columns of a chunk (16 f32 per lane), 1..16 warps
MAX_NUM_WARPS = 16
BIG = tl.constexpr(1 << 30)  # "no column": above any real column (V < 2**30)
# Kernel modes (tl.constexpr: Triton kernels read only constexpr globals).
CHUNK, SINGLE, MERGE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


def _topk_kernel(
    src_val_ptr,  # CHUNK / SINGLE: float[R, V] logits; MERGE: f32[R, C, BLOCK_K] candidates
    src_idx_ptr,  # MERGE: i32[R, C, BLOCK_K] their columns (else unused)
    src_m_ptr,  # MERGE: f32[R, C] chunk maxima (else unused)
    src_s_ptr,  # MERGE: f32[R, C] chunk sum(exp(x - shift(max))) (else unused)
    dst_val_ptr,  # (out) CHUNK: f32[R, C, BLOCK_K] candidates; else f32[R, K] topk_p
    dst_idx_ptr,  # (out) CHUNK: i32[R, C, BLOCK_K] their columns; else i32[R, K] topk_index
    dst_m_ptr,  # (out) CHUNK: f32[R, C] (else unused)
    dst_s_ptr,  # (out) CHUNK: f32[R, C] (else unused)
    V: tl.constexpr,
    C: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK: tl.constexpr,  # CHUNK / SINGLE: columns per program; MERGE: next_pow2(C)
    MODE: tl.constexpr,  # CHUNK (stage 1 of C > 1), SINGLE (C == 1) or MERGE (stage 2)
):
    row = tl.program_id(0).to(tl.int64)
    if MODE == MERGE:
        c = tl.arange(0, BLOCK)
        m = tl.load(src_m_ptr + row * C + c, mask=c < C, other=float("-inf"))
        s = tl.load(src_s_ptr + row * C + c, mask=c < C, other=0.0)
        mx = tl.max(m, axis=0)
        top_shift = tl.where(tl.abs(mx) < float("inf"), mx, 0.0)
        m_shift = tl.where(tl.abs(m) < float("inf"), m, 0.0)
        # s == 0 (an all -inf chunk) weighs 0 even where exp() overflows; a NaN s stays NaN.
        total = tl.sum(tl.where(s == 0.0, 0.0, s * tl.exp(m_shift - top_shift)), axis=0)
        lse = top_shift + tl.log(total)
        flat = tl.arange(0, BLOCK * BLOCK_K)
        ok = flat < C * BLOCK_K
        x = tl.load(src_val_ptr + row * (C * BLOCK_K) + flat, mask=ok, other=float("-inf"))
        cols = tl.load(src_idx_ptr + row * (C * BLOCK_K) + flat, mask=ok, other=BIG)
    else:
        chunk = tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)  # i32[BLOCK], global columns
        x = tl.load(src_val_ptr + row * V + cols, mask=cols < V, other=float("-inf"))
        x = x.to(tl.float32)
        m = tl.max(x, axis=0)
        m_shift = tl.where(tl.abs(m) < float("inf"), m, 0.0)  # jax.nn.logsumexp's shift
        s = tl.sum(tl.exp(x - m_shift), axis=0)
        lse = m_shift + tl.log(s)

    # K rounds of "max, lowest column attaining it, mark taken". Taken entries are marked twice
    # (value and column): a row whose remaining entries are all -inf would otherwise pick a
    # taken -inf entry again. Tail columns (>= V) keep their column, so they rank after every
    # real one; only a NaN row finds no match (clamped into [0, V)).
    kcol = tl.arange(0, BLOCK_K)
    top = tl.full((BLOCK_K,), float("-inf"), tl.float32)
    index = tl.full((BLOCK_K,), BIG, tl.int32)
    for j in range(K):
        cur = tl.max(x, axis=0)
        idx = tl.minimum(tl.min(tl.where(x == cur, cols, BIG), axis=0), V - 1)
        top = tl.where(kcol == j, cur, top)
        index = tl.where(kcol == j, idx, index)
        taken = cols == idx
        x = tl.where(taken, float("-inf"), x)
        cols = tl.where(taken, BIG, cols)

    if MODE == CHUNK:
        out = (row * C + tl.program_id(1)) * BLOCK_K + kcol
        tl.store(dst_val_ptr + out, top)
        tl.store(dst_idx_ptr + out, index)
        tl.store(dst_m_ptr + row * C + tl.program_id(1), m)
        tl.store(dst_s_ptr + row * C + tl.program_id(1), s)
    else:
        tl.store(dst_val_ptr + row * K + kcol, tl.exp(top - lse), mask=kcol < K)
        tl.store(dst_idx_ptr + row * K + kcol, index, mask=kcol < K)


def get_kernel() -> Any:
    """``triton.jit`` of the kernel for the current mode (:func:`_common.triton_jit`)."""
    return _common.triton_jit(_topk_kernel)


def launch_plan(
    vocab: int, topk: int, *, block_cols: int | None = None, num_warps: int | None = None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, int]]:
    """Static ``(stage 1 constexprs, merge constexprs or {} for one chunk, stage 1 launch
    options)``; the merge runs one warp per row.

    Defaults: ``block_cols`` :data:`DEFAULT_BLOCK_COLS`, ``num_warps`` one per
    :data:`COLS_PER_WARP` columns of a chunk (1..16).
    """
    block_cols = min(block_cols or DEFAULT_BLOCK_COLS, next_power_of_2(vocab))
    if num_warps is None:
        num_warps = min(MAX_NUM_WARPS, max(1, block_cols // COLS_PER_WARP))
    num_chunks = -(-vocab // block_cols)
    common = {"V": vocab, "C": num_chunks, "K": topk, "BLOCK_K": next_power_of_2(topk)}
    mode = CHUNK.value if num_chunks > 1 else SINGLE.value
    meta = {**common, "BLOCK": block_cols, "MODE": mode}
    merge = (
        {}
        if num_chunks == 1
        else {**common, "BLOCK": next_power_of_2(num_chunks), "MODE": MERGE.value}
    )
    return meta, merge, {"num_warps": num_warps, "num_stages": 1}


def topk_probs_triton(
    logits: jax.Array, topk: int, *, block_cols: int | None = None, num_warps: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """:func:`jspec.kernels.topk_probs.topk_probs` through ``jax_triton`` (GPU only).

    Args: as ``topk_probs`` (validated there): ``logits float[R, V]`` (R >= 1), static
    ``topk``; tuning: :func:`launch_plan`'s keywords.

    Returns:
      ``(topk_p f32[R, K], topk_index i32[R, K])``.
    """
    num_rows = logits.shape[0]
    meta, merge, opts = launch_plan(
        logits.shape[1], topk, block_cols=block_cols, num_warps=num_warps
    )
    k, bk, c = meta["K"], meta["BLOCK_K"], meta["C"]
    f32, i32 = jnp.float32, jnp.int32
    result = (
        jax.ShapeDtypeStruct((num_rows, k), f32),
        jax.ShapeDtypeStruct((num_rows, k), i32),
        jax.ShapeDtypeStruct((1,), f32),  # unused outputs
        jax.ShapeDtypeStruct((1,), f32),
    )
    unused = (jnp.zeros((1,), i32), jnp.zeros((1,), f32), jnp.zeros((1,), f32))
    kernel = get_kernel()
    if not merge:
        p, index, _, _ = _common.jax_triton_call(
            logits,
            *unused,
            kernel=kernel,
            out_shape=result,
            grid=(num_rows, 1),
            name="jspec_topk_probs",
            **meta,
            **opts,
        )
        return p, index
    parts = _common.jax_triton_call(
        logits,
        *unused,
        kernel=kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_rows, c, bk), f32),
            jax.ShapeDtypeStruct((num_rows, c, bk), i32),
            jax.ShapeDtypeStruct((num_rows, c), f32),
            jax.ShapeDtypeStruct((num_rows, c), f32),
        ),
        grid=(num_rows, c),
        name="jspec_topk_probs_chunks",
        **meta,
        **opts,
    )
    p, index, _, _ = _common.jax_triton_call(
        *parts,
        kernel=kernel,
        out_shape=result,
        grid=(num_rows, 1),
        name="jspec_topk_probs_merge",
        **merge,
        num_warps=1,
        num_stages=1,
    )
    return p, index
