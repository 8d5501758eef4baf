"""End-to-end engine: EAGLE tree speculative decoding over a KV backend (jspec's paged KV by
default), for any model that follows :mod:`jspec.engine.protocol` (a target + a draft head, each
a static model object with its params beside it).

Module map:
  protocol.py    TargetModel / DraftModel / AttnFn: all the engine knows of a model
  runner.py      Runner (static: config, models, KV backend; checked once) and Weights (params)
  kv_backend.py  the KV seam: KVBackend (prepare decode / prefill, commit, release), KVView
                 (token slots, rows, lengths), view_from_page_table for block-table caches
  paged_kv.py    jspec's KV backend: paged allocator, req_to_token rows, pools (PagedKVState)
  attention.py   the attention seam: AttentionBackend (write K/V, read one AttentionMetadata
                 pass), jspec's PagedAttentionBackend, AttnPlan, the LSE merge
  memory.py      KV pool sizing from device memory (mem_fraction_static), step workspace
  model_calls.py the engine's only calls into a model (protocol methods, named scopes)
  state.py       EngineConfig, EngineState (the KV state + SpecCarry, the per-slot carry)
  step_types.py  the typed values passed between step phases, and the steps' outputs
  lifecycle.py   chunked prefill (admission) and release of requests
  rounds.py      several decode rounds per dispatch (a device-side loop, EOS / budget on device)
  greedy.py      plain greedy decode step (the lossless baseline; with a draft, the draft kept
                 current: a spec engine's plain step, adaptive speculation)
  spec_step.py   the jitted EAGLE tree speculative decode step, as phases
  draft_phases.py  the step's draft side: draft attention passes, draft loop, draft extend
  inputs.py      host-side validation of requests (before any compile)
  guards.py      traced input guards of the public steps (slots, token ids; ok=False + probes)
  sampling_params.py  SamplingParams: per-request temperature / top-k / top-p / min-p / seed
  sampling.py    SamplingBatch and the steps' sampled branches (exact, reproducible)
  scheduler.py   Engine: continuous batching host loop, leak checks
  sharding.py    data / tensor parallel shards with shard_map
  reference.py   dense no-cache greedy oracle (over any TargetModel)

Models live above the engine: :mod:`jspec.models` (Llama targets, EAGLE-1 / EAGLE-3 heads,
the toy init, checkpoint loading); ``jspec demo`` is :mod:`jspec.apps.demo`.

The way in, one shard, your own loop::

    ecfg = make_engine_config(target, page_size=16, topk=4, num_steps=3, ...)
    runner = Runner(ecfg, target, draft)            # static; kv=YourKVBackend() to bring yours
    weights = Weights(target_params, draft_params)
    state = init_engine_state(runner)
    state, out = prefill(runner, weights, state, slot_idx, ids, lens)
    # (or prefill_chunk(..., token_ids, chunk_lens, starts, is_last, next_ids) chunk by chunk)
    state, out = spec_decode_step(runner, weights, state, slot_idx, live)
    # or up to max_rounds steps in one dispatch, entries stopped on the device at a stop id
    # or their budget (a serving loop's way: no host round trip a step):
    state, rounds = decode_rounds(spec_decode_step, runner, weights, state, slot_idx, live,
                                  budget, eos_ids, num_rounds)
    state = release(runner, state, slot_idx, finished)  # return_ok=True: (state, ok)

or the continuous-batching loop: ``Engine(ecfg, target, tparams, draft, dparams).generate(...)``,
sampled per request with ``generate(..., sampling=SamplingParams(temperature=0.8, top_p=0.9,
seed=1))`` (the step functions take the batch's ``SamplingBatch`` as ``sampling=``).
examples/own_kv_cache.py drives the spec step over a block-table KV cache of its own.
"""

from __future__ import annotations

from jspec.engine.attention import AttentionBackend, AttnPlan, PagedAttentionBackend
from jspec.engine.greedy import greedy_step
from jspec.engine.inputs import InputError, validate_requests
from jspec.engine.kv_backend import KVBackend, KVView, view_from_page_table
from jspec.engine.lifecycle import prefill, prefill_chunk, release
from jspec.engine.memory import kv_bytes_per_token, num_pages_for_memory
from jspec.engine.paged_kv import PagedKVBackend, PagedKVState
from jspec.engine.protocol import AttnFn, DraftModel, TargetModel
from jspec.engine.rounds import RoundsOutput, decode_rounds
from jspec.engine.runner import Runner, Weights, init_engine_state
from jspec.engine.sampling import SamplingBatch
from jspec.engine.sampling_params import SamplingParams
from jspec.engine.scheduler import Engine, Request, RunStats, SpecPolicy
from jspec.engine.spec_step import spec_decode_step
from jspec.engine.state import EngineConfig, EngineState, SpecCarry, make_engine_config
from jspec.engine.step_types import GreedyStepOutput, PrefillOutput, SpecStepOutput
from jspec.kernels.policy import CHOICES as KERNEL_CHOICES
from jspec.kernels.policy import KernelPolicy, resolve_kernel_policy

__all__ = [
    "AttentionBackend",
    "AttnFn",
    "AttnPlan",
    "DraftModel",
    "Engine",
    "EngineConfig",
    "EngineState",
    "GreedyStepOutput",
    "InputError",
    "KERNEL_CHOICES",
    "KVBackend",
    "KVView",
    "KernelPolicy",
    "PagedAttentionBackend",
    "PagedKVBackend",
    "PagedKVState",
    "PrefillOutput",
    "Request",
    "RoundsOutput",
    "RunStats",
    "Runner",
    "SamplingBatch",
    "SamplingParams",
    "SpecCarry",
    "SpecPolicy",
    "SpecStepOutput",
    "TargetModel",
    "Weights",
    "decode_rounds",
    "greedy_step",
    "init_engine_state",
    "kv_bytes_per_token",
    "make_engine_config",
    "num_pages_for_memory",
    "prefill",
    "prefill_chunk",
    "release",
    "resolve_kernel_policy",
    "spec_decode_step",
    "validate_requests",
    "view_from_page_table",
]
