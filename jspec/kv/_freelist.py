"""The paged allocator's state and its free-list primitives (private to ``jspec.kv.allocator``).

The :class:`PagedAllocator` pytree (public as ``jspec.kv.PagedAllocator``; the free-list layout
is drawn in :mod:`jspec.kv.allocator`) and pure XLA on it: pop from the front, release (prepend,
or append to the staged list in need_sort mode), merge-and-sort, and the validity mask of a free
(range, already free, repeated in one call) that makes bad frees atomic no-ops.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jspec import _compact, probes
from jspec._jit import jit
from jspec._pytree import pytree_dataclass, replace, static_field
from jspec.sentinels import PAD_PAGE_ID  # free-list padding past the live prefix

# Sort key that places dead entries after every live page id.
SORT_PAD = jnp.iinfo(jnp.int32).max


@pytree_dataclass
class PagedAllocator:
    """Allocator state (a pytree; ``page_size``/``num_pages``/``need_sort`` are static).

    Attributes:
      free_pages: i32[num_pages]; ``[0, num_free)`` is the free list, the rest ``PAD_PAGE_ID``.
      num_free: i32[]; live length of ``free_pages``.
      staged_pages: i32[num_pages]; sglang ``release_pages`` (need_sort mode), ``[0, num_staged)``.
      num_staged: i32[]; live length of ``staged_pages``.
      page_size: tokens per page ``P`` (static, power of 2).
      num_pages: allocatable pages, ids ``1..num_pages`` (static).
      need_sort: route frees to ``staged_pages`` and merge-sort lazily (static).
    """

    # (num_pages,)
    free_pages: jax.Array
    # ()
    num_free: jax.Array
    # (num_pages,)
    staged_pages: jax.Array
    # ()
    num_staged: jax.Array
    page_size: int = static_field()
    num_pages: int = static_field()
    need_sort: bool = static_field(default=False)


def pop_front(a: PagedAllocator, n: jax.Array) -> PagedAllocator:
    """Drop ``n`` pages from the front of the free list (caller guarantees ``n <= num_free``)."""
    i = jnp.arange(a.num_pages, dtype=jnp.int32)
    src = i + n
    free = jnp.where(src < a.num_free, a.free_pages[jnp.minimum(src, a.num_pages - 1)], PAD_PAGE_ID)
    return replace(a, free_pages=free, num_free=a.num_free - n)


def compact(page_ids: jax.Array, keep: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Stable compaction of ``page_ids[keep]`` to the front: (i32[M] padded with 0, count)."""
    out = _compact.compact(page_ids, keep, fill=PAD_PAGE_ID, dtype=jnp.int32)
    return out, jnp.sum(keep.astype(jnp.int32))


def release(a: PagedAllocator, pages: jax.Array, count: jax.Array) -> PagedAllocator:
    """Give back ``pages[:count]``: prepend to ``free_pages`` or append to ``staged_pages``.

    The caller has validated the pages (:func:`free_ok`); counts are clamped to ``num_pages``
    only as a last guard.
    """
    n = a.num_pages
    i = jnp.arange(n, dtype=jnp.int32)
    m = pages.shape[0]
    if m == 0:
        return a
    if a.need_sort:
        j = i - a.num_staged
        staged = jnp.where(
            i < a.num_staged,
            a.staged_pages,
            jnp.where(j < count, pages[jnp.clip(j, 0, m - 1)], PAD_PAGE_ID),
        )
        return replace(a, staged_pages=staged, num_staged=jnp.minimum(a.num_staged + count, n))
    j = i - count
    free = jnp.where(
        i < count,
        pages[jnp.minimum(i, m - 1)],
        jnp.where(j < a.num_free, a.free_pages[jnp.clip(j, 0, n - 1)], PAD_PAGE_ID),
    )
    return replace(a, free_pages=free, num_free=jnp.minimum(a.num_free + count, n))


@jit()
def merge_and_sort_free(a: PagedAllocator) -> PagedAllocator:
    """sglang ``merge_and_sort_free``: ``free_pages = sort(free ++ staged)``; staged emptied."""
    n = a.num_pages
    i = jnp.arange(n, dtype=jnp.int32)
    both = jnp.concatenate(
        [
            jnp.where(i < a.num_free, a.free_pages, SORT_PAD),
            jnp.where(i < a.num_staged, a.staged_pages, SORT_PAD),
        ]
    )
    count = jnp.minimum(a.num_free + a.num_staged, n)
    merged = jnp.sort(both)[:n]
    return replace(
        a,
        free_pages=jnp.where(i < count, merged, PAD_PAGE_ID),
        num_free=count,
        staged_pages=jnp.full((n,), PAD_PAGE_ID, jnp.int32),
        num_staged=jnp.zeros((), jnp.int32),
    )


def ensure_free(a: PagedAllocator, short: jax.Array) -> PagedAllocator:
    """need_sort mode: merge staged pages in when ``short`` (a traced bool)."""
    if not a.need_sort:
        return a
    return jax.lax.cond(short, merge_and_sort_free, lambda s: s, a)


def free_counts(a: PagedAllocator) -> jax.Array:
    """i32[num_pages+1]: occurrences of each page id among the live free + staged entries."""
    n = a.num_pages
    i = jnp.arange(n, dtype=jnp.int32)

    # NOTE: dead or out-of-range entries go to index n+1 (dropped); negative ids would wrap.
    def bucket(x, live):
        return jnp.where(live & (x >= 0) & (x <= n), x, n + 1)

    ids = jnp.concatenate(
        [bucket(a.free_pages, i < a.num_free), bucket(a.staged_pages, i < a.num_staged)]
    )
    return jnp.zeros((n + 1,), jnp.int32).at[ids].add(1, mode="drop")


def free_faults(
    a: PagedAllocator, pages: jax.Array, valid: jax.Array, *, repeats_ok: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-entry faults of freeing ``pages[valid]`` (all bool[M]).

    Returns:
      ``(out_of_range, already_free, repeated)``: page not in ``[1, num_pages]`` (page 0 is the
      padding page); page already in the free or staged list; page given twice in this call
      (never set when ``repeats_ok``, as ``free`` takes ``unique``).
    """
    n = a.num_pages
    in_range = (pages >= 1) & (pages <= n)
    out_of_range = valid & ~in_range
    idx = jnp.where(valid & in_range, pages, n + 1)
    already = valid & in_range & (free_counts(a)[jnp.minimum(idx, n)] > 0)
    if repeats_ok:
        return out_of_range, already, jnp.zeros_like(valid)
    hits = jnp.zeros((n + 2,), jnp.int32).at[idx].add(1, mode="drop")
    repeated = valid & in_range & (hits[jnp.minimum(idx, n)] > 1)
    return out_of_range, already, repeated


# ---- input checks -------------------------------------------------------------------------------
def check_merge_rule(merge_rule: str, merge_rules: tuple[str, ...]) -> None:
    probes.static_check(
        merge_rule in merge_rules, f"merge_rule={merge_rule!r} must be one of {merge_rules}"
    )


def check_capacity(value: Any, name: str) -> None:
    probes.static_check(
        isinstance(value, int) and not isinstance(value, bool) and value >= 0,
        f"{name}={value!r} must be a Python int >= 0 (static)",
    )


def check_1d_int(x: jax.Array, name: str) -> None:
    probes.static_check(
        jnp.ndim(x) == 1 and jnp.issubdtype(jnp.result_type(x), jnp.integer),
        f"{name} must be a 1-D int array, got shape {jnp.shape(x)} dtype {jnp.result_type(x)}",
    )


def free_ok(
    a: PagedAllocator, pages: jax.Array, valid: jax.Array, what: str, *, repeats_ok: bool
) -> jax.Array:
    """bool[]: the free is valid (else it is rejected whole); probes name the first bad page."""
    out_of_range, already, repeated = free_faults(a, pages, valid, repeats_ok=repeats_ok)
    if probes.probes_on() and pages.size:  # NOTE: argmax of an empty array fails to trace
        bad_range = (
            f"freed page id {{page}} outside [1, {a.num_pages}] (page 0 is the padding page)"
        )
        for bad, msg in (
            (out_of_range, bad_range),
            (already, "double free of page {page} (already free)"),
            (repeated, "page {page} freed twice in one call"),
        ):
            probes.assert_async(~jnp.any(bad), f"{what}: " + msg, page=pages[jnp.argmax(bad)])
    return ~jnp.any(out_of_range | already | repeated)


def aligned_rows(
    last_loc: jax.Array, lens: jax.Array, rows: jax.Array, p: int, shift: int
) -> jax.Array:
    """bool[B]: ``(last_loc + shift) % P == lens % P`` on ``rows`` (sglang debug assert)."""
    return ~rows | ((last_loc + shift) % p == lens % p)
