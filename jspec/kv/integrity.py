"""Allocator integrity checks: leaks, use-after-free, double free (SPEC.md §10 leak checks).

Mirrors sglang's ``invariant_checker`` full-pool invariant (``available + owned == total``, else
"memory leak detected!") and ``SGLANG_CHECK_KV_PAGE_INVARIANTS`` (no owner page in the free list,
no duplicate free pages). Pages are counted, not slots; messages also give token counts.

* :func:`owned_page_mask` and :func:`integrity_violations` are jittable (counts as i32 scalars).
* :func:`check_integrity` is host-side: it reads the state back and raises
  :class:`AllocatorIntegrityError` naming the offending page ids.
* :func:`check_req_rows_integrity` does the same for the request-row allocator (sglang's
  ``req_to_token_pool`` check ``free_slots + live == size``): duplicates, rows both free and live.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec._jit import jit
from jspec.kv.allocator import PagedAllocator
from jspec.kv.req_to_token import ReqRowAllocator


class AllocatorIntegrityError(AssertionError):
    """The allocator's free lists disagree with the pages owned by live requests."""


@jit(static_argnames=("num_pages", "page_size"))
def owned_page_mask(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    allocated_lens: jax.Array,
    *,
    num_pages: int,
    page_size: int,
    valid: jax.Array | None = None,
) -> jax.Array:
    """bool[num_pages+1]: pages referenced by ``row[0:allocated_len]`` of the valid requests.

    Args:
      req_to_token: i32[R, W].
      req_pool_indices: i32[B]; row per request.
      allocated_lens: i32[B]; allocated positions per request (sglang ``kv_allocated_len``).
      num_pages, page_size: static pool geometry.
      valid: bool[B] or None (all valid).

    Returns:
      Index ``p`` is True when some valid request's row maps a position below its allocated
      length into page ``p``. Index 0 (the padding page) is set when a row points there.
    """
    width = req_to_token.shape[1]
    valid = jnp.ones(req_pool_indices.shape, bool) if valid is None else valid.astype(bool)
    rows = req_to_token[req_pool_indices.astype(jnp.int32)]  # i32[B, W]
    live = valid[:, None] & (jnp.arange(width)[None, :] < allocated_lens[:, None])
    pages = jnp.where(live & (rows >= 0), rows // page_size, num_pages + 1)  # never wrap
    return jnp.zeros((num_pages + 1,), bool).at[pages.reshape(-1)].set(True, mode="drop")


def _free_counts(a: PagedAllocator) -> jax.Array:
    """i32[num_pages+2]: occurrences of each page id among live free + staged entries.

    Index ``num_pages+1`` collects out-of-range ids (< 0 or > num_pages).
    """
    n = a.num_pages
    i = jnp.arange(n, dtype=jnp.int32)

    def bucket(x):
        return jnp.where((x >= 0) & (x <= n), x, n + 1)

    # NOTE: dead entries get index n+2 (dropped); a negative index would wrap around.
    ids = jnp.concatenate(
        [
            jnp.where(i < a.num_free, bucket(a.free_pages), n + 2),
            jnp.where(i < a.num_staged, bucket(a.staged_pages), n + 2),
        ]
    )
    return jnp.zeros((n + 2,), jnp.int32).at[ids].add(1, mode="drop")


@jit()
def integrity_violations(
    a: PagedAllocator, owned_mask: jax.Array | None = None
) -> dict[str, jax.Array]:
    """Counts of integrity violations (all i32[]; zero means healthy).

    Keys:
      ``duplicate_free``: extra occurrences of pages already in the free/staged lists.
      ``page0_free``: occurrences of the padding page 0 in the free/staged lists.
      ``out_of_range_free``: free entries outside ``[0, num_pages]``.
      ``owned_and_free`` (with ``owned_mask``): pages both owned and free (use-after-free).
      ``lost`` (with ``owned_mask``): pages in ``[1, num_pages]`` neither free nor owned (leak).
      ``num_free``, ``num_owned``: the page counts behind the checks (informational).
    """
    counts = _free_counts(a)
    n = a.num_pages
    real = counts[1 : n + 1]
    out = {
        "duplicate_free": jnp.sum(jnp.maximum(real - 1, 0)),
        "page0_free": counts[0],
        "out_of_range_free": counts[n + 1],
        "num_free": a.num_free + a.num_staged,
    }
    if owned_mask is not None:
        owned = owned_mask[1 : n + 1]
        is_free = real > 0
        out["owned_and_free"] = jnp.sum((owned & is_free).astype(jnp.int32))
        out["lost"] = jnp.sum((~owned & ~is_free).astype(jnp.int32))
        out["num_owned"] = jnp.sum(owned.astype(jnp.int32))
    return out


def _ids(x: np.ndarray, limit: int = 16) -> str:
    ids = [int(v) for v in x]
    return str(ids[:limit]) + (f" (+{len(ids) - limit} more)" if len(ids) > limit else "")


def _distinct_in_range(
    ids: np.ndarray, cap: int, prefix: str, *, outside: str, duplicate: str
) -> np.ndarray:
    """``np.unique(ids)`` once every id is in ``[1, cap]`` (id 0 is padding) and none repeats;
    else :class:`AllocatorIntegrityError` with ``prefix + outside`` / ``prefix + duplicate``,
    their ``{ids}`` naming the offenders."""
    bad = ids[(ids < 1) | (ids > cap)]
    if bad.size:
        raise AllocatorIntegrityError(prefix + outside.format(ids=_ids(bad)))
    unique, counts = np.unique(ids, return_counts=True)
    if np.any(counts > 1):
        raise AllocatorIntegrityError(prefix + duplicate.format(ids=_ids(unique[counts > 1])))
    return unique


def check_integrity(
    a: PagedAllocator, owned_mask: jax.Array | None = None, *, what: str = ""
) -> None:
    """Host-side integrity check (syncs); raises :class:`AllocatorIntegrityError` on failure.

    Without ``owned_mask`` only the free lists are checked (duplicates, page 0, range). With it
    (bool[num_pages+1] from :func:`owned_page_mask`) also use-after-free and leaks
    (``available + owned == total``).

    Args:
      a: allocator state.
      owned_mask: bool[num_pages+1] or None.
      what: prefix for the messages (e.g. the call site).
    """
    prefix = f"{what}: " if what else ""
    n, p = a.num_pages, a.page_size
    nf, ns = int(a.num_free), int(a.num_staged)
    live = np.concatenate([np.asarray(a.free_pages)[:nf], np.asarray(a.staged_pages)[:ns]])
    if nf < 0 or ns < 0 or nf > n or ns > n:
        raise AllocatorIntegrityError(
            f"{prefix}bad free-list counts num_free={nf} num_staged={ns} (num_pages={n})"
        )
    ids = _distinct_in_range(
        live,
        n,
        prefix,
        outside=f"free list holds page ids outside [1, {n}]: {{ids}} (page 0 is the padding page)",
        duplicate="duplicate free pages {ids}",
    )
    if owned_mask is None:
        return
    owned = np.asarray(owned_mask)[1 : n + 1]
    is_free = np.zeros(n, bool)
    is_free[ids - 1] = True
    both = np.nonzero(owned & is_free)[0] + 1
    if both.size:
        raise AllocatorIntegrityError(
            f"{prefix}use-after-free: page ids {_ids(both)} are both owned and free"
        )
    num_owned = int(owned.sum())
    if live.size + num_owned != n:
        lost = np.nonzero(~owned & ~is_free)[0] + 1
        raise AllocatorIntegrityError(
            f"{prefix}token_to_kv_pool_allocator memory leak detected! "
            f"available={live.size * p} owned={num_owned * p} total={n * p} (tokens; "
            f"{n - live.size - num_owned} pages lost: {_ids(lost)})"
        )


def check_req_rows_integrity(r: ReqRowAllocator, live_rows: Any = None, *, what: str = "") -> None:
    """Host-side check of the request-row free list; raises :class:`AllocatorIntegrityError`.

    Checks the free list holds distinct rows in ``[1, max_running_requests]``; with
    ``live_rows`` (rows owned by running requests, any int sequence) also that no row is both
    free and live and that ``free + live == max_running_requests`` (no leaked row).

    Args:
      r: row allocator state.
      live_rows: i32[L] or None.
      what: prefix for the messages.
    """
    prefix = f"{what}: " if what else ""
    cap = int(r.free_rows.shape[0])
    nf = int(r.num_free)
    if nf < 0 or nf > cap:
        raise AllocatorIntegrityError(
            f"{prefix}bad request-row count num_free={nf} (max_running_requests={cap})"
        )
    free = np.asarray(r.free_rows)[:nf]
    ids = _distinct_in_range(
        free,
        cap,
        prefix,
        outside=f"request-row free list holds rows outside [1, {cap}]: {{ids}} "
        "(row 0 is the padding row)",
        duplicate="duplicate free request rows {ids} (double free)",
    )
    if live_rows is None:
        return
    live = np.unique(np.asarray(live_rows, np.int64).reshape(-1))
    both = np.intersect1d(live, ids)
    if both.size:
        raise AllocatorIntegrityError(f"{prefix}request rows {_ids(both)} are both free and live")
    if ids.size + live.size != cap:
        lost = np.setdiff1d(np.arange(1, cap + 1), np.concatenate([ids, live]))
        raise AllocatorIntegrityError(
            f"{prefix}req_to_token_pool memory leak detected! free={ids.size} live={live.size} "
            f"total={cap} (rows lost: {_ids(lost)})"
        )
