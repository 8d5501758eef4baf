"""Test helper: pad draft inputs to a batch bucket, sglang's CUDA-graph replay padding (SPEC §12).

NOTE: test-only. The engine pads its own batches (``jspec.engine``); these helpers let the
attention_meta tests check that the metadata ops give the unpadded results on the live rows of a
padded bucket. Bucket choice is :class:`jspec.config.BatchBuckets`.


sglang captures one CUDA graph per batch bucket and, at replay, pads a raw batch of ``raw_bs``
requests up to the smallest captured bucket ``bs >= raw_bs``. jspec does the same with ``jax.jit``:
one compile per bucket, never one per batch size. Padding follows sglang's replay (including the
fix of the "EAGLE cuda graph padding" seed: the **whole** padded buffers are reset, so no stale
value of an earlier, larger batch survives)::

    field               live rows [0, raw_bs)      padding rows [raw_bs, bs)
    seq_lens            copied                     1   (seq_len_fill_value of FA3/FlashInfer/Triton)
    req_pool_indices    copied                     0   (req_to_token row 0: the padding row)
    out_cache_loc       copied (raw_bs*K*S)        0   (slot 0: the dummy page 0)
    positions           copied (raw_bs*K)          0
    topk_p, topk_index  copied                     0
    hidden              copied                     0
    seq_lens_sum        raw_sum + (bs - raw_bs) * 1

Padding rows therefore only reference request row 0 and slot 0, never a live slot. Outputs are
sliced back to the live rows with :func:`unpad`.

Probes (off by default) run on the raw inputs before the copy-in, as in the seed fix: NaN in
``topk_p``, and ``topk_index`` outside ``[0, vocab_size)`` (instead of clamping).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jspec import probes
from jspec._pytree import pytree_dataclass
from jspec.config import BatchBuckets
from jspec.sentinels import PAD_ROW, PAD_SLOT_ID, SEQ_LEN_FILL_VALUE


@pytree_dataclass
class DraftInputs:
    """The per-request inputs of one draft-decode call (sglang's graph-runner buffers).

    ``B`` requests, ``K`` = topk, ``S`` = num_steps, ``H`` = hidden size. Index arrays are int32
    (sglang's int64 ``out_cache_loc`` / ``topk_index`` become int32).
    """

    # i32[B]: committed prefix lengths L.
    seq_lens: jax.Array
    # i32[B]: request rows of req_to_token.
    req_pool_indices: jax.Array
    # i32[B*K*S]: draft slot ids, flattened (request, branch, step).
    out_cache_loc: jax.Array
    # i32[B*K]: seq_lens repeated K times.
    positions: jax.Array
    # f32[B, K]: top-k probabilities of the previous step.
    topk_p: jax.Array
    # i32[B, K]: top-k token ids of the previous step.
    topk_index: jax.Array
    # dtype[B, H]: draft hidden states.
    hidden: jax.Array

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])


def _pad_rows(x: jax.Array, rows: int, fill: Any) -> jax.Array:
    """Append ``rows`` rows of ``fill`` along axis 0 (a fresh buffer: nothing stale survives)."""
    if rows == 0:
        return x
    return jnp.concatenate([x, jnp.full((rows,) + x.shape[1:], fill, x.dtype)], axis=0)


def pad_draft_inputs(
    inputs: DraftInputs, bucket: int, *, vocab_size: int | None = None, num_steps: int | None = None
) -> tuple[DraftInputs, jax.Array]:
    """Pad ``inputs`` from ``B`` to ``bucket`` rows (module docstring table); jittable.

    Args:
      inputs: the raw batch (``B = inputs.batch_size``).
      bucket: static, ``>= B``.
      vocab_size: static; enables the ``topk_index`` range probe.
      num_steps: static ``S``; only needed when ``B == 0`` (otherwise inferred from
        ``out_cache_loc``).

    Returns:
      ``(padded DraftInputs with bucket rows, seq_lens_sum i32[])`` where ``seq_lens_sum =
      sum(raw seq_lens) + (bucket - B) * SEQ_LEN_FILL_VALUE``.
    """
    raw_bs = inputs.batch_size
    topk = inputs.topk_p.shape[1] if inputs.topk_p.ndim == 2 else -1
    probes.static_check(
        isinstance(bucket, int) and bucket >= max(raw_bs, 1),
        f"bucket={bucket!r} must be an int >= max(batch size {raw_bs}, 1)",
    )
    probes.static_check(
        topk >= 1
        and inputs.topk_index.shape == (raw_bs, topk)
        and inputs.topk_p.shape == (raw_bs, topk),
        f"topk_p.shape={tuple(inputs.topk_p.shape)} and topk_index.shape="
        f"{tuple(inputs.topk_index.shape)} must both be (B={raw_bs}, K)",
    )
    if raw_bs > 0:
        steps = inputs.out_cache_loc.size // (raw_bs * topk)
    else:
        probes.static_check(
            num_steps is not None, "num_steps must be given to pad an empty batch (B=0)"
        )
        steps = num_steps
    shapes = {
        "seq_lens": (raw_bs,),
        "req_pool_indices": (raw_bs,),
        "out_cache_loc": (raw_bs * topk * steps,),
        "positions": (raw_bs * topk,),
    }
    for name, shape in shapes.items():
        probes.static_check_shape(getattr(inputs, name), shape, name)
    probes.static_check(
        inputs.hidden.ndim == 2 and inputs.hidden.shape[0] == raw_bs,
        f"hidden.shape={tuple(inputs.hidden.shape)} must be (B={raw_bs}, H)",
    )

    # Probes on the raw inputs, before the copy-in (seed fix: detect instead of clamp).
    probes.detect_nan(inputs.topk_p, "pad_draft_inputs: topk_p")
    if vocab_size is not None:
        probes.detect_oob(
            inputs.topk_index,
            0,
            vocab_size,
            f"pad_draft_inputs: topk_index vs vocab_size={vocab_size}",
        )

    pad = bucket - raw_bs
    padded = DraftInputs(
        seq_lens=_pad_rows(inputs.seq_lens, pad, SEQ_LEN_FILL_VALUE),
        req_pool_indices=_pad_rows(inputs.req_pool_indices, pad, PAD_ROW),
        out_cache_loc=_pad_rows(inputs.out_cache_loc, pad * topk * steps, PAD_SLOT_ID),
        positions=_pad_rows(inputs.positions, pad * topk, 0),
        topk_p=_pad_rows(inputs.topk_p, pad, 0),
        topk_index=_pad_rows(inputs.topk_index, pad, 0),
        hidden=_pad_rows(inputs.hidden, pad, 0),
    )
    seq_lens_sum = jnp.sum(inputs.seq_lens, dtype=jnp.int32) + jnp.int32(pad * SEQ_LEN_FILL_VALUE)
    return padded, seq_lens_sum


def unpad(outputs: Any, raw_bs: int, *, bucket: int | None = None) -> Any:
    """Slice every array leaf of ``outputs`` back to the live rows (sglang's ``[:raw_bs]``).

    Without ``bucket`` each leaf with ``ndim >= 1`` becomes ``x[:raw_bs]``. With ``bucket``, a
    leaf whose leading dim is ``m * bucket`` (``m`` rows per request, e.g. ``B*K``) becomes
    ``x[:m * raw_bs]``; other leaves (and scalars) are returned unchanged.
    """

    def cut(x: Any) -> Any:
        if not hasattr(x, "shape") or len(x.shape) == 0:
            return x
        if bucket is None:
            return x[:raw_bs]
        lead = x.shape[0]
        if bucket > 0 and lead % bucket == 0:
            return x[: (lead // bucket) * raw_bs]
        return x

    return jax.tree.map(cut, outputs)


class BucketedFunction:
    """Run ``fn(padded_inputs, seq_lens_sum, *args)`` on padded buckets; one compile per bucket.

    ``fn`` is jitted once; calls pad the raw :class:`DraftInputs` to ``buckets.bucket_for(B)``
    (:func:`pad_draft_inputs`, op by op, outside the jit), call the jitted ``fn`` and slice its
    outputs back to the live rows with ``unpad_outputs(outputs, raw_bs, bucket)`` (default:
    :func:`unpad` with ``bucket=``; pass your own when an output's leading dim is not per-row).
    Extra ``args`` must not depend on ``B``. ``compile_count`` counts traces of ``fn`` (one per
    distinct bucket for fixed ``args`` shapes); ``buckets_used`` records the buckets seen.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        buckets: BatchBuckets,
        *,
        vocab_size: int | None = None,
        num_steps: int | None = None,
        unpad_outputs: Callable[[Any, int, int], Any] | None = None,
    ) -> None:
        self.fn = fn
        self.buckets = buckets
        self.vocab_size = vocab_size
        self.num_steps = num_steps
        self.unpad_outputs = unpad_outputs or (lambda out, raw, bs: unpad(out, raw, bucket=bs))
        self.compile_count = 0
        self.buckets_used: set[int] = set()

        def traced(padded: DraftInputs, seq_lens_sum: jax.Array, *args: Any) -> Any:
            self.compile_count += 1  # runs once per trace, i.e. once per compiled bucket
            return fn(padded, seq_lens_sum, *args)

        self._jitted = jax.jit(traced)

    def __call__(self, inputs: DraftInputs, *args: Any) -> Any:
        raw_bs = inputs.batch_size
        bucket = self.buckets.bucket_for(raw_bs)
        self.buckets_used.add(bucket)
        padded, seq_lens_sum = pad_draft_inputs(
            inputs, bucket, vocab_size=self.vocab_size, num_steps=self.num_steps
        )
        return self.unpad_outputs(self._jitted(padded, seq_lens_sum, *args), raw_bs, bucket)
