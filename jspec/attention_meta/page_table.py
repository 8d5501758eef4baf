"""FA3 draft-decode attention metadata: pass A ("normal") and pass B ("expand"), SPEC.md §5.

For topk > 1 FA3 runs two non-causal attentions per draft step ``i`` (``d = i + 1`` draft
tokens visible) and merges them by log-sum-exp:

* pass A: ``B`` sequences, ``K`` queries each, over the full prefix pages ``[0, base)``;
* pass B: ``B*K`` sequences, one query each, over the branch's own pages: the first page of
  the branch region (whose holes hold the prefix tail ``lp = L % P``) and the draft slots::

      row positions of branch t (holey layout, SPEC.md §4.2; P = 4, L = 7, S = 3)
      [0 1 2 3 | 4 5 6 7 8 9 10 11 | 12 13 14 15 16 17 18 19]
       prefix  | branch 0 region   | branch 1 region
       pass A  | holes=tail d d d p| holes=copy d d d p
      expand page table of (b, t) at step i = distinct pages of its draft slots 0..i.

Pages needed by pass B: the ``d`` live draft slots of a branch are consecutive row positions
``lp .. lp+d-1`` of its region, so they span ``ceil((lp + d) / P) <= ceil((P - 1 + d) / P) <= d``
row pages. In general (any slots) ``d`` slots have at most ``d`` distinct consecutive pages,
never ``d + 1``: a page table of width ``>= d`` can never be written past, and sglang's cuda-graph
width ``d + 1`` always has at least one all-zero column. jspec requires ``width >= d`` at trace
time (``ValueError``, sglang's ``assert_buffer_fits`` of PR #27360) and defaults to ``d + 1``.

NOTE: deviations from sglang, all in padding/unused entries:

* expand ``page_table`` columns past the distinct-page count are 0 (sglang: stale);
* ``NormalMetadata.page_table`` columns past ``cache_seqlens // P`` are 0 (sglang writes row
  values up to ``ceil(max(L) / P)`` columns);
* ``cu_seqlens_k`` of both passes is the prefix sum of the ``cache_seqlens`` actually used
  (sglang's cuda-graph path keeps zeros / ``arange(0, B*K*d+1, d)``; FA3 with a page table reads
  ``cache_seqlens`` only);
* ``draft_decode_metadata`` stacks the S-1 steps with one page-table width ``S`` (sglang: a
  ``d + 1`` wide buffer per step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec import probes
from jspec._jit import jit
from jspec._layout import holey_geometry
from jspec._pytree import pytree_dataclass
from jspec.config import TreeGeometry, check_geometry
from jspec.kernels import expand_page_table as _expand

INT32_MAX = 2**31 - 1


@pytree_dataclass
class NormalMetadata:
    """FA3 pass-A metadata (the committed prefix, full pages only)."""

    # i32[B]: L - L % P (tokens of full prefix pages).
    cache_seqlens: jax.Array
    # i32[B+1]: arange(0, B*K + 1, K) (K queries per sequence).
    cu_seqlens_q: jax.Array
    # i32[B+1]: [0, cumsum(cache_seqlens)].
    cu_seqlens_k: jax.Array
    # i32[B, max_pages]: page ids row[0 : max_pages*P : P] // P; 0 past cache_seqlens // P.
    page_table: jax.Array


@pytree_dataclass
class ExpandMetadata:
    """FA3 pass-B metadata for draft steps ``i = 0 .. S-2`` (``decode_length = i + 1``)."""

    # i32[S-1, B*K]: (i + 1) + L % P.
    cache_seqlens: jax.Array
    # i32[B*K+1]: arange(B*K + 1) (one query per branch).
    cu_seqlens_q: jax.Array
    # i32[S-1, B*K+1]: [0, cumsum(cache_seqlens[i])].
    cu_seqlens_k: jax.Array
    # i32[S-1, B*K, S]: page ids of draft slots 0..i, distinct pages left-packed, 0 after.
    page_table: jax.Array


@pytree_dataclass
class DraftDecodeMetadata:
    """Both FA3 passes for all draft steps of one draft-decode call."""

    normal: NormalMetadata
    expand: ExpandMetadata


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.concatenate(
        [jnp.zeros(x.shape[:-1] + (1,), jnp.int32), jnp.cumsum(x, axis=-1, dtype=jnp.int32)],
        axis=-1,
    )


@jit(
    static_argnames=(
        "decode_length",
        "geometry",
        "page_table_width",
        "num_cols",
        "impl",
        "interpret",
    ),
)
def draft_decode_set_expand_metadata(
    last_page_lens: jax.Array,
    decode_length: int,
    cache_loc: jax.Array,
    *,
    geometry: TreeGeometry,
    page_table_width: int | None = None,
    num_cols: int | None = None,
    impl: str = "xla",
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """sglang ``draft_decode_set_expand_metadata`` with the #27360 slice to ``decode_length``.

    Args:
      last_page_lens: i32[B] ``seq_lens % page_size``.
      decode_length: static; ``d``, draft tokens visible at this step (``step + 1``).
      cache_loc: i32[B*K, W] draft slot ids, ``W >= num_cols`` (``out_cache_loc.reshape(B*K,
        S)``; sglang's int64 is int32 here), rows ordered (seq, branch). Only columns
        ``[0, num_cols)`` are read (in place, no copy).
      geometry: static :class:`jspec.config.TreeGeometry` (reads ``topk`` and ``page_size``).
      page_table_width: static; default ``num_cols + 1`` (sglang's cuda-graph buffer). Must be
        ``>= num_cols`` (the exact never-overflow bound, module docstring), else ``ValueError``
        at trace time.
      num_cols: static; columns of ``cache_loc`` turned into pages: default ``d`` (the #27360
        fix); ``W`` is sglang's function before it (every column; ``interop``'s drop-in).
      impl: ``"xla"`` | ``"pallas"`` | ``"triton"`` (GPU only).
      interpret: Pallas interpret mode; ``None`` means interpret off the GPU.

    Returns:
      cache_seqlens_int32: i32[B*K] = ``d + last_page_lens[r // K]``.
      page_table: i32[B*K, page_table_width] page ids; columns past the distinct-page count 0.
      An empty batch (B = 0) gives empty outputs.
    """
    check_geometry(geometry, "draft_decode_set_expand_metadata")
    page_size = geometry.page_size
    cols_name = "decode_length" if num_cols is None else "num_cols"
    num_cols = decode_length if num_cols is None else num_cols
    width = num_cols + 1 if page_table_width is None else page_table_width
    probes.static_check_int(decode_length, "decode_length")
    probes.static_check(
        cache_loc.ndim == 2 and cache_loc.shape[1] >= num_cols,
        f"cache_loc.shape={tuple(cache_loc.shape)} must be (B*K, W) with "
        f"W >= {cols_name}={num_cols}",
    )
    live = cache_loc[:, :num_cols]
    probes.detect_in_closed_range(
        last_page_lens, 0, page_size - 1, "draft_decode_set_expand_metadata: last_page_lens"
    )
    probes.detect_in_closed_range(
        live, 0, INT32_MAX, "draft_decode_set_expand_metadata: cache_loc (live columns)"
    )
    return _expand.expand_page_table(
        last_page_lens,
        cache_loc,
        decode_length=decode_length,
        geometry=geometry,
        page_table_width=width,
        num_cols=num_cols,
        impl=impl,
        interpret=interpret,
    )


# The raw Triton kernel of ``impl="triton"``, for callers launching it on their own tensors.
expand_page_table_triton_launch = _expand.triton_launch


def validate_row_args(
    req_to_token: jax.Array, req_pool_indices: jax.Array, seq_lens: jax.Array
) -> None:
    """Trace-time checks of the (req_to_token, req_pool_indices, seq_lens) triple."""
    probes.static_check(
        req_to_token.ndim == 2, f"req_to_token.ndim={req_to_token.ndim} must be 2 (i32[rows, R])"
    )
    probes.static_check(
        req_pool_indices.ndim == 1
        and seq_lens.ndim == 1
        and req_pool_indices.shape == seq_lens.shape,
        f"req_pool_indices.shape={tuple(req_pool_indices.shape)} and "
        f"seq_lens.shape={tuple(seq_lens.shape)} must both be (B,)",
    )
    for name, x in (
        ("req_to_token", req_to_token),
        ("req_pool_indices", req_pool_indices),
        ("seq_lens", seq_lens),
    ):
        probes.static_check_dtype(x, jnp.int32, name)


@jit(static_argnames=("geometry", "max_pages"))
def draft_decode_normal_metadata(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    seq_lens: jax.Array,
    *,
    geometry: TreeGeometry,
    max_pages: int,
) -> NormalMetadata:
    """FA3 pass-A metadata (SPEC.md §5.2, §5.3 "normal").

    Args:
      req_to_token: i32[num_req_rows, R] token slot ids per request row (row 0: padding).
      req_pool_indices: i32[B] request rows.
      seq_lens: i32[B] committed prefix lengths ``L``.
      geometry: static :class:`jspec.config.TreeGeometry` (reads ``page_size`` and ``topk``).
      max_pages: static page-table width, ``1 <= max_pages <= ceil(R / P)``; must cover every
        ``L // P`` (a probe checks it).

    Returns:
      :class:`NormalMetadata`; ``page_table`` holds page ids, 0 past ``L // P`` columns.
    """
    check_geometry(geometry, "draft_decode_normal_metadata")
    topk, page_size = geometry.topk, geometry.page_size
    validate_row_args(req_to_token, req_pool_indices, seq_lens)
    row_width = req_to_token.shape[1]
    row_pages = -(-row_width // page_size)
    probes.static_check(
        isinstance(max_pages, int) and 1 <= max_pages <= row_pages,
        f"max_pages={max_pages!r} must be an int in [1, ceil(R / page_size) = "
        f"{row_pages}] (R={row_width}, page_size={page_size})",
    )
    num_seqs = seq_lens.shape[0]
    _, cache_seqlens, _ = holey_geometry(seq_lens, num_steps=1, page_size=page_size)  # base
    num_live_pages = cache_seqlens // page_size
    probes.detect_oob(
        req_pool_indices, 0, req_to_token.shape[0], "draft_decode_normal_metadata: req_pool_indices"
    )
    probes.detect_in_closed_range(
        num_live_pages,
        0,
        max_pages,
        f"draft_decode_normal_metadata: full prefix pages vs max_pages={max_pages}",
    )
    # row[:, 0 : max_pages*P : P] // P: the first slot of every row page.
    first_slots = req_to_token[:, 0 : max_pages * page_size : page_size][req_pool_indices]
    col = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
    page_table = jnp.where(col < num_live_pages[:, None], first_slots // page_size, 0)
    return NormalMetadata(
        cache_seqlens=cache_seqlens.astype(jnp.int32),
        cu_seqlens_q=jnp.arange(0, num_seqs * topk + 1, topk, dtype=jnp.int32),
        cu_seqlens_k=_exclusive_cumsum(cache_seqlens.astype(jnp.int32)),
        page_table=page_table.astype(jnp.int32),
    )


@jit(static_argnames=("geometry", "max_pages", "impl", "interpret"))
def draft_decode_metadata(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    seq_lens: jax.Array,
    out_cache_loc: jax.Array,
    *,
    geometry: TreeGeometry,
    max_pages: int,
    impl: str = "xla",
    interpret: bool | None = None,
) -> DraftDecodeMetadata:
    """Both FA3 passes for draft steps ``0 .. S-2`` (sglang's per-step cuda-graph metadata).

    Runs unchanged on a padded bucket (padding rows: seq_len 1, request row 0, slots 0).

    Args:
      req_to_token: i32[num_req_rows, R]; req_pool_indices, seq_lens: i32[B].
      out_cache_loc: i32[B, K, S] (or any shape of ``B*K*S`` entries) draft slot ids.
      geometry: static :class:`jspec.config.TreeGeometry` (reads ``K``, ``S``, ``P``).
      max_pages: static, as in :func:`draft_decode_normal_metadata`.
      impl, interpret: the expand page-table kernel (``draft_decode_set_expand_metadata``).

    Returns:
      :class:`DraftDecodeMetadata`; expand page tables have width ``S`` for every step. For
      ``page_size == 1`` the expand page table is the slots copied (sglang's ``else`` branch).
    """
    check_geometry(geometry, "draft_decode_metadata")
    topk, num_steps, page_size = geometry.topk, geometry.num_steps, geometry.page_size
    validate_row_args(req_to_token, req_pool_indices, seq_lens)
    num_seqs = seq_lens.shape[0]
    num_rows = num_seqs * topk
    probes.static_check(
        out_cache_loc.size == num_rows * num_steps,
        f"out_cache_loc.size={out_cache_loc.size} must be B*topk*num_steps = "
        f"{num_rows * num_steps}",
    )
    probes.static_check_dtype(out_cache_loc, jnp.int32, "out_cache_loc")
    normal = draft_decode_normal_metadata(
        req_to_token,
        req_pool_indices,
        seq_lens,
        geometry=geometry,
        max_pages=max_pages,
    )
    cache_loc = out_cache_loc.reshape(num_rows, num_steps)
    last_page_lens, _, _ = holey_geometry(seq_lens, num_steps=num_steps, page_size=page_size)
    width = num_steps
    seqlens, tables = [], []
    for step in range(num_steps - 1):
        d = step + 1
        if page_size > 1:
            cache_seqlens, table = draft_decode_set_expand_metadata(
                last_page_lens,
                d,
                cache_loc,
                geometry=geometry,
                page_table_width=width,
                impl=impl,
                interpret=interpret,
            )
        else:
            cache_seqlens = jnp.full((num_rows,), d, jnp.int32)
            table = jnp.where(jnp.arange(width)[None, :] < d, cache_loc, 0)
        seqlens.append(cache_seqlens)
        tables.append(table)
    num_expand = num_steps - 1
    cache_seqlens = jnp.stack(seqlens) if seqlens else jnp.zeros((0, num_rows), jnp.int32)
    page_table = jnp.stack(tables) if tables else jnp.zeros((0, num_rows, width), jnp.int32)
    expand = ExpandMetadata(
        cache_seqlens=cache_seqlens.reshape(num_expand, num_rows),
        cu_seqlens_q=jnp.arange(num_rows + 1, dtype=jnp.int32),
        cu_seqlens_k=_exclusive_cumsum(cache_seqlens).reshape(num_expand, num_rows + 1),
        page_table=page_table.reshape(num_expand, num_rows, width).astype(jnp.int32),
    )
    return DraftDecodeMetadata(normal=normal, expand=expand)
