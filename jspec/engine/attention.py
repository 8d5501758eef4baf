"""Paged attention passes: the pool rows named by slot ids, masked softmax, merged by LSE.

Every attention in the engine is a list of *passes* merged by log-sum-exp (sglang FA3's
``merge_state_v2``). A pass is ``(kv_slot_ids i32[Bp, W], kv_mask bool[Bp, Qp, W])``: the
queries of the step (flat ``[T]`` tokens) are viewed as ``[Bp, Qp]`` and query ``(r, q)`` sees
the key at slot ``kv_slot_ids[r, w]`` iff ``kv_mask[r, q, w]``. Slot ids come only from the
bookkeeping outputs:

=====================  =========================================================================
use                    passes
=====================  =========================================================================
prefill / extend       row pass: ``req_to_token[row, :W]``, causal ``w <= start + q``
greedy decode          row pass: ``w <= L`` (the new token was written at ``row[L]`` first)
draft decode (FA3)     pass A: full prefix pages, ``page_table[b] // P`` expanded to slots,
                       ``w < L - L % P``, K queries per request (non-causal);
                       pass B: per branch, the ``draft_decode_set_expand_metadata`` page table
                       expanded to slots, ``w < lp + d`` (prefix tail / holes, then this
                       branch's draft tokens), 1 query per branch
target verify          prefix pass ``row[:W]``, ``w < L``; tree pass over the N verify slots
                       with the ``build_tree_kernel_efficient`` ancestor mask
draft extend           prefix pass ``w < L``; causal pass over the N verify-window slots
=====================  =========================================================================

Each pass is one :func:`jspec.kernels.paged_attention.paged_attention` call (``impl="xla"``:
gather + masked softmax in pure jnp; ``"pallas"``: one fused kernel). Softmax math is f32. A
query whose pass sees no key gets ``out = 0`` and ``lse = -inf`` so the merge ignores that pass
(pass A is empty while ``L < P``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jspec._pytree import pytree_dataclass
from jspec.kernels.paged_attention import paged_attention


@pytree_dataclass
class AttnPass:
    """One attention pass over the paged pool."""

    kv_slot_ids: jax.Array  # i32[Bp, W]: token slots to read (0 = padding page)
    kv_mask: jax.Array  # bool[Bp, Qp, W]: query (r, q) sees key w


@pytree_dataclass
class AttnPlan:
    """Where one forward writes its K/V and what each query reads."""

    write_slot_ids: jax.Array  # i32[T]: slot for each token's K/V (0 for padding tokens)
    passes: tuple  # tuple[AttnPass, ...], merged by log-sum-exp


def attend(
    q: jax.Array,
    k_layer: jax.Array,
    v_layer: jax.Array,
    kv_slot_ids: jax.Array,
    kv_mask: jax.Array,
    impl: str = "xla",
) -> tuple[jax.Array, jax.Array]:
    """Masked GQA attention over the pool rows of one layer
    (:func:`jspec.kernels.paged_attention.paged_attention`).

    Args:
      q: dtype[Bp, Qp, Hq, D] queries (RoPE applied).
      k_layer, v_layer: dtype[num_slots, Hkv, D] one layer of the pool.
      kv_slot_ids: i32[Bp, W]; kv_mask: bool[Bp, Qp, W].
      impl: ``"xla"`` (the pure-jnp reference) or ``"pallas"``.

    Returns:
      (out f32[Bp, Qp, Hq, D], lse f32[Bp, Qp, Hq]); rows with no visible key: 0 and -inf.
    """
    return paged_attention(q, k_layer[None], v_layer[None], 0, kv_slot_ids, kv_mask, impl=impl)


def merge_states(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Log-sum-exp merge of two partial attentions (sglang ``merge_state_v2``).

    Args:
      out_*: f32[..., Hq, D]; lse_*: f32[..., Hq] (-inf = the pass saw no key).
    """
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w_a = jnp.where(jnp.isfinite(lse_a), jnp.exp(lse_a - safe), 0.0)
    w_b = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - safe), 0.0)
    return out_a * w_a[..., None] + out_b * w_b[..., None], lse


def run_plan(
    plan: AttnPlan,
    k_pool: jax.Array,
    v_pool: jax.Array,
    layer: int,
    q: jax.Array,
    impl: str = "xla",
) -> jax.Array:
    """All passes of ``plan`` for flat queries ``q: dtype[T, Hq, D]``, merged: f32[T, Hq, D].

    ``k_pool, v_pool: dtype[L, S, Hkv, D]`` (the whole pool; ``layer`` selects one, no slice
    of the pool is materialized); ``impl``: :func:`paged_attention`'s.
    """
    num_tokens, hq, dim = q.shape
    out = lse = None
    for p in plan.passes:
        bp, qp, _ = p.kv_mask.shape
        o, part_lse = paged_attention(
            q.reshape(bp, qp, hq, dim), k_pool, v_pool, layer, p.kv_slot_ids, p.kv_mask, impl=impl
        )
        o, part_lse = o.reshape(num_tokens, hq, dim), part_lse.reshape(num_tokens, hq)
        out, lse = (o, part_lse) if out is None else merge_states(out, lse, o, part_lse)
    return out


def make_attn_fn(
    plan: AttnPlan, set_kv: Callable[..., Any], impl: str = "xla"
) -> Callable[..., Any]:
    """``attn_fn(layer, pool, q, k, v)`` for the model: write K/V at the plan's slots, then read.

    ``set_kv(pool, layer, slot_ids, k, v) -> pool`` is ``jspec.kv.pool.set_kv_buffer``;
    ``impl``: the attention kernel (``EngineConfig.attention_kernel_impl``).
    """

    def attn_fn(layer: int, pool: Any, q: jax.Array, k: jax.Array, v: jax.Array):
        pool = set_kv(
            pool, layer, plan.write_slot_ids, k.astype(pool.k.dtype), v.astype(pool.v.dtype)
        )
        return pool, run_plan(plan, pool.k, pool.v, layer, q, impl)

    return attn_fn


# ---- slot ids and masks -------------------------------------------------------------------------
def row_slot_ids(req_to_token: jax.Array, req_pool_indices: jax.Array, width: int) -> jax.Array:
    """``req_to_token[req_pool_indices, :width]``: i32[B, width] token slots by row position."""
    return req_to_token[req_pool_indices, :width]


def page_table_slot_ids(page_table: jax.Array, page_size: int) -> jax.Array:
    """Expand page ids to token slots: ``i32[R, C] -> i32[R, C * P]`` (slot = page*P + offset).

    This is how FA3 reads a page table: every listed page from offset 0.
    """
    rows, cols = page_table.shape
    offsets = jnp.arange(page_size, dtype=page_table.dtype)
    return (page_table[:, :, None] * page_size + offsets).reshape(rows, cols * page_size)


def length_mask(lengths: jax.Array, num_queries: int, width: int) -> jax.Array:
    """bool[R, Qp, W]: key ``w`` visible iff ``w < lengths[r]`` (non-causal)."""
    cols = jnp.arange(width, dtype=jnp.int32)
    mask = cols[None, :] < lengths[:, None]
    return jnp.broadcast_to(mask[:, None, :], (lengths.shape[0], num_queries, width))


def causal_mask(
    starts: jax.Array, num_queries: int, width: int, lengths: jax.Array | None = None
) -> jax.Array:
    """bool[R, Qp, W]: query q at position ``starts[r] + q`` sees keys ``w <= starts[r] + q``.

    With ``lengths``, keys are further limited to ``w < lengths[r]``.
    """
    cols = jnp.arange(width, dtype=jnp.int32)
    last = starts[:, None] + jnp.arange(num_queries, dtype=jnp.int32)[None, :]  # [R, Qp]
    mask = cols[None, None, :] <= last[:, :, None]
    if lengths is not None:
        mask = mask & (cols[None, None, :] < lengths[:, None, None])
    return mask
