"""The paged attention's launch-plan rules against other values of their constants, on the
passes whose default plan the two rule sets launch differently.

    python -m bench.plan_rules [--stage1-max-blocks 1] [--tail-split-max-blocks 4] [--sets 5]

``jspec.kernels.paged_attention_triton`` picks one pipeline stage where a key split reads at
most ``STAGE1_MAX_BLOCKS`` blocks and gives the verify tail a split of its own where splits read
at most ``TAIL_SPLIT_MAX_BLOCKS``. This bench plans every pass of a grid (verify / decode / draft
pass A, bs 4 / 16 / 64, the 8B heads, 128-4000 keys in tables 256-4096 keys wide: a short batch
in a real_size engine up to a 4k one) under both rule sets, and times the passes whose launch
differs, each with the other rules' ``num_stages`` / ``tail_split`` as knobs (kernel + merge us,
``bench.paged_attention``'s timing, best of two rounds). The defaults compare the rules before
2026-11-27 (1 and 4) with today's. GPU only.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench._timing import copy_bandwidth_tbs, device_name, matmul_tflops
from bench.paged_attention import LLAMA_8B, Pass, _plan, bench_pass

# (table width in keys, keys a row holds)
TABLES = ((256, 200), (512, 200), (512, 450), (2048, 2000), (2304, 2200), (4096, 4000))


def _knobs(p: Pass, stage1: int, tail: int) -> dict:
    """The plan's num_stages / tail_split under the rule constants ``stage1`` / ``tail``."""
    import jspec.kernels.paged_attention_triton as pat

    saved = pat.STAGE1_MAX_BLOCKS, pat.TAIL_SPLIT_MAX_BLOCKS
    pat.STAGE1_MAX_BLOCKS, pat.TAIL_SPLIT_MAX_BLOCKS = stage1, tail
    try:
        _, meta, opts = _plan(p, LLAMA_8B, {})
    finally:
        pat.STAGE1_MAX_BLOCKS, pat.TAIL_SPLIT_MAX_BLOCKS = saved
    knobs = {"num_stages": opts["num_stages"]}
    if p.tail_len:
        knobs["tail_split"] = meta["TAIL_SPLIT"]
    return knobs


def main(argv: list[str] | None = None) -> None:
    import jspec.kernels.paged_attention_triton as pat

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage1-max-blocks", type=int, default=1, help="the other rules'")
    parser.add_argument("--tail-split-max-blocks", type=int, default=4, help="the other rules'")
    parser.add_argument("--sets", type=int, default=5, help="page tables per timing")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        sys.exit("bench.plan_rules times Triton kernels: GPU only")
    g = LLAMA_8B
    env = {"copy_tbs": copy_bandwidth_tbs(), "matmul_tflops": matmul_tflops()}
    print(f"{device_name()}: copy {env['copy_tbs']:.2f} TB/s", flush=True)
    other = (args.stage1_max_blocks, args.tail_split_max_blocks)
    today = (pat.STAGE1_MAX_BLOCKS, pat.TAIL_SPLIT_MAX_BLOCKS)
    todo = []
    for width, keys in TABLES:
        for bs in (4, 16, 64):
            for p in (
                Pass("verify", bs, 8, keys, tail_len=8, width=width),
                Pass("decode", bs, 1, keys, width=width),
                Pass("draftA", bs, 4, keys, width=width),
            ):
                a, b = _knobs(p, *other), _knobs(p, *today)
                if a != b:
                    todo.append((p, a, b))
    if not todo:
        sys.exit(f"rules {other} launch every pass as today's {today}: nothing to time")
    need = max(p.batch * (-(-p.width // g.page_size) + p.tail_len) for p, _, _ in todo) + 64
    keys_ = jax.random.split(jax.random.PRNGKey(0), 2)
    shape = (1, need * g.page_size, g.num_kv_heads, g.head_dim)
    pools = tuple(jax.random.normal(k, shape, jnp.dtype(g.dtype)) for k in keys_)
    rng = np.random.default_rng(0)
    print(f"| pass | rules {other} | us | rules {today} (today) | us | today / other |")
    print("|---|---|---|---|---|---|")
    for p, a, b in todo:
        us = {}
        for name, knobs in (("a", a), ("b", b), ("a2", a), ("b2", b)):
            row = bench_pass(rng, p, g, pools, need, "triton", knobs, args.sets, env, False)
            us[name] = row.get("device us", float("nan"))
        ua, ub = min(us["a"], us["a2"]), min(us["b"], us["b2"])
        print(
            f"| {p.kind} {p.label} | {a} | {ua:.1f} | {b} | {ub:.1f} | {ub / ua:.3f} |", flush=True
        )


if __name__ == "__main__":
    main(sys.argv[1:])
