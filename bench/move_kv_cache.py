"""Bench ``move_kv_cache``: xla / pallas / triton vs torch, random and per-request-local slots.

    python -m bench.move_kv_cache [--quick] [--sweep] [--impls xla,pallas,triton,torch]

Shapes (default, shared/ANCHORS.md): 32 layers x K and V, 8 KV heads x 128 x bf16 (2 KB rows),
100k-slot pool, n in {64, 256, 1024, 4096} moved rows. Patterns:

* ``random``: distinct random tgt and src slots (disjoint).
* ``local``: packed per-request pairs like the accept-path compaction: each request owns a
  random 2-page window ``w`` and moves 5 rows ``w[j + d] -> w[j]`` (shift ``d`` in 1..5, so
  src and tgt overlap inside a request).

Columns: device us = R distinct (tgt, src) sets threaded through one jitted, unrolled
``lax.scan`` with the pool as the carry (donated, in place), divided by R; wall us = one
donated jitted call, median; torch us = ``pool[:, tgt] = pool[:, src]`` on a stacked
``[2*layers, slots, H*D]`` CUDA pool (CUDA events); TB/s and % of the measured copy rate count
``2 * n * layers * 2 * row_bytes`` (read + write) over the device time, against the larger of
``bench._timing.copy_bandwidth_tbs`` and an in-place f32 ``x + 1`` scan over 1 GiB (the
shared helper's fresh-output uint8 copy read only 1.2 TB/s on the H200); "% 4.25" is against
the 4.25 TB/s anchor of shared/ANCHORS.md.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench._timing import copy_bandwidth_tbs, device_name, format_table, time_torch
from jspec.kernels._common import on_gpu
from jspec.kv.pool import KVPool, move_kv_cache

# shared/ANCHORS.md: device-to-device copy rate measured on the project's H200 (read + write).
ANCHOR_COPY_TBS = 4.25
PAGE_SIZE = 16
LOCAL_WINDOW = 2 * PAGE_SIZE
LOCAL_PAIRS = 5
# Tuning variants tried with --sweep: (block_rows, block_elems, num_warps, single_block_rows);
# the first is the module default.
SWEEP = {
    "pallas": (
        (16, 8192, 8, 64),
        (8, 8192, 8, 64),
        (32, 8192, 8, 64),
        (16, 16384, 8, 64),
        (16, 8192, 4, 64),
        (16, 8192, 8, 256),
        (16, 8192, 8, 16),
    ),
    "triton": ((16, 8192, 8, 64), (8, 8192, 8, 64), (16, 8192, 8, 256)),
}
_TUNING_KEYS = ("block_rows", "block_elems", "num_warps", "single_block_rows")


def _pairs(
    rng: np.random.Generator, pattern: str, n: int, num_slots: int
) -> tuple[np.ndarray, np.ndarray]:
    """(tgt, src) i32[n] slot ids, never touching the padding page."""
    if pattern == "random":
        slots = rng.choice(np.arange(PAGE_SIZE, num_slots), size=2 * n, replace=False)
        return slots[:n].astype(np.int32), slots[n:].astype(np.int32)
    num_req = -(-n // LOCAL_PAIRS)
    num_windows = (num_slots - PAGE_SIZE) // LOCAL_WINDOW
    starts = PAGE_SIZE + LOCAL_WINDOW * rng.choice(num_windows, size=num_req, replace=False)
    shift = rng.integers(1, LOCAL_PAIRS + 1, size=num_req)
    j = np.arange(LOCAL_PAIRS)
    tgt = (starts[:, None] + j[None, :]).reshape(-1)[:n]
    src = (starts[:, None] + shift[:, None] + j[None, :]).reshape(-1)[:n]
    return tgt.astype(np.int32), src.astype(np.int32)


def _device_us(
    move, pool: KVPool, tgts: jax.Array, srcs: jax.Array, repeats: int
) -> tuple[float, KVPool]:
    """Microseconds per call: R sets in one jitted unrolled scan over the (donated) pool."""

    @functools.partial(jax.jit, donate_argnums=0)
    def run(pool, tgts, srcs):
        def body(p, ts):
            return move(p, ts[0], ts[1]), None

        return jax.lax.scan(body, pool, (tgts, srcs), unroll=True)[0]

    pool = jax.block_until_ready(run(pool, tgts, srcs))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        pool = jax.block_until_ready(run(pool, tgts, srcs))
        best = min(best, time.perf_counter() - t0)
    return best / tgts.shape[0] * 1e6, pool


def _wall_us(
    move, pool: KVPool, tgt: jax.Array, src: jax.Array, iters: int
) -> tuple[float, KVPool]:
    samples = []
    for i in range(iters + 3):
        t0 = time.perf_counter()
        pool = jax.block_until_ready(move(pool, tgt, src))
        if i >= 3:
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6, pool


def _check(move, pool: KVPool, tgt: jax.Array, src: jax.Array) -> tuple[bool, KVPool]:
    """One call vs the gather-then-scatter expectation on the moved rows (distinct tgt)."""
    want_k, want_v = pool.k[:, src], pool.v[:, src]
    pool = move(pool, tgt, src)
    ok = bool(jnp.array_equal(pool.k[:, tgt], want_k) & jnp.array_equal(pool.v[:, tgt], want_v))
    return ok, pool


def _torch_us(shape, dtype_name: str, sets, iters: int) -> float:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    num_layers, num_slots, row_width = shape
    pool = torch.zeros(
        (2 * num_layers, num_slots, row_width), dtype=getattr(torch, dtype_name), device=device
    )
    idx = [
        (torch.as_tensor(t, device=device).long(), torch.as_tensor(s, device=device).long())
        for t, s in sets
    ]
    state = {"i": 0}

    def step():
        t, s = idx[state["i"] % len(idx)]
        state["i"] += 1
        pool[:, t] = pool[:, s]

    try:
        return time_torch(step, iters=iters)
    finally:
        pool = None  # free the GPU buffer (step() holds it through the closure cell)
        if device == "cuda":
            torch.cuda.empty_cache()


def _variants(impls: list[str], sweep: bool) -> list[tuple[str, dict]]:
    out = []
    for impl in impls:
        if impl in SWEEP:
            configs = SWEEP[impl] if sweep else SWEEP[impl][:1]
            out += [(impl, dict(zip(_TUNING_KEYS, config))) for config in configs]
        else:
            out.append((impl, {}))
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--sweep", action="store_true", help="also try tuning variants")
    parser.add_argument("--impls", default="", help="comma list of xla,pallas,triton,torch")
    parser.add_argument("--sizes", default="", help="comma list of n")
    parser.add_argument("--reps", type=int, default=0, help="distinct sets per timing scan")
    parser.add_argument("--no-wall", action="store_true", help="skip the wall-time column")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="skip the remaining rows after this many seconds (0: no limit)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        num_layers, heads, head_dim, num_pages, sizes, reps = 2, 2, 64, 256, (16, 64), 2
    else:
        num_layers, heads, head_dim, num_pages, sizes, reps = (
            32,
            8,
            128,
            6250,
            (64, 256, 1024, 4096),
            16,
        )
    sizes = tuple(int(s) for s in args.sizes.split(",")) if args.sizes else sizes
    reps = args.reps or reps
    gpu = on_gpu()
    default_impls = ["xla", "pallas"] + (["triton"] if gpu else []) + ["torch"]
    impls = args.impls.split(",") if args.impls else default_impls
    if args.quick and not gpu:
        impls = [i for i in impls if i != "triton"]
    dtype_name = "bfloat16"
    num_slots = num_pages * PAGE_SIZE + PAGE_SIZE
    row_width = heads * head_dim
    row_bytes = row_width * jnp.dtype(dtype_name).itemsize
    copy_tbs = copy_bandwidth_tbs()
    print(
        f"# move_kv_cache on {device_name()}: {num_layers} layers x K,V, {heads}x{head_dim} "
        f"{dtype_name} ({row_bytes} B rows), {num_slots} slots; copy rate {copy_tbs:.2f} "
        f"TB/s (bench._timing.copy_bandwidth_tbs)",
        flush=True,
    )
    shape4 = (num_layers, num_slots, heads, head_dim)
    key = jax.random.PRNGKey(0)
    pool = KVPool(
        k=jax.random.normal(key, shape4, dtype_name),
        v=jax.random.normal(jax.random.fold_in(key, 1), shape4, dtype_name),
        page_size=PAGE_SIZE,
    )
    rng = np.random.default_rng(0)
    rows: list[dict] = []
    deadline = time.perf_counter() + (args.budget_s or float("inf"))
    lines = format_table([dict.fromkeys(_COLUMNS, "")], _COLUMNS).splitlines()
    print("\n".join(lines[:2]), flush=True)
    for n in sizes:
        for pattern in ("random", "local"):
            sets = [_pairs(rng, pattern, n, num_slots) for _ in range(reps)]
            tgts = jnp.asarray(np.stack([t for t, _ in sets]))
            srcs = jnp.asarray(np.stack([s for _, s in sets]))
            moved_bytes = 2 * n * num_layers * 2 * row_bytes
            torch_us = None
            for impl, tuning in _variants(impls, args.sweep):
                if time.perf_counter() > deadline:
                    break
                row = dict.fromkeys(_COLUMNS, "")
                row.update(
                    {
                        "n": n,
                        "pattern": pattern,
                        "impl": impl,
                        "tuning": "/".join(str(tuning[k]) for k in tuning) or "-",
                    }
                )
                try:
                    if impl == "torch":
                        torch_us = _torch_us(
                            (num_layers, num_slots, row_width), dtype_name, sets, 30 if gpu else 5
                        )
                        dev_us = torch_us
                        row.update({"device us": dev_us, "wall us": "-", "ok": "-"})
                    else:
                        move = functools.partial(move_kv_cache, impl=impl, **tuning)
                        ok, pool = _check(move, pool, tgts[0], srcs[0])
                        dev_us, pool = _device_us(move, pool, tgts, srcs, 3)
                        wall_us = "-"
                        if not args.no_wall:
                            wall_us, pool = _wall_us(move, pool, tgts[1], srcs[1], 30 if gpu else 3)
                        row.update({"device us": dev_us, "wall us": wall_us, "ok": ok})
                    tbs = moved_bytes / (dev_us * 1e-6) / 1e12
                    row.update(
                        {
                            "TB/s": tbs,
                            "% copy": 100 * tbs / copy_tbs,
                            "% 4.25": 100 * tbs / ANCHOR_COPY_TBS,
                        }
                    )
                except Exception as exc:  # noqa: BLE001 - report the failure, keep going
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    traceback.print_exc()
                    if pool.k.is_deleted():
                        pool = KVPool(
                            k=jnp.zeros(shape4, dtype_name),
                            v=jnp.zeros(shape4, dtype_name),
                            page_size=PAGE_SIZE,
                        )
                rows.append(row)
                print(format_table([row], _COLUMNS).splitlines()[-1], flush=True)
    return rows


_COLUMNS = (
    "n",
    "pattern",
    "impl",
    "tuning",
    "device us",
    "wall us",
    "TB/s",
    "% copy",
    "% 4.25",
    "ok",
    "error",
)


if __name__ == "__main__":
    result = main()
    print()
    print(format_table(result, _COLUMNS))
