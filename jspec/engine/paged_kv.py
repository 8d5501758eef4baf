"""jspec's KV backend: the paged allocator, req_to_token rows and the two pools (sglang's).

:class:`PagedKVBackend` implements :class:`jspec.engine.kv_backend.KVBackend` over
:class:`PagedKVState`: one shard's paged allocator (``jspec.kv.allocator``), its req_to_token
table and row allocator (``jspec.kv.req_to_token``), the target and draft KV pools (they share
slot ids, allocator and req_to_token, as in sglang where the draft worker reuses the target's
pools' indexing), and per batch slot the request's lengths, row and liveness::

    committed_lens   i32[M]   sglang kv_committed_len = L (KV-ready prefix)
    allocated_lens   i32[M]   sglang kv_allocated_len (row positions backed by pages)
    req_pool_indices i32[M]   req_to_token row (0 = padding row, free batch slot)
    live             bool[M]

Its view is the state's own req_to_token (no copy): ``KVView(req_to_token, rows, L)``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec._pytree import pytree_dataclass, replace, tree_where
from jspec.config import ceil_to_multiple
from jspec.engine.kv_backend import KVView
from jspec.engine.protocol import DraftModel, TargetModel
from jspec.engine.state import (
    EngineConfig,
    draft_pool_spec,
    gather_slots,
    pack_valid,
    scatter_slots,
)
from jspec.kv import (
    KVPool,
    PagedAllocator,
    ReqKVState,
    ReqRowAllocator,
    alloc_decode,
    alloc_extend,
    alloc_req_rows,
    assign_req_to_token_pool,
    free_req_rows,
    get_last_loc,
    init_allocator,
    init_kv_pool,
    init_req_rows,
    init_req_to_token,
    prepare_for_decode,
    release_kv_cache,
)


@pytree_dataclass
class PagedKVState:
    """One shard's paged KV memory (module docstring for the per-slot arrays)."""

    allocator: PagedAllocator
    req_rows: ReqRowAllocator
    req_to_token: jax.Array  # i32[M+1, R] token slots (row 0 = padding row)
    target_pool: KVPool
    draft_pool: KVPool | None  # None in a plain greedy engine
    committed_lens: jax.Array  # i32[M]
    allocated_lens: jax.Array  # i32[M]
    req_pool_indices: jax.Array  # i32[M]
    live: jax.Array  # bool[M]


@dataclasses.dataclass(frozen=True)
class PagedKVBackend:
    """jspec's paged KV memory (``ecfg.spec``: page size, pool size, reserve; ``ecfg``'s
    kernel impl for the allocator ops)."""

    ecfg: EngineConfig

    def init_state(self, target: TargetModel, draft: DraftModel | None) -> PagedKVState:
        del target  # the target pool's geometry is ecfg.spec's (checked by the Runner)
        s = self.ecfg.spec
        cap = s.max_running_requests
        return PagedKVState(
            allocator=init_allocator(s.num_pages, s.page_size),
            req_rows=init_req_rows(s),
            req_to_token=init_req_to_token(s),
            target_pool=init_kv_pool(s),
            draft_pool=None if draft is None else init_kv_pool(draft_pool_spec(self.ecfg, draft)),
            committed_lens=jnp.zeros((cap,), jnp.int32),
            allocated_lens=jnp.zeros((cap,), jnp.int32),
            req_pool_indices=jnp.zeros((cap,), jnp.int32),
            live=jnp.zeros((cap,), bool),
        )

    def slot_status(self, kv: PagedKVState) -> tuple[jax.Array, jax.Array]:
        return kv.live, kv.req_pool_indices > 0

    def _reqs(self, kv: PagedKVState, slot_idx: jax.Array, live: jax.Array) -> ReqKVState:
        return ReqKVState(
            committed_lens=gather_slots(kv.committed_lens, slot_idx, live),
            allocated_lens=gather_slots(kv.allocated_lens, slot_idx, live),
            req_pool_indices=gather_slots(kv.req_pool_indices, slot_idx, live),
            valid=live,
        )

    def prepare_decode(
        self, kv: PagedKVState, slot_idx: jax.Array, live: jax.Array, *, num_tokens: int
    ) -> tuple[PagedKVState, KVView, jax.Array]:
        """``num_tokens == 1``: ``alloc_decode`` of row[L] (the greedy step); the spec reserve:
        ``prepare_for_decode`` (rows grown page aligned to ``ceil_P(L + reserve)``)."""
        spec, impl = self.ecfg.spec, self.ecfg.kernels.bookkeeping
        reqs = self._reqs(kv, slot_idx, live)
        seq, rpi = reqs.committed_lens, reqs.req_pool_indices
        if num_tokens == 1:
            last_loc = get_last_loc(kv.req_to_token, rpi, seq)
            allocator, slots, ok = alloc_decode(
                kv.allocator, seq + 1, last_loc, valid=live, impl=impl
            )
            live = live & ok
            seq, rpi = jnp.where(live, seq, 0), jnp.where(live, rpi, 0)
            r2t = assign_req_to_token_pool(
                kv.req_to_token, rpi, seq, jnp.where(live, seq + 1, 0), pack_valid(slots, live),
                impl=impl,
            )  # fmt: skip
            allocated = seq + 1
        elif num_tokens == spec.alloc_reserve_per_decode:
            allocator, r2t, reqs, ok = prepare_for_decode(
                kv.allocator, kv.req_to_token, reqs, spec, impl=impl
            )
            # Pages short (ok False): nothing was allocated; every entry becomes padding.
            live = live & ok
            seq = jnp.where(live, reqs.committed_lens, 0)
            rpi = jnp.where(live, reqs.req_pool_indices, 0)
            allocated = reqs.allocated_lens
        else:
            raise ValueError(
                f"num_tokens={num_tokens} must be 1 or spec.alloc_reserve_per_decode="
                f"{spec.alloc_reserve_per_decode} (the paged backend's two decode reserves)"
            )
        kv = replace(
            kv,
            allocator=allocator,
            req_to_token=r2t,
            allocated_lens=scatter_slots(kv.allocated_lens, slot_idx, live, allocated),
        )
        return kv, KVView(token_table=r2t, rows=rpi, seq_lens=seq, valid=live), ok

    def prepare_prefill(
        self,
        kv: PagedKVState,
        slot_idx: jax.Array,
        starts: jax.Array,
        ends: jax.Array,
        valid: jax.Array,
        *,
        chunk_width: int,
    ) -> tuple[PagedKVState, KVView, jax.Array]:
        """A first chunk takes a req_to_token row (``alloc_req_rows``); every chunk
        ``alloc_extend``s ``row[start : end]``."""
        spec, impl = self.ecfg.spec, self.ecfg.kernels.bookkeeping
        bp, p = slot_idx.shape[0], spec.page_size
        first = valid & (starts == 0)
        cont = valid & ~first
        # A later chunk must continue its slot: a row, not live, exactly ``start`` tokens in.
        old_rpi = gather_slots(kv.req_pool_indices, slot_idx, cont)
        ok_cont = jnp.all(
            ~cont
            | (
                (old_rpi > 0)
                & ~gather_slots(kv.live, slot_idx, cont)
                & (gather_slots(kv.committed_lens, slot_idx, cont) == starts)
            )
        )
        req_rows, new_rows, ok_rows = alloc_req_rows(
            kv.req_rows, jnp.sum(first.astype(jnp.int32)), max_rows=bp
        )
        rank = jnp.clip(jnp.cumsum(first.astype(jnp.int32)) - 1, 0, bp - 1)
        rpi = jnp.where(first, new_rows[rank], old_rpi)
        last_loc = get_last_loc(kv.req_to_token, rpi, starts)
        allocator, slots, ok_alloc = alloc_extend(
            kv.allocator,
            starts,
            ends,
            last_loc,
            max_new_slots=bp * (ceil_to_multiple(chunk_width, p) + p),
            valid=valid,
            impl=impl,
        )
        ok = ok_rows & ok_alloc & ok_cont
        # Failed call: every entry is padding (row 0, nothing written but the padding page).
        valid = valid & ok
        starts, ends = jnp.where(valid, starts, 0), jnp.where(valid, ends, 0)
        rpi = jnp.where(valid, rpi, 0)
        r2t = assign_req_to_token_pool(
            kv.req_to_token, rpi, starts, ends, jnp.where(ok, slots, 0), impl=impl
        )
        # NOTE: no entry (e.g. refused by the input guards): the allocators stay bit-identical.
        take = ok & jnp.any(valid)
        kv = replace(
            kv,
            allocator=tree_where(take, allocator, kv.allocator),
            req_rows=tree_where(take, req_rows, kv.req_rows),
            req_to_token=r2t,
            allocated_lens=scatter_slots(kv.allocated_lens, slot_idx, valid, ends),
            req_pool_indices=scatter_slots(kv.req_pool_indices, slot_idx, valid, rpi),
        )
        return kv, KVView(token_table=r2t, rows=rpi, seq_lens=starts, valid=valid), ok

    def commit(
        self,
        kv: PagedKVState,
        slot_idx: jax.Array,
        valid: jax.Array,
        seq_lens: jax.Array,
        live: jax.Array,
    ) -> PagedKVState:
        return replace(
            kv,
            committed_lens=scatter_slots(kv.committed_lens, slot_idx, valid, seq_lens),
            live=scatter_slots(kv.live, slot_idx, valid, live),
        )

    def release(
        self, kv: PagedKVState, slot_idx: jax.Array, finished: jax.Array
    ) -> tuple[PagedKVState, jax.Array]:
        """Frees ``row[0 : allocated_len]`` (page-aligned segment, sglang ``free_segment``:
        jspec has no prefix cache, so the committed part is freed too) and the row."""
        rpi = gather_slots(kv.req_pool_indices, slot_idx, finished)
        reqs = self._reqs(kv, slot_idx, finished)
        allocator, _, ok_kv = release_kv_cache(
            kv.allocator, kv.req_to_token, reqs, finished, return_ok=True
        )
        req_rows, ok_rows = free_req_rows(kv.req_rows, rpi, valid=finished, return_ok=True)
        ok = ok_kv & ok_rows
        finished = finished & ok
        take = jnp.any(finished)  # NOTE: nothing to free: the allocators stay bit-identical
        zero = jnp.zeros(slot_idx.shape, jnp.int32)
        kv = replace(
            kv,
            allocator=tree_where(take, allocator, kv.allocator),
            req_rows=tree_where(take, req_rows, kv.req_rows),
            committed_lens=scatter_slots(kv.committed_lens, slot_idx, finished, zero),
            allocated_lens=scatter_slots(kv.allocated_lens, slot_idx, finished, zero),
            req_pool_indices=scatter_slots(kv.req_pool_indices, slot_idx, finished, zero),
            live=scatter_slots(kv.live, slot_idx, finished, jnp.zeros(slot_idx.shape, bool)),
        )
        return kv, ok
