"""Bench the draft's top-k proposal ``topk_probs``: xla (lax.top_k + logsumexp) vs the fused
Pallas kernel (block_rows / num_warps sweep; rows up to 16384 columns) vs the chunked Triton
kernel (block_cols sweep; any width) vs torch ``topk(softmax(x))`` (sglang's ``fast_topk`` path).

    python -m bench.topk_probs [--quick] [--rows 512,4096] [--vocab 512,32000] [--sets 16]
                               [--topk 8]

Rows R = bs * topk draft branches (512 = the e2e bs64/topk8 step; 1 / 4 / 256 = the 8B spec
step's extend and draft rows at bs 1 and 64, topk 4). GB/s counts the logits read once
(R * V * 4 bytes): the floor of any implementation.
"""

from __future__ import annotations

import argparse
import functools

import jax
import numpy as np

from bench._timing import format_table, time_impl, time_torch, torch_us_cell
from jspec.config import next_power_of_2
from jspec.kernels.topk_probs import MAX_COLS, topk_probs

COLUMNS = ["shape", "impl", "tuning", "device us", "wall us", "GB/s", "torch us", "error"]


def _torch_us(logits: np.ndarray, topk: int) -> float:
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.as_tensor(np.array(logits), device=dev)
    return time_torch(lambda: torch.topk(torch.softmax(x, -1), topk, dim=-1), iters=30)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    parser.add_argument("--rows", default="", help="comma-separated row counts")
    parser.add_argument("--vocab", default="", help="comma-separated vocab sizes")
    parser.add_argument("--sets", type=int, default=0, help="distinct input sets per timing")
    parser.add_argument("--topk", type=int, default=8)
    args = parser.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",") if r] or (
        [16] if args.quick else [64, 512, 4096]
    )
    vocabs = [int(v) for v in args.vocab.split(",") if v] or (
        [100] if args.quick else [512, 4096, 32000]
    )
    sets = args.sets or (2 if args.quick else 16)
    topk = args.topk
    tunings = [(None, None)] if args.quick else [(None, None), (1, 4), (2, 4), (4, 8)]
    # Triton: columns per program (None: launch_plan's default); GPU only.
    col_tunings = [None, 1024, 2048, 4096, 8192] if jax.default_backend() == "gpu" else []
    rng = np.random.default_rng(0)
    out = []
    for r in rows_list:
        for v in vocabs:
            arg_sets = [
                (jax.numpy.asarray(rng.standard_normal((r, v)), jax.numpy.float32),)
                for _ in range(sets)
            ]
            shape = f"R={r} V={v} K={topk}"
            torch_us = torch_us_cell(lambda a=arg_sets[0]: _torch_us(np.asarray(a[0]), topk))
            ref = topk_probs(arg_sets[0][0], topk, impl="xla")

            def same_indices(op, x=arg_sets[0][0], ref=ref):
                if not np.array_equal(np.asarray(op(x)[1]), np.asarray(ref[1])):
                    raise AssertionError("indices differ from the reference")

            cases = [("xla", "-", {})]
            if next_power_of_2(v) <= MAX_COLS:  # wider: "pallas" runs the Triton kernel
                cases += [
                    (
                        "pallas",
                        f"{br or 'auto'}/{nw or 'auto'}",
                        {"block_rows": br, "num_warps": nw},
                    )
                    for br, nw in tunings
                ]
            cases += [("triton", f"cols {bc or 'auto'}", {"block_cols": bc}) for bc in col_tunings]
            for impl, tuning, kw in cases:
                row = {"shape": shape, "impl": impl, "torch us": torch_us, "tuning": tuning}
                op = functools.partial(topk_probs, topk=topk, impl=impl, **kw)
                out.append(
                    time_impl(
                        row,
                        op,
                        arg_sets,
                        wall_iters=5 if args.quick else 30,
                        check=same_indices,
                        extra=lambda us, r=r, v=v: {"GB/s": r * v * 4 / us / 1e3},
                    )
                )
    print(format_table(out, COLUMNS), flush=True)
    return out


if __name__ == "__main__":
    main()
