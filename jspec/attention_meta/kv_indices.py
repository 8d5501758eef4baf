"""FlashInfer / Triton draft-decode metadata: ``kv_indices`` and ``kv_indptr`` (SPEC.md §6).

FlashInfer reads the draft KV token by token (``kv_last_page_len`` all ones: page size 1
semantics), so one flat row of token slot ids per draft step suffices::

    kv_indices[i] = [ seg(0,0) | seg(0,1) | ... | seg(B-1,K-1) | unused ... ]   i32[S, W]
    seg(b, t)     = row_b[0 : L_b]  ++  draft slots of branch t for steps 0..i
    kv_indptr[i]  = segment starts, kv_indptr[i, B*K] = used length            i32[S, B*K+1]

    used length of row i = draft_kv_indices_used_len(sum(L), K, B*K, i + 1)
                         = sum(L) * K + B*K*(i + 1)

The draft slots of branch t start at ``L + t*S`` (page_size 1 or topk 1) or at
``base + t*nnp*P + lp`` (the holey layout, SPEC.md §4.2). Step row ``S-1`` is computed too
(sglang's kernel launches over all S steps) though only rows ``0 .. S-2`` are consumed.

Capacity: the row width ``W`` is ``SpecConfig.kv_indices_width(max_bs) = max_bs * K *
context_len`` (the K factor is PR #27338's fix). The used length is checked

* at trace time: ``W >= B*K*S`` always (each segment has at least ``i + 1`` entries), and
  ``W >= B*K*(max_seq_len + S)`` when the static bound ``max_seq_len`` is given;
* at run time by a probe (``sum(L)*K + B*K*S <= W``, off by default);
* and writes at or past ``W`` are masked in every impl: never an out-of-bounds write.

Entries past the used length: 0 in a fresh output; with ``kv_indices_buffer`` they keep the
buffer's values (in-place update, no ``S * W`` zero fill; donate the buffer in the enclosing
``jax.jit`` to avoid a copy).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jspec import probes
from jspec._jit import jit
from jspec.attention_meta.page_table import validate_row_args
from jspec.config import TreeGeometry, check_geometry
from jspec.kernels import draft_kv_indices as _kernel

INT32_LIMIT = 2**31


def draft_kv_indices_used_len(
    sum_seq_lens: Any, topk: int, num_seqs_times_topk: Any, it: Any
) -> Any:
    """sglang ``draft_kv_indices_used_len``: ``sum_seq_lens * topk + num_seqs_times_topk * it``.

    Works on Python ints (static sizing) and on int32 arrays alike.
    """
    return sum_seq_lens * topk + num_seqs_times_topk * it


@jit(
    static_argnames=(
        "geometry",
        "kv_indices_width",
        "max_bs",
        "max_seq_len",
        "impl",
        "interpret",
        "block_tokens",
    ),
)
def generate_draft_decode_kv_indices(
    req_pool_indices: jax.Array,
    req_to_token: jax.Array,
    seq_lens: jax.Array,
    *,
    geometry: TreeGeometry,
    kv_indices_width: int,
    max_bs: int | None = None,
    max_seq_len: int | None = None,
    kv_indices_buffer: jax.Array | None = None,
    impl: str = "xla",
    interpret: bool | None = None,
    block_tokens: int = _kernel.BLOCK_TOKENS,
) -> tuple[jax.Array, jax.Array]:
    """sglang ``generate_draft_decode_kv_indices`` (default mode: no window, no translation).

    Args:
      req_pool_indices: i32[B] request rows of ``req_to_token``.
      req_to_token: i32[num_req_rows, R] token slot ids (row 0: the padding row).
      seq_lens: i32[B] committed prefix lengths ``L`` (``paged_kernel_lens``).
      geometry: static :class:`jspec.config.TreeGeometry` (reads ``K``, ``S``, ``P``).
      kv_indices_width: static row width ``W`` (``SpecConfig.kv_indices_width(max_bs)``).
      max_bs: static, optional; the batch bucket ``W`` was sized for (``B <= max_bs``).
      max_seq_len: static, optional bound on ``seq_lens``; enables the trace-time check
        ``B*K*(max_seq_len + S) <= W``.
      kv_indices_buffer: optional i32[S, W] updated in place (entries past the used length keep
        their values); default: a fresh output with zeros there.
      impl: ``"xla"`` | ``"pallas"`` | ``"triton"`` (GPU only).
      interpret: Pallas interpret mode; ``None`` means interpret off the GPU.
      block_tokens: static; token slots per copy block of the kernels (power of 2).

    Returns:
      kv_indices: i32[S, W] token slot ids (step row ``i`` serves draft step ``i``).
      kv_indptr: i32[S, B*K+1] segment starts per step; ``kv_indptr[i, B*K]`` = used length.
    """
    check_geometry(geometry, "generate_draft_decode_kv_indices")
    topk, num_steps = geometry.topk, geometry.num_steps
    _validate(
        req_pool_indices,
        req_to_token,
        seq_lens,
        topk=topk,
        num_steps=num_steps,
        kv_indices_width=kv_indices_width,
        max_bs=max_bs,
        max_seq_len=max_seq_len,
        kv_indices_buffer=kv_indices_buffer,
    )
    _probe(
        req_pool_indices,
        req_to_token,
        seq_lens,
        geometry=geometry,
        kv_indices_width=kv_indices_width,
    )
    impl = _kernel.resolve_impl(impl)
    if impl == "xla" or seq_lens.shape[0] == 0 or kv_indices_width == 0:
        return _kernel.draft_kv_indices_reference(
            req_pool_indices,
            req_to_token,
            seq_lens,
            geometry=geometry,
            kv_indices_width=kv_indices_width,
            kv_indices_buffer=kv_indices_buffer,
        )
    buffer = (
        jnp.zeros((geometry.num_steps, kv_indices_width), jnp.int32)
        if kv_indices_buffer is None
        else kv_indices_buffer
    )
    args = (req_pool_indices, req_to_token, seq_lens, buffer)
    if impl == "pallas":
        return _kernel.draft_kv_indices_pallas(
            *args, geometry=geometry, interpret=interpret, block_tokens=block_tokens
        )
    return _kernel.draft_kv_indices_triton(*args, geometry=geometry, block_tokens=block_tokens)


def _validate(
    req_pool_indices: jax.Array,
    req_to_token: jax.Array,
    seq_lens: jax.Array,
    *,
    topk: int,
    num_steps: int,
    kv_indices_width: int,
    max_bs: int | None,
    max_seq_len: int | None,
    kv_indices_buffer: jax.Array | None,
) -> None:
    """Trace-time checks (``ValueError`` naming the argument)."""
    probes.static_check(
        isinstance(kv_indices_width, int) and 0 <= kv_indices_width < INT32_LIMIT,
        f"kv_indices_width={kv_indices_width!r} must be an int in [0, 2**31)",
    )
    validate_row_args(req_to_token, req_pool_indices, seq_lens)
    num_seqs = seq_lens.shape[0]
    if max_bs is not None:
        probes.static_check(
            isinstance(max_bs, int) and num_seqs <= max_bs,
            f"batch size B={num_seqs} exceeds max_bs={max_bs!r}, the bucket "
            f"kv_indices_width was sized for",
        )
    if kv_indices_buffer is not None:
        probes.static_check_shape(
            kv_indices_buffer, (num_steps, kv_indices_width), "kv_indices_buffer"
        )
        probes.static_check_dtype(kv_indices_buffer, jnp.int32, "kv_indices_buffer")
    ctx = {"topk": topk, "num_seqs": num_seqs, "num_steps": num_steps}
    # Every segment holds at least its it <= S draft slots.
    probes.assert_buffer_fits(
        num_seqs * topk * num_steps,
        kv_indices_width,
        "EAGLE draft kv_indices row too small (draft slots alone)",
        **ctx,
    )
    if max_seq_len is not None:
        probes.assert_buffer_fits(
            draft_kv_indices_used_len(num_seqs * max_seq_len, topk, num_seqs * topk, num_steps),
            kv_indices_width,
            "EAGLE draft kv_indices row too small for max_seq_len",
            max_seq_len=max_seq_len,
            **ctx,
        )


def _probe(
    req_pool_indices: jax.Array,
    req_to_token: jax.Array,
    seq_lens: jax.Array,
    *,
    geometry: TreeGeometry,
    kv_indices_width: int,
) -> None:
    """Dynamic probes (off by default; nothing traced when off)."""
    topk, num_steps = geometry.topk, geometry.num_steps
    if not probes.probes_on() or seq_lens.shape[0] == 0:
        return
    name = "generate_draft_decode_kv_indices"
    row_width = req_to_token.shape[1]
    probes.detect_oob(req_pool_indices, 0, req_to_token.shape[0], f"{name}: req_pool_indices")
    probes.detect_in_closed_range(seq_lens, 0, row_width, f"{name}: seq_lens vs row width")
    used = draft_kv_indices_used_len(jnp.sum(seq_lens), topk, seq_lens.shape[0] * topk, num_steps)
    probes.assert_async(
        used <= kv_indices_width,
        f"{name}: EAGLE draft kv_indices row too small: need {{used}} but row "
        f"width is {kv_indices_width} (topk={topk}, num_steps={num_steps})",
        used=used,
    )
    last_draft_end = _kernel.draft_ext_start(seq_lens, geometry=geometry)[:, -1] + num_steps
    probes.detect_in_closed_range(
        last_draft_end, 0, row_width, f"{name}: draft slots end past the req_to_token row"
    )


# The raw Triton kernel of ``impl="triton"``, for callers launching it on their own tensors.
draft_kv_indices_triton_launch = _kernel.triton_launch
