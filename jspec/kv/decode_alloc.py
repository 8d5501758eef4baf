"""Decode-step KV allocation for speculative decoding (SPEC.md §2 step 1, §3, §4.1, §10 end).

Each decode iteration grows every live request's allocated row to cover the next draft and
verify footprint, page aligned (sglang ``eagle_prepare_for_decode`` ->
``alloc_for_spec_decode``)::

    reserve = cfg.alloc_reserve_per_decode              (2 * alloc_len: overlap double buffer)
    cur     = kv_allocated_len
    nxt     = max(cur, ceil_P(kv_committed_len + reserve))
    row[cur : nxt] = new slots        alloc_extend continues the partial page at row[cur-1]+1
                                      (P > 1), or alloc(need) (P == 1)

    row:  [ committed KV | verify window / draft regions (reused every step) | ... ]
          0          committed                                            allocated <= R

Nothing is freed per step (``nxt`` only grows); the whole row ``[0, allocated)`` is released
when the request finishes (:func:`release_kv_cache`).

Requests are a padded batch (static ``B``) in :class:`ReqKVState`; padding rows have
``valid=False``, ``req_pool_indices=0`` (the padding row of req_to_token) and allocate nothing.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jspec import _index, probes
from jspec._jit import jit
from jspec._pytree import pytree_dataclass, replace, tree_where
from jspec.config import SpecConfig, ceil_div, ceil_to_multiple
from jspec.kv.allocator import PagedAllocator, alloc, alloc_extend, free
from jspec.kv.req_to_token import PAD_ROW, assign_req_to_token_pool, get_last_loc

__all__ = [
    "ReqKVState",
    "commit_kv_lens",
    "init_req_kv_state",
    "page_aligned_decode_alloc_lens",
    "prepare_for_decode",
    "release_kv_cache",
]


@pytree_dataclass
class ReqKVState:
    """Per-request KV lengths of a padded batch (sglang ``req.kv`` fields).

    Attributes:
      committed_lens: i32[B] ``kv_committed_len``: KV-ready prefix length ``L``.
      allocated_lens: i32[B] ``kv_allocated_len``: row positions ``[0, allocated)`` own slots.
        Invariant ``committed <= allocated <= R``; page aligned after any decode step.
      req_pool_indices: i32[B] req_to_token row (``PAD_ROW`` = 0 for padding rows).
      valid: bool[B] live requests.
    """

    # (B,)
    committed_lens: jax.Array
    # (B,)
    allocated_lens: jax.Array
    # (B,)
    req_pool_indices: jax.Array
    # (B,)
    valid: jax.Array


def init_req_kv_state(max_batch: int) -> ReqKVState:
    """An all-padding batch of ``max_batch`` rows."""
    zeros = jnp.zeros((max_batch,), jnp.int32)
    return ReqKVState(
        committed_lens=zeros,
        allocated_lens=zeros,
        req_pool_indices=jnp.full((max_batch,), PAD_ROW, jnp.int32),
        valid=jnp.zeros((max_batch,), bool),
    )


def page_aligned_decode_alloc_lens(
    committed_lens: jax.Array,
    allocated_lens: jax.Array,
    *,
    reserve: int,
    page_size: int,
    valid: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """sglang ``page_aligned_decode_alloc_lens`` (SPEC.md §3).

    Args:
      committed_lens, allocated_lens: i32[B].
      reserve: static ``alloc_reserve_per_decode``; page_size: static ``P``.
      valid: bool[B] (None = all); padding rows get ``nxt == cur``.

    Returns:
      cur: i32[B] = allocated_lens; nxt: i32[B] = ``max(cur, ceil_P(committed + reserve))``;
      need: i32[] = ``sum(nxt - cur)``.
    """
    cur = allocated_lens.astype(jnp.int32)
    target = (committed_lens + reserve + page_size - 1) // page_size * page_size
    nxt = jnp.maximum(cur, target.astype(jnp.int32))
    if valid is not None:
        nxt = jnp.where(valid, nxt, cur)
    return cur, nxt, jnp.sum(nxt - cur).astype(jnp.int32)


def _max_new_slots_default(batch: int, cfg: SpecConfig) -> int:
    # nxt - cur <= ceil_P(committed + reserve) - committed <= reserve + P - 1 (cur >= committed).
    return batch * (cfg.alloc_reserve_per_decode + cfg.page_size - 1)


def _static_validate_decode(
    allocator: PagedAllocator, req_to_token: jax.Array, reqs: ReqKVState, cfg: SpecConfig
) -> None:
    width = req_to_token.shape[1]
    worst = ceil_to_multiple(cfg.context_len + cfg.alloc_reserve_per_decode, cfg.page_size)
    # PR #26972's row-width invariant, always on here (sglang: only P > 1 and K > 1).
    probes.static_check(
        worst <= width,
        f"prepare_for_decode: worst-case allocated row length ceil_P(context_len + "
        f"alloc_reserve_per_decode) = {worst} exceeds the req_to_token row width {width} "
        f"(cfg.req_to_token_width={cfg.req_to_token_width}; spec v2 draft over-allocation, "
        f"PR #26972; {cfg})",
    )
    probes.static_check(
        allocator.page_size == cfg.page_size,
        f"prepare_for_decode: allocator.page_size={allocator.page_size} != "
        f"cfg.page_size={cfg.page_size}",
    )
    probes.static_check_dtype(req_to_token, jnp.int32, "req_to_token")
    (batch,) = reqs.valid.shape
    for name in ("committed_lens", "allocated_lens", "req_pool_indices"):
        probes.static_check_shape(getattr(reqs, name), (batch,), f"reqs.{name}")


def _rows_ok(reqs: ReqKVState, req_to_token: jax.Array, what: str) -> jax.Array:
    """bool[]: every valid request has its own real row and ``0 <= committed <= allocated <= R``.

    A row outside ``[1, rows)`` (jnp indexing would clamp or wrap it onto another request's
    row; row 0 is the padding row) or held by two valid requests would make the caller take
    pages for a row it cannot write, or free another request's pages. Probes name the entry.
    """
    num_rows, width = req_to_token.shape
    valid = reqs.valid.astype(bool)
    rows = reqs.req_pool_indices.astype(jnp.int32)
    committed, allocated = reqs.committed_lens, reqs.allocated_lens
    bad_row = _index.out_of_range(rows, valid, 1, num_rows)
    twice = _index.repeated(rows, valid, num_rows)
    bad_len = valid & ((committed < 0) | (committed > allocated) | (allocated > width))
    if probes.probes_on():
        for bad, msg in (
            (bad_row, f"row {{value}} outside [1, {num_rows})"),
            (twice, "row {value} held by two valid requests"),
        ):
            at, value = _index.first_bad(bad, rows)
            probes.assert_async(~jnp.any(bad), f"{what}: request {{at}}: {msg}", at=at, value=value)
        at, value = _index.first_bad(bad_len, committed)
        probes.assert_async(
            ~jnp.any(bad_len),
            f"{what}: request {{at}}: need 0 <= committed_len={{value}} <= allocated_len={{alloc}}"
            f" <= {width}",
            at=at,
            value=value,
            alloc=allocated[at],
        )
    return ~jnp.any(bad_row | twice | bad_len)


@jit(static_argnames=("cfg", "impl", "interpret", "max_new_slots"))
def prepare_for_decode(
    allocator: PagedAllocator,
    req_to_token: jax.Array,
    reqs: ReqKVState,
    cfg: SpecConfig,
    *,
    impl: str = "xla",
    interpret: bool | None = None,
    max_new_slots: int | None = None,
) -> tuple[PagedAllocator, jax.Array, ReqKVState, jax.Array]:
    """Grow every live row to ``nxt`` and write the new slots (``eagle_prepare_for_decode``).

    Args:
      allocator: the paged allocator.
      req_to_token: i32[rows, R] (row 0 = padding row).
      reqs: the padded batch.
      cfg: static config (page size, reserve, context length).
      impl: ``"xla"`` | ``"pallas"`` for ``alloc_extend`` and ``assign_req_to_token_pool``.
      interpret: Pallas interpret flag (None = interpret off GPU).
      max_new_slots: static capacity of the packed new-slot buffer; None = the worst case
        ``B * (reserve + P - 1)``. A larger ``need`` returns ``ok=False``.

    Returns:
      ``(allocator, req_to_token, reqs, ok)``. ``ok`` (bool[]) is False when pages are short,
      ``need > max_new_slots``, some ``nxt > R``, or a valid request's row is outside
      ``[1, rows)`` or shared with another valid request, or its lengths break
      ``0 <= committed <= allocated <= R``; then all three states are returned unchanged
      (probes name the request when on).

    Raises:
      ValueError (trace time): ``ceil_P(context_len + reserve) > R``, naming both widths.
    """
    _static_validate_decode(allocator, req_to_token, reqs, cfg)
    p = cfg.page_size
    width = req_to_token.shape[1]
    valid = reqs.valid.astype(bool)
    if max_new_slots is None:
        max_new_slots = _max_new_slots_default(valid.shape[0], cfg)
    rows_ok = _rows_ok(reqs, req_to_token, "prepare_for_decode")
    cur, nxt, _ = page_aligned_decode_alloc_lens(
        reqs.committed_lens,
        reqs.allocated_lens,
        reserve=cfg.alloc_reserve_per_decode,
        page_size=p,
        valid=valid,
    )
    max_nxt = jnp.max(jnp.where(valid, nxt, 0))
    width_ok = max_nxt <= width
    probes.assert_async(
        width_ok,
        "prepare_for_decode: max(nxt)={nxt} exceeds req_to_token row "
        f"width {width} (spec v2 draft over-allocation, PR #26972)",
        nxt=max_nxt,
    )
    # Rows that must not grow (padding, or everything when a row would overflow) ask for 0.
    prefix = jnp.where(valid, cur, 0)
    grow_ok = width_ok & rows_ok
    seq = jnp.where(valid & grow_ok, nxt, prefix)
    need = jnp.sum(seq - prefix)
    if p == 1:
        allocator, slot_ids, ok = alloc(allocator, need, max_slots=max_new_slots)
    else:
        last_loc = jnp.where(valid, get_last_loc(req_to_token, reqs.req_pool_indices, prefix), -1)
        allocator, slot_ids, ok = alloc_extend(
            allocator,
            prefix,
            seq,
            last_loc,
            max_new_slots=max_new_slots,
            impl=impl,
            interpret=interpret,
        )
    ok = ok & grow_ok
    # On failure nothing was taken from the allocator; write nothing either.
    end = jnp.where(ok, seq, prefix)
    req_to_token = assign_req_to_token_pool(
        req_to_token, reqs.req_pool_indices, prefix, end, slot_ids, impl=impl, interpret=interpret
    )
    reqs = replace(reqs, allocated_lens=jnp.where(valid & ok, nxt, reqs.allocated_lens))
    return allocator, req_to_token, reqs, ok


@jit(static_argnames=("return_ok",))
def commit_kv_lens(reqs: ReqKVState, accept_lens: jax.Array, *, return_ok: bool = False) -> Any:
    """Result processing: ``kv_committed_len += accept_len`` on live rows (SPEC.md §2 step 7).

    All or nothing: a valid row with ``accept_len < 0`` or ``committed + accept_len >
    allocated`` (KV past the row's pages) commits nothing (``ok=False``, ``reqs`` unchanged; a
    probe names the row when on).

    Args:
      reqs: the batch; accept_lens: i32[B] accepted tokens incl. the bonus.
      return_ok: static; also return the ``ok`` flag.

    Returns:
      The new ``reqs``, or ``(reqs, ok: bool[])`` with ``return_ok``.
    """
    probes.static_check_shape(accept_lens, reqs.valid.shape, "accept_lens")
    probes.static_check(
        jnp.issubdtype(accept_lens.dtype, jnp.integer),
        f"accept_lens.dtype={accept_lens.dtype} must be an integer dtype",
    )
    accept_lens = accept_lens.astype(jnp.int32)
    valid = reqs.valid.astype(bool)
    bad = valid & ((accept_lens < 0) | (reqs.committed_lens + accept_lens > reqs.allocated_lens))
    probes.assert_async(
        lambda: ~jnp.any(bad),
        "commit_kv_lens: accept_len {n} at row {row} is negative or takes committed past "
        "kv_allocated_len",
        row=lambda: jnp.argmax(bad),
        n=lambda: accept_lens[jnp.argmax(bad)],
    )
    ok = ~jnp.any(bad)
    new = replace(
        reqs,
        committed_lens=jnp.where(
            valid & ok, reqs.committed_lens + accept_lens, reqs.committed_lens
        ),
    )
    return (new, ok) if return_ok else new


@jit(static_argnames=("return_ok",))
def release_kv_cache(
    allocator: PagedAllocator,
    req_to_token: jax.Array,
    reqs: ReqKVState,
    finished: jax.Array,
    *,
    return_ok: bool = False,
) -> Any:
    """Free the whole row ``[0, allocated)`` of finished requests and mark them padding.

    sglang frees the committed part via the tree/chunk cache and the over-allocated tail
    ``[ceil_P(committed), allocated)`` via ``free_segment``, inside one
    ``free_group_begin/end`` (``process_batch_result``). With no prefix cache the union is the
    whole row, one page representative ``row[j*P]`` per page; the group end frees
    ``unique(pages)`` in ascending order, prepended (or staged when ``need_sort``) -- exactly
    :func:`jspec.kv.allocator.free` on the representatives.

    All or nothing: unless every valid request has its own row in ``[1, rows)`` and lengths
    ``0 <= committed <= allocated <= R``, and every page to free is a live page (not page 0,
    in range, not already free), nothing is released (``ok=False``, both states unchanged;
    probes name the request or page when on).

    Args:
      allocator: the allocator.
      req_to_token: i32[rows, R].
      reqs: the batch.
      finished: bool[B]; only valid rows are released.
      return_ok: static; also return the ``ok`` flag.

    Returns:
      ``(allocator, reqs)``, or ``(allocator, reqs, ok: bool[])`` with ``return_ok``: finished
      rows become padding (``valid=False``, lengths 0, ``req_pool_indices=0``). The caller
      frees the req_to_token rows themselves (use the old ``reqs.req_pool_indices``).
    """
    p = allocator.page_size
    width = req_to_token.shape[1]
    rows_ok = _rows_ok(reqs, req_to_token, "release_kv_cache")
    done = finished.astype(bool) & reqs.valid & rows_ok
    pos = jnp.arange(ceil_div(width, p), dtype=jnp.int32)[None, :] * p  # page starts
    live = done[:, None] & (pos < reqs.allocated_lens[:, None])  # bool[B, W/P]
    rows = jnp.where(done, reqs.req_pool_indices, PAD_ROW)
    slot_ids = req_to_token.reshape(-1)[(rows[:, None] * width + jnp.minimum(pos, width - 1))]
    new_allocator, free_ok = free(
        allocator, slot_ids.reshape(-1), valid=live.reshape(-1), return_ok=True
    )
    ok = rows_ok & free_ok
    done = done & ok
    zeros = jnp.zeros_like(reqs.committed_lens)
    new_reqs = ReqKVState(
        committed_lens=jnp.where(done, zeros, reqs.committed_lens),
        allocated_lens=jnp.where(done, zeros, reqs.allocated_lens),
        req_pool_indices=jnp.where(done, PAD_ROW, reqs.req_pool_indices),
        valid=reqs.valid & ~done,
    )
    new_allocator = tree_where(ok, new_allocator, allocator)
    return (new_allocator, new_reqs, ok) if return_ok else (new_allocator, new_reqs)
