"""``paged_attention``: one GQA attention pass read straight from a paged KV pool by page table.

Every attention of the engine (prefill chunks, greedy decode, draft passes A and B, target
verify, draft extend; :mod:`jspec.engine.attention`) is one or two such passes. A pass takes the
metadata serving stacks already keep: a page table and lengths (FA3's ``page_table`` +
``cache_seqlens``), plus for the tree verify and the draft extend a small tail of ``N`` slots
with its own mask. Queries are ``[B, Qp]`` (row ``b``, query ``i``)::

    prefix key at row position w (0 <= w < kv_lens[b]):  slot = page_table[b, w // P] * P + w % P
    query (b, i) sees prefix key w   iff  w < kv_lens[b]
                                          and, if causal: i < q_lens[b] and
                                                          w <= kv_lens[b] - q_lens[b] + i
    query (b, i) sees tail key j     iff  tail_mask[b, i, j]   (slot tail_slot_ids[b, j])

    s[b, i, h, w] = <q[b, i, h], K[layer, slot(b, w), h // G]> / sqrt(D)   (visible keys only)
    out[b, i, h]  = softmax_w(s) @ V[layer, slot(b, :), h // G],  lse = logsumexp_w(s)
    a query that sees no key: out = 0, lse = -inf (a log-sum-exp merge then ignores the pass)

=========================  ==================================================================
pass (engine)              page_table / kv_lens / causal / tail
=========================  ==================================================================
prefill chunk              row pages; start + chunk_len; causal (q_lens = chunk_len); -
greedy decode              row pages; L + 1 (the new token's K/V written first); -
draft pass A (FA3)         full prefix pages; L - L % P; K queries, non-causal; -
draft pass B (FA3)         the ``draft_decode_set_expand_metadata`` table + cache_seqlens; -
target verify              row pages; L; N queries; tail = the N verify slots, tree mask
draft extend               row pages; L; N queries; tail = the N window slots, causal mask
=========================  ==================================================================

The cost is the KV actually read: no ``[B, context]`` slot list and no ``[B, Q, context]`` mask
exists on the kernel path (``impl="triton"``, :mod:`jspec.kernels.paged_attention_triton`, raw
Triton through jax_triton, GPU only: flash decoding with split-K for decode-shaped passes,
causal flash attention for prefill chunks, the prefix read once per KV head for every query of
a row). ``impl="xla"`` is :func:`paged_attention_reference`, the pure-jnp oracle: it gathers
every listed position of the page table and masks (test sizes, CPU).

NOTE: the page table lists page ids, not token slots (``page_size`` is the table's: the engine
passes the pool's page size, or 1 for FlashInfer-style token indices). Entries past
``ceil(kv_lens / P)`` are never read; every read page id must be in ``[0, S / P)`` (a probe
checks it when probes are on; the kernel has no bounds checks, shared/PLATFORM.md).
NOTE: K/V at positions a row does not read never reach its output (NaN included). A NaN in K/V
that some query of a row reads may reach every query of that row (``0 * NaN`` in ``p @ v``),
in the reference and the kernel alike.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jspec import probes
from jspec._jit import jit
from jspec.kernels import _common

IMPLS = ("xla", "triton", "cudnn")


def _validate(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: Any,
    page_table: jax.Array,
    kv_lens: jax.Array,
    q_lens: jax.Array | None,
    tail_slot_ids: jax.Array | None,
    tail_mask: jax.Array | None,
    page_size: int,
    causal: bool,
) -> None:
    """Trace-time shape / dtype checks (``ValueError`` naming the argument)."""
    probes.static_check(q.ndim == 4, f"q.shape={tuple(q.shape)} must be 4-D ([B, Qp, Hq, D])")
    probes.static_check(
        k_pool.ndim == 4 and k_pool.shape == v_pool.shape,
        f"k_pool.shape={tuple(k_pool.shape)} and v_pool.shape={tuple(v_pool.shape)} must be "
        "equal and 4-D ([L, S, Hkv, D])",
    )
    bsz, qp, hq, dim = q.shape
    num_layers, num_slots, hkv, pool_dim = k_pool.shape
    probes.static_check(pool_dim == dim, f"k_pool head_dim={pool_dim} must equal q's D={dim}")
    probes.static_check(hq % hkv == 0, f"q heads Hq={hq} must be a multiple of Hkv={hkv}")
    probes.static_check_power_of_2(page_size, "page_size")
    probes.static_check(
        num_slots % page_size == 0,
        f"page_size={page_size} must divide the pool's slots S={num_slots}",
    )
    probes.static_check(
        page_table.ndim == 2 and page_table.shape[0] == bsz,
        f"page_table.shape={tuple(page_table.shape)} must be i32[B={bsz}, C]",
    )
    probes.static_check_shape(kv_lens, (bsz,), "kv_lens")
    probes.static_check_dtype(page_table, jnp.int32, "page_table")
    probes.static_check_dtype(kv_lens, jnp.int32, "kv_lens")
    probes.static_check(isinstance(causal, bool), f"causal={causal!r} must be a bool")
    if q_lens is not None:
        probes.static_check(causal, "q_lens is only read by causal passes (causal=True)")
        probes.static_check_shape(q_lens, (bsz,), "q_lens")
        probes.static_check_dtype(q_lens, jnp.int32, "q_lens")
    probes.static_check(
        (tail_slot_ids is None) == (tail_mask is None),
        "tail_slot_ids and tail_mask: give both or neither",
    )
    if tail_slot_ids is not None:
        probes.static_check(
            tail_slot_ids.ndim == 2 and tail_slot_ids.shape[0] == bsz,
            f"tail_slot_ids.shape={tuple(tail_slot_ids.shape)} must be i32[B={bsz}, N]",
        )
        probes.static_check_dtype(tail_slot_ids, jnp.int32, "tail_slot_ids")
        probes.static_check_shape(tail_mask, (bsz, qp, tail_slot_ids.shape[1]), "tail_mask")
        probes.static_check_dtype(tail_mask, jnp.bool_, "tail_mask")
    if isinstance(layer, int):
        probes.static_check(
            not isinstance(layer, bool) and 0 <= layer < num_layers,
            f"layer={layer!r} must be in [0, L={num_layers})",
        )


OUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _check_out_dtype(out_dtype: Any) -> Any:
    """``out_dtype`` as a numpy dtype (None: f32), one of :data:`OUT_DTYPES` (``ValueError``
    naming it)."""
    if out_dtype is None:
        return jnp.dtype(jnp.float32)
    try:
        dtype = jnp.dtype(out_dtype)
    except TypeError:
        dtype = None
    probes.static_check(
        dtype in tuple(map(jnp.dtype, OUT_DTYPES)),
        f"out_dtype={out_dtype!r} must be None, float32, bfloat16 or float16",
    )
    return dtype


def _check_prefix_bound(max_prefix_len: Any, causal: bool) -> None:
    """``max_prefix_len``: None, or an int >= 0 on a causal pass (``ValueError`` naming it)."""
    if max_prefix_len is None:
        return
    probes.static_check(
        isinstance(max_prefix_len, int)
        and not isinstance(max_prefix_len, bool)
        and max_prefix_len >= 0,
        f"max_prefix_len={max_prefix_len!r} must be None or an int >= 0",
    )
    probes.static_check(causal, "max_prefix_len bounds causal passes only (causal=True)")


def _probe(
    page_table: jax.Array,
    kv_lens: jax.Array,
    q_lens: jax.Array | None,
    tail_slot_ids: jax.Array | None,
    num_slots: int,
    page_size: int,
    num_queries: int,
    max_prefix_len: int | None = None,
) -> None:
    """Runtime checks (probes on only): lengths in range (keys before the queries within
    ``max_prefix_len`` when given), every read page id / slot in range."""
    width = page_table.shape[1] * page_size
    probes.detect_in_closed_range(kv_lens, 0, width, "paged_attention: kv_lens vs page_table")
    if q_lens is not None:
        probes.detect_in_closed_range(q_lens, 0, num_queries, "paged_attention: q_lens vs Qp")
        probes.detect_in_closed_range(
            kv_lens - q_lens, 0, width, "paged_attention: kv_lens - q_lens (causal offset)"
        )
    if max_prefix_len is not None:
        ql = jnp.full_like(kv_lens, num_queries) if q_lens is None else q_lens
        probes.detect_in_closed_range(
            kv_lens - ql, 0, max_prefix_len, "paged_attention: kv_lens - q_lens vs max_prefix_len"
        )
    cols = jnp.arange(page_table.shape[1], dtype=jnp.int32)
    read = cols[None, :] * page_size < kv_lens[:, None]
    probes.detect_oob(
        jnp.where(read, page_table, 0),
        0,
        num_slots // page_size,
        "paged_attention: page id read from page_table",
    )
    if tail_slot_ids is not None:
        probes.detect_oob(tail_slot_ids, 0, num_slots, "paged_attention: tail_slot_ids")


def visibility(
    page_table: jax.Array,
    kv_lens: jax.Array,
    q_lens: jax.Array | None,
    num_queries: int,
    *,
    page_size: int,
    causal: bool,
) -> tuple[jax.Array, jax.Array]:
    """Dense form of a pass's prefix (the reference's and the tests' view).

    Returns:
      ``(slots i32[B, C*P], visible bool[B, Qp, C*P])``: the token slot of every listed row
      position (0 where ``w >= kv_lens``) and which query sees it.
    """
    width = page_table.shape[1] * page_size
    pos = jnp.arange(width, dtype=jnp.int32)
    key_ok = pos[None, :] < kv_lens[:, None]  # [B, W]
    slots = page_table[:, pos // page_size] * page_size + pos % page_size
    slots = jnp.where(key_ok, slots, 0)
    visible = jnp.broadcast_to(key_ok[:, None, :], (kv_lens.shape[0], num_queries, width))
    if causal:
        ql = jnp.full_like(kv_lens, num_queries) if q_lens is None else q_lens
        query = jnp.arange(num_queries, dtype=jnp.int32)
        last = (kv_lens - ql)[:, None] + query[None, :]  # [B, Qp] position of query i
        visible = visible & (pos[None, None, :] <= last[:, :, None])
        visible = visible & (query[None, :] < ql[:, None])[:, :, None]
    return slots, visible


# ---- reference ------------------------------------------------------------------------------
def paged_attention_reference(
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
    causal: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp oracle: gather every listed position, masked softmax in f32 (HIGHEST).

    Args: as :func:`paged_attention`.

    Returns:
      ``(out f32[B, Qp, Hq, D], lse f32[B, Qp, Hq])``; queries with no visible key: 0, -inf.
    """
    bsz, qp, hq, dim = q.shape
    hkv = k_pool.shape[2]
    slots, visible = visibility(page_table, kv_lens, q_lens, qp, page_size=page_size, causal=causal)
    key_ok = jnp.any(visible, axis=1)  # [B, W] read by some query of the row
    if tail_slot_ids is not None:
        if tail_mask is None:
            raise ValueError("tail_slot_ids and tail_mask: give both or neither")
        tail_ok = jnp.any(tail_mask, axis=1)  # [B, N]
        slots = jnp.concatenate([slots, jnp.where(tail_ok, tail_slot_ids, 0)], axis=1)
        visible = jnp.concatenate([visible, tail_mask], axis=2)
        key_ok = jnp.concatenate([key_ok, tail_ok], axis=1)
    # NOTE: k_pool[layer, slots], one gather over the 4-D pool: ``k_pool[layer]`` with a traced
    # layer would first copy a whole layer of the pool.
    keep = key_ok[:, :, None, None]
    k = jnp.where(keep, k_pool[layer, slots].astype(jnp.float32), 0.0)  # [B, W, Hkv, D]
    v = jnp.where(keep, v_pool[layer, slots].astype(jnp.float32), 0.0)
    qg = q.astype(jnp.float32).reshape(bsz, qp, hkv, hq // hkv, dim)
    # NOTE: HIGHEST: the GPU's default f32 matmul is TF32 (protocol.matmul_precision).
    hp = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("bqhgd,bwhd->bqhgw", qg, k, precision=hp) * (dim**-0.5)
    mask = visible[:, :, None, None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    has_key = jnp.any(mask, axis=-1)  # from the mask, never from the scores: NaN stays NaN
    row_max = jnp.where(has_key, jnp.max(scores, axis=-1), 0.0)
    probs = jnp.where(mask, jnp.exp(scores - row_max[..., None]), 0.0)
    denom = jnp.sum(probs, axis=-1)
    safe = jnp.where(has_key, denom, 1.0)
    out = jnp.einsum("bqhgw,bwhd->bqhgd", probs, v, precision=hp) / safe[..., None]
    out = jnp.where(has_key[..., None], out, 0.0)
    lse = jnp.where(has_key, row_max + jnp.log(safe), -jnp.inf)
    return out.reshape(bsz, qp, hq, dim), lse.reshape(bsz, qp, hq)


# ---- public op --------------------------------------------------------------------------------
@jit(
    static_argnames=(
        "page_size",
        "causal",
        "impl",
        "block_m",
        "block_n",
        "num_splits",
        "num_warps",
        "num_stages",
        "max_kv_len",
        "tail_split",
        "max_prefix_len",
        "out_dtype",
    ),
)
def paged_attention(
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
    causal: bool = False,
    impl: str = "xla",
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_kv_len: int | None = None,
    tail_split: bool | None = None,
    max_prefix_len: int | None = None,
    out_dtype: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """One GQA attention pass of ``q`` over a paged KV pool (module docstring).

    Args:
      q: float[B, Qp, Hq, D] queries (RoPE applied).
      k_pool, v_pool: dtype[L, S, Hkv, D] the whole pool (``KVPool.k`` / ``.v``; slot
        ``s`` = page ``s // P``, offset ``s % P``).
      layer: the layer to read: an int in ``[0, L)`` or a traced i32 scalar.
      page_table: i32[B, C] page ids of each row's positions ``[c*P, (c+1)*P)``; entries
        past ``ceil(kv_lens / P)`` are ignored (0 by convention).
      kv_lens: i32[B] prefix keys of each row (positions ``[0, kv_lens)``, ``<= C*P``).
      q_lens: i32[B] real queries per row (causal passes only; default ``Qp``): query ``i``
        sits at position ``kv_lens - q_lens + i``; queries ``i >= q_lens`` see nothing.
      tail_slot_ids: optional i32[B, N] token slots of extra keys (verify / extend window).
      tail_mask: bool[B, Qp, N]: query ``(b, i)`` sees tail key ``j``.
      page_size: static tokens per page-table entry (power of 2 dividing ``S``).
      causal: static; see ``q_lens``.
      impl: ``"xla"`` (:func:`paged_attention_reference`), ``"triton"`` (GPU only) or
        ``"cudnn"`` (GPU only: causal passes without a tail through cuDNN's flash attention,
        :mod:`jspec.kernels.paged_prefill_cudnn`, bf16 / f16 pools; every other pass Triton).
      block_m, block_n, num_splits, num_warps, num_stages: static Triton launch knobs
        (``None``: the kernel's launch plan; ignored by ``"xla"``).
      max_kv_len: static launch hint (FlashAttention's ``max_seqlen_k``, FlashInfer's plan): the
        most prefix keys a row of this call reads. The Triton plan sizes its key splits and
        blocks for ``min(C * P, max_kv_len)`` keys instead of the page table's whole width, so a
        short batch in a wide table does not pay for the width (measured: 2-3x on 128-key
        passes in 8k-key tables). Not a bound: a longer row is still read whole, with fewer
        splits. None: the width. Ignored by ``"xla"``.
      tail_split: static Triton launch knob: read the tail in a split of its own (None: the
        kernel's launch plan; ignored by ``"xla"`` and without a tail).
      max_prefix_len: static bound, causal passes only: no row has more than this many keys
        before its queries (``kv_lens - q_lens``; 0: every row's chunk starts at position 0,
        as first prefill chunks do). A bound, unlike ``max_kv_len``: ``"cudnn"`` gathers the
        prefix only this wide and skips it at 0, and gives a row past it NaN outputs (never a
        wrong number; a probe names the row when probes are on). ``"triton"`` and ``"xla"``
        read by ``kv_lens`` and ignore it. None: no bound.
      out_dtype: static; the output's dtype: None or float32 (f32), bfloat16 or float16 (what
        FlashAttention and FlashInfer return: the activations' dtype). The output is computed
        in f32 and rounded once to nearest even; ``"triton"`` writes it in this dtype from the
        kernel or its split merge, so a model that wants its activations' dtype pays no
        convert launch. ``lse`` is f32 whatever this is.

    Returns:
      ``(out out_dtype[B, Qp, Hq, D], lse f32[B, Qp, Hq])``: a query that sees no key gets
      ``out = 0`` and ``lse = -inf``.
    """
    _validate(
        q,
        k_pool,
        v_pool,
        layer,
        page_table,
        kv_lens,
        q_lens,
        tail_slot_ids,
        tail_mask,
        page_size,
        causal,
    )
    # NOTE: Any values: the launch knobs, passed whole to the Triton wrapper's typed keywords.
    tuning: dict[str, Any] = {
        "max_kv_len": max_kv_len,
        "block_m": block_m,
        "block_n": block_n,
        "num_splits": num_splits,
        "num_warps": num_warps,
        "num_stages": num_stages,
        "tail_split": tail_split,
    }
    # num_splits and num_stages are any positive ints (the others powers of 2).
    _common.validate_tuning(block_m=block_m, block_n=block_n, num_warps=num_warps)
    for name in ("num_splits", "num_stages", "max_kv_len"):
        probes.static_check(
            tuning[name] is None or (isinstance(tuning[name], int) and tuning[name] >= 1),
            f"{name}={tuning[name]!r} must be None or an int >= 1",
        )
    probes.static_check(
        tail_split is None or isinstance(tail_split, bool),
        f"tail_split={tail_split!r} must be None or a bool",
    )
    _check_prefix_bound(max_prefix_len, causal)
    out_dtype = _check_out_dtype(out_dtype)
    impl = _common.resolve_impl(impl, IMPLS, "paged_attention")
    if probes.probes_on():
        _probe(
            page_table,
            kv_lens,
            q_lens,
            tail_slot_ids,
            k_pool.shape[1],
            page_size,
            q.shape[1],
            max_prefix_len,
        )
    args = (q, k_pool, v_pool, layer, page_table, kv_lens, q_lens, tail_slot_ids, tail_mask)
    if impl == "xla" or q.shape[0] * q.shape[1] == 0:
        out, lse = paged_attention_reference(*args, page_size=page_size, causal=causal)
        return out.astype(out_dtype), lse
    if impl == "cudnn" and causal and tail_slot_ids is None:
        from jspec.kernels.paged_prefill_cudnn import paged_prefill_cudnn

        out, lse = paged_prefill_cudnn(
            *args[:7], page_size=page_size, max_prefix_len=max_prefix_len
        )
        return out.astype(out_dtype), lse
    from jspec.kernels.paged_attention_triton import paged_attention_triton

    return paged_attention_triton(
        *args, page_size=page_size, causal=causal, out_dtype=out_dtype, **tuning
    )
