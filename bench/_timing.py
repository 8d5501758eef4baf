# Over 400 lines: the one timing toolkit every bench shares (device time, wall, profiler split,
# floors, table format); splitting it would scatter one measuring method.
"""Shared timing helpers for bench/ scripts (shared/ANCHORS.md: device time, not dispatch).

* :func:`time_device`: on GPU, the summed kernel time per call from a JAX profiler trace
  (:func:`kernel_time_us`: what the op occupies the GPU, no launch gaps, no dispatch). On CPU,
  R calls inside one jitted, unrolled ``lax.scan`` over R *distinct* input sets, divided by R
  (each iteration folds the outputs into a checksum so nothing is dead-code eliminated).
* :func:`profile_split_us`: the GPU kernel time per call of a jitted function split by class
  of the HLO ops behind each kernel (``classify(op_name)``, e.g. by ``jax.named_scope``).
* :func:`time_wall` is the standalone jitted call's wall time (dispatch included), median.
* :func:`time_torch` times a torch callable with CUDA events (or wall time on CPU).
* :func:`copy_bandwidth_tbs` measures the device-to-device copy rate (bytes read + written).
"""

from __future__ import annotations

import functools
import re
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


# One event on a GPU stream line of a profiler trace: (event name = kernel name, the "hlo_op"
# stat or "" when absent, duration in nanoseconds).
StreamEvent = tuple[str, str, float]

UNATTRIBUTED = "unattributed"
# Class-name suffix of kernels whose fusion also holds ops of another class (attribute_events).
MIXED_SUFFIX = " (mixed)"

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s")
_OP_NAME = re.compile(r'\bop_name="([^"]*)"')
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s+\(")
_CALLS = re.compile(r"\bcalls=%([\w.\-]+)")
_OPCODE = re.compile(r"\s([a-z][\w\-]*)\(")
# Opcodes whose op_name says little about whose work a fusion does: XLA CSEs constants and
# their broadcasts across scopes, and parameters / bitcasts / iotas move no data of their own.
_PLUMBING = frozenset({"parameter", "constant", "broadcast", "iota", "bitcast"})


def trace_profile(thunk: Callable[[], Any], read: Callable[[Any], Any]) -> Any:
    """Run ``thunk()`` once under the JAX profiler (its outputs waited for) and return
    ``read(data)`` of the trace's ``jax.profiler.ProfileData`` (read while the trace exists),
    or None when no trace was written."""
    import glob
    import tempfile

    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            jax.block_until_ready(thunk())
        paths = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        return read(ProfileData.from_file(paths[0])) if paths else None


def trace_gpu_planes(thunk: Callable[[], Any]) -> dict[str, list[StreamEvent]] | None:
    """Run ``thunk()`` once under the JAX profiler; the events on its GPU stream lines, per GPU.

    ``{plane name ("/device:GPU:0", ...): events}``: every event on a ``/device:GPU*`` plane, line
    named ``Stream*`` (kernels and device copies), as ``(name, hlo_op, duration_ns)``. None when
    the trace has no GPU events (CPU).
    """

    def read(data) -> dict[str, list[StreamEvent]]:
        planes: dict[str, list[StreamEvent]] = {}
        for plane in data.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            events = planes.setdefault(plane.name, [])
            for line in plane.lines:
                if not line.name.startswith("Stream"):
                    continue
                for event in line.events:
                    hlo_op = dict(event.stats).get("hlo_op", "")
                    events.append((event.name, str(hlo_op), float(event.duration_ns)))
        return {name: events for name, events in planes.items() if events}

    return trace_profile(thunk, read) or None


def trace_gpu_events(thunk: Callable[[], Any]) -> list[StreamEvent] | None:
    """:func:`trace_gpu_planes`' events of every GPU in one list (None on CPU)."""
    planes = trace_gpu_planes(thunk)
    return None if planes is None else [e for events in planes.values() for e in events]


def profile_kernel_us(thunk: Callable[[], Any], num_calls: int) -> float | None:
    """Summed GPU kernel time (microseconds) of running ``thunk()`` once, divided by num_calls.

    Reads a JAX profiler trace: the durations of every event on the GPU stream lines (kernels
    and device copies) are summed. Launch gaps and Python dispatch are excluded: this is the
    time the work occupies the GPU. Returns None when the trace has no GPU events (CPU).
    """
    events = trace_gpu_events(thunk)
    if events is None:
        return None
    return sum(dur for _, _, dur in events) / num_calls / 1e3


def hlo_op_names(hlo_text: str) -> dict[str, str]:
    """Instruction name -> its ``op_name`` metadata ("" when it has none), every computation.

    ``hlo_text`` is optimized HLO (``jitted.lower(*args).compile().as_text()``), where each
    instruction line reads ``[ROOT ]%name = shape op(...), ..., metadata={op_name="..." ...}``.
    A fusion's op_name is its root's (a fusion can hold ops of other scopes).
    """
    names: dict[str, str] = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        op_name = _OP_NAME.search(line)
        names[match.group(1)] = op_name.group(1) if op_name else ""
    return names


def hlo_fused_op_names(hlo_text: str) -> dict[str, frozenset[str]]:
    """Instruction name -> op_names of the ops inside the computations it ``calls=``.

    For fusions (and custom fusions such as Triton gemms): every op_name found in the fused
    computation, nested fusions included, skipping parameters, constants, broadcasts, iotas
    and bitcasts (their metadata is often another scope's after CSE). Instructions that call
    nothing are absent.
    """
    ops: dict[str, set[str]] = {}
    callees: dict[str, set[str]] = {}
    calls: dict[str, str] = {}
    current = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header is not None:
            current = header.group(1)
            ops[current], callees[current] = set(), set()
            continue
        match = _INSTRUCTION.match(line)
        if match is None or current is None:
            continue
        called = _CALLS.search(line)
        if called is not None:
            calls[match.group(1)] = called.group(1)
            callees[current].add(called.group(1))
        opcode = _OPCODE.search(line, match.end() - 1)
        op_name = _OP_NAME.search(line)
        if op_name and op_name.group(1) and not (opcode and opcode.group(1) in _PLUMBING):
            ops[current].add(op_name.group(1))

    @functools.cache
    def inside(computation: str) -> frozenset[str]:
        nested = (inside(c) for c in callees.get(computation, ()) if c in ops)
        return frozenset(ops.get(computation, set())).union(*nested)

    return {name: inside(computation) for name, computation in calls.items()}


def _sanitize(name: str) -> str:
    """An HLO instruction name as its GPU kernel is named ('.' and '-' become '_')."""
    return re.sub(r"[.\-]", "_", name)


def event_instruction(
    name: str, hlo_op: str, op_names: dict[str, str], by_kernel: dict[str, str]
) -> str | None:
    """The HLO instruction behind one stream event (:func:`attribute_events`' rule), or None.

    ``by_kernel``: sanitized instruction name -> instruction (``_sanitize``)."""
    if hlo_op in op_names and not hlo_op.startswith("command_buffer"):
        return hlo_op
    instruction = by_kernel.get(name)
    if instruction is None:
        base, sep, suffix = name.rpartition("_")
        if sep and suffix.isdigit():
            instruction = by_kernel.get(base)
    return instruction


def attribute_events(
    events: Sequence[StreamEvent],
    op_names: dict[str, str],
    classify: Callable[[str], str],
    fused_op_names: dict[str, frozenset[str]] | None = None,
) -> dict[str, float]:
    """Summed duration (nanoseconds) of GPU stream events per class.

    Each event's HLO instruction is, in order: its ``hlo_op`` stat when that is an instruction
    of ``op_names`` other than a command buffer (exact; XLA's command buffers off); else its
    name matched to the sanitized instruction names (with command buffers on, ``hlo_op`` is the
    buffer, the event name the kernel's); else, the name with one trailing ``_<n>`` dropped (an
    instruction emitted as several kernels). Its class is ``classify(op_names[instruction])``,
    the class of the fusion's root op; events with no instruction (cuBLAS / Triton kernels
    inside a command buffer, memcpys) go to :data:`UNATTRIBUTED`. With ``fused_op_names``
    (:func:`hlo_fused_op_names`), a fusion that also holds ops of another class goes to
    ``class + MIXED_SUFFIX`` (e.g. ``"model (mixed)"``) instead.
    """
    by_kernel = {_sanitize(name): name for name in op_names}
    totals: dict[str, float] = {}
    for name, hlo_op, dur_ns in events:
        instruction = event_instruction(name, hlo_op, op_names, by_kernel)
        if instruction is None:
            cls = UNATTRIBUTED
        else:
            # No op_name metadata (XLA-made copies, ...): classify the instruction's name.
            cls = classify(op_names[instruction] or "@" + instruction)
            fused = (fused_op_names or {}).get(instruction, ())
            if any(classify(op) != cls for op in fused):
                cls += MIXED_SUFFIX
        totals[cls] = totals.get(cls, 0.0) + dur_ns
    return totals


def profile_split_us(
    fn: Any,
    make_args: Callable[[], tuple],
    classify: Callable[[str], str],
    *,
    num_calls: int = 5,
    warmup: int = 2,
    breakdown: Callable[[str], str] | None = None,
    compiler_options: dict[str, Any] | None = None,
) -> dict[str, float] | None:
    """Device time (microseconds) per call of jitted ``fn``, split by class of HLO op.

    ``fn`` is compiled once (``fn.lower(*args).compile()``); that executable runs ``warmup``
    times (at least once), then ``num_calls`` times under the profiler, and its kernels are
    attributed to HLO instructions of the same executable (:func:`attribute_events`), classed
    by ``classify(op_name) -> str`` of the root op, ``+ MIXED_SUFFIX`` where XLA fused ops of
    another class into the kernel.

    Args:
      fn: a ``jax.jit``-ed function without static arguments.
      make_args: returns one fresh argument tuple per call (donated inputs: fresh copies). The
        profiled calls' tuples are all made, and made ready, before the trace starts.
      classify: op_name metadata (``"@" + instruction name`` when absent) -> class name.
      breakdown: optional second, finer classifier of the same events (e.g. op_name -> the
        bookkeeping op it belongs to); its us per call land under ``"by:" + key``.
      compiler_options: XLA options for this compile only (e.g.
        ``{"xla_gpu_enable_command_buffer": ""}``: no CUDA graphs, every kernel attributed).
    Returns:
      ``{class: us per call}`` (classes as above, ``"unattributed"`` for kernels not matched to
      an instruction; they partition the kernels) and ``"total"`` for all (equal to
      :func:`profile_kernel_us` of the same calls); None when the trace has no GPU events
      (CPU).
    """
    args = make_args()
    compiled = fn.lower(*args).compile(compiler_options)
    hlo_text = compiled.as_text()
    op_names, fused_op_names = hlo_op_names(hlo_text), hlo_fused_op_names(hlo_text)
    jax.block_until_ready(compiled(*args))
    for _ in range(warmup - 1):  # the first warm-up call is the one above
        jax.block_until_ready(compiled(*make_args()))
    arg_sets = [jax.block_until_ready(make_args()) for _ in range(num_calls)]

    def thunk():
        return [compiled(*a) for a in arg_sets]

    events = trace_gpu_events(thunk)
    if events is None:
        return None
    split = {
        cls: ns / num_calls / 1e3
        for cls, ns in attribute_events(events, op_names, classify, fused_op_names).items()
    }
    split["total"] = sum(split.values())
    if breakdown is not None:
        for key, ns in attribute_events(events, op_names, breakdown).items():
            split["by:" + key] = ns / num_calls / 1e3
    return split


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


def _matmul_chain(n: int, chain: int) -> Callable[[], Any]:
    """A warmed-up thunk running ``chain`` n x n x n bf16 products back to back in one jitted
    call (each feeds the next, its left factor scaled by 1/sqrt(n) so the values stay finite:
    nothing to hoist or fuse), blocking until they are done."""
    a = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16) * (n**-0.5)
    b = jax.random.normal(jax.random.PRNGKey(2), (n, n), jnp.bfloat16)
    run = jax.jit(lambda x, y: jax.lax.fori_loop(0, chain, lambda _, z: x @ z, y))
    jax.block_until_ready(run(a, b))
    return lambda: jax.block_until_ready(run(a, b))


def matmul_tflops(n: int = 8192, chain: int = 8, trials: int = 5) -> float:
    """Device bf16 matmul rate in TFLOP/s: a chain of ``chain`` products
    (:func:`_matmul_chain`), the best of ``trials`` after a warm-up, as
    :func:`copy_bandwidth_tbs` takes its best (a floor is what the device can do). A single
    product timed from the host read 572-676 TFLOP/s on one H200 across calls, 589 and 663 in
    one. Off GPU a toy size."""
    if jax.default_backend() != "gpu":
        n = 256
    run = _matmul_chain(n, chain)
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 * chain / best / 1e12


def matmul_tflops_sustained(seconds: float = 4.0, n: int = 8192, chain: int = 64) -> float:
    """The bf16 matmul rate a long compute-bound run holds: a chain of 64 products a call
    (~0.1 s on the H200) called back to back for ``seconds``, the mean rate of the calls in
    the second half. On the H200 the SM clock falls from 1.98 to ~1.6 GHz under its 700 W
    power cap within the first call: 643 TFLOP/s sustained against 721 for
    :func:`matmul_tflops` (bench/RESULTS.md, nineteenth session). A long prefill runs at this
    rate; floors use the burst one. Off GPU a toy size, at most one second."""
    if jax.default_backend() != "gpu":
        n, chain, seconds = 256, 8, min(seconds, 1.0)
    run = _matmul_chain(n, chain)
    start, calls = time.perf_counter(), []  # (start offset, duration) per call
    while (t0 := time.perf_counter()) - start < seconds:
        run()
        calls.append((t0 - start, time.perf_counter() - t0))
    late = [dt for at, dt in calls if at >= seconds / 2] or [dt for _, dt in calls]
    return 2 * n**3 * chain / (sum(late) / len(late)) / 1e12


COPY_REPEATS = 10  # timed calls of copy_bandwidth_tbs (its best is the floor's rate)


def copy_bandwidth_tbs(num_bytes: int = 1 << 30) -> float:
    """Device streaming copy rate in TB/s, counting bytes read + written: the best of
    ``COPY_REPEATS`` timed calls after three untimed ones (best of 3 with one warm-up read 3.81 and
    3.94 TB/s in two runs minutes apart on one H200, 2026-11-27: a 3% swing of every floor).

    An in-place ``x + 1`` over a donated f32 buffer, 8 passes per call with an optimization
    barrier between them so XLA cannot fuse the passes (a fresh-output uint8 ``x + 1`` reads
    only ~1.2 TB/s on the H200: allocation and launch dominate).
    """
    n = num_bytes if jax.default_backend() == "gpu" else min(num_bytes, 1 << 24)
    passes = 8
    x = jnp.zeros((n // 4,), jnp.float32)

    @functools.partial(jax.jit, donate_argnums=0)
    def run(a):
        return jax.lax.fori_loop(
            0, passes, lambda _, y: jax.lax.optimization_barrier(y + 1.0), a, unroll=True
        )

    for _ in range(3):  # compile, then let the clocks settle
        x = jax.block_until_ready(run(x))
    best = float("inf")
    for _ in range(COPY_REPEATS):
        t0 = time.perf_counter()
        x = jax.block_until_ready(run(x))
        best = min(best, time.perf_counter() - t0)
    return 2 * n * passes / best / 1e12


def error_cell(max_len: int = 160) -> str:
    """The exception being handled, as one short table cell: its last traceback line."""
    import traceback

    return traceback.format_exc(limit=1).strip().splitlines()[-1][:max_len]


def torch_us_cell(fn: Callable[[], float]) -> float | str:
    """``fn()`` (the PyTorch timing of a bench row), or its error as a short cell."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - report and continue
        return f"error: {type(exc).__name__}"


def time_impl(
    row: dict[str, Any],
    op: Callable[..., Any],
    arg_sets: Sequence[tuple],
    *,
    wall_iters: int,
    check: Callable[[Callable[..., Any]], None] | None = None,
    extra: Callable[[float], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One impl x shape row of a kernel bench (the loop body every bench shared).

    Runs ``check(op)`` first (a correctness check that may add columns), then fills
    ``device us`` (:func:`time_device`), the ``extra(us)`` columns and ``wall us``
    (:func:`time_wall` of ``jax.jit(op)``). An exception becomes ``row["error"]``: one failing
    impl must not hide the others. Returns ``row``.
    """
    try:
        if check is not None:
            check(op)
        us = time_device(op, arg_sets)
        row["device us"] = us
        row.update(extra(us) if extra is not None else {})
        row["wall us"] = time_wall(jax.jit(op), *arg_sets[0], iters=wall_iters)
    except Exception:  # noqa: BLE001 - one failing impl must not hide the others
        row["error"] = error_cell()
    return row


def batch_sizes(arg: str, quick: bool, full: Sequence[int] = (1, 8, 64, 256)) -> list[int]:
    """``--bs`` as ints, else ``[1, 8]`` (quick) or ``full``."""
    return [int(b) for b in arg.split(",") if b] or ([1, 8] if quick else list(full))


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


def print_and_write(text: str, out: str) -> None:
    """A bench's report: printed, and written to ``out`` (its ``--out``) when given."""
    print(text, flush=True)
    if out:
        with open(out, "w") as f:
            f.write(text)


def write_with_json(path: str, text: str, payload: Any) -> None:
    """A bench's ``--out``: ``text`` to ``path`` and ``payload`` as JSON beside it, at
    ``path + ".json"`` (the rows, for drawing or comparing elsewhere)."""
    import json

    with open(path, "w") as f:
        f.write(text)
    with open(path + ".json", "w") as f:
        json.dump(payload, f, default=str, indent=1)


def device_name() -> str:
    dev = jax.devices()[0]
    return f"{dev.platform}:{getattr(dev, 'device_kind', '')}"
