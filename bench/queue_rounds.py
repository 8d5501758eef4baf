"""Continuous batching with a queue: decode rounds per dispatch while requests wait (issue 25).

    python -m bench.queue_rounds [--geometry 8b] [--requests 256] [--max-running 64]
                                 [--modes greedy,spec]

``--requests`` requests of mixed lengths (prompts and budgets uniform in [16, 128] tokens, ids
from the draft's hot vocabulary) through one ``Engine.generate`` at ``--max-running`` at once,
on :mod:`bench.real_size`'s 8B geometry (its target, matched head and engine, one batch bucket
of ``--max-running``). Per mode, three runs on the same engine:

* ``one round``: the rule before ``Engine._rounds_for`` (one round per dispatch whenever a
  request is queued), patched in for the comparison;
* ``until a budget ends``: the engine's rule without stop ids (while the queue's head waits
  for a slot, the rounds until a running request can first end by its budget);
* ``stop ids``: the same with a stop id (the hot vocabulary's id 7; its rounds are capped at
  ``WAITING_ROUNDS``); its tokens differ (requests end at the id), so it is compared with
  nothing.

Reported: total wall s, total tokens/s (prefill's first tokens included), decode dispatches
and rounds, mean rounds per dispatch, and whether the first two runs' tokens are identical
(they must be: the rule moves where dispatches end, never a token).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench._timing import device_name, format_table, print_and_write

COLUMNS = (
    "mode",
    "rule",
    "requests",
    "wall s",
    "tok/s",
    "dispatches",
    "rounds",
    "rounds / dispatch",
    "same tokens",
)


def _requests(n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, int(rng.integers(16, 129))).tolist() for _ in range(n)]
    return prompts, [int(rng.integers(16, 129)) for _ in range(n)]


def run(engine, prompts, max_new, rule: str) -> tuple[dict, list[list[int]]]:
    """One ``generate`` under ``rule``; the row and the outputs."""
    calls: list[int] = []
    call_rounds = engine._call_rounds

    def counting(slot_idx, live, budget, num_rounds, *args, **kwargs):
        calls.append(num_rounds)
        return call_rounds(slot_idx, live, budget, num_rounds, *args, **kwargs)

    engine._call_rounds = counting
    if rule == "one round":  # the earlier rule: one round whenever anyone waits
        engine._rounds_for = lambda loop: (
            1 if loop.pending or any(loop.prefilling) else engine.max_rounds
        )
    try:
        t0 = time.perf_counter()
        out, stats = engine.generate(prompts, max_new)
        wall = time.perf_counter() - t0
    finally:
        del engine._call_rounds
        engine.__dict__.pop("_rounds_for", None)
    row = {
        "rule": rule,
        "requests": len(prompts),
        "wall s": round(wall, 2),
        "tok/s": round(stats.num_tokens / wall, 1),
        "dispatches": len(calls),
        "rounds": stats.num_decode_steps,
        "rounds / dispatch": round(stats.num_decode_steps / max(len(calls), 1), 2),
    }
    return row, out


def main(argv: list[str] | None = None) -> list[dict]:
    from bench import real_size as rs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", default="8b")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--modes", default="greedy,spec")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    g = rs.GEOMETRIES[args.geometry]
    rs.PROMPT, rs.NEW = 128, 128  # the engine's prompt / context limits
    target = rs.make_target(g)
    params, draft, dparams = rs.make_params(g, target)
    prompts, max_new = _requests(args.requests, g.draft_vocab)
    rows = []
    for mode in [m for m in args.modes.split(",") if m]:
        engine = rs.make_engine(g, target, params, draft, dparams, mode, [args.max_running], "auto")
        engine.warmup()
        engine.generate(prompts[: args.max_running], 2)  # first calls of every executable
        base, base_out = run(engine, prompts, max_new, "one round")
        new, new_out = run(engine, prompts, max_new, "until a budget ends")
        same = sum(a == b for a, b in zip(base_out, new_out))
        base["same tokens"] = new["same tokens"] = f"{same}/{len(prompts)}"
        engine.eos_token_id = 7
        eos, _ = run(engine, prompts, max_new, "stop ids")
        engine.eos_token_id = None
        for row in (base, new, eos):
            rows.append({"mode": mode, **row})
            print(format_table(rows[-1:], COLUMNS), flush=True)
        del engine
    text = (
        f"queue_rounds on {device_name()}: {args.geometry}, {args.requests} requests "
        f"(prompts and budgets in [16, 128]) at max running {args.max_running}\n\n"
        f"{format_table(rows, COLUMNS)}\n"
    )
    print_and_write(text, args.out)
    return rows


if __name__ == "__main__":
    main()
