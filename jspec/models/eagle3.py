"""EAGLE-3 draft head (``LlamaForCausalLMEagle3``) behind jspec's ``DraftModel`` protocol.

Forward, as sglang runs it (``llama_eagle3.py``), over flat tokens::

    hidden = combine_hidden_states(aux) = fc(aux) + fc_bias    on the target's aux states
                                                                [T, num_aux * H], once per verify
           = hidden_out of the previous draft step               in the draft loop ([T, H])
    residual = hidden
    x = concat(input_layernorm(embed(tokens)), hidden_norm(hidden))      # [T, 2H]
    attn = o_proj(attention(q/k/v_proj(x)))      # RoPE, GQA, draft pool layer 0
    residual = attn + residual;  h = mlp(post_attention_layernorm(residual))
    hidden_out = h + residual                    # handed to the next draft step
    logits = lm_head(norm(hidden_out))           # over the DRAFT vocabulary
    target id = draft id + d2t[draft id]

The token embedding is the target's (the head ships none); the LM head is the head's own
``[H, draft_vocab]``. The fusion is its own method (:meth:`Eagle3Draft.combine_hidden_states`,
tpu-inference's name), not a test of the input width: with one captured layer the aux feature
and the head's own hidden are both ``[T, H]``, and only the engine knows which one it holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec._pytree import pytree_dataclass
from jspec.models._geometry import ConfigGeometry
from jspec.models.hf_config import Eagle3Config
from jspec.models.layers import (
    AttnFn,
    add_rms_norm,
    attention_block,
    check_rms_norm_impl,
    lm_logits,
    matmul,
    mlp_block,
    model_scope,
    rms_norm,
)
from jspec.models.llama import (
    LayerParams,
    LlamaParams,
    _random_layer,
    _spec_leaf,
    layer_specs,
)


@pytree_dataclass
class Eagle3Params:
    """EAGLE-3 head weights (``x @ W`` layout). ``H`` hidden, ``Vd`` draft vocab."""

    fc: jax.Array  # [num_aux*H, H]: fuses the target's captured states
    fc_bias: jax.Array | None  # [H] or None
    hidden_norm: jax.Array  # [H]: midlayer.hidden_norm, on the incoming hidden
    layer: LayerParams  # midlayer: attn_norm = input_layernorm (on the embedding), Hin = 2H
    final_norm: jax.Array  # [H]: norm
    lm_head: jax.Array  # [H, Vd]
    d2t: jax.Array  # i32[Vd]: target id = draft id + d2t[draft id]


@dataclasses.dataclass(frozen=True, slots=True)
class Eagle3Draft(ConfigGeometry):
    """An EAGLE-3 head (``DraftModel`` protocol); static config only.

    Attributes:
      config: the head's :class:`Eagle3Config`.
      capture_layers: target layers whose incoming residual the head fuses
        (``config.capture_layers(target.num_layers)``).
      rms_norm_impl: the RMSNorm kernel, ``"xla"`` | ``"triton"`` (GPU): the engine's
        ``KernelPolicy.rms_norm`` (:func:`jspec.kernels.policy.with_kernel_policy`).
    """

    config: Eagle3Config
    capture_layers: tuple[int, ...]
    rms_norm_impl: str = "xla"

    def __post_init__(self) -> None:
        if not isinstance(self.config, Eagle3Config):
            raise TypeError(f"config={type(self.config).__name__} must be an Eagle3Config")
        check_rms_norm_impl(self.rms_norm_impl)
        if len(self.capture_layers) != self.config.num_aux:
            raise ValueError(
                f"capture_layers={self.capture_layers} must name "
                f"num_aux={self.config.num_aux} layers"
            )

    num_layers = 1  # the draft KV pool holds the midlayer only

    @property
    def vocab_size(self) -> int:
        return self.config.draft_vocab_size

    @model_scope("draft")
    def forward(
        self,
        params: Eagle3Params,
        target_params: LlamaParams,
        pool: Any,
        token_ids: jax.Array,
        hidden_in: jax.Array,
        positions: jax.Array,
        attn_fn: AttnFn,
        *,
        tp_axis: str | None = None,
    ) -> tuple[Any, jax.Array]:
        """One draft forward over flat tokens (its layer is layer 0 of the draft pool).

        Args:
          params: :class:`Eagle3Params`; target_params: the target's (for its embedding).
          token_ids: i32[T] TARGET ids; positions: i32[T].
          hidden_in: dtype[T, H]: :meth:`combine_hidden_states` of the target's aux states, or
            the head's previous ``hidden_out``.
          tp_axis: tensor-parallel mesh axis when the midlayer is head-sharded.

        Returns:
          (pool, hidden_out dtype[T, H]): the pre-norm sum, fed to the next draft step.

        Raises:
          ValueError: ``hidden_in`` is not ``[T, hidden_size]``, or ``params.layer.attn_norm``
            is None (trace time).
        """
        cfg = self.config
        dt = jnp.dtype(cfg.dtype)
        if hidden_in.shape[-1] != cfg.hidden_size:
            raise ValueError(
                f"hidden_in.shape={hidden_in.shape}: the last axis must be hidden_size="
                f"{cfg.hidden_size} (fuse the target's aux states with combine_hidden_states)"
            )
        hidden = hidden_in.astype(dt)
        lp = params.layer
        if lp.attn_norm is None:
            raise ValueError(
                "params.layer.attn_norm=None: an EAGLE-3 midlayer normalizes the embedding "
                "(midlayer.input_layernorm.weight, [hidden_size])"
            )
        embeds = target_params.embed[token_ids].astype(dt)
        norm = self.rms_norm_impl
        x = jnp.concatenate(
            [
                rms_norm(embeds, lp.attn_norm, cfg.rms_norm_eps, impl=norm),
                rms_norm(hidden, params.hidden_norm, cfg.rms_norm_eps, impl=norm),
            ],
            -1,
        )
        inv_freq = self.inv_freq
        pool, attn = attention_block(
            lp.wqkv, lp.wo, x, 0, pool, positions, attn_fn, inv_freq=inv_freq, tp_axis=tp_axis
        )
        h, residual = add_rms_norm(hidden, attn, lp.mlp_norm, cfg.rms_norm_eps, impl=norm)
        return pool, mlp_block(lp.w_gate_up, lp.w_down, h, tp_axis) + residual

    @model_scope("draft")
    def combine_hidden_states(self, params: Eagle3Params, feature: jax.Array) -> jax.Array:
        """The target's aux states dtype[T, num_aux * H] -> the head's hidden dtype[T, H]:
        ``fc`` (+ ``fc_bias``), sglang's first draft forward after verify.

        Raises:
          ValueError: ``feature`` is not ``[T, num_aux * hidden_size]`` (trace time).
        """
        cfg = self.config
        dt = jnp.dtype(cfg.dtype)
        if feature.shape[-1] != cfg.num_aux * cfg.hidden_size:
            raise ValueError(
                f"feature.shape={feature.shape}: the last axis must be num_aux * hidden_size = "
                f"{cfg.num_aux} * {cfg.hidden_size} (the target's aux states of capture_layers)"
            )
        hidden = matmul(feature.astype(dt), params.fc)
        if params.fc_bias is not None:
            hidden = hidden + params.fc_bias.astype(dt)
        return hidden

    @model_scope("draft")
    def logits(
        self, params: Eagle3Params, target_params: LlamaParams, hidden: jax.Array
    ) -> jax.Array:
        """f32[T, draft_vocab_size] from ``hidden_out: dtype[T, H]`` (``norm`` then lm_head)."""
        del target_params  # the head has its own LM head over the draft vocabulary
        normed = rms_norm(
            hidden, params.final_norm, self.config.rms_norm_eps, impl=self.rms_norm_impl
        )
        return lm_logits(normed, params.lm_head)

    def to_target_ids(self, params: Eagle3Params, draft_ids: jax.Array) -> jax.Array:
        """i32[...] draft ids -> i32[...] target ids (``id + d2t[id]``)."""
        return (draft_ids + params.d2t[draft_ids]).astype(jnp.int32)

    def param_specs(self, params: Eagle3Params, tp_axis: str | None) -> Eagle3Params:
        """PartitionSpecs: the midlayer split over ``tp_axis``, the rest replicated."""
        return Eagle3Params(
            fc=_spec_leaf(),
            fc_bias=None if params.fc_bias is None else _spec_leaf(),
            hidden_norm=_spec_leaf(),
            layer=layer_specs(tp_axis),
            final_norm=_spec_leaf(),
            lm_head=_spec_leaf(),
            d2t=_spec_leaf(),
        )


def random_eagle3_params(
    draft: Eagle3Draft, seed: int = 0, *, target_vocab_size: int | None = None
) -> Eagle3Params:
    """Seeded random head weights with a random injective ``d2t`` (for tests)."""
    cfg = draft.config
    rng = np.random.default_rng(seed)
    hid, vd = cfg.hidden_size, cfg.draft_vocab_size

    def put(x: np.ndarray) -> jax.Array:
        return jnp.asarray(x, cfg.dtype)

    def dense(fan_in: int, fan_out: int) -> jax.Array:
        return put(rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in))

    def norm() -> jax.Array:
        return put(1.0 + 0.1 * rng.standard_normal(hid))

    layer = _random_layer(cfg, 2 * hid, dense, norm)  # the midlayer reads concat(embed, hidden)
    vocab = target_vocab_size or cfg.vocab_size
    hot = np.sort(rng.choice(vocab, vd, replace=False))
    return Eagle3Params(
        fc=dense(cfg.num_aux * hid, hid),
        fc_bias=None,
        hidden_norm=norm(),
        layer=layer,
        final_norm=norm(),
        lm_head=dense(hid, vd),
        d2t=jnp.asarray(hot - np.arange(vd), jnp.int32),
    )
