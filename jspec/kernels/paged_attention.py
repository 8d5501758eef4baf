# Over 400 lines: one op: validation, the pure-jnp reference, the Pallas kernel with its launch
# shape, and the wrapper (the raw Triton impl is paged_attention_triton.py).
"""``paged_attention``: one masked GQA attention pass over token slots of a paged KV pool.

The engine's every attention (prefill, greedy decode, draft decode passes A and B, target
verify, draft extend; see :mod:`jspec.engine.attention`) is a list of passes merged by
log-sum-exp. One pass: the queries ``q[b, i]`` (``i < Qp``) see the keys at token slots
``kv_slot_ids[b, w]`` for which ``kv_mask[b, i, w]`` is set::

    s[b, i, h, w]   = <q[b, i, h], K[layer, kv_slot_ids[b, w], h // G]> / sqrt(D)   (masked)
    out[b, i, h]    = softmax_w(s) @ V[layer, kv_slot_ids[b, :], h // G]
    lse[b, i, h]    = logsumexp_w(s)           # out = 0, lse = -inf when nothing is visible

* ``impl="xla"``: :func:`paged_attention_reference`: gather the ``W`` rows, two f32
  ``HIGHEST``-precision einsums and a masked softmax (4-6 XLA kernels per pass, the gathered
  ``[Bp, W, Hkv, D]`` K and V written to memory).
* ``impl="triton"``: a raw Triton flash-decoding kernel through ``jax_triton`` (GPU only;
  :mod:`jspec.kernels.paged_attention_triton`): K and V read from the pool in their stored
  dtype (bf16 tensor-core dots with f32 accumulation), W split across programs, the splits
  merged by log-sum-exp. The fast path at head_dim 64 / 128.
* ``impl="pallas"``: one program per (query row ``b``, KV head, block of query x group rows).
  The ``G = Hq / Hkv`` query heads sharing a KV head are stacked into the program's rows, so
  K and V are gathered from the pool once per KV head. Keys are read in blocks of
  ``block_w`` slots (gathered straight from the pool, never written back) with an online
  softmax (FlashAttention-2 style)::

      rows r = (query i = r // G, head h = kv_head * G + r % G)      [BQ]   (masked: i < Qp)
      for w0 in 0, BW, 2 BW, ... < W:
          slots = kv_slot_ids[b, w0 : w0 + BW]                      [BW]   (masked: w < W)
          k, v  = pool[layer, slots, kv_head, chunk c]              [BW, BD] per chunk (f32)
          s     = sum_c q[c] @ k[c].T * scale, masked -> -inf        [BQ, BW]
          m'    = max(m, max_w s);  p = exp(s - m');  a = exp(m - m')
          l     = a * l + sum_w p;  acc[c] = a * acc[c] + p @ v[c]
          m     = m'
      out = acc / l; lse = m + log(l)       (l == 0: 0 and -inf, as the reference)

  The head dim is processed in chunks of ``block_d`` columns (default 32). Both products are
  ``jnp.dot(..., precision=HIGHEST)`` on f32 tiles: the Triton lowering makes them IEEE-f32
  ``tl.dot`` (no TF32), which keeps greedy and speculative decoding on the same argmax (the
  lossless guarantee; ``jspec.engine.protocol.matmul_precision``). An IEEE-f32 ``tl.dot`` runs on
  FMA units and keeps its whole inner dimension in registers: unchunked, D = 128 spilled
  (measured on the H200: 30x slower than XLA on the verify prefix pass). ``tl.dot`` wants every
  tile dimension >= 16, so ``BQ``, ``BW`` and ``BD`` are powers of 2 >= 16 (``D`` need not be a
  power of 2: the tail columns are masked).

The pool is passed whole (``[L, S, Hkv, D]`` viewed as ``[L, S, Hkv * D]``, a free reshape)
and the static layer index offsets the kernel's loads, so no per-layer slice of the pool is
materialized for the custom call.

NOTE: not bit-identical to the reference (online vs two-pass softmax, a different summation
order in the products): equal to ~1e-6 relative in f32. Use one impl for runs that must agree
token for token (the engine uses the same impl for greedy and speculative decoding).
NOTE (shared/PLATFORM.md): no bounds checks inside the kernel; slot ids must be in
``[0, S)``. Interpret mode clamps out-of-range loads, the GPU reads whatever is there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jspec import probes
from jspec.kernels import _common

IMPLS = ("xla", "pallas", "triton")
# Smallest tile side: tl.dot needs every dimension of its operands >= 16.
MIN_DOT = 16
# Default launch. Query x group rows per program at most (more rows: more programs along grid
# axis 2); key slots per loop iteration; head-dim columns per chunk (the dots run per chunk).
# The [BQ, BW] scores and per chunk the [BQ, BD] q / accumulator and [BW, BD] K / V tiles live
# in registers.
MAX_BLOCK_Q = 64
DEFAULT_BLOCK_W = 32
MAX_BLOCK_D = 32
DEFAULT_NUM_WARPS = 4


def _validate(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: int,
    kv_slot_ids: jax.Array,
    kv_mask: jax.Array,
) -> None:
    probes.static_check(q.ndim == 4, f"q.shape={tuple(q.shape)} must be 4-D (f32[Bp, Qp, Hq, D])")
    probes.static_check(
        k_pool.ndim == 4 and k_pool.shape == v_pool.shape,
        f"k_pool.shape={tuple(k_pool.shape)} and v_pool.shape="
        f"{tuple(v_pool.shape)} must be equal and 4-D ([L, S, Hkv, D])",
    )
    bp, qp, hq, dim = q.shape
    hkv = k_pool.shape[2]
    probes.static_check(
        k_pool.shape[3] == dim, f"k_pool head_dim={k_pool.shape[3]} must equal q head_dim={dim}"
    )
    probes.static_check(hq % hkv == 0, f"q heads Hq={hq} must be a multiple of Hkv={hkv}")
    probes.static_check(
        kv_slot_ids.ndim == 2 and kv_slot_ids.shape[0] == bp,
        f"kv_slot_ids.shape={tuple(kv_slot_ids.shape)} must be i32[Bp={bp}, W]",
    )
    probes.static_check_shape(kv_mask, (bp, qp, kv_slot_ids.shape[1]), "kv_mask")
    probes.static_check(
        jnp.issubdtype(kv_slot_ids.dtype, jnp.integer),
        f"kv_slot_ids.dtype={kv_slot_ids.dtype} must be an integer dtype",
    )
    probes.static_check(
        isinstance(layer, int) and not isinstance(layer, bool) and 0 <= layer < k_pool.shape[0],
        f"layer={layer!r} must be a static int in [0, L={k_pool.shape[0]})",
    )


# ---- reference ------------------------------------------------------------------------------
def paged_attention_reference(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: int,
    kv_slot_ids: jax.Array,
    kv_mask: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp oracle: gather the pool rows, masked softmax in f32 (HIGHEST precision).

    Args: as :func:`paged_attention`.

    Returns:
      ``(out f32[Bp, Qp, Hq, D], lse f32[Bp, Qp, Hq])``; rows with no visible key: 0, -inf.
    """
    bp, qp, hq, dim = q.shape
    hkv = k_pool.shape[2]
    k = k_pool[layer][kv_slot_ids].astype(jnp.float32)  # [Bp, W, Hkv, D]
    v = v_pool[layer][kv_slot_ids].astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(bp, qp, hkv, hq // hkv, dim)
    # NOTE: HIGHEST: the GPU's default f32 matmul is TF32 (protocol.matmul_precision).
    scores = jnp.einsum("bqhgd,bwhd->bqhgw", qg, k, precision=jax.lax.Precision.HIGHEST)
    scores = scores * (dim**-0.5)
    mask = kv_mask[:, :, None, None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.where(mask, jnp.exp(scores - row_max[..., None]), 0.0)
    denom = jnp.sum(probs, axis=-1)
    out = jnp.einsum("bqhgw,bwhd->bqhgd", probs, v, precision=jax.lax.Precision.HIGHEST)
    has_key = denom > 0
    out = jnp.where(has_key[..., None], out / jnp.where(has_key, denom, 1.0)[..., None], 0.0)
    lse = jnp.where(has_key, row_max + jnp.log(jnp.where(has_key, denom, 1.0)), -jnp.inf)
    return out.reshape(bp, qp, hq, dim), lse.reshape(bp, qp, hq)


# ---- Pallas kernel ---------------------------------------------------------------------------
def _paged_attention_kernel(
    q_ref,  # f32[Bp, Qp, Hq * D]
    k_ref,  # dtype[L, S, Hkv * D]
    v_ref,  # dtype[L, S, Hkv * D]
    slot_ref,  # i32[Bp, W]
    mask_ref,  # i8[Bp, Qp, W]
    out_ref,  # f32[Bp, Qp, Hq * D] (out)
    lse_ref,  # f32[Bp, Qp, Hq] (out)
    *,
    layer: int,
    num_queries: int,
    width: int,
    dim: int,
    group: int,
    block_q: int,
    block_w: int,
    block_d: int,
    scale: float,
):
    from jax.experimental.pallas import triton as pltriton

    hp = jax.lax.Precision.HIGHEST
    b, kv_head, qb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = qb * block_q + jnp.arange(block_q, dtype=jnp.int32)  # [BQ] query x group rows
    query = rows // group
    head = kv_head * group + rows % group  # [BQ] query head of each row
    row_ok = query < num_queries
    # Head dim in chunks of BD columns: every dot has a small inner dimension (the FMA dot of
    # an IEEE-f32 tl.dot keeps its whole inner dimension in registers).
    chunks = []  # (cols [BD] within the head, ok [BD])
    for c0 in range(0, dim, block_d):
        cols = c0 + jnp.arange(block_d, dtype=jnp.int32)
        chunks.append((cols, cols < dim))
    q = [
        pltriton.load(
            q_ref.at[b, query[:, None], head[:, None] * dim + cols[None, :]],
            mask=row_ok[:, None] & ok[None, :],
            other=0.0,
        ).astype(jnp.float32)
        for cols, ok in chunks
    ]  # [BQ, BD] each

    def body(blk, carry):
        m, l, acc = carry  # [BQ], [BQ], list of [BQ, BD]
        w = blk * block_w + jnp.arange(block_w, dtype=jnp.int32)  # [BW]
        w_ok = w < width
        slots = pltriton.load(slot_ref.at[b, w], mask=w_ok, other=0)  # [BW] token slots

        def load_kv(ref, cols, ok):  # [BW, BD] f32: the chunk of this KV head's rows
            return pltriton.load(
                ref.at[layer, slots[:, None], kv_head * dim + cols[None, :]],
                mask=w_ok[:, None] & ok[None, :],
                other=0,
            ).astype(jnp.float32)

        visible = (
            pltriton.load(
                mask_ref.at[b, query[:, None], w[None, :]],
                mask=row_ok[:, None] & w_ok[None, :],
                other=0,
            )
            != 0
        )  # [BQ, BW]
        s = None
        for q_c, (cols, ok) in zip(q, chunks):  # s = q @ k.T over the chunks: [BQ, BW]
            part = jax.lax.dot_general(
                q_c, load_kv(k_ref, cols, ok), (((1,), (1,)), ((), ())), precision=hp
            )
            s = part if s is None else s + part
        s = jnp.where(visible, s * scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # NOTE: rows with nothing visible yet keep m = -inf; shift by 0 so no inf - inf.
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.where(visible, jnp.exp(s - shift[:, None]), 0.0)  # [BQ, BW]
        alpha = jnp.exp(m - shift)  # [BQ]; 0 while m = -inf
        l = l * alpha + jnp.sum(p, axis=1)
        acc = [
            a * alpha[:, None] + jnp.dot(p, load_kv(v_ref, cols, ok), precision=hp)
            for a, (cols, ok) in zip(acc, chunks)
        ]
        return m_new, l, acc

    carry = (
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
        [jnp.zeros((block_q, block_d), jnp.float32) for _ in chunks],
    )
    m, l, acc = jax.lax.fori_loop(0, pl.cdiv(width, block_w), body, carry)
    has_key = l > 0
    safe_l = jnp.where(has_key, l, 1.0)
    for a, (cols, ok) in zip(acc, chunks):
        pltriton.store(
            out_ref.at[b, query[:, None], head[:, None] * dim + cols[None, :]],
            jnp.where(has_key[:, None], a / safe_l[:, None], 0.0),
            mask=row_ok[:, None] & ok[None, :],
        )
    pltriton.store(
        lse_ref.at[b, query, head], jnp.where(has_key, m + jnp.log(safe_l), -jnp.inf), mask=row_ok
    )


def _launch_shape(
    num_rows: int,
    width: int,
    dim: int,
    block_q: int | None,
    block_w: int | None,
    block_d: int | None,
    num_warps: int | None,
) -> tuple[int, int, int, int]:
    """Static ``(block_q, block_w, block_d, num_warps)``: powers of 2, tiles >= :data:`MIN_DOT`.

    Defaults: see :data:`MAX_BLOCK_Q`, :data:`DEFAULT_BLOCK_W`, :data:`MAX_BLOCK_D`.
    """
    if block_q is None:
        block_q = min(MAX_BLOCK_Q, _common.next_power_of_2(num_rows))
    if block_w is None:
        block_w = min(DEFAULT_BLOCK_W, _common.next_power_of_2(width))
    if block_d is None:
        block_d = min(MAX_BLOCK_D, _common.next_power_of_2(dim))
    return (
        max(MIN_DOT, block_q),
        max(MIN_DOT, block_w),
        max(MIN_DOT, block_d),
        num_warps or DEFAULT_NUM_WARPS,
    )


def _paged_attention_pallas(
    q,
    k_pool,
    v_pool,
    layer,
    kv_slot_ids,
    kv_mask,
    *,
    interpret: bool,
    block_q: int | None,
    block_w: int | None,
    block_d: int | None,
    num_warps: int | None,
):
    bp, qp, hq, dim = q.shape
    num_layers, num_slots, hkv, _ = k_pool.shape
    width = kv_slot_ids.shape[1]
    group = hq // hkv
    block_q, block_w, block_d, num_warps = _launch_shape(
        qp * group, width, dim, block_q, block_w, block_d, num_warps
    )
    kernel = functools.partial(
        _paged_attention_kernel,
        layer=layer,
        num_queries=qp,
        width=width,
        dim=dim,
        group=group,
        block_q=block_q,
        block_w=block_w,
        block_d=block_d,
        scale=float(dim) ** -0.5,
    )
    out, lse = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((bp, qp, hq * dim), jnp.float32),
            jax.ShapeDtypeStruct((bp, qp, hq), jnp.float32),
        ),
        grid=(bp, hkv, pl.cdiv(qp * group, block_q)),
        interpret=interpret,
        compiler_params=None if interpret else _common.triton_params(num_warps=num_warps),
        name="jspec_paged_attention",
    )(
        q.astype(jnp.float32).reshape(bp, qp, hq * dim),
        k_pool.reshape(num_layers, num_slots, hkv * dim),
        v_pool.reshape(num_layers, num_slots, hkv * dim),
        kv_slot_ids.astype(jnp.int32),
        kv_mask.astype(jnp.int8),
    )
    return out.reshape(bp, qp, hq, dim), lse


# ---- public wrapper --------------------------------------------------------------------------
@functools.partial(
    jax.jit,
    static_argnames=("layer", "impl", "interpret", "block_q", "block_w", "block_d", "num_warps"),
)
def paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: int,
    kv_slot_ids: jax.Array,
    kv_mask: jax.Array,
    *,
    impl: str = "xla",
    interpret: bool | None = None,
    block_q: int | None = None,
    block_w: int | None = None,
    block_d: int | None = None,
    num_warps: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Masked GQA attention of ``q`` over the pool rows at ``kv_slot_ids`` (one pass).

    Args:
      q: float[Bp, Qp, Hq, D] queries (RoPE applied; computed in f32).
      k_pool, v_pool: dtype[L, S, Hkv, D] the whole pool (``KVPool.k`` / ``.v``).
      layer: static int, the layer to read (``0 <= layer < L``).
      kv_slot_ids: i32[Bp, W] token slots (not page ids) of the keys of row ``b``; entries
        the mask hides may be any slot in ``[0, S)`` (0, the padding page, by convention).
      kv_mask: bool[Bp, Qp, W]: query ``(b, i)`` sees key ``w``.
      impl: ``"xla"`` (:func:`paged_attention_reference`), ``"pallas"`` or ``"triton"`` (GPU
        only; ``block_q`` / ``block_w`` / ``num_warps`` are its block_m / block_n / warps,
        ``block_d`` is ignored).
      interpret: Pallas interpret mode; ``None`` means interpret off the GPU.
      block_q: static query x group rows per program (power of 2; at least 16 is used);
        default ``min(64, next_pow2(Qp * Hq / Hkv))``.
      block_w: static key slots per loop iteration (power of 2, >= 16 used; default 32).
      block_d: static head-dim columns per chunk (power of 2, >= 16 used; default 32).
      num_warps: static Triton warps per program (power of 2; default 4).

    Returns:
      ``(out f32[Bp, Qp, Hq, D], lse f32[Bp, Qp, Hq])``: a query that sees no key gets
      ``out = 0`` and ``lse = -inf`` (so a log-sum-exp merge ignores this pass).
    """
    tuning = {"block_q": block_q, "block_w": block_w, "block_d": block_d, "num_warps": num_warps}
    _validate(q, k_pool, v_pool, layer, kv_slot_ids, kv_mask)
    _common.validate_tuning(**tuning)
    impl = _common.resolve_impl(impl, IMPLS, "paged_attention")
    bp, qp = q.shape[:2]
    if impl == "xla" or bp * qp * kv_slot_ids.shape[1] == 0:
        return paged_attention_reference(q, k_pool, v_pool, layer, kv_slot_ids, kv_mask)
    if impl == "triton":
        from jspec.kernels.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(
            q,
            k_pool,
            v_pool,
            layer,
            kv_slot_ids,
            kv_mask,
            block_m=block_q,
            block_n=block_w,
            num_warps=num_warps,
        )
    return _paged_attention_pallas(
        q,
        k_pool,
        v_pool,
        layer,
        kv_slot_ids,
        kv_mask,
        interpret=_common.resolve_interpret(interpret),
        **tuning,
    )
