"""Decode-shaped matmuls (a few rows x every weight of an 8B layer): XLA's GEMM choices.

    python -m bench.skinny_matmul [--rows 1,8,16,64] [--layers] [--no-shapes] [--impls xla,...]
                                  [--shapes qkv,down,...]

Per weight shape of Llama-3-8B (q / k / v / o, fused qkv, gate / up, fused gate_up, down, LM
head) and rows M: device us of ``x @ w`` (bf16, default precision) and the streamed rate over the
weight bytes, for

* ``xla``: ``jnp.matmul`` as XLA compiles it; ``xla-cublas``: the same with XLA's Triton GEMM
  emitter off (``xla_gpu_enable_triton_gemm=False`` for this compile: cuBLAS);
  ``xla-exhaustive`` (``--impls``): XLA's autotuner over every Triton tiling
  (``xla_gpu_exhaustive_tiling_search``), cuBLAS still a candidate; ``xla-cublaslt``
  (``--impls``): the Triton emitter off and cuBLASLt on (``xla_gpu_enable_cublaslt``).

(A raw split-K Triton GEMV through jax-triton was measured here too, 2026-11-24 on the H200: no
faster than XLA on any fused shape, 1.6 TB/s on the [4096, 1024] k / v matrices where XLA is at
0.5; fusing q, k and v was the better fix, so the kernel was dropped; bench/RESULTS.md.)

Weights rotate over enough distinct copies (>= 150 MB) that no call reads from L2. ``--layers``
adds 8 decoder-layer-like blocks (RMSNorm, q/k/v, RoPE, o, residual, RMSNorm, SwiGLU, residual;
no attention) with separate vs fused (qkv, gate_up) weights, per matmul impl: device us per
layer and kernel launches per layer.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench._timing import (
    copy_bandwidth_tbs,
    device_name,
    error_cell,
    format_table,
    kernel_time_us,
    trace_gpu_events,
)

H, KV, INTER, V = 4096, 1024, 14336, 128256
SHAPES = {
    "q/o": (H, H),
    "k/v": (H, KV),
    "qkv": (H, H + 2 * KV),
    "gate/up": (H, INTER),
    "gate_up": (H, 2 * INTER),
    "down": (INTER, H),
    "lm_head": (H, V),
}


def _weights(k: int, n: int) -> list[jax.Array]:
    copies = max(3, -(-150_000_000 // (k * n * 2)))
    keys = jax.random.split(jax.random.PRNGKey(k + n), copies)
    return [jax.random.normal(key, (k, n), jnp.bfloat16) for key in keys]


def _compile(fn, args, options=None):
    return jax.jit(fn).lower(*args).compile(options)


IMPLS = {
    "xla": None,
    "xla-cublas": {"xla_gpu_enable_triton_gemm": False},
    # XLA's autotuner over every Triton GEMM tiling (split-K included), cuBLAS still a candidate.
    "xla-exhaustive": {"xla_gpu_exhaustive_tiling_search": True},
    # cuBLASLt instead of legacy cuBLAS (its own heuristics, epilogues XLA may fuse into it).
    "xla-cublaslt": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_cublaslt": True},
}
DEFAULT_IMPLS = ("xla", "xla-cublas")


def shape_rows(
    rows_list: list[int], bw: float, impls=DEFAULT_IMPLS, shapes=tuple(SHAPES)
) -> list[dict]:
    out = []
    for name in shapes:
        k, n = SHAPES[name]
        ws = _weights(k, n)
        for m in rows_list:
            x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.bfloat16)
            want = np.asarray(jnp.matmul(x, ws[0]), np.float32)
            for label in impls:
                options = IMPLS[label]
                row = {"shape": name, "K x N": f"{k}x{n}", "M": m, "impl": label}
                try:
                    compiled = _compile(jnp.matmul, (x, ws[0]), options)
                    got = np.asarray(compiled(x, ws[0]), np.float32)
                    err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-9))
                    us = kernel_time_us(compiled, [(x, w) for w in ws])
                    rate = k * n * 2 / (us * 1e-6) / 1e12
                    row.update({"us": us, "TB/s": rate, "% copy": 100 * rate / bw, "rel err": err})
                except Exception:  # noqa: BLE001 - report and keep going
                    row["error"] = error_cell()
                out.append(row)
                print(format_table([row]), flush=True)
    return out


def _layer(lp, x, positions, inv_freq, mm, fused: bool):
    from jspec.engine import resolve_kernel_policy
    from jspec.models.layers import apply_rope, rms_norm

    t = x.shape[0]
    # The RMSNorm kernel the engine's policy picks for these rows.
    norm = resolve_kernel_policy(hidden_size=x.shape[-1]).rms_norm
    h = rms_norm(x, lp["attn_norm"], 1e-5, impl=norm)
    if fused:
        qkv = mm(h, lp["wqkv"])
        q, k, v = qkv[:, :H], qkv[:, H : H + KV], qkv[:, H + KV :]
    else:
        q, k, v = mm(h, lp["wq"]), mm(h, lp["wk"]), mm(h, lp["wv"])
    q = apply_rope(q.reshape(t, 32, 128), positions, inv_freq)
    k = apply_rope(k.reshape(t, 8, 128), positions, inv_freq)
    v = v.reshape(t, 8, 128)
    attn = q + jnp.repeat(k, 4, axis=1) + jnp.repeat(v, 4, axis=1)  # stands in for attention
    x = x + mm(attn.reshape(t, H), lp["wo"])
    h = rms_norm(x, lp["mlp_norm"], 1e-5, impl=norm)
    if fused:
        gu = mm(h, lp["w_gate_up"])
        act = jax.nn.silu(gu[:, :INTER]) * gu[:, INTER:]
    else:
        act = jax.nn.silu(mm(h, lp["w_gate"])) * mm(h, lp["w_up"])
    return x + mm(act, lp["w_down"])


def layer_rows(rows_list: list[int], num_layers: int = 8, impls=DEFAULT_IMPLS) -> list[dict]:
    from jspec.models.layers import rope_inv_freq

    inv_freq = rope_inv_freq(128, 500000.0, None)

    def make(key):
        ks = jax.random.split(key, 7)
        w = lambda k, a, b: jax.random.normal(k, (a, b), jnp.bfloat16) * (a**-0.5)  # noqa: E731
        lp = {
            "attn_norm": jnp.ones(H, jnp.bfloat16),
            "mlp_norm": jnp.ones(H, jnp.bfloat16),
            "wq": w(ks[0], H, H),
            "wk": w(ks[1], H, KV),
            "wv": w(ks[2], H, KV),
            "wo": w(ks[3], H, H),
            "w_gate": w(ks[4], H, INTER),
            "w_up": w(ks[5], H, INTER),
            "w_down": w(ks[6], INTER, H),
        }
        lp["wqkv"] = jnp.concatenate([lp["wq"], lp["wk"], lp["wv"]], 1)
        lp["w_gate_up"] = jnp.concatenate([lp["w_gate"], lp["w_up"]], 1)
        return lp

    layers = [make(k) for k in jax.random.split(jax.random.PRNGKey(7), num_layers)]
    out = []
    for m in rows_list:
        x = jax.random.normal(jax.random.PRNGKey(m), (m, H), jnp.bfloat16)
        positions = jnp.arange(m, dtype=jnp.int32) + 100
        for impl in impls:
            options = IMPLS[impl]
            for fused in (False, True):

                def run(x, layers, fused=fused):
                    for lp in layers:
                        x = _layer(lp, x, positions, inv_freq, jnp.matmul, fused)
                    return x

                row = {"M": m, "impl": impl, "weights": "fused" if fused else "separate"}
                try:
                    fn = _compile(run, (x, layers), options)
                    jax.block_until_ready(fn(x, layers))
                    us = kernel_time_us(fn, [(x, layers)] * 3)
                    events = trace_gpu_events(lambda: fn(x, layers)) or []
                    row.update(
                        {
                            "us / layer": us / num_layers,
                            "launches / layer": len(events) / num_layers,
                        }
                    )
                except Exception:  # noqa: BLE001
                    row["error"] = error_cell()
                out.append(row)
                print(format_table([row]), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,16,64")
    parser.add_argument("--layers", action="store_true")
    parser.add_argument("--no-shapes", action="store_true")
    parser.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"of {tuple(IMPLS)}")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {tuple(SHAPES)}")
    args = parser.parse_args(argv)
    impls = tuple(args.impls.split(","))
    shapes = tuple(args.shapes.split(","))
    for bad in [i for i in impls if i not in IMPLS] + [s for s in shapes if s not in SHAPES]:
        parser.error(f"unknown impl or shape {bad!r}")
    rows_list = [int(r) for r in args.rows.split(",")]
    bw = copy_bandwidth_tbs()
    print(f"skinny_matmul on {device_name()}: copy {bw:.2f} TB/s", flush=True)
    if not args.no_shapes:
        print(format_table(shape_rows(rows_list, bw, impls, shapes)))
    if args.layers:
        print(format_table(layer_rows(rows_list, impls=impls)))


if __name__ == "__main__":
    main(sys.argv[1:])
