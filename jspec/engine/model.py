"""A small Llama-style target model and an EAGLE-style draft head, in plain JAX.

Target: token embedding -> ``num_layers`` x [RMSNorm -> GQA attention with RoPE -> residual,
RMSNorm -> SwiGLU MLP -> residual] -> final RMSNorm -> LM head. Draft (EAGLE-1 style): one
decoder layer over ``fc(concat(embed(token), target_hidden))``, sharing the target's embedding
and LM head (SPEC.md §2 step 6, §7.1).

Attention is injected: every layer calls ``attn_fn(layer, pool, q, k, v) -> (pool, out)``, which
writes this layer's K/V into the paged pool and reads it back through the metadata
(``jspec.engine.attention``). The model code itself never sees a slot id.

Hidden-state conventions (EAGLE, as in sglang):

* the target returns ``hidden`` = the final-RMSNorm output for every token; the draft at
  position ``p`` consumes ``(embed(x[p+1]), target_hidden[p])`` and predicts ``x[p+2]``;
* the draft returns its decoder layer's output (pre-norm residual stream) as the hidden state
  fed to its next step; its logits are ``lm_head(rms_norm(hidden, draft.final_norm))``.

The default init (:func:`init_target_params`, :func:`init_draft_params`) makes greedy chains
predictable: the LM head is the embedding composed with a fixed random permutation ``sigma``,
so ``logits(x) ~ onehot(sigma(x))`` plus context-dependent terms from the layers (scaled by
``residual_scale``). The draft, sharing embedding and LM head, predicts ``sigma`` well; the
target deviates where the context tips the argmax, so acceptance is high but not perfect.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jspec._pytree import pytree_dataclass
from jspec.engine.protocol import DTYPES as _DTYPES
from jspec.engine.protocol import MODEL_SCOPE, AttnFn, matmul_precision

__all__ = [
    "MODEL_SCOPE",
    "DraftParams",
    "LayerParams",
    "ModelConfig",
    "TargetParams",
    "ToyDraft",
    "ToyTarget",
    "init_draft_params",
    "init_target_params",
]


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """Static model geometry (hashable: usable as a static jit argument).

    Attributes:
      vocab_size, hidden_size, intermediate_size, num_layers: the usual Llama sizes.
      num_heads, num_kv_heads, head_dim: GQA geometry (``num_heads % num_kv_heads == 0``).
      rope_theta, rms_norm_eps: RoPE base and RMSNorm epsilon.
      dtype: parameter and activation dtype by name ("float32", "bfloat16", "float16");
        attention softmax and logits are always computed in f32.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE)")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {sorted(_DTYPES)}")

    @property
    def jnp_dtype(self) -> Any:
        return _DTYPES[self.dtype]

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


@pytree_dataclass
class LayerParams:
    """One decoder layer. ``H`` = hidden, ``Hq``/``Hkv`` heads, ``D`` head_dim, ``I`` MLP."""

    attn_norm: jax.Array  # [H]
    wq: jax.Array  # [H, Hq*D]
    wk: jax.Array  # [H, Hkv*D]
    wv: jax.Array  # [H, Hkv*D]
    wo: jax.Array  # [Hq*D, H]
    mlp_norm: jax.Array  # [H]
    w_gate: jax.Array  # [H, I]
    w_up: jax.Array  # [H, I]
    w_down: jax.Array  # [I, H]


@pytree_dataclass
class TargetParams:
    embed: jax.Array  # [V, H]
    layers: tuple  # tuple[LayerParams, ...], one per layer
    final_norm: jax.Array  # [H]
    lm_head: jax.Array  # [H, V]


@pytree_dataclass
class DraftParams:
    """EAGLE draft head; embedding and LM head come from the target."""

    fc: jax.Array  # [2H, H]: concat(embed(token), target_hidden) -> H
    layer: LayerParams
    final_norm: jax.Array  # [H]


# ---- building blocks ---------------------------------------------------------------------------
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in f32, cast back to ``x.dtype``."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (HF ``rotate_half`` convention).

    Args:
      x: dtype[T, heads, D].
      positions: i32[T] token positions.
    """
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, None, :]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, None, :]
    xf = x.astype(jnp.float32)
    half = dim // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], -1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def _mm(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a @ b`` at the dtype's precision (HIGHEST for f32 only; ``protocol.matmul_precision``)."""
    return jnp.matmul(a, b, precision=matmul_precision(b.dtype))


def _tp_sum(x: jax.Array, tp_axis: str | None) -> jax.Array:
    """Sum the row-parallel partial products over the tensor-parallel mesh axis (if any)."""
    return x if tp_axis is None else jax.lax.psum(x, tp_axis)


def decoder_layer(
    cfg: ModelConfig,
    lp: LayerParams,
    layer: int,
    pool: Any,
    x: jax.Array,
    positions: jax.Array,
    attn_fn: AttnFn,
    tp_axis: str | None = None,
) -> tuple[Any, jax.Array]:
    """One pre-norm Llama decoder layer over flat tokens ``x: dtype[T, H]``.

    Tensor parallel (Megatron layout, ``tp_axis`` names the mesh axis inside ``shard_map``):
    ``wq/wk/wv/w_gate/w_up`` hold this shard's columns (its contiguous block of query / KV heads,
    its slice of the MLP), ``wo/w_down`` the matching rows; the two row-parallel products are
    summed over ``tp_axis``. Head counts are read from the weights, so the same code runs on a
    full layer (``tp_axis=None``) or on one shard's slice; the pool then holds this shard's KV
    heads only.
    """
    num_tokens = x.shape[0]
    h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
    q = _mm(h, lp.wq).reshape(num_tokens, -1, cfg.head_dim)
    k = _mm(h, lp.wk).reshape(num_tokens, -1, cfg.head_dim)
    v = _mm(h, lp.wv).reshape(num_tokens, -1, cfg.head_dim)
    q = apply_rope(q, positions, cfg.rope_theta)
    k = apply_rope(k, positions, cfg.rope_theta)
    pool, attn = attn_fn(layer, pool, q, k, v)
    x = x + _tp_sum(_mm(attn.astype(x.dtype).reshape(num_tokens, -1), lp.wo), tp_axis)
    h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
    x = x + _tp_sum(_mm(jax.nn.silu(_mm(h, lp.w_gate)) * _mm(h, lp.w_up), lp.w_down), tp_axis)
    return pool, x


def target_forward(
    cfg: ModelConfig,
    params: TargetParams,
    pool: Any,
    token_ids: jax.Array,
    positions: jax.Array,
    attn_fn: AttnFn,
    tp_axis: str | None = None,
    *,
    capture_layers: tuple[int, ...] = (),
) -> tuple[Any, jax.Array]:
    """Target model over flat tokens.

    Args:
      token_ids, positions: i32[T].
      attn_fn: writes K/V into ``pool`` and attends (see module docstring).
      tp_axis: tensor-parallel mesh axis when the layers are head-sharded (:func:`decoder_layer`).

    Returns:
      (pool, hidden dtype[T, H]): hidden is the final-RMSNorm output (LM-head input and the
      feature handed to the EAGLE draft). With ``capture_layers``: (pool, hidden, aux
      dtype[T, len(capture_layers) * H]), the residual entering each listed layer.
    """
    x = params.embed[token_ids]
    captured = {}
    for layer, lp in enumerate(params.layers):
        if layer in capture_layers:
            captured[layer] = x
        pool, x = decoder_layer(cfg, lp, layer, pool, x, positions, attn_fn, tp_axis)
    hidden = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    if not capture_layers:
        return pool, hidden
    return pool, hidden, jnp.concatenate([captured[i] for i in capture_layers], -1)


def target_logits(params: TargetParams, hidden: jax.Array) -> jax.Array:
    """f32[..., V] logits from the target's normed hidden states (f32: exact f32 product;
    bf16 / f16: a result in the model dtype, upcast after)."""
    return jnp.dot(hidden, params.lm_head, precision=matmul_precision(params.lm_head.dtype)).astype(
        jnp.float32
    )


def draft_forward(
    cfg: ModelConfig,
    draft: DraftParams,
    target: TargetParams,
    pool: Any,
    token_ids: jax.Array,
    hidden_in: jax.Array,
    positions: jax.Array,
    attn_fn: AttnFn,
    tp_axis: str | None = None,
) -> tuple[Any, jax.Array]:
    """EAGLE draft head over flat tokens (its single layer is layer 0 of the draft pool).

    Args:
      token_ids, positions: i32[T]; hidden_in: dtype[T, H] (target or previous draft hidden).
      tp_axis: tensor-parallel mesh axis when the layer is head-sharded (as ``target_forward``).

    Returns:
      (pool, hidden_out dtype[T, H]): the decoder layer output, fed to the next draft step.
    """
    x = jnp.concatenate([target.embed[token_ids], hidden_in.astype(target.embed.dtype)], -1)
    x = _mm(x, draft.fc)
    return decoder_layer(cfg, draft.layer, 0, pool, x, positions, attn_fn, tp_axis)


def draft_logits(
    cfg: ModelConfig, draft: DraftParams, target: TargetParams, hidden: jax.Array
) -> jax.Array:
    """f32[..., V] draft logits: shared LM head over the draft's own final norm."""
    return target_logits(target, rms_norm(hidden, draft.final_norm, cfg.rms_norm_eps))


# ---- initialisation ----------------------------------------------------------------------------
def _init_layer(cfg: ModelConfig, rng: np.random.Generator, residual_scale: float) -> dict:
    hid, inter = cfg.hidden_size, cfg.intermediate_size
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def dense(fan_in: int, fan_out: int, scale: float = 1.0) -> np.ndarray:
        return rng.standard_normal((fan_in, fan_out)) * (scale / np.sqrt(fan_in))

    return {
        "attn_norm": np.ones(hid),
        "wq": dense(hid, qd),
        "wk": dense(hid, kvd),
        "wv": dense(hid, kvd),
        "wo": dense(qd, hid, residual_scale),
        "mlp_norm": np.ones(hid),
        "w_gate": dense(hid, inter),
        "w_up": dense(hid, inter),
        "w_down": dense(inter, hid, residual_scale),
    }


def _layer_params(cfg: ModelConfig, arrays: dict) -> LayerParams:
    return LayerParams(**{k: jnp.asarray(v, cfg.jnp_dtype) for k, v in arrays.items()})


def init_target_params(
    cfg: ModelConfig, seed: int = 0, *, residual_scale: float = 0.5
) -> TargetParams:
    """Seeded random target with transition-dominated logits (see the module docstring).

    ``lm_head[:, sigma(x)] = embed[x] / sqrt(H)``: with small layer residuals the normed hidden
    of token ``x`` is close to ``embed[x]``, so ``argmax logits ~ sigma(x)`` with a margin of
    about ``sqrt(H)`` standard deviations; ``residual_scale`` sets how often the context (the
    attention and MLP residuals) overrides it.
    """
    rng = np.random.default_rng(seed)
    embed = rng.standard_normal((cfg.vocab_size, cfg.hidden_size))
    sigma = rng.permutation(cfg.vocab_size)
    lm_head = np.zeros((cfg.hidden_size, cfg.vocab_size))
    lm_head[:, sigma] = embed.T / np.sqrt(cfg.hidden_size)
    layers = tuple(
        _layer_params(cfg, _init_layer(cfg, rng, residual_scale)) for _ in range(cfg.num_layers)
    )
    return TargetParams(
        embed=jnp.asarray(embed, cfg.jnp_dtype),
        layers=layers,
        final_norm=jnp.ones(cfg.hidden_size, cfg.jnp_dtype),
        lm_head=jnp.asarray(lm_head, cfg.jnp_dtype),
    )


def init_draft_params(
    cfg: ModelConfig, target: TargetParams, seed: int = 1, *, hidden_mix: float = 0.1
) -> DraftParams:
    """Default EAGLE draft that accepts well on its own target.

    ``fc = [I; hidden_mix * R]`` passes the token embedding through (plus a little of the
    incoming hidden state) and the decoder layer is a copy of the target's last layer, so the
    draft predicts the target's dominant transition ``sigma``.
    """
    rng = np.random.default_rng(seed)
    hid = cfg.hidden_size
    fc = np.concatenate([np.eye(hid), hidden_mix * rng.standard_normal((hid, hid)) / np.sqrt(hid)])
    return DraftParams(
        fc=jnp.asarray(fc, cfg.jnp_dtype),
        layer=target.layers[-1],
        final_norm=jnp.ones(hid, cfg.jnp_dtype),
    )


def cast_params(tree: Any, dtype: Any) -> Any:
    """Cast every floating leaf of a params pytree to ``dtype``."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


# ---- the model protocol (jspec.engine.protocol) -------------------------------------------------
def _layer_param_specs(tp_axis: str) -> LayerParams:
    cols, rows = P(None, tp_axis), P(tp_axis, None)
    return LayerParams(
        attn_norm=P(),
        wq=cols,
        wk=cols,
        wv=cols,
        wo=rows,
        mlp_norm=P(),
        w_gate=cols,
        w_up=cols,
        w_down=rows,
    )


@dataclasses.dataclass(frozen=True)
class _ToyGeometry:
    """The protocol's geometry fields, read from ``cfg``."""

    cfg: ModelConfig

    @property
    def num_kv_heads(self) -> int:
        return self.cfg.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.cfg.head_dim

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def dtype(self) -> str:
        return self.cfg.dtype

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        """ValueError unless ``tensor_parallel`` divides the KV heads and the MLP width."""
        cfg = self.cfg
        if cfg.num_kv_heads % tensor_parallel or cfg.intermediate_size % tensor_parallel:
            raise ValueError(
                f"tensor_parallel={tensor_parallel} must divide num_kv_heads="
                f"{cfg.num_kv_heads} and intermediate_size="
                f"{cfg.intermediate_size}"
            )


@dataclasses.dataclass(frozen=True)
class ToyTarget(_ToyGeometry):
    """:class:`jspec.engine.protocol.TargetModel` over :class:`TargetParams`."""

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    def forward(
        self,
        params: TargetParams,
        pool: Any,
        token_ids: jax.Array,
        positions: jax.Array,
        attn_fn: AttnFn,
        *,
        capture_layers: tuple[int, ...] = (),
        tp_axis: str | None = None,
    ) -> tuple[Any, jax.Array, jax.Array | None]:
        out = target_forward(
            self.cfg,
            params,
            pool,
            token_ids,
            positions,
            attn_fn,
            tp_axis,
            capture_layers=tuple(capture_layers),
        )
        return out if capture_layers else (*out, None)

    def logits(self, params: TargetParams, hidden: jax.Array) -> jax.Array:
        return target_logits(params, hidden)

    def param_specs(self, params: TargetParams, tp_axis: str) -> TargetParams:
        """Layers head-sharded over ``tp_axis`` (Megatron), embedding / norms / LM head whole."""
        return TargetParams(
            embed=P(),
            final_norm=P(),
            lm_head=P(),
            layers=tuple(_layer_param_specs(tp_axis) for _ in params.layers),
        )


@dataclasses.dataclass(frozen=True)
class ToyDraft(_ToyGeometry):
    """:class:`jspec.engine.protocol.DraftModel` over :class:`DraftParams` (EAGLE-1: one layer,
    the target's vocab, embedding and LM head; consumes the target's final-norm hidden)."""

    @property
    def num_layers(self) -> int:
        return 1

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return ()

    def forward(
        self,
        params: DraftParams,
        target_params: TargetParams,
        pool: Any,
        token_ids: jax.Array,
        hidden_in: jax.Array,
        positions: jax.Array,
        attn_fn: AttnFn,
        *,
        tp_axis: str | None = None,
    ) -> tuple[Any, jax.Array]:
        return draft_forward(
            self.cfg, params, target_params, pool, token_ids, hidden_in, positions, attn_fn, tp_axis
        )

    def logits(
        self, params: DraftParams, target_params: TargetParams, hidden: jax.Array
    ) -> jax.Array:
        return draft_logits(self.cfg, params, target_params, hidden)

    def to_target_ids(self, params: DraftParams, draft_ids: jax.Array) -> jax.Array:
        del params
        return draft_ids

    def param_specs(self, params: DraftParams, tp_axis: str) -> DraftParams:
        """The layer head-sharded over ``tp_axis``; ``fc`` and the norm whole."""
        del params
        return DraftParams(fc=P(), layer=_layer_param_specs(tp_axis), final_norm=P())
