"""Every kernel of one real_size decode step, by HLO instruction (issue 13: where the time goes).

    python -m bench.step_kernels [--geometry 8b] [--modes greedy] [--batches 1] [--top 40]
                                 [--prompt 128] [--context 256]

Builds ``bench.real_size``'s geometry and engine, runs it to a steady state, compiles the step
with XLA's command buffers off (every kernel attributed to its HLO instruction) and prints, per
instruction: device us per step, kernel launches per step, the class (``real_size``'s split),
the instruction's opcode / fusion kind / custom-call target, its result shape and op_name. The
summary line counts the launches and sums the dot-bearing kernels (matmuls) apart from the rest;
a last table lists every bookkeeping (and unattributed) kernel.
"""

from __future__ import annotations

import argparse
import re
import sys

import jax

from bench._timing import (
    _CALLS,
    _COMPUTATION,
    _INSTRUCTION,
    _sanitize,
    device_name,
    event_instruction,
    format_table,
    hlo_op_names,
    trace_gpu_events,
)


def _describe(hlo_text: str) -> dict[str, str]:
    """Instruction -> "opcode[kind/target] shape", + " DOT" when it is a dot or calls a
    computation that holds one (nested fusions included)."""
    has_dot: dict[str, bool] = {}
    callees: dict[str, set[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(1)
            has_dot[current], callees[current] = False, set()
        elif current:
            has_dot[current] |= bool(re.search(r"\s(dot|convolution)\(", line))
            callees[current].update(_CALLS.findall(line))

    def holds_dot(computation: str, seen: frozenset = frozenset()) -> bool:
        if has_dot.get(computation):
            return True
        return any(holds_dot(c, seen | {computation}) for c in callees.get(computation, ()) - seen)

    out: dict[str, str] = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        rest = line[m.end() :]
        op = re.search(r"\s([a-z][\w\-]*)\(", " " + rest)
        shape = rest[: op.start()].strip() if op else ""
        desc = op.group(1) if op else "?"
        kind = re.search(r"kind=(\w+)", rest)
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        if kind:
            desc += f"[{kind.group(1)}]"
        if target:
            desc += f"[{target.group(1)}]"
        called = _CALLS.search(rest)
        if desc.startswith("dot") or (called and holds_dot(called.group(1))):
            desc += " DOT"
        out[m.group(1)] = f"{desc} {shape[:60]}"
    return out


def _is_matmul(row: dict) -> bool:
    """A dot-bearing fusion, an XLA Triton GEMM or a cuBLAS custom call (``__cublas$...``)."""
    return any(key in row["what"] for key in ("DOT", "gemm", "cublas"))


def kernel_rows(engine, prompts, num_calls: int = 3) -> tuple[list[dict], dict]:
    from bench.e2e import _copy, _op_key, _steady_state, steady_max_len
    from bench.real_size import NEW, SPLIT_COMPILER_OPTIONS, _classify

    state, slot_idx, live = _steady_state(engine, prompts, NEW)
    stacked = jax.tree.map(lambda x: x[None], state)

    def make_args():
        return (engine.weights, _copy(stacked), slot_idx[None], live[None])

    args = make_args()
    step = engine._step_for(int(slot_idx.shape[-1]), steady_max_len(engine, prompts))
    compiled = step.lower(*args).compile(SPLIT_COMPILER_OPTIONS)
    hlo = compiled.as_text()
    op_names, desc = hlo_op_names(hlo), _describe(hlo)
    by_kernel = {_sanitize(n): n for n in op_names}
    jax.block_until_ready(compiled(*args))
    arg_sets = [jax.block_until_ready(make_args()) for _ in range(num_calls)]
    events = trace_gpu_events(lambda: [compiled(*a) for a in arg_sets])
    if events is None:
        return [], {}
    acc: dict[str, list[float]] = {}
    for name, hlo_op, dur in events:
        inst = event_instruction(name, hlo_op, op_names, by_kernel) or ("?" + name)
        acc.setdefault(inst, [0.0, 0])
        acc[inst][0] += dur
        acc[inst][1] += 1
    rows = []
    for inst, (ns, n) in acc.items():
        op = op_names.get(inst, "")
        rows.append(
            {
                "us": ns / num_calls / 1e3,
                "calls": n / num_calls,
                "class": _classify(op or "@" + inst),
                "what": desc.get(inst, inst[:40]),
                "op": _op_key(op)[-60:] if op else "@" + inst[:40],
            }
        )
    rows.sort(key=lambda r: -r["us"])
    dots = [r for r in rows if _is_matmul(r)]
    summary = {
        "total us": sum(r["us"] for r in rows),
        "launches": sum(r["calls"] for r in rows),
        "dot us": sum(r["us"] for r in dots),
        "dot launches": sum(r["calls"] for r in dots),
    }
    return rows, summary


def by_op(rows: list[dict]) -> list[dict]:
    """Rows summed over instructions of one op and kind (a layer's kernels over all layers):
    us and launches per step, most first."""
    acc: dict[tuple, list[float]] = {}
    for r in rows:
        kind = r["what"].split(" ")[0] + (" DOT" if " DOT" in r["what"] else "")
        key = (r["class"], kind, r["op"])
        acc.setdefault(key, [0.0, 0.0])
        acc[key][0] += r["us"]
        acc[key][1] += r["calls"]
    out = [
        {"us": us, "calls": n, "class": c, "what": kind, "op": op}
        for (c, kind, op), (us, n) in acc.items()
    ]
    return sorted(out, key=lambda r: -r["us"])


def main(argv: list[str] | None = None) -> None:
    import numpy as np

    from bench.real_size import GEOMETRIES, PROMPT, make_engine, make_params, make_target

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", default="8b")
    parser.add_argument("--modes", default="greedy")
    parser.add_argument("--batches", default="1")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--attention-impl", default="auto")
    parser.add_argument(
        "--calls", type=int, default=3, help="profiled calls (state copies held at once)"
    )
    parser.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens per request")
    parser.add_argument(
        "--context", type=int, default=256, help="the engine's context_len (capacity)"
    )
    args = parser.parse_args(argv)
    from bench import real_size

    real_size.PROMPT = args.prompt  # read by make_engine (max_prompt_len, context)
    real_size.CAPACITY = (max(args.context, args.prompt + 256), None)
    g = GEOMETRIES[args.geometry]
    target = make_target(g)
    params, draft, dparams = make_params(g, target)
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"step_kernels on {device_name()}: {g.name}, prompts {args.prompt}, engine context "
        f"{real_size.CAPACITY[0]}",
        flush=True,
    )
    for mode in args.modes.split(","):
        engine = make_engine(g, target, params, draft, dparams, mode, batches, args.attention_impl)
        for bs in batches:
            rng = np.random.default_rng(bs)
            prompts = [rng.integers(0, g.draft_vocab, args.prompt).tolist() for _ in range(bs)]
            rows, summary = kernel_rows(engine, prompts, args.calls)
            print(f"\n## {mode} bs={bs}: " + ", ".join(f"{k} {v:.1f}" for k, v in summary.items()))
            dots = [r for r in rows if _is_matmul(r)]
            others = [r for r in rows if not _is_matmul(r)]
            print(f"### matmuls (top {args.top})\n" + format_table(dots[: args.top]))
            print(f"### the rest (top {args.top})\n" + format_table(others[: args.top]), flush=True)
            print(
                f"### by op (top {args.top})\n" + format_table(by_op(rows)[: args.top]), flush=True
            )
            # Every kernel outside the models (bookkeeping and unattributed), whatever its rank.
            books = [r for r in rows if r["class"] not in ("target", "draft", "attention")]
            total = sum(r["us"] for r in books)
            print(f"### bookkeeping: {total:.1f} us, {sum(r['calls'] for r in books):.0f} launches")
            print(format_table(books), flush=True)
            from bench.real_size import _reset

            _reset(engine)
        del engine


if __name__ == "__main__":
    main(sys.argv[1:])
