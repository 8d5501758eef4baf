# Over 400 lines: one state machine (alloc*, free*) with sglang's order rules in its docstrings;
# the state pytree and its free-list mechanics are in _freelist.py, free groups in free_group.py.
"""Paged KV-slot allocator: sglang ``PagedTokenToKVPoolAllocator`` as a pure-functional pytree.

SPEC.md §10. Page ``p`` owns the token slots ``[p*P, (p+1)*P)``; page 0 (slots ``0..P-1``) is the
padding page and is never handed out. Every transition is ``new_state = f(state, ...)``; an
allocation that cannot be served returns ``ok=False`` and the **input state unchanged**.

Free-list layout (all int32; sglang keeps int64 page ids, jspec keeps int32)::

    free_pages   [ p0 p1 ... p(num_free-1) | PAD_PAGE_ID ... ]   sglang order, taken from the front
    staged_pages [ s0 ... s(num_staged-1)  | PAD_PAGE_ID ... ]   sglang ``release_pages``

Order semantics (what makes JAX and sglang 0.5.23 hand out identical slot ids):

* ``alloc``/``alloc_extend``/``alloc_decode`` take pages from the front of ``free_pages``. In
  ``need_sort`` mode ``merge_and_sort_free`` (``free_pages = sort(free ++ staged)``) runs first
  when sglang's bound says the free list may be short: ``alloc``: ``pages > len(free)``;
  ``alloc_extend``: ``tokens//P + B + 1 > len(free)``; ``alloc_decode``: ``B > len(free)``.
* ``free`` computes ``unique(slot_ids // P)`` (ascending, like ``torch.unique``) and prepends it to
  ``free_pages``, or appends it to ``staged_pages`` when ``need_sort``.
* ``free_page_ids`` / ``free_segment`` free exactly the given pages (no unique), in given order.

Bad input never corrupts the state: an unaligned or oversized size, a row contract violation
(``seq < prefix``, misaligned ``last_loc``), or a bad free (page 0, out of range, already free)
gives ``ok=False`` and the input state unchanged (``free*`` take ``return_ok=True`` to get the
flag); with probes on a probe also names the value. Static mistakes raise ``ValueError``.

NOTE: deliberate deviation. In sglang a failed ``alloc*`` in need_sort mode keeps the merge it did
before failing; here a failed call returns the input state bit-identical (no merge either).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jspec import probes
from jspec._index import flat_ids, valid_mask
from jspec._jit import jit
from jspec._pytree import tree_where
from jspec.config import SpecConfig, ceil_div
from jspec.kernels.alloc_decode import alloc_decode_slots
from jspec.kernels.alloc_extend import alloc_extend_slots
from jspec.kv import _freelist as _fl
from jspec.kv._freelist import PAD_PAGE_ID, PagedAllocator, merge_and_sort_free

__all__ = [
    "MERGE_RULES",
    "PAD_PAGE_ID",
    "PagedAllocator",
    "alloc",
    "alloc_decode",
    "alloc_extend",
    "allocator_from_config",
    "available_size",
    "free",
    "free_page_ids",
    "free_segment",
    "init_allocator",
    "merge_and_sort_free",
]
# Merge-before-alloc rules in need_sort mode: "exact" (merge iff the free list is short of the
# exact page count) or "sglang" (sglang's quick bounds: extend ``tokens//P + bs + 1 > len(free)``,
# decode ``bs > len(free)``; they may merge when not strictly needed).
MERGE_RULES = ("exact", "sglang")


# ---- construction -------------------------------------------------------------------------------
def init_allocator(num_pages: int, page_size: int, *, need_sort: bool = False) -> PagedAllocator:
    """sglang ``clear()``: ``free_pages = 1..num_pages``; page 0 is never handed out.

    Raises:
      ValueError: ``num_pages < 1`` or ``page_size`` not a power of 2 (names the argument).
    """
    probes.static_check_int(num_pages, "num_pages")
    probes.static_check_power_of_2(page_size, "page_size")
    probes.static_check(
        (num_pages + 1) * page_size < 2**31,
        f"num_pages={num_pages}: (num_pages+1)*page_size must be < 2**31",
    )
    return PagedAllocator(
        free_pages=jnp.arange(1, num_pages + 1, dtype=jnp.int32),
        num_free=jnp.asarray(num_pages, jnp.int32),
        staged_pages=jnp.full((num_pages,), PAD_PAGE_ID, jnp.int32),
        num_staged=jnp.zeros((), jnp.int32),
        page_size=page_size,
        num_pages=num_pages,
        need_sort=bool(need_sort),
    )


def allocator_from_config(cfg: SpecConfig, *, need_sort: bool = False) -> PagedAllocator:
    """``init_allocator(cfg.num_pages, cfg.page_size)``."""
    return init_allocator(cfg.num_pages, cfg.page_size, need_sort=need_sort)


def available_size(a: PagedAllocator) -> jax.Array:
    """i32[]: free token slots ``(num_free + num_staged) * page_size`` (``available_size``)."""
    return (a.num_free + a.num_staged) * a.page_size


# ---- allocation ---------------------------------------------------------------------------------
def alloc(
    a: PagedAllocator, num_slots: jax.Array, *, max_slots: int
) -> tuple[PagedAllocator, jax.Array, jax.Array]:
    """sglang ``alloc(need_size)``: ``num_slots/P`` whole pages from the front of the free list.

    Args:
      a: allocator state.
      num_slots: i32[]; a multiple of ``page_size`` in ``[0, max_slots]`` (else ``ok=False``;
        a probe names an unaligned size when probes are on). A float, a bool or an int that
        does not fit int32 is a ``ValueError`` (it would truncate or wrap at the jit boundary).
      max_slots: static capacity of the returned ``slot_ids`` (Python int >= 0).

    Returns:
      ``(a', slot_ids, ok)``: slot_ids i32[max_slots] = ``page*P + arange(P)`` per page, 0 past
      ``num_slots`` (sglang returns int64; int32 here). ``ok`` is False (state unchanged, slot_ids
      all 0) when pages are short, ``num_slots`` is unaligned, negative or ``> max_slots``.
    """
    probes.static_check_int_arg(num_slots, "num_slots")
    return _alloc(a, num_slots, max_slots=max_slots)


def _commit(
    a: PagedAllocator,
    work: PagedAllocator,
    ok: jax.Array,
    num_pages: jax.Array,
    slot_ids: jax.Array,
) -> tuple[PagedAllocator, jax.Array, jax.Array]:
    """All or nothing: where ``ok``, ``work`` less its first ``num_pages`` free pages and
    ``slot_ids``; else ``a`` unchanged and slot ids 0. Returns ``(allocator, slot_ids, ok)``."""
    new = tree_where(ok, _fl.pop_front(work, jnp.where(ok, num_pages, 0)), a)
    return new, jnp.where(ok, slot_ids, 0), ok


@jit(static_argnames=("max_slots",))
def _alloc(
    a: PagedAllocator, num_slots: jax.Array, *, max_slots: int
) -> tuple[PagedAllocator, jax.Array, jax.Array]:
    _fl.check_capacity(max_slots, "max_slots")
    p = a.page_size
    num_slots = jnp.asarray(num_slots, jnp.int32)
    probes.static_check(
        num_slots.ndim == 0, f"num_slots must be a scalar, got shape {num_slots.shape}"
    )
    probes.detect_page_aligned(num_slots, p, "alloc: num_slots")
    n_pages = num_slots // p
    valid_size = (num_slots % p == 0) & (num_slots >= 0) & (num_slots <= max_slots)
    work = _fl.ensure_free(a, valid_size & (n_pages > a.num_free))
    ok = valid_size & (n_pages <= work.num_free)
    j = jnp.arange(max_slots, dtype=jnp.int32)
    page = work.free_pages[jnp.minimum(j // p, a.num_pages - 1)]
    slot_ids = jnp.where(j < num_slots, page * p + j % p, 0)
    return _commit(a, work, ok, n_pages, slot_ids)


@jit(static_argnames=("max_new_slots", "impl", "interpret", "merge_rule"))
def alloc_extend(
    a: PagedAllocator,
    prefix_lens: jax.Array,
    seq_lens: jax.Array,
    last_loc: jax.Array,
    *,
    max_new_slots: int,
    valid: jax.Array | None = None,
    impl: str = "xla",
    interpret: bool | None = None,
    merge_rule: str = "sglang",
) -> tuple[PagedAllocator, jax.Array, jax.Array]:
    """sglang ``alloc_extend``: grow each request from ``prefix_lens`` to ``seq_lens`` tokens.

    Per request (SPEC §10): part 1 continues the partial page at ``last_loc + 1``; part 2 takes
    whole new pages; part 3 puts the tail on one more new page. New pages come from the front of
    the free list in batch order. Request ``b``'s slots are packed at ``[cu[b], cu[b+1])`` with
    ``cu = exclusive cumsum(seq_lens - prefix_lens)``; rows with ``seq == prefix`` take nothing
    (padding rows).

    Args:
      a: allocator state.
      prefix_lens: i32[B]; current allocated length per request (``>= 0``).
      seq_lens: i32[B]; target length (``>= prefix_lens``).
      last_loc: i32[B]; slot of position ``prefix-1`` (``-1`` if prefix is 0), see
        ``get_last_loc``; ``(last_loc+1) % P == prefix % P`` on growing rows (sglang debug mode).
      max_new_slots: static capacity of ``slot_ids`` (Python int >= 0).
      valid: bool[B] or None (all valid); invalid rows are padding: they take nothing and do
        not count in sglang's ``bs`` (a drop-in padding sglang's batch passes its real rows).
      impl: ``"xla"`` or ``"pallas"`` for the slot computation.
      interpret: Pallas interpret flag (None: interpret off-GPU).
      merge_rule: need_sort merge trigger: ``"sglang"`` (default, sglang 0.5.23's quick bound
        ``tokens//P + bs + 1 > len(free)``, ``bs`` the valid rows) or ``"exact"``.

    Returns:
      ``(a', slot_ids i32[max_new_slots] (0 past the total), ok)``; ``ok`` is False (state
      unchanged, slot_ids all 0) when ``total > max_new_slots``, pages are short, or an input
      contract above is violated (probes name the row when on).
    """
    _fl.check_merge_rule(merge_rule, MERGE_RULES)
    _fl.check_capacity(max_new_slots, "max_new_slots")
    _fl.check_1d_int(prefix_lens, "prefix_lens")
    probes.static_check_shape(seq_lens, prefix_lens.shape, "seq_lens")
    probes.static_check_shape(last_loc, prefix_lens.shape, "last_loc")
    valid = valid_mask(valid, prefix_lens.shape)
    p = a.page_size
    prefix_lens = prefix_lens.astype(jnp.int32)
    # Invalid rows become empty padding rows (seq == prefix), so every kernel skips them.
    seq_lens = jnp.where(valid, seq_lens.astype(jnp.int32), prefix_lens)
    last_loc = last_loc.astype(jnp.int32)
    grows = seq_lens > prefix_lens
    lens_ok = ~valid | ((seq_lens >= prefix_lens) & (prefix_lens >= 0))
    aligned = _fl.aligned_rows(last_loc, prefix_lens, grows, p, 1)
    if probes.probes_on():
        probes.assert_async(
            jnp.all(lens_ok),
            "alloc_extend: 0 <= prefix_lens <= seq_lens violated at row {row}",
            row=jnp.argmax(~lens_ok),
        )
        probes.assert_async(
            jnp.all(aligned),
            f"alloc_extend: last_loc {{loc}} not aligned with prefix_len {{pre}} (page_size={p})",
            loc=last_loc[jnp.argmax(~aligned)],
            pre=prefix_lens[jnp.argmax(~aligned)],
        )
    inputs_ok = jnp.all(lens_ok) & jnp.all(aligned)
    total_slots = jnp.sum(jnp.where(grows, seq_lens - prefix_lens, 0))
    new_pages = jnp.where(grows, ceil_div(seq_lens, p) - ceil_div(prefix_lens, p), 0)
    total_pages = jnp.sum(new_pages)
    if merge_rule == "sglang":
        short = total_slots // p + jnp.sum(valid.astype(jnp.int32)) + 1 > a.num_free
    else:
        short = total_pages > a.num_free
    work = _fl.ensure_free(a, inputs_ok & short)
    ok = inputs_ok & (total_pages <= work.num_free) & (total_slots <= max_new_slots)
    slot_ids = alloc_extend_slots(
        prefix_lens,
        seq_lens,
        last_loc,
        work.free_pages,
        page_size=p,
        max_new_slots=max_new_slots,
        impl=impl,
        interpret=interpret,
    )
    return _commit(a, work, ok, total_pages, slot_ids)


@jit(static_argnames=("impl", "interpret", "merge_rule"))
def alloc_decode(
    a: PagedAllocator,
    seq_lens: jax.Array,
    last_loc: jax.Array,
    *,
    valid: jax.Array | None = None,
    impl: str = "xla",
    interpret: bool | None = None,
    merge_rule: str = "sglang",
) -> tuple[PagedAllocator, jax.Array, jax.Array]:
    """sglang ``alloc_decode``: one new token per request (``seq_lens`` includes it).

    A request needs a new page iff ``ceil(seq/P) > ceil((seq-1)/P)`` (``seq % P == 1`` for P>1);
    its slot is then ``free_pages[rank] * P`` with ``rank`` the count of earlier new-page rows;
    otherwise ``last_loc + 1``.

    Args:
      a: allocator state.
      seq_lens: i32[B]; lengths after this token (``>= 1`` on valid rows).
      last_loc: i32[B]; slot of position ``seq-2``; ``(last_loc+2) % P == seq % P`` on valid rows.
      valid: bool[B] or None (all valid); invalid rows get slot 0 and take nothing.
      impl, interpret: as in :func:`alloc_extend`.
      merge_rule: ``"sglang"`` (default: merge when ``valid rows > len(free)``) or ``"exact"``.

    Returns:
      ``(a', slot_ids i32[B], ok)``; on ``ok=False`` (pages short or an input contract above
      violated) state unchanged and slot_ids all 0.
    """
    _fl.check_merge_rule(merge_rule, MERGE_RULES)
    _fl.check_1d_int(seq_lens, "seq_lens")
    probes.static_check_shape(last_loc, seq_lens.shape, "last_loc")
    valid = valid_mask(valid, seq_lens.shape)
    p = a.page_size
    seq_lens = seq_lens.astype(jnp.int32)
    last_loc = last_loc.astype(jnp.int32)
    probes.detect_oob(seq_lens, 1, jnp.iinfo(jnp.int32).max, "alloc_decode: seq_lens", where=valid)
    aligned = _fl.aligned_rows(last_loc, seq_lens, valid, p, 2)
    if probes.probes_on():
        probes.assert_async(
            jnp.all(aligned),
            f"alloc_decode: last_loc {{loc}} not aligned with seq_len {{seq}} (page_size={p})",
            loc=last_loc[jnp.argmax(~aligned)],
            seq=seq_lens[jnp.argmax(~aligned)],
        )
    inputs_ok = jnp.all(aligned) & jnp.all(~valid | (seq_lens >= 1))
    new_page = valid & (ceil_div(seq_lens, p) > ceil_div(seq_lens - 1, p))
    total_pages = jnp.sum(new_page.astype(jnp.int32))
    if merge_rule == "sglang":
        short = jnp.sum(valid.astype(jnp.int32)) > a.num_free
    else:
        short = total_pages > a.num_free
    work = _fl.ensure_free(a, inputs_ok & short)
    ok = inputs_ok & (total_pages <= work.num_free)
    slot_ids = alloc_decode_slots(
        seq_lens,
        last_loc,
        work.free_pages,
        valid=valid,
        page_size=p,
        impl=impl,
        interpret=interpret,
    )
    return _commit(a, work, ok, total_pages, slot_ids)


# ---- freeing ------------------------------------------------------------------------------------
def _result(new: PagedAllocator, old: PagedAllocator, ok: jax.Array, return_ok: bool) -> Any:
    out = tree_where(ok, new, old)
    return (out, ok) if return_ok else out


@jit(static_argnames=("return_ok",))
def free(
    a: PagedAllocator,
    slot_ids: jax.Array,
    *,
    valid: jax.Array | None = None,
    return_ok: bool = False,
) -> Any:
    """sglang ``free(idx)``: pages ``unique(slot_ids // P)`` (ascending) back to the pool.

    A bad free is rejected whole (state unchanged): a slot outside ``[P, (num_pages+1)*P)``
    (the padding page 0 or out of range) or on a page already free (double free). Probes name
    the slot / page when on.

    Args:
      a: allocator state.
      slot_ids: i32[M]; token slots, any order, repeats allowed.
      valid: bool[M] or None; invalid entries are ignored.
      return_ok: static; also return the ``ok`` flag.

    Returns:
      The new state (pages prepended to ``free_pages``, or appended to ``staged_pages`` when
      ``need_sort``), or ``(state, ok: bool[])`` with ``return_ok``. All-invalid / empty input
      is a no-op with ``ok=True``.
    """
    slot_ids, valid = flat_ids(slot_ids, valid)
    p = a.page_size
    probes.detect_oob(slot_ids, p, (a.num_pages + 1) * p, "free: slot_ids", where=valid)
    # NOTE: floor division keeps negative slots negative, so they land out of range.
    pages = jnp.where(slot_ids < 0, -1, slot_ids // p)
    ok = _fl.free_ok(a, pages, valid, "free", repeats_ok=True)
    keys = jnp.sort(jnp.where(valid, pages, _fl.SORT_PAD))
    prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), keys[:-1]])
    first = (keys != _fl.SORT_PAD) & (keys != prev)
    uniq, count = _fl.compact(keys, first)
    return _result(_fl.release(a, uniq, count), a, ok, return_ok)


@jit(static_argnames=("return_ok",))
def free_page_ids(
    a: PagedAllocator,
    page_ids: jax.Array,
    *,
    valid: jax.Array | None = None,
    return_ok: bool = False,
) -> Any:
    """sglang ``free_page_ids``: exactly these pages (no unique), in the given order.

    Rejected whole (state unchanged, ``ok=False``) when a valid page id is outside
    ``[1, num_pages]``, already free, or given twice in this call.

    Args:
      a: allocator state.
      page_ids: i32[M]; page ids.
      valid: bool[M] or None; invalid entries are skipped (the rest keep their order).
      return_ok: static; also return the ``ok`` flag.
    """
    page_ids, valid = flat_ids(page_ids, valid)
    ok = _fl.free_ok(a, page_ids, valid, "free_page_ids", repeats_ok=False)
    pages, count = _fl.compact(page_ids, valid)
    return _result(_fl.release(a, pages, count), a, ok, return_ok)


@jit(static_argnames=("return_ok",))
def free_segment(
    a: PagedAllocator,
    row_slot_ids: jax.Array,
    start: jax.Array,
    end: jax.Array,
    *,
    return_ok: bool = False,
) -> Any:
    """sglang ``free_segment(row[start:end], start)``: pages ``row[start:end:P] // P``.

    The row maps positions to slots with one physical page per row page (SPEC §4.1), so the page
    representatives ``row[start], row[start+P], ...`` name every page of the segment exactly once.

    Args:
      a: allocator state.
      row_slot_ids: i32[W]; one req_to_token row.
      start: i32[]; first position, page-aligned (0.5.23 asserts it).
      end: i32[]; one past the last position, ``start <= end <= W``. Empty is a no-op.
      return_ok: static; also return the ``ok`` flag.

    Returns:
      The new state, or ``(state, ok)``. Rejected whole (state unchanged, ``ok=False``) on an
      unaligned or out-of-bounds segment or a bad page (as :func:`free_page_ids`).
    """
    probes.static_check(
        row_slot_ids.ndim == 1, f"row_slot_ids must be 1-D, got shape {row_slot_ids.shape}"
    )
    row_slot_ids = row_slot_ids.astype(jnp.int32)
    width = row_slot_ids.shape[0]
    p = a.page_size
    start = jnp.asarray(start, jnp.int32)
    end = jnp.asarray(end, jnp.int32)
    probes.detect_page_aligned(start, p, "free_segment: start")
    bounds_ok = (start >= 0) & (start <= end) & (end <= width) & (start % p == 0)
    probes.assert_async(
        lambda: bounds_ok,
        f"free_segment: need 0 <= start <= end <= {width}, got start={{s}} end={{e}}",
        s=start,
        e=end,
    )
    pos = start + jnp.arange(ceil_div(width, p), dtype=jnp.int32) * p
    keep = (pos < end) & (pos < width) & bounds_ok
    slots = row_slot_ids[jnp.clip(pos, 0, width - 1)]
    pages = jnp.where(slots < 0, -1, slots // p)
    ok = bounds_ok & _fl.free_ok(a, pages, keep, "free_segment", repeats_ok=False)
    new = _fl.release(a, jnp.where(keep, pages, PAD_PAGE_ID), jnp.sum(keep.astype(jnp.int32)))
    return _result(new, a, ok, return_ok)
