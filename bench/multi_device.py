"""Several GPUs: tensor and data parallel at real size against per-GPU floors, tokens vs one GPU.

    python -m bench.multi_device [--model 8b|1b|quick] [--layouts 1x2,2x1] [--batches 1,16]
                                 [--modes greedy,spec] [--out multi_device.md]
    python -m bench.multi_device --model demo --layouts 2x1,1x2      # smoke: tokens only

Layouts are ``DPxTP`` (``DP * TP`` devices, the first of ``jax.devices()``); ``1x1`` (one device)
always runs first and is every row's reference.

``--model 8b`` (default; ``1b``; ``quick`` is CPU-sized): bench.real_size's target and EAGLE-3
head (random bf16 weights made on the device, prompts of 128 hot ids, 64 new tokens, page 16,
topk 4, steps 3, 8 draft tokens), one engine per (layout, mode) over its batch buckets:

* ``DP = 1`` (tensor parallel over ``TP`` GPUs): every batch of ``--batches``. ``DP > 1``: one
  batch of ``DP x max(batches)`` requests (``max(batches)`` per GPU group), set beside the one
  GPU run at ``max(batches)``: ``tok/s x`` is the throughput ratio (2 = perfect).
* ``step ms (wall)``: median decode step of ``Engine.generate`` (host loop included);
  ``step ms (device)``: summed kernel time of one decode step on the busiest GPU (a profiler
  trace of 4 steps of the full batch, XLA command buffers on as in the timed run; NCCL kernels
  included, waiting for the peer too); None on CPU.
* ``floor ms`` per GPU, measured in the same run: max(bytes this GPU reads per step (its shard of
  the weights, as real_size.floors counts them: for TP its half of the layers + the replicated
  LM head; KV / TP) / measured copy bandwidth, its FLOPs / measured bf16 matmul rate) + the
  step's all-reduces (TP: 2 psums per target layer and per draft forward, ``allreduce_plan``),
  each timed alone at its message size ``[rows, hidden]`` (the all-reduce table; device time of
  the NCCL kernels on GPU).
* ``step x``: one GPU's step wall / this one's; ``same as 1 GPU``: requests whose tokens equal
  the one-GPU run's for the same prompt (bf16: TP sums in another order, so a near-tied argmax
  may flip; reported, not asserted).

``--model demo``: the ``jspec demo`` model (vocab 512, 4 layers, f32), 16 prompts x 48 tokens,
greedy and spec per layout: tokens/s, acceptance, leak check, tokens equal to one device
(asserted). ``--out PATH`` writes the markdown table(s) there and the rows as JSON to PATH.json.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import itertools
import re
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bench import real_size
from bench._timing import (
    copy_bandwidth_tbs,
    device_name,
    format_table,
    matmul_tflops,
    time_wall,
    trace_gpu_planes,
    write_with_json,
)

DEMO_COLUMNS = ("layout", "mode", "tokens/s", "accept len", "equal to 1 device", "leak check")
# fmt: off
COLUMNS = (
    "layout", "mode", "bs", "step ms (wall)", "step ms (device)", "floor ms", "x floor (device)",
    "x floor (wall)", "memory floor ms", "compute floor ms", "all-reduce floor ms", "all-reduce MB",
    "weights GB/GPU", "tok/s", "step x", "tok/s x", "accept len", "same as 1 GPU", "leak check",
    "note", "kernels (device ms / step)",
)
# fmt: on
AR_COLUMNS = ("tp", "rows", "MB", "device us", "wall us", "GB/s")
PROFILED_STEPS = 4
TOP_KERNELS = 8


def parse_layouts(arg: str) -> list[tuple[int, int]]:
    """``"2x1,1x2"`` -> ``[(1, 1), (2, 1), (1, 2)]``: (dp, tp) pairs, one device first."""
    layouts = [tuple(int(x) for x in item.split("x")) for item in arg.split(",") if item]
    if any(len(lt) != 2 or min(lt) < 1 for lt in layouts):
        raise ValueError(f"--layouts {arg!r}: expected DPxTP items such as 1x2,2x1")
    return [(1, 1)] + [lt for lt in dict.fromkeys(layouts) if lt != (1, 1)]


def layout_batches(dp: int, batches: list[int]) -> list[int]:
    """Total batch sizes run on a layout: every one of ``batches`` (dp 1), else dp x the largest."""
    return list(batches) if dp == 1 else [dp * max(batches)]


def allreduce_plan(g, mode: str, bs: int) -> dict[int, int]:
    """``{rows: count}``: the psums of ``dtype[rows, hidden]`` in one decode step of ``bs``
    requests on a tensor-parallel group (``g``: a real_size Geometry).

    Each target layer sums its attention and MLP row-parallel products (2 psums over the step's
    target tokens: ``bs``, spec's verify ``bs * DRAFT_TOKENS``); spec's EAGLE-3 midlayer adds 2
    per draft forward: ``STEPS - 1`` loop forwards of ``bs * TOPK`` rows and the extend of
    ``bs * DRAFT_TOKENS`` rows (real_size.floors' count of draft forwards).
    """
    if mode == "greedy":
        return {bs: 2 * g.layers}
    plan = collections.Counter({bs * real_size.DRAFT_TOKENS: 2 * g.layers + 2})
    plan[bs * real_size.TOPK] += 2 * (real_size.STEPS - 1)
    return dict(plan)


def measure_allreduce(rows: int, hidden: int, tp: int, dtype: str = "bfloat16") -> dict:
    """One psum of ``dtype[rows, hidden]`` over the first ``tp`` devices, alone.

    16 dependent psums (each times 0.5) unrolled in one jitted shard_map; ``device us``: the
    all-reduce kernels' summed time per psum, mean over the GPUs (None on CPU); ``wall us``: the
    call's median wall / 16 (the 0.5 multiplies and dispatch included).
    """
    chain = 16
    mesh = Mesh(np.asarray(jax.devices()[:tp]), ("tp",))

    def body(x):
        return jax.lax.fori_loop(0, chain, lambda _, y: jax.lax.psum(y, "tp") * 0.5, x, unroll=True)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False)
    fn = jax.jit(mapped)
    x = jax.device_put(jnp.ones((tp * rows, hidden), dtype), NamedSharding(mesh, P("tp")))
    wall_us = time_wall(fn, x, iters=10) / chain
    planes = trace_gpu_planes(lambda: fn(x))
    device_us = None
    if planes is not None:
        per_gpu = []
        for events in planes.values():
            reduce = [d for n, _, d in events if "allreduce" in n.lower().replace("_", "")]
            per_gpu.append(sum(reduce or [d for *_, d in events]) / chain / 1e3)
        device_us = statistics.mean(per_gpu)
    num_bytes = rows * hidden * jnp.dtype(dtype).itemsize
    us = wall_us if device_us is None else device_us
    return {
        "tp": tp,
        "rows": rows,
        "MB": num_bytes / 1e6,
        "device us": device_us,
        "wall us": wall_us,
        "GB/s": num_bytes / us / 1e3,
    }


def local_view(tree):
    """Each array of ``tree`` as a ``ShapeDtypeStruct`` of what one device holds of it."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.sharding.shard_shape(x.shape), x.dtype), tree
    )


def gpu_floor(g, params, dparams, mode: str, bs: int, dp: int, tp: int, measured: dict) -> dict:
    """Per-GPU floor columns of one decode step of ``bs`` requests on a ``dp x tp`` layout.

    ``params`` / ``dparams``: the engine's placed weights (each GPU's shard is what it reads);
    ``measured``: ``{"copy TB/s", "TFLOP/s", "allreduce": {(tp, rows): measure_allreduce(...)}}``.
    """
    local_g = dataclasses.replace(g, kv_heads=g.kv_heads // tp)
    lp, ld = local_view(params), local_view(dparams)
    f = real_size.floors(
        local_g, lp, ld, mode, bs // dp, measured["copy TB/s"], measured["TFLOP/s"]
    )
    plan = allreduce_plan(g, mode, bs // dp) if tp > 1 else {}
    ar = measured["allreduce"]
    comm_us = 0.0
    for rows, count in plan.items():
        m = ar[(tp, rows)]
        comm_us += count * (m["wall us"] if m["device us"] is None else m["device us"])
    return {
        "memory floor ms": f["_mem_ms"],
        "compute floor ms": f["_compute_ms"],
        "all-reduce floor ms": comm_us / 1e3,
        "all-reduce MB": sum(count * ar[(tp, r)]["MB"] for r, count in plan.items()),
        "floor ms": f["floor ms"] + comm_us / 1e3,
        "weights GB/GPU": real_size._nbytes((lp, ld)) / 1e9,
    }


def compare_rows(rows: list[dict], outputs: dict) -> None:
    """Fill ``step x``, ``tok/s x``, ``same as 1 GPU`` and ``x floor`` of every row, in place.

    ``outputs[(layout, mode, bs)]``: the run's token lists (prompt i first); a ``dp x tp`` row
    with ``bs`` requests is set beside the ``1x1`` row of ``bs // dp`` (its first prompts).
    """
    by_key = {(r["layout"], r["mode"], r["bs"]): r for r in rows}
    for row in rows:
        for key in ("device", "wall"):
            if row.get(f"step ms ({key})") and row.get("floor ms"):
                row[f"x floor ({key})"] = row[f"step ms ({key})"] / row["floor ms"]
        dp = int(row["layout"].split("x")[0])
        ref_key = ("1x1", row["mode"], row["bs"] // dp)
        ref = by_key.get(ref_key)
        if row["layout"] == "1x1" or ref is None or "tok/s" not in ref or "tok/s" not in row:
            continue
        row["step x"] = ref["step ms (wall)"] / row["step ms (wall)"]
        row["tok/s x"] = row["tok/s"] / ref["tok/s"]
        mine, theirs = outputs[(row["layout"], row["mode"], row["bs"])], outputs[ref_key]
        same = sum(a == b for a, b in zip(mine, theirs))
        row["same as 1 GPU"] = f"{same}/{len(theirs)}"


def step_device_ms(engine, prompts: list, new_tokens: int) -> tuple[float, str] | None:
    """Device ms of one decode step of ``prompts`` on the busiest GPU (module docstring) and
    that GPU's :func:`kernel_breakdown`, or None on CPU. Admits them, runs one untimed step, traces ``PROFILED_STEPS`` steps, then gives
    the engine a fresh state."""
    from bench.e2e import STEADY_ROUNDS, admit_all
    from jspec.engine.scheduler import RunStats

    loop = admit_all(engine, prompts, new_tokens)
    stats = RunStats(mode=engine.mode)
    engine._decode_step(loop, stats, STEADY_ROUNDS)  # one dispatch, untimed

    before = stats.num_decode_steps

    def steps():
        while stats.num_decode_steps - before < PROFILED_STEPS and any(loop.running):
            engine._decode_step(loop, stats, STEADY_ROUNDS)
        return engine.state

    try:
        planes = trace_gpu_planes(steps)
    finally:
        real_size._reset(engine)
    if planes is None:
        return None
    rounds = max(stats.num_decode_steps - before, 1)
    busiest = max(planes.values(), key=lambda events: sum(d for *_, d in events))
    return sum(d for *_, d in busiest) / rounds / 1e6, kernel_breakdown(busiest, rounds)


def kernel_breakdown(events: list, rounds: int, top: int = TOP_KERNELS) -> str:
    """The ``top`` kernel families of one GPU's events by device ms per round, as one cell
    (``"nccl 1.02; gemm 2.10; ..."``); a family is the kernel name up to its first digit or
    bracket, NCCL kernels as ``nccl``."""
    totals: collections.Counter = collections.Counter()
    for name, _, ns in events:
        family = "nccl" if "nccl" in name.lower() else re.split(r"[0-9(<\[]", name, 1)[0]
        totals[family[:40] or name[:40]] += ns / rounds / 1e6
    return "; ".join(f"{k} {v:.2f}" for k, v in totals.most_common(top))


def run_config(engine, prompts: list, new_tokens: int, outputs: dict, key: tuple) -> dict:
    """One (layout, mode, bs) row: compile, the timed run, the device time."""
    engine.generate(prompts, 2)  # compiles this bucket's prefill / step / release
    out, stats = engine.generate(prompts, new_tokens)
    outputs[key] = out
    spec = engine.mode == "spec"
    tokens = sum(stats.accept_lens) if spec else sum(stats.batch_sizes)
    row = {
        "step ms (wall)": statistics.median(stats.step_s) * 1e3,
        "tok/s": tokens / stats.decode_s,
        "accept len": stats.mean_accept_len if spec else 1.0,
        "leak check": stats.leak_check,
        "step ms (device)": None,
    }
    device = step_device_ms(engine, prompts, new_tokens)
    if device is not None:
        row["step ms (device)"], row["kernels (device ms / step)"] = device
    return row


def report(header: str, rows: list[dict], allreduce: dict) -> str:
    text = f"{header}\n\n{format_table(rows, COLUMNS)}\n"
    if allreduce:
        text += "\nAll-reduce alone (psum over the TP group):\n\n"
        text += format_table(list(allreduce.values()), AR_COLUMNS) + "\n"
    return text


def _failed(exc: Exception) -> str:
    """The exception being handled, printed, as one table cell."""
    traceback.print_exc()
    return f"FAILED: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"[:160]


def run_real_size(args: argparse.Namespace) -> list[dict]:
    g = real_size.GEOMETRIES[args.model]
    batches, modes = [int(b) for b in args.batches.split(",")], args.modes.split(",")
    measured = {"copy TB/s": copy_bandwidth_tbs(), "TFLOP/s": matmul_tflops()}
    measured["allreduce"] = {}
    t0 = time.perf_counter()
    target = real_size.make_target(g)
    params, draft, dparams = real_size.make_params(g, target)
    rng = np.random.default_rng(0)
    layouts = parse_layouts(args.layouts)
    top = max(bs for dp, _ in layouts for bs in layout_batches(dp, batches))
    prompt_len = min(real_size.PROMPT, g.vocab)
    prompts = [rng.integers(0, g.draft_vocab, prompt_len).tolist() for _ in range(top)]
    header = (
        f"multi_device {g.name} on {len(jax.devices())} x {device_name()}: copy "
        f"{measured['copy TB/s']:.2f} TB/s, bf16 matmul {measured['TFLOP/s']:.0f} TFLOP/s; "
        f"prompts {real_size.PROMPT}, {real_size.NEW} new tokens; page {real_size.PAGE}, topk "
        f"{real_size.TOPK}, steps {real_size.STEPS}, {real_size.DRAFT_TOKENS} draft tokens; "
        f"weights made in {time.perf_counter() - t0:.0f} s; XLA command buffers on"
    )
    print(header + "\n\n" + "\n".join(format_table([{}], COLUMNS).splitlines()[:2]), flush=True)
    rows: list[dict] = []
    outputs: dict = {}

    def save() -> str:
        text = report(header, rows, measured["allreduce"])
        if args.out:  # after every row: partial results survive a timeout
            write_with_json(args.out, text, {"header": header, "rows": rows, **measured,
                                   "allreduce": list(measured["allreduce"].values())})  # fmt: skip
        return text

    for (dp, tp), mode in itertools.product(layouts, modes):
        t1, totals = time.perf_counter(), layout_batches(dp, batches)
        try:
            for r in {r for bs in totals for r in allreduce_plan(g, mode, bs // dp)}:
                if tp > 1 and (tp, r) not in measured["allreduce"]:
                    measured["allreduce"][(tp, r)] = measure_allreduce(r, g.hidden, tp)
            engine = real_size.make_engine(
                g, target, params, draft, dparams, mode, [b // dp for b in totals],
                args.attention_impl, num_devices=dp, tensor_parallel=tp,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - report and keep going
            engine, failed = None, _failed(e)
        for bs in totals:
            row = {"layout": f"{dp}x{tp}", "mode": mode, "bs": bs}
            try:
                if engine is None:
                    raise RuntimeError(failed)
                row.update(
                    gpu_floor(
                        g, engine.weights.target, engine.weights.draft, mode, bs, dp, tp, measured
                    )
                )
                key = (row["layout"], mode, bs)
                row.update(run_config(engine, prompts[:bs], real_size.NEW, outputs, key))
            except Exception as e:  # noqa: BLE001 - report and keep going
                row["note"] = failed if engine is None else _failed(e)
            row["note"] = row.get("note", "") + f" ({time.perf_counter() - t1:.0f} s)"
            rows.append(row)
            compare_rows(rows, outputs)
            print(format_table([row], COLUMNS).splitlines()[-1], flush=True)
            save()
        del engine
        gc.collect()
    print(save(), flush=True)
    return rows


def demo_models() -> tuple:
    """``(target, params, draft_model, draft_params)``: ``jspec demo``'s models at its defaults."""
    from jspec.apps.demo import _build_models, _parser, _plan_models

    demo_args = _parser().parse_args([])
    target, _, _ = _plan_models(demo_args)
    return (target, *_build_models(demo_args, target))


def run_demo(args: argparse.Namespace) -> list[dict]:
    """Every layout x (greedy, spec) on the demo model: the tokens equal one device's."""
    from jspec.engine.scheduler import Engine
    from jspec.engine.state import make_engine_config

    target, params, draft_model, draft = demo_models()
    cfg = target.config
    rng = np.random.default_rng(0)
    lens = rng.integers(4, 41, args.num_prompts)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in lens]
    rows, reference = [], None
    print("\n".join(format_table([{}], DEMO_COLUMNS).splitlines()[:2]), flush=True)
    for dp, tp in parse_layouts(args.layouts):
        ecfg = make_engine_config(
            target,
            page_size=16,
            topk=4,
            num_steps=3,
            num_draft_tokens=8,
            context_len=128,
            max_running_requests=8,
            max_prompt_len=int(lens.max()),
            tensor_parallel=tp,
        )
        for mode, d in (("greedy", None), ("spec", draft)):
            engine = (
                Engine(ecfg, target, params, num_devices=dp)
                if d is None
                else Engine(ecfg, target, params, draft_model, d, num_devices=dp)
            )
            engine.warmup()
            out, stats = engine.generate(prompts, args.max_new_tokens)
            reference = out if reference is None else reference
            rows.append(
                {
                    "layout": f"dp{dp} x tp{tp}",
                    "mode": mode,
                    "tokens/s": stats.tokens_per_s,
                    "accept len": stats.mean_accept_len if mode == "spec" else 1.0,
                    "equal to 1 device": out == reference,
                    "leak check": stats.leak_check,
                }
            )
            print(format_table(rows[-1:], DEMO_COLUMNS).splitlines()[-1], flush=True)
    text = f"multi_device demo on {device_name()}\n\n{format_table(rows, DEMO_COLUMNS)}\n"
    if args.out:
        write_with_json(args.out, text, {"header": text.splitlines()[0], "rows": rows})
    assert all(r["equal to 1 device"] for r in rows), "a layout changed the tokens"
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="8b", help="8b | 1b | quick | demo")
    parser.add_argument("--layouts", default="1x1,1x2,2x1", help="DPxTP, comma-separated")
    parser.add_argument("--batches", default="1,16", help="requests per GPU group")
    parser.add_argument("--modes", default="greedy,spec")
    parser.add_argument("--attention-impl", default="auto")
    parser.add_argument("--num-prompts", type=int, default=16, help="demo only")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="demo only")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    return run_demo(args) if args.model == "demo" else run_real_size(args)


if __name__ == "__main__":
    main(sys.argv[1:])
