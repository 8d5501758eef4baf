"""Bench ``build_tree_kernel_efficient`` (QLEN_ONLY): xla vs pallas vs a vectorised torch port.

    python -m bench.build_tree [--quick] [--bs 1,8,64,256] [--sets 32]

Shapes: K=8, S=5, N=32 (the issue's sizes). Inputs are random valid EAGLE trees (the draft
loop on random probabilities). ``device us`` = ``time_device`` (R distinct input sets in one
jitted scan, divided by R, including a checksum read of the outputs); ``wall us`` = one jitted
call with dispatch; ``torch us`` = the torch port (CUDA events on GPU); ``anchor us`` = sglang
0.5.23's Triton build-tree kernel on the H200 (shared/ANCHORS.md).
"""

from __future__ import annotations

import argparse
import functools

import jax.numpy as jnp
import numpy as np

from bench._timing import batch_sizes, format_table, time_impl, time_torch, torch_us_cell
from jspec.config import TreeGeometry
from jspec.kernels.build_tree import num_closure_rounds
from jspec.tree.build import TreeMaskMode, build_tree_kernel_efficient

ANCHOR_US = {1: 37.0, 8: 22.0, 64: 50.0, 256: 24.0}
COLUMNS = ["shape", "impl", "device us", "wall us", "torch us", "anchor us", "error"]


def _topk_idx(x: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-x, axis=1, kind="stable")[:, :k]


def random_trees(rng: np.random.Generator, bs: int, topk: int, num_steps: int, n: int):
    """Random valid (parent_list i32[B, K(S-1)+1], sel i32[B, N-1]) from the EAGLE draft loop."""
    cum = rng.random((bs, topk), dtype=np.float32) * 0.98 + 0.01
    chunks, parents = [cum], [np.tile(np.arange(-1, topk), (bs, 1))]
    for i in range(1, num_steps):
        flat = (
            cum[:, :, None] * (rng.random((bs, topk, topk), dtype=np.float32) * 0.98 + 0.01)
        ).reshape(bs, -1)
        idx = _topk_idx(flat, topk)
        cum = np.take_along_axis(flat, idx, axis=1)
        chunks.append(flat)
        parents.append(idx + topk * topk * (i - 1) + topk)
    sel = np.sort(_topk_idx(np.concatenate(chunks, axis=1), n - 1), axis=1)
    parent_list = np.concatenate(parents[:-1], axis=1) if num_steps > 1 else np.zeros((bs, 0))
    return parent_list.astype(np.int32), sel.astype(np.int32)


def build_tree_torch(parent_list, sel, seq_lens, topk: int):
    """Vectorised torch port (same parent rule, links and squaring closure as the kernel)."""
    import torch

    nsel = sel.shape[1]
    n, width = nsel + 1, parent_list.shape[1]
    nodes = torch.arange(n, device=sel.device)
    sel_node = torch.cat([torch.zeros_like(sel[:, :1]), sel], dim=1)
    tb = torch.div(sel_node, topk, rounding_mode="floor")
    live = nodes >= 1
    need = live & (tb >= 1) & (tb < width)
    ptok = torch.where(need, torch.gather(parent_list, 1, tb.clamp(0, width - 1)), -1)
    eq = (sel_node[:, None, :] == ptok[:, :, None]) & live
    pos = torch.where(eq, nodes, n).amin(-1)
    ok = live & ((tb == 0) | (need & (pos < nodes)))
    parent = torch.where(tb == 0, 0, pos)
    child = ok[:, None, :] & (parent[:, None, :] == nodes[None, :, None])
    next_token = torch.where(child, nodes, n).amin(-1)
    sib = (
        ok[:, :, None]
        & ok[:, None, :]
        & (parent[:, None, :] == parent[:, :, None])
        & (nodes[None, None, :] > nodes[None, :, None])
    )
    next_sibling = torch.where(sib, nodes, n).amin(-1)
    up = torch.where(ok, parent, 0)
    adj = (
        (nodes[None, None, :] == nodes[None, :, None]) | (nodes[None, None, :] == up[:, :, None])
    ).float()
    for _ in range(num_closure_rounds(n)):
        adj = (adj @ adj > 0.5).float()
    mask = adj > 0.5
    positions = seq_lens[:, None] + mask.sum(-1) - 1
    return (
        torch.where(next_token == n, -1, next_token),
        torch.where(next_sibling == n, -1, next_sibling),
        positions,
        mask,
    )


def _torch_us(parent_list, sel, seq_lens, topk) -> float:
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    args = [
        torch.as_tensor(np.array(x), dtype=torch.int64, device=dev)
        for x in (parent_list, sel, seq_lens)
    ]
    return time_torch(lambda: build_tree_torch(*args, topk), iters=20, warmup=3)


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
        arg_sets = []
        for _ in range(sets):
            parent_list, sel = random_trees(rng, bs, topk, num_steps, n)
            arg_sets.append(
                (
                    jnp.zeros(bs, jnp.int32),
                    jnp.asarray(parent_list),
                    jnp.asarray(sel),
                    jnp.zeros((bs, n - 1), jnp.int32),
                    jnp.asarray(rng.integers(1, 2000, bs), jnp.int32),
                )
            )
        shape = f"bs={bs} K={topk} S={num_steps} N={n}"
        torch_us = torch_us_cell(lambda a=arg_sets[0]: _torch_us(a[1], a[2], a[4], topk))
        for impl in ("xla", "pallas"):
            row = {
                "shape": shape,
                "impl": impl,
                "torch us": torch_us,
                "anchor us": ANCHOR_US.get(bs, ""),
            }
            op = functools.partial(
                build_tree_kernel_efficient,
                geometry=TreeGeometry(
                    topk=topk, num_steps=num_steps, num_draft_tokens=n, page_size=1
                ),
                mode=TreeMaskMode.QLEN_ONLY,
                impl=impl,
            )
            rows.append(time_impl(row, op, arg_sets, wall_iters=5 if args.quick else 30))
    print(format_table(rows, COLUMNS), flush=True)
    return rows


if __name__ == "__main__":
    main()
