"""Every kernel of one real_size decode step, by HLO instruction (issue 13: where the time goes).

    python -m bench.step_kernels [--geometry 8b] [--modes greedy] [--batches 1] [--top 40]
                                 [--prompt 128] [--context 256] [--num-pages N] [--rounds 0,8]
                                 [--tensor-parallel 2] [--hlo-dir DIR]

Builds ``bench.real_size``'s geometry and engine, runs it to a steady state, compiles the step
with XLA's command buffers off (every kernel attributed to its HLO instruction) and prints, per
instruction: device us per step, kernel launches per step, the class (``real_size``'s split),
the instruction's opcode / fusion kind / custom-call target, its result shape and op_name. The
summary line counts the launches and sums the dot-bearing kernels (matmuls) apart from the rest;
a table sums them by decode phase beside each phase's floor (``bench.serving_size``'s
``decode_phases`` at the prompt's context, over the run's copy and matmul probes; one device
only); a last table lists every bookkeeping (and unattributed) kernel.

``--rounds R`` profiles the engine's multi-round dispatch (``jspec.engine.rounds``, ``R`` rounds
of the step in one device loop, as ``Engine.generate`` runs it) instead of the single step, every
number per round; ``--rounds 0,8`` prints both, so that the loop's own cost shows beside the
step's. ``--num-pages`` sizes the KV pool (default: ``max_running x context``; a serving engine's
pool, sized from device memory, is far larger).
"""

from __future__ import annotations

import argparse
import os
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


def phase_of(row_class: str, op_name: str, matmul: bool) -> str:
    """The decode phase of one kernel (``bench.serving_size.PHASES``' names), or
    ``"target glue"`` / ``"draft glue"`` (a model's other kernels: norms, RoPE, K/V writes,
    activations) or ``"bookkeeping"`` (everything outside the models)."""
    if row_class == "attention":  # the draft's passes run under a "draft" name scope
        draft = re.search(r"(^|[/:])draft(/|$)", op_name)
        return "draft attention" if draft else "target attention"
    if row_class in ("target", "draft"):
        return f"{row_class} linear" if matmul else f"{row_class} glue"
    return "bookkeeping"


def against_floor(rows: list[dict], floors_us: dict[str, float]) -> list[dict]:
    """Device us and launches per phase (:func:`phase_of`, the rows' ``phase``) beside each
    phase's floor (``floors_us``; phases without one: none), and what is over it; a
    last row sums them all."""
    acc: dict[str, list[float]] = {}
    for r in rows:
        acc.setdefault(r["phase"], [0.0, 0.0])
        acc[r["phase"]][0] += r["us"]
        acc[r["phase"]][1] += r["calls"]
    out = []
    for phase, (us, n) in sorted(acc.items(), key=lambda kv: -kv[1][0]):
        floor = floors_us.get(phase)
        if floor is None:  # glue, bookkeeping: no floor of their own
            out.append({"phase": phase, "us": us, "launches": n, "floor us": "", "over us": ""})
        else:
            out.append(
                {"phase": phase, "us": us, "launches": n, "floor us": floor, "over us": us - floor}
            )
    total = sum(r["us"] for r in out)
    floor_total = sum(floors_us.values())
    out.append(
        {
            "phase": "all",
            "us": total,
            "launches": sum(r["launches"] for r in out),
            "floor us": floor_total,
            "over us": total - floor_total,
        }
    )
    return out


def kernel_rows(
    engine,
    prompts,
    num_calls: int = 3,
    rounds: int = 0,
    hlo_out: str | None = None,
    tensor_parallel: int = 1,
) -> tuple[list[dict], dict]:
    """Per-instruction rows of the step (``rounds`` 0) or of one ``rounds``-round dispatch,
    us and launches per step (per round) and per device (a tensor-parallel engine's
    ``tensor_parallel`` devices run the same program), and a summary; ``hlo_out``: a path to
    write the compiled HLO to (the GEMMs' autotuned configs are in it)."""
    import numpy as np

    from bench.e2e import _op_key, _steady_state, steady_max_len
    from bench.real_size import NEW, SPLIT_COMPILER_OPTIONS, _classify
    from jspec.engine.rounds import rounds_body

    _, slot_idx, live = _steady_state(engine, prompts, NEW)
    bucket, max_len = int(slot_idx.shape[-1]), steady_max_len(engine, prompts)
    extra: tuple = ()
    if rounds:  # every entry runs all rounds: a budget past them, no stop id
        extra = (
            np.full((1, bucket), 1 << 20, np.int32),
            np.full((1, 1), -1, np.int32),
            np.full((1,), rounds, np.int32),
        )

    # The state is donated: each call runs on the state the one before returned (a serving
    # pool is too large to hold copies of), a step or R rounds further on: the warm-up and the
    # traced calls grow the rows past the steady state's bound (the launch hint covers them).
    grow = engine.ecfg.spec.num_steps + 1 if engine.mode == "spec" else 1
    max_len += (num_calls + 1) * max(1, rounds) * grow
    hint = engine.ecfg.kv_len_bucket_for(max_len)
    body = rounds_body(engine._step_body, rounds) if rounds else engine._step_body
    step = engine._fn(body, engine._step_tokens(bucket), hint)
    inputs = (slot_idx[None], live[None], *extra)
    compiled = step.lower(engine.weights, engine.state, *inputs).compile(SPLIT_COMPILER_OPTIONS)
    hlo = compiled.as_text()
    if hlo_out:
        os.makedirs(os.path.dirname(hlo_out) or ".", exist_ok=True)
        with open(hlo_out, "w") as f:
            f.write(hlo)
    op_names, desc = hlo_op_names(hlo), _describe(hlo)
    by_kernel = {_sanitize(n): n for n in op_names}

    def run(calls: int):
        for _ in range(calls):
            engine.state = compiled(engine.weights, engine.state, *inputs)[0]
        return engine.state

    jax.block_until_ready(run(1))
    events = trace_gpu_events(lambda: run(num_calls))
    if events is None:
        return [], {}
    per = num_calls * max(1, rounds) * tensor_parallel  # per step (per round), per device
    acc: dict[str, list[float]] = {}
    for name, hlo_op, dur in events:
        inst = event_instruction(name, hlo_op, op_names, by_kernel) or ("?" + name)
        acc.setdefault(inst, [0.0, 0])
        acc[inst][0] += dur
        acc[inst][1] += 1
    rows = []
    for inst, (ns, n) in acc.items():
        op = op_names.get(inst, "")
        row = {
            "us": ns / per / 1e3,
            "calls": n / per,
            "class": _classify(op or "@" + inst),
            "what": desc.get(inst, inst[:40]),
            "op": _op_key(op)[-60:] if op else "@" + inst[:40],
        }
        row["phase"] = phase_of(row["class"], op, _is_matmul(row))
        rows.append(row)
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
        "--calls",
        type=int,
        default=3,
        help="profiled calls (steps or dispatches), each on the state the last one returned",
    )
    parser.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens per request")
    parser.add_argument(
        "--context", type=int, default=256, help="the engine's context_len (capacity)"
    )
    parser.add_argument(
        "--num-pages", type=int, default=None, help="KV pool pages (default: running x context)"
    )
    parser.add_argument(
        "--rounds",
        default="0",
        help="comma list: 0 the single step, R one R-round dispatch (numbers per round)",
    )
    parser.add_argument("--hlo-dir", default=None, help="write each compiled HLO here")
    parser.add_argument(
        "--tensor-parallel", type=int, default=1, help="tp devices (numbers per device)"
    )
    args = parser.parse_args(argv)
    from bench import real_size

    real_size.PROMPT = args.prompt  # read by make_engine (max_prompt_len, context)
    real_size.CAPACITY = (max(args.context, args.prompt + 256), args.num_pages)
    g = GEOMETRIES[args.geometry]
    target = make_target(g)
    params, draft, dparams = make_params(g, target)
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"step_kernels on {device_name()}: {g.name}, prompts {args.prompt}, engine context "
        f"{real_size.CAPACITY[0]}, pool pages {args.num_pages or 'running x context'}",
        flush=True,
    )
    # Floors by phase (bench.serving_size's), at the prompt's context; per device they would
    # need the tp split: printed for one device only.
    floors_at = None
    if args.tensor_parallel == 1:
        from bench._timing import copy_bandwidth_tbs, matmul_tflops
        from bench.serving_size import decode_phases, floor_ms

        floors_at = (copy_bandwidth_tbs(), matmul_tflops())
    for mode in args.modes.split(","):
        engine = make_engine(
            g,
            target,
            params,
            draft,
            dparams,
            mode,
            batches,
            args.attention_impl,
            tensor_parallel=args.tensor_parallel,
        )
        for bs, rounds in [(b, int(r)) for b in batches for r in args.rounds.split(",")]:
            rng = np.random.default_rng(bs)
            prompts = [rng.integers(0, g.draft_vocab, args.prompt).tolist() for _ in range(bs)]
            hlo_out = args.hlo_dir and f"{args.hlo_dir}/{mode}_bs{bs}_r{rounds}.hlo"
            rows, summary = kernel_rows(
                engine, prompts, args.calls, rounds, hlo_out, args.tensor_parallel
            )
            what = f"{rounds}-round dispatch, per round" if rounds else "step"
            print(
                f"\n## {mode} bs={bs} ({what}): "
                + ", ".join(f"{k} {v:.1f}" for k, v in summary.items())
            )
            dots = [r for r in rows if _is_matmul(r)]
            others = [r for r in rows if not _is_matmul(r)]
            print(f"### matmuls (top {args.top})\n" + format_table(dots[: args.top]))
            print(f"### the rest (top {args.top})\n" + format_table(others[: args.top]), flush=True)
            print(
                f"### by op (top {args.top})\n" + format_table(by_op(rows)[: args.top]), flush=True
            )
            if floors_at and rows:
                bw, tflops = floors_at
                phases = decode_phases(g, params, dparams, mode, bs, args.prompt)
                floors = {name: floor_ms(b, f, bw, tflops) * 1e3 for name, b, f in phases}
                print(
                    f"### against the floor, by phase (us; context {args.prompt}, copy "
                    f"{bw:.2f} TB/s, matmul {tflops:.0f} TFLOP/s)\n"
                    + format_table(against_floor(rows, floors)),
                    flush=True,
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
