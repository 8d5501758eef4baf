"""Hugging Face ``config.json`` -> frozen, hashable jspec configs (static jit arguments).

Three kinds of directory are read:

* targets, ``architectures: ["LlamaForCausalLM"]`` (Llama-2, 3, 3.1, 3.2) -> :class:`LlamaConfig`;
* EAGLE-3 heads, ``["LlamaForCausalLMEagle3"]`` -> :class:`Eagle3Config` (its capture layers
  depend on the target's depth: :meth:`Eagle3Config.capture_layers`);
* EAGLE-1/2 heads (``fc [H, 2H]`` over ``concat(embed, target_hidden)``): their config is a
  one-layer Llama config, read as :class:`LlamaConfig` with ``allow_eagle1=True``.

RoPE is read from both spellings: the older top-level ``rope_theta`` + ``rope_scaling`` and the
newer ``rope_parameters`` (transformers 5.x, ``rope_theta`` inside it). Rope types ``default``
and ``llama3`` are supported; any other raises ``ValueError`` naming it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from typing import Any

import numpy as np

from jspec.engine.protocol import DTYPES

TARGET_ARCHITECTURES = ("LlamaForCausalLM",)
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
EAGLE1_ARCHITECTURES = ("LlamaForCausalLMEagle", "LlamaForCausalLM")
_DEFAULT_ROPE_THETA = 10000.0


def _check_positive_ints(obj: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")


@dataclasses.dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3.1 RoPE scaling (``rope_type: "llama3"``): a one-off rescale of the inverse
    frequencies, independent of the position (see :func:`jspec.models.layers.rope_inv_freq`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"

    def __post_init__(self) -> None:
        if self.rope_type != "llama3":
            raise ValueError(
                f"rope_type={self.rope_type!r} is not supported "
                "(jspec supports 'default' and 'llama3')"
            )
        if not self.factor > 0:
            raise ValueError(f"factor={self.factor!r} must be > 0")
        if not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                f"high_freq_factor={self.high_freq_factor!r} must be > "
                f"low_freq_factor={self.low_freq_factor!r} > 0"
            )
        _check_positive_ints(self, ("original_max_position_embeddings",))


@dataclasses.dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Static geometry of a Llama-family model (hashable).

    Attributes:
      vocab_size, hidden_size, intermediate_size, num_layers: the usual sizes.
      num_heads, num_kv_heads, head_dim: GQA geometry (``num_heads % num_kv_heads == 0``).
      rms_norm_eps, rope_theta: RMSNorm epsilon and RoPE base.
      rope_scaling: :class:`RopeScaling` or None (plain RoPE).
      tie_word_embeddings: the LM head is the token embedding (no ``lm_head.weight``).
      dtype: weights / activations / KV pool ("float32" | "bfloat16" | "float16").
      bos_token_ids, eos_token_ids: tuples (a config may give an int or a list).
      max_position_embeddings: the context the model was configured for.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = _DEFAULT_ROPE_THETA
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    bos_token_ids: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        _check_positive_ints(
            self,
            (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_layers",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "max_position_embeddings",
            ),
        )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE)")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps!r} must be > 0")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta!r} must be > 0")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {sorted(DTYPES)}")
        for name in ("bos_token_ids", "eos_token_ids"):
            if not isinstance(getattr(self, name), tuple):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a tuple of ints")

    @property
    def jnp_dtype(self) -> Any:
        return DTYPES[self.dtype]


@dataclasses.dataclass(frozen=True, slots=True)
class Eagle3Config:
    """Static config of an EAGLE-3 head (``LlamaForCausalLMEagle3``, one ``midlayer``).

    Attributes:
      hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim: the midlayer's geometry
        (its q/k/v take ``2 * hidden_size`` inputs).
      vocab_size: the target's vocabulary (as the head's config states it).
      draft_vocab_size: rows of the head's ``lm_head`` (``d2t`` maps them to target ids).
      aux_layer_ids: ``eagle_config.eagle_aux_hidden_state_layer_ids`` (layer OUTPUTS), or None
        for sglang's default; see :meth:`capture_layers`.
      num_aux: number of fused auxiliary states (``fc`` is ``[H, num_aux * H]``; 3 in practice).
    """

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = _DEFAULT_ROPE_THETA
    rope_scaling: RopeScaling | None = None
    aux_layer_ids: tuple[int, ...] | None = None
    num_aux: int = 3
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _check_positive_ints(
            self,
            (
                "hidden_size",
                "intermediate_size",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "vocab_size",
                "draft_vocab_size",
                "num_aux",
            ),
        )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE)")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} must be <= vocab_size={self.vocab_size}"
            )
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != self.num_aux:
            raise ValueError(
                f"aux_layer_ids={self.aux_layer_ids} must name num_aux={self.num_aux} layers"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {sorted(DTYPES)}")

    @property
    def jnp_dtype(self) -> Any:
        return DTYPES[self.dtype]

    def capture_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """Target layers whose INCOMING residual stream the head fuses (sglang's rule).

        ``aux_layer_ids`` name layer outputs, so the capture is at ``id + 1``; without them it is
        ``(2, N // 2, N - 3)``. sglang captures in layer order, once per layer, so the result
        must be strictly increasing and inside ``[0, N)``.
        """
        n = num_target_layers
        if self.aux_layer_ids is None:
            layers = (2, n // 2, n - 3)
        else:
            layers = tuple(i + 1 for i in self.aux_layer_ids)
        if any(b <= a for a, b in itertools.pairwise(layers)) or layers[0] < 0 or layers[-1] >= n:
            raise ValueError(
                f"capture_layers={layers} (aux_layer_ids={self.aux_layer_ids}) must be strictly "
                f"increasing layers of the {n}-layer target; name them with "
                "eagle_config.eagle_aux_hidden_state_layer_ids in the draft's config.json"
            )
        return layers


# ---- parsing -----------------------------------------------------------------------------------
def read_config_json(directory: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``config.json`` of a model directory (clear error when absent)."""
    path = os.path.join(os.fspath(directory), "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model directory {os.fspath(directory)!r} has no config.json")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def architecture(raw: dict[str, Any]) -> str | None:
    """The first entry of ``architectures`` (None when the config names none)."""
    archs = raw.get("architectures") or []
    return archs[0] if archs else None


def _parse_dtype(raw: dict[str, Any], override: str | None) -> str:
    if override is not None:
        name = override
    else:
        name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        name = str(name).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not supported: use one of {sorted(DTYPES)}")
    return name


def _parse_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from either the old or the new key layout."""
    theta = raw.get("rope_theta")
    scaling = raw.get("rope_scaling")
    params = raw.get("rope_parameters")
    if params:
        if "rope_type" not in params and "rope_theta" not in params:
            raise ValueError(f"rope_parameters={params!r}: per-layer-type RoPE is not supported")
        theta = params.get("rope_theta", theta)
        scaling = params
    theta = float(_DEFAULT_ROPE_THETA if theta is None else theta)
    if not scaling:
        return theta, None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(
            f"rope_type={rope_type!r} is not supported (jspec supports 'default' and 'llama3')"
        )
    try:
        return theta, RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"llama3 rope scaling lacks the key {e.args[0]!r}") from None


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _require(raw: dict[str, Any], key: str) -> Any:
    if key not in raw:
        raise ValueError(f"config.json lacks the key {key!r}")
    return raw[key]


def _check_llama_features(raw: dict[str, Any]) -> None:
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={raw['hidden_act']!r} is not supported (only 'silu')")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key, False):
            raise ValueError(f"{key}=true is not supported (Llama checkpoints have no biases)")


def _geometry(raw: dict[str, Any]) -> dict[str, Any]:
    hidden = int(_require(raw, "hidden_size"))
    heads = int(_require(raw, "num_attention_heads"))
    head_dim = raw.get("head_dim")
    theta, scaling = _parse_rope(raw)
    return {
        "hidden_size": hidden,
        "intermediate_size": int(_require(raw, "intermediate_size")),
        "num_heads": heads,
        "num_kv_heads": int(raw.get("num_key_value_heads") or heads),
        "head_dim": int(head_dim) if head_dim else hidden // heads,
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": scaling,
    }


def parse_llama_config(
    raw: dict[str, Any], *, dtype: str | None = None, allow_eagle1: bool = False
) -> LlamaConfig:
    """A :class:`LlamaConfig` from a parsed ``config.json``.

    Args:
      raw: the JSON object.
      dtype: overrides ``torch_dtype`` / ``dtype`` of the file.
      allow_eagle1: also accept the EAGLE-1 head architecture names.

    Raises:
      ValueError: unsupported architecture, rope type, activation, or a missing key.
    """
    arch = architecture(raw)
    allowed = EAGLE1_ARCHITECTURES if allow_eagle1 else TARGET_ARCHITECTURES
    if arch is None and raw.get("model_type", "llama") != "llama":
        raise ValueError(
            f"model_type={raw['model_type']!r} is not supported (jspec loads {', '.join(allowed)})"
        )
    if arch is not None and arch not in allowed:
        raise ValueError(
            f"architectures={raw['architectures']} is not supported "
            f"(jspec loads {', '.join(allowed)})"
        )
    _check_llama_features(raw)
    return LlamaConfig(
        vocab_size=int(_require(raw, "vocab_size")),
        num_layers=int(_require(raw, "num_hidden_layers")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        dtype=_parse_dtype(raw, dtype),
        bos_token_ids=_token_ids(raw.get("bos_token_id")),
        eos_token_ids=_token_ids(raw.get("eos_token_id")),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        **_geometry(raw),
    )


def parse_eagle3_config(raw: dict[str, Any], *, dtype: str | None = None) -> Eagle3Config:
    """An :class:`Eagle3Config` from a parsed ``config.json`` (``LlamaForCausalLMEagle3``)."""
    arch = architecture(raw)
    if arch not in EAGLE3_ARCHITECTURES:
        raise ValueError(
            f"architectures={raw.get('architectures')} is not an EAGLE-3 head "
            f"(expected {EAGLE3_ARCHITECTURES[0]})"
        )
    _check_llama_features(raw)
    layers = int(raw.get("num_hidden_layers", 1))
    if layers != 1:
        raise ValueError(f"num_hidden_layers={layers}: EAGLE-3 heads have exactly one midlayer")
    geometry = _geometry(raw)
    target_hidden = raw.get("target_hidden_size")
    if target_hidden is not None and int(target_hidden) != geometry["hidden_size"]:
        raise ValueError(
            f"target_hidden_size={target_hidden} != hidden_size="
            f"{geometry['hidden_size']} is not supported"
        )
    vocab = int(_require(raw, "vocab_size"))
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return Eagle3Config(
        vocab_size=vocab,
        draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
        aux_layer_ids=None if ids is None else tuple(int(i) for i in ids),
        dtype=_parse_dtype(raw, dtype),
        **geometry,
    )


def load_llama_config(directory: str | os.PathLike, *, dtype: str | None = None) -> LlamaConfig:
    """:func:`parse_llama_config` of ``directory/config.json``.

    BOS / EOS ids named by ``generation_config.json`` take precedence over config.json's, as in
    transformers' ``generate`` (Llama-3 instruct files list their end-of-turn ids there).
    """
    cfg = parse_llama_config(read_config_json(directory), dtype=dtype)
    path = os.path.join(os.fspath(directory), "generation_config.json")
    if not os.path.isfile(path):
        return cfg
    with open(path, encoding="utf-8") as f:
        gen = json.load(f)
    ids = {}
    for key, field in (("bos_token_id", "bos_token_ids"), ("eos_token_id", "eos_token_ids")):
        if gen.get(key) is not None:
            ids[field] = _token_ids(gen[key])
    return dataclasses.replace(cfg, **ids)
