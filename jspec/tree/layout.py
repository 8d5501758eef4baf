"""The holey draft slot layout: ``prepare_for_draft``, prefix-tail duplication (SPEC.md §4.2-4.3).

Per request (``L`` = committed KV-ready length, ``P`` = page size, ``K`` = topk, ``S`` = steps)::

    lp = L % P        base = L - lp        nnp = ceil((lp + S) / P)     region = nnp * P

    row positions  [base + t*region, base + (t+1)*region)   = branch t's region, t = 0..K-1
      offset [0, lp)          holes: t = 0 -> the real prefix tail; t >= 1 -> copies of it
      offset [lp, lp + S)     draft slots, step s = 0..S-1   -> out_cache_loc[b, t, s]
      offset [lp + S, region) padding (allocated, unused)

    example P=4, K=2, S=3, L=7 (SPEC.md §14): lp=3, base=4, nnp=2
      branch 0: [4, 12)  holes 4,5,6 (real)   drafts 7,8,9     pad 10,11
      branch 1: [12, 20) holes 12,13,14 <- 4,5,6 (draft pool)  drafts 15,16,17  pad 18,19

When ``P == 1`` or ``K == 1`` the formula degenerates to sglang's contiguous layout
``row[L + t*S + s]`` (``assign_draft_cache_locs_contiguous``), so one code path serves both.

Why the holes: FA3 reads each draft branch through a page table from page offset 0, so branch
t's first page must start with the prefix-tail KV. Only the **draft** KV pool is touched; the
holes of t >= 1 lie past ``base + P > L - 1``, so no live KV is overwritten. The footprint
``K * region <= alloc_len_per_decode`` is guaranteed allocated by ``prepare_for_decode``.

All functions take a padded batch (static ``B``) with an optional ``valid: bool[B]`` mask;
padding rows read nothing, produce slot 0 and no copy pairs. Slot ids are int32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jspec import probes
from jspec._jit import jit
from jspec.config import TreeGeometry, check_geometry
from jspec.kernels.draft_cache_loc import draft_cache_loc, draft_rows_ok, max_prefix_tail_pairs
from jspec.kv.pool import KVPool, move_kv_cache

__all__ = [
    "draft_out_cache_loc",
    "draft_positions",
    "duplicate_prefix_tail_to_draft_branches",
    "max_prefix_tail_pairs",
    "prefix_tail_copy_pairs",
    "prepare_for_draft",
]


def draft_out_cache_loc(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    seq_lens: jax.Array,
    *,
    geometry: TreeGeometry,
    valid: jax.Array | None = None,
    impl: str = "xla",
    interpret: bool | None = None,
) -> jax.Array:
    """sglang ``prepare_for_draft``'s ``out_cache_loc``: the draft KV write targets.

    Args:
      req_to_token: i32[rows, R] position -> slot id table (row 0 = padding row).
      req_pool_indices: i32[B] request rows.
      seq_lens: i32[B] committed length ``L`` per request.
      geometry: static :class:`jspec.config.TreeGeometry` (``K``, ``S``, ``P``).
      valid: bool[B] live rows (None = all).
      impl: ``"xla"`` | ``"pallas"``; interpret: Pallas interpret mode (None = off GPU only).

    Returns:
      i32[B, K, S]: ``row_b[base + t*nnp*P + lp + s]`` (``row_b[L + t*S + s]`` when ``P == 1``
      or ``K == 1``); padding rows 0. ``reshape(-1)`` gives sglang's flat B*K*S order.
    """
    check_geometry(geometry, "draft_out_cache_loc")
    out, _, _, _ = draft_cache_loc(
        req_to_token,
        req_pool_indices,
        seq_lens,
        valid,
        geometry=geometry,
        max_pairs=0,
        impl=impl,
        interpret=interpret,
    )
    return out


def prefix_tail_copy_pairs(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    seq_lens: jax.Array,
    *,
    geometry: TreeGeometry,
    max_pairs: int,
    valid: jax.Array | None = None,
    impl: str = "xla",
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The ``(tgt, src)`` slot pairs of ``duplicate_prefix_tail_to_draft_branches`` (§4.3).

    For each valid b, t in 1..K-1, o < lp_b (in that order, packed):
    ``src = row_b[base_b + o]`` and ``tgt = row_b[base_b + t*nnp_b*P + o]``.

    Args:
      req_to_token, req_pool_indices, seq_lens, geometry, valid, impl,
        interpret: as :func:`draft_out_cache_loc`.
      max_pairs: static buffer capacity; :func:`max_prefix_tail_pairs` is the worst case.

    Returns:
      tgt_slot_ids: i32[max_pairs], src_slot_ids: i32[max_pairs] (unused tail ``0 -> 0``),
      num_pairs: i32[] = ``(K-1) * sum_b lp_b`` (0 when K == 1 or P == 1).
    """
    check_geometry(geometry, "prefix_tail_copy_pairs")
    _, tgt, src, num_pairs = draft_cache_loc(
        req_to_token,
        req_pool_indices,
        seq_lens,
        valid,
        geometry=geometry,
        max_pairs=max_pairs,
        impl=impl,
        interpret=interpret,
    )
    return tgt, src, num_pairs


def duplicate_prefix_tail_to_draft_branches(
    draft_pool: KVPool,
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    seq_lens: jax.Array,
    *,
    geometry: TreeGeometry,
    max_pairs: int | None = None,
    valid: jax.Array | None = None,
    impl: str = "xla",
    move_impl: str | None = None,
    interpret: bool | None = None,
) -> KVPool:
    """Copy each request's prefix-tail KV into the first-page holes of branches 1..K-1.

    Applied to the **draft** model's pool only (all layers, K and V) through
    ``move_kv_cache``; a no-op when ``topk == 1`` or ``page_size == 1``.

    Args:
      draft_pool: the draft model's KV pool.
      max_pairs: static pair capacity; None = the worst case ``B*(K-1)*(P-1)``. Unused pairs
        are ``(0 -> 0)`` moves inside the padding page.
      impl: pair generation (``"xla"`` | ``"pallas"``); move_impl: ``move_kv_cache``'s impl
        (None: ``impl``).
      Others: as :func:`prefix_tail_copy_pairs`.

    Returns:
      The draft pool with ``pool[:, tgt] = pool[:, src]``. NOTE: ``move_kv_cache`` donates
      ``draft_pool``: outside an outer ``jit`` the passed buffers are consumed (in place).
    """
    check_geometry(geometry, "duplicate_prefix_tail_to_draft_branches")
    if not geometry.is_holey:
        return draft_pool
    draft_pool, _ = _layout_and_holes(
        draft_pool,
        req_to_token,
        req_pool_indices,
        seq_lens,
        valid,
        geometry=geometry,
        max_pairs=max_pairs,
        impl=impl,
        move_impl=move_impl,
        interpret=interpret,
    )
    return draft_pool


def _layout_and_holes(
    draft_pool: KVPool,
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    seq_lens: jax.Array,
    valid: jax.Array | None,
    *,
    geometry: TreeGeometry,
    max_pairs: int | None,
    impl: str,
    move_impl: str | None,
    interpret: bool | None,
) -> tuple[KVPool, jax.Array]:
    """One ``draft_cache_loc`` launch, then (holey layout only) the hole copies: the shared
    body of :func:`duplicate_prefix_tail_to_draft_branches` and :func:`prepare_for_draft`.

    Returns ``(draft_pool, out_cache_loc i32[B, K, S])``.
    """
    holey = geometry.is_holey
    if max_pairs is None:
        max_pairs = max_prefix_tail_pairs(req_pool_indices.shape[0], geometry=geometry)
    out_cache_loc, tgt, src, _ = draft_cache_loc(
        req_to_token,
        req_pool_indices,
        seq_lens,
        valid,
        geometry=geometry,
        max_pairs=max_pairs if holey else 0,
        impl=impl,
        interpret=interpret,
    )
    if holey:
        draft_pool = move_kv_cache(
            draft_pool, tgt, src, impl=move_impl or impl, interpret=interpret
        )
    return draft_pool, out_cache_loc


@jit(static_argnames=("topk",))
def draft_positions(seq_lens: jax.Array, *, topk: int) -> jax.Array:
    """Draft-step positions ``repeat_interleave(seq_lens, K)``: i32[B*K]."""
    return jnp.repeat(seq_lens, topk, total_repeat_length=seq_lens.shape[0] * topk)


def prepare_for_draft(
    draft_pool: KVPool,
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    seq_lens: jax.Array,
    *,
    geometry: TreeGeometry,
    max_pairs: int | None = None,
    valid: jax.Array | None = None,
    impl: str = "xla",
    move_impl: str | None = None,
    interpret: bool | None = None,
    return_ok: bool = False,
) -> Any:
    """sglang ``prepare_for_draft`` (V2): layout, hole duplication and positions, one launch.

    ``page_size`` must be the draft pool's (``ValueError`` naming both otherwise). A valid
    request with a row out of range, a negative length or a draft footprint past the row
    (:func:`jspec.kernels.draft_cache_loc.draft_rows_ok`) makes the whole call a no-op:
    ``ok=False``, the pool unchanged, ``out_cache_loc`` all padding slot 0 (a probe names the
    value when on).

    Args:
      return_ok: static; also return the ``ok`` flag. Others: as :func:`draft_out_cache_loc`
        and :func:`duplicate_prefix_tail_to_draft_branches`.

    Returns:
      draft_pool: with the prefix tails duplicated (unchanged when K == 1 or P == 1; donated
        to ``move_kv_cache`` otherwise).
      out_cache_loc: i32[B, K, S] as :func:`draft_out_cache_loc`.
      positions: i32[B*K] as :func:`draft_positions`.
      ok: bool[] (only with ``return_ok``).
    """
    check_geometry(geometry, "prepare_for_draft")
    page_size = geometry.page_size
    probes.static_check(
        page_size == draft_pool.page_size,
        f"prepare_for_draft: page_size={page_size!r} must be the draft pool's "
        f"page_size={draft_pool.page_size}",
    )
    draft_pool, out_cache_loc = _layout_and_holes(
        draft_pool,
        req_to_token,
        req_pool_indices,
        seq_lens,
        valid,
        geometry=geometry,
        max_pairs=max_pairs,
        impl=impl,
        move_impl=move_impl,
        interpret=interpret,
    )
    out = (draft_pool, out_cache_loc, draft_positions(seq_lens, topk=geometry.topk))
    if not return_ok:
        return out
    live = jnp.ones(req_pool_indices.shape, bool) if valid is None else valid.astype(bool)
    ok = draft_rows_ok(
        req_to_token,
        req_pool_indices,
        seq_lens,
        live,
        geometry=geometry,
    )
    return out + (ok,)
