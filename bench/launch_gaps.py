"""Where a decode round's wall time goes beyond its kernels (issue 25): the GPU timeline of the
engine's decode dispatches, read from a profiler trace.

    python -m bench.launch_gaps [--geometry 8b] [--batches 1,64] [--modes greedy,spec]
                                [--dispatches 3] [--rms-norm-impl auto|xla|triton]

Per (mode, batch), on the 8B geometry of :mod:`bench.real_size` (its target, matched head and
engine): every prompt admitted and prefilled, two decode dispatches run untraced, then
``--dispatches`` dispatches of ``max_rounds`` rounds each run under the profiler exactly as
``Engine.generate`` runs them (``Engine._decode_step``: host preparation, one dispatch, one
read of the results, the host's token pass). From the GPU stream events (start, end):

* ``wall ms / round``: the host time of the same dispatches run unprofiled first (from the same
  start: reset, admission, prefill and two dispatches; greedy tokens, so the same lengths) /
  rounds; ``profiled wall``: the traced run's; ``busy ms / round``: the union of the traced
  kernels' intervals / rounds: the device time of these very rounds (contexts, clocks), which
  ``wall / busy`` divides into the unprofiled wall; ``kernels / round``.
* the GPU's idle time per round, split by where it falls: ``between dispatches`` (the host
  loop: the last kernel of a dispatch to the first of the next, plus the lead-in before the
  first) and, inside dispatches, by gap length: ``< 2 us`` (back-to-back launches on a
  stream), ``2-20 us``, ``20-200 us`` and ``>= 200 us``;
* the longest gaps inside dispatches with the kernels on either side (the log).

``wall - busy`` is what issue 25's wall <= 1.05x device target asks to remove; the split says
whether it is the host loop, launch gaps between many small kernels, or a few long stalls.
GPU only (a CPU trace has no GPU stream events).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench._timing import device_name, format_table, print_and_write, trace_profile
from jspec.engine.scheduler import DEFAULT_MAX_ROUNDS

GAP_BINS_US = (2.0, 20.0, 200.0)
GAP_NAMES = ("< 2 us", "2-20 us", "20-200 us", ">= 200 us")
COLUMNS = (
    "mode",
    "bs",
    "rounds",
    "wall ms / round",
    "profiled wall ms / round",
    "busy ms / round",
    "wall / busy",
    "kernels / round",
    "idle ms / round: between dispatches",
    *(f"idle ms / round: {name}" for name in GAP_NAMES),
)


HostEvent = tuple[int, int, str, str]  # (start ns, end ns, thread line name, event name)


def trace_timeline(thunk, host: list[HostEvent] | None = None) -> list[tuple[int, int, str]] | None:
    """``thunk()`` under the profiler: every GPU stream event as ``(start_ns, end_ns, name)``,
    sorted by start (None on CPU); ``host``: filled with the host threads' events."""

    def read(data) -> list[tuple[int, int, str]]:
        if host is not None:
            host.extend(
                (int(e.start_ns), int(e.end_ns), line.name, e.name)
                for plane in data.planes
                if plane.name.startswith("/host")
                for line in plane.lines
                for e in line.events
            )
        return [
            (int(e.start_ns), int(e.end_ns), e.name)
            for plane in data.planes
            if plane.name.startswith("/device:GPU")
            for line in plane.lines
            if line.name.startswith("Stream")
            for e in line.events
        ]

    return sorted(trace_profile(thunk, read) or []) or None


def host_during(host: list[HostEvent], start: int, stop: int, top: int = 6) -> list[str]:
    """The longest host events overlapping ``[start, stop)`` (ns), as "ms thread: name"."""
    inside = [e for e in host if e[0] < stop and e[1] > start]
    inside.sort(key=lambda e: min(e[1], stop) - max(e[0], start), reverse=True)
    return [
        f"{(min(e1, stop) - max(e0, start)) / 1e6:.3f} ms {line[:24]}: {name[:90]}"
        for e0, e1, line, name in inside[:top]
    ]


def dispatch_starts(events: list[tuple[int, int, str]], dispatches: int) -> list[int]:
    """The GPU start of each traced dispatch's first kernel but the first: the ends of the
    ``dispatches - 1`` longest idle gaps (each dispatch ends in the host's read of its results
    and the host's token pass, longer than any stall inside a dispatch)."""
    gaps, end = [], None
    for start, stop, _ in events:
        if end is not None and start > end:
            gaps.append((start - end, start))
        end = stop if end is None else max(end, stop)
    return sorted(start for _, start in sorted(gaps, reverse=True)[: max(dispatches - 1, 0)])


def split_timeline(events: list[tuple[int, int, str]], dispatch_starts_ns: list[int]) -> dict:
    """The busy time (union of intervals), idle gaps inside dispatches binned by length, the
    idle time before each dispatch's first kernel (from the previous kernel's end), and the
    longest inside gaps, from ``events`` sorted by start. ``dispatch_starts_ns``: the GPU start
    of each dispatch's first kernel (a gap ending at one is "between dispatches")."""
    starts = set(dispatch_starts_ns)
    busy = 0
    between = 0
    bins = [0.0] * len(GAP_NAMES)
    longest: list[tuple[float, str, str, int, int]] = []
    pairs: dict[str, list[int]] = {}  # inside gaps >= 2 us by (before -> after): [count, ns]
    windows: list[tuple[int, int]] = []
    end, prev = None, ""
    for start, stop, name in events:
        if end is None or start >= end:
            if end is not None:
                gap = start - end
                if start in starts:
                    between += gap
                    windows.append((end, start))
                else:
                    bins[int(np.searchsorted(GAP_BINS_US, gap / 1e3, side="right"))] += gap
                    longest.append((gap / 1e3, prev, name, end, start))
                    if gap >= GAP_BINS_US[0] * 1e3:
                        pair = pairs.setdefault(f"{prev[:48]} -> {name[:48]}", [0, 0])
                        pair[0] += 1
                        pair[1] += gap
            busy += stop - start
            end = stop
        elif stop > end:  # overlapping (another stream): count the part past the union's end
            busy += stop - end
            end = stop
        prev = name
    longest.sort(reverse=True)
    return {
        "busy_ns": busy,
        "between_ns": between,
        "bins_ns": bins,
        "longest": longest[:8],
        "pairs": sorted(pairs.items(), key=lambda kv: -kv[1][1])[:12],
        "between_windows": windows,
    }


def run_case(
    engine, mode: str, bs: int, prompt_len: int, vocab: int, dispatches: int, new: int
) -> dict:
    from bench.e2e import admit_all
    from jspec.engine.scheduler import RunStats

    rng = np.random.default_rng(bs)
    prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(bs)]

    def start():
        """Reset, admit and prefill, two untraced dispatches (every executable ran once)."""
        engine.reset()
        loop = admit_all(engine, prompts, new)
        stats = RunStats(mode=engine.mode)
        for _ in range(2):
            engine._decode_step(loop, stats)
        return loop, stats

    def run_dispatches(loop, stats) -> tuple[float, int]:
        """``dispatches`` dispatches as the host loop runs them: (seconds, rounds)."""
        first, t0 = stats.num_decode_steps, time.perf_counter()
        for _ in range(dispatches):
            engine._decode_step(loop, stats)
        return time.perf_counter() - t0, stats.num_decode_steps - first

    # The same dispatches twice from the same start (greedy tokens: the same lengths): once
    # unprofiled (the wall a user sees), once under the profiler (the timeline).
    plain_s, plain_rounds = run_dispatches(*start())
    loop, stats = start()
    traced = {}

    def thunk():
        traced["s"], traced["rounds"] = run_dispatches(loop, stats)

    host_events: list[HostEvent] = []
    events = trace_timeline(thunk, host_events)
    if events is None:
        raise SystemExit("launch_gaps: no GPU events in the trace (a GPU is needed)")
    rounds = traced["rounds"]
    split = split_timeline(events, dispatch_starts(events, dispatches))
    per_round = 1e6 * max(rounds, 1)
    row = {
        "mode": mode,
        "bs": bs,
        "rounds": rounds,
        "wall ms / round": round(plain_s * 1e3 / max(plain_rounds, 1), 3),
        "profiled wall ms / round": round(traced["s"] * 1e9 / per_round, 3),
        "busy ms / round": round(split["busy_ns"] / per_round, 3),
        "kernels / round": round(len(events) / max(rounds, 1), 1),
        "idle ms / round: between dispatches": round(split["between_ns"] / per_round, 3),
    }
    row["wall / busy"] = round(row["wall ms / round"] / max(row["busy ms / round"], 1e-9), 3)
    for name, ns in zip(GAP_NAMES, split["bins_ns"]):
        row[f"idle ms / round: {name}"] = round(ns / per_round, 3)
    print(f"{mode} bs {bs}: longest gaps inside dispatches (us, before -> after):", flush=True)
    for i, (gap, before, after, g0, g1) in enumerate(split["longest"]):
        print(f"  {gap:8.1f}  {before[:70]} -> {after[:70]}", flush=True)
        if i < 3:  # what the host did meanwhile
            for text in host_during(host_events, g0, g1):
                print(f"        host {text}", flush=True)
    print(f"{mode} bs {bs}: gaps >= 2 us inside dispatches by kernel pair (per round):")
    for pair, (count, ns) in split["pairs"]:
        print(f"  {ns / per_round * 1e3:7.1f} us {count / max(rounds, 1):5.1f}x  {pair}")
    between = [(g1 - g0, g0, g1) for g0, g1 in split["between_windows"]]
    for gap, g0, g1 in sorted(between, reverse=True)[:1]:
        print(f"  between dispatches {gap / 1e3:8.1f} us; host meanwhile:", flush=True)
        for text in host_during(host_events, g0, g1):
            print(f"        host {text}", flush=True)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    from bench import real_size as rs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", default="8b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--modes", default="greedy,spec")
    parser.add_argument("--dispatches", type=int, default=3)
    parser.add_argument(
        "--max-rounds",
        type=int,
        default=DEFAULT_MAX_ROUNDS,
        help="decode rounds per dispatch (default: Engine's)",
    )
    parser.add_argument(
        "--rms-norm-impl", default="auto", help="the engine's RMSNorm kernel: auto | xla | triton"
    )
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    g = rs.GEOMETRIES[args.geometry]
    rs.RMS_NORM_IMPL = args.rms_norm_impl
    # Room for every request to decode through the untraced and traced dispatches (up to
    # steps + 1 tokens a round): no request ends.
    rs.NEW = (args.dispatches + 3) * args.max_rounds * (rs.STEPS + 1)
    batches = [int(b) for b in args.batches.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    target = rs.make_target(g)
    params, draft, dparams = rs.make_params(g, target)
    rows = []
    for mode in modes:
        engine = rs.make_engine(
            g, target, params, draft, dparams, mode, batches, "auto", max_rounds=args.max_rounds
        )
        engine.warmup()
        for bs in batches:
            rows.append(
                run_case(
                    engine,
                    mode,
                    bs,
                    min(rs.PROMPT, g.vocab),
                    g.draft_vocab,
                    args.dispatches,
                    rs.NEW,
                )
            )
            print(format_table(rows[-1:], COLUMNS), flush=True)
        del engine
    text = (
        f"launch_gaps on {device_name()}: {args.geometry}, {args.dispatches} traced dispatches "
        f"of {args.max_rounds} rounds per row, rms_norm {args.rms_norm_impl}\n\n{format_table(rows, COLUMNS)}\n"
    )
    print_and_write(text, args.out)
    return rows


if __name__ == "__main__":
    main()
