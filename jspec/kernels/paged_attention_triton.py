# Over 400 lines: one kernel serves every pass shape; its launch plan (which sets the kernel's
# constexprs), the split merge and the wrapper belong with it.
"""``paged_attention`` as one raw Triton kernel through ``jax_triton`` (GPU).

The same function as :func:`jspec.kernels.paged_attention.paged_attention_reference` (its
module docstring is the contract), reading K and V straight from the pool by page table in
their stored dtype (bf16 / f16: tensor-core ``tl.dot`` with f32 accumulation; f32 pools:
IEEE-f32 ``tl.dot``, no TF32). One launch serves every pass shape::

    grid = (row blocks x B x Hkv, splits);  rows r = (query r // G, head kv_head * G + r % G)
    program's keys [0, hi): hi = kv_lens[b] (causal: the limit of its last real query)
    split s: keys [s * chunk, (s + 1) * chunk) of [0, hi), chunk = BN * ceil(hi / NSP / BN)
    NSP = NS prefix splits, or NS - 1 with TAIL_SPLIT (the last split then reads the tail only)

    phase 0  full blocks     every real row sees every key: no mask loaded or computed
    phase 1  masked blocks   key w visible to row r iff w < lim[r]          (lengths only)
               lim[r] = kv_lens[b] (causal: kv_lens[b] - q_lens[b] + query(r) + 1)
    phase 2  the tail        last split only: key j iff tail_mask[b, query(r), j], slot
                             tail_slot_ids[b, j] (only keys some row of the block sees load);
                             with TAIL_SPLIT that split reads no prefix key: the tail's
                             loads no longer wait behind a prefix chunk's; a short tail
                             in a launch of few splits is one tile (TAIL_BLOCK) loaded
                             before phase 0 and attended after phase 1
    per block of BN keys: slot = page_table[b, w // P] * P + w % P;  K, V [BN, D] rows gathered
    s = q @ k.T (log2 units); online softmax m, l; acc = acc * alpha + p @ v

    part_out[b, split] = acc / l, part_lse[b, split] = ln(sum exp)   (0, -inf: nothing seen)

Launch plans (:func:`launch_plan`): *decode-shaped* passes (``Qp * G <= 64`` rows: decode,
draft passes A / B, verify; or any non-causal pass) take one 16-64-row tile per (batch row,
KV head) and split the keys over enough programs to fill the GPU (flash decoding, merged by
log-sum-exp: :func:`jspec.kernels.merge_state.merge_splits`, or past a few splits or from 64
rows a second launch, :func:`merge_splits_triton`). *Causal prefill chunks* (``Qp * G > 64``) take
128-row tiles (``128 / G`` queries x ``G`` heads: K / V read once per block for the whole
group), full key blocks below the diagonal and masked blocks on it, the longest query blocks
first, no split unless the grid is under one wave. Each program's trip count is a runtime value from the lengths: padded
page-table columns and padding rows cost nothing. The layer is a runtime scalar (one compile
for every layer).

Whether a row sees a key comes from the lengths and the tail mask, never from the values:
a query with nothing visible gets ``out = 0, lse = -inf`` while a NaN read at a visible
position reaches the output. Pool positions no query of the block sees are never loaded.

``jax_triton`` (0.3.1) is imported lazily; the kernel is wrapped with ``triton.jit`` on first use
(:func:`get_kernel`), so it runs in Triton's interpreter when ``TRITON_INTERPRET=1`` is set
before triton is imported (CPU tests on torch tensors: tests/engine/paged_attention_cases.py).

NOTE (shared/PLATFORM.md): no bounds checks inside the kernel; read page ids must be in
``[0, S / P)`` and seen tail slots in ``[0, S)`` (probes check both when on).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import triton.language as tl

from jspec.config import next_power_of_2
from jspec.kernels import _common
from jspec.kernels._common import interpreting
from jspec.kernels.merge_state import merge_splits

MIN_DOT = 16  # tl.dot wants every tile dimension >= 16
NUM_SMS = 132  # H100 / H200
# Decode-shaped passes: rows (query x group) per program, at most this many.
MAX_DECODE_ROWS = 64
# Key slots per loop iteration of decode-shaped passes: next_pow2(C * P) / 4 clamped to
# [32, 128] (measured on the H200 with the slot-list kernel, bench/RESULTS.md: 128 best for
# 1k-2k keys, 32 for the 80-key draft pass B).
MIN_BLOCK_N, MAX_BLOCK_N = 32, 128
DEFAULT_NUM_WARPS = 4
# Software pipelining depth of decode-shaped passes: 2 (measured on the H200 with this kernel,
# 2026-11-26, bench/RESULTS.md: verify bs64 x 8k keys, 32-row tiles: 648 us with 1 stage,
# 542 us with 2 (3.96 TB/s), 545 with 3; decode 16-row tiles: 2 as good as any); 1 where each
# split reads at most STAGE1_MAX_BLOCKS key blocks of the planned width (H100, 2026-11-27:
# verify bs 1 over 2k keys, 17 splits, kernel 12.2 us with 2 stages, 8.7 with 1; H200,
# 2026-11-27, an 8448-key table, 33 splits of 2 blocks, kernel + merge: verify bs 1 over 600 /
# 2150 / 4300 / 8192 keys 21.2 / 23.1 / 24.7 / 27.1 us with 2 stages, 13.0 / 14.9 / 18.7 / 22.4
# with 1 (and no tail split); decode bs 1 9.4 -> 8.8, 12.1 -> 10.8, 15.1 -> 14.8, 19.3 -> 18.5;
# at 8 blocks a split 2 stages win: verify bs 1 over 32k keys 51.4 vs 54.7 us).
DEFAULT_NUM_STAGES_SMALL_M, DEFAULT_NUM_STAGES = 2, 2
STAGE1_MAX_BLOCKS = 2
# NOTE: a K / V address needs a page id loaded first, so Triton's pipeliner (triton 3.6) splits
# the depth between the two loads: num_stages 2-4 fetch K / V one block ahead of the dots (the
# page ids two), 5 two blocks ahead (seen in the sm_90 TTGIR: async_wait num=0 vs num=3).
# Causal prefill chunks (FlashAttention-2 on Hopper: wgmma tiles of 128 rows over 2 warpgroups).
# Measured on the H200 (2026-11-26, bench.paged_attention --sweep, 8192 queries x 8192 keys,
# 32/8 heads x 128, bf16): 128 x 64 tiles, 3 stages 1601 us; 128 x 128 tiles, 5 stages (K / V
# fetched two blocks ahead, see the NOTE above) 1206 us = 57% of the matmul rate (cuDNN's dense
# causal kernel on the same problem: 915 us).
PREFILL_BLOCK_M, PREFILL_BLOCK_N = 128, 128
PREFILL_NUM_WARPS, PREFILL_NUM_STAGES = 8, 5
# f32 pools (IEEE dots; tests and the f32 demo): 64 x 64 tiles, 2 stages. The bf16 plan's
# 128 x 128 x 5 stages asks for 394 KB of shared memory in f32 (the H100 / H200 have 227 KB).
F32_PREFILL_BLOCK, F32_PREFILL_NUM_STAGES = 64, 2
# Splits of the keys: about TARGET_PROGRAMS programs (the split count rounded to the nearest),
# each split at least MIN_SPLIT_BLOCKS key blocks of the page table's width. Measured on the
# H100 (2026-11-27, 8B heads, bf16, 2k keys): verify bs 16 over 2k keys, kernel alone, 6 splits
# (768 programs) 74.5 us, 2 splits 62.5; decode bs 16 5 splits 54.3, 2 splits 50.2; bs 64
# verify 1 split 205 vs 2 splits 217; bs 1 passes want every split they can get (16 splits).
TARGET_PROGRAMS = 2 * NUM_SMS
MIN_SPLIT_BLOCKS = 1
# Up to this many splits the jnp merge (:func:`merge_splits`), which XLA may fuse into the
# pass's consumers; more: the Triton merge (a launch of ~2-4 us, but one read of the
# partials). Measured on the H100 (2026-11-27): greedy bs 1 over ~200 keys, 3 splits: kernel
# 4.9 us and the jnp merge fused away vs 6.8 us unsplit or 4.9 + 2.0 with the Triton merge;
# verify bs 1 over 2k keys, 17 splits: the jnp merge 7.1 us (three fusions), Triton 4.0.
XLA_MERGE_MAX_SPLITS = 4
# ... and only for passes of fewer rows (B * Qp) than this: from CUBLAS_MIN_TOKENS target tokens
# on (jspec.kernels.policy) the pass's consumer, the output projection, is a cuBLAS GEMM that
# cannot absorb the jnp merge, which then runs as three fusions of its own (H200, 2026-11-27:
# the verify's 2 splits at bs 16 x 2k, 128 rows, 1.2 + 2.2 + 1.5 us after a 44 us kernel). The
# Triton merge there (H100, 2026-11-28, kernel + merge): verify bs 16 over 2k / 8k keys 64.0 ->
# 62.2 / 197.1 -> 193.7 us, draft pass A bs 16 (64 rows) 55.2 -> 54.4 / 187.2 -> 185.4.
XLA_MERGE_MAX_ROWS = 64
# No split for decode-shaped rows (one 16-row tile) when the grid already holds at least half of
# TARGET_PROGRAMS and each program loops over fewer than this many key blocks: the partials and
# the XLA merge cost more than they give (measured on the H200, 2026-11-24, bs64 decode over
# ~160 keys: 2 splits 31.8 us, 1 split 23.9 us; bench/RESULTS.md).
SPLIT_FULL_GRID_MIN_BLOCKS = 8
# A tail (verify / extend window) gets a split of its own when each prefix split reads at most
# this many key blocks: there the tail's loads, queued behind the last split's prefix chunk,
# set the kernel's time (H100, 2026-11-27: verify bs 1 over 2k keys, 17 splits of one block,
# 1.1 us faster); longer splits keep it in the last one. At 2 blocks a split it costs (H200,
# 2026-11-27, an 8448-key table, 1 stage, kernel + merge: verify bs 1 over 600 / 2150 keys 15.3 /
# 16.3 us with it, 13.0 / 14.9 without; over 8192 keys 22.7 / 22.4; at 9 blocks a split, bs 4,
# 2-7 us more with it; 3-4 blocks were not measured): a grid planned wider than the keys
# already leaves the last split to the tail alone, and the extra column of programs is paid.
TAIL_SPLIT_MAX_BLOCKS = 1
# A tail of at most TAIL_TILE_MAX keys, in a launch of at most TAIL_TILE_MAX_SPLITS prefix
# splits, is read as one tile (TAIL_BLOCK) whose loads are issued before the prefix loop and
# used after it, instead of a loop of its own after the prefix, whose dependent loads (mask,
# slots, then K / V) ran after the last prefix block, on the last split's path. Measured on the
# H200 (2026-11-27, 8-query verify + 8-key tail, kernel alone, us, tail loop -> tile): bs 16 x 2k
# (2 splits) 48.5 -> 44.0 (41.6 with no tail at all); bs 64 x 2k 154.4 -> 146.8; bs 4 x 1k / 2k /
# 4k / 8k / 32k (5-8 splits) 15.3 / 21.0 / 32.1 / 47.3 / 140.4 -> 14.3 / 19.0 / 27.9 / 44.4 /
# 137.6 (x 600: 9.2 -> 9.6); bs 1 x 600 / 2k (16 splits + the tail's) 7.2 / 8.5 -> 6.0 / 7.8;
# but bs 1 x 4k / 8k / 32k (32-33 splits) 9.9 / 15.7 / 44.0 -> 11.4 / 18.0 / 44.8: there the
# tile stays off.
TAIL_TILE_MAX, TAIL_TILE_MAX_SPLITS = 16, 16
_LOG2E = 1.4426950408889634


def _paged_attention_kernel(
    q_ptr,  # dtype[B, Qp, Hq, D]
    k_ptr,  # dtype[L, S, Hkv, D]
    v_ptr,  # dtype[L, S, Hkv, D]
    layer_ptr,  # i32[1]
    page_table_ptr,  # i32[B, C]
    kv_lens_ptr,  # i32[B]
    q_lens_ptr,  # i32[B] (CAUSAL; unread otherwise)
    tail_slot_ptr,  # i32[B, N] (TAIL_LEN = N > 0; unread otherwise)
    tail_mask_ptr,  # i8[B, Qp, N] (TAIL_LEN > 0; unread otherwise)
    num_pages,  # i32 scalar: C, the page table's width (runtime: one compile for every C)
    num_slots,  # i32 scalar: S, the pool's slots per layer
    out_ptr,  # f32[B, NS, Qp, Hq, D] (out)
    lse_ptr,  # f32[B, NS, Qp, Hq] (out)
    QP: tl.constexpr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TAIL_LEN: tl.constexpr,
    TAIL_BLOCK: tl.constexpr,
    TAIL_SPLIT: tl.constexpr,
    CAUSAL: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALE_LOG2: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    G: tl.constexpr = HQ // HKV
    D_PAD: tl.constexpr = BLOCK_D != D  # head_dim not a power of 2: mask the columns
    pid = tl.program_id(0)
    row_block = pid % ROW_BLOCKS
    if CAUSAL:
        row_block = ROW_BLOCKS - 1 - row_block  # the longest (last) query blocks first
    bh = pid // ROW_BLOCKS
    b = (bh // HKV).to(tl.int64)
    kv_head = bh % HKV
    split = tl.program_id(1)
    NS = tl.num_programs(1)  # splits of the keys (runtime: one compile for every count)
    layer = tl.load(layer_ptr).to(tl.int64)

    first_row = row_block * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)  # [BM]
    query = rows // G
    head = kv_head * G + rows % G
    in_q = query < QP
    dcol = tl.arange(0, BLOCK_D)  # [BD]
    d_ok = dcol < D
    q_off = ((b * QP + query) * HQ + head) * D  # [BM] i64
    if D_PAD:
        q = tl.load(
            q_ptr + q_off[:, None] + dcol[None, :], mask=in_q[:, None] & d_ok[None, :], other=0.0
        )
    else:
        q = tl.load(q_ptr + q_off[:, None] + dcol[None, :], mask=in_q[:, None], other=0.0)
    if IEEE or INTERPRET:  # NOTE: the interpreter's bf16 tl.dot is wrong (triton 3.6)
        q = q.to(tl.float32)  # [BM, BD]

    # The program's prefix keys [0, hi); keys below `full` are visible to every real row.
    kv_len = tl.load(kv_lens_ptr + b)
    if CAUSAL:
        q_len = tl.minimum(tl.load(q_lens_ptr + b), QP)
        offset = kv_len - q_len  # query i sits at row position offset + i
        pre_ok = query < q_len  # [BM] rows with a real query
        lim = offset + query + 1  # [BM] row r sees prefix keys [0, lim[r])
        q_first = first_row // G
        q_last = tl.minimum((first_row + BLOCK_M - 1) // G, q_len - 1)
        hi = tl.where(q_last >= q_first, offset + q_last + 1, 0)
        full = tl.minimum(tl.maximum(offset + q_first + 1, 0), hi)
    else:
        pre_ok = in_q
        lim = tl.zeros((BLOCK_M,), tl.int32) + kv_len
        hi = kv_len
        full = kv_len
    # This split's keys [s_lo, s_hi): full blocks [s_lo, f_end), masked blocks [f_end, s_hi).
    # With TAIL_SPLIT the last split's s_lo = (NS - 1) * chunk >= hi: no prefix key.
    chunk = tl.cdiv(tl.cdiv(hi, NS - 1 if TAIL_SPLIT else NS), BLOCK_N) * BLOCK_N
    s_lo = split * chunk
    s_hi = tl.minimum(s_lo + chunk, hi)
    f_end = s_lo + tl.maximum(tl.minimum(full, s_hi) - s_lo, 0) // BLOCK_N * BLOCK_N
    lim = tl.minimum(lim, s_hi)
    pre_seen = pre_ok & (lim > s_lo)  # [BM] the row sees a prefix key of this split

    kv_base = layer * num_slots * (HKV * D) + kv_head * D  # i64
    k_base = k_ptr + kv_base
    v_base = v_ptr + kv_base
    pt_row = page_table_ptr + b * num_pages
    tail_row = tail_slot_ptr + b * TAIL_LEN
    tmask_row = tail_mask_ptr + (b * QP + query) * TAIL_LEN  # [BM]
    t_end = tl.where(split == NS - 1, TAIL_LEN, 0)  # the tail goes with the last split

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    tail_seen = tl.zeros((BLOCK_M,), tl.int32)
    if TAIL_BLOCK > 0:  # the whole tail in one tile, loaded now: its loads wait on no prefix
        wt = tl.arange(0, TAIL_BLOCK)  # [TB] tail index; other splits (t_end = 0) load nothing
        t_vis = (
            tl.load(
                tmask_row[:, None] + wt[None, :],
                mask=in_q[:, None] & (wt < t_end)[None, :],
                other=0,
            )
            != 0
        )  # [BM, TB]
        t_col = tl.max(t_vis.to(tl.int32), axis=0) > 0  # [TB] some row sees the key
        t_off = tl.load(tail_row + wt, mask=t_col, other=0).to(tl.int64) * (HKV * D)
        t_mask = t_col[:, None] & d_ok[None, :] if D_PAD else t_col[:, None]
        t_k = tl.load(k_base + t_off[:, None] + dcol[None, :], mask=t_mask, other=0.0)
        t_v = tl.load(v_base + t_off[:, None] + dcol[None, :], mask=t_mask, other=0.0)
    # NOTE: runtime trip counts and no data-dependent branch inside a loop: the loops stay
    # software-pipelined (an ``if any(vis)`` skip measured 1.4x slower on bs64 decode).
    for phase in tl.static_range(3 if TAIL_LEN > 0 else 2):
        if phase == 0:
            lo = s_lo
            hi_phase = f_end
        elif phase == 1:
            lo = f_end
            hi_phase = s_hi
        else:
            lo = 0
            hi_phase = tl.minimum(t_end, 1) if TAIL_BLOCK > 0 else t_end  # TAIL_BLOCK: 1 step
            if CAUSAL:  # rows past q_lens ran phase 0 on their (unused) queries: drop it
                m = tl.where(pre_ok, m, float("-inf"))
                l = tl.where(pre_ok, l, 0.0)
                acc = tl.where(pre_ok[:, None], acc, 0.0)
        for start in range(lo, hi_phase, BLOCK_N):
            start = tl.multiple_of(start, BLOCK_N)
            w = start + tl.arange(0, BLOCK_N)  # [BN] prefix positions (phase 2: tail index)
            if phase == 0:
                slot = tl.load(pt_row + w // PAGE_SIZE) * PAGE_SIZE + w % PAGE_SIZE
            elif phase == 1:
                col = w < s_hi  # [BN] keys to load
                page = tl.load(pt_row + w // PAGE_SIZE, mask=col, other=0)
                slot = page * PAGE_SIZE + w % PAGE_SIZE
                vis = w[None, :] < lim[:, None]  # [BM, BN]
            elif TAIL_BLOCK == 0:
                vis = (
                    tl.load(
                        tmask_row[:, None] + w[None, :],
                        mask=in_q[:, None] & (w < TAIL_LEN)[None, :],
                        other=0,
                    )
                    != 0
                )  # [BM, BN]
                col = tl.max(vis.to(tl.int32), axis=0) > 0  # [BN] some row sees the key
                slot = tl.load(tail_row + w, mask=col, other=0)
            else:
                vis = t_vis  # [BM, TB]
            if phase == 2:
                tail_seen = tl.maximum(tail_seen, tl.max(vis.to(tl.int32), axis=1))
            if phase < 2 or TAIL_BLOCK == 0:
                kv_off = slot.to(tl.int64) * (HKV * D)  # [BN]
                kv_ptrs = kv_off[:, None] + dcol[None, :]  # [BN, BD]
            if phase == 2 and TAIL_BLOCK > 0:
                k = t_k  # [TB, BD]
                v = t_v
            elif phase == 0:
                if D_PAD:
                    k = tl.load(k_base + kv_ptrs, mask=d_ok[None, :], other=0.0)
                    v = tl.load(v_base + kv_ptrs, mask=d_ok[None, :], other=0.0)
                else:
                    k = tl.load(k_base + kv_ptrs)  # [BN, BD]
                    v = tl.load(v_base + kv_ptrs)
            else:
                if D_PAD:
                    kv_mask = col[:, None] & d_ok[None, :]
                else:
                    kv_mask = col[:, None]
                k = tl.load(k_base + kv_ptrs, mask=kv_mask, other=0.0)
                v = tl.load(v_base + kv_ptrs, mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            elif INTERPRET:
                s = tl.dot(q, tl.trans(k.to(tl.float32)))
            else:
                s = tl.dot(q, tl.trans(k))  # [BM, BN] f32
            if phase == 0:  # m in log2 units; one FMA per score (scale > 0: max commutes)
                m_new = tl.maximum(m, tl.max(s, axis=1) * SCALE_LOG2)
                p = tl.math.exp2(s * SCALE_LOG2 - m_new[:, None])
                alpha = tl.math.exp2(m - m_new)
            else:
                s = tl.where(vis, s * SCALE_LOG2, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                # NOTE: rows with nothing visible yet keep m = -inf; shift by 0: no inf - inf.
                shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.math.exp2(s - shift[:, None])
                alpha = tl.math.exp2(m - shift)
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None]
            if IEEE:
                acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
            elif INTERPRET:  # the compiled kernel's rounding of p
                acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc)
            else:
                acc = tl.dot(p.to(v.dtype), v, acc)
            m = m_new

    has_key = pre_seen | (tail_seen > 0)  # from lengths and the mask: a NaN stays a NaN
    safe_l = tl.where(has_key, l, 1.0)
    out = tl.where(has_key[:, None], acc / safe_l[:, None], 0.0)
    lse = tl.where(has_key, (m + tl.math.log2(safe_l)) * 0.6931471805599453, float("-inf"))
    o_off = ((b * NS + split) * QP + query) * HQ + head  # [BM] i64
    if D_PAD:
        o_mask = in_q[:, None] & d_ok[None, :]
    else:
        o_mask = in_q[:, None]
    out = out.to(out_ptr.dtype.element_ty)  # f32 partials, or the final out_dtype (one split)
    tl.store(out_ptr + o_off[:, None] * D + dcol[None, :], out, mask=o_mask)
    tl.store(lse_ptr + o_off, lse, mask=in_q)


def _merge_splits_kernel(
    out_ptr,  # f32[B, NS, R, D] the splits' partial outputs (R = Qp * Hq rows)
    lse_ptr,  # f32[B, NS, R]
    merged_ptr,  # f32[B, R, D] (out)
    merged_lse_ptr,  # f32[B, R] (out)
    NS: tl.constexpr,
    NS_PAD: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    R: tl.constexpr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_BLOCKS: tl.constexpr,
):
    """:func:`merge_splits` in one launch: ``BLOCK_R`` rows x ``BLOCK_D`` columns of one batch
    row per program (``D_BLOCKS`` column blocks); the splits' lse first (the row's max), then
    their outputs ``SPLIT_CHUNK`` splits at a time (unrolled: every load in flight at once).
    Empty splits' outputs are never loaded."""
    row_blocks: tl.constexpr = (R + BLOCK_R - 1) // BLOCK_R
    pid = tl.program_id(0)
    d_block = pid % D_BLOCKS
    pid = pid // D_BLOCKS
    b = (pid // row_blocks).to(tl.int64)
    rows = (pid % row_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    r_ok = rows < R
    dcol = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = dcol < D
    every = tl.arange(0, NS_PAD)
    lse = tl.load(
        lse_ptr + (b * NS + every[:, None]) * R + rows[None, :],
        mask=(every < NS)[:, None] & r_ok[None, :],
        other=float("-inf"),
    )  # [NS_PAD, BR]
    has_key = tl.max((lse != float("-inf")).to(tl.int32), axis=0) > 0  # NaN counts as seen
    top = tl.where(has_key, tl.max(lse, axis=0), 0.0)
    total = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for first in tl.static_range(0, NS, SPLIT_CHUNK):
        split = first + tl.arange(0, SPLIT_CHUNK)  # [SC]
        part = tl.load(
            lse_ptr + (b * NS + split[:, None]) * R + rows[None, :],
            mask=(split < NS)[:, None] & r_ok[None, :],
            other=float("-inf"),
        )  # [SC, BR]
        empty = part == float("-inf")
        weight = tl.where(empty, 0.0, tl.exp(part - top[None, :]))  # a NaN lse: NaN weight
        total += tl.sum(weight, axis=0)
        o_off = ((b * NS + split[:, None, None]) * R + rows[None, :, None]) * D
        o = tl.load(
            out_ptr + o_off + dcol[None, None, :],
            mask=(~empty)[:, :, None] & d_ok[None, None, :],
            other=0.0,
        )  # [SC, BR, BD]
        acc += tl.sum(o * weight[:, :, None], axis=0)
    safe = tl.where(has_key, total, 1.0)
    merged = tl.where(has_key[:, None], acc / safe[:, None], 0.0)
    merged_lse = tl.where(has_key, top + tl.log(safe), float("-inf"))
    m_off = (b * R + rows) * D
    merged = merged.to(merged_ptr.dtype.element_ty)  # the call's out_dtype
    tl.store(
        merged_ptr + m_off[:, None] + dcol[None, :], merged, mask=r_ok[:, None] & d_ok[None, :]
    )
    tl.store(merged_lse_ptr + b * R + rows, merged_lse, mask=r_ok & (d_block == 0))


def get_kernel() -> Any:
    """``triton.jit`` of the kernel for the current mode (:func:`_common.triton_jit`)."""
    return _common.triton_jit(_paged_attention_kernel)


def get_merge_kernel() -> Any:
    """``triton.jit`` of the split merge for the current mode."""
    return _common.triton_jit(_merge_splits_kernel)


# The merge's register tile: at most this many f32 partial-output elements per program and
# loop step (SPLIT_CHUNK x BLOCK_R x BLOCK_D), 4 warps.
MERGE_TILE = 4096
# The head dim is split into column blocks of at least this many (up to the programs a wave
# holds) when the rows alone leave the grid short: the merge is a chain of two dependent loads
# (the lse, then the outputs) per program, so more programs with less to read each finish
# sooner. Measured on the H200 (2026-11-27, bs 1, 33 splits, 8B heads): verify over 8k / 32k
# keys 6.1 / 6.5 -> 3.3 / 3.4 us, decode 5.8 / 6.0 -> 2.2 / 2.3 us; 17 splits 3.9 -> 3.7.
MERGE_MIN_BLOCK_D = 32


def merge_plan(batch: int, num_splits: int, rows: int, dim: int) -> tuple[tuple[int], dict]:
    """Static ``(grid, constexprs)`` of :func:`merge_splits_triton` for ``f32[B, NS, R, D]``
    partials: enough programs of ``BLOCK_R`` rows to fill the GPU (2-64 rows each), the splits
    read ``SPLIT_CHUNK`` at a time within :data:`MERGE_TILE`; a grid still short of
    ``TARGET_PROGRAMS`` splits the head dim into ``D_BLOCKS`` column blocks."""
    full_d = next_power_of_2(dim)
    want = -(-batch * rows // TARGET_PROGRAMS)
    block_r = max(2, min(64, next_power_of_2(want), next_power_of_2(rows)))
    programs = batch * -(-rows // block_r)
    short = next_power_of_2(-(-TARGET_PROGRAMS // programs))
    d_blocks = max(1, min(short, full_d // MERGE_MIN_BLOCK_D))
    block_d = full_d // d_blocks
    chunk = max(1, min(next_power_of_2(num_splits), MERGE_TILE // (block_r * block_d)))
    meta = {
        "NS": num_splits,
        "NS_PAD": next_power_of_2(num_splits),
        "SPLIT_CHUNK": chunk,
        "R": rows,
        "D": dim,
        "BLOCK_R": block_r,
        "BLOCK_D": block_d,
        "D_BLOCKS": d_blocks,
    }
    return (programs * d_blocks,), meta


def is_prefill_shaped(qp: int, hq: int, hkv: int, causal: bool) -> bool:
    """Whether a pass takes the prefill plan: causal with more than MAX_DECODE_ROWS rows."""
    return causal and qp * (hq // hkv) > MAX_DECODE_ROWS


def launch_plan(
    batch: int,
    qp: int,
    hq: int,
    hkv: int,
    dim: int,
    num_pages: int,
    page_size: int,
    tail_len: int,
    pool_dtype: Any,
    *,
    causal: bool,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    tail_split: bool | None = None,
) -> tuple[tuple[int, int], dict[str, Any], dict[str, int]]:
    """Static ``(grid, constexprs, launch options)`` for one pass (``batch * qp > 0``); the
    grid is ``(row blocks x B x Hkv, splits)``.

    Args:
      batch, qp, hq, hkv, dim: ``q``'s ``[B, Qp, Hq, D]`` and the pool's ``Hkv``.
      num_pages, page_size: the page table's width ``C`` and ``P``; tail_len: ``N`` (0: none).
      pool_dtype: the pool's dtype (f32: IEEE dots); causal: the pass's.
      block_m, block_n, num_splits, num_warps, num_stages: None: the defaults below.
      tail_split: with a tail, read it in a split of its own (the grid's last; ``num_splits``
        then counts the prefix splits) instead of after the last split's prefix keys. None:
        when the prefix splits hold at most :data:`TAIL_SPLIT_MAX_BLOCKS` key blocks each.

    Defaults: prefill-shaped passes (:func:`is_prefill_shaped`) 128 x 128 tiles, 8 warps,
    5 stages, no split unless the grid is under one wave; decode-shaped passes ``block_m =
    min(64, next_pow2(Qp * G))``, ``block_n`` from ``C * P`` (:data:`MIN_BLOCK_N`), splits so
    that about :data:`TARGET_PROGRAMS` programs run (none where the grid is half full and the
    loop short: :data:`SPLIT_FULL_GRID_MIN_BLOCKS`). Tiles are at least 16 (``tl.dot``).
    """
    group = hq // hkv
    rows = qp * group
    width = num_pages * page_size
    prefill = is_prefill_shaped(qp, hq, hkv, causal)
    f32 = jnp.dtype(pool_dtype) == jnp.float32
    if block_m is None:
        prefill_m = F32_PREFILL_BLOCK if f32 else PREFILL_BLOCK_M
        block_m = prefill_m if prefill else min(MAX_DECODE_ROWS, next_power_of_2(rows))
    block_m = max(MIN_DOT, block_m)
    if block_n is None:
        keys = next_power_of_2(max(width, tail_len))
        block_n = (
            (F32_PREFILL_BLOCK if f32 else PREFILL_BLOCK_N)
            if prefill
            else min(MAX_BLOCK_N, max(MIN_BLOCK_N, next_power_of_2(width) // 4), keys)
        )
    block_n = max(MIN_DOT, block_n)
    row_blocks = -(-rows // block_m)
    base = batch * hkv * row_blocks
    num_blocks = max(1, -(-width // block_n))
    if num_splits is None:
        if prefill:  # split only a grid under one wave
            num_splits = 1 if base >= NUM_SMS else -(-2 * NUM_SMS // base)
        else:
            nearest = (2 * TARGET_PROGRAMS + base) // (2 * base)  # round(TARGET / base)
            num_splits = max(1, min(nearest, num_blocks // MIN_SPLIT_BLOCKS))
            short = num_blocks < SPLIT_FULL_GRID_MIN_BLOCKS
            if block_m <= MIN_DOT and 2 * base >= TARGET_PROGRAMS and short:
                num_splits = 1  # decode-shaped rows only (draft A's 32-row tiles kept the split)
    num_splits = max(1, min(num_splits, num_blocks))
    split_blocks = -(-num_blocks // num_splits)  # key blocks a prefix split reads
    if tail_split is None:
        tail_split = split_blocks <= TAIL_SPLIT_MAX_BLOCKS
    tail_split = bool(tail_split and tail_len > 0)
    tile_tail = 0 < tail_len <= TAIL_TILE_MAX and num_splits <= TAIL_TILE_MAX_SPLITS
    tail_block = max(MIN_DOT, next_power_of_2(tail_len)) if tile_tail else 0
    meta = {
        "QP": qp,
        "HQ": hq,
        "HKV": hkv,
        "D": dim,
        "PAGE_SIZE": page_size,
        "TAIL_LEN": tail_len,
        "TAIL_BLOCK": tail_block,
        "TAIL_SPLIT": tail_split,
        "CAUSAL": bool(causal),
        "ROW_BLOCKS": row_blocks,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_D": max(MIN_DOT, next_power_of_2(dim)),
        "SCALE_LOG2": float(dim) ** -0.5 * _LOG2E,
        "IEEE": bool(jnp.dtype(pool_dtype) == jnp.float32),
        "INTERPRET": interpreting(),
    }
    if prefill and f32:
        default_warps, default_stages = PREFILL_NUM_WARPS, F32_PREFILL_NUM_STAGES
    elif prefill:
        default_warps, default_stages = PREFILL_NUM_WARPS, PREFILL_NUM_STAGES
    else:
        default_warps = DEFAULT_NUM_WARPS
        default_stages = DEFAULT_NUM_STAGES_SMALL_M if block_m <= MIN_DOT else DEFAULT_NUM_STAGES
        if split_blocks <= STAGE1_MAX_BLOCKS:
            default_stages = 1  # a loop of 1-2 blocks: the pipeline costs more than it hides
    opts = {"num_warps": num_warps or default_warps, "num_stages": num_stages or default_stages}
    return (row_blocks * batch * hkv, num_splits + tail_split), meta, opts


def plan_pages(num_pages: int, page_size: int, max_kv_len: int | None) -> int:
    """The page-table width :func:`launch_plan` plans for: ``C``, or with the launch hint
    ``max_kv_len`` the pages it spans (at least 1, at most ``C``)."""
    if max_kv_len is None:
        return num_pages
    return max(1, min(num_pages, -(-max_kv_len // page_size)))


def merge_splits_triton(
    out: jax.Array, lse: jax.Array, out_dtype: Any = jnp.float32
) -> tuple[jax.Array, jax.Array]:
    """:func:`merge_splits` as one raw Triton launch (:func:`_merge_splits_kernel`; XLA
    lowers the jnp merge to three fusions that cost as much as a short pass's kernel:
    measured on the H100, bs 1 verify over 2k keys, 17 splits: 7 us against the kernel's 12).

    Args: ``out f32[B, NS, Qp, Hq, D]``, ``lse f32[B, NS, Qp, Hq]``; ``out_dtype``: the merged
    output's dtype (written by the kernel: no convert launch after it). Returns as
    merge_splits, the output in ``out_dtype``.
    """
    bsz, ns, qp, hq, dim = out.shape
    if ns == 1:
        return out[:, 0].astype(out_dtype), lse[:, 0]
    grid, meta = merge_plan(bsz, ns, qp * hq, dim)
    merged, merged_lse = _common.jax_triton_call(
        out,
        lse,
        kernel=get_merge_kernel(),
        out_shape=(
            jax.ShapeDtypeStruct((bsz, qp, hq, dim), out_dtype),
            jax.ShapeDtypeStruct((bsz, qp, hq), jnp.float32),
        ),
        grid=grid,
        name="jspec_merge_splits",
        num_warps=4,
        num_stages=1,
        **meta,
    )
    return merged, merged_lse


def paged_attention_triton(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: Any,
    page_table: jax.Array,
    kv_lens: jax.Array,
    q_lens: jax.Array | None = None,
    tail_slot_ids: jax.Array | None = None,
    tail_mask: jax.Array | None = None,
    *,
    page_size: int,
    causal: bool,
    max_kv_len: int | None = None,
    out_dtype: Any = jnp.float32,
    **knobs: Any,
) -> tuple[jax.Array, jax.Array]:
    """:func:`jspec.kernels.paged_attention.paged_attention` through ``jax_triton`` (GPU only).

    Args: as ``paged_attention`` (validated there): ``q: float[B, Qp, Hq, D]`` (cast to the
    pool dtype; the model's activations already are), ``k_pool, v_pool: dtype[L, S, Hkv, D]``,
    ``layer`` an int or a traced i32 scalar, ``page_table: i32[B, C]``, ``kv_lens: i32[B]``,
    ``q_lens: i32[B] | None`` (causal; None: ``Qp``), ``tail_slot_ids: i32[B, N] | None``,
    ``tail_mask: bool[B, Qp, N] | None``; static ``page_size``, ``causal``; ``max_kv_len``:
    the launch hint (the key splits planned for ``ceil(max_kv_len / P)`` pages instead of
    ``C``; a longer row is still read whole); ``out_dtype``: the output's dtype, written by
    the kernel (one split) or the Triton merge, never by a convert after them; ``knobs``:
    static, passed on to
    :func:`launch_plan` (``block_m``, ``block_n``, ``num_splits``, ``num_warps``,
    ``num_stages``, ``tail_split``; None or left out: its default).

    Returns:
      ``(out out_dtype[B, Qp, Hq, D], lse f32[B, Qp, Hq])``; a query that sees nothing: 0,
      -inf.
    """
    bsz, qp, hq, dim = q.shape
    if bsz * qp == 0:
        return (
            jnp.zeros((bsz, qp, hq, dim), out_dtype),
            jnp.full((bsz, qp, hq), -jnp.inf, jnp.float32),
        )
    num_slots, hkv = k_pool.shape[1], k_pool.shape[2]
    if page_table.shape[1] == 0:  # no prefix column (kv_lens are 0): a pointer to something
        page_table = jnp.zeros((bsz, 1), jnp.int32)
    if causal and q_lens is None:
        q_lens = jnp.full((bsz,), qp, jnp.int32)
    tail_len = 0 if tail_slot_ids is None else tail_slot_ids.shape[1]
    # Without a tail both tail operands are unread: kv_lens stands in for them.
    tail_ids, tail_bits = kv_lens, kv_lens
    if tail_len:
        if tail_slot_ids is None or tail_mask is None:
            raise ValueError("tail_slot_ids and tail_mask: give both or neither")
        tail_ids, tail_bits = tail_slot_ids, tail_mask.astype(jnp.int8)
    grid, meta, opts = launch_plan(
        bsz,
        qp,
        hq,
        hkv,
        dim,
        plan_pages(page_table.shape[1], page_size, max_kv_len),
        page_size,
        tail_len,
        k_pool.dtype,
        causal=causal,
        **knobs,
    )
    ns = grid[1]
    out_shape = (
        # One split: the kernel's output is final, written in out_dtype; else f32 partials.
        jax.ShapeDtypeStruct((bsz, ns, qp, hq, dim), out_dtype if ns == 1 else jnp.float32),
        jax.ShapeDtypeStruct((bsz, ns, qp, hq), jnp.float32),
    )
    out, lse = _common.jax_triton_call(
        q.astype(k_pool.dtype),
        k_pool,
        v_pool,
        jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),
        page_table,
        kv_lens,
        q_lens if causal else kv_lens,  # unread when not causal
        tail_ids,
        tail_bits,
        int(page_table.shape[1]),  # Python ints: jax_triton passes them as i32 scalars
        int(num_slots),
        kernel=get_kernel(),
        out_shape=out_shape,
        grid=grid,
        name="jspec_paged_attention",
        **meta,
        **opts,
    )
    # (one split: both merges hand the kernel's output back as it is, already in out_dtype)
    if ns <= XLA_MERGE_MAX_SPLITS and bsz * qp < XLA_MERGE_MAX_ROWS:
        merged, merged_lse = merge_splits(out, lse)  # XLA fuses the cast into the merge
        return merged.astype(out_dtype), merged_lse
    return merge_splits_triton(out, lse, out_dtype)
