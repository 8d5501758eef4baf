"""Slot ids of ``alloc_decode`` (sglang ``alloc_decode_kernel`` / ``alloc_decode_naive``).

SPEC.md §10. One new token per request; ``seq_lens`` counts it. Request ``b`` needs a new page iff
``ceil(seq/P) > ceil((seq-1)/P)`` (``seq % P == 1`` for P > 1, always for P == 1)::

    new page?   slot
    ---------   ------------------------------------------------------------
    yes         free_pages[rank[b]] * P    rank = #new-page rows before b
    no          last_loc[b] + 1            continue the current page

Invalid rows keep the fill buffer (default 0) and take no page. The new-page flags and their
exclusive cumsum (the bookkeeping) are computed in XLA; the kernel does the gather and the select
over blocks of requests. Int32 everywhere (sglang's ``out_indices`` is int64).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec import probes
from jspec._index import valid_mask
from jspec._jit import jit
from jspec.config import next_power_of_2
from jspec.kernels._common import pallas_call, resolve_impl

IMPLS = ("xla", "pallas")
# Requests per program (power of 2, masked tail).
MAX_BLOCK = 256


def _alloc_decode_kernel(
    last_loc_ref,
    rank_ref,
    free_pages_ref,
    fill_ref,
    out_ref,
    *,
    block: int,
    page_size: int,
    num_req: int,
):
    # last_loc_ref: i32[B]  slot of position seq-2
    # rank_ref:     i32[B]  free-list index of the request's new page; -1: no new page;
    #                       -2: invalid row (keeps the fill value)
    # free_pages_ref: i32[F]
    # fill_ref:     i32[B]  aliased with out_ref
    # out_ref:      i32[B]  the new token's slot per request
    del fill_ref
    rows = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
    in_range = rows < num_req
    rank = pltriton.load(rank_ref.at[rows], mask=in_range, other=-2)
    last_loc = pltriton.load(last_loc_ref.at[rows], mask=in_range, other=0)
    new_page = rank >= 0
    page = pltriton.load(free_pages_ref.at[jnp.maximum(rank, 0)], mask=in_range & new_page, other=0)
    slot = jnp.where(new_page, page * page_size, last_loc + 1)
    pltriton.store(out_ref.at[rows], slot, mask=in_range & (rank >= -1))


def _ranks(seq_lens: jax.Array, valid: jax.Array, page_size: int) -> jax.Array:
    """i32[B]: free-list index of each new page, -1 for no new page, -2 for invalid rows."""
    new_page = valid & (
        (seq_lens + page_size - 1) // page_size > (seq_lens + page_size - 2) // page_size
    )
    flags = new_page.astype(jnp.int32)
    rank = jnp.cumsum(flags) - flags
    return jnp.where(new_page, rank, jnp.where(valid, -1, -2))


@jit(static_argnames=("page_size", "impl", "interpret"))
def alloc_decode_slots(
    seq_lens: jax.Array,
    last_loc: jax.Array,
    free_pages: jax.Array,
    *,
    page_size: int,
    valid: jax.Array | None = None,
    out: jax.Array | None = None,
    impl: str = "xla",
    interpret: bool | None = None,
) -> jax.Array:
    """New-token slot ids of ``alloc_decode`` (no free-list update, no OOM check).

    Args:
      seq_lens: i32[B]; lengths including the new token (``>= 1`` on valid rows).
      last_loc: i32[B]; slot of position ``seq-2`` (read when no new page is needed).
      free_pages: i32[F]; free list; must hold the number of new pages (caller's check).
      page_size: static ``P`` (power of 2).
      valid: bool[B] or None (all valid); invalid rows keep ``out``.
      out: i32[B] fill buffer or None (zeros).
      impl: ``"xla"`` (:func:`alloc_decode_slots_reference`) or ``"pallas"``.
      interpret: Pallas interpret flag; None = interpret off-GPU.

    Returns:
      i32[B] slot ids.
    """
    impl = resolve_impl(impl, IMPLS, "alloc_decode_slots")
    probes.static_check_power_of_2(page_size, "page_size")
    probes.static_check(seq_lens.ndim == 1, f"seq_lens.ndim={seq_lens.ndim} must be 1")
    probes.static_check_shape(last_loc, seq_lens.shape, "last_loc")
    valid = valid_mask(valid, seq_lens.shape)
    if out is not None:
        probes.static_check_shape(out, seq_lens.shape, "out")
    if impl == "xla":
        return alloc_decode_slots_reference(
            seq_lens, last_loc, free_pages, page_size=page_size, valid=valid, out=out
        )
    num_req = seq_lens.shape[0]
    fill = jnp.zeros((num_req,), jnp.int32) if out is None else out.astype(jnp.int32)
    if num_req == 0:
        return fill
    rank = _ranks(seq_lens.astype(jnp.int32), valid, page_size)
    block = min(MAX_BLOCK, next_power_of_2(num_req))
    kernel = functools.partial(
        _alloc_decode_kernel, block=block, page_size=page_size, num_req=num_req
    )
    return pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_req,), jnp.int32),
        grid=(pl.cdiv(num_req, block),),
        input_output_aliases={3: 0},
        interpret=interpret,
        name="alloc_decode_slots",
    )(last_loc.astype(jnp.int32), rank, free_pages.astype(jnp.int32), fill)


def alloc_decode_slots_reference(
    seq_lens: jax.Array,
    last_loc: jax.Array,
    free_pages: jax.Array,
    *,
    page_size: int,
    valid: jax.Array | None = None,
    out: jax.Array | None = None,
) -> jax.Array:
    """Pure-jnp oracle of :func:`alloc_decode_slots` (same args)."""
    num_req = seq_lens.shape[0]
    fill = jnp.zeros((num_req,), jnp.int32) if out is None else out.astype(jnp.int32)
    valid = jnp.ones((num_req,), bool) if valid is None else valid.astype(bool)
    rank = _ranks(seq_lens.astype(jnp.int32), valid, page_size)
    page = free_pages.astype(jnp.int32)[jnp.clip(rank, 0, free_pages.shape[0] - 1)]
    slot = jnp.where(rank >= 0, page * page_size, last_loc.astype(jnp.int32) + 1)
    return jnp.where(valid, slot, fill)
