"""Write packed slot ids into req_to_token rows (sglang ``assign_req_to_token_pool``).

SPEC.md §4.1. For request ``b`` (batch order), with ``len_b = end[b] - start[b]`` and
``cu`` = exclusive cumsum of ``len``::

    req_to_token[req_pool_indices[b], start[b] : end[b]] = out_cache_loc[cu[b] : cu[b] + len_b]

Rows with ``start == end`` write nothing (padding rows). Reads past ``len(out_cache_loc)`` are
dropped (the caller's probe checks ``sum(len) <= M``). Two requests writing the same cell is
undefined (as in sglang). The Pallas kernel runs one program per request and updates the table
in place (``input_output_aliases``); the cumsum stays in XLA. Int32 table and slots (sglang's
``out_cache_loc`` is int64).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec import probes
from jspec.config import next_power_of_2
from jspec.kernels import _common
from jspec.kernels._common import pallas_call, segment_owners

IMPLS = ("xla", "pallas")
# Positions copied per loop iteration of one program (power of 2, masked tail).
MAX_BLOCK = 256


def _assign_req_to_token_pool_kernel(
    rows_ref,
    start_ref,
    end_ref,
    src_start_ref,
    loc_ref,
    table_in_ref,
    table_ref,
    *,
    block: int,
    width: int,
    num_locs: int,
):
    # rows_ref, start_ref, end_ref: i32[B]   target row and [start, end) positions
    # src_start_ref:                i32[B]   exclusive cumsum of end - start
    # loc_ref:                      i32[M]   packed slot ids (out_cache_loc)
    # table_in_ref:                 i32[R*W] aliased with table_ref
    # table_ref:                    i32[R*W] req_to_token, flattened row-major
    del table_in_ref
    b = pl.program_id(0)
    row = rows_ref[b]
    start = start_ref[b]
    length = jnp.maximum(end_ref[b] - start, 0)
    src_start = src_start_ref[b]
    offsets = jnp.arange(block, dtype=jnp.int32)

    def body(k, carry):
        t = k * block + offsets  # i32[block]: offset inside the segment
        src = src_start + t
        mask = (t < length) & (src < num_locs)
        slot = pltriton.load(loc_ref.at[src], mask=mask, other=0)
        pltriton.store(table_ref.at[row * width + start + t], slot, mask=mask)
        return carry

    jax.lax.fori_loop(0, (length + block - 1) // block, body, 0)


def validate_assign_args(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    start_offset: jax.Array,
    end_offset: jax.Array,
    out_cache_loc: jax.Array,
) -> None:
    """Trace-time shape and dtype checks of every impl (``jspec.kv.req_to_token`` calls them);
    raises ``ValueError`` naming the argument."""
    probes.static_check(req_to_token.ndim == 2, f"req_to_token.ndim={req_to_token.ndim} must be 2")
    probes.static_check_dtype(req_to_token, jnp.int32, "req_to_token")
    probes.static_check(
        req_pool_indices.ndim == 1, f"req_pool_indices.ndim={req_pool_indices.ndim} must be 1"
    )
    probes.static_check_shape(start_offset, req_pool_indices.shape, "start_offset")
    probes.static_check_shape(end_offset, req_pool_indices.shape, "end_offset")
    probes.static_check(
        out_cache_loc.ndim == 1, f"out_cache_loc.ndim={out_cache_loc.ndim} must be 1"
    )


def _segments(
    start_offset: jax.Array, end_offset: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """i32[B] each: ``start_offset``, the lengths ``max(end - start, 0)`` and their exclusive
    cumsum (where each request's slots start in ``out_cache_loc``)."""
    start_offset = start_offset.astype(jnp.int32)
    lengths = jnp.maximum(end_offset.astype(jnp.int32) - start_offset, 0)
    return start_offset, lengths, jnp.cumsum(lengths) - lengths


def resolve_impl(impl: str) -> str:
    """``impl`` if it is one of :data:`IMPLS`, else ``ValueError`` naming the choices."""
    return _common.resolve_impl(impl, IMPLS, "assign_req_to_token_pool")


def assign_req_to_token_pool_pallas(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    start_offset: jax.Array,
    end_offset: jax.Array,
    out_cache_loc: jax.Array,
    *,
    interpret: bool | None = None,
) -> jax.Array:
    """The Pallas kernel behind ``impl="pallas"`` (the op, its checks, probes and ``impl=``
    dispatch: ``jspec.kv.req_to_token``): one program per request, the table updated in place.

    Args:
      req_to_token: i32[R, W]; the table (donate it under ``jit`` for a true in-place update).
      req_pool_indices: i32[B]; row per request (0 = the padding row).
      start_offset, end_offset: i32[B]; positions ``[start, end)`` to write; ``end <= W``.
      out_cache_loc: i32[M]; packed slot ids in batch order.
      interpret: Pallas interpret flag; None = interpret off-GPU.

    Returns:
      i32[R, W]: the updated table, as :func:`assign_req_to_token_pool_reference`.
    """
    num_req = req_pool_indices.shape[0]
    num_locs = out_cache_loc.shape[0]
    if num_req == 0 or num_locs == 0:
        return req_to_token  # nothing to write, no program to launch
    num_rows, width = req_to_token.shape
    start_offset, lengths, src_start = _segments(start_offset, end_offset)
    block = min(MAX_BLOCK, next_power_of_2(min(num_locs, width)))
    kernel = functools.partial(
        _assign_req_to_token_pool_kernel, block=block, width=width, num_locs=num_locs
    )
    flat = pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((num_rows * width,), jnp.int32),
        grid=(num_req,),
        input_output_aliases={5: 0},
        interpret=interpret,
        name="assign_req_to_token_pool",
    )(
        req_pool_indices.astype(jnp.int32),
        start_offset,
        end_offset.astype(jnp.int32),
        src_start,
        out_cache_loc.astype(jnp.int32),
        req_to_token.reshape(-1),
    )
    return flat.reshape(num_rows, width)


def assign_req_to_token_pool_reference(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    start_offset: jax.Array,
    end_offset: jax.Array,
    out_cache_loc: jax.Array,
) -> jax.Array:
    """Pure-jnp oracle of :func:`assign_req_to_token_pool_pallas`: one scatter over the M
    sources."""
    num_req = req_pool_indices.shape[0]
    num_locs = out_cache_loc.shape[0]
    num_rows, width = req_to_token.shape
    if num_req == 0 or num_locs == 0:
        return req_to_token
    start_offset, lengths, src_start = _segments(start_offset, end_offset)
    total = jnp.sum(lengths)
    j = jnp.arange(num_locs, dtype=jnp.int32)
    b = segment_owners(src_start, lengths, num_locs)  # owner request of source j
    col = start_offset[b] + (j - src_start[b])
    row = req_pool_indices.astype(jnp.int32)[b]
    # Sources past the total (and cells outside the row) are dropped through an out-of-range
    # row index (a negative index would wrap around).
    row = jnp.where((j < total) & (col >= 0) & (col < width), row, num_rows)
    return req_to_token.at[row, col].set(out_cache_loc.astype(jnp.int32), mode="drop")
