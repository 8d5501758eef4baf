"""Draft write targets and prefix-tail hole pairs of the holey draft layout (SPEC.md §4.2, §4.3).

One launch computes, for a padded batch of ``B`` requests, both halves of sglang's
``prepare_for_draft`` bookkeeping:

* ``out_cache_loc[b, t, s] = row_b[base_b + t*nnp_b*P + lp_b + s]`` (the draft KV write
  targets, branch-major then step), and
* the ``(tgt, src)`` slot pairs of ``duplicate_prefix_tail_to_draft_branches``:
  ``tgt = row_b[base_b + t*nnp_b*P + o]``, ``src = row_b[base_b + o]`` for ``t in 1..K-1``,
  ``o < lp_b``, packed b-major, then t, then o (request b's pairs start at
  ``(K-1) * sum_{b' < b} lp_b'``); unused tail pairs are ``(0 -> 0)``.

with ``lp = L % P``, ``base = L - lp`` and ``nnp = ceil((lp + S) / P)``. NOTE: the same
formula is the contiguous layout ``row[L + t*S + s]`` when ``P == 1`` (lp=0, nnp*P=S) or
``K == 1`` (t=0), so one code path serves every (P, K).

Implementations (``impl=``):

* ``"xla"``: :func:`draft_cache_loc_reference`, pure jnp (a gather plus one scatter).
* ``"pallas"``: one program per request, Triton lowering: a power-of-2 gather block of
  ``K*S`` row positions, and a power-of-2 block over ``(t, o)`` hole positions scattered to the
  packed pair buffers (masked). The zero tail of the pair buffers comes from aliased zero
  inputs. No checks in the kernel: probes run in the XLA wrapper.

All slot ids are int32 (sglang's ``out_cache_loc`` is int64). Padding rows (``valid`` False)
read nothing and produce slot 0 and no pairs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jspec import probes
from jspec._compact import pack_to
from jspec._index import valid_mask
from jspec._jit import jit
from jspec._layout import draft_footprint, holey_geometry
from jspec.config import INT32_LIMIT, TreeGeometry, check_geometry, next_power_of_2
from jspec.kernels._common import pallas_call, resolve_impl
from jspec.sentinels import PAD_SLOT_ID

IMPLS = ("xla", "pallas")
# Value of unused out_cache_loc entries (padding rows) and of unused (tgt, src) pair entries:
# slot 0 lies in the reserved padding page 0, so a (0 -> 0) move is harmless.


def max_prefix_tail_pairs(batch_size: int, *, geometry: TreeGeometry) -> int:
    """Static worst-case pair count ``B * (K-1) * (P-1)`` (every ``lp = P-1``)."""
    return check_geometry(geometry, "max_prefix_tail_pairs").max_prefix_tail_pairs(batch_size)


def _static_validate(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    seq_lens: jax.Array,
    *,
    max_pairs: int,
) -> None:
    probes.static_check(
        isinstance(max_pairs, int) and max_pairs >= 0,
        f"max_pairs={max_pairs!r} must be an int >= 0",
    )
    probes.static_check(
        req_to_token.ndim == 2, f"req_to_token.shape={req_to_token.shape} must be 2-D"
    )
    probes.static_check(
        req_to_token.size < INT32_LIMIT,
        f"req_to_token.size={req_to_token.size} must be < 2**31 (flat int32 index)",
    )
    (batch,) = req_pool_indices.shape
    probes.static_check_shape(seq_lens, (batch,), "seq_lens")
    for name, x in (
        ("req_to_token", req_to_token),
        ("req_pool_indices", req_pool_indices),
        ("seq_lens", seq_lens),
    ):
        probes.static_check_dtype(x, jnp.int32, name)


def draft_rows_ok(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    seq_lens: jax.Array,
    valid: jax.Array,
    *,
    geometry: TreeGeometry,
) -> jax.Array:
    """bool[]: every valid request has a row in ``[0, rows)`` and ``0 <= L`` with the draft
    footprint ``base + K*nnp*P`` inside the row.

    Else a gather would clamp or wrap onto another row (a negative ``L`` reads the previous
    row, a footprint past the width the next one) and the hole copies would move another
    request's KV; :func:`draft_cache_loc` then treats every row as padding.
    """
    check_geometry(geometry, "draft_rows_ok")
    topk, num_steps, page_size = geometry.topk, geometry.num_steps, geometry.page_size
    rows, width = req_to_token.shape
    footprint = draft_footprint(seq_lens, topk=topk, num_steps=num_steps, page_size=page_size)
    bad = (req_pool_indices < 0) | (req_pool_indices >= rows) | (seq_lens < 0)
    return ~jnp.any(valid & (bad | (footprint > width)))


def _probe_positions(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    seq_lens: jax.Array,
    valid: jax.Array,
    *,
    geometry: TreeGeometry,
) -> None:
    """Probes: row indices in range and the draft footprint ``base + K*nnp*P`` inside the row."""
    if not probes.probes_on():  # the footprint is computed for the probe only
        return
    rows, width = req_to_token.shape
    footprint = draft_footprint(
        seq_lens,
        topk=geometry.topk,
        num_steps=geometry.num_steps,
        page_size=geometry.page_size,
    )
    probes.detect_oob(req_pool_indices, 0, rows, "draft_cache_loc: req_pool_indices", where=valid)
    probes.detect_in_closed_range(seq_lens, 0, width, "draft_cache_loc: seq_lens", where=valid)
    probes.detect_in_closed_range(
        footprint,
        0,
        width,
        "draft_cache_loc: draft footprint base + K*nnp*P vs row width",
        where=valid,
    )


def draft_cache_loc_reference(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    seq_lens: jax.Array,
    valid: jax.Array,
    *,
    geometry: TreeGeometry,
    max_pairs: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Pure-jnp oracle; see :func:`draft_cache_loc` for the contract."""
    check_geometry(geometry, "draft_cache_loc_reference")
    batch = req_pool_indices.shape[0]
    width = req_to_token.shape[1]
    k, s, p = geometry.topk, geometry.num_steps, geometry.page_size
    flat = req_to_token.reshape(-1)
    lp, base, region = holey_geometry(seq_lens, num_steps=s, page_size=p)  # i32[B] each
    row_start = req_pool_indices * width  # i32[B]

    def gather(pos: jax.Array, live: jax.Array) -> jax.Array:
        # pos: i32[B, ...] row positions; live masks padding rows / unused entries.
        idx = row_start.reshape((batch,) + (1,) * (pos.ndim - 1)) + pos
        val = flat.at[jnp.where(live, idx, 0)].get(mode="clip")
        return jnp.where(live, val, PAD_SLOT_ID)

    t = jnp.arange(k, dtype=jnp.int32)[None, :, None]
    step = jnp.arange(s, dtype=jnp.int32)[None, None, :]
    pos = (base + lp)[:, None, None] + t * region[:, None, None] + step  # i32[B, K, S]
    out_cache_loc = gather(pos, jnp.broadcast_to(valid[:, None, None], pos.shape))

    counts = jnp.where(valid, (k - 1) * lp, 0)  # pairs per request
    num_pairs = jnp.sum(counts).astype(jnp.int32)
    if max_pairs == 0 or k == 1 or p == 1:
        zeros = jnp.zeros((max_pairs,), jnp.int32)
        return out_cache_loc, zeros, zeros, num_pairs
    cu = jnp.cumsum(counts) - counts  # exclusive, i32[B]
    tb = jnp.arange(1, k, dtype=jnp.int32)[None, :, None]  # branches 1..K-1
    o = jnp.arange(p - 1, dtype=jnp.int32)[None, None, :]  # hole offsets
    live = valid[:, None, None] & (o < lp[:, None, None])  # bool[B, K-1, P-1]
    dst = cu[:, None, None] + (tb - 1) * lp[:, None, None] + o
    live = live & (dst < max_pairs)
    tgt_val = gather(base[:, None, None] + tb * region[:, None, None] + o, live)
    src_val = gather(jnp.broadcast_to(base[:, None, None] + o, live.shape), live)
    tgt = pack_to(dst, tgt_val, live, max_pairs, fill=PAD_SLOT_ID)
    src = pack_to(dst, src_val, live, max_pairs, fill=PAD_SLOT_ID)
    return out_cache_loc, tgt, src, num_pairs


def _draft_cache_loc_kernel(
    rpi_ref,
    seq_ref,
    valid_ref,
    cu_ref,
    r2t_ref,
    tgt_in_ref,
    src_in_ref,
    loc_ref,
    tgt_ref,
    src_ref,
    *,
    topk: int,
    num_steps: int,
    page_size: int,
    width: int,
    max_pairs: int,
    loc_block: int,
    pair_block: int,
) -> None:
    # rpi_ref:   i32[B]                 req_pool_indices
    # seq_ref:   i32[B]                 seq_lens (L)
    # valid_ref: i32[B]                 1 = live request, 0 = padding row
    # cu_ref:    i32[B]                 exclusive cumsum of the per-request pair counts
    # r2t_ref:   i32[rows * width]      req_to_token, flattened
    # tgt_in_ref, src_in_ref: i32[max_pairs + pair_block]   zeros, aliased to tgt_ref / src_ref
    # loc_ref:   i32[B * loc_block]     out_cache_loc, row b at [b*loc_block, b*loc_block + K*S)
    # tgt_ref, src_ref: i32[max_pairs + pair_block]   packed pairs; [max_pairs, ...) is scratch
    del tgt_in_ref, src_in_ref
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    b = pl.program_id(0)
    p = page_size
    seq_len = seq_ref[b]
    is_live = valid_ref[b] != 0
    row_start = rpi_ref[b] * width
    lp, base, region = holey_geometry(seq_len, num_steps=num_steps, page_size=p)

    # out_cache_loc: entry j = t*S + s -> row position base + t*region + lp + s.
    j = jnp.arange(loc_block, dtype=jnp.int32)
    t = j // num_steps
    live = (j < topk * num_steps) & is_live
    pos = base + t * region + lp + (j - t * num_steps)
    val = pltriton.load(r2t_ref.at[row_start + jnp.where(live, pos, 0)], mask=live, other=0)
    # Full power-of-2 block store (no mask): the row's padding columns are sliced off outside.
    loc_ref[pl.ds(b * loc_block, loc_block)] = jnp.where(live, val, PAD_SLOT_ID)

    if pair_block:
        # hole (t, o) for t in 1..K-1, o < lp -> packed index cu + (t-1)*lp + o.
        q = jnp.arange(pair_block, dtype=jnp.int32)
        tb = 1 + q // p
        o = q % p
        dst = cu_ref[b] + (tb - 1) * lp + o
        live = is_live & (tb < topk) & (o < lp) & (dst < max_pairs)
        tgt_val = pltriton.load(
            r2t_ref.at[row_start + jnp.where(live, base + tb * region + o, 0)], mask=live, other=0
        )
        src_val = pltriton.load(
            r2t_ref.at[row_start + jnp.where(live, base + o, 0)], mask=live, other=0
        )
        # NOTE: masked lanes get distinct in-range scratch indices past max_pairs: interpret
        # mode applies a masked scatter as a read-modify-write, and clamped duplicates would
        # race with live lanes. Compiled, masked lanes store nothing.
        dst = jnp.where(live, dst, max_pairs + q)
        pltriton.store(tgt_ref.at[dst], tgt_val, mask=live)
        pltriton.store(src_ref.at[dst], src_val, mask=live)


def _draft_cache_loc_pallas(
    req_to_token,
    req_pool_indices,
    seq_lens,
    valid,
    *,
    topk,
    num_steps,
    page_size,
    max_pairs,
    interpret,
):
    """Launch the kernel; the pair buffers start as padding pairs ``(PAD_SLOT_ID, PAD_SLOT_ID)``."""

    batch = req_pool_indices.shape[0]
    _rows, width = req_to_token.shape
    k, s, p = topk, num_steps, page_size
    lp, _, _ = holey_geometry(seq_lens, num_steps=s, page_size=p)
    counts = jnp.where(valid, (k - 1) * lp, 0)
    num_pairs = jnp.sum(counts).astype(jnp.int32)
    cu = (jnp.cumsum(counts) - counts).astype(jnp.int32)
    loc_block = next_power_of_2(k * s)
    with_pairs = max_pairs > 0 and k > 1 and p > 1
    pair_block = next_power_of_2((k - 1) * p) if with_pairs else 0
    buf = max_pairs + pair_block if with_pairs else 1
    kernel = functools.partial(
        _draft_cache_loc_kernel,
        topk=k,
        num_steps=s,
        page_size=p,
        width=width,
        max_pairs=max_pairs,
        loc_block=loc_block,
        pair_block=pair_block,
    )
    out_shape = (
        jax.ShapeDtypeStruct((batch * loc_block,), jnp.int32),
        jax.ShapeDtypeStruct((buf,), jnp.int32),
        jax.ShapeDtypeStruct((buf,), jnp.int32),
    )
    tgt_init = jnp.full((buf,), PAD_SLOT_ID, jnp.int32)
    src_init = jnp.full((buf,), PAD_SLOT_ID, jnp.int32)
    loc, tgt, src = pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(batch,),
        input_output_aliases={5: 1, 6: 2},
        interpret=interpret,
        name="draft_cache_loc",
    )(
        req_pool_indices,
        seq_lens,
        valid.astype(jnp.int32),
        cu,
        req_to_token.reshape(-1),
        tgt_init,
        src_init,
    )
    out_cache_loc = loc.reshape(batch, loc_block)[:, : k * s].reshape(batch, k, s)
    if not with_pairs:
        empty = jnp.zeros((max_pairs,), jnp.int32)
        return out_cache_loc, empty, empty, num_pairs
    return out_cache_loc, tgt[:max_pairs], src[:max_pairs], num_pairs


@jit(static_argnames=("geometry", "max_pairs", "impl", "interpret"))
def draft_cache_loc(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    seq_lens: jax.Array,
    valid: jax.Array | None = None,
    *,
    geometry: TreeGeometry,
    max_pairs: int,
    impl: str = "xla",
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Draft ``out_cache_loc`` and prefix-tail hole pairs in one pass (SPEC.md §4.2, §4.3).

    Args:
      req_to_token: i32[rows, R] token position -> KV slot id per request row; row 0 is padding.
      req_pool_indices: i32[B] request rows (padding rows: 0).
      seq_lens: i32[B] committed KV-ready prefix length ``L`` (the tree root sits at ``L``).
      valid: bool[B] live requests; None means all. Padding rows read nothing. If a valid
        row fails :func:`draft_rows_ok` (row out of range, negative ``L``, footprint past the
        row), every row is treated as padding (a probe names the value when on).
      geometry: static :class:`jspec.config.TreeGeometry` (``K``, ``S``, ``P``).
      max_pairs: static capacity of the pair buffers (see :func:`max_prefix_tail_pairs`);
        pairs past it are dropped (a probe fires). 0 asks for ``out_cache_loc`` only: no pairs
        are packed and the overflow probe is off.
      impl: ``"xla"`` or ``"pallas"``.
      interpret: Pallas interpret mode; None = interpret off GPU.

    Returns:
      out_cache_loc: i32[B, K, S] draft KV slot ids; padding rows 0.
      tgt_slot_ids: i32[max_pairs] packed hole slots (branch ``t >= 1`` first pages); tail 0.
      src_slot_ids: i32[max_pairs] packed prefix-tail slots; tail 0.
      num_pairs: i32[] true pair count ``(K-1) * sum(lp)`` over valid rows.
    """
    check_geometry(geometry, "draft_cache_loc")
    topk, num_steps, page_size = geometry.topk, geometry.num_steps, geometry.page_size
    impl = resolve_impl(impl, IMPLS, "draft_cache_loc")
    _static_validate(req_to_token, req_pool_indices, seq_lens, max_pairs=max_pairs)
    valid = valid_mask(valid, req_pool_indices.shape)
    _probe_positions(req_to_token, req_pool_indices, seq_lens, valid, geometry=geometry)
    # A bad row (draft_rows_ok) makes every row padding: slot 0, no pairs.
    valid = valid & draft_rows_ok(
        req_to_token, req_pool_indices, seq_lens, valid, geometry=geometry
    )
    if impl == "pallas":
        out = _draft_cache_loc_pallas(
            req_to_token,
            req_pool_indices,
            seq_lens,
            valid,
            topk=topk,
            num_steps=num_steps,
            page_size=page_size,
            max_pairs=max_pairs,
            interpret=interpret,
        )
    else:
        out = draft_cache_loc_reference(
            req_to_token, req_pool_indices, seq_lens, valid, geometry=geometry, max_pairs=max_pairs
        )
    if max_pairs > 0:  # max_pairs=0: the caller wants out_cache_loc only, no pairs to drop
        probes.assert_async(
            lambda: out[3] <= max_pairs,
            "draft_cache_loc: num_pairs {n} exceeds max_pairs=" + str(max_pairs),
            n=lambda: out[3],
        )
    return out
