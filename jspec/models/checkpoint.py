"""Load Hugging Face checkpoint directories: Llama targets, EAGLE-3 and EAGLE-1 heads.

Weights are read from ``model.safetensors`` or the shards named by
``model.safetensors.index.json`` as views of the files mapped into memory (no torch; bf16
through ``ml_dtypes``; :mod:`jspec.models._sources`). Every name and shape is checked from the
file headers before a byte of weights is read (:func:`inspect_llama` / :func:`inspect_draft` run
those checks alone and size the weights; :func:`abstract_llama` / :func:`abstract_draft` also
give the params as shapes, to compile against while the weights load), then the tensors go to
the device shard by shard, in the model dtype (no full host copy, never an f32 copy of a bf16
checkpoint), each checked finite.

One table per model maps HF names to params (:data:`LAYER_TABLE`, :data:`LLAMA_TABLE`,
:data:`EAGLE3_TABLE`, :data:`EAGLE1_TABLE`); ``nn.Linear`` weights (``[out, in]``) are transposed
to jspec's ``x @ W`` layout. A tensor outside the tables is an error unless it is in the model's
documented ignore list (:data:`IGNORED`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from jspec.models import hf_config
from jspec.models._json import in_file
from jspec.models._load import ROTARY_BUFFERS, Plan, Progress, Want, check_source, num_bytes
from jspec.models._sources import open_source
from jspec.models.eagle1 import Eagle1Draft, Eagle1Params
from jspec.models.eagle3 import Eagle3Draft, Eagle3Params
from jspec.models.llama import LayerParams, LlamaParams, LlamaTarget

# params field -> (HF name, transposed?). Layer names are relative to the layer's prefix.
LAYER_TABLE = {
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
LLAMA_TABLE = {  # + LAYER_TABLE under "model.layers.{i}."
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),  # absent when tie_word_embeddings
}
EAGLE3_TABLE = {  # + LAYER_TABLE under "midlayer."; t2d is ignored
    "fc": ("fc.weight", True),
    "fc_bias": ("fc.bias", False),  # optional
    "hidden_norm": ("midlayer.hidden_norm.weight", False),
    "final_norm": ("norm.weight", False),
    "lm_head": ("lm_head.weight", True),
    "d2t": ("d2t", False),  # int64 offsets -> i32
}
EAGLE1_TABLE = {  # + LAYER_TABLE under "layers.0." (input_layernorm optional)
    "fc": ("fc.weight", True),
    "fc_bias": ("fc.bias", False),  # optional
    "final_norm": ("norm.weight", False),  # optional
}

# Tensors a checkpoint may hold that jspec does not load (regexes, full match): RoPE buffers of
# older conversions (computed from the config); the tied LM head's copy (transformers ties it
# too); an EAGLE head's copy of the embedding / LM head (sglang replaces them with the target's,
# as jspec uses the target's) and EAGLE-3's t2d (the inverse of d2t).
IGNORED = {
    "llama": (ROTARY_BUFFERS,),
    "llama_tied": (ROTARY_BUFFERS, r"lm_head\.weight"),
    "eagle3": (ROTARY_BUFFERS, "t2d", r"(model\.)?embed_tokens\.weight"),
    "eagle1": (ROTARY_BUFFERS, r"(model\.)?embed_tokens\.weight", r"lm_head\.weight"),
}


def _layer_wants(
    prefix: str, cfg: Any, hin: int, optional_attn_norm: bool = False
) -> dict[str, Want]:
    """One decoder layer's tensors (:data:`LAYER_TABLE` under ``prefix``) for a
    ``LlamaConfig`` / ``Eagle3Config`` ``cfg``; ``hin``: the q/k/v input width (``2 * H`` for
    the EAGLE-3 midlayer)."""
    hid, inter = cfg.hidden_size, cfg.intermediate_size
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "attn_norm": (hid,),
        "wq": (hin, qd),
        "wk": (hin, kvd),
        "wv": (hin, kvd),
        "wo": (qd, hid),
        "mlp_norm": (hid,),
        "w_gate": (hid, inter),
        "w_up": (hid, inter),
        "w_down": (inter, hid),
    }
    return {
        field: Want(
            prefix + name,
            shapes[field],
            transpose,
            optional=optional_attn_norm and field == "attn_norm",
        )
        for field, (name, transpose) in LAYER_TABLE.items()
    }


def _fuse_layer(
    arrays: dict[str, jax.Array], prefix: str, head_dim: int, device: Any
) -> LayerParams:
    """Pop one layer's loaded projections from ``arrays`` and fuse them on their device
    (:meth:`LayerParams.from_projections`; the separate copies are freed layer by layer)."""
    parts = {f: arrays.pop(prefix + f, None) for f in LAYER_TABLE}
    layer = LayerParams.from_projections(**parts, head_dim=head_dim)
    return layer if device is None else jax.device_put(layer, device)


# ---- targets -----------------------------------------------------------------------------------
def _llama_wants(cfg: hf_config.LlamaConfig) -> dict[str, Want]:
    hid, vocab = cfg.hidden_size, cfg.vocab_size
    shapes = {"embed": (vocab, hid), "final_norm": (hid,), "lm_head": (hid, vocab)}
    wants = {
        key: Want(name, shapes[key], transpose)
        for key, (name, transpose) in LLAMA_TABLE.items()
        if not (key == "lm_head" and cfg.tie_word_embeddings)
    }
    for i in range(cfg.num_layers):
        for field, want in _layer_wants(f"model.layers.{i}.", cfg, hid).items():
            wants[f"layers.{i}.{field}"] = want
    return wants


def _plan_llama(directory: str | os.PathLike, dtype: str | None) -> Plan:
    cfg = hf_config.load_llama_config(directory, dtype=dtype)
    wants = _llama_wants(cfg)
    source = open_source(directory)
    check_source(
        source,
        wants,
        what=hf_config.TARGET_ARCHITECTURES[0],
        ignored=IGNORED["llama_tied" if cfg.tie_word_embeddings else "llama"],
        num_layers=cfg.num_layers,
    )
    return Plan(LlamaTarget(cfg), source, wants, cfg.jnp_dtype)


def inspect_llama(
    directory: str | os.PathLike, *, dtype: str | None = None
) -> tuple[LlamaTarget, int]:
    """Every check :func:`load_llama` makes before reading a weight (config, headers, names),
    without reading one.

    Returns:
      ``(LlamaTarget, weight bytes on the device)``.
    """
    plan = _plan_llama(directory, dtype)
    return plan.model, plan.num_bytes


def load_llama(
    directory: str | os.PathLike,
    *,
    dtype: str | None = None,
    device: Any = None,
    progress: Progress | None = None,
) -> tuple[LlamaTarget, LlamaParams]:
    """A Llama-family target from a HF model directory.

    Args:
      directory: holds ``config.json`` and ``model.safetensors`` (or shards + index).
      dtype: "float32" | "bfloat16" | "float16"; default: the config's ``torch_dtype``.
      device: a ``jax.Device`` or ``Sharding`` for every tensor (default device if None).
      progress: called ``progress(done, total)`` after each tensor.

    Returns:
      ``(LlamaTarget, LlamaParams)``.

    Raises:
      ValueError naming the file and the field or tensor: unsupported or malformed config, a
        bad index or safetensors file, a missing / misshaped / unknown tensor (all before a
        weight is read), a tensor holding NaN or Inf (while reading).
    """
    plan = _plan_llama(directory, dtype)
    return plan.model, _assemble_llama(plan.read(device, progress), plan.model, device)


def _assemble_llama(arrays: dict, target: LlamaTarget, device: Any) -> LlamaParams:
    cfg = target.config
    layers = tuple(
        _fuse_layer(arrays, f"layers.{i}.", cfg.head_dim, device) for i in range(cfg.num_layers)
    )
    return LlamaParams(
        embed=arrays["embed"],
        layers=layers,
        final_norm=arrays["final_norm"],
        lm_head=arrays.get("lm_head"),
    )


def abstract_llama(
    directory: str | os.PathLike, *, dtype: str | None = None
) -> tuple[LlamaTarget, LlamaParams]:
    """:func:`inspect_llama`'s checks, and the params :func:`load_llama` would return as
    ``jax.ShapeDtypeStruct`` leaves (no weight read): what a caller compiles against while
    the weights load."""
    plan = _plan_llama(directory, dtype)
    return plan.model, jax.eval_shape(lambda a: _assemble_llama(a, plan.model, None), plan.avals)


# ---- drafts ------------------------------------------------------------------------------------
def _fit(field: str, draft_value: int, target: LlamaTarget, target_value: int) -> None:
    if draft_value != target_value:
        raise ValueError(
            f"draft {field}={draft_value} does not fit the target's {field}={target_value}"
        )


def _config_json(directory: str | os.PathLike) -> str:
    return os.path.join(os.fspath(directory), "config.json")


def _eagle3_wants(cfg: hf_config.Eagle3Config) -> dict[str, Want]:
    """Every tensor of an EAGLE-3 head (:data:`EAGLE3_TABLE`, then the midlayer's)."""
    hid, vd = cfg.hidden_size, cfg.draft_vocab_size
    shapes = {
        "fc": (cfg.num_aux * hid, hid),
        "fc_bias": (hid,),
        "hidden_norm": (hid,),
        "final_norm": (hid,),
        "lm_head": (hid, vd),
        "d2t": (vd,),
    }
    wants = {
        key: Want(name, shapes[key], transpose, optional=key == "fc_bias", integer=key == "d2t")
        for key, (name, transpose) in EAGLE3_TABLE.items()
    }
    return wants | _layer_wants("midlayer.", cfg, 2 * hid)


def _eagle1_wants(cfg: hf_config.LlamaConfig) -> dict[str, Want]:
    """Every tensor of an EAGLE-1 head (:data:`EAGLE1_TABLE`, then ``layers.0.``'s)."""
    hid = cfg.hidden_size
    shapes = {"fc": (2 * hid, hid), "fc_bias": (hid,), "final_norm": (hid,)}
    wants = {
        key: Want(name, shapes[key], transpose, optional=key != "fc")
        for key, (name, transpose) in EAGLE1_TABLE.items()
    }
    return wants | _layer_wants("layers.0.", cfg, hid, optional_attn_norm=True)


def _plan_eagle3(directory: str | os.PathLike, target: LlamaTarget, dtype: str | None) -> Plan:
    with in_file(_config_json(directory)):
        cfg = hf_config.parse_eagle3_config(
            hf_config.read_config_json(directory), dtype=dtype or target.dtype
        )
    _fit("hidden_size", cfg.hidden_size, target, target.hidden_size)
    _fit("vocab_size", cfg.vocab_size, target, target.vocab_size)
    draft = Eagle3Draft(cfg, cfg.capture_layers(target.num_layers))
    source = open_source(directory)
    wants = _eagle3_wants(cfg)
    # A head over the full target vocabulary may ship without d2t (identity).
    if cfg.draft_vocab_size == target.vocab_size and not source.has("d2t"):
        del wants["d2t"]
    check_source(source, wants, what=hf_config.EAGLE3_ARCHITECTURES[0], ignored=IGNORED["eagle3"])
    return Plan(draft, source, wants, cfg.jnp_dtype)


def load_eagle3(
    directory: str | os.PathLike,
    target: LlamaTarget,
    *,
    dtype: str | None = None,
    device: Any = None,
    progress: Progress | None = None,
) -> tuple[Eagle3Draft, Eagle3Params]:
    """An EAGLE-3 head (``LlamaForCausalLMEagle3``) for ``target`` from a HF directory.

    Args:
      directory: ``config.json`` + ``model.safetensors`` (``pytorch_model.bin`` only when torch
        is importable: loaded with ``weights_only=True``).
      target: the target it drafts for (hidden size, vocabulary and depth are checked).
      dtype: default: the target's dtype.

    Returns:
      ``(Eagle3Draft, Eagle3Params)``; ``Eagle3Draft.capture_layers`` is the target capture.

    Raises:
      ValueError: not an EAGLE-3 config, a field that does not fit the target, the errors of
        :func:`load_llama`, or ``d2t`` mapping outside the target vocabulary.
    """
    return _read_eagle3(_plan_eagle3(directory, target, dtype), target, device, progress)


def _read_eagle3(plan: Plan, target: LlamaTarget, device: Any, progress: Any) -> tuple:
    draft, vd = plan.model, plan.model.config.draft_vocab_size
    arrays = plan.read(device, progress)
    if arrays.get("d2t") is not None:
        mapped = np.arange(vd) + np.asarray(arrays["d2t"])
        if mapped.min() < 0 or mapped.max() >= target.vocab_size:
            raise ValueError(
                f"d2t maps draft ids to [{mapped.min()}, {mapped.max()}], outside the "
                f"target's vocab_size={target.vocab_size}"
            )
    return draft, _assemble_eagle3(arrays, draft, device)


def _assemble_eagle3(arrays: dict, draft: Eagle3Draft, device: Any) -> Eagle3Params:
    d2t = arrays.get("d2t")
    if d2t is None:  # identity
        d2t = jax.device_put(np.zeros(draft.config.draft_vocab_size, np.int32), device)
    return Eagle3Params(
        fc=arrays["fc"],
        fc_bias=arrays.get("fc_bias"),
        hidden_norm=arrays["hidden_norm"],
        layer=_fuse_layer(arrays, "", draft.config.head_dim, device),
        final_norm=arrays["final_norm"],
        lm_head=arrays["lm_head"],
        d2t=d2t,
    )


def _plan_eagle1(directory: str | os.PathLike, target: LlamaTarget, dtype: str | None) -> Plan:
    with in_file(_config_json(directory)):
        raw = hf_config.read_config_json(directory)
        raw.setdefault("vocab_size", target.vocab_size)
        cfg = hf_config.parse_llama_config(raw, dtype=dtype or target.dtype, allow_eagle1=True)
    _fit("hidden_size", cfg.hidden_size, target, target.hidden_size)
    _fit("vocab_size", cfg.vocab_size, target, target.vocab_size)
    cfg = dataclasses.replace(cfg, num_layers=1)
    wants = _eagle1_wants(cfg)
    source = open_source(directory)
    check_source(source, wants, what="EAGLE-1 head", ignored=IGNORED["eagle1"], num_layers=1)
    return Plan(Eagle1Draft(cfg), source, wants, cfg.jnp_dtype)


def load_eagle1(
    directory: str | os.PathLike,
    target: LlamaTarget,
    *,
    dtype: str | None = None,
    device: Any = None,
    progress: Progress | None = None,
) -> tuple[Eagle1Draft, Eagle1Params]:
    """An EAGLE-1/2 head (``fc [H, 2H]``, ``layers.0.*``) for ``target`` from a HF directory.

    ``layers.0.input_layernorm.weight`` and ``norm.weight`` are optional (absent = identity /
    no final norm, as sglang runs published EAGLE-1 heads). Errors as :func:`load_eagle3`.
    """
    return _read_eagle1(_plan_eagle1(directory, target, dtype), target, device, progress)


def _read_eagle1(plan: Plan, target: LlamaTarget, device: Any, progress: Any) -> tuple:
    del target
    return plan.model, _assemble_eagle1(plan.read(device, progress), plan.model, device)


def _assemble_eagle1(arrays: dict, draft: Eagle1Draft, device: Any) -> Eagle1Params:
    return Eagle1Params(
        fc=arrays["fc"],
        fc_bias=arrays.get("fc_bias"),
        layer=_fuse_layer(arrays, "", draft.config.head_dim, device),
        final_norm=arrays.get("final_norm"),
    )


def _plan_draft(directory: str | os.PathLike, target: LlamaTarget, dtype: str | None) -> Plan:
    with in_file(_config_json(directory)):
        raw = hf_config.read_config_json(directory)
        arch = hf_config.architecture(raw)
        supported = hf_config.EAGLE3_ARCHITECTURES + hf_config.EAGLE1_ARCHITECTURES
        if arch is not None and arch not in supported:
            raise ValueError(
                f"draft architectures={raw['architectures']} is not supported "
                f"(jspec loads {', '.join(supported)})"
            )
    plan = _plan_eagle3 if arch in hf_config.EAGLE3_ARCHITECTURES else _plan_eagle1
    return plan(directory, target, dtype)


def inspect_draft(
    directory: str | os.PathLike, target: LlamaTarget, *, dtype: str | None = None
) -> tuple[Eagle3Draft | Eagle1Draft, int]:
    """Every check :func:`load_draft` makes before reading a weight, without reading one.

    Returns:
      ``(draft model, weight bytes on the device)``.
    """
    plan = _plan_draft(directory, target, dtype)
    return plan.model, plan.num_bytes


def abstract_draft(
    directory: str | os.PathLike, target: LlamaTarget, *, dtype: str | None = None
) -> tuple[Eagle3Draft | Eagle1Draft, Eagle3Params | Eagle1Params]:
    """:func:`inspect_draft`'s checks, and the params :func:`load_draft` would return as
    ``jax.ShapeDtypeStruct`` leaves (no weight read; ``d2t``'s range is checked when it
    loads)."""
    plan = _plan_draft(directory, target, dtype)
    assemble = _assemble_eagle3 if isinstance(plan.model, Eagle3Draft) else _assemble_eagle1
    return plan.model, jax.eval_shape(lambda a: assemble(a, plan.model, None), plan.avals)


def load_draft(
    directory: str | os.PathLike,
    target: LlamaTarget,
    *,
    dtype: str | None = None,
    device: Any = None,
    progress: Progress | None = None,
) -> tuple[Eagle3Draft | Eagle1Draft, Eagle3Params | Eagle1Params]:
    """:func:`load_eagle3` for ``LlamaForCausalLMEagle3`` configs, else :func:`load_eagle1`."""
    plan = _plan_draft(directory, target, dtype)
    read = _read_eagle3 if isinstance(plan.model, Eagle3Draft) else _read_eagle1
    return read(plan, target, device, progress)


def weight_bytes(model: Any) -> int:
    """Device bytes of a jspec model's weights from its config alone (no checkpoint), every
    optional tensor counted; for sizing before anything is built or read."""
    cfg = model.config
    if isinstance(model, LlamaTarget):
        wants = _llama_wants(cfg)
    elif isinstance(model, Eagle3Draft):
        wants = _eagle3_wants(cfg)
    else:
        wants = _eagle1_wants(cfg)
    return num_bytes(wants.values(), cfg.jnp_dtype)
