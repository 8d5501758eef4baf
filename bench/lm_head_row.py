"""The LM head + greedy argmax at a few rows (issue 13's greedy bs=1 lever), variants side by side.

Measured on the H200 (2026-11-24): every variant streams the 8B LM head at ~235 us (bf16
result, ~4.4 TB/s read), one row or eight: the one-row LM head is not the greedy bs=1 gap.

    python -m bench.lm_head_row [--hidden 4096] [--vocab 128256] [--rows 1,2,4]

Per variant, the device us of ``argmax(logits(hidden @ lm_head))`` (bf16 weights, f32 logits),
jitted as the greedy step does, over 3 distinct weight sets (no L2 reuse), and the streamed
rate over the LM head's bytes (against the copy bandwidth measured here):

* ``plain``: bf16 dot, ``astype(f32)``, argmax (XLA may fuse all three);
* ``barrier``: ``optimization_barrier`` on the bf16 dot result before the upcast;
* ``pad2``: a one-row input padded to 2 rows (no matrix-vector rewrite), sliced after;
* ``pad2+barrier``: both;
* ``dot only``: the bf16 dot alone (the floor of the others).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from bench._timing import copy_bandwidth_tbs, device_name, format_table, time_device


def _dot(h, w):
    return jax.lax.dot_general(h, w, (((1,), (0,)), ((), ())))


def _pad2(h):
    return jnp.concatenate([h, jnp.zeros_like(h)]) if h.shape[0] == 1 else h


VARIANTS = {
    "plain": lambda h, w: jnp.argmax(_dot(h, w).astype(jnp.float32), -1),
    "barrier": lambda h, w: jnp.argmax(
        jax.lax.optimization_barrier(_dot(h, w)).astype(jnp.float32), -1
    ),
    "pad2": lambda h, w: jnp.argmax(_dot(_pad2(h), w)[: h.shape[0]].astype(jnp.float32), -1),
    "pad2+barrier": lambda h, w: jnp.argmax(
        jax.lax.optimization_barrier(_dot(_pad2(h), w))[: h.shape[0]].astype(jnp.float32), -1
    ),
    "dot only": _dot,
}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--rows", default="1,2,4")
    args = parser.parse_args(argv)
    bw = copy_bandwidth_tbs()
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    weights = [
        jax.random.normal(k, (args.hidden, args.vocab), jnp.float32).astype(jnp.bfloat16)
        for k in keys
    ]
    rows = []
    for n in [int(r) for r in args.rows.split(",")]:
        hs = [jax.random.normal(k, (n, args.hidden), jnp.bfloat16) for k in keys]
        for name, fn in VARIANTS.items():
            us = time_device(fn, list(zip(hs, weights)))
            rate = weights[0].size * 2 / (us * 1e-6) / 1e12
            rows.append(
                {
                    "rows": n,
                    "variant": name,
                    "device us": us,
                    "TB/s": rate,
                    "% copy": 100 * rate / bw,
                }
            )
    print(f"lm_head_row on {device_name()}: H {args.hidden}, V {args.vocab}, copy {bw:.2f} TB/s")
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
