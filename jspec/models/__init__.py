"""Real checkpoints behind jspec's model protocol: HF Llama targets, EAGLE-3 / EAGLE-1 heads.

Build a target and a draft from directories::

    target, params = load_llama("Llama-3.1-8B-Instruct", dtype="bfloat16")
    draft, draft_params = load_draft("EAGLE3-LLaMA3.1-Instruct-8B", target)

``target`` / ``draft`` are frozen static configs (``TargetModel`` / ``DraftModel``); the params
are pytrees on the device. transformers is never imported here (tests only).

Modules: ``hf_config`` (config.json -> LlamaConfig / Eagle3Config), ``layers`` (RMSNorm, RoPE,
attention / MLP blocks, the decoder layer; ``AttnFn``, ``MODEL_SCOPE`` and the precision rule
are :mod:`jspec.engine.protocol`'s), ``llama`` (LlamaTarget), ``eagle3`` / ``eagle1``
(draft heads), ``checkpoint`` (HF name tables + loaders), ``export`` (HF writers),
``synthetic`` (toy target, constructed EAGLE-3 head), ``tokenizer`` (tokenizer.json).
"""

from __future__ import annotations

from jspec.engine.protocol import MODEL_SCOPE, AttnFn
from jspec.kernels.policy import with_kernel_policy
from jspec.models.checkpoint import load_draft, load_eagle1, load_eagle3, load_llama
from jspec.models.eagle1 import Eagle1Draft, Eagle1Params
from jspec.models.eagle3 import Eagle3Draft, Eagle3Params, random_eagle3_params
from jspec.models.export import save_eagle3, save_llama
from jspec.models.hf_config import (
    Eagle3Config,
    LlamaConfig,
    RopeScaling,
    load_llama_config,
    parse_eagle3_config,
    parse_llama_config,
    read_eos_token_ids,
)
from jspec.models.llama import LayerParams, LlamaParams, LlamaTarget, random_llama_params
from jspec.models.synthetic import matched_eagle3, toy_eagle1, toy_llama_params
from jspec.models.tokenizer import Tokenizer

__all__ = [
    "with_kernel_policy",
    "MODEL_SCOPE",
    "AttnFn",
    "Eagle1Draft",
    "Eagle1Params",
    "Eagle3Config",
    "Eagle3Draft",
    "Eagle3Params",
    "LayerParams",
    "LlamaConfig",
    "LlamaParams",
    "LlamaTarget",
    "RopeScaling",
    "Tokenizer",
    "load_draft",
    "load_eagle1",
    "load_eagle3",
    "load_llama",
    "load_llama_config",
    "matched_eagle3",
    "parse_eagle3_config",
    "parse_llama_config",
    "read_eos_token_ids",
    "random_eagle3_params",
    "random_llama_params",
    "save_eagle3",
    "save_llama",
    "toy_eagle1",
    "toy_llama_params",
]
