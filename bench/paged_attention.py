# Over 400 lines: one bench for every pass shape of the op, its floors, the cuDNN yardstick and
# the launch-knob sweep; split, the sweep would lose the per-pass rows it compares against.
"""Bench the page-table-native paged attention pass (``jspec.kernels.paged_attention``) at 8B size.

    python -m bench.paged_attention [--quick] [--sweep [--sweep-shapes verify:16x2048,...]]
                                    [--passes decode,prefill] [--impl triton|cudnn] [--out DIR]

Llama-3-8B geometry (32 / 8 heads x 128, bf16 pool, page 16), ``impl="triton"`` (``--impl
cudnn``: the causal prefill chunks through cuDNN, :mod:`jspec.kernels.paged_prefill_cudnn`), one
pass each:

* greedy decode: bs 1 / 16 / 64 at 2k / 8k / 32k keys, bs 1 at 128k;
* draft pass A: K = 4 queries over full prefix pages (bs 16 / 64 at 2k / 8k);
* draft pass B: B*K rows of one query over a 3-page expand table, ``kv_lens <= P - 1 + 3``;
* target verify: N = 8 queries over the prefix plus an 8-slot tail with a tree mask;
* causal prefill chunks: 2k and 8k prompts in one chunk, a 32k prompt as 4 chunks of 8k (and
  their sum, the 32k time-to-first-token of attention).

``--capacity`` runs instead decode (bs 1 / 16 / 64) and verify (bs 1 / 16) passes over 128 keys
in page tables 128, 8k and 128k keys wide (``kv128 in 8192``), and decode / verify at bs 1 and 4
over 600-8192 keys in an 8448-key table (an 8k engine's rows: the plan's splits are for more
keys than a row holds): what a short batch pays for the engine's capacity (``kernels us``: each
kernel's time, the attention kernel vs the split merge); with ``--sweep``, the 8k-wide rows at
other split counts, pipeline depths, with and without the tail's own split, and planned for
their keys (``max_kv_len=keys``, the engine's launch hint at its best).

Page tables are random permutations over one shared pool, a different table per timed call
(``--sets``), so a pass reads K/V from HBM, not from the L2 left by the previous call. Columns:
``device us`` (kernel time per call from a profiler trace, the split merge included), ``KV MB``
(distinct K and V bytes the pass must read), ``TB/s`` (those bytes per second), ``TFLOP/s``
(``4 * Hq * D`` per visible query-key pair), ``floor us`` = max(bytes / the measured copy
bandwidth, FLOPs / the measured bf16 matmul rate) and ``% floor`` = floor / device time. Prefill
prompts also run ``jax.nn.dot_product_attention(implementation="cudnn")`` on the same dense causal
problem (a yardstick; ``max err`` of the 2k / 8k prompts is against it, of the other passes
against the pure-jnp reference where that fits in memory).

``--sweep`` times other launch knobs on one shape per pass and prints the best per pass
(``--sweep-shapes KIND:BxKEYS,...``: these decode / draftA / verify shapes instead);
``--budget-s`` stops the sweep when the run has taken that long (finishing inside a device call);
``--out DIR`` writes ``paged_attention.json`` and ``paged_attention.md``. Without a GPU (``--quick``
on CPU) the same passes run at toy size through ``impl="xla"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench._timing import (
    copy_bandwidth_tbs,
    device_name,
    format_table,
    matmul_tflops,
    time_device,
    trace_gpu_events,
)
from jspec.kernels.paged_attention import paged_attention

COLUMNS = [
    "pass",
    "shape",
    "knobs",
    "device us",
    "KV MB",
    "TB/s",
    "TFLOP/s",
    "floor us",
    "% floor",
    "cudnn us",
    "max err",
    "kernels us",
    "error",
]


@dataclasses.dataclass(frozen=True)
class Geometry:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int


LLAMA_8B = Geometry(32, 8, 128, "bfloat16", 16)
TOY = Geometry(4, 2, 32, "float32", 16)


@dataclasses.dataclass(frozen=True)
class Pass:
    """One pass: ``batch`` rows of ``qp`` queries over ``context`` prefix keys (+ a tail)."""

    kind: str  # decode | draftA | draftB | verify | prefill
    batch: int
    qp: int
    context: int  # prefix keys per row (draft B: the table width in keys)
    causal: bool = False
    tail_len: int = 0
    start: int = 0  # prefill: keys before the chunk
    width: int = 0  # the page table's width in keys (0: the context's pages)

    @property
    def label(self) -> str:
        tail = f" +{self.tail_len} tail" if self.tail_len else ""
        wide = f" in {self.width}" if self.width > self.context else ""
        return f"bs{self.batch} q{self.qp} kv{self.context}{tail}{wide}"


def full_passes() -> list[Pass]:
    out = [Pass("decode", bs, 1, ctx) for bs in (1, 16, 64) for ctx in (2048, 8192, 32768)]
    out.append(Pass("decode", 1, 1, 131072))
    out += [Pass("draftA", bs, 4, ctx) for bs in (16, 64) for ctx in (2048, 8192)]
    out += [Pass("draftB", bs * 4, 1, 3 * 16) for bs in (16, 64)]
    out += [Pass("verify", bs, 8, ctx, tail_len=8) for bs in (16, 64) for ctx in (2048, 8192)]
    out += [Pass("prefill", 1, n, n, causal=True) for n in (2048, 8192)]
    out += [Pass("prefill", 1, 8192, s + 8192, causal=True, start=s) for s in (8192, 16384, 24576)]
    out.append(Pass("prefill", 1, 32768, 32768, causal=True))  # one chunk: vs cuDNN
    return out


# An 8k engine's page-table width in keys (8192 + a reserve), for --capacity's longer rows.
WIDE = 8448


def capacity_passes() -> list[Pass]:
    """128-key passes in page tables 128 / 8k / 128k keys wide, and 600-8192-key rows in a
    :data:`WIDE` table: what a short batch pays for an engine's capacity (the split plan
    follows the table's width, or the launch hint's bucket, not the keys read)."""
    out = []
    for width in (128, 8192, 131072):
        out += [Pass("decode", bs, 1, 128, width=width) for bs in (1, 16, 64)]
        out += [Pass("verify", bs, 8, 128, tail_len=8, width=width) for bs in (1, 16)]
    for keys in (600, 2150, 4300, 8192):
        for bs in (1, 4):
            out.append(Pass("decode", bs, 1, keys, width=WIDE))
            out.append(Pass("verify", bs, 8, keys, tail_len=8, width=WIDE))
    return out


def quick_passes() -> list[Pass]:
    return [
        Pass("decode", 2, 1, 64),
        Pass("draftA", 2, 4, 64),
        Pass("draftB", 4, 1, 48),
        Pass("verify", 2, 4, 64, tail_len=4),
        Pass("prefill", 1, 32, 32, causal=True),
    ]


# --sweep: one shape per pass, most important first (the budget may cut the tail of the list).
SWEEP_SHAPES = [
    Pass("prefill", 1, 8192, 8192, causal=True),
    Pass("decode", 1, 1, 32768),
    Pass("verify", 64, 8, 8192, tail_len=8),
    Pass("decode", 64, 1, 8192),
    Pass("draftA", 64, 4, 8192),
    Pass("draftB", 256, 1, 48),
]
# Knob sets besides the default; "splits*F" scales the plan's default split count by F (the
# right count depends on how many programs fit an SM at once: shared memory per program).
DECODE_SWEEP = [
    {"num_stages": 1},
    {"num_stages": 2},
    {"num_stages": 3},
    {"num_stages": 5},
    {"block_n": 64},
    {"block_n": 64, "num_stages": 3},
    {"block_n": 64, "num_stages": 5},
    {"num_warps": 8},
    {"block_n": 64, "num_splits": "splits*2"},
    {"block_n": 64, "num_splits": "splits*0.5"},
    {"block_n": 64, "num_warps": 8},
    {"num_splits": "splits*2"},
    {"num_splits": "splits*1.5"},
    {"num_splits": "splits*0.75"},
    {"num_splits": "splits*0.5"},
    {"tail_split": True},  # verify / extend: the tail in a split of its own, or not
    {"tail_split": False},
]
PREFILL_SWEEP = [
    {"num_stages": 2},
    {"num_stages": 5},
    {"block_n": 128},
    {"block_n": 128, "num_stages": 2},
    {"block_n": 32, "num_stages": 5},
    {"num_warps": 4},
    {"block_m": 64, "num_warps": 4},
    {"block_m": 64, "num_warps": 4, "num_stages": 5},
    {"block_n": 128, "num_stages": 5},
]
CAPACITY_SWEEP = [{"num_splits": n} for n in (1, 4, 16)] + [{"block_n": 32}]
CAPACITY_SWEEP += [{"num_stages": 1}, {"num_stages": 2}, {"tail_split": True}]
CAPACITY_SWEEP += [{"tail_split": False}, {"num_stages": 2, "tail_split": True}]
CAPACITY_SWEEP += [{"max_kv_len": "keys"}]  # planned for the row's keys (an exact hint)
DRAFT_B_SWEEP = [{"block_n": 16}, {"block_n": 64}, {"num_stages": 1}, {"num_stages": 3}]
# Knob sets (the sweep's lists) launching the default plan are skipped (:func:`_resolve`).


# --sweep-shapes KIND:BxKEYS,...: the queries and tail each kind has in :func:`full_passes`.
SHAPE_QUERIES = {"decode": (1, 0), "draftA": (4, 0), "verify": (8, 8)}


def parse_sweep_shapes(text: str) -> list[Pass]:
    """``"verify:16x2048,decode:64x8192"`` -> the passes (ValueError naming a bad item)."""
    out = []
    for item in (x for x in text.split(",") if x):
        kind, _, size = item.partition(":")
        batch, _, keys = size.partition("x")
        if kind not in SHAPE_QUERIES or not (batch.isdigit() and keys.isdigit()):
            raise ValueError(
                f"--sweep-shapes: {item!r} is not KIND:BxKEYS, KIND in {list(SHAPE_QUERIES)}"
            )
        qp, tail = SHAPE_QUERIES[kind]
        out.append(Pass(kind, int(batch), qp, int(keys), tail_len=tail))
    return out


def _sweep_for(p: Pass) -> list[dict[str, Any]]:
    if p.width:
        return CAPACITY_SWEEP
    return {"prefill": PREFILL_SWEEP, "draftB": DRAFT_B_SWEEP}.get(p.kind, DECODE_SWEEP)


def _kv_lens(rng, p: Pass, g: Geometry) -> np.ndarray:
    if p.kind == "draftA":
        return np.full(p.batch, p.context - p.context % g.page_size, np.int32)
    if p.kind == "draftB":  # last-page length + 3 draft steps: <= P - 1 + 3
        return rng.integers(3, g.page_size + 3, p.batch).astype(np.int32)
    return np.full(p.batch, p.context, np.int32)


def make_args(rng, p: Pass, g: Geometry, pools, num_pages: int) -> tuple:
    """``paged_attention``'s array args for one timed call (a fresh random page table)."""
    k_pool, v_pool = pools
    width = -(-max(p.width, p.context) // g.page_size)
    pages = rng.permutation(num_pages)
    if p.kind == "draftB":  # branches of a request share its last prefix page
        rows = pages[: p.batch * width].reshape(p.batch, width)
        rows[:, 0] = np.repeat(pages[-(p.batch // 4) :], 4)[: p.batch]
        table = rows
    else:
        table = pages[: p.batch * width].reshape(p.batch, width)
    q = jax.random.normal(
        jax.random.PRNGKey(int(rng.integers(1 << 30))),
        (p.batch, p.qp, g.num_heads, g.head_dim),
        jnp.dtype(g.dtype),
    )
    kv_lens = _kv_lens(rng, p, g)
    q_lens = jnp.full((p.batch,), p.qp, jnp.int32) if p.causal else None
    tail_ids = tail_mask = None
    if p.tail_len:  # slots of pages no row lists; a random tree mask (ancestors + self)
        free = pages[p.batch * width :][: -(-p.batch * p.tail_len // g.page_size)]
        slots = (free[:, None] * g.page_size + np.arange(g.page_size)).reshape(-1)
        tail_ids = jnp.asarray(slots[: p.batch * p.tail_len].reshape(p.batch, p.tail_len))
        anc = np.tril(rng.random((p.batch, p.qp, p.tail_len)) < 0.5, k=-1)
        tail_mask = jnp.asarray(anc | np.eye(p.qp, p.tail_len, dtype=bool)[None])
    table = jnp.asarray(table, jnp.int32)
    return q, k_pool, v_pool, table, jnp.asarray(kv_lens), q_lens, tail_ids, tail_mask


def _op(p: Pass, g: Geometry, impl: str, knobs: dict[str, Any]):
    """The pass as a function of one arg set: the public op, or with launch knobs the Triton
    wrapper itself (NOTE: ``paged_attention`` rejects ``num_stages=3`` (its knob check wants
    powers of 2), the best depth for some passes; ``impl="xla"`` ignores knobs)."""

    def op(q, k_pool, v_pool, table, kv_lens, q_lens, tail_ids, tail_mask):
        args = (q, k_pool, v_pool, 0, table, kv_lens, q_lens, tail_ids, tail_mask)
        static = {"page_size": g.page_size, "causal": p.causal}
        if knobs and impl == "triton":
            from jspec.kernels.paged_attention_triton import paged_attention_triton

            return paged_attention_triton(*args, **static, **knobs)
        return paged_attention(*args, **static, impl=impl)

    return op


def work(p: Pass, g: Geometry, args: tuple) -> tuple[float, float]:
    """(distinct K + V bytes read, FLOPs of the visible pairs) of one call."""
    kv_lens = np.asarray(args[4]).astype(np.int64)
    itemsize = jnp.dtype(g.dtype).itemsize
    key_bytes = 2 * g.num_kv_heads * g.head_dim * itemsize
    if p.causal:  # query i of a chunk of qp over kv keys sees kv - qp + i + 1 of them
        pairs = float(np.sum(p.qp * (kv_lens - p.qp) + p.qp * (p.qp + 1) // 2))
    else:
        pairs = float(np.sum(kv_lens) * p.qp)
    keys = float(np.sum(kv_lens))
    if p.tail_len:
        pairs += float(np.asarray(args[7]).sum())
        keys += p.batch * p.tail_len
    return keys * key_bytes, 4.0 * pairs * g.num_heads * g.head_dim


def _cudnn(p: Pass, g: Geometry, args: tuple) -> tuple[float | str, Any]:
    """cuDNN on the same dense causal problem (row 0's keys gathered): (device us, output)."""
    if jax.default_backend() != "gpu" or p.kind != "prefill" or p.start:
        return "", None
    try:
        q, k_pool, v_pool, table = args[:4]
        pos = jnp.arange(p.context)
        slots = table[0, pos // g.page_size] * g.page_size + pos % g.page_size
        k, v = k_pool[0, slots][None], v_pool[0, slots][None]

        def attn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

        out = jax.jit(attn)(q, k, v)
        return time_device(attn, [(q, k, v)]), out
    except Exception:  # noqa: BLE001 - the yardstick is optional
        return f"error: {_error()}", None


def _max_err(p: Pass, g: Geometry, op, args: tuple, cudnn_out) -> float | str:
    got = np.asarray(jax.jit(op)(*args)[0], np.float32)
    if cudnn_out is not None:
        return float(np.max(np.abs(got - np.asarray(cudnn_out, np.float32))))
    width = -(-max(p.width, p.context) // g.page_size) * g.page_size
    scores = p.batch * p.qp * g.num_heads * (width + p.tail_len)
    if scores > 1 << 27 or p.batch * width * g.num_kv_heads * g.head_dim > 1 << 29:
        return ""  # the reference's scores or gathered K / V would not fit
    want = np.asarray(jax.jit(_op(p, g, "xla", {}))(*args)[0])
    return float(np.max(np.abs(got - want)))


def bench_pass(rng, p: Pass, g: Geometry, pools, num_pages, impl, knobs, sets, env, check=True):
    row: dict[str, Any] = {
        "pass": p.kind,
        "shape": p.label,
        "knobs": ",".join(f"{k}={v}" for k, v in knobs.items()),
    }
    try:
        arg_sets = [make_args(rng, p, g, pools, num_pages) for _ in range(sets)]
        op = _op(p, g, impl, knobs)
        us = time_device(op, arg_sets)
        kv_bytes, flops = work(p, g, arg_sets[0])
        floor = max(kv_bytes / env["copy_tbs"] / 1e6, flops / env["matmul_tflops"] / 1e6)
        row.update(
            {
                "device us": us,
                "KV MB": kv_bytes / 1e6,
                "TB/s": kv_bytes / us / 1e6,
                "TFLOP/s": flops / us / 1e6,
                "floor us": floor,
                "% floor": 100 * floor / us,
            }
        )
        if p.width and jax.default_backend() == "gpu":  # --capacity: the kernel vs the merge
            jitted = jax.jit(op)
            jax.block_until_ready(jitted(*arg_sets[0]))
            events = trace_gpu_events(lambda: [jitted(*a) for a in arg_sets]) or []
            per: dict[str, float] = {}
            for name, _, ns in events:
                per[name[:32]] = per.get(name[:32], 0.0) + ns / 1e3 / len(arg_sets)
            row["kernels us"] = "; ".join(f"{k} {v:.1f}" for k, v in per.items())
        if check:
            cudnn_us, cudnn_out = _cudnn(p, g, arg_sets[0])
            row["cudnn us"] = cudnn_us
            row["max err"] = _max_err(p, g, op, arg_sets[0], cudnn_out)
    except Exception:  # noqa: BLE001 - one failing pass must not hide the others
        row["error"] = _error()
    return row


def _plan(p: Pass, g: Geometry, knobs: dict[str, Any]) -> tuple:
    from jspec.kernels.paged_attention_triton import launch_plan, plan_pages

    knobs = dict(knobs)
    hint = knobs.pop("max_kv_len", None)  # the launch hint: a narrower planned width
    grid, meta, opts = launch_plan(
        p.batch,
        p.qp,
        g.num_heads,
        g.num_kv_heads,
        g.head_dim,
        plan_pages(-(-max(p.width, p.context) // g.page_size), g.page_size, hint),
        g.page_size,
        p.tail_len,
        jnp.dtype(g.dtype),
        causal=p.causal,
        **knobs,
    )
    return grid, meta, opts


def _resolve(knobs: dict[str, Any], p: Pass, g: Geometry) -> dict[str, Any] | None:
    """Turn ``num_splits: "splits*F"`` into a count from the default plan; None when the knobs
    launch exactly the default plan (nothing new to time)."""
    default = _plan(p, g, {})
    if knobs.get("max_kv_len") == "keys":
        knobs = {**knobs, "max_kv_len": p.context}
    if isinstance(knobs.get("num_splits"), str):
        factor = float(knobs["num_splits"].removeprefix("splits*"))
        knobs = {**knobs, "num_splits": max(1, int(default[0][1] * factor))}
    return None if _plan(p, g, knobs) == default else knobs


def _error(max_len: int = 160) -> str:
    """The exception being handled as one short cell (its type and first message line)."""
    import sys

    exc = sys.exc_info()[1]
    lines = [x for x in str(exc).splitlines() if x.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:max_len]


def _cell(row: dict[str, Any]) -> str:
    """A progress line's result: device us, or the error."""
    us = row.get("device us")
    return f"{us:.1f} us" if us is not None else str(row.get("error"))


def _write(out_dir: str, report: dict[str, Any], text: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "paged_attention.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(out_dir, "paged_attention.md"), "w") as f:
        f.write(text + "\n")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="toy shapes (CPU smoke run)")
    parser.add_argument("--sweep", action="store_true", help="also time other launch knobs")
    parser.add_argument("--passes", default="", help="only these kinds (decode,draftA,...)")
    parser.add_argument(
        "--capacity", action="store_true", help="128-key passes in wide page tables only"
    )
    parser.add_argument(
        "--sweep-shapes", default="", help="sweep these instead: KIND:BxKEYS,... (GPU)"
    )
    parser.add_argument(
        "--impl",
        default="triton",
        choices=("triton", "cudnn"),
        help="the GPU implementation (cudnn: causal prefill chunks through cuDNN, the rest Triton)",
    )
    parser.add_argument("--sets", type=int, default=0, help="page tables per timing")
    parser.add_argument("--budget-s", type=float, default=270.0, help="stop the sweep here")
    parser.add_argument("--out", default="", help="write paged_attention.{json,md} here")
    args = parser.parse_args(argv)
    try:  # validated before anything compiles
        sweep_shapes = parse_sweep_shapes(args.sweep_shapes)
    except ValueError as e:
        parser.error(str(e))
    t0 = time.perf_counter()
    on_gpu = jax.default_backend() == "gpu"
    g = LLAMA_8B if on_gpu and not args.quick else TOY
    impl = args.impl if on_gpu else "xla"
    passes = quick_passes() if args.quick or not on_gpu else full_passes()
    if args.capacity:
        passes = (
            capacity_passes()
            if on_gpu and not args.quick
            else [Pass("decode", 2, 1, 32, width=256)]
        )
    kinds = [k for k in args.passes.split(",") if k]
    passes = [p for p in passes if not kinds or p.kind in kinds]
    sets = args.sets or (2 if args.quick else 3)
    env = {"copy_tbs": copy_bandwidth_tbs(), "matmul_tflops": matmul_tflops()}
    # One pool for every pass: enough distinct pages for the largest (plus tails).
    extra = sweep_shapes if args.sweep and g is LLAMA_8B else []
    need = max(
        p.batch * (-(-max(p.width, p.context) // g.page_size) + p.tail_len) for p in passes + extra
    )
    num_pages = need + 64
    num_slots = num_pages * g.page_size
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    shape = (1, num_slots, g.num_kv_heads, g.head_dim)
    pools = tuple(jax.random.normal(k, shape, jnp.dtype(g.dtype)) for k in keys)
    header = (
        f"device {device_name()}, impl={impl}, copy {env['copy_tbs']:.2f} TB/s, "
        f"bf16 matmul {env['matmul_tflops']:.0f} TFLOP/s, pool {num_slots} slots"
    )
    print(header, flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for p in passes:
        rows.append(bench_pass(rng, p, g, pools, num_pages, impl, {}, sets, env))
        print(f"  {p.kind} {p.label}: {_cell(rows[-1])}", flush=True)
    prefill = [r for r in rows if r["pass"] == "prefill" and "device us" in r]
    chunks = [r for r in prefill if r["shape"].startswith("bs1 q8192")]
    if len(chunks) == 4:  # the 32k prompt as 4 chunks of 8k; cuDNN from the one-chunk row
        total = {k: sum(r[k] for r in chunks) for k in ("device us", "floor us", "KV MB")}
        one = [r for r in prefill if r["shape"].startswith("bs1 q32768")]
        rows.append(
            {
                "pass": "prefill",
                "shape": "32k prompt (4 chunks)",
                **total,
                "% floor": 100 * total["floor us"] / total["device us"],
                "TFLOP/s": sum(r["TFLOP/s"] * r["device us"] for r in chunks) / total["device us"],
                "cudnn us": one[0].get("cudnn us", "") if one else "",
            }
        )
    table = format_table(rows, COLUMNS)
    print(table, flush=True)
    report: dict[str, Any] = {"header": header, "env": env, "rows": rows}
    text = f"{header}\n\n{table}\n"
    if args.out:  # written now and after each sweep shape: a timed-out run keeps its results
        _write(args.out, report, text)
    if args.sweep:  # off GPU: the toy passes through impl="xla" (knobs ignored; a smoke run)
        shapes = SWEEP_SHAPES if g is LLAMA_8B else quick_passes()
        shapes = extra or shapes
        if args.capacity:
            shapes = [p for p in passes if p.width in (8192, WIDE)] or passes
        sweep_rows, best, skipped = [], [], []
        report.update({"sweep": sweep_rows, "best": best, "skipped": skipped})
        for p in [p for p in shapes if not kinds or p.kind in kinds]:
            base = bench_pass(rng, p, g, pools, num_pages, impl, {}, sets, env, check=False)
            results, seen = [base], set()
            for knobs in _sweep_for(p):
                if time.perf_counter() - t0 > args.budget_s:
                    skipped.append(f"{p.kind} {p.label} {knobs}")
                    continue
                knobs = _resolve(knobs, p, g)
                if knobs is None or tuple(knobs.items()) in seen:
                    continue
                seen.add(tuple(knobs.items()))
                results.append(
                    bench_pass(rng, p, g, pools, num_pages, impl, knobs, sets, env, False)
                )
                print(f"  sweep {p.kind} {results[-1]['knobs']}: {_cell(results[-1])}", flush=True)
            sweep_rows += results
            ok = [r for r in results if "device us" in r]
            if ok and "device us" in base:
                top = min(ok, key=lambda r: r["device us"])
                best.append(
                    {
                        "pass": p.kind,
                        "shape": p.label,
                        "default us": base["device us"],
                        "best knobs": top["knobs"] or "(default)",
                        "best us": top["device us"],
                        "x vs default": base["device us"] / top["device us"],
                        "% floor": top["% floor"],
                    }
                )
            sweep_text = (
                f"\n### sweep\n\n{format_table(sweep_rows, COLUMNS[:9] + ['error'])}\n\n"
                f"### best per pass\n\n{format_table(best)}\n"
            )
            if args.out:
                _write(args.out, report, text + sweep_text)
        print(sweep_text, flush=True)
        if skipped:
            print(f"(budget {args.budget_s:.0f} s: skipped {len(skipped)}: {skipped})")
        text += sweep_text
    report["seconds"] = time.perf_counter() - t0
    print(f"({report['seconds']:.0f} s)", flush=True)
    if args.out:
        _write(args.out, report, text)
    return rows


if __name__ == "__main__":
    main()
