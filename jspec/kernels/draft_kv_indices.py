"""FlashInfer draft-decode kv_indices/kv_indptr: sglang ``generate_draft_decode_kv_indices``.

SPEC.md §6.1. For every draft step ``i`` (``it = i + 1`` draft tokens visible) one row of token
slot ids lists, per branch segment ``z = b*K + t`` in seq-major then branch order, the request's
committed prefix followed by the branch's own draft slots for steps ``0..i``::

    step row i:  | b=0,t=0          | b=0,t=1          | ... | b=B-1,t=K-1      | 0 0 0 ... 0 |
                 | row_0[0:L_0] d.. | row_0[0:L_0] d.. | ... |                  |  (unused)   |
                 ^ kv_indptr[i, 0]  ^ kv_indptr[i, 1]                          ^ kv_indptr[i, B*K]

    kv_indptr[i, z] = K * sum_{b' < b} L_b' + t * L_b + z * it      (z = b*K + t)
    draft slots of (b, t):  row_b[ext + s], s = 0..i, with
        ext = L_b + t*S                            if page_size == 1 or topk == 1
        ext = base_b + t*nnp_b*P + lp_b            otherwise (the holey layout, SPEC.md §4.2)

Entries past the used length ``K * sum(L) + B*K*it`` of a row are **0** in a fresh output
(sglang leaves stale values; FlashInfer never reads them). With ``kv_indices_buffer`` given, the
buffer is updated in place (aliased) and those entries keep the buffer's previous values, like
sglang's persistent cuda-graph buffer: no ``S * W`` zero fill, which is most of the cost when
``W = max_bs * K * context_len`` is much larger than the used length.

Writes at or past the row width ``W`` are masked off in every impl (never an out-of-bounds
write); the wrapper in ``jspec.attention_meta.kv_indices`` checks the width statically and with a
probe. Reads past the ``req_to_token`` row width are masked too (they yield 0).

Kernels (``impl=``): ``"xla"`` (the reference: a gather per output entry through a
``searchsorted`` over ``kv_indptr``), ``"pallas"`` (grid ``(B, K)``; program (b, t) copies its
prefix once per token block and stores it into all ``S`` step rows, then writes its draft slots
and its ``kv_indptr`` entries), ``"triton"`` (the same kernel in raw Triton,
``jspec.kernels.triton_meta``, planned by :func:`triton_launch`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec import _layout
from jspec.config import TreeGeometry, check_geometry, next_power_of_2
from jspec.kernels import _common
from jspec.kernels._common import TritonLaunch

# Token slots copied per block (power of 2): wide blocks, the op is a big copy.
BLOCK_TOKENS = 1024
NUM_WARPS = 4
IMPLS = ("xla", "pallas", "triton")


def draft_kv_indptr(seq_lens: jax.Array, *, geometry: TreeGeometry) -> jax.Array:
    """Closed form ``kv_indptr[i, z] = K*sum_{b'<b} L_b' + t*L_b + z*(i+1)``: i32[S, B*K+1]."""
    check_geometry(geometry, "draft_kv_indptr")
    topk, num_steps = geometry.topk, geometry.num_steps
    num_seqs = seq_lens.shape[0]
    cum = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(seq_lens, dtype=jnp.int32)])
    z = jnp.arange(num_seqs * topk + 1, dtype=jnp.int32)
    seq = z // topk
    branch = z % topk
    own_len = jnp.concatenate([seq_lens, jnp.zeros((1,), jnp.int32)])[seq]
    base = topk * cum[seq] + branch * own_len
    its = jnp.arange(1, num_steps + 1, dtype=jnp.int32)[:, None]
    return (base[None, :] + z[None, :] * its).astype(jnp.int32)


def draft_ext_start(seq_lens: jax.Array, *, geometry: TreeGeometry) -> jax.Array:
    """Row position of each branch's step-0 draft slot: i32[B, K] (SPEC.md §4.2, §6.1)."""
    check_geometry(geometry, "draft_ext_start")
    topk, num_steps, page_size = geometry.topk, geometry.num_steps, geometry.page_size
    branch = jnp.arange(topk, dtype=jnp.int32)[None, :]
    return _layout.draft_ext_start(
        seq_lens[:, None], branch, num_steps=num_steps, page_size=page_size
    )


# ---- reference ------------------------------------------------------------------------------
def draft_kv_indices_reference(
    req_pool_indices: jax.Array,
    req_to_token: jax.Array,
    seq_lens: jax.Array,
    *,
    geometry: TreeGeometry,
    kv_indices_width: int,
    kv_indices_buffer: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp oracle: every output entry gathers its slot (see the module docstring).

    Returns ``(kv_indices i32[S, W], kv_indptr i32[S, B*K+1])``; entries past the used length
    are 0, or ``kv_indices_buffer``'s values when a buffer is given.
    """
    check_geometry(geometry, "draft_kv_indices_reference")
    topk, num_steps = geometry.topk, geometry.num_steps
    num_seqs = seq_lens.shape[0]
    num_rows = num_seqs * topk
    width = kv_indices_width
    row_width = req_to_token.shape[1]
    kv_indptr = draft_kv_indptr(seq_lens, geometry=geometry)
    old = (
        jnp.zeros((num_steps, width), jnp.int32) if kv_indices_buffer is None else kv_indices_buffer
    )
    if num_seqs == 0 or width == 0:
        return old, kv_indptr
    pos = jnp.arange(width, dtype=jnp.int32)
    # Segment of every entry: the last z with kv_indptr[i, z] <= p (segments may be empty).
    seg = jax.vmap(lambda row: jnp.searchsorted(row, pos, side="right"))(kv_indptr) - 1
    seg = jnp.clip(seg, 0, num_rows - 1).astype(jnp.int32)  # [S, W]
    local = pos[None, :] - jnp.take_along_axis(kv_indptr, seg, axis=1)
    seq = seg // topk
    seq_len = seq_lens[seq]
    ext = draft_ext_start(seq_lens, geometry=geometry).reshape(-1)[seg]
    src = jnp.where(local < seq_len, local, ext + local - seq_len)
    in_row = (src >= 0) & (src < row_width)
    slots = req_to_token[req_pool_indices[seq], jnp.clip(src, 0, row_width - 1)]
    slots = jnp.where(in_row, slots, 0)
    used = kv_indptr[:, num_rows : num_rows + 1]
    return jnp.where(pos[None, :] < used, slots, old).astype(jnp.int32), kv_indptr


# ---- Pallas kernel ---------------------------------------------------------------------------
def _draft_kv_indices_kernel(
    req_pool_indices_ref,  # i32[B]
    req_to_token_ref,  # i32[num_req_rows, R]
    seq_lens_ref,  # i32[B]
    kv_indices_in_ref,  # i32[S, W] (aliased to kv_indices_ref)
    kv_indices_ref,  # i32[S, W] (out)
    kv_indptr_ref,  # i32[S, B*K+1] (out)
    *,
    num_seqs: int,
    topk: int,
    num_steps: int,
    page_size: int,
    width: int,
    row_width: int,
    block_tokens: int,
    block_seqs: int,
    block_steps: int,
):
    del kv_indices_in_ref  # same buffer as kv_indices_ref
    seq = pl.program_id(0)
    branch = pl.program_id(1)
    seq_ids = jnp.arange(block_seqs, dtype=jnp.int32)
    all_lens = pltriton.load(
        seq_lens_ref.at[pl.ds(0, block_seqs)], mask=seq_ids < num_seqs, other=0
    )  # [BS]
    cum_len = jnp.sum(jnp.where(seq_ids < seq, all_lens, 0))  # sum_{b' < b} L_b'
    total_len = jnp.sum(all_lens)
    seq_len = seq_lens_ref[seq]
    req = req_pool_indices_ref[seq]
    z = seq * topk + branch
    # Segment (b, t) of step row i starts at seg_base + z * (i + 1).
    seg_base = cum_len * topk + branch * seq_len

    # kv_indptr: entry z of every step row; the last program also writes entry B*K.
    is_last = (seq == num_seqs - 1) & (branch == topk - 1)
    for i in range(num_steps):
        kv_indptr_ref[jnp.int32(i), z] = seg_base + z * (i + 1)

    @pl.when(is_last)
    def _():
        for i in range(num_steps):
            kv_indptr_ref[jnp.int32(i), jnp.int32(num_seqs * topk)] = (
                total_len * topk + num_seqs * topk * (i + 1)
            )

    # Prefix: copy row[0:L] once per token block into all S step rows (slots read past the row
    # width R are 0, like the reference).
    copy_len = jnp.minimum(seq_len, row_width)
    num_blocks = (seq_len + block_tokens - 1) // block_tokens

    def copy_block(blk, carry):
        tok0 = blk * block_tokens
        tok = tok0 + jnp.arange(block_tokens, dtype=jnp.int32)  # [BT]
        slots = pltriton.load(
            req_to_token_ref.at[req, pl.ds(tok0, block_tokens)], mask=tok < copy_len, other=0
        )
        for i in range(num_steps):
            start = seg_base + z * (i + 1)
            pltriton.store(
                kv_indices_ref.at[jnp.int32(i), pl.ds(start + tok0, block_tokens)],
                slots,
                mask=(tok < seq_len) & (start + tok < width),
            )
        return carry

    jax.lax.fori_loop(0, num_blocks, copy_block, jnp.int32(0))

    # Draft slots: row[ext + s] for s <= i, right after the prefix.
    ext = _layout.draft_ext_start(seq_len, branch, num_steps=num_steps, page_size=page_size)
    step = jnp.arange(block_steps, dtype=jnp.int32)  # [BSt]
    draft_slots = pltriton.load(
        req_to_token_ref.at[req, pl.ds(ext, block_steps)],
        mask=(step < num_steps) & (ext + step >= 0) & (ext + step < row_width),
        other=0,
    )
    for i in range(num_steps):
        start = seg_base + z * (i + 1) + seq_len
        pltriton.store(
            kv_indices_ref.at[jnp.int32(i), pl.ds(start, block_steps)],
            draft_slots,
            mask=(step <= i) & (start + step < width),
        )


def draft_kv_indices_pallas(
    req_pool_indices: jax.Array,
    req_to_token: jax.Array,
    seq_lens: jax.Array,
    kv_indices_buffer: jax.Array,
    *,
    geometry: TreeGeometry,
    interpret: bool | None,
    block_tokens: int = BLOCK_TOKENS,
) -> tuple[jax.Array, jax.Array]:
    """The Pallas kernel behind ``impl="pallas"``: grid ``(B, K)``, no validation.

    ``kv_indices_buffer``: i32[S, W], updated in place (aliased); the other arrays and the
    returned ``(kv_indices, kv_indptr)`` as in :func:`draft_kv_indices_reference`. ``B >= 1``
    and ``W >= 1``.
    """
    check_geometry(geometry, "draft_kv_indices_pallas")
    topk, num_steps, page_size = geometry.topk, geometry.num_steps, geometry.page_size
    num_seqs = seq_lens.shape[0]
    width = kv_indices_buffer.shape[1]
    kernel = functools.partial(
        _draft_kv_indices_kernel,
        num_seqs=num_seqs,
        topk=topk,
        num_steps=num_steps,
        page_size=page_size,
        width=width,
        row_width=req_to_token.shape[1],
        block_tokens=next_power_of_2(block_tokens),
        block_seqs=next_power_of_2(num_seqs),
        block_steps=next_power_of_2(num_steps),
    )
    return _common.pallas_call(
        kernel,
        out_shape=_out_shape(num_seqs, topk, num_steps, width),
        grid=(num_seqs, topk),
        input_output_aliases={3: 0},
        interpret=interpret,
        num_warps=NUM_WARPS,
        name="jspec_draft_kv_indices",
    )(req_pool_indices, req_to_token, seq_lens, kv_indices_buffer)


# ---- raw Triton (the kernel source is jspec.kernels.triton_meta's) ----------------------------
def triton_launch(
    num_seqs: int,
    kv_indices_width: int,
    row_width: int,
    *,
    geometry: TreeGeometry,
    block_tokens: int = BLOCK_TOKENS,
) -> TritonLaunch:
    """The raw Triton kernel behind ``impl="triton"``, planned for one call.

    Launch ``kernel[grid](req_pool_indices i32[B], req_to_token i32[rows, row_width], seq_lens
    i32[B], kv_indices i32[S, kv_indices_width] (in), kv_indices (out: the same buffer),
    kv_indptr i32[S, B*K+1] (out), **options)`` on contiguous buffers (a caller's own tensors:
    ``interop.triton_meta``): the values of :func:`draft_kv_indices_reference` in place. No
    validation. Imports triton: set ``TRITON_INTERPRET=1`` before its first import to run in
    Triton's interpreter.
    """
    check_geometry(geometry, "triton_launch")
    topk, num_steps, page_size = geometry.topk, geometry.num_steps, geometry.page_size
    from jspec.kernels import triton_meta  # imports triton

    options = {
        "NUM_SEQS": num_seqs,
        "TOPK": topk,
        "NUM_STEPS": num_steps,
        "PAGE_SIZE": page_size,
        "WIDTH": kv_indices_width,
        "ROW_WIDTH": row_width,
        "BLOCK_TOKENS": next_power_of_2(block_tokens),
        "BLOCK_SEQS": next_power_of_2(num_seqs),
        "BLOCK_STEPS": next_power_of_2(num_steps),
        "num_warps": NUM_WARPS,
        "num_stages": 1,
    }
    kernel = triton_meta.get_kernel("draft_kv_indices")
    return TritonLaunch(kernel, (num_seqs, topk), options)


def _out_shape(num_seqs: int, topk: int, num_steps: int, width: int) -> tuple:
    """``(kv_indices i32[S, W], kv_indptr i32[S, B*K+1])``."""
    return (
        jax.ShapeDtypeStruct((num_steps, width), jnp.int32),
        jax.ShapeDtypeStruct((num_steps, num_seqs * topk + 1), jnp.int32),
    )


# ---- impl= (the op, with its validation, probes and dispatch: jspec.attention_meta.kv_indices) ---
def resolve_impl(impl: str) -> str:
    """``impl`` if it is one of :data:`IMPLS` (``"triton"`` on a GPU backend only), else
    ``ValueError`` naming the choices."""
    return _common.resolve_impl(impl, IMPLS, "draft_kv_indices")


def draft_kv_indices_triton(
    req_pool_indices: jax.Array,
    req_to_token: jax.Array,
    seq_lens: jax.Array,
    kv_indices_buffer: jax.Array,
    *,
    geometry: TreeGeometry,
    block_tokens: int = BLOCK_TOKENS,
) -> tuple[jax.Array, jax.Array]:
    """The raw Triton kernel behind ``impl="triton"`` through ``jax_triton`` (GPU only): the
    arguments and outputs of :func:`draft_kv_indices_pallas`."""
    check_geometry(geometry, "draft_kv_indices_triton")
    topk, num_steps = geometry.topk, geometry.num_steps
    num_seqs = seq_lens.shape[0]
    kv_indices_width = kv_indices_buffer.shape[1]
    launch = triton_launch(
        num_seqs,
        kv_indices_width,
        req_to_token.shape[1],
        geometry=geometry,
        block_tokens=block_tokens,
    )
    return _common.triton_call(
        launch,
        req_pool_indices,
        req_to_token,
        seq_lens,
        kv_indices_buffer,
        out_shape=_out_shape(num_seqs, topk, num_steps, kv_indices_width),
        input_output_aliases={3: 0},
        name="jspec_draft_kv_indices_triton",
    )
