"""Slot ids of ``alloc_extend`` (sglang ``alloc_extend_kernel`` / ``alloc_extend_naive``).

SPEC.md §10. Request ``b`` grows from ``pre = prefix_lens[b]`` to ``seq = seq_lens[b]`` tokens;
its new slots are packed at ``out[cu[b] : cu[b] + seq - pre]`` (``cu`` = exclusive cumsum of
``seq - pre``). With ``ceil_pre = ceil_P(pre)`` and ``page_start[b]`` = exclusive cumsum of
``ceil(seq/P) - ceil(pre/P)`` (the request's first page in the free list)::

    position pos in [pre, seq)     slot
    ----------------------------   ---------------------------------------------------------
    pos <  ceil_pre   (part 1)     last_loc + 1 + (pos - pre)        continue the partial page
    pos >= ceil_pre   (parts 2, 3) free_pages[page_start + (pos - ceil_pre) // P] * P + pos % P

Parts 2 and 3 of sglang (whole pages, then the partial tail page on the request's last new page)
are the same formula. Entries of ``out`` past the total keep the fill buffer (default 0).

Only the slot computation lives here: counts, cumsums, the OOM check and the free-list update stay
in XLA (``jspec.kv.allocator.alloc_extend``). Int32 everywhere (sglang's ``out_indices`` is int64).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec import probes
from jspec._jit import jit
from jspec.config import next_power_of_2
from jspec.kernels._common import pallas_call, resolve_impl, segment_owners

IMPLS = ("xla", "pallas")
# Slots written per loop iteration of one program (power of 2, masked tail).
MAX_BLOCK = 256


def _alloc_extend_kernel(
    prefix_ref,
    seq_ref,
    last_loc_ref,
    out_start_ref,
    page_start_ref,
    free_pages_ref,
    fill_ref,
    out_ref,
    *,
    page_size: int,
    block: int,
    max_new_slots: int,
):
    # prefix_ref, seq_ref, last_loc_ref: i32[B]   request lengths and last slot
    # out_start_ref, page_start_ref:     i32[B]   exclusive cumsums (slots, new pages)
    # free_pages_ref:                    i32[F]   free list (front = next page handed out)
    # fill_ref:                          i32[M]   aliased with out_ref (untouched entries)
    # out_ref:                           i32[M]   packed new slot ids
    del fill_ref
    b = pl.program_id(0)
    pre = prefix_ref[b]
    num_slots = jnp.maximum(seq_ref[b] - pre, 0)
    last_loc = last_loc_ref[b]
    out_start = out_start_ref[b]
    page_start = page_start_ref[b]
    ceil_pre = (pre + page_size - 1) // page_size * page_size
    offsets = jnp.arange(block, dtype=jnp.int32)

    def body(k, carry):
        t = k * block + offsets  # i32[block]: offset inside the request
        dst = out_start + t
        mask = (t < num_slots) & (dst < max_new_slots)
        pos = pre + t  # token position in the row
        continues = pos < ceil_pre  # part 1: the prefix's partial page
        page_idx = page_start + jnp.maximum(pos - ceil_pre, 0) // page_size
        page = pltriton.load(free_pages_ref.at[page_idx], mask=mask & ~continues, other=0)
        slot = jnp.where(continues, last_loc + 1 + t, page * page_size + pos % page_size)
        pltriton.store(out_ref.at[dst], slot, mask=mask)
        return carry

    jax.lax.fori_loop(0, (num_slots + block - 1) // block, body, 0)


def _layout(prefix_lens: jax.Array, seq_lens: jax.Array, page_size: int):
    """Per-request extend lengths and exclusive cumsums (XLA bookkeeping)."""
    num_slots = jnp.maximum(seq_lens - prefix_lens, 0)
    num_pages = jnp.where(
        num_slots > 0,
        (seq_lens + page_size - 1) // page_size - (prefix_lens + page_size - 1) // page_size,
        0,
    )
    out_start = jnp.cumsum(num_slots) - num_slots
    page_start = jnp.cumsum(num_pages) - num_pages
    return num_slots, out_start, page_start


def _check_args(prefix_lens, seq_lens, last_loc, free_pages, page_size, max_new_slots, out) -> None:
    probes.static_check_power_of_2(page_size, "page_size")
    probes.static_check(max_new_slots >= 0, f"max_new_slots={max_new_slots} must be >= 0")
    probes.static_check(prefix_lens.ndim == 1, f"prefix_lens.ndim={prefix_lens.ndim} must be 1")
    probes.static_check_shape(seq_lens, prefix_lens.shape, "seq_lens")
    probes.static_check_shape(last_loc, prefix_lens.shape, "last_loc")
    probes.static_check(free_pages.ndim == 1, f"free_pages.ndim={free_pages.ndim} must be 1")
    if out is not None:
        probes.static_check_shape(out, (max_new_slots,), "out")


@jit(static_argnames=("page_size", "max_new_slots", "impl", "interpret"))
def alloc_extend_slots(
    prefix_lens: jax.Array,
    seq_lens: jax.Array,
    last_loc: jax.Array,
    free_pages: jax.Array,
    *,
    page_size: int,
    max_new_slots: int,
    out: jax.Array | None = None,
    impl: str = "xla",
    interpret: bool | None = None,
) -> jax.Array:
    """Packed new slot ids of ``alloc_extend`` (no free-list update, no OOM check).

    Args:
      prefix_lens: i32[B]; tokens already allocated per request.
      seq_lens: i32[B]; target lengths; rows with ``seq <= prefix`` write nothing.
      last_loc: i32[B]; slot of position ``prefix-1`` (read only when ``prefix % P != 0``).
      free_pages: i32[F]; free list; must hold ``sum(new pages)`` live entries (caller's check).
      page_size: static ``P`` (power of 2).
      max_new_slots: static length ``M`` of the output.
      out: i32[M] fill buffer or None (zeros); entries past the total keep its values.
      impl: ``"xla"`` (:func:`alloc_extend_slots_reference`) or ``"pallas"``.
      interpret: Pallas interpret flag; None = interpret off-GPU.

    Returns:
      i32[M]: request ``b``'s slots at ``[cu[b], cu[b+1])``; writes past ``M`` are dropped.
    """
    impl = resolve_impl(impl, IMPLS, "alloc_extend_slots")
    _check_args(prefix_lens, seq_lens, last_loc, free_pages, page_size, max_new_slots, out)
    if impl == "xla":
        return alloc_extend_slots_reference(
            prefix_lens,
            seq_lens,
            last_loc,
            free_pages,
            page_size=page_size,
            max_new_slots=max_new_slots,
            out=out,
        )
    prefix_lens = prefix_lens.astype(jnp.int32)
    seq_lens = seq_lens.astype(jnp.int32)
    fill = jnp.zeros((max_new_slots,), jnp.int32) if out is None else out.astype(jnp.int32)
    if prefix_lens.shape[0] == 0 or max_new_slots == 0:
        return fill
    _, out_start, page_start = _layout(prefix_lens, seq_lens, page_size)
    block = min(MAX_BLOCK, next_power_of_2(max_new_slots))
    kernel = functools.partial(
        _alloc_extend_kernel, page_size=page_size, block=block, max_new_slots=max_new_slots
    )
    return pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((max_new_slots,), jnp.int32),
        grid=(prefix_lens.shape[0],),
        input_output_aliases={6: 0},
        interpret=interpret,
        name="alloc_extend_slots",
    )(
        prefix_lens,
        seq_lens,
        last_loc.astype(jnp.int32),
        out_start,
        page_start,
        free_pages.astype(jnp.int32),
        fill,
    )


def alloc_extend_slots_reference(
    prefix_lens: jax.Array,
    seq_lens: jax.Array,
    last_loc: jax.Array,
    free_pages: jax.Array,
    *,
    page_size: int,
    max_new_slots: int,
    out: jax.Array | None = None,
) -> jax.Array:
    """Pure-jnp oracle of :func:`alloc_extend_slots` (same args; one gather per output slot)."""
    prefix_lens = prefix_lens.astype(jnp.int32)
    seq_lens = seq_lens.astype(jnp.int32)
    last_loc = last_loc.astype(jnp.int32)
    fill = jnp.zeros((max_new_slots,), jnp.int32) if out is None else out.astype(jnp.int32)
    num_req = prefix_lens.shape[0]
    if num_req == 0 or max_new_slots == 0:
        return fill
    num_slots, out_start, page_start = _layout(prefix_lens, seq_lens, page_size)
    total = jnp.sum(num_slots)
    j = jnp.arange(max_new_slots, dtype=jnp.int32)
    # Owner request of output slot j: the last growing row whose segment starts at or before j.
    b = segment_owners(out_start, num_slots, max_new_slots)
    t = j - out_start[b]
    pre = prefix_lens[b]
    pos = pre + t
    ceil_pre = (pre + page_size - 1) // page_size * page_size
    page_idx = page_start[b] + jnp.maximum(pos - ceil_pre, 0) // page_size
    page = free_pages.astype(jnp.int32)[jnp.clip(page_idx, 0, max(free_pages.shape[0] - 1, 0))]
    slot = jnp.where(pos < ceil_pre, last_loc[b] + 1 + t, page * page_size + pos % page_size)
    return jnp.where(j < total, slot, fill)
