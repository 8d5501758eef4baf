"""Bench ``verify_tree_greedy``: xla vs pallas vs a vectorised torch port.

    python -m bench.verify_tree_greedy [--quick] [--bs 1,8,64,256] [--sets 32]

Trees: random valid EAGLE trees with K=8, S=5, N=32 (built by build_tree_kernel_efficient);
candidates and target tokens are drawn from a 3-token vocabulary so that accepts, rejects and
sibling hops all happen. Columns as in ``bench/build_tree.py``; ``anchor us`` = sglang 0.5.23's
Triton verify kernel on the H200 (shared/ANCHORS.md).
"""

from __future__ import annotations

import argparse
import functools

import jax.numpy as jnp
import numpy as np

from bench._timing import batch_sizes, format_table, time_impl, time_torch, torch_us_cell
from bench.build_tree import random_trees
from jspec.config import TreeGeometry
from jspec.tree.build import TreeMaskMode, build_tree_kernel_efficient
from jspec.tree.verify import verify_tree_greedy

ANCHOR_US = {1: 6.6, 8: 8.3, 64: 9.0, 256: 9.2}
COLUMNS = ["shape", "impl", "device us", "wall us", "torch us", "anchor us", "error"]


def verify_tree_greedy_torch(
    candidates, retrive_index, next_token, next_sibling, target_predict, num_spec_steps: int
):
    """Vectorised torch port of the reference state machine (N node visits, batch-parallel)."""
    import torch

    bsz, n = candidates.shape
    rows = torch.arange(bsz, device=candidates.device)
    tgt = target_predict.reshape(-1)[retrive_index]
    cur, last = next_token[:, 0].clone(), torch.zeros_like(rows)
    depth, num = torch.ones_like(rows), torch.zeros_like(rows)
    done = torch.full((bsz,), num_spec_steps == 1, device=candidates.device)
    pred = torch.zeros((bsz, n), dtype=candidates.dtype, device=candidates.device)
    acc = torch.full((bsz, num_spec_steps), -1, dtype=candidates.dtype, device=candidates.device)
    acc[:, 0] = retrive_index[:, 0]
    for _ in range(n):
        ok = ~done & (cur >= 0) & (cur < n)
        c = cur.clamp(0, n - 1)
        target = tgt[rows, last]
        match = ok & (candidates[rows, c] == target)
        pred[rows, last] = torch.where(match, target, pred[rows, last])
        num = num + match
        acc[rows, num.clamp(max=num_spec_steps - 1)] = torch.where(
            match, retrive_index[rows, c], acc[rows, num.clamp(max=num_spec_steps - 1)]
        )
        last = torch.where(match, c, last)
        depth = depth + match
        cur = torch.where(match, next_token[rows, c], torch.where(ok, next_sibling[rows, c], cur))
        done = done | ~ok | (match & (depth > num_spec_steps - 1))
    pred[rows, last] = tgt[rows, last]
    return pred.reshape(-1), acc, num


def _torch_us(arrays, num_spec_steps) -> float:
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    args = [torch.as_tensor(np.array(x), dtype=torch.int64, device=dev) for x in arrays]
    return time_torch(lambda: verify_tree_greedy_torch(*args, num_spec_steps), iters=20, warmup=3)


def make_inputs(
    rng: np.random.Generator, bs: int, topk: int, num_steps: int, n: int, vocab: int = 3
):
    parent_list, sel = random_trees(rng, bs, topk, num_steps, n)
    tree = build_tree_kernel_efficient(
        jnp.zeros(bs, jnp.int32),
        jnp.asarray(parent_list),
        jnp.asarray(sel),
        jnp.zeros((bs, n - 1), jnp.int32),
        jnp.zeros(bs, jnp.int32),
        geometry=TreeGeometry(topk=topk, num_steps=num_steps, num_draft_tokens=n, page_size=1),
        mode=TreeMaskMode.QLEN_ONLY,
    )
    return (
        jnp.asarray(rng.integers(0, vocab, (bs, n)), jnp.int32),
        tree.retrive_index,
        tree.retrive_next_token,
        tree.retrive_next_sibling,
        jnp.asarray(rng.integers(0, vocab, (bs, n)), jnp.int32),
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    parser.add_argument("--bs", default="", help="comma-separated batch sizes")
    parser.add_argument("--sets", type=int, default=0, help="distinct input sets per timing")
    args = parser.parse_args(argv)
    topk, num_steps, n = 8, 5, 32
    sets = args.sets or (2 if args.quick else 32)
    rng = np.random.default_rng(0)
    rows = []
    for bs in batch_sizes(args.bs, args.quick):
        arg_sets = [make_inputs(rng, bs, topk, num_steps, n) for _ in range(sets)]
        shape = f"bs={bs} N={n} S+1={num_steps + 1}"
        torch_us = torch_us_cell(lambda a=arg_sets[0]: _torch_us(a, num_steps + 1))
        for impl in ("xla", "pallas"):
            row = {
                "shape": shape,
                "impl": impl,
                "torch us": torch_us,
                "anchor us": ANCHOR_US.get(bs, ""),
            }
            op = functools.partial(verify_tree_greedy, num_spec_steps=num_steps + 1, impl=impl)
            rows.append(time_impl(row, op, arg_sets, wall_iters=5 if args.quick else 30))
    print(format_table(rows, COLUMNS), flush=True)
    return rows


if __name__ == "__main__":
    main()
