"""req_to_token: the per-request position -> KV slot table, and its row allocator.

SPEC.md §1, §4.1, §10. ``req_to_token`` is ``i32[num_req_rows, req_to_token_width]``; row 0 is
the padding row (all zeros, never handed out), so padded batch entries can point at it. A row maps a
token position to a token slot id (``slot = page*P + offset``); sglang keeps the table int32 too.

::

    row r:  [ slot(0) slot(1) ... slot(allocated-1) | stale / 0 ... ]   width = context_len + extra
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jspec import probes
from jspec._index import flat_ids
from jspec._jit import jit
from jspec._pytree import pytree_dataclass, replace, tree_where
from jspec.config import SpecConfig
from jspec.kernels import assign_req_to_token_pool as _assign
from jspec.sentinels import PAD_ROW  # padding row of req_to_token, value of unused row ids


def init_req_to_token(cfg: SpecConfig) -> jax.Array:
    """i32[cfg.num_req_rows, cfg.req_to_token_width] zeros; row 0 is the padding row."""
    return jnp.zeros((cfg.num_req_rows, cfg.req_to_token_width), jnp.int32)


@jit(static_argnames=("impl", "interpret", "return_ok"))
def assign_req_to_token_pool(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    start_offset: jax.Array,
    end_offset: jax.Array,
    out_cache_loc: jax.Array,
    *,
    impl: str = "xla",
    interpret: bool | None = None,
    return_ok: bool = False,
) -> Any:
    """sglang ``assign_req_to_token_pool``: write packed slots into request rows.

    ``row[req_pool_indices[b], start[b]:end[b]] = out_cache_loc[cu[b] : cu[b] + end[b]-start[b]]``
    with ``cu`` the exclusive cumsum of ``end - start`` in batch order.

    Bad input never writes: unless every request has ``0 <= start <= end <= W``, every writing
    request (``start < end``) a row in ``[0, R)``, and ``sum(end-start) <= M``, the table is
    returned unchanged (``ok=False``); probes name the offending value when on.

    Args:
      req_to_token: i32[R, W]; the table.
      req_pool_indices: i32[B]; row per request (``PAD_ROW`` for padding rows).
      start_offset: i32[B]; first position written per request.
      end_offset: i32[B]; one past the last; ``start == end`` writes nothing (padding rows).
      out_cache_loc: i32[M]; packed slot ids (sglang int64; int32 here).
      impl: ``"xla"`` or ``"pallas"`` (in-place kernel, one program per request).
      interpret: Pallas interpret flag; None = interpret off-GPU.
      return_ok: static; also return the ``ok`` flag.

    Returns:
      i32[R, W]: the updated table, or ``(table, ok: bool[])`` with ``return_ok``.
    """
    _assign.validate_assign_args(
        req_to_token, req_pool_indices, start_offset, end_offset, out_cache_loc
    )
    impl = _assign.resolve_impl(impl)
    num_rows, width = req_to_token.shape
    rows = req_pool_indices.astype(jnp.int32)
    start = start_offset.astype(jnp.int32)
    end = end_offset.astype(jnp.int32)
    writes = start < end
    total = jnp.sum(jnp.where(writes, end - start, 0))
    bad_range = (start < 0) | (start > end) | (end > width)
    bad_row = writes & ((rows < 0) | (rows >= num_rows))
    if probes.probes_on():
        probes.detect_in_closed_range(
            end, 0, width, "assign_req_to_token_pool: end_offset (row width)"
        )
        probes.detect_oob(start, 0, width + 1, "assign_req_to_token_pool: start_offset")
        probes.assert_async(
            jnp.all(start <= end),
            "assign_req_to_token_pool: start > end at request {b}",
            b=jnp.argmax(start > end),
        )
        probes.detect_oob(
            rows, 0, num_rows, "assign_req_to_token_pool: req_pool_indices", where=writes
        )
        probes.assert_async(
            total <= out_cache_loc.shape[0],
            "assign_req_to_token_pool: sum(end-start)={total} > "
            f"len(out_cache_loc)={out_cache_loc.shape[0]}",
            total=total,
        )
    ok = ~jnp.any(bad_range | bad_row) & (total <= out_cache_loc.shape[0])
    # Rejected calls write nothing: every request becomes an empty padding write.
    safe_rows = jnp.where(ok & writes, rows, PAD_ROW)
    safe_end = jnp.where(ok, end, jnp.clip(start, 0, width))
    args = (req_to_token, safe_rows, jnp.clip(start, 0, width), jnp.clip(safe_end, 0, width))
    if impl == "xla":
        out = _assign.assign_req_to_token_pool_reference(*args, out_cache_loc)
    else:
        out = _assign.assign_req_to_token_pool_pallas(*args, out_cache_loc, interpret=interpret)
    out = jnp.where(ok, out, req_to_token)
    return (out, ok) if return_ok else out


@jit()
def get_last_loc(
    req_to_token: jax.Array, req_pool_indices: jax.Array, prefix_lens: jax.Array
) -> jax.Array:
    """sglang ``get_last_loc``: i32[B] ``row[prefix-1]`` if ``prefix > 0`` else ``-1``.

    Args:
      req_to_token: i32[R, W].
      req_pool_indices: i32[B]; row per request, ``< R`` (probe).
      prefix_lens: i32[B]; ``<= W`` (probe).
    """
    width = req_to_token.shape[1]
    prefix_lens = prefix_lens.astype(jnp.int32)
    rows = req_pool_indices.astype(jnp.int32)
    probes.detect_oob(rows, 0, req_to_token.shape[0], "get_last_loc: req_pool_indices")
    probes.detect_in_closed_range(prefix_lens, 0, width, "get_last_loc: prefix_lens")
    col = jnp.clip(prefix_lens - 1, 0, width - 1)
    loc = req_to_token[rows, col]
    return jnp.where(prefix_lens > 0, loc, -1).astype(prefix_lens.dtype)


# ---- row allocator (sglang ReqToTokenPool free_slots) -------------------------------------------
@pytree_dataclass
class ReqRowAllocator:
    """Free req_to_token rows (sglang ``ReqToTokenPool.free_slots``), rows ``1..max``.

    Attributes:
      free_rows: i32[max_running_requests]; ``[0, num_free)`` live, rest ``PAD_ROW``.
      num_free: i32[].
    """

    # (max_running_requests,)
    free_rows: jax.Array
    # ()
    num_free: jax.Array


def init_req_rows(cfg: SpecConfig) -> ReqRowAllocator:
    """All rows ``1..cfg.max_running_requests`` free, in ascending order."""
    n = cfg.max_running_requests
    return ReqRowAllocator(
        free_rows=jnp.arange(1, n + 1, dtype=jnp.int32), num_free=jnp.asarray(n, jnp.int32)
    )


def alloc_req_rows(
    r: ReqRowAllocator, num: jax.Array, *, max_rows: int
) -> tuple[ReqRowAllocator, jax.Array, jax.Array]:
    """sglang ``ReqToTokenPool.alloc(need)``: pop ``num`` rows from the front.

    ``num``: i32[]; a float, a bool or an int that does not fit int32 is a ``ValueError``.

    Returns:
      ``(r', rows i32[max_rows] (PAD_ROW past num), ok)``; ``ok=False`` (``num > num_free`` or
      ``num > max_rows`` or ``num < 0``) leaves the state unchanged and rows all ``PAD_ROW``.
    """
    probes.static_check_int_arg(num, "num")
    return _alloc_req_rows(r, num, max_rows=max_rows)


@jit(static_argnames=("max_rows",))
def _alloc_req_rows(
    r: ReqRowAllocator, num: jax.Array, *, max_rows: int
) -> tuple[ReqRowAllocator, jax.Array, jax.Array]:
    probes.static_check(max_rows >= 0, f"max_rows={max_rows} must be >= 0")
    cap = r.free_rows.shape[0]
    num = jnp.asarray(num, jnp.int32)
    ok = (num >= 0) & (num <= r.num_free) & (num <= max_rows)
    j = jnp.arange(max_rows, dtype=jnp.int32)
    rows = jnp.where(ok & (j < num), r.free_rows[jnp.minimum(j, cap - 1)], PAD_ROW)
    i = jnp.arange(cap, dtype=jnp.int32)
    src = i + num
    rest = jnp.where(src < r.num_free, r.free_rows[jnp.clip(src, 0, cap - 1)], PAD_ROW)
    new = replace(r, free_rows=rest, num_free=r.num_free - num)
    return tree_where(ok, new, r), rows, ok


@jit(static_argnames=("return_ok",))
def free_req_rows(
    r: ReqRowAllocator, rows: jax.Array, *, valid: jax.Array | None = None, return_ok: bool = False
) -> Any:
    """sglang ``ReqToTokenPool.free``: append the valid ``rows`` (i32[M]) to the free list.

    Rejected whole (state unchanged, ``ok=False``) when a valid row is outside
    ``[1, max_running_requests]``, already free (double free), or given twice; probes name the
    row when on.

    Returns:
      The new state, or ``(state, ok: bool[])`` with ``return_ok``.
    """
    cap = r.free_rows.shape[0]
    rows, valid = flat_ids(rows, valid)
    probes.detect_in_closed_range(rows, 1, cap, "free_req_rows: rows", where=valid)
    m = rows.shape[0]
    if m == 0:
        return (r, jnp.asarray(True)) if return_ok else r
    in_range = valid & (rows >= 1) & (rows <= cap)
    idx = jnp.where(in_range, rows, cap + 1)
    live = jnp.arange(cap) < r.num_free
    is_free = (
        jnp.zeros((cap + 2,), jnp.int32)
        .at[jnp.where(live, r.free_rows, cap + 1)]
        .add(1, mode="drop")
    )
    hits = jnp.zeros((cap + 2,), jnp.int32).at[idx].add(1, mode="drop")
    already = in_range & (is_free[idx] > 0)
    repeated = in_range & (hits[idx] > 1)
    if probes.probes_on():
        probes.assert_async(
            ~jnp.any(already),
            "free_req_rows: double free of row {row} (already free)",
            row=rows[jnp.argmax(already)],
        )
        probes.assert_async(
            ~jnp.any(repeated),
            "free_req_rows: row {row} freed twice in one call",
            row=rows[jnp.argmax(repeated)],
        )
    ok = ~jnp.any(valid & ~in_range) & ~jnp.any(already | repeated)
    dest = jnp.cumsum(valid.astype(jnp.int32)) - 1 + r.num_free
    free_rows = r.free_rows.at[jnp.where(valid, dest, cap)].set(rows, mode="drop")
    count = jnp.sum(valid.astype(jnp.int32))
    new = replace(r, free_rows=free_rows, num_free=jnp.minimum(r.num_free + count, cap))
    out = tree_where(ok, new, r)
    return (out, ok) if return_ok else out
