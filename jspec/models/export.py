"""Write jspec models as Hugging Face directories (``config.json`` + safetensors), the loader's
tables (:mod:`jspec.models.checkpoint`) inverted: what :func:`load_llama` / :func:`load_eagle3`
read back, and what ``transformers.LlamaForCausalLM.from_pretrained`` loads for targets.

For tests, examples and synthetic checkpoints (:mod:`jspec.models.synthetic`); weights are
written in the model dtype, RoPE in the older ``rope_theta`` + ``rope_scaling`` keys.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from jspec.models.checkpoint import EAGLE3_TABLE, LAYER_TABLE, LLAMA_TABLE
from jspec.models.eagle3 import Eagle3Draft, Eagle3Params
from jspec.models.hf_config import Eagle3Config, LlamaConfig, RopeScaling
from jspec.models.llama import LlamaParams, LlamaTarget


def _rope_json(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    if scaling is None:
        return {"rope_theta": theta, "rope_scaling": None}
    return {
        "rope_theta": theta,
        "rope_scaling": {
            "rope_type": scaling.rope_type,
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        },
    }


def _decoder_json(cfg: LlamaConfig | Eagle3Config, num_layers: int) -> dict[str, Any]:
    """The decoder-layer keys of a HF Llama ``config.json`` (the target's and the EAGLE-3
    head's alike): geometry, activation, RMSNorm epsilon, dtype and RoPE."""
    return {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "torch_dtype": cfg.dtype,
        **_rope_json(cfg.rope_theta, cfg.rope_scaling),
    }


def _host(x: Any, transpose: bool) -> np.ndarray:
    """``x`` (numpy or jax) on the host in the file layout; a jax array is transposed on its
    device before the copy (numpy's host transpose ran at ~0.25 GB/s on an 8B model)."""
    return np.ascontiguousarray(x.T if transpose else x)


def _table_tensors(
    table: dict[str, tuple[str, bool]], params: Any, prefix: str = ""
) -> dict[str, np.ndarray]:
    """The file tensors of ``params`` by a loader table (``field -> (name, transpose)``, e.g.
    :data:`jspec.models.checkpoint.LLAMA_TABLE`): ``{prefix + name: host array}`` in table
    order, each in the model dtype and shape (``[in, out]`` weights transposed to HF's
    ``[out, in]``); fields that are None (an untied head, no ``fc_bias``) are left out."""
    return {
        prefix + name: _host(getattr(params, field), transpose)
        for field, (name, transpose) in table.items()
        if getattr(params, field) is not None
    }


def _write(
    directory: str | os.PathLike,
    config: dict[str, Any],
    tensors: dict[str, np.ndarray],
    max_shard_bytes: int | None,
) -> None:
    from safetensors.numpy import save_file

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    if max_shard_bytes is None:
        save_file(tensors, os.path.join(directory, "model.safetensors"))
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    for name, arr in tensors.items():
        if shards[-1] and sum(a.nbytes for a in shards[-1].values()) + arr.nbytes > (
            max_shard_bytes
        ):
            shards.append({})
        shards[-1][name] = arr
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, file))
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(a.nbytes for a in tensors.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def save_llama(
    directory: str | os.PathLike,
    target: LlamaTarget,
    params: LlamaParams,
    *,
    max_shard_bytes: int | None = None,
) -> None:
    """Write ``target`` + ``params`` as a HF ``LlamaForCausalLM`` directory.

    Args:
      max_shard_bytes: split the weights into shards of at most this size (+ the index file);
        one ``model.safetensors`` when None.
    """
    cfg = target.config
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        **_decoder_json(cfg, cfg.num_layers),
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": params.lm_head is None,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": _ids_json(cfg.bos_token_ids),
        "eos_token_id": _ids_json(cfg.eos_token_ids),
    }
    tensors = _table_tensors(LLAMA_TABLE, params)
    for i, lp in enumerate(params.layers):
        tensors.update(_table_tensors(LAYER_TABLE, lp, f"model.layers.{i}."))
    _write(directory, config, tensors, max_shard_bytes)


def _ids_json(ids: tuple[int, ...]) -> int | list[int] | None:
    return None if not ids else ids[0] if len(ids) == 1 else list(ids)


def save_eagle3(
    directory: str | os.PathLike,
    draft: Eagle3Draft,
    params: Eagle3Params,
    *,
    num_target_layers: int | None = None,
) -> None:
    """Write an EAGLE-3 head as a HF ``LlamaForCausalLMEagle3`` directory.

    ``config.aux_layer_ids`` are written as ``eagle_aux_hidden_state_layer_ids``; without them,
    ``draft.capture_layers - 1`` unless those are sglang's default for ``num_target_layers``.
    """
    cfg = draft.config
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        **_decoder_json(cfg, 1),
    }
    ids = cfg.aux_layer_ids
    n = num_target_layers
    if ids is None and (n is None or draft.capture_layers != (2, n // 2, n - 3)):
        ids = tuple(i - 1 for i in draft.capture_layers)
    if ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids)}
    tensors = _table_tensors(EAGLE3_TABLE, params)
    tensors["d2t"] = np.asarray(params.d2t).astype(np.int64)
    tensors.update(_table_tensors(LAYER_TABLE, params.layer, "midlayer."))
    _write(directory, config, tensors, None)
