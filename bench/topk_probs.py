"""Bench the draft's top-k proposal ``topk_probs``: xla (lax.top_k + logsumexp) vs the fused
Pallas kernel (block_rows / num_warps sweep) vs torch ``topk(softmax(x))`` (sglang's
``fast_topk`` path).

    python -m bench.topk_probs [--quick] [--rows 512,4096] [--vocab 512,32000] [--sets 16]

Rows R = bs * topk draft branches (512 = the e2e bs64/topk8 step); K = 8. GB/s counts the
logits read once (R * V * 4 bytes): the floor of any implementation.
"""

from __future__ import annotations

import argparse
import functools

import jax
import numpy as np

from bench._timing import format_table, time_impl, time_torch, torch_us_cell
from jspec.kernels.topk_probs import topk_probs

COLUMNS = ["shape", "impl", "tuning", "device us", "wall us", "GB/s", "torch us", "error"]
TOPK = 8


def _torch_us(logits: np.ndarray) -> float:
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.as_tensor(np.array(logits), device=dev)
    return time_torch(lambda: torch.topk(torch.softmax(x, -1), TOPK, dim=-1), iters=30)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    parser.add_argument("--rows", default="", help="comma-separated row counts")
    parser.add_argument("--vocab", default="", help="comma-separated vocab sizes")
    parser.add_argument("--sets", type=int, default=0, help="distinct input sets per timing")
    args = parser.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",") if r] or (
        [16] if args.quick else [64, 512, 4096]
    )
    vocabs = [int(v) for v in args.vocab.split(",") if v] or (
        [100] if args.quick else [512, 4096, 32000]
    )
    sets = args.sets or (2 if args.quick else 16)
    tunings = [(None, None)] if args.quick else [(None, None), (1, 4), (2, 4), (4, 8)]
    rng = np.random.default_rng(0)
    out = []
    for r in rows_list:
        for v in vocabs:
            arg_sets = [
                (jax.numpy.asarray(rng.standard_normal((r, v)), jax.numpy.float32),)
                for _ in range(sets)
            ]
            shape = f"R={r} V={v} K={TOPK}"
            torch_us = torch_us_cell(lambda a=arg_sets[0]: _torch_us(np.asarray(a[0])))
            ref = topk_probs(arg_sets[0][0], TOPK, impl="xla")

            def same_indices(op, x=arg_sets[0][0], ref=ref):
                if not np.array_equal(np.asarray(op(x)[1]), np.asarray(ref[1])):
                    raise AssertionError("indices differ from the reference")

            cases = [("xla", None, None)] + [("pallas", br, nw) for br, nw in tunings]
            for impl, block_rows, num_warps in cases:
                row = {
                    "shape": shape,
                    "impl": impl,
                    "torch us": torch_us,
                    "tuning": "-"
                    if impl == "xla"
                    else f"{block_rows or 'auto'}/{num_warps or 'auto'}",
                }
                kw = {} if impl == "xla" else {"block_rows": block_rows, "num_warps": num_warps}
                op = functools.partial(topk_probs, topk=TOPK, impl=impl, **kw)
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
