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
import math
import os
from typing import Any

import numpy as np

from jspec.engine.protocol import DTYPES
from jspec.models._json import (
    get_bool,
    get_dtype,
    get_float,
    get_int,
    get_int_list,
    get_object,
    get_str,
    get_token_ids,
    in_file,
    in_object,
    read_json_object,
)

TARGET_ARCHITECTURES = ("LlamaForCausalLM",)
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
EAGLE1_ARCHITECTURES = ("LlamaForCausalLMEagle", "LlamaForCausalLM")
_DEFAULT_ROPE_THETA = 10000.0


def _check_positive_ints(obj: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")


def _check_geometry(cfg: Any, ints: tuple[str, ...]) -> None:
    """The checks :class:`LlamaConfig` and :class:`Eagle3Config` share (ValueError naming the
    field): positive ints, GQA grouping, even head_dim, finite positive eps / theta, dtype."""
    names = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")
    _check_positive_ints(cfg, (*names, "vocab_size", *ints))
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(
            f"num_heads={cfg.num_heads} must be a multiple of num_kv_heads={cfg.num_kv_heads}"
        )
    if cfg.head_dim % 2:
        raise ValueError(f"head_dim={cfg.head_dim} must be even (RoPE)")
    for name in ("rms_norm_eps", "rope_theta"):
        value = getattr(cfg, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value!r} must be a finite number > 0")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype={cfg.dtype!r} must be one of {sorted(DTYPES)}")


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
        _check_geometry(self, ("num_layers", "max_position_embeddings"))
        for name in ("bos_token_ids", "eos_token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, tuple):
                raise TypeError(f"{name}={ids!r} must be a tuple of ints")
            if any(not 0 <= i < self.vocab_size for i in ids):
                raise ValueError(f"{name}={ids}: ids must lie in [0, vocab_size={self.vocab_size})")

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
        _check_geometry(self, ("draft_vocab_size", "num_aux"))
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} must be <= vocab_size={self.vocab_size}"
            )
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != self.num_aux:
            raise ValueError(
                f"aux_layer_ids={self.aux_layer_ids} must name num_aux={self.num_aux} layers"
            )

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
        layers: tuple[int, ...]
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
    """The parsed ``config.json`` of a model directory (a JSON object).

    Raises:
      ValueError naming the file: absent, not JSON, or not an object.
    """
    path = os.path.join(os.fspath(directory), "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model directory {os.fspath(directory)!r} has no config.json")
    return read_json_object(path)


def architecture(raw: dict[str, Any]) -> str | None:
    """The first entry of ``architectures`` (None when the config names none)."""
    archs = raw.get("architectures")
    if archs is None:
        return None
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"architectures={archs!r} must be a list of strings")
    return archs[0] if archs else None


def _parse_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from either the old or the new key layout."""
    theta = get_float(raw, "rope_theta", _DEFAULT_ROPE_THETA)
    scaling = get_object(raw, "rope_scaling")
    params = get_object(raw, "rope_parameters")
    key = "rope_scaling"
    if params:
        if "rope_type" not in params and "rope_theta" not in params:
            raise ValueError(f"rope_parameters={params!r}: per-layer-type RoPE is not supported")
        theta = get_float(params, "rope_theta", theta)
        scaling, key = params, "rope_parameters"
    if not scaling:
        return theta, None
    with in_object(key):
        rope_type = get_str(scaling, "rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            return theta, None
        if rope_type != "llama3":
            raise ValueError(
                f"rope_type={rope_type!r} is not supported (jspec supports 'default' and 'llama3')"
            )
        return theta, RopeScaling(
            factor=get_float(scaling, "factor"),
            low_freq_factor=get_float(scaling, "low_freq_factor"),
            high_freq_factor=get_float(scaling, "high_freq_factor"),
            original_max_position_embeddings=get_int(scaling, "original_max_position_embeddings"),
        )


def _check_llama_features(raw: dict[str, Any]) -> None:
    act = get_str(raw, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
    for key in ("attention_bias", "mlp_bias"):
        if get_bool(raw, key, False):
            raise ValueError(f"{key}=true is not supported (Llama checkpoints have no biases)")


def _geometry(raw: dict[str, Any]) -> dict[str, Any]:
    hidden = get_int(raw, "hidden_size")
    heads = get_int(raw, "num_attention_heads")
    head_dim = get_int(raw, "head_dim", None)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(
                f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
                "(name head_dim)"
            )
        head_dim = hidden // heads
    theta, scaling = _parse_rope(raw)
    return {
        "hidden_size": hidden,
        "intermediate_size": get_int(raw, "intermediate_size"),
        "num_heads": heads,
        "num_kv_heads": get_int(raw, "num_key_value_heads", heads),
        "head_dim": head_dim,
        "rms_norm_eps": get_float(raw, "rms_norm_eps", 1e-6),
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
      ValueError naming the field: unsupported architecture, rope type or activation, a missing
        key, a value of the wrong JSON type (``16.9`` for an integer, ``"inf"`` for a number),
        out of range, or a BOS / EOS id outside the vocabulary.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"config must be a JSON object, got {type(raw).__name__}")
    arch = architecture(raw)
    allowed = EAGLE1_ARCHITECTURES if allow_eagle1 else TARGET_ARCHITECTURES
    model_type = get_str(raw, "model_type", "llama")
    if arch is None and model_type != "llama":
        raise ValueError(
            f"model_type={model_type!r} is not supported (jspec loads {', '.join(allowed)})"
        )
    if arch is not None and arch not in allowed:
        raise ValueError(
            f"architectures={raw['architectures']} is not supported "
            f"(jspec loads {', '.join(allowed)})"
        )
    _check_llama_features(raw)
    vocab = get_int(raw, "vocab_size")
    return LlamaConfig(
        vocab_size=vocab,
        num_layers=get_int(raw, "num_hidden_layers"),
        tie_word_embeddings=get_bool(raw, "tie_word_embeddings", False),
        dtype=get_dtype(raw, dtype, DTYPES),
        bos_token_ids=get_token_ids(raw, "bos_token_id", vocab) or (),
        eos_token_ids=get_token_ids(raw, "eos_token_id", vocab) or (),
        max_position_embeddings=get_int(raw, "max_position_embeddings", 2048),
        **_geometry(raw),
    )


def parse_eagle3_config(raw: dict[str, Any], *, dtype: str | None = None) -> Eagle3Config:
    """An :class:`Eagle3Config` from a parsed ``config.json`` (``LlamaForCausalLMEagle3``);
    ValueErrors as :func:`parse_llama_config`."""
    if not isinstance(raw, dict):
        raise ValueError(f"config must be a JSON object, got {type(raw).__name__}")
    arch = architecture(raw)
    if arch not in EAGLE3_ARCHITECTURES:
        raise ValueError(
            f"architectures={raw.get('architectures')} is not an EAGLE-3 head "
            f"(expected {EAGLE3_ARCHITECTURES[0]})"
        )
    _check_llama_features(raw)
    layers = get_int(raw, "num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"num_hidden_layers={layers}: EAGLE-3 heads have exactly one midlayer")
    geometry = _geometry(raw)
    target_hidden = get_int(raw, "target_hidden_size", None)
    if target_hidden is not None and target_hidden != geometry["hidden_size"]:
        raise ValueError(
            f"target_hidden_size={target_hidden} != hidden_size="
            f"{geometry['hidden_size']} is not supported"
        )
    vocab = get_int(raw, "vocab_size")
    eagle = get_object(raw, "eagle_config") or {}
    with in_object("eagle_config"):
        ids = get_int_list(eagle, "eagle_aux_hidden_state_layer_ids", minimum=-1)
    return Eagle3Config(
        vocab_size=vocab,
        draft_vocab_size=get_int(raw, "draft_vocab_size", vocab),
        aux_layer_ids=ids,
        dtype=get_dtype(raw, dtype, DTYPES),
        **geometry,
    )


def read_eos_token_ids(directory: str | os.PathLike) -> tuple[int, ...] | None:
    """The EOS ids a model directory names, for a target whose config does not carry them:
    ``generation_config.json``'s ``eos_token_id`` (an int or a list), else ``config.json``'s;
    None where neither file names one (or neither exists).

    Raises:
      ValueError naming the file and the field (not an int, not a list of ints, bad JSON).
    """
    directory = os.fspath(directory)
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            continue
        with in_file(path):
            ids = get_int_list(read_json_object(path), "eos_token_id", scalar_ok=True)
        if ids is not None:
            return ids
    return None


def load_llama_config(directory: str | os.PathLike, *, dtype: str | None = None) -> LlamaConfig:
    """:func:`parse_llama_config` of ``directory/config.json``.

    BOS / EOS ids named by ``generation_config.json`` take precedence over config.json's, as in
    transformers' ``generate`` (Llama-3 instruct files list their end-of-turn ids there).

    Raises:
      ValueError naming the file and the field.
    """
    directory = os.fspath(directory)
    with in_file(os.path.join(directory, "config.json")):
        cfg = parse_llama_config(read_config_json(directory), dtype=dtype)
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return cfg
    with in_file(path):
        gen = read_json_object(path)
        bos_token_ids = get_token_ids(gen, "bos_token_id", cfg.vocab_size)
        eos_token_ids = get_token_ids(gen, "eos_token_id", cfg.vocab_size)
    return dataclasses.replace(
        cfg,
        bos_token_ids=cfg.bos_token_ids if bos_token_ids is None else bos_token_ids,
        eos_token_ids=cfg.eos_token_ids if eos_token_ids is None else eos_token_ids,
    )
