"""Shared timing helpers for bench/ scripts (shared/ANCHORS.md: device time, not dispatch).

* :func:`time_device` runs the op R times inside one jitted, unrolled ``lax.scan`` over R *distinct*
  input sets (so XLA cannot hoist the op out of the loop) and divides. Each iteration folds
  every output into a scalar checksum so nothing is dead-code eliminated; that adds one read
  of the outputs per iteration (small next to the op, and stated in the tables).
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


def time_device(op: Callable[..., Any], arg_sets: Sequence[tuple], *, repeats: int = 3) -> float:
    """Microseconds per call of ``op`` on device: R calls in one jitted scan, divided by R.

    Args:
      op: a jax-traceable function of the arrays in one arg set (static args closed over).
      arg_sets: R distinct tuples of arrays with identical shapes/dtypes.
    """
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
