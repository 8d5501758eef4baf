"""``paged_attention`` as a raw Triton flash-decoding kernel through ``jax_triton`` (GPU).

The same function as :func:`jspec.kernels.paged_attention.paged_attention_reference` (one
masked GQA pass over the pool rows at ``kv_slot_ids``), reading K and V straight from the pool
in their stored dtype (bf16 / f16: tensor-core ``tl.dot`` with f32 accumulation; f32 pools:
IEEE-f32 ``tl.dot``, no TF32)::

    grid = (Bp, Hkv * row blocks, splits of W)
    rows r = (query i = r // G, head h = kv_head * G + r % G)            [BM]  (i < Qp)
    for w0 in this split's chunk of W below kv_len[b], BN slots at a time:
        vis   = kv_mask[b, i, w0 : w0 + BN]                               [BM, BN]
        slots = kv_slot_ids[b, w0 : w0 + BN]; col = any_r(vis)            [BN]
        k, v  = pool[layer, slots, kv_head, :] where col else 0           [BN, D]
        s     = q @ k.T * scale (log2 units), masked -> -inf              [BM, BN]
        online softmax: m, l, acc += p @ v
    part_out[b, split] = acc / l, part_lse[b, split] = ln(sum exp)    (0, -inf when empty)

``kv_len[b]`` = 1 + the last column any query of row b sees (:func:`visible_length`): the
loop's runtime trip count, so a padded tail of W costs nothing. The splits are merged by
log-sum-exp in XLA (:func:`merge_splits`; skipped when there is
one split). Only the listed-and-visible columns of the pool are read: slots the mask hides may
hold anything (NaN included). The layer is a runtime scalar (one compile for every layer).

``jax_triton`` (0.3.1) is imported lazily in :func:`paged_attention_triton`; the kernel is a
plain function wrapped with ``triton.jit`` on first use (:func:`get_kernel`), so it runs in
Triton's interpreter when ``TRITON_INTERPRET=1`` is set before triton is imported (tests on CPU
torch tensors: :func:`paged_attention_torch`).

NOTE (shared/PLATFORM.md): no bounds checks inside the kernel; slot ids must be in ``[0, S)``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import triton.language as tl

from jspec.kernels import _common
from jspec.kernels._common import interpreting

MIN_DOT = 16  # tl.dot wants every tile dimension >= 16
MAX_BLOCK_M = 64  # query x group rows per program
# Key slots per loop iteration: next_pow2(W) / 4 clamped to [32, 128] (measured on the H200,
# bench/RESULTS.md: 128 best for 1k-2k keys, 32 for the 80-key draft pass B).
MIN_BLOCK_N, MAX_BLOCK_N = 32, 128
DEFAULT_NUM_WARPS = 4
# Software pipelining depth: 2 for the 16-row tiles of decode (the loads of the next block
# overlap this one's dots); 1 for larger tiles, where the extra K / V stage in shared memory
# costs occupancy (measured on the H200, 8B geometry: verify prefix 32 x 4 rows 473 -> 220 us,
# verify tree 32 -> 29 us, draft A equal; decode 16 rows 94 us with 2 stages, 103 with 1).
DEFAULT_NUM_STAGES_SMALL_M, DEFAULT_NUM_STAGES = 2, 1
# Splits of W: enough programs to fill the GPU (132 SMs on the H100 / H200), each split at
# least MIN_SPLIT_BLOCKS blocks of keys.
TARGET_PROGRAMS = 4 * 132
MIN_SPLIT_BLOCKS = 1
# No split for decode-shaped rows (one 16-row tile) when the grid already holds at least half of
# TARGET_PROGRAMS and each program loops over fewer than this many key blocks: the split's partials and the XLA merge cost more than
# they give (measured on the H200, 2026-11-24, bs64 decode, 32/8 x 128, ~160 keys of W=256:
# 2 splits 31.8 us, 1 split 23.9 us; bench/RESULTS.md). Longer loops keep the split (2k-key
# decode: 71% of the copy bandwidth with 2 splits), and so does draft pass A (32-row tiles: the
# 8B spec bs64 step's attention rose 1.83 -> 2.08 ms without its split).
SPLIT_FULL_GRID_MIN_BLOCKS = 8
_LOG2E = 1.4426950408889634


def _paged_attention_kernel(
    q_ptr,  # dtype[Bp, Qp, Hq, D]
    k_ptr,  # dtype[L, S, Hkv, D]
    v_ptr,  # dtype[L, S, Hkv, D]
    slot_ptr,  # i32[Bp, W]
    mask_ptr,  # i8[Bp, Qp, W]
    len_ptr,  # i32[Bp]: 1 + the last column some query of the row sees (0: none)
    layer_ptr,  # i32[1]
    out_ptr,  # f32[Bp, NS, Qp, Hq, D] (out)
    lse_ptr,  # f32[Bp, NS, Qp, Hq] (out)
    QP: tl.constexpr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    W: tl.constexpr,
    NS: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNK_BLOCKS: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALE_LOG2: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    G: tl.constexpr = HQ // HKV
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1) // ROW_BLOCKS
    row_block = tl.program_id(1) % ROW_BLOCKS
    split = tl.program_id(2)
    layer = tl.load(layer_ptr).to(tl.int64)

    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    query = rows // G
    head = kv_head * G + rows % G
    row_ok = query < QP
    dcol = tl.arange(0, BLOCK_D)  # [BD]
    d_ok = dcol < D
    q_off = ((b * QP + query) * HQ + head).to(tl.int64) * D  # [BM]
    q = tl.load(
        q_ptr + q_off[:, None] + dcol[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )  # [BM, BD]
    if IEEE:
        q = q.to(tl.float32)
    else:
        q = q.to(k_ptr.dtype.element_ty)

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    mask_row = mask_ptr + (b * QP + query).to(tl.int64) * W  # [BM]
    kv_base = (layer * NUM_SLOTS * HKV + kv_head) * D
    w_start = split * CHUNK
    kv_len = tl.load(len_ptr + b)  # 1 + the last column any query of row b sees (0: none)
    # A runtime trip count up to kv_len and no data-dependent branch in the loop: no empty
    # tail blocks, and the loop stays pipelined (an ``if any(vis)`` skip of empty blocks
    # measured 1.4x slower on the bs64 decode pass). NOTE: the interpreter's range() takes no
    # tensor bound (triton 3.6): there every block of the chunk runs, masked.
    num_iters = tl.cdiv(tl.minimum(w_start + CHUNK, kv_len) - w_start, BLOCK_N)
    for blk in range(CHUNK_BLOCKS if INTERPRET else num_iters):
        w = w_start + blk * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        w_ok = w < kv_len
        vis = (
            tl.load(mask_row[:, None] + w[None, :], mask=row_ok[:, None] & w_ok[None, :], other=0)
            != 0
        )  # [BM, BN]
        col = tl.max(vis.to(tl.int32), axis=0) > 0  # [BN]: some row sees this key
        slots = tl.load(slot_ptr + b * W + w, mask=col, other=0).to(tl.int64)  # [BN]
        kv_off = kv_base + slots * (HKV * D)  # [BN]
        kv_mask = col[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off[:, None] + dcol[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_off[:, None] + dcol[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        elif INTERPRET:  # NOTE: the interpreter's bf16 tl.dot is wrong (triton 3.6)
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(vis, s * SCALE_LOG2, float("-inf"))  # [BM, BN], log2 units
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # NOTE: rows with nothing visible yet keep m = -inf; shift by 0 so no inf - inf.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.where(vis, tl.math.exp2(s - shift[:, None]), 0.0)
        alpha = tl.math.exp2(m - shift)
        l = l * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        elif INTERPRET:  # the same rounding of p as the compiled kernel
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    has_key = l > 0
    safe_l = tl.where(has_key, l, 1.0)
    out = tl.where(has_key[:, None], acc / safe_l[:, None], 0.0)
    lse = tl.where(has_key, (m + tl.math.log2(safe_l)) * 0.6931471805599453, float("-inf"))
    part = (b * NS + split) * QP + query  # [BM]
    o_off = (part * HQ + head).to(tl.int64)
    tl.store(
        out_ptr + o_off[:, None] * D + dcol[None, :], out, mask=row_ok[:, None] & d_ok[None, :]
    )
    tl.store(lse_ptr + o_off, lse, mask=row_ok)


def get_kernel() -> Any:
    """``triton.jit`` of the kernel for the current mode (:func:`_common.triton_jit`)."""
    return _common.triton_jit(_paged_attention_kernel)


def launch_plan(
    bp: int,
    qp: int,
    hq: int,
    hkv: int,
    dim: int,
    width: int,
    pool_dtype: Any,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[tuple[int, int, int], dict[str, Any], dict[str, int]]:
    """Static ``(grid, constexprs, launch options)`` for one pass.

    Defaults: ``block_m = min(64, next_pow2(Qp * G))`` (>= 16), ``block_n`` as
    :data:`MIN_BLOCK_N` says (>= 16), ``num_splits`` so that about :data:`TARGET_PROGRAMS` programs run
    with at least :data:`MIN_SPLIT_BLOCKS` key blocks each, and 1 where the grid is already half
    full and the loop short (:data:`SPLIT_FULL_GRID_MIN_BLOCKS`).
    """
    group = hq // hkv
    if block_m is None:
        block_m = min(MAX_BLOCK_M, _common.next_power_of_2(qp * group))
    block_m = max(MIN_DOT, block_m)
    if block_n is None:
        block_n = min(
            MAX_BLOCK_N,
            max(MIN_BLOCK_N, _common.next_power_of_2(width) // 4),
            _common.next_power_of_2(width),
        )
    block_n = max(MIN_DOT, block_n)
    row_blocks = -(-qp * group // block_m)
    num_blocks = max(1, -(-width // block_n))
    if num_splits is None:
        base = bp * hkv * row_blocks
        num_splits = max(
            1, min(-(-TARGET_PROGRAMS // max(base, 1)), num_blocks // MIN_SPLIT_BLOCKS)
        )
        short = num_blocks < SPLIT_FULL_GRID_MIN_BLOCKS
        if block_m <= MIN_DOT and 2 * base >= TARGET_PROGRAMS and short:
            num_splits = 1  # decode-shaped rows only (draft A's 32-row tiles measured slower)
    num_splits = max(1, min(num_splits, num_blocks))
    chunk = -(-num_blocks // num_splits) * block_n
    num_splits = -(-width // chunk) if width else 1
    ieee = jnp.dtype(pool_dtype) == jnp.float32
    meta = {
        "QP": qp,
        "HQ": hq,
        "HKV": hkv,
        "D": dim,
        "W": width,
        "NS": num_splits,
        "CHUNK": chunk,
        "CHUNK_BLOCKS": chunk // block_n,
        "ROW_BLOCKS": row_blocks,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_D": max(MIN_DOT, _common.next_power_of_2(dim)),
        "SCALE_LOG2": float(dim) ** -0.5 * _LOG2E,
        "IEEE": bool(ieee),
        "INTERPRET": interpreting(),
    }
    opts = {
        "num_warps": num_warps or DEFAULT_NUM_WARPS,
        "num_stages": num_stages
        or (DEFAULT_NUM_STAGES_SMALL_M if block_m <= MIN_DOT else DEFAULT_NUM_STAGES),
    }
    return (bp, hkv * row_blocks, num_splits), meta, opts


def visible_length(kv_mask: jax.Array) -> jax.Array:
    """i32[Bp]: 1 + the last key column any query of row b sees (0 when none), from
    ``kv_mask: bool[Bp, Qp, W]`` (one small XLA reduction); the kernel's loop stops there."""
    cols = jnp.arange(1, kv_mask.shape[2] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(jnp.any(kv_mask, axis=1), cols[None, :], 0), axis=1)


def merge_splits(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Log-sum-exp merge over axis 1: ``f32[Bp, NS, Qp, Hq, D], f32[Bp, NS, Qp, Hq]`` ->
    ``(f32[Bp, Qp, Hq, D], f32[Bp, Qp, Hq])`` (-inf splits ignored; all -inf: 0, -inf)."""
    if out.shape[1] == 1:
        return out[:, 0], lse[:, 0]
    top = jnp.max(lse, axis=1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weight = jnp.where(jnp.isfinite(lse), jnp.exp(lse - top), 0.0)  # [Bp, NS, Qp, Hq]
    total = jnp.sum(weight, axis=1)
    has_key = total > 0
    safe = jnp.where(has_key, total, 1.0)
    merged = jnp.sum(out * weight[..., None], axis=1) / safe[..., None]
    lse_out = jnp.where(has_key, top[:, 0] + jnp.log(safe), -jnp.inf)
    return jnp.where(has_key[..., None], merged, 0.0), lse_out


def paged_attention_triton(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: int,
    kv_slot_ids: jax.Array,
    kv_mask: jax.Array,
    **tuning: Any,
) -> tuple[jax.Array, jax.Array]:
    """:func:`jspec.kernels.paged_attention.paged_attention` through ``jax_triton`` (GPU only).

    Args: as ``paged_attention`` (validated there); ``tuning``: :func:`launch_plan`'s
    keywords. q is cast to the pool dtype (the model's activations already are).
    """
    jt = _common.import_jax_triton()
    bp, qp, hq, dim = q.shape
    num_slots, hkv = k_pool.shape[1], k_pool.shape[2]
    width = kv_slot_ids.shape[1]
    grid, meta, opts = launch_plan(bp, qp, hq, hkv, dim, width, k_pool.dtype, **tuning)
    ns = meta["NS"]
    out_shape = (
        jax.ShapeDtypeStruct((bp, ns, qp, hq, dim), jnp.float32),
        jax.ShapeDtypeStruct((bp, ns, qp, hq), jnp.float32),
    )
    out, lse = jt.triton_call(
        q.astype(k_pool.dtype),
        k_pool,
        v_pool,
        kv_slot_ids.astype(jnp.int32),
        kv_mask.astype(jnp.int8),
        visible_length(kv_mask),
        jnp.full((1,), layer, jnp.int32),
        kernel=get_kernel(),
        out_shape=out_shape,
        grid=grid,
        name="jspec_paged_attention",
        NUM_SLOTS=num_slots,
        **meta,
        **opts,
    )
    return merge_splits(out, lse)


def paged_attention_torch(q, k_pool, v_pool, layer: int, kv_slot_ids, kv_mask, **tuning: Any):
    """The same kernel on torch tensors (the interpreter on CPU; tests and benches).

    Args: torch tensors shaped as :func:`paged_attention_triton`'s (q in the pool dtype,
    slot ids int32, mask bool). Returns the un-merged torch partials
    ``(out f32[Bp, NS, Qp, Hq, D], lse f32[Bp, NS, Qp, Hq])`` (NaN-poisoned before the launch;
    :func:`merge_torch_partials` merges them).
    """
    import numpy as np
    import torch

    bp, qp, hq, dim = q.shape
    num_slots, hkv = k_pool.shape[1], k_pool.shape[2]
    pool_dtype = {
        torch.float32: jnp.float32,
        torch.bfloat16: jnp.bfloat16,
        torch.float16: jnp.float16,
    }[k_pool.dtype]
    grid, meta, opts = launch_plan(bp, qp, hq, hkv, dim, kv_slot_ids.shape[1], pool_dtype, **tuning)
    ns = meta["NS"]
    out = torch.full((bp, ns, qp, hq, dim), float("nan"), dtype=torch.float32, device=q.device)
    lse = torch.full((bp, ns, qp, hq), float("nan"), dtype=torch.float32, device=q.device)
    layer_t = torch.full((1,), layer, dtype=torch.int32, device=q.device)
    kv_len = torch.from_numpy(np.array(visible_length(jnp.asarray(kv_mask.cpu().numpy()))))
    get_kernel()[grid](
        q.to(k_pool.dtype).contiguous(),
        k_pool,
        v_pool,
        kv_slot_ids.to(torch.int32).contiguous(),
        kv_mask.to(torch.int8).contiguous(),
        kv_len.to(q.device),
        layer_t,
        out,
        lse,
        NUM_SLOTS=num_slots,
        **meta,
        **opts,
    )
    return out, lse


def merge_torch_partials(out, lse) -> tuple[Any, Any]:
    """:func:`merge_splits` of :func:`paged_attention_torch`'s partials, as numpy arrays."""
    import numpy as np

    merged = merge_splits(jnp.asarray(out.cpu().numpy()), jnp.asarray(lse.cpu().numpy()))
    return np.asarray(merged[0]), np.asarray(merged[1])
