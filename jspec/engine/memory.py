"""Sizing the KV pools from device memory (sglang ``--mem-fraction-static``).

sglang gives the KV pool what is left of a fraction of device memory once the weights are
loaded::

    kv_bytes  = free_after_weights - device_memory * (1 - mem_fraction_static)
    num_pages = kv_bytes // (page_size * bytes of K and V per token, target + draft pools)

so ``device_memory * (1 - mem_fraction_static)`` stays free for a step's workspace
(activations, logits, the attention partials). jspec reads the device's memory from JAX
(``Device.memory_stats()``: ``bytes_limit``, the memory JAX may use, and ``bytes_in_use``, the
weights already placed) and checks the reserve against the step's measured workspace
(:func:`compiled_workspace_bytes`, XLA's buffer assignment of a compiled step: temporaries only,
the donated state is updated in place). A step's workspace must not grow with the pool: the
pools are donated and every per-step array is sized by the batch and the chunk, never by the
pool (tests/engine/test_engine_serving.py measures it at two pool sizes). The engine's compiles
turn XLA's rematerialization off (``jspec.engine.runner.ENGINE_COMPILER_OPTIONS``): its budget,
device memory minus a program's arguments, is below zero beside pools sized this way, and it
recomputed parts of every step instead.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jspec.engine.protocol import DTYPES


def kv_bytes_per_token(target: Any, draft: Any = None) -> int:
    """Bytes of K and V one token takes in the target pool (+ the draft pool, if any).

    ``target`` / ``draft``: anything with ``num_layers``, ``num_kv_heads``, ``head_dim`` and
    ``dtype`` (a model, a ``LlamaConfig`` or a ``SpecConfig``).
    """
    total = 0
    for model in (target, draft):
        if model is None:
            continue
        item = jnp.dtype(DTYPES[model.dtype]).itemsize
        total += 2 * model.num_layers * model.num_kv_heads * model.head_dim * item
    return total


def device_memory(device: Any = None) -> tuple[int, int]:
    """``(bytes JAX may use on the device, bytes in use now)`` from ``memory_stats()``.

    Raises:
      ValueError: the backend reports no memory statistics (CPU): give ``num_pages``.
    """
    device = jax.local_devices()[0] if device is None else device
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        raise ValueError(
            f"mem_fraction_static: device {device} reports no memory statistics "
            "(memory_stats()); give num_pages instead"
        )
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def num_pages_for_memory(
    target: Any,
    draft: Any,
    *,
    page_size: int,
    mem_fraction_static: float,
    tensor_parallel: int = 1,
    memory: tuple[int, int] | None = None,
    workspace_bytes: int = 0,
) -> int:
    """Pages the pools get from device memory (module docstring).

    Args:
      target, draft: pool geometries (draft None: a greedy engine).
      page_size: tokens per page.
      mem_fraction_static: in (0, 1): weights + pools take at most this fraction.
      tensor_parallel: devices sharing a shard's KV heads (each holds ``1 / tp`` of a page).
      memory: ``(limit, in_use)`` bytes of one device (default: :func:`device_memory`, read
        after the weights were placed).
      workspace_bytes: a measured step workspace; the reserve ``limit * (1 - fraction)`` must
        cover it.

    Raises:
      ValueError naming the numbers when the reserve is smaller than the workspace or nothing
      is left for a single page.
    """
    if not (isinstance(mem_fraction_static, float) and 0.0 < mem_fraction_static < 1.0):
        raise ValueError(f"mem_fraction_static={mem_fraction_static!r} must be a float in (0, 1)")
    limit, in_use = device_memory() if memory is None else memory
    reserve = int(limit * (1.0 - mem_fraction_static))
    if workspace_bytes > reserve:
        raise ValueError(
            f"mem_fraction_static={mem_fraction_static}: the reserve {reserve / 2**30:.2f} GiB "
            f"is smaller than the step workspace {workspace_bytes / 2**30:.2f} GiB; lower it"
        )
    per_page = kv_bytes_per_token(target, draft) * page_size // tensor_parallel
    pages = (limit - in_use - reserve) // per_page - 1  # page 0 is the padding page
    if pages < 1:
        raise ValueError(
            f"mem_fraction_static={mem_fraction_static}: {limit / 2**30:.2f} GiB device memory, "
            f"{in_use / 2**30:.2f} GiB in use, {reserve / 2**30:.2f} GiB reserved: no room for "
            f"one KV page of {per_page} bytes"
        )
    return int(pages)


def compiled_workspace_bytes(compiled: Any) -> int:
    """Temporary bytes of a compiled step (XLA's buffer assignment): what it needs beside its
    arguments and outputs (0 when the backend does not report it)."""
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - backends without the analysis
        return 0
    return int(getattr(analysis, "temp_size_in_bytes", 0) or 0)
