"""Bench one paged attention pass (``jspec.kernels.paged_attention``): xla (gather + masked
softmax, the reference) vs the fused Pallas kernel vs the same gather + softmax in torch.

    python -m bench.paged_attention [--quick] [--geometry tiny,llama] [--sets 8] [--sweep]

Shapes are the passes of the e2e ``bs64`` spec step (bs 64, topk 8, steps 5, 32 draft tokens,
page 16, context 128): greedy decode, draft pass A (K queries over the full prefix pages) and
pass B (one query per branch over ``S * P`` slots), the verify prefix and tree passes. Geometry
``tiny`` = the e2e model (4/2 heads x 32, f32 pool); ``llama`` = 32/8 heads x 128, bf16 pool,
context 1024 (an 8B-class layer). Slot ids are random over the pool; masks as the engine builds
them (length masks, a random ~half-dense tree mask). ``GB/s`` counts the K and V rows each pass
lists (read once) plus q and the outputs: the floor of any implementation.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from bench._timing import format_table, time_impl, time_torch, torch_us_cell
from jspec.kernels.paged_attention import paged_attention

COLUMNS = [
    "geometry",
    "pass",
    "shape",
    "impl",
    "tuning",
    "device us",
    "wall us",
    "GB/s",
    "seen KV GB/s",
    "% copy bw",
    "torch us",
    "x vs xla",
    "x vs torch",
    "max err",
    "error",
]


# --sweep: Pallas launches besides the default (block_q / block_w / block_d / num_warps).
SWEEP = [
    {"block_q": 16},
    {"block_q": 32},
    {"block_w": 16},
    {"block_w": 64},
    {"block_d": 16},
    {"block_d": 64},
    {"num_warps": 2},
    {"num_warps": 8},
    {"block_q": 32, "block_w": 64, "num_warps": 8},
]


# --sweep: raw Triton launches besides the default (launch_plan keywords).
TRITON_SWEEP = [
    {"num_stages": 1},
    {"num_stages": 3},
    {"block_n": 64},
    {"block_n": 64, "num_stages": 1},
    {"block_n": 32},
    {"block_m": 32},
    {"block_m": 32, "num_stages": 1},
    {"block_m": 128, "num_warps": 8},
    {"num_warps": 8, "num_stages": 1},
]


@dataclasses.dataclass(frozen=True)
class Geometry:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    context: int
    num_slots: int


GEOMETRIES = {
    "tiny": Geometry("tiny", 4, 2, 32, "float32", 128, 64 * 16 * 16),
    "llama": Geometry("llama", 32, 8, 128, "bfloat16", 1024, 64 * 1024 + 4096),
    "llama-256": Geometry("llama-256", 32, 8, 128, "bfloat16", 256, 64 * 256 + 4096),
    "llama-2k": Geometry("llama-2k", 32, 8, 128, "bfloat16", 2048, 64 * 2048 + 4096),
    "llama-d64": Geometry("llama-d64", 32, 8, 64, "bfloat16", 1024, 64 * 1024 + 4096),
}
COPY_TBS: list[float] = []  # the measured copy bandwidth (run_all's header measures it too)


def _passes(g: Geometry, quick: bool) -> list[tuple[str, int, int, int, str]]:
    """(pass, Bp, Qp, W, mask kind) of the bs64 / K8 / S5 / N32 / P16 spec step."""
    if quick:
        return [("decode", 4, 1, 32, "length"), ("tree", 2, 8, 8, "tree")]
    bs, k, s, n, p = 64, 8, 5, 32, 16
    return [
        ("decode", bs, 1, g.context, "length"),
        ("draft A", bs, k, g.context, "length"),
        ("draft B", bs * k, 1, s * p, "length"),
        ("verify prefix", bs, n, g.context, "length"),
        ("verify tree", bs, n, n, "tree"),
    ]


def _pools(rng, g: Geometry, num_layers: int = 2):
    """K and V pools ``[L, S, Hkv, D]`` (layer 1 is read), shared by every arg set."""
    shape = (num_layers, g.num_slots, g.num_kv_heads, g.head_dim)
    return tuple(
        jnp.asarray(rng.standard_normal(shape, np.float32), jnp.dtype(g.dtype)) for _ in range(2)
    )


def _arg_set(rng, g: Geometry, pools, bp: int, qp: int, w: int, kind: str):
    q = jnp.asarray(rng.standard_normal((bp, qp, g.num_heads, g.head_dim)), jnp.dtype(g.dtype))
    k_pool, v_pool = pools
    slots = jnp.asarray(rng.integers(1, g.num_slots, (bp, w)), jnp.int32)
    if kind == "tree":
        mask = (rng.random((bp, qp, w)) < 0.5) | np.eye(qp, w, dtype=bool)[None]
    else:
        lens = rng.integers(w // 2, w + 1, bp)
        mask = np.broadcast_to((np.arange(w)[None, :] < lens[:, None])[:, None, :], (bp, qp, w))
    return q, k_pool, v_pool, slots, jnp.asarray(np.array(mask))


def _torch_us(args) -> float:
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    pool_dtype = torch.bfloat16 if args[1].dtype == jnp.bfloat16 else torch.float32
    q, k_pool, v_pool, slots, mask = (
        torch.as_tensor(
            np.array(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x), device=dev
        )
        for x in args
    )
    k_pool, v_pool = k_pool.to(pool_dtype), v_pool.to(pool_dtype)
    bp, qp, hq, d = q.shape
    hkv = k_pool.shape[2]
    slots = slots.long()

    def run():
        k = k_pool[1][slots].float()  # [Bp, W, Hkv, D]
        v = v_pool[1][slots].float()
        qg = q.reshape(bp, qp, hkv, hq // hkv, d)
        s = torch.einsum("bqhgd,bwhd->bqhgw", qg, k) * d**-0.5
        s = s.masked_fill(~mask[:, :, None, None, :], float("-inf"))
        return torch.einsum("bqhgw,bwhd->bqhgd", torch.softmax(s, -1).nan_to_num(), v)

    return time_torch(run, iters=30)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    parser.add_argument("--geometry", default="tiny,llama")
    parser.add_argument("--sets", type=int, default=0, help="distinct input sets per timing")
    parser.add_argument("--passes", default="", help="only these passes (comma-separated)")
    parser.add_argument(
        "--impls", default="xla,pallas,triton", help="impls to time (triton needs a GPU)"
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time other Pallas launches (block_q/block_w/block_d/warps)",
    )
    args = parser.parse_args(argv)
    geometries = ["tiny"] if args.quick else [x for x in args.geometry.split(",") if x]
    sets = args.sets or (2 if args.quick else 8)
    impls = [
        i for i in args.impls.split(",") if i and (i != "triton" or jax.default_backend() == "gpu")
    ]
    if not COPY_TBS:
        from bench._timing import copy_bandwidth_tbs

        COPY_TBS.append(copy_bandwidth_tbs())
    rng = np.random.default_rng(0)
    out = []
    for name in geometries:
        g = GEOMETRIES[name]
        if args.quick:
            g = dataclasses.replace(g, num_slots=256)
        pools = _pools(rng, g)
        for pass_name, bp, qp, w, kind in _passes(g, args.quick):
            if args.passes and pass_name not in args.passes.split(","):
                continue
            arg_sets = [_arg_set(rng, g, pools, bp, qp, w, kind) for _ in range(sets)]
            shape = f"Bp={bp} Qp={qp} W={w}"
            itemsize = jnp.dtype(g.dtype).itemsize
            num_bytes = (
                2 * bp * w * g.num_kv_heads * g.head_dim * itemsize
                + 2 * bp * qp * g.num_heads * g.head_dim * 4
            )
            # K and V bytes of the columns some query sees (what a mask-aware kernel must read)
            seen = float(np.mean([np.asarray(a[4]).any(axis=1).sum() for a in arg_sets]))
            seen_bytes = 2 * seen * g.num_kv_heads * g.head_dim * itemsize
            torch_us = torch_us_cell(lambda a=arg_sets[0]: _torch_us(a))
            ref = [np.asarray(x) for x in paged_attention(*arg_sets[0][:3], 1, *arg_sets[0][3:])]
            xla = {}
            cases = [(i, {}) for i in impls]
            if args.sweep:
                cases += [("pallas", t) for t in SWEEP if "pallas" in impls]
                cases += [("triton", t) for t in TRITON_SWEEP if "triton" in impls]
            for impl, tuning in cases:
                row = {
                    "geometry": name,
                    "pass": pass_name,
                    "shape": shape,
                    "impl": impl,
                    "torch us": torch_us,
                    "tuning": ",".join(f"{k}={v}" for k, v in tuning.items()),
                }

                def op(q, k, v, s, m, impl=impl, tuning=tuning):
                    if impl == "triton" and tuning:
                        from jspec.kernels.paged_attention_triton import paged_attention_triton

                        return paged_attention_triton(q, k, v, 1, s, m, **tuning)
                    return paged_attention(q, k, v, 1, s, m, impl=impl, **tuning)

                def max_err(op, row=row, a=arg_sets[0], ref=ref):
                    row["max err"] = float(np.max(np.abs(np.asarray(op(*a)[0]) - ref[0])))

                def speedups(
                    us,
                    impl=impl,
                    xla=xla,
                    num_bytes=num_bytes,
                    torch_us=torch_us,
                    seen_bytes=seen_bytes,
                ):
                    if impl == "xla":
                        xla["us"] = us
                    return {
                        "GB/s": num_bytes / us / 1e3,
                        "seen KV GB/s": seen_bytes / us / 1e3,
                        "% copy bw": seen_bytes / us / 1e3 / (10 * COPY_TBS[0]),
                        "x vs xla": xla["us"] / us if xla.get("us") else None,
                        "x vs torch": torch_us / us if isinstance(torch_us, float) else None,
                    }

                out.append(
                    time_impl(
                        row,
                        op,
                        arg_sets,
                        wall_iters=5 if args.quick else 20,
                        check=max_err,
                        extra=speedups,
                    )
                )
    print(format_table(out, COLUMNS), flush=True)
    return out


if __name__ == "__main__":
    main()
