"""Serving size (issue 20): the 8B engine at batch x context cells, against floors.

    python -m bench.serving_size [--quick] [--cells 1x2k,16x2k,64x2k,...] [--modes greedy,spec]
                                 [--mem-fraction 0.9] [--chunk 8192] [--steps 8] [--max-rounds 32]
                                 [--png serving.png] [--out serving.md] [--no-kv-len-hints]
                                 [--rms-norm-impl auto|xla|triton]
                                 [--attention-impl auto|triton|cudnn|xla]

The model is bench/real_size.py's (8B Llama geometry, random bf16 weights on the device, the
matched EAGLE-3 head: high acceptance), page 16, topk 4, steps 3, 8 draft tokens. One engine per
mode whose KV pools are sized from device memory (``mem_fraction_static``) and whose context
covers the largest cell (``--context``: at least that many tokens); prompts are chunk-prefilled (``chunked_prefill_size``); its decode
launch hints (``kv_len_buckets``) are one per cell context (``--no-kv-len-hints``: none, every
step planned for the whole context); ``--rms-norm-impl`` picks the models' RMSNorm kernel
(``make_engine_config``'s, default "auto": XLA's fusion), ``--attention-impl`` the attention
(default "auto"; ``cudnn``: prefill chunks through cuDNN). Per cell
``B x C`` (B requests with C-token prompts from the head's hot ids):

* ``TTFT ms``: wall time of the prefill calls of the cell's first request (bs 1 cells: the
  whole prompt's time to first token) beside its floor (FLOPs: 2 x non-embedding params x
  tokens + causal attention 4 x layers x heads x head_dim x C^2 / 2, / the measured matmul
  rate) and ``x floor``. One sample, taken after the previous cell's decode: the GPU at its
  full clock. ``prefill ms / prompt``: the cell's whole fill (every prompt prefilled back to
  back, host loop included) / its prompts: the sustained rate, which on the H200 runs at its
  700 W power cap, the SM clock ~1.6 instead of 1.98 GHz (~10% slower a prompt at 2k:
  bench/RESULTS.md, nineteenth session);
* decode: ``step ms (wall)`` the host loop's wall (``Engine._decode_step``) per round over
  whole dispatches of ``--max-rounds`` rounds (the engine's default, 32; the tables of
  2026-11-26/27 ran 8), at least ``--steps`` rounds; ``step ms (device)`` the summed GPU
  kernel time of real engine steps under the profiler (no state copy: the pools are far too large to copy); the floor = the
  larger of (weights + KV bytes each step must read) / the measured copy bandwidth and FLOPs /
  the matmul rate; spec reads the draft's weights and its KV once per draft forward;
  ``phase floor ms``: the same split by phase (target linear, target attention, draft linear,
  draft attention), each phase's larger term, summed (``decode_floor``);
* ``kernels (device ms / round)``: the profiled dispatch's kernel families by device time
  (``bench.multi_device.kernel_breakdown``: the name up to its first digit or bracket);
* ``peak GiB``: ``peak_bytes_in_use`` after the cell; ``pool GiB`` / ``KV capacity`` (tokens);
  ``weights GiB``; ``tok/s`` (decode), acceptance, and (spec) requests whose tokens equal a
  greedy run's on the same cell (``same as greedy``).

Engine API used: ``make_engine_config(mem_fraction_static=...)``, ``Engine`` internals of
the host loop (``_admit``, ``_prefill_round``, ``_decode_step``) through bench.e2e.admit_all.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback

import jax
import numpy as np

from bench._timing import (
    copy_bandwidth_tbs,
    device_name,
    format_table,
    matmul_tflops,
    matmul_tflops_sustained,
    trace_gpu_events,
    write_with_json,
)
from bench.multi_device import kernel_breakdown
from bench.real_size import (
    DEFAULT_MAX_ROUNDS,
    DRAFT_TOKENS,
    GEOMETRIES,
    PAGE,
    STEPS,
    TOPK,
    _matmul_params,
    _nbytes,
    make_params,
    make_target,
)

COLUMNS = (
    "mode",
    "bs",
    "context",
    "TTFT ms",
    "TTFT floor ms",
    "TTFT x floor",
    "prefill ms / prompt",
    "step ms (wall)",
    "step ms (device)",
    "wall / device",
    "floor ms",
    "floor kind",
    "x floor (device)",
    "phase floor ms",
    "x phase floor (device)",
    "x floor (wall)",
    "tok/s",
    "accept len",
    "same as greedy",
    "peak GiB",
    "pool GiB",
    "KV capacity",
    "kernels (device ms / round)",
    "note",
)
DEFAULT_CELLS = "1x128,16x128,64x128,1x2k,16x2k,64x2k,1x8k,16x8k,64x8k,1x32k,4x32k,16x32k,1x128k"


def parse_cells(text: str) -> list[tuple[int, int]]:
    """``"16x2k,1x128"`` -> ``[(16, 2048), (1, 128)]`` (``k`` = 1024)."""
    cells = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        bs, ctx = item.lower().split("x")
        cells.append((int(bs), int(ctx[:-1]) * 1024 if ctx.endswith("k") else int(ctx)))
    return cells


def prefill_floor_ms(g, params, dparams, tokens: int, tflops: float, spec: bool) -> float:
    """FLOPs of one prompt's prefill (causal attention included) / the matmul rate."""
    linear = sum(_matmul_params(lp) for lp in params.layers)
    flops = 2 * linear * tokens + 4 * g.layers * g.heads * g.head_dim * tokens * tokens / 2
    if spec:  # the EAGLE-3 head: fc + one layer over the same tokens
        flops += 2 * (_matmul_params(dparams.layer) + dparams.fc.size) * tokens
        flops += 4 * g.draft_heads * (g.hidden // g.draft_heads) * tokens * tokens / 2
    return flops / (tflops * 1e12) * 1e3


# decode_phases' names, in step order (bench.step_kernels sums its kernels under the same names).
PHASES = ("target linear", "target attention", "draft linear", "draft attention")


def decode_phases(g, params, dparams, mode, bs, ctx) -> list[tuple[str, float, float]]:
    """``(phase, bytes, FLOPs)`` of one decode step at context ``ctx``, phase by phase
    (:data:`PHASES`; greedy: the target's two): the target's linear layers + LM head (its
    weights once; ``N`` verify tokens for spec), its attention (the target KV), and for spec
    ``STEPS`` draft forwards (the head's weights and its KV each time, + fc)."""
    target_b = _nbytes(params.layers) + _nbytes(params.final_norm) + _nbytes(params.lm_head)
    target_kv = bs * ctx * g.layers * 2 * g.kv_heads * g.head_dim * 2
    target_mm = sum(_matmul_params(lp) for lp in params.layers) + params.lm_head.size
    attn_flops = 4 * g.layers * g.heads * g.head_dim * ctx  # per query token
    tokens = bs if mode == "greedy" else bs * DRAFT_TOKENS  # target query tokens a step
    phases = [
        (PHASES[0], target_b, 2 * target_mm * tokens),
        (PHASES[1], target_kv, attn_flops * tokens),
    ]
    if mode != "greedy":
        dh = g.hidden // g.draft_heads
        draft_kv = bs * ctx * 2 * g.draft_heads * dh * 2
        draft_b = _nbytes(dparams.layer) + _nbytes(dparams.lm_head)
        d_mm = _matmul_params(dparams.layer) + dparams.lm_head.size
        d_attn = 4 * g.draft_heads * dh * ctx
        d_tokens = bs * (TOPK * (STEPS - 1) + DRAFT_TOKENS)
        phases += [
            (PHASES[2], STEPS * draft_b + _nbytes(dparams.fc), 2 * d_mm * d_tokens),
            (PHASES[3], STEPS * draft_kv, d_attn * d_tokens),
        ]
    return phases


def floor_terms(num_bytes: float, flops: float, bw_tbs: float, tflops: float) -> tuple:
    """``(num_bytes / the copy bandwidth, flops / the matmul rate)``, both in ms."""
    return num_bytes / (bw_tbs * 1e12) * 1e3, flops / (tflops * 1e12) * 1e3


def floor_ms(num_bytes: float, flops: float, bw_tbs: float, tflops: float) -> float:
    """The larger of :func:`floor_terms`, ms."""
    return max(floor_terms(num_bytes, flops, bw_tbs, tflops))


def decode_floor(g, params, dparams, mode, bs, ctx, bw_tbs, tflops) -> dict:
    """Floors of one decode step at context ``ctx`` (:func:`decode_phases`' bytes and FLOPs).

    ``floor ms``: all the bytes read once / copy bandwidth vs all the FLOPs / matmul rate, the
    larger (greedy: target weights + LM head + the target KV; spec: + ``STEPS`` draft forwards
    each reading the head's weights and its KV, and N verify tokens). ``phase floor ms``: each
    phase's larger term, summed: a lower bound for a step whose kernels run one after another,
    which the single max() is not where one phase is compute-bound and another memory-bound
    (spec at bs 64)."""
    phases = decode_phases(g, params, dparams, mode, bs, ctx)
    num_bytes, flops = sum(b for _, b, _ in phases), sum(f for _, _, f in phases)
    mem_ms, compute_ms = floor_terms(num_bytes, flops, bw_tbs, tflops)
    return {
        "floor ms": max(mem_ms, compute_ms),
        "floor kind": "memory" if mem_ms >= compute_ms else "compute",
        "phase floor ms": sum(floor_ms(b, f, bw_tbs, tflops) for _, b, f in phases),
    }


def make_engine(g, target, params, draft, dparams, mode, cells, args):
    from jspec.engine.scheduler import Engine
    from jspec.engine.state import make_engine_config

    top_bs = max(bs for bs, _ in cells)
    top_ctx = max(ctx for _, ctx in cells)
    buckets = tuple(sorted({bs for bs, _ in cells}))
    chunk = min(args.chunk, top_ctx)
    prefill_buckets = tuple(sorted({min(chunk, max(c, 16)) for _, c in cells}))
    context_len = max(top_ctx, args.context) + new_tokens(args) + 128
    # Launch hints (EngineConfig.kv_len_buckets): one per cell context, what the cell's
    # dispatches read (its prompt + the timed rounds' growth), so warm-up compiles only those.
    grow = new_tokens(args) + PAGE
    hints = () if args.no_kv_len_hints else {c + grow for _, c in cells}
    kw = {"kv_len_buckets": tuple(sorted(h for h in hints if h < context_len))}
    if args.quick:
        kw["num_pages"] = sum(bs * -(-(ctx + 512) // PAGE) for bs, ctx in cells[-1:]) + 64
    else:
        kw["mem_fraction_static"] = args.mem_fraction
    ecfg = make_engine_config(
        target,
        page_size=PAGE,
        topk=TOPK,
        num_steps=STEPS,
        num_draft_tokens=DRAFT_TOKENS,
        context_len=context_len,
        max_running_requests=top_bs,
        max_prompt_len=top_ctx,
        batch_buckets=buckets,
        prefill_batch=1,
        chunked_prefill_size=chunk,
        prefill_buckets=prefill_buckets,
        draft=draft if mode == "spec" else None,
        rms_norm_impl=args.rms_norm_impl,
        attention_impl=args.attention_impl,
        **kw,
    )
    if mode == "spec":
        return Engine(ecfg, target, params, draft, dparams, max_rounds=args.max_rounds)
    return Engine(ecfg, target, params, max_rounds=args.max_rounds)


def _mem_stats() -> dict:
    try:
        return jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU
        return {}


def new_tokens(args) -> int:
    """Each request's budget: the timed dispatches (``--steps`` rounds at least, so up to
    ``steps + max_rounds``) and the profiled one (``max_rounds``), at most ``STEPS + 1`` tokens
    a round, so that no request ends before the profile does."""
    return (args.steps + 2 * args.max_rounds) * (STEPS + 1)


def run_cell(
    engine, g, mode: str, bs: int, ctx: int, steps: int, budget: int, outputs: dict
) -> dict:
    from bench.e2e import admit_all
    from jspec.engine.scheduler import RunStats

    rng = np.random.default_rng(bs * 100003 + ctx)
    prompts = [rng.integers(0, g.draft_vocab, ctx).tolist() for _ in range(bs)]
    stats = RunStats(mode=mode)
    t0 = time.perf_counter()
    loop = admit_all(engine, prompts, budget, stats)
    fill_s = time.perf_counter() - t0
    first = loop.running[0][min(loop.running[0])]
    row = {
        "TTFT ms": first.ttft_s * 1e3,
        "prefill ms / prompt": fill_s / bs * 1e3,
        "note": f"fill {fill_s:.1f} s",
    }
    # Decode: dispatches of up to Engine.max_rounds rounds each (the engine's host loop);
    # stats.step_s gets one entry per round (the dispatch's wall / its rounds).
    n_steps0, n_tok0 = len(stats.step_s), len(stats.accept_lens)
    n_bs0 = len(stats.batch_sizes)
    t0 = time.perf_counter()
    while stats.num_decode_steps < steps and any(loop.running):
        engine._decode_step(loop, stats)
    wall = time.perf_counter() - t0
    rounds = stats.num_decode_steps
    row["step ms (wall)"] = wall / max(rounds, 1) * 1e3
    row["step ms (wall, median dispatch)"] = float(np.median(stats.step_s[n_steps0:])) * 1e3
    if mode == "spec":
        row["tok/s"] = sum(stats.accept_lens[n_tok0:]) / wall
    else:
        row["tok/s"] = sum(stats.batch_sizes[n_bs0:]) / wall
    # Device time: one more dispatch under the profiler (no state copy), per round.
    before = stats.num_decode_steps
    events = trace_gpu_events(lambda: engine._decode_step(loop, stats))
    prof_rounds = stats.num_decode_steps - before
    if events and prof_rounds:
        row["step ms (device)"] = sum(dur for _, _, dur in events) / prof_rounds / 1e6
        row["kernels (device ms / round)"] = kernel_breakdown(events, prof_rounds)
    row["accept len"] = stats.mean_accept_len if mode == "spec" else 1.0
    out = [loop.running[0][s].output[: steps + 1] for s in sorted(loop.running[0])]
    # (requests that hit their budget were retired inside _decode_step's loop: compare those
    # still running; the count is in "same as greedy")
    outputs[(mode, bs, ctx)] = out
    if mode == "spec" and ("greedy", bs, ctx) in outputs:
        greedy = outputs[("greedy", bs, ctx)]
        same = sum(a[: len(b)] == b[: len(a)] for a, b in zip(out, greedy))
        row["same as greedy"] = f"{same}/{len(out)}"
    mem = _mem_stats()
    if mem:
        row["peak GiB"] = mem.get("peak_bytes_in_use", 0) / 2**30
    # Release every request of the cell (the next cell starts from an empty pool).
    for s in list(loop.running[0]):
        loop.running[0][s].max_new_tokens = 0
    engine._retire(loop)
    return row


def draw(rows: list[dict], path: str) -> str:
    """PNG: decode step (device / wall / floor) vs context per batch, and TTFT vs context."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(matplotlib missing: no PNG)"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for mode, color in (("greedy", "tab:blue"), ("spec", "tab:orange")):
        for bs, marker in zip(sorted({r["bs"] for r in rows}), "os^dv"):
            sel = sorted(
                (r for r in rows if r["mode"] == mode and r["bs"] == bs and "floor ms" in r),
                key=lambda r: r["context"],
            )
            if not sel or not any("step ms (device)" in r for r in sel):
                continue
            ctx = [r["context"] for r in sel]
            dev = [r.get("step ms (device)", np.nan) for r in sel]
            ax1.plot(ctx, dev, marker + "-", color=color, label=f"{mode} bs{bs} device")
            ax1.plot(ctx, [r["floor ms"] for r in sel], ":", color=color, alpha=0.6)
        sel = sorted(
            (r for r in rows if r["mode"] == mode and r["bs"] == 1 and "TTFT ms" in r),
            key=lambda r: r["context"],
        )
        if sel:
            ctx = [r["context"] for r in sel]
            ax2.plot(ctx, [r["TTFT ms"] for r in sel], "o-", color=color, label=f"{mode} TTFT")
            ax2.plot(ctx, [r["TTFT floor ms"] for r in sel], ":", color=color, label="floor")
    for ax, ylab in ((ax1, "ms per decode step (dotted: floor)"), (ax2, "time to first token ms")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_ylabel(ylab)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"(PNG: {path})"


def _write(path: str, header: str, rows: list[dict]) -> None:
    text = f"{header}\n\n{format_table(rows, COLUMNS)}\n"
    write_with_json(path, text, {"header": header, "rows": rows})


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny geometry (CPU smoke)")
    parser.add_argument("--geometry", default="8b")
    parser.add_argument("--cells", default=DEFAULT_CELLS)
    parser.add_argument(
        "--no-kv-len-hints", action="store_true", help="plan every step for the engine's width"
    )
    parser.add_argument("--modes", default="greedy,spec")
    parser.add_argument("--mem-fraction", type=float, default=0.9)
    parser.add_argument("--chunk", type=int, default=8192, help="chunked_prefill_size")
    parser.add_argument(
        "--context",
        type=int,
        default=0,
        help="size the engines for prompts of this many tokens at least (default: the largest "
        "cell's; the full grid's engines are sized for 128k: its page tables are that wide)",
    )
    parser.add_argument(
        "--steps", type=int, default=8, help="timed decode rounds per cell (at least)"
    )
    parser.add_argument(
        "--max-rounds",
        type=int,
        default=DEFAULT_MAX_ROUNDS,
        help="decode rounds per dispatch (Engine's; the 2026-11-26/27 tables: 8)",
    )
    parser.add_argument(
        "--rms-norm-impl", default="auto", help="the engine's RMSNorm kernel: auto | xla | triton"
    )
    parser.add_argument(
        "--attention-impl",
        default="auto",
        help="the engine's attention: auto | triton | cudnn (prefill chunks through cuDNN) | xla",
    )
    parser.add_argument("--png", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    g = GEOMETRIES["quick" if args.quick else args.geometry]
    cells = parse_cells("1x32,2x64" if args.quick else args.cells)
    modes = [m for m in args.modes.split(",") if m]
    bw, tflops = copy_bandwidth_tbs(), matmul_tflops()
    sustained = matmul_tflops_sustained()
    header = (
        f"serving_size on {device_name()}: copy {bw:.2f} TB/s, bf16 matmul {tflops:.0f} TFLOP/s "
        f"(the floors'; {sustained:.0f} sustained under the power cap);"
        f" {g.name}, page {PAGE}, topk {TOPK}, steps {STEPS}, {DRAFT_TOKENS} draft tokens, "
        f"chunked prefill {args.chunk}, mem_fraction_static {args.mem_fraction}, "
        f"{args.max_rounds} rounds per dispatch, attention {args.attention_impl}, "
        f"rms_norm {args.rms_norm_impl}"
    )
    print(header, flush=True)
    target = make_target(g)
    params, draft, dparams = make_params(g, target)
    weights = _nbytes(params) + _nbytes(dparams)
    print(f"weights {weights / 2**30:.2f} GiB; memory {_mem_stats()}", flush=True)
    budget = new_tokens(args)  # each request's max_new_tokens, every cell alike
    rows: list[dict] = []
    outputs: dict = {}
    for mode in modes:
        t0 = time.perf_counter()
        engine = make_engine(g, target, params, draft, dparams, mode, cells, args)
        pool = sum(
            x.nbytes
            for x in jax.tree.leaves((engine.state.kv.target_pool, engine.state.kv.draft_pool))
        )
        spec = engine.ecfg.spec
        t1 = time.perf_counter()
        engine.warmup()
        print(f"{mode}: compiled in {time.perf_counter() - t1:.1f} s", flush=True)
        print(
            f"{mode}: pool {pool / 2**30:.2f} GiB = {spec.num_pages} pages "
            f"({spec.pool_size} tokens) in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        for bs, ctx in cells:
            row = {"mode": mode, "bs": bs, "context": ctx}
            row["TTFT floor ms"] = prefill_floor_ms(g, params, dparams, ctx, tflops, mode == "spec")
            row.update(decode_floor(g, params, dparams, mode, bs, ctx, bw, tflops))
            row.update({"pool GiB": pool / 2**30, "KV capacity": spec.pool_size})
            t0 = time.perf_counter()
            try:
                row.update(run_cell(engine, g, mode, bs, ctx, args.steps, budget, outputs))
                row["TTFT x floor"] = row["TTFT ms"] / row["TTFT floor ms"]
                for key in ("device", "wall"):
                    if f"step ms ({key})" in row:
                        row[f"x floor ({key})"] = row[f"step ms ({key})"] / row["floor ms"]
                if "step ms (device)" in row:
                    row["x phase floor (device)"] = row["step ms (device)"] / row["phase floor ms"]
                    row["wall / device"] = row["step ms (wall)"] / row["step ms (device)"]
            except Exception as e:  # noqa: BLE001 - report and keep going
                traceback.print_exc()
                row["note"] = f"FAILED: {type(e).__name__}: {e}"[:200]
                engine = make_engine(g, target, params, draft, dparams, mode, cells, args)
            row["note"] = row.get("note", "") + f" ({time.perf_counter() - t0:.0f} s)"
            rows.append(row)
            print(format_table([row], COLUMNS), flush=True)
            if args.out:
                _write(args.out, header, rows)
        del engine
        gc.collect()
    text = f"{header}\n\n{format_table(rows, COLUMNS)}\n"
    if args.png:
        text += "\n" + draw(rows, args.png) + "\n"
    print(text, flush=True)
    if args.out:
        _write(args.out, header, rows)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
