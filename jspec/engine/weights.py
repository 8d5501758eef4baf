"""Weight files for the engine's target and draft: ``.npz`` (numpy) and ``.safetensors``.

Two naming schemes are read:

* jspec's own (written by :func:`save_weights`): ``embed``, ``final_norm``, ``lm_head``,
  ``layers.{i}.{wq,wk,wv,wo,attn_norm,mlp_norm,w_gate,w_up,w_down}``, ``draft.fc``,
  ``draft.final_norm``, ``draft.layer.{...}``; matrices stored ``[in, out]``.
* Hugging Face Llama / EAGLE: ``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.
  {q,k,v,o}_proj.weight``, ``...input_layernorm.weight``, ``...post_attention_layernorm.weight``,
  ``...mlp.{gate,up,down}_proj.weight``, ``model.norm.weight``, ``lm_head.weight`` (absent =
  tied to the embedding); EAGLE draft files: ``fc.weight``, ``layers.0.*``, optional
  ``norm.weight``. Linear weights are stored ``[out, in]`` and transposed on load.

``.safetensors`` needs the ``safetensors`` package; without it loading raises ``ImportError``
with instructions (``.npz`` always works).
"""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from jspec.engine.model import DraftParams, LayerParams, ModelConfig, TargetParams

_LAYER_FIELDS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
# jspec field -> (HF suffix, transpose)
_HF_LAYER = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}


def read_tensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a ``.npz`` or ``.safetensors`` file as numpy arrays."""
    path = os.fspath(path)
    if path.endswith(".npz"):
        with np.load(path) as data:
            return {k: np.asarray(data[k]) for k in data.files}
    if path.endswith(".safetensors"):
        try:
            from safetensors.numpy import load_file
        except ImportError as e:
            raise ImportError(
                f"reading {path!r} needs the 'safetensors' package (pip install safetensors); "
                "alternatively convert the weights to .npz"
            ) from e
        return dict(load_file(path))
    raise ValueError(f"weights path={path!r}: expected a .npz or .safetensors file")


def _take(
    tensors: dict, name: str, shape: tuple[int, ...], dtype: Any, transpose: bool = False
) -> jnp.ndarray:
    if name not in tensors:
        raise KeyError(f"weight {name!r} missing (have {sorted(tensors)[:8]}...)")
    arr = np.asarray(tensors[name], np.float32)
    if transpose:
        arr = arr.T
    if arr.shape != tuple(shape):
        raise ValueError(f"weight {name!r} has shape {arr.shape}, expected {tuple(shape)}")
    return jnp.asarray(arr, dtype)


def _layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    hid, inter = cfg.hidden_size, cfg.intermediate_size
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "attn_norm": (hid,),
        "wq": (hid, qd),
        "wk": (hid, kvd),
        "wv": (hid, kvd),
        "wo": (qd, hid),
        "mlp_norm": (hid,),
        "w_gate": (hid, inter),
        "w_up": (hid, inter),
        "w_down": (inter, hid),
    }


def _load_layer(cfg: ModelConfig, tensors: dict, prefix: str, hf: bool) -> LayerParams:
    shapes = _layer_shapes(cfg)
    out = {}
    for field in _LAYER_FIELDS:
        if hf:
            suffix, transpose = _HF_LAYER[field]
            out[field] = _take(tensors, prefix + suffix, shapes[field], cfg.jnp_dtype, transpose)
        else:
            out[field] = _take(tensors, prefix + field, shapes[field], cfg.jnp_dtype)
    return LayerParams(**out)


def load_target(path: str | os.PathLike, cfg: ModelConfig) -> TargetParams:
    """Target params from a jspec or Hugging Face Llama weight file (shapes checked)."""
    tensors = read_tensors(path)
    hid, vocab = cfg.hidden_size, cfg.vocab_size
    hf = "model.embed_tokens.weight" in tensors
    if hf:
        embed = _take(tensors, "model.embed_tokens.weight", (vocab, hid), cfg.jnp_dtype)
        lm_name = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
        lm_head = _take(tensors, lm_name, (hid, vocab), cfg.jnp_dtype, transpose=True)
        final_norm = _take(tensors, "model.norm.weight", (hid,), cfg.jnp_dtype)
        layers = tuple(
            _load_layer(cfg, tensors, f"model.layers.{i}.", True) for i in range(cfg.num_layers)
        )
    else:
        embed = _take(tensors, "embed", (vocab, hid), cfg.jnp_dtype)
        lm_head = _take(tensors, "lm_head", (hid, vocab), cfg.jnp_dtype)
        final_norm = _take(tensors, "final_norm", (hid,), cfg.jnp_dtype)
        layers = tuple(
            _load_layer(cfg, tensors, f"layers.{i}.", False) for i in range(cfg.num_layers)
        )
    return TargetParams(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


def load_draft(path: str | os.PathLike, cfg: ModelConfig) -> DraftParams:
    """EAGLE draft params from a jspec file (``draft.*``) or an EAGLE HF file (``fc.weight``)."""
    tensors = read_tensors(path)
    hid = cfg.hidden_size
    if "fc.weight" in tensors:
        fc = _take(tensors, "fc.weight", (2 * hid, hid), cfg.jnp_dtype, transpose=True)
        if "layers.0.input_layernorm.weight" not in tensors:
            # EAGLE-1 checkpoints drop the draft layer's input_layernorm: use ones.
            tensors["layers.0.input_layernorm.weight"] = np.ones(hid, np.float32)
        layer = _load_layer(cfg, tensors, "layers.0.", True)
        norm = (
            _take(tensors, "norm.weight", (hid,), cfg.jnp_dtype)
            if "norm.weight" in tensors
            else jnp.ones(hid, cfg.jnp_dtype)
        )
        return DraftParams(fc=fc, layer=layer, final_norm=norm)
    fc = _take(tensors, "draft.fc", (2 * hid, hid), cfg.jnp_dtype)
    norm = _take(tensors, "draft.final_norm", (hid,), cfg.jnp_dtype)
    return DraftParams(
        fc=fc, layer=_load_layer(cfg, tensors, "draft.layer.", False), final_norm=norm
    )


def save_weights(
    path: str | os.PathLike, target: TargetParams, draft: DraftParams | None = None
) -> None:
    """Write target (and draft) params as a jspec-named ``.npz`` (f32 on disk)."""
    out: dict[str, np.ndarray] = {
        "embed": target.embed,
        "final_norm": target.final_norm,
        "lm_head": target.lm_head,
    }
    for i, lp in enumerate(target.layers):
        for field in _LAYER_FIELDS:
            out[f"layers.{i}.{field}"] = getattr(lp, field)
    if draft is not None:
        out["draft.fc"] = draft.fc
        out["draft.final_norm"] = draft.final_norm
        for field in _LAYER_FIELDS:
            out[f"draft.layer.{field}"] = getattr(draft.layer, field)
    np.savez(os.fspath(path), **{k: np.asarray(v, np.float32) for k, v in out.items()})
