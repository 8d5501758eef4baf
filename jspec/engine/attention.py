"""The engine's attention seam: an attention backend over per-pass ``AttentionMetadata``.

Every attention of a step is one or two passes (:class:`jspec.attention_meta.AttentionMetadata`:
a page table, lengths, the query layout and an optional tail of ``N`` slots) merged by
log-sum-exp (sglang FA3's ``merge_state_v2``). The passes the engine builds:

=====================  =========================================================================
use                    passes (queries ``[B, Qp]``)
=====================  =========================================================================
prefill chunk          row pages, ``kv_lens = start + len``, causal (``q_lens = len``)
greedy decode          row pages, ``kv_lens = L + 1`` (the new token was written at row[L])
draft decode (FA3)     pass A: full prefix pages, ``kv_lens = L - L % P``, K queries;
                       pass B: per branch (1 query) the ``draft_decode_set_expand_metadata``
                       page table and ``cache_seqlens = lp + d``
draft decode (FI)      one pass per branch: its kv_indices segment as a ``page_size = 1`` table
target verify          row pages, ``kv_lens = L``, tail = the N verify slots with the tree mask
draft extend           row pages, ``kv_lens = L``, tail = the N window slots, causal
=====================  =========================================================================

An **attention backend** (:class:`AttentionBackend`) writes a layer's new K/V and reads a pass;
the model never sees it: :func:`make_attn_fn` turns a backend and an :class:`AttnPlan` into the
model's ``attn_fn(layer, pool, q, k, v) -> (pool, out)``. :class:`PagedAttentionBackend` is
jspec's (``impl="xla"``: the pure-jnp reference that gathers pages, the oracle; ``"triton"``:
kernels reading K/V straight from pool pages); any object with the two methods and a hash
(``EngineConfig.attention_backend``) drives the same steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax

from jspec._pytree import pytree_dataclass
from jspec.attention_meta.metadata import AttentionMetadata
from jspec.kernels.merge_state import merge_states
from jspec.kernels.paged_attention import paged_attention
from jspec.kernels.paged_prefill_cudnn import CUDNN_MIN_QUERIES, supports
from jspec.kv.pool import set_kv_buffer


class AttentionBackend(Protocol):
    """How a step writes and reads one layer's K/V (static, hashable: part of the jit key)."""

    def write_kv(
        self, pool: Any, layer: int, slot_ids: jax.Array, k: jax.Array, v: jax.Array
    ) -> Any:
        """``pool`` with ``k, v: dtype[T, Hkv, D]`` written at token slots ``i32[T]``."""
        ...

    def attend(
        self, pool: Any, layer: int, q: jax.Array, meta: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array]:
        """One pass: ``q: dtype[B, Qp, Hq, D]`` -> ``(out float[B, Qp, Hq, D], lse f32[B, Qp,
        Hq])`` (no visible key: 0, -inf); ``out`` in f32 or in ``q``'s dtype (as FlashAttention
        and FlashInfer return it): :func:`run_plan` merges passes in f32 either way."""
        ...


@dataclasses.dataclass(frozen=True)
class PagedAttentionBackend:
    """jspec's backend over :class:`jspec.kv.KVPool` (``[L, S, Hkv, D]`` K and V).

    Attributes:
      impl: ``"xla"`` (:func:`jspec.kernels.paged_attention.paged_attention_reference`, the
        K/V writes as XLA scatters), ``"triton"`` (GPU: the Triton passes, and a layer's K
        and V written in one launch, ``set_kv_buffer(impl="triton")``) or ``"cudnn"`` (as
        ``"triton"``, but causal prefill chunks of at least
        :data:`jspec.kernels.paged_prefill_cudnn.CUDNN_MIN_QUERIES` queries through cuDNN's
        flash attention, ``paged_attention(impl="cudnn")``, where cuDNN takes the pool's dtype
        and head dim: :func:`jspec.kernels.paged_prefill_cudnn.supports`).
    """

    impl: str = "xla"

    def write_kv(self, pool: Any, layer: int, slot_ids: jax.Array, k: jax.Array, v: jax.Array):
        k, v = k.astype(pool.k.dtype), v.astype(pool.v.dtype)
        impl = "triton" if self.impl == "cudnn" else self.impl
        return set_kv_buffer(pool, layer, slot_ids, k, v, impl=impl)

    def attend(self, pool: Any, layer: int, q: jax.Array, meta: AttentionMetadata):
        impl = self.impl
        long_chunk = meta.causal and meta.tail_slot_ids is None and q.shape[1] >= CUDNN_MIN_QUERIES
        if impl == "cudnn" and not (long_chunk and supports(pool.k.dtype, q.shape[-1])):
            impl = "triton"  # cuDNN pays only on long chunks, and takes bf16 / f16 pools
        return paged_attention(
            q,
            pool.k,
            pool.v,
            layer,
            meta.page_table,
            meta.kv_lens,
            meta.q_lens,
            meta.tail_slot_ids,
            meta.tail_mask,
            page_size=meta.page_size,
            causal=meta.causal,
            impl=impl,
            max_kv_len=meta.max_kv_len,
            max_prefix_len=meta.max_prefix_len,
            # The activations' dtype, written by the kernel: the model casts to it anyway, so
            # a bf16 model pays no f32 output and convert launch (sglang's FA3 passes return
            # q's dtype too, and its cascade merges them as run_plan does).
            out_dtype=q.dtype,
        )


@pytree_dataclass
class AttnPlan:
    """Where one forward writes its K/V and what each query reads."""

    # i32[T]: slot for each token's K/V (0, the padding page, for padding tokens)
    write_slot_ids: jax.Array
    # passes over the same T queries (at least one), merged by log-sum-exp
    passes: tuple[AttentionMetadata, ...]


def run_plan(
    plan: AttnPlan, backend: AttentionBackend, pool: Any, layer: int, q: jax.Array
) -> jax.Array:
    """Every pass of ``plan`` for flat queries ``q: dtype[T, Hq, D]``, merged by log-sum-exp
    in f32: float[T, Hq, D] (one pass: the backend's output as it is)."""
    if not plan.passes:
        raise ValueError("plan.passes=() is empty: an AttnPlan reads at least one pass")
    num_tokens, hq, dim = q.shape

    def attend(meta: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
        rows = meta.num_rows
        o, part = backend.attend(pool, layer, q.reshape(rows, num_tokens // rows, hq, dim), meta)
        return o.reshape(num_tokens, hq, dim), part.reshape(num_tokens, hq)

    out, lse = attend(plan.passes[0])
    for meta in plan.passes[1:]:
        out, lse = merge_states(out, lse, *attend(meta))
    return out


def make_attn_fn(plan: AttnPlan, backend: AttentionBackend) -> Callable[..., Any]:
    """``attn_fn(layer, pool, q, k, v)`` for the model: write K/V at the plan's slots, then
    read every pass of the plan through ``backend``."""

    def attn_fn(layer: int, pool: Any, q: jax.Array, k: jax.Array, v: jax.Array):
        pool = backend.write_kv(pool, layer, plan.write_slot_ids, k, v)
        return pool, run_plan(plan, backend, pool, layer, q)

    return attn_fn
