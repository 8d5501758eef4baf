"""The model protocol: how the engine sees a target model and a draft head.

jspec owns the bookkeeping (allocation, layout, metadata, draft loop, tree build, verify,
accept, KV moves, commit); the caller owns the model. The spec step, the greedy step and prefill
call a model only through the methods below. A model object is a frozen, hashable dataclass
holding static config only (a static jit argument); its weights are a separate params pytree
passed beside it::

    target: TargetModel, target_params   # e.g. jspec.models.LlamaTarget
    draft:  DraftModel,  draft_params    # e.g. jspec.models.Eagle1Draft / Eagle3Draft

Attention is injected: every layer calls ``attn_fn(layer, pool, q, k, v) -> (pool, out)``,
which writes this layer's K/V at the slots jspec chose and attends through jspec's metadata.
Model code never sees a slot id or a page id.

Matmul precision follows the dtype (:func:`matmul_precision`): bf16/f16 models use the default
precision with a bf16/f16 result (upcast after, e.g. for the f32 logits); only f32 models use
``precision=HIGHEST`` (f32 exactness, needed by the lossless tests on CPU and GPU).

Optional extension (tensor parallelism): a model that supports ``tensor_parallel > 1`` also
defines ``param_specs(params, tp_axis: str) -> pytree of PartitionSpec`` (a prefix of its
params pytree: head / MLP blocks split over ``tp_axis``, the rest replicated) and sums its
row-parallel products with ``jax.lax.psum(x, tp_axis)`` when ``forward`` gets ``tp_axis``; it
may define ``check_tensor_parallel(tensor_parallel: int)`` raising ValueError for a split its
weights do not allow (e.g. the MLP width).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

AttnFn = Callable[[int, Any, jax.Array, jax.Array, jax.Array], tuple[Any, jax.Array]]
"""``attn_fn(layer, pool, q dtype[T, Hq, D], k dtype[T, Hkv, D], v dtype[T, Hkv, D])
-> (pool, out float[T, Hq, D])``: ``out`` in f32 or in ``q``'s dtype (the model casts it to
its activations' dtype)."""

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# Every model call the engine makes (forwards and logits) runs under
# ``jax.named_scope(MODEL_SCOPE)`` and, inside it, ``"target"`` or ``"draft"``: the HLO ops it
# emits carry these in their ``op_name`` metadata, which is how bench/e2e.py splits the device
# time of a fused step into target (verify) forward, draft forwards and bookkeeping.
MODEL_SCOPE = "jspec_model"


class ModelGeometry(Protocol):
    """What the engine reads of either model: the geometry of its KV pool and its vocab.

    NOTE: read-only members (properties), so a frozen dataclass or a class with properties
    conforms for a type checker too (a plain annotation would ask for a settable attribute).
    """

    @property
    def num_layers(self) -> int:
        """Layers in the model's KV pool (1 for EAGLE heads)."""
        ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def vocab_size(self) -> int:
        """Its output vocab (an EAGLE-3 head: ``draft_vocab_size``; EAGLE-1: the target's)."""
        ...

    @property
    def dtype(self) -> str:
        """``"float32"`` | ``"bfloat16"`` | ``"float16"`` (weights / activations / pool)."""
        ...


@runtime_checkable
class TargetModel(ModelGeometry, Protocol):
    """The target model (static config; params passed beside it)."""

    def forward(
        self,
        params: Any,
        pool: Any,
        token_ids: jax.Array,
        positions: jax.Array,
        attn_fn: AttnFn,
        *,
        capture_layers: tuple[int, ...] = (),
        tp_axis: str | None = None,
    ) -> tuple[Any, jax.Array, jax.Array | None]:
        """The target over flat tokens.

        Args:
          token_ids, positions: i32[T] (flat tokens).
          attn_fn: see :data:`AttnFn`.
          capture_layers: static; layers whose INCOMING residual stream is returned as aux.
          tp_axis: the tensor-parallel mesh axis (inside ``shard_map``) or None.

        Returns:
          (pool, hidden dtype[T, H], aux): hidden is the final-RMSNorm output (LM-head input);
          aux is dtype[T, len(capture_layers) * H], the residual stream entering each layer in
          ``capture_layers``, concatenated in that order (sglang's EAGLE-3 capture); None when
          ``capture_layers == ()``.
        """
        ...

    def logits(self, params: Any, hidden: jax.Array) -> jax.Array:
        """f32[T, vocab_size] from hidden dtype[T, H]."""
        ...


@runtime_checkable
class DraftModel(ModelGeometry, Protocol):
    """A draft head (EAGLE-1 / EAGLE-3 style; static config, params passed beside it)."""

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Target layers whose incoming residual the draft consumes (EAGLE-3, e.g. ``(2, N//2,
        N-3)``); ``()`` = EAGLE-1: the draft consumes the target's final-norm hidden [T, H]."""
        ...

    def forward(
        self,
        params: Any,
        target_params: Any,
        pool: Any,
        token_ids: jax.Array,
        hidden_in: jax.Array,
        positions: jax.Array,
        attn_fn: AttnFn,
        *,
        tp_axis: str | None = None,
    ) -> tuple[Any, jax.Array]:
        """The draft over flat tokens.

        Args:
          token_ids: i32[T] TARGET ids (the draft embeds them with the target's embedding).
          hidden_in: dtype[T, Hd]: :meth:`combine_hidden_states` of the target's feature
            (after prefill / verify) or the draft's own previous hidden_out (in the draft loop);
            the same width either way, so the forward never guesses which one it got.
          positions: i32[T].

        Returns:
          (pool, hidden_out dtype[T, Hd]), fed to the next draft step.
        """
        ...

    def combine_hidden_states(self, params: Any, feature: jax.Array) -> jax.Array:
        """The target's feature as the draft's hidden input: dtype[T, Hin] -> dtype[T, Hd].

        ``feature`` is what the target returns for this draft (``run_target``): EAGLE-3 the aux
        states of ``capture_layers`` concatenated, ``[T, len(capture_layers) * H]`` (fused by
        ``fc``); EAGLE-1 the final hidden ``[T, H]`` (identity). The engine calls it once on
        every target feature, never on the draft's own hidden (tpu-inference's
        ``combine_hidden_states``).
        """
        ...

    def logits(self, params: Any, target_params: Any, hidden: jax.Array) -> jax.Array:
        """f32[T, vocab_size] over the DRAFT vocab."""
        ...

    def to_target_ids(self, params: Any, draft_ids: jax.Array) -> jax.Array:
        """i32[...] -> i32[...]: target id = draft id + d2t[draft id] (EAGLE-3); identity for
        heads that share the target's vocab."""
        ...


def matmul_precision(dtype: Any) -> jax.lax.Precision | None:
    """``HIGHEST`` for f32 (exact on GPU, where the default f32 matmul is TF32), else None.

    NOTE: verify (a batched tree forward) and plain greedy decode compute the same logits
    through different computations; at TF32 (~1e-3) a near-tied argmax flips and an f32 model
    is no longer lossless. bf16 / f16 models keep the default precision (and may flip anyway).
    """
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


@contextlib.contextmanager
def model_scope(part: str) -> Iterator[None]:
    """``jax.named_scope(MODEL_SCOPE)/part`` around a model call (``part``: target / draft)."""
    with jax.named_scope(MODEL_SCOPE), jax.named_scope(part):
        yield


def check_models(target: Any, draft: Any = None) -> None:
    """Static checks that ``target`` / ``draft`` follow the protocol and fit each other.

    Raises:
      TypeError: a protocol attribute or method is missing.
      ValueError: a field is out of range or the two models do not fit (names the field).
    """
    for name, model, proto in (("target", target, TargetModel), ("draft", draft, DraftModel)):
        if model is None:
            continue
        missing = [a for a in _protocol_members(proto) if not hasattr(model, a)]
        if missing:
            raise TypeError(
                f"{name} model {type(model).__name__} lacks {missing} "
                f"(jspec.engine.protocol.{proto.__name__})"
            )
        for field in ("num_layers", "num_kv_heads", "head_dim", "hidden_size", "vocab_size"):
            value = getattr(model, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}.{field}={value!r} must be an int >= 1")
        if model.dtype not in DTYPES:
            raise ValueError(f"{name}.dtype={model.dtype!r} must be one of {sorted(DTYPES)}")
    if draft is None:
        return
    layers = tuple(draft.capture_layers)
    if any(not 0 <= i < target.num_layers for i in layers):
        raise ValueError(
            f"draft.capture_layers={layers} must lie in [0, target.num_layers={target.num_layers})"
        )
    if draft.vocab_size > target.vocab_size:
        raise ValueError(
            f"draft.vocab_size={draft.vocab_size} must be <= target.vocab_size={target.vocab_size}"
        )


def _protocol_members(proto: type) -> tuple[str, ...]:
    names: set[str] = set()
    for cls in proto.__mro__:  # ModelGeometry's members too
        if cls in (object, Protocol):
            continue
        names |= set(getattr(cls, "__annotations__", {}))
        names |= {
            n
            for n, v in vars(cls).items()
            if (callable(v) or isinstance(v, property)) and not n.startswith("_")
        }
    return tuple(sorted(names))
