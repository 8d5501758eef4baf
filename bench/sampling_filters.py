"""Bench the sampling filters' threshold searches (``jspec.tree.sampling_probs``) by ways per pass.

    python -m bench.sampling_filters [--quick] [--rows 8,512] [--vocab 128256] [--ways 2,4,8,16]

Rows R = the verify rows of a sampled spec step (bs x draft tokens: 8 at bs 1, 512 at bs 64 on
the 8B geometry). Per (R, ways): device time of ``kth_largest`` (top-k's k-th value),
``mass_pivot`` (top-p's pivot) and the whole ``target_probs_from_logits`` with top-k 50 and
top-p 0.9 at T = 1 (the default ways there: ``SEARCH_WAYS``, its row marked). ``row reads``:
the row-length compare passes one search makes, ``(ways - 1) x passes``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench._timing import device_name, format_table, time_device
from jspec.tree import sampling_probs
from jspec.tree.sampling_probs import kth_largest, mass_pivot, target_probs_from_logits

COLUMNS = [
    "rows",
    "vocab",
    "ways",
    "passes",
    "row reads",
    "kth_largest us",
    "mass_pivot us",
    "target_probs us (top-k 50, top-p 0.9)",
]


def _arg_sets(rows: int, vocab: int, num: int) -> list[tuple]:
    rng = np.random.default_rng(rows)
    out = []
    for i in range(num):
        logits = rng.standard_normal((rows, vocab), np.float32) * 3.0
        probs = jax.nn.softmax(jnp.asarray(logits), -1)
        k = jnp.full((rows,), 50, jnp.int32)
        target = jnp.full((rows,), 0.9, jnp.float32) * jnp.sum(probs, -1)
        out.append((jnp.asarray(logits), probs, k, target, i))
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    parser.add_argument("--rows", default="8,512")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--ways", default="2,4,8,16")
    parser.add_argument("--sets", type=int, default=3)
    args = parser.parse_args(argv)
    rows_list = [8] if args.quick else [int(r) for r in args.rows.split(",")]
    vocab = 512 if args.quick else args.vocab
    ways_list = [int(w) for w in args.ways.split(",")]
    print(f"sampling_filters on {device_name()}: vocab {vocab}", flush=True)
    table = []
    for rows in rows_list:
        sets = _arg_sets(rows, vocab, args.sets)
        probs_sets = [(p, k) for _, p, k, _, _ in sets]
        pivot_sets = [(p, t) for _, p, _, t, _ in sets]
        temps = jnp.ones((rows,), jnp.float32)
        full_sets = [(x, temps, k, jnp.full((rows,), 0.9, jnp.float32)) for x, _, k, _, _ in sets]
        full_us = time_device(
            lambda x, t, k, p: target_probs_from_logits(x, t, top_ks=k, top_ps=p), full_sets
        )
        for ways in ways_list:
            passes = sampling_probs._num_passes(sampling_probs._ONE_BITS + 1, ways)
            row = {
                "rows": rows,
                "vocab": vocab,
                "ways": f"{ways}{' (default)' if ways == sampling_probs.SEARCH_WAYS else ''}",
                "passes": passes,
                "row reads": (ways - 1) * passes,
                "kth_largest us": round(
                    time_device(lambda p, k, w=ways: kth_largest(p, k, ways=w), probs_sets), 1
                ),
                "mass_pivot us": round(
                    time_device(lambda p, t, w=ways: mass_pivot(p, t, ways=w), pivot_sets), 1
                ),
                "target_probs us (top-k 50, top-p 0.9)": (
                    round(full_us, 1) if ways == sampling_probs.SEARCH_WAYS else ""
                ),
            }
            print(row, flush=True)
            table.append(row)
    print(format_table(table, COLUMNS))
    return table


if __name__ == "__main__":
    main()
