"""``AttentionMetadata``: what one attention pass reads, in the form serving stacks already keep.

A pass is a page table and lengths (FA3's ``page_table`` + ``cache_seqlens``), the query
layout and, for the tree verify and the draft extend, a tail of ``N`` token slots with its own
mask. Its semantics are :func:`jspec.kernels.paged_attention.paged_attention`'s; the engine
builds one per pass (:mod:`jspec.engine.attention` lists them) and an attention backend
consumes it. Queries are the pass's flat tokens viewed as ``[B, Qp]``::

    prefix key w of row b (w < kv_lens[b]):  slot page_table[b, w // P] * P + w % P
    causal:   query i sits at position kv_lens[b] - q_lens[b] + i and sees w <= that;
              queries i >= q_lens[b] see nothing
    tail:     query (b, i) sees slot tail_slot_ids[b, j] iff tail_mask[b, i, j]

Nothing in it grows with ``B x Q x context``: ``page_table`` is ``[B, context / P]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec import probes
from jspec._pytree import pytree_dataclass, static_field


@pytree_dataclass
class AttentionMetadata:
    """One attention pass over a paged KV pool (module docstring).

    Attributes:
      page_table: i32[B, C] page ids of row positions ``[c*P, (c+1)*P)``; entries past
        ``ceil(kv_lens / P)`` are never read.
      kv_lens: i32[B] prefix keys per row (``<= C * P``).
      q_lens: i32[B] real queries per row (causal passes; None: all ``Qp``).
      tail_slot_ids: i32[B, N] extra key slots (None: no tail).
      tail_mask: bool[B, Qp, N] which query sees which tail key (None with no tail).
      page_size: static tokens per page-table entry (the pool's ``P``; 1 for token indices).
      causal: static; queries see the prefix causally (prefill chunks).
      max_kv_len: static launch hint, the most prefix keys a row reads (FlashAttention's
        ``max_seqlen_k``): kernels plan their key splits for it rather than for ``C * P``. Not
        a bound (a longer row is read whole, only slower); None: ``C * P``.
      max_prefix_len: static bound, causal passes only: no row has more than this many keys
        before its queries (``kv_lens - q_lens``; 0: first prefill chunks). A kernel may read
        no further (cuDNN's prefill skips the prefix at 0); see
        :func:`jspec.kernels.paged_attention.paged_attention`. None: no bound.
    """

    # (B, C) page ids
    page_table: jax.Array
    # (B,) prefix lengths
    kv_lens: jax.Array
    # (B,) or None
    q_lens: jax.Array | None = None
    # (B, N) or None
    tail_slot_ids: jax.Array | None = None
    # (B, Qp, N) or None
    tail_mask: jax.Array | None = None
    page_size: int = static_field(default=1)
    causal: bool = static_field(default=False)
    max_kv_len: int | None = static_field(default=None)
    max_prefix_len: int | None = static_field(default=None)

    @property
    def num_rows(self) -> int:
        return self.kv_lens.shape[0]


def row_page_table(
    req_to_token: jax.Array, req_pool_indices: jax.Array, *, page_size: int, max_pages: int
) -> jax.Array:
    """The FA3 page table of request rows: ``req_to_token[rows, 0 : C*P : P] // P``.

    Row positions ``[c*P, (c+1)*P)`` of a request live in one page (the paged allocator's
    invariant, SPEC.md §1), so its first slot names the page.

    Args:
      req_to_token: i32[num_req_rows, R] token slots per row position (row 0: padding).
      req_pool_indices: i32[B] request rows (padding entries: row 0).
      page_size: static P; max_pages: static C, ``C * P <= R``.

    Returns:
      i32[B, C] page ids (0, the padding page, where the row holds no slot).
    """
    probes.static_check(
        isinstance(max_pages, int) and max_pages * page_size <= req_to_token.shape[1],
        f"max_pages={max_pages!r} * page_size={page_size} must be <= the row width "
        f"R={req_to_token.shape[1]}",
    )
    first = req_to_token[req_pool_indices, 0 : max_pages * page_size : page_size]
    return first // page_size


def causal_tail_mask(num_rows: int, num_queries: int) -> jax.Array:
    """bool[B, Qp, Qp]: query ``i`` sees tail keys ``j <= i`` (the draft-extend window)."""
    tri = jnp.tril(jnp.ones((num_queries, num_queries), bool))
    return jnp.broadcast_to(tri[None], (num_rows, num_queries, num_queries))
