"""Bench the draft layout: ``out_cache_loc`` + prefix-tail pair generation in one call.

    python -m bench.draft_layout [--quick] [--impls xla,pallas] [--copy-layers 2]

Shapes (issue "Tree drafting"; shared/ANCHORS.md): K=8, S=5, bs in {1, 8, 64, 256},
P in {1, 16, 64}, committed lengths L uniform in [1024, 2048), rows of random slot ids.

Columns:
* device us: R distinct (rpi, L) sets in one jitted ``lax.scan`` (``bench._timing.time_device``;
  includes one checksum read of the outputs per iteration), divided by R.
* wall us: one standalone jitted call, median (dispatch included).
* torch us: the same op in PyTorch the way sglang's V2 writes it (an advanced-index gather for
  out_cache_loc, boolean-mask selects for the pairs), CUDA events on GPU.
* pairs: mean (K-1)*sum(lp) copies per call (the hole duplication's KV rows).
* dup copy us: the KV copy itself, reported separately (not part of the layout target):
  ``move_kv_cache`` (impl "auto") of those pairs over ``--copy-layers`` layers x K and V,
  8 heads x 128 bf16 (2 KB rows), donated, wall time median.
Target: xla or pallas layout + pairs at bs=256 under 10 us device time on the H200.
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

from bench._timing import device_name, format_table, time_device, time_torch, time_wall
from jspec.config import TreeGeometry
from jspec.kernels.draft_cache_loc import draft_cache_loc, max_prefix_tail_pairs
from jspec.kv.pool import KVPool, move_kv_cache

TOPK, NUM_STEPS = 8, 5
COLUMNS = ("shape", "impl", "device us", "wall us", "torch us", "pairs", "dup copy us")


def _case(rng: np.random.Generator, batch: int, page_size: int, lo: int, hi: int, reps: int):
    """req_to_token i32[B+1, W] (row 0 padding) and ``reps`` (rpi, seq_lens) sets."""
    region = -(-(page_size - 1 + NUM_STEPS) // page_size) * page_size
    width = hi + TOPK * region
    num_slots = (batch * width // page_size + 2) * page_size
    r2t = np.zeros((batch + 1, width), np.int32)
    r2t[1:] = rng.integers(page_size, num_slots, size=(batch, width), dtype=np.int32)
    sets = [
        (
            rng.permutation(np.arange(1, batch + 1)).astype(np.int32),
            rng.integers(lo, hi, size=batch).astype(np.int32),
        )
        for _ in range(reps)
    ]
    return r2t, sets, num_slots


def _torch_layout_fn(r2t: np.ndarray, rpi: np.ndarray, seq: np.ndarray, page_size: int):
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    req_to_token = torch.as_tensor(r2t, device=device)
    rpi_t = torch.as_tensor(rpi, device=device).long()
    seq_t = torch.as_tensor(seq, device=device).long()
    t = torch.arange(TOPK, device=device)
    s = torch.arange(NUM_STEPS, device=device)
    o = torch.arange(page_size, device=device)
    tb = torch.arange(1, TOPK, device=device)

    def run():
        lp = seq_t % page_size
        base = seq_t - lp
        region = (lp + NUM_STEPS + page_size - 1) // page_size * page_size
        pos = (base + lp)[:, None, None] + t[None, :, None] * region[:, None, None] + s
        out = req_to_token[rpi_t[:, None, None], pos]
        if page_size == 1:
            return out
        rows = rpi_t[:, None, None]
        mask = (o[None, None, :] < lp[:, None, None]).expand(-1, TOPK - 1, -1)
        src = req_to_token[rows, (base[:, None, None] + o).expand(-1, TOPK - 1, -1)][mask]
        tgt = req_to_token[
            rows, base[:, None, None] + tb[None, :, None] * region[:, None, None] + o
        ][mask]
        return out, tgt, src

    return run


def _copy_us(pool_shape, num_slots: int, tgt: jax.Array, src: jax.Array, iters: int) -> float:
    state = {
        "pool": KVPool(
            k=jnp.zeros(pool_shape, jnp.bfloat16),
            v=jnp.zeros(pool_shape, jnp.bfloat16),
            page_size=1,
        )
    }
    samples = []
    try:
        for i in range(iters + 2):
            t0 = time.perf_counter()
            state["pool"] = jax.block_until_ready(move_kv_cache(state["pool"], tgt, src))
            if i >= 2:
                samples.append(time.perf_counter() - t0)
    finally:
        state.clear()
    return statistics.median(samples) * 1e6


def _err(e: BaseException) -> str:
    return f"ERR {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--impls", default="xla,pallas", help="comma list of xla,pallas")
    parser.add_argument(
        "--copy-layers",
        type=int,
        default=2,
        help="layers of the duplication-copy pool (0: skip the copy column)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        batches, pages, lo, hi, reps, iters = (1, 8), (1, 16), 16, 64, 2, 3
        heads, head_dim = 1, 8
    else:
        batches, pages, lo, hi, reps, iters = (1, 8, 64, 256), (1, 16, 64), 1024, 2048, 10, 30
        heads, head_dim = 8, 128
    impls = [i for i in args.impls.split(",") if i]
    print(
        f"# draft_layout on {device_name()}: K={TOPK} S={NUM_STEPS}, L in [{lo}, {hi})", flush=True
    )
    print(
        "\n".join(format_table([dict.fromkeys(COLUMNS, "")], COLUMNS).splitlines()[:2]), flush=True
    )
    rng = np.random.default_rng(0)
    rows: list[dict] = []
    for page_size in pages:
        for batch in batches:
            r2t_np, sets, num_slots = _case(rng, batch, page_size, lo, hi, reps)
            r2t = jnp.asarray(r2t_np)
            geometry = TreeGeometry(
                topk=TOPK, num_steps=NUM_STEPS, num_draft_tokens=1, page_size=page_size
            )
            max_pairs = max_prefix_tail_pairs(batch, geometry=geometry)
            shape = f"bs={batch} K={TOPK} S={NUM_STEPS} P={page_size}"
            mean_pairs = float(np.mean([(TOPK - 1) * np.sum(s % page_size) for _, s in sets]))
            torch_us: object = "-"
            try:
                torch_us = time_torch(_torch_layout_fn(r2t_np, *sets[0], page_size), iters=iters)
            except Exception as e:  # noqa: BLE001 - report, keep going
                torch_us = _err(e)
            copy_us: object = "-"
            if args.copy_layers and max_pairs:
                try:
                    _, tgt, src, _ = draft_cache_loc(
                        r2t,
                        *map(jnp.asarray, sets[0]),
                        geometry=geometry,
                        max_pairs=max_pairs,
                    )
                    copy_us = _copy_us(
                        (args.copy_layers, num_slots, heads, head_dim), num_slots, tgt, src, iters
                    )
                except Exception as e:  # noqa: BLE001
                    copy_us = _err(e)
            for impl in impls:
                row = dict.fromkeys(COLUMNS, "")
                row.update(
                    {
                        "shape": shape,
                        "impl": impl,
                        "torch us": torch_us,
                        "pairs": mean_pairs,
                        "dup copy us": copy_us,
                    }
                )
                op = functools.partial(
                    draft_cache_loc,
                    geometry=geometry,
                    max_pairs=max_pairs,
                    impl=impl,
                )
                arg_sets = [(r2t, jnp.asarray(rpi), jnp.asarray(seq)) for rpi, seq in sets]
                try:
                    row["device us"] = time_device(op, arg_sets)
                    row["wall us"] = time_wall(op, *arg_sets[0], iters=iters)
                except Exception as e:  # noqa: BLE001
                    row["device us"] = _err(e)
                    traceback.print_exc()
                rows.append(row)
                print(format_table([row], COLUMNS).splitlines()[-1], flush=True)
    return rows  # the header and every row are printed as they come: one table


if __name__ == "__main__":
    main()
