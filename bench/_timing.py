"""Shared timing helpers for bench/ scripts (shared/ANCHORS.md: device time, not dispatch).

* :func:`time_device`: on GPU, the summed kernel time per call from a JAX profiler trace
  (:func:`kernel_time_us`: what the op occupies the GPU, no launch gaps, no dispatch). On CPU,
  R calls inside one jitted, unrolled ``lax.scan`` over R *distinct* input sets, divided by R
  (each iteration folds the outputs into a checksum so nothing is dead-code eliminated).
* :func:`time_wall` is the standalone jitted call's wall time (dispatch included), median.
* :func:`time_torch` times a torch callable with CUDA events (or wall time on CPU).
* :func:`copy_bandwidth_tbs` measures the device-to-device copy rate (bytes read + written).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _checksum(tree: Any) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype")]
    total = jnp.zeros((), jnp.float32)
    for x in leaves:
        total = total + jnp.sum(x.astype(jnp.float32))
    return total


def profile_kernel_us(thunk: Callable[[], Any], num_calls: int) -> float | None:
    """Summed GPU kernel time (microseconds) of running ``thunk()`` once, divided by num_calls.

    Reads a JAX profiler trace: the durations of every event on the GPU stream lines (kernels
    and device copies) are summed. Launch gaps and Python dispatch are excluded: this is the
    time the work occupies the GPU. Returns None when the trace has no GPU events (CPU).
    """
    import glob
    import tempfile

    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            jax.block_until_ready(thunk())
        paths = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        if not paths:
            return None
        data = ProfileData.from_file(paths[0])
    total_ns, found = 0.0, False
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for event in line.events:
                found = True
                total_ns += event.duration_ns
    return total_ns / num_calls / 1e3 if found else None


def kernel_time_us(fn: Callable[..., Any], arg_sets: Sequence[tuple]) -> float | None:
    """Summed GPU kernel time per call of jitted ``fn``, one call per arg set (after warm-up)."""
    for args in arg_sets[:2]:
        jax.block_until_ready(fn(*args))

    def thunk():
        return [fn(*args) for args in arg_sets]

    return profile_kernel_us(thunk, len(arg_sets))


def time_device(op: Callable[..., Any], arg_sets: Sequence[tuple], *, repeats: int = 3) -> float:
    """Microseconds of device time per call of ``op``.

    On GPU: the summed kernel time of the jitted op from a profiler trace
    (:func:`kernel_time_us`), over R distinct arg sets. Elsewhere (or if the trace has no GPU
    events): R calls in one jitted, unrolled scan, divided by R, each iteration folding the
    outputs into a checksum (adds one read of the outputs).

    Args:
      op: a jax-traceable function of the arrays in one arg set (static args closed over).
      arg_sets: R distinct tuples of arrays with identical shapes/dtypes.
    """
    if jax.default_backend() == "gpu":
        try:
            us = kernel_time_us(jax.jit(op), arg_sets)
        except Exception:  # noqa: BLE001 - profiler unavailable: fall back to the scan
            us = None
        if us is not None:
            return us
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *arg_sets)
    num = len(arg_sets)

    @jax.jit
    def run(stacked_args):
        def body(carry, args):
            return carry + _checksum(op(*args)), None

        # NOTE: unrolled. A rolled while loop on GPU syncs its predicate with the host every
        # iteration (~15-20 us), which would swamp microsecond ops.
        out, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), stacked_args, unroll=True)
        return out

    jax.block_until_ready(run(stacked))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(stacked))
        best = min(best, time.perf_counter() - t0)
    return best / num * 1e6


def time_wall(fn: Callable[..., Any], *args: Any, iters: int = 30, warmup: int = 3) -> float:
    """Median microseconds of one jitted call, ``block_until_ready`` after each."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def time_torch(fn: Callable[[], Any], *, iters: int = 50, warmup: int = 5) -> float:
    """Median microseconds of a torch callable (CUDA events on GPU, wall time on CPU)."""
    import torch

    for _ in range(warmup):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        samples = []
        for _ in range(iters):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        return statistics.median(samples)
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def copy_bandwidth_tbs(num_bytes: int = 1 << 30) -> float:
    """Device streaming copy rate in TB/s, counting bytes read + written.

    An in-place ``x + 1`` over a donated f32 buffer, 8 passes per call with an optimization
    barrier between them so XLA cannot fuse the passes (a fresh-output uint8 ``x + 1`` reads
    only ~1.2 TB/s on the H200: allocation and launch dominate).
    """
    n = num_bytes if jax.default_backend() == "gpu" else min(num_bytes, 1 << 24)
    passes = 8
    x = jnp.zeros((n // 4,), jnp.float32)

    @functools.partial(jax.jit, donate_argnums=0)
    def run(a):
        return jax.lax.fori_loop(0, passes, lambda _, y: jax.lax.optimization_barrier(y + 1.0),
                                 a, unroll=True)

    x = jax.block_until_ready(run(x))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        x = jax.block_until_ready(run(x))
        best = min(best, time.perf_counter() - t0)
    return 2 * n * passes / best / 1e12


def format_table(rows: list[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A markdown table of ``rows`` (floats printed with 1 decimal)."""
    if not rows:
        return "(no rows)"
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))  # union, first-seen order
    columns = list(columns)

    def fmt(v: Any) -> str:
        if isinstance(v, float | np.floating):
            return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def device_name() -> str:
    dev = jax.devices()[0]
    return f"{dev.platform}:{getattr(dev, 'device_kind', '')}"
