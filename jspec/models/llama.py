"""The Llama-family target model behind jspec's ``TargetModel`` protocol.

Token embedding -> ``num_layers`` x [RMSNorm -> GQA attention with RoPE -> residual, RMSNorm ->
SwiGLU MLP -> residual] -> final RMSNorm -> LM head (the embedding when tied). Weights use the
``x @ W`` layout (``[in, out]``; checkpoints' ``nn.Linear`` weights are transposed on load by
:mod:`jspec.models.checkpoint`).

:class:`LlamaTarget` is static config only (frozen, hashable: a static jit argument); the
weights are the :class:`LlamaParams` pytree passed beside it. jspec's toy target is a
``LlamaTarget`` with its own init (:func:`jspec.models.synthetic.toy_llama_params`).

Tensor parallel (Megatron layout, ``tp_axis`` names the mesh axis inside ``shard_map``):
``wqkv`` / ``w_gate_up`` hold this shard's KV-head groups (each with its query heads) / its slice
of the MLP, ``wo/w_down`` the matching rows; the two row-parallel products are summed over
``tp_axis``. Head counts are read from the weights, so one code path runs full or sharded
layers (:meth:`LlamaTarget.param_specs` gives the partition).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jspec._pytree import pytree_dataclass
from jspec.models._geometry import ConfigGeometry
from jspec.models.hf_config import LlamaConfig
from jspec.models.layers import (
    AttnFn,
    add_rms_norm,
    attention_block,
    check_rms_norm_impl,
    lm_logits,
    mlp_block,
    model_scope,
)


@pytree_dataclass
class LayerParams:
    """One decoder layer. ``H`` hidden, ``Hq``/``Hkv`` heads, ``G = Hq / Hkv``, ``D`` head_dim,
    ``I`` MLP, ``Hin`` the attention input width (``H``; ``2H`` in an EAGLE-3 midlayer).

    The projections that read the same input are stored fused, so a decode step streams each
    with one matmul (measured on the H200 at one row: q, k, v as three matmuls 33 us, fused
    15 us; gate and up 66 us, fused 54 us; bench/skinny_matmul.py). Build a layer from the
    checkpoint's separate matrices with :meth:`from_projections`; ``wq`` .. ``w_up`` read them
    back. The fused axes are grouped per KV head (``wqkv``) and kept apart from the split axis
    (``w_gate_up``), so a tensor-parallel shard holds whole groups (:func:`layer_specs`).
    """

    attn_norm: jax.Array | None  # [H] input_layernorm; None = identity (EAGLE-1 heads)
    wqkv: jax.Array  # [Hin, Hkv, G + 2, D]: per KV head its G query heads, then K, then V
    wo: jax.Array  # [Hq*D, H]
    mlp_norm: jax.Array  # [H] post_attention_layernorm
    w_gate_up: jax.Array  # [H, 2, I]: gate, up
    w_down: jax.Array  # [I, H]

    @classmethod
    def from_projections(
        cls,
        *,
        attn_norm: Any,
        wq: Any,
        wk: Any,
        wv: Any,
        wo: Any,
        mlp_norm: Any,
        w_gate: Any,
        w_up: Any,
        w_down: Any,
        head_dim: int,
    ) -> LayerParams:
        """Fuse a layer's separate projections (``x @ W`` layout, numpy or jax arrays).

        Args:
          wq: [Hin, Hq*D]; wk, wv: [Hin, Hkv*D] (query head ``h`` reads KV head ``h // G``,
            HF's GQA order); w_gate, w_up: [H, I]; the rest as stored. ``head_dim``: ``D``.

        Raises:
          ValueError: shapes that do not form one GQA layer, naming the field.
        """
        xp = np if all(isinstance(w, np.ndarray) for w in (wq, wk, wv, w_gate, w_up)) else jnp
        hin = wq.shape[0]
        for name, w in (("wk", wk), ("wv", wv)):
            if w.shape != wk.shape or w.shape[0] != hin or w.shape[1] % head_dim:
                raise ValueError(
                    f"{name}.shape={w.shape}: expected [{hin}, Hkv * head_dim={head_dim}] like wk"
                )
        hkv = wk.shape[1] // head_dim
        if wq.shape[1] % (hkv * head_dim):
            raise ValueError(
                f"wq.shape={wq.shape}: its width must be a multiple of wk's {wk.shape[1]} (GQA)"
            )
        group = wq.shape[1] // (hkv * head_dim)
        if w_up.shape != w_gate.shape:
            raise ValueError(f"w_up.shape={w_up.shape} must equal w_gate.shape={w_gate.shape}")
        wqkv = xp.concatenate(
            [
                wq.reshape(hin, hkv, group, head_dim),
                wk.reshape(hin, hkv, 1, head_dim),
                wv.reshape(hin, hkv, 1, head_dim),
            ],
            axis=2,
        )
        return cls(
            attn_norm=attn_norm,
            wqkv=wqkv,
            wo=wo,
            mlp_norm=mlp_norm,
            w_gate_up=xp.stack([w_gate, w_up], axis=1),
            w_down=w_down,
        )

    # ---- the separate projections, read back (checkpoint export, tests) ----------------------
    @property
    def wq(self) -> jax.Array:
        """[Hin, Hq*D]."""
        return self.wqkv[:, :, :-2].reshape(self.wqkv.shape[0], -1)

    @property
    def wk(self) -> jax.Array:
        """[Hin, Hkv*D]."""
        return self.wqkv[:, :, -2].reshape(self.wqkv.shape[0], -1)

    @property
    def wv(self) -> jax.Array:
        """[Hin, Hkv*D]."""
        return self.wqkv[:, :, -1].reshape(self.wqkv.shape[0], -1)

    @property
    def w_gate(self) -> jax.Array:
        """[H, I]."""
        return self.w_gate_up[:, 0]

    @property
    def w_up(self) -> jax.Array:
        """[H, I]."""
        return self.w_gate_up[:, 1]


@pytree_dataclass
class LlamaParams:
    """Target weights."""

    embed: jax.Array  # [V, H]
    layers: tuple  # tuple[LayerParams, ...], one per layer
    final_norm: jax.Array  # [H]
    lm_head: jax.Array | None  # [H, V]; None = tied (the LM head is embed.T)


def _spec_leaf(*axes: str | None) -> jax.Array:
    """``PartitionSpec(*axes)``, a leaf of a spec tree.

    NOTE: a spec tree (``param_specs``) is the params dataclass itself with a PartitionSpec
    where each array sits (jax's prefix-tree convention), so it is typed as the params class;
    the cast says that this leaf stands where the params hold an array."""
    return cast(jax.Array, P(*axes))


def layer_specs(tp_axis: str | None) -> LayerParams:
    """PartitionSpecs of one :class:`LayerParams`: KV-head groups / MLP split over ``tp_axis``."""
    if tp_axis is None:
        return LayerParams(
            attn_norm=_spec_leaf(),
            wqkv=_spec_leaf(),
            wo=_spec_leaf(),
            mlp_norm=_spec_leaf(),
            w_gate_up=_spec_leaf(),
            w_down=_spec_leaf(),
        )
    return LayerParams(
        attn_norm=_spec_leaf(),
        wqkv=_spec_leaf(None, tp_axis, None, None),
        wo=_spec_leaf(tp_axis, None),
        mlp_norm=_spec_leaf(),
        w_gate_up=_spec_leaf(None, None, tp_axis),
        w_down=_spec_leaf(tp_axis, None),
    )


def decoder_layer(
    lp: LayerParams,
    layer: int,
    pool: Any,
    x: jax.Array,
    h: jax.Array,
    positions: jax.Array,
    attn_fn: AttnFn,
    *,
    eps: float,
    inv_freq: np.ndarray,
    tp_axis: str | None = None,
    norm_impl: str = "xla",
) -> tuple[Any, jax.Array, jax.Array]:
    """One pre-norm Llama decoder layer over flat tokens, its output left unsummed.

    Args:
      x: dtype[T, H] the incoming residual stream; h: dtype[T, Hin] its normed form (the
        attention input: ``rms_norm(x, lp.attn_norm)``, or ``x`` for EAGLE-1's identity norm).
      norm_impl: the RMSNorm kernel (:func:`jspec.models.layers.rms_norm`).

    Returns:
      ``(pool, x', mlp_out)``, both dtype[T, H]: the layer's output is ``x' + mlp_out``, left
      for the caller to add in the next norm's fused launch (:func:`add_rms_norm`).
    """
    pool, attn = attention_block(
        lp.wqkv, lp.wo, h, layer, pool, positions, attn_fn, inv_freq=inv_freq, tp_axis=tp_axis
    )
    h, x = add_rms_norm(x, attn, lp.mlp_norm, eps, impl=norm_impl)
    return pool, x, mlp_block(lp.w_gate_up, lp.w_down, h, tp_axis)


@dataclasses.dataclass(frozen=True, slots=True)
class LlamaTarget(ConfigGeometry):
    """A Llama-family target (``TargetModel`` protocol); static config only.

    Attributes:
      config: the model's :class:`LlamaConfig` (``dtype`` is the weights / activations / pool
        dtype).
      rms_norm_impl: the RMSNorm kernel, ``"xla"`` | ``"triton"`` (GPU): the engine's
        ``KernelPolicy.rms_norm`` (:func:`jspec.kernels.policy.with_kernel_policy`).
    """

    config: LlamaConfig
    rms_norm_impl: str = "xla"

    def __post_init__(self) -> None:
        if not isinstance(self.config, LlamaConfig):
            raise TypeError(f"config={type(self.config).__name__} must be a LlamaConfig")
        check_rms_norm_impl(self.rms_norm_impl)

    # ---- the protocol's static attributes (the rest: ConfigGeometry) ------------------------
    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    # ---- compute -----------------------------------------------------------------------------
    @model_scope("target")
    def forward(
        self,
        params: LlamaParams,
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
          params: :class:`LlamaParams` (this shard's slice under tensor parallelism).
          pool: the target KV pool, threaded through ``attn_fn`` (layer ``i`` = decoder ``i``).
          token_ids, positions: i32[T].
          attn_fn: writes K/V into ``pool`` and attends (:data:`jspec.engine.protocol.AttnFn`).
          capture_layers: static; target layers whose INCOMING residual stream is returned
            (sglang's EAGLE-3 capture), each in ``[0, num_layers)``.
          tp_axis: tensor-parallel mesh axis when the layers are head-sharded.

        Returns:
          (pool, hidden dtype[T, H], aux): hidden is the final-RMSNorm output (the LM-head
          input); aux is dtype[T, len(capture_layers) * H], the captured states concatenated in
          ``capture_layers`` order, or None when ``capture_layers == ()``.
        """
        cfg = self.config
        for layer in capture_layers:
            if not 0 <= layer < cfg.num_layers:
                raise ValueError(
                    f"capture_layers={capture_layers}: layer {layer} is outside "
                    f"[0, {cfg.num_layers})"
                )
        if len(params.layers) != cfg.num_layers:
            raise ValueError(
                f"params.layers has {len(params.layers)} layers, num_layers={cfg.num_layers}"
            )
        inv_freq = self.inv_freq
        eps, norm = cfg.rms_norm_eps, self.rms_norm_impl
        x = params.embed[token_ids].astype(cfg.jnp_dtype)
        delta = None  # the previous layer's MLP output, added in the next norm's launch
        captured: dict[int, jax.Array] = {}
        for layer, lp in enumerate(params.layers):
            h, x = add_rms_norm(x, delta, lp.attn_norm, eps, impl=norm)
            if layer in capture_layers:
                captured[layer] = x
            pool, x, delta = decoder_layer(
                lp,
                layer,
                pool,
                x,
                h,
                positions,
                attn_fn,
                eps=eps,
                inv_freq=inv_freq,
                tp_axis=tp_axis,
                norm_impl=norm,
            )
        hidden, _ = add_rms_norm(x, delta, params.final_norm, eps, impl=norm)
        aux = jnp.concatenate([captured[i] for i in capture_layers], -1) if capture_layers else None
        return pool, hidden, aux

    @model_scope("target")
    def logits(self, params: LlamaParams, hidden: jax.Array) -> jax.Array:
        """f32[T, vocab_size] from the final-normed ``hidden: dtype[T, H]``."""
        return _lm_head_logits(params, hidden)

    def param_specs(self, params: LlamaParams, tp_axis: str | None) -> LlamaParams:
        """PartitionSpecs for ``params``: layers split over ``tp_axis``, the rest replicated."""
        return LlamaParams(
            embed=_spec_leaf(),
            layers=tuple(layer_specs(tp_axis) for _ in params.layers),
            final_norm=_spec_leaf(),
            lm_head=None if params.lm_head is None else _spec_leaf(),
        )


def _lm_head_logits(params: LlamaParams, hidden: jax.Array) -> jax.Array:
    """f32[T, V]: ``params``' LM head over ``hidden: dtype[T, H]``, the embedding (transposed)
    when tied (the target's logits, and EAGLE-1's, which shares the target's head)."""
    if params.lm_head is None:
        return lm_logits(hidden, params.embed, transposed=True)
    return lm_logits(hidden, params.lm_head)


def _random_layer(
    cfg: Any,
    in_dim: int,
    dense: Callable[[int, int], jax.Array],
    norm: Callable[[], jax.Array],
) -> LayerParams:
    """One random decoder layer of ``cfg``'s geometry with attention input width ``in_dim``
    (``H``; ``2H`` for the EAGLE-3 midlayer), drawn from the caller's seeded ``dense(fan_in,
    fan_out)`` and ``norm()`` in a fixed order (the random init of :func:`random_llama_params`
    and :func:`jspec.models.eagle3.random_eagle3_params`)."""
    hid, inter = cfg.hidden_size, cfg.intermediate_size
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return LayerParams.from_projections(
        attn_norm=norm(),
        wq=dense(in_dim, qd),
        wk=dense(in_dim, kvd),
        wv=dense(in_dim, kvd),
        wo=dense(qd, hid),
        mlp_norm=norm(),
        w_gate=dense(hid, inter),
        w_up=dense(hid, inter),
        w_down=dense(inter, hid),
        head_dim=cfg.head_dim,
    )


def random_llama_params(target: LlamaTarget, seed: int = 0, *, scale: float = 1.0) -> LlamaParams:
    """Seeded random weights (``N(0, scale^2 / fan_in)`` matrices, norms around 1), for tests."""
    cfg = target.config
    rng = np.random.default_rng(seed)
    hid = cfg.hidden_size

    def put(x: np.ndarray) -> jax.Array:
        return jnp.asarray(x, cfg.jnp_dtype)

    def dense(fan_in: int, fan_out: int) -> jax.Array:
        return put(rng.standard_normal((fan_in, fan_out)) * (scale / np.sqrt(fan_in)))

    def norm() -> jax.Array:
        return put(1.0 + 0.1 * rng.standard_normal(hid))

    layers = tuple(_random_layer(cfg, hid, dense, norm) for _ in range(cfg.num_layers))
    embed = put(rng.standard_normal((cfg.vocab_size, hid)))
    lm_head = None if cfg.tie_word_embeddings else dense(hid, cfg.vocab_size)
    return LlamaParams(embed=embed, layers=layers, final_norm=norm(), lm_head=lm_head)
