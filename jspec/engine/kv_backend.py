"""The KV backend: the one seam between the speculative algorithm and a KV memory system.

The steps (prefill, greedy, spec, plain) never touch an allocator. They ask a
:class:`KVBackend` (static, hashable: a field of :class:`jspec.engine.runner.Runner`) to back
the positions a call will write, get back a :class:`KVView` of the batch (a token-slot table,
each entry's row and committed length), and tell the backend the new lengths at the end::

    prepare_decode   live entries' positions [L, L + num_tokens) get token slots (ok: all of them)
    prepare_prefill  entries' positions [start, end) get token slots (first chunk: a new request)
    commit           the entries' requests now hold seq_lens KV-ready tokens; live: which decode
    release          the finished requests' memory is freed; their batch slots are free again
    slot_status      live / held per batch slot (the input guards read it)

Everything else the spec step does to memory is jspec's, computed from the view: the draft
layout (``jspec.tree.layout.prepare_for_draft``: branch token slots, prefix-tail copies into
the draft pool), the attention passes (``AttentionMetadata``: page tables ``row_page_table``
of the view), the verify window (``row[L : L+N]``), the accepted-KV move
(``move_accept_tokens_to_target_kvcache``). A backend whose state is kept as page tables (vLLM
/ tpu-inference block tables) builds its view with :func:`view_from_page_table`.

The KV state is the backend's own pytree (a registered frozen dataclass) with two fields the
step reads and replaces: ``target_pool`` and ``draft_pool`` (what the engine's attention
backend writes and reads, ``jspec.kv.KVPool`` for jspec's; ``draft_pool`` None without a
draft). Token slot ``s`` of a pool lies in page ``s // P`` (``P`` = the pool's page size);
slots ``0 .. P-1`` (page 0) are the padding page every padding entry writes to.

Shapes: ``M`` max_running_requests (batch slots), ``B`` the call's padded batch, ``R`` the
token table's row width (``>= ceil_P(context_len + alloc_reserve_per_decode)``).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jspec._pytree import pytree_dataclass
from jspec.attention_meta.metadata import AttentionMetadata, row_page_table
from jspec.config import SpecConfig, ceil_div
from jspec.engine.protocol import DraftModel, TargetModel
from jspec.sentinels import PAD_ROW


@pytree_dataclass
class KVView:
    """The KV memory of a call's batch, as the step reads it (padding entries: row 0, L 0).

    Token slot of position ``w`` of entry ``b``: ``token_table[rows[b], w]``; positions the
    backend backed for this call (``[0, L + num_tokens)`` after ``prepare_decode``) hold real
    slots, page aligned (``slot % P == w % P``, one page per ``P`` positions).
    """

    # i32[num_rows, R]: token slot of every row position (row 0 = padding row, all slot 0)
    token_table: jax.Array
    # i32[B]: each entry's row in token_table (PAD_ROW 0 for padding entries)
    rows: jax.Array
    # i32[B]: committed KV-ready length L of each entry's request (0 on padding; prefill: start)
    seq_lens: jax.Array
    # bool[B]: entries that hold a request in this call (False when ok is False)
    valid: jax.Array

    def page_table(self, page_size: int, max_pages: int) -> jax.Array:
        """i32[B, max_pages] page ids of each entry's positions ``[c*P, (c+1)*P)``."""
        return row_page_table(self.token_table, self.rows, page_size=page_size, max_pages=max_pages)

    def slot_ids(self, positions: jax.Array) -> jax.Array:
        """i32[B, T] token slots of positions ``i32[B, T]`` (slot 0 on padding entries)."""
        width = self.token_table.shape[1]
        slots = self.token_table[self.rows[:, None], jnp.clip(positions, 0, width - 1)]
        return jnp.where(self.valid[:, None], slots, 0)


def row_metadata(
    spec: SpecConfig, view: KVView, kv_lens: jax.Array, **kwargs: Any
) -> AttentionMetadata:
    """One attention pass over the view's request rows: their page table (the pages of
    positions ``[0, context_len)``), ``kv_lens: i32[B]`` prefix keys, and ``kwargs`` (``q_lens``,
    ``tail_slot_ids``, ``tail_mask``, ``causal``) as :class:`AttentionMetadata`."""
    p = spec.page_size
    return AttentionMetadata(
        page_table=view.page_table(p, ceil_div(spec.context_len, p)),
        kv_lens=kv_lens,
        page_size=p,
        **kwargs,
    )


def view_from_page_table(
    page_table: jax.Array, seq_lens: jax.Array, valid: jax.Array, *, page_size: int
) -> KVView:
    """A :class:`KVView` of a batch whose memory is kept as page tables (block tables).

    Args:
      page_table: i32[B, max_pages] page ids of each entry's positions ``[c*P, (c+1)*P)``
        (page 0, the padding page, where none); ``max_pages * P`` is the view's row width.
      seq_lens: i32[B] committed length L per entry.
      valid: bool[B] entries holding a request.
      page_size: static ``P``.

    Returns:
      The view over a batch-local token table ``i32[B + 1, max_pages * P]`` (row 0 padding,
      entry b at row b + 1): ``slot = page * P + w % P``.
    """
    batch, max_pages = page_table.shape
    offsets = jnp.arange(page_size, dtype=jnp.int32)
    slots = page_table.astype(jnp.int32)[:, :, None] * page_size + offsets[None, None, :]
    slots = jnp.where(valid[:, None, None], slots, 0).reshape(batch, max_pages * page_size)
    table = jnp.concatenate([jnp.zeros_like(slots[:1]), slots], axis=0)
    rows = jnp.where(valid, jnp.arange(1, batch + 1, dtype=jnp.int32), PAD_ROW)
    return KVView(
        token_table=table,
        rows=rows,
        seq_lens=jnp.where(valid, seq_lens, 0).astype(jnp.int32),
        valid=valid.astype(bool),
    )


class KVBackend(Protocol):
    """How the steps reach the KV memory (module docstring). Static and hashable.

    Every method is pure (``new_kv = f(kv, ...)``) and all or nothing: on ``ok`` False the
    returned state equals the given one and the view is all padding. Batch slots ``slot_idx:
    i32[B]`` index the backend's per-request memory (``0 <= slot < M``; padding entries hold
    any value and are masked out by ``valid`` / ``live``: they must change nothing).
    """

    def init_state(self, target: TargetModel, draft: DraftModel | None) -> Any:
        """An empty KV state: every batch slot free; pools for the target (and the draft, or
        ``draft_pool=None`` when ``draft`` is None)."""
        ...

    def slot_status(self, kv: Any) -> tuple[jax.Array, jax.Array]:
        """``(live bool[M], held bool[M])``: the slot's request decodes; the slot holds a
        request (live, or prefilling between chunks)."""
        ...

    def prepare_decode(
        self, kv: Any, slot_idx: jax.Array, live: jax.Array, *, num_tokens: int
    ) -> tuple[Any, KVView, jax.Array]:
        """Back positions ``[0, L + num_tokens)`` of every live entry's request.

        Args:
          slot_idx: i32[B]; live: bool[B] (entries already checked live and distinct).
          num_tokens: static; 1 for a greedy step, ``spec.alloc_reserve_per_decode`` for a
            spec (or a spec engine's plain) step: the draft branches and the verify window.

        Returns:
          ``(kv, view, ok bool[])``; ``view.valid = live & ok``.
        """
        ...

    def prepare_prefill(
        self,
        kv: Any,
        slot_idx: jax.Array,
        starts: jax.Array,
        ends: jax.Array,
        valid: jax.Array,
        *,
        chunk_width: int,
    ) -> tuple[Any, KVView, jax.Array]:
        """Back positions ``[0, end)`` of each valid entry's request; an entry with ``start ==
        0`` starts a request in its (free) slot, a later chunk must continue its slot (a held,
        not live request with exactly ``start`` committed tokens) or ``ok`` is False.

        Args:
          slot_idx: i32[Bp]; starts, ends: i32[Bp] positions ``[start, end)`` of the chunk;
          valid: bool[Bp] entries with a chunk.
          chunk_width: static ``Cq``, the padded chunk length (``end - start <= Cq``).

        Returns:
          ``(kv, view, ok bool[])``; ``view.seq_lens = starts`` on valid entries.
        """
        ...

    def commit(
        self,
        kv: Any,
        slot_idx: jax.Array,
        valid: jax.Array,
        seq_lens: jax.Array,
        live: jax.Array,
    ) -> Any:
        """The valid entries' requests hold ``seq_lens: i32[B]`` KV-ready tokens (``<=`` what
        the prepare backed); ``live: bool[B]`` which of them decode next."""
        ...

    def release(self, kv: Any, slot_idx: jax.Array, finished: jax.Array) -> tuple[Any, jax.Array]:
        """Free the finished entries' requests (slots checked held and distinct): ``(kv, ok
        bool[])``; the slots are free (not live, not held) after it."""
        ...
