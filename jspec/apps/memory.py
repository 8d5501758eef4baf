"""How much device memory a run needs, estimated from the configs before a weight is read or a
pool allocated, and the refusal (one line, with the numbers) when it cannot fit.

Per device (a data-parallel shard's ``tensor_parallel`` devices split heads and MLP)::

    weights    the checkpoint's tensors in the model dtype (from the headers, or the params
               already built), / tensor_parallel (a lower bound: embeddings are replicated)
    kv_pools   target + draft pools: 2 (K, V) x layers x num_slots x kv_heads / tp x head_dim x
               itemsize; num_slots = (num_pages + 1) x page_size, num_pages sized so that
               max_running_requests requests at full context never run out (make_engine_config)
    bookkeep   req_to_token rows (i32[M + 1, context_len + reserve]) and the allocator
    workspace  the largest transients of one step, roughly: f32 logits of the verify / prefill
               tokens (target and draft vocabularies), f32 activations of the widest forward,
               and with the XLA attention (the default off the GPU) the gathered K / V rows and
               f32 scores of its largest pass (the fused kernels stream them instead)

The estimate is what jspec allocates plus a rough transient term, not XLA's exact peak: it is
there to refuse what cannot fit (a 1M-token page, a context sized for 10**8 new tokens) with the
numbers, before minutes of loading and compiling end in an allocator abort.

The limit: on GPU, the first device's ``memory_stats()`` (``bytes_limit - bytes_in_use``); on
CPU, the host memory the OS reports available (``MemAvailable`` of ``/proc/meminfo``, else
``sysconf``), shared by every host device.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device needs (see the module docstring)."""

    weights: int
    kv_pools: int
    bookkeeping: int
    workspace: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_pools + self.bookkeeping + self.workspace

    def describe(self) -> str:
        parts = (
            ("weights", self.weights),
            ("KV pools", self.kv_pools),
            ("bookkeeping", self.bookkeeping),
            ("workspace", self.workspace),
        )
        return " + ".join(f"{name} {_gib(n)}" for name, n in parts) + f" = {_gib(self.total)}"


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB // 100 else f"{n / (1 << 20):.2f} MiB"


def _itemsize(dtype: str) -> int:
    return 4 if dtype == "float32" else 2  # float32 | bfloat16 | float16


def _pool_bytes(spec: Any, layers: int, kv_heads: int, head_dim: int, dtype: str, tp: int) -> int:
    return 2 * layers * spec.num_slots * max(kv_heads // tp, 1) * head_dim * _itemsize(dtype)


def estimate_memory(
    ecfg: Any, target: Any, draft: Any = None, *, weight_bytes: int
) -> MemoryEstimate:
    """Bytes per device of a run of ``ecfg`` over ``target`` (and ``draft``).

    Args:
      ecfg: the ``EngineConfig``.
      target, draft: protocol models (geometry only: ``num_layers``, ``num_kv_heads``,
        ``head_dim``, ``hidden_size``, ``vocab_size``, ``dtype``; ``num_heads`` and
        ``config.intermediate_size`` when present).
      weight_bytes: both models' weights in all (bytes).
    """
    spec, tp = ecfg.spec, ecfg.tensor_parallel
    pools = _pool_bytes(
        spec, target.num_layers, target.num_kv_heads, target.head_dim, target.dtype, tp
    )
    if draft is not None:
        pools += _pool_bytes(
            spec, draft.num_layers, draft.num_kv_heads, draft.head_dim, draft.dtype, tp
        )
    bookkeeping = 4 * (spec.num_req_rows * spec.req_to_token_width + 3 * spec.num_pages)
    max_bs = max(ecfg.batch_buckets)
    n, k, lp = spec.num_draft_tokens, spec.topk, ecfg.max_prompt_len
    spec_run = draft is not None
    step_tokens = max_bs * n if spec_run else max_bs
    tokens = max(ecfg.prefill_batch * lp, step_tokens)
    logits = 4 * max(ecfg.prefill_batch, step_tokens) * target.vocab_size
    if spec_run:
        logits += 4 * max_bs * n * draft.vocab_size
    attention = 0
    if ecfg.attention_backend is None and ecfg.kernels.attention == "xla":
        # (rows, queries per row, keys per row) of each pass: prefill over the prompt, the
        # verify / greedy decode rows over the context row, the draft's B*K branch rows.
        width = spec.req_to_token_width
        passes = [(ecfg.prefill_batch, lp, lp), (max_bs, n if spec_run else 1, width)]
        if spec_run:
            passes.append((max_bs * k, 1, width))
        heads = max(getattr(target, "num_heads", target.num_kv_heads) // tp, 1)
        kv_heads = max(target.num_kv_heads // tp, 1)
        attention = max(
            4 * rows * heads * queries * keys  # f32 scores
            + 2 * rows * keys * kv_heads * target.head_dim * _itemsize(target.dtype)  # K, V
            for rows, queries, keys in passes
        )
    inter = getattr(getattr(target, "config", None), "intermediate_size", 4 * target.hidden_size)
    activations = 4 * tokens * (3 * inter // tp + 6 * target.hidden_size)
    return MemoryEstimate(
        weights=weight_bytes // tp,
        kv_pools=pools,
        bookkeeping=bookkeeping,
        workspace=logits + attention + activations,
    )


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def available_memory() -> tuple[int | None, str, bool]:
    """``(bytes, where, shared)``: free memory of the first JAX device on GPU / TPU, else of the
    host; ``shared`` when every device draws from it (CPU host devices); bytes None if
    unknown."""
    import jax

    device = jax.local_devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
            return free, f"{device.platform}:{device.id} ({device.device_kind})", False
        return None, str(device), False
    return _host_available(), "the host (MemAvailable)", True


def check_memory(
    estimate: MemoryEstimate, *, num_devices: int, limit: tuple[int | None, str, bool] | None = None
) -> None:
    """``InputError`` with the numbers when ``estimate`` (per device, ``num_devices`` devices)
    exceeds ``limit`` (default :func:`available_memory`); nothing when the limit is unknown."""
    from jspec.engine.inputs import InputError

    free, where, shared = available_memory() if limit is None else limit
    if free is None:
        return
    need = estimate.total * (num_devices if shared else 1)
    if need > free:
        per = f" per device x {num_devices} devices" if shared and num_devices > 1 else ""
        raise InputError(
            f"this run needs about {_gib(need)} ({estimate.describe()}{per}), more than the "
            f"{_gib(free)} free on {where}: lower --max-new-tokens / --max-running / "
            "--page-size / --draft-tokens, or use a smaller model"
        )
