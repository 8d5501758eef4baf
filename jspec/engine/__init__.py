"""End-to-end engine: a small Llama-style target + EAGLE draft head over jspec's paged KV.

Module map:
  model.py      ModelConfig, target / draft params and forwards (RMSNorm, RoPE, GQA, SwiGLU)
  weights.py    .npz / .safetensors loading (jspec and Hugging Face names), save_weights
  attention.py  paged attention passes (gather slots + masked softmax, LSE merge)
  state.py      EngineConfig, EngineState (allocator, req_to_token, pools, per-slot carry)
  lifecycle.py  prefill (admission) and release of requests
  greedy.py     plain greedy decode step (the lossless baseline)
  spec_step.py  the jitted EAGLE tree speculative decode step, as phases
  scheduler.py  Engine: continuous batching host loop, leak checks
  sharding.py   data-parallel shards with shard_map
  reference.py  dense no-cache greedy oracle
  demo.py       ``jspec demo``
"""

from __future__ import annotations

from jspec.engine.model import (
    DraftParams,
    ModelConfig,
    TargetParams,
    init_draft_params,
    init_target_params,
)
from jspec.engine.scheduler import Engine, Request, RunStats
from jspec.engine.state import EngineConfig, EngineState, make_engine_config

__all__ = [
    "DraftParams",
    "Engine",
    "EngineConfig",
    "EngineState",
    "ModelConfig",
    "Request",
    "RunStats",
    "TargetParams",
    "init_draft_params",
    "init_target_params",
    "make_engine_config",
]
