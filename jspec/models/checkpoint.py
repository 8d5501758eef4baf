"""Load Hugging Face checkpoint directories: Llama targets, EAGLE-3 and EAGLE-1 heads.

Weights are read with ``safetensors.safe_open(..., framework="np")`` (no torch; bf16 arrives
through ``ml_dtypes``) from ``model.safetensors`` or the shards named by
``model.safetensors.index.json``. Every name and shape is checked from the file headers before a
byte of weights is read, then the tensors go to the device one by one, shard by shard, in the
model dtype (no full host copy, never an f32 copy of a bf16 checkpoint).

One table per model maps HF names to params (:data:`LAYER_TABLE`, :data:`LLAMA_TABLE`,
:data:`EAGLE3_TABLE`, :data:`EAGLE1_TABLE`); ``nn.Linear`` weights (``[out, in]``) are transposed
to jspec's ``x @ W`` layout.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jspec.models import hf_config
from jspec.models._json import in_file
from jspec.models._sources import TensorSource, open_source
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

Progress = Callable[[int, int], None]  # (tensors loaded, tensors in all)


@dataclasses.dataclass(frozen=True)
class _Want:
    name: str  # HF tensor name
    shape: tuple[int, ...]  # jspec layout; the file holds shape[::-1] when transposed
    transpose: bool = False
    optional: bool = False
    integer: bool = False

    @property
    def file_shape(self) -> tuple[int, ...]:
        return self.shape[::-1] if self.transpose else self.shape


def _layer_wants(
    prefix: str, hin: int, hid: int, qd: int, kvd: int, inter: int, optional_attn_norm: bool = False
) -> dict[str, _Want]:
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
        field: _Want(
            prefix + name,
            shapes[field],
            transpose,
            optional=optional_attn_norm and field == "attn_norm",
        )
        for field, (name, transpose) in LAYER_TABLE.items()
    }


def _check(source: TensorSource, wants: dict[str, _Want]) -> None:
    """Names, shapes and dtypes from the headers; ValueError naming the tensor otherwise."""
    missing = [w.name for w in wants.values() if not w.optional and not source.has(w.name)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"tensor {missing[0]!r}{more} is missing from {source.describe()}")
    for want in wants.values():
        if not source.has(want.name):
            continue
        shape, dtype = source.info(want.name)
        if shape != want.file_shape:
            raise ValueError(
                f"tensor {want.name!r} in {source.file_of(want.name)} has shape "
                f"{shape}, expected {want.file_shape}"
            )
        ok = ("I64", "I32") if want.integer else ("F32", "BF16", "F16")
        if dtype not in ok:
            raise ValueError(
                f"tensor {want.name!r} in {source.file_of(want.name)} has dtype "
                f"{dtype}, expected one of {ok}"
            )


@jax.jit
def _transpose(x: jax.Array) -> jax.Array:
    return x.T


def _to_device(arr: np.ndarray, want: _Want, dtype: Any, device: Any) -> jax.Array:
    """One file tensor in the jspec layout on ``device``. ``nn.Linear`` weights are transposed
    on the device when it is one device (a host transpose of an 8B checkpoint's 15 GB ran at
    ~0.25 GB/s); for another ``Sharding`` (laid out for the transposed shape) on the host."""
    if want.integer:
        return jax.device_put(np.asarray(arr, np.int32), device)
    host = np.asarray(arr, dtype=dtype)  # no copy when the file holds ``dtype``
    if not want.transpose:
        return jax.device_put(host, device)
    if device is None or isinstance(device, jax.Device):
        return _transpose(jax.device_put(host, device))
    return jax.device_put(np.ascontiguousarray(host.T), device)


def _load(
    source: TensorSource,
    wants: dict[str, _Want],
    dtype: Any,
    device: Any,
    progress: Progress | None,
) -> dict[str, jax.Array]:
    """Checked, then read file by file, each tensor straight to ``device`` in ``dtype``."""
    _check(source, wants)
    by_name = {w.name: key for key, w in wants.items() if source.has(w.name)}
    out: dict[str, jax.Array] = {}
    for arrays in source.read(list(by_name)):
        for name, arr in arrays:
            want = wants[by_name[name]]
            out[by_name[name]] = last = _to_device(arr, want, dtype, device)
            del arr
            if progress is not None:
                progress(len(out), len(by_name))
        if out:  # one shard's host buffers in flight at most
            last.block_until_ready()
    return out


def _fuse_layer(
    arrays: dict[str, jax.Array], prefix: str, head_dim: int, device: Any
) -> LayerParams:
    """Pop one layer's loaded projections from ``arrays`` and fuse them on their device
    (:meth:`LayerParams.from_projections`; the separate copies are freed layer by layer)."""
    parts = {f: arrays.pop(prefix + f, None) for f in LAYER_TABLE}
    layer = LayerParams.from_projections(**parts, head_dim=head_dim)
    return layer if device is None else jax.device_put(layer, device)


# ---- targets -----------------------------------------------------------------------------------
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
      ValueError: unsupported config, or a missing / misshaped tensor (before any compile).
    """
    cfg = hf_config.load_llama_config(directory, dtype=dtype)
    hid, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"embed": (vocab, hid), "final_norm": (hid,), "lm_head": (hid, vocab)}
    wants = {
        key: _Want(name, shapes[key], transpose)
        for key, (name, transpose) in LLAMA_TABLE.items()
        if not (key == "lm_head" and cfg.tie_word_embeddings)
    }
    for i in range(cfg.num_layers):
        for field, want in _layer_wants(f"model.layers.{i}.", hid, hid, qd, kvd, inter).items():
            wants[f"layers.{i}.{field}"] = want
    source = open_source(directory)
    arrays = _load(source, wants, cfg.jnp_dtype, device, progress)
    layers = tuple(
        _fuse_layer(arrays, f"layers.{i}.", cfg.head_dim, device) for i in range(cfg.num_layers)
    )
    params = LlamaParams(
        embed=arrays["embed"],
        layers=layers,
        final_norm=arrays["final_norm"],
        lm_head=arrays.get("lm_head"),
    )
    return LlamaTarget(cfg), params


# ---- drafts ------------------------------------------------------------------------------------
def _fit(field: str, draft_value: int, target: LlamaTarget, target_value: int) -> None:
    if draft_value != target_value:
        raise ValueError(
            f"draft {field}={draft_value} does not fit the target's {field}={target_value}"
        )


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
      ValueError: not an EAGLE-3 config, a field that does not fit the target, a missing /
        misshaped tensor, or ``d2t`` mapping outside the target vocabulary.
    """
    with in_file(os.path.join(os.fspath(directory), "config.json")):
        cfg = hf_config.parse_eagle3_config(
            hf_config.read_config_json(directory), dtype=dtype or target.dtype
        )
    _fit("hidden_size", cfg.hidden_size, target, target.hidden_size)
    _fit("vocab_size", cfg.vocab_size, target, target.vocab_size)
    draft = Eagle3Draft(cfg, cfg.capture_layers(target.num_layers))
    hid, inter, vd = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "fc": (cfg.num_aux * hid, hid),
        "fc_bias": (hid,),
        "hidden_norm": (hid,),
        "final_norm": (hid,),
        "lm_head": (hid, vd),
        "d2t": (vd,),
    }
    source = open_source(directory)
    # A head over the full target vocabulary may ship without d2t (identity).
    identity_d2t = vd == target.vocab_size and not source.has("d2t")
    wants = {
        key: _Want(name, shapes[key], transpose, optional=key == "fc_bias", integer=key == "d2t")
        for key, (name, transpose) in EAGLE3_TABLE.items()
        if not (key == "d2t" and identity_d2t)
    }
    wants.update(_layer_wants("midlayer.", 2 * hid, hid, qd, kvd, inter))
    arrays = _load(source, wants, cfg.jnp_dtype, device, progress)
    d2t = arrays["d2t"] if not identity_d2t else jax.device_put(np.zeros(vd, np.int32), device)
    mapped = np.arange(vd) + np.asarray(d2t)
    if mapped.min() < 0 or mapped.max() >= target.vocab_size:
        raise ValueError(
            f"d2t maps draft ids to [{mapped.min()}, {mapped.max()}], outside the "
            f"target's vocab_size={target.vocab_size}"
        )
    layer = _fuse_layer(arrays, "", cfg.head_dim, device)
    params = Eagle3Params(
        fc=arrays["fc"],
        fc_bias=arrays.get("fc_bias"),
        hidden_norm=arrays["hidden_norm"],
        layer=layer,
        final_norm=arrays["final_norm"],
        lm_head=arrays["lm_head"],
        d2t=d2t,
    )
    return draft, params


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
    with in_file(os.path.join(os.fspath(directory), "config.json")):
        raw = hf_config.read_config_json(directory)
        raw.setdefault("vocab_size", target.vocab_size)
        cfg = hf_config.parse_llama_config(raw, dtype=dtype or target.dtype, allow_eagle1=True)
    _fit("hidden_size", cfg.hidden_size, target, target.hidden_size)
    _fit("vocab_size", cfg.vocab_size, target, target.vocab_size)
    cfg = dataclasses.replace(cfg, num_layers=1)
    hid, inter = cfg.hidden_size, cfg.intermediate_size
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"fc": (2 * hid, hid), "fc_bias": (hid,), "final_norm": (hid,)}
    wants = {
        key: _Want(name, shapes[key], transpose, optional=key != "fc")
        for key, (name, transpose) in EAGLE1_TABLE.items()
    }
    wants.update(_layer_wants("layers.0.", hid, hid, qd, kvd, inter, optional_attn_norm=True))
    arrays = _load(open_source(directory), wants, cfg.jnp_dtype, device, progress)
    layer = _fuse_layer(arrays, "", cfg.head_dim, device)
    params = Eagle1Params(
        fc=arrays["fc"],
        fc_bias=arrays.get("fc_bias"),
        layer=layer,
        final_norm=arrays.get("final_norm"),
    )
    return Eagle1Draft(cfg), params


def load_draft(
    directory: str | os.PathLike,
    target: LlamaTarget,
    *,
    dtype: str | None = None,
    device: Any = None,
    progress: Progress | None = None,
) -> tuple[Eagle3Draft | Eagle1Draft, Eagle3Params | Eagle1Params]:
    """:func:`load_eagle3` for ``LlamaForCausalLMEagle3`` configs, else :func:`load_eagle1`."""
    with in_file(os.path.join(os.fspath(directory), "config.json")):
        raw = hf_config.read_config_json(directory)
        arch = hf_config.architecture(raw)
    supported = hf_config.EAGLE3_ARCHITECTURES + hf_config.EAGLE1_ARCHITECTURES
    if arch is not None and arch not in supported:
        raise ValueError(
            f"draft architectures={raw['architectures']} is not supported "
            f"(jspec loads {', '.join(supported)})"
        )
    loader = load_eagle3 if arch in hf_config.EAGLE3_ARCHITECTURES else load_eagle1
    return loader(directory, target, dtype=dtype, device=device, progress=progress)
