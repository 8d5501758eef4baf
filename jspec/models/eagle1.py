"""EAGLE-1/2 draft head (the layout of jspec's demo) behind the ``DraftModel`` protocol.

``x = fc(concat(embed(token), hidden_in)) (+ fc_bias)`` -> one Llama decoder layer (layer 0 of
the draft pool; published heads drop its ``input_layernorm``: ``attn_norm=None`` = identity) ->
``hidden_out`` (the pre-norm residual stream). Logits: the TARGET's LM head over
``norm(hidden_out)`` (or ``hidden_out`` itself when the head has no ``norm``, as sglang runs
published EAGLE-1 heads). The head shares the target's embedding, LM head and vocabulary, and
consumes the target's final-normed hidden state (``capture_layers == ()``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jspec._pytree import pytree_dataclass, replace
from jspec.models._geometry import ConfigGeometry
from jspec.models.hf_config import LlamaConfig
from jspec.models.layers import (
    AttnFn,
    check_rms_norm_impl,
    matmul,
    model_scope,
    rms_norm,
)
from jspec.models.llama import (
    LayerParams,
    LlamaParams,
    _lm_head_logits,
    _spec_leaf,
    decoder_layer,
    layer_specs,
)


@pytree_dataclass
class Eagle1Params:
    """EAGLE-1 head weights (``x @ W`` layout)."""

    fc: jax.Array  # [2H, H]: concat(embed(token), hidden_in) -> H
    fc_bias: jax.Array | None  # [H] or None
    layer: LayerParams
    final_norm: jax.Array | None  # [H], or None: logits straight from hidden_out


@dataclasses.dataclass(frozen=True, slots=True)
class Eagle1Draft(ConfigGeometry):
    """An EAGLE-1 head (``DraftModel`` protocol); static config only.

    Attributes:
      config: the head's geometry as a one-layer :class:`LlamaConfig` (``vocab_size`` = the
        target's; the head has no embedding or LM head of its own).
      capture_layers: always ``()`` (the head reads the target's final hidden state).
      rms_norm_impl: the RMSNorm kernel, ``"xla"`` | ``"triton"`` (GPU): the engine's
        ``KernelPolicy.rms_norm`` (:func:`jspec.kernels.policy.with_kernel_policy`).
    """

    config: LlamaConfig
    capture_layers: tuple[int, ...] = ()
    rms_norm_impl: str = "xla"

    def __post_init__(self) -> None:
        if not isinstance(self.config, LlamaConfig):
            raise TypeError(f"config={type(self.config).__name__} must be a LlamaConfig")
        check_rms_norm_impl(self.rms_norm_impl)
        if self.capture_layers != ():
            raise ValueError(
                f"capture_layers={self.capture_layers}: EAGLE-1 heads consume the "
                "target's final hidden state, capture_layers must be ()"
            )

    num_layers = 1

    @model_scope("draft")
    def forward(
        self,
        params: Eagle1Params,
        target_params: LlamaParams,
        pool: Any,
        token_ids: jax.Array,
        hidden_in: jax.Array,
        positions: jax.Array,
        attn_fn: AttnFn,
        *,
        tp_axis: str | None = None,
    ) -> tuple[Any, jax.Array]:
        """One draft forward over flat tokens.

        Args:
          token_ids, positions: i32[T]; hidden_in: dtype[T, H] (target hidden or the previous
          ``hidden_out``).

        Returns:
          (pool, hidden_out dtype[T, H]).
        """
        cfg = self.config
        dt = jnp.dtype(cfg.dtype)
        x = jnp.concatenate([target_params.embed[token_ids].astype(dt), hidden_in.astype(dt)], -1)
        x = matmul(x, params.fc)
        if params.fc_bias is not None:
            x = x + params.fc_bias.astype(dt)
        lp = params.layer
        norm = self.rms_norm_impl
        h = x if lp.attn_norm is None else rms_norm(x, lp.attn_norm, cfg.rms_norm_eps, impl=norm)
        pool, x, mlp_out = decoder_layer(
            lp,
            0,
            pool,
            x,
            h,
            positions,
            attn_fn,
            eps=cfg.rms_norm_eps,
            inv_freq=self.inv_freq,
            tp_axis=tp_axis,
            norm_impl=norm,
        )
        return pool, x + mlp_out

    def combine_hidden_states(self, params: Eagle1Params, feature: jax.Array) -> jax.Array:
        """Identity: the head consumes the target's final hidden dtype[T, H] as it is (its
        ``fc`` fuses the token embedding with either hidden, inside :meth:`forward`)."""
        del params
        return feature

    @model_scope("draft")
    def logits(
        self, params: Eagle1Params, target_params: LlamaParams, hidden: jax.Array
    ) -> jax.Array:
        """f32[T, V]: the target's LM head over the head's normed ``hidden``."""
        if params.final_norm is not None:
            hidden = rms_norm(
                hidden, params.final_norm, self.config.rms_norm_eps, impl=self.rms_norm_impl
            )
        return _lm_head_logits(target_params, hidden)

    def to_target_ids(self, params: Eagle1Params, draft_ids: jax.Array) -> jax.Array:
        """Identity: the head shares the target's vocabulary."""
        del params
        return draft_ids.astype(jnp.int32)

    def param_specs(self, params: Eagle1Params, tp_axis: str | None) -> Eagle1Params:
        """PartitionSpecs: the layer split over ``tp_axis``, the rest replicated."""
        specs = layer_specs(tp_axis)
        if params.layer.attn_norm is None:
            specs = replace(specs, attn_norm=None)
        return Eagle1Params(
            fc=_spec_leaf(),
            fc_bias=None if params.fc_bias is None else _spec_leaf(),
            layer=specs,
            final_norm=None if params.final_norm is None else _spec_leaf(),
        )
