"""The lifted step's wall clock: a serving loop of your own around jspec's public calls.

    python -m bench.lifted_step [--geometry 8b|1b|quick] [--modes spec,greedy] [--batches 1,16]
                                [--prompt 128] [--rounds 32] [--dispatches 3] [--out DIR]

A caller that lifts the step into its own engine (README, "Lift the step into your engine")
builds ``Runner`` / ``Weights`` / ``init_engine_state``, prefills with ``prefill`` and then loops
either

* ``spec_decode_step`` (or ``greedy_step``) one call a step, reading each step's tokens to the
  host (what a loop that streams tokens and checks stop ids must do), or
* ``decode_rounds(step, ..., num_rounds=R)``: up to ``R`` steps in one dispatch, each entry
  stopped on the device at its budget or a stop id, the tokens read once a dispatch.

A third loop compiles the step's body without XLA's command buffers (the kernels launched from
the host, no CUDA graph to update when an execution's buffers move): ``step wall ms (no
graphs)``.

For each (mode, batch) this times both loops from the same prefilled state (bench.real_size's
synthetic geometry and matched EAGLE-3 head: bf16, page 16, topk 4, steps 3, 8 draft tokens;
random prompts from the head's hot ids) and the device time of a dispatch's rounds from a
profiler trace (kernels summed, launch gaps excluded). Columns: ``step wall ms`` (median of the
single-step loop), ``rounds wall ms`` (a dispatch's wall / its rounds, median over
``--dispatches``), ``device ms`` (a round's kernels), and each wall over the device time.
Written and checked on CPU (``--geometry quick``); the numbers that matter are the GPU's
(bench/RESULTS.md). ``JSPEC_TRITON_FFI=0`` (set before the run) times the legacy Triton launch.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench._timing import device_name, format_table, profile_kernel_us
from bench.real_size import (
    DRAFT_TOKENS,
    GEOMETRIES,
    PAGE,
    SPLIT_COMPILER_OPTIONS,
    STEPS,
    TOPK,
    make_params,
    make_target,
)
from jspec.engine import (
    Runner,
    Weights,
    decode_rounds,
    greedy_step,
    init_engine_state,
    make_engine_config,
    prefill,
    spec_decode_step,
)
from jspec.engine.greedy import greedy_step_body
from jspec.engine.runner import compiler_options
from jspec.engine.spec_step import spec_step_body

COLUMNS = (
    "mode",
    "bs",
    "step wall ms",
    "step wall ms (no graphs)",
    "rounds wall ms",
    "device ms",
    "step wall / device",
    "no graphs / device",
    "rounds wall / device",
    "tokens / round",
)


def _runner(target, params, draft, dparams, mode: str, bs: int, prompt: int, context: int):
    ecfg = make_engine_config(
        target, page_size=PAGE, topk=TOPK, num_steps=STEPS, num_draft_tokens=DRAFT_TOKENS,
        context_len=context, max_running_requests=bs, max_prompt_len=prompt,
        batch_buckets=(bs,), prefill_batch=bs,
    )  # fmt: skip
    spec = mode == "spec"
    runner = Runner(ecfg, target, draft if spec else None)
    return runner, Weights(params, dparams if spec else None)


def _prefilled(runner, weights, bs: int, prompt: int, hot: int, seed: int):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, hot, (bs, prompt)), jnp.int32)
    slots = jnp.arange(bs, dtype=jnp.int32)
    state, out = prefill(
        runner, weights, init_engine_state(runner), slots, ids, jnp.full((bs,), prompt)
    )
    if not bool(out.ok):
        raise RuntimeError("prefill refused (pool too small?)")
    return state, slots


def run_cell(g, target, params, draft, dparams, mode: str, bs: int, args) -> dict:
    """Both loops and the device time for one (mode, batch)."""
    r, n_disp = args.rounds, args.dispatches
    per_step = STEPS + 1 if mode == "spec" else 1
    # Room for every step timed here: warm-ups, the single-step loop, the dispatches, the
    # profiled one, each at most per_step tokens, plus the spec step's reserve.
    steps_total = 2 + args.steps + (n_disp + 2) * r
    context = args.prompt + per_step * steps_total + 64
    context = -(-context // PAGE) * PAGE
    runner, weights = _runner(target, params, draft, dparams, mode, bs, args.prompt, context)
    step = spec_decode_step if mode == "spec" else greedy_step
    state, slots = _prefilled(runner, weights, bs, args.prompt, g.draft_vocab, bs)
    live = jnp.ones((bs,), bool)
    budget = jnp.full((bs,), 1 << 30, jnp.int32)
    eos = jnp.zeros((0,), jnp.int32)

    def read(out):  # what a streaming loop reads each step
        if hasattr(out, "accept_tokens"):
            return np.asarray(out.accept_tokens), np.asarray(out.accept_lens)
        return np.asarray(out.next_tokens), None

    def loop(fn, state):
        """Median wall ms of a call a step, its tokens read each step (2 calls untimed: the
        compile, then a command buffer's first update)."""
        samples = []
        for i in range(2 + args.steps):
            t0 = time.perf_counter()
            state, out = fn(runner, weights, state, slots, live)
            read(out)
            samples.append(time.perf_counter() - t0)
        return state, float(np.median(samples[2:])) * 1e3

    state, step_ms = loop(step, state)
    # The same body compiled without XLA's command buffers (CUDA graphs): kernels launched
    # from the host one by one, no graph to update when an execution's buffers move.
    body = spec_step_body if mode == "spec" else greedy_step_body
    no_graphs = jax.jit(
        body,
        static_argnames=("runner",),
        donate_argnames=("state",),
        compiler_options=compiler_options(tuple(SPLIT_COMPILER_OPTIONS.items())),
    )
    state, step_nocb_ms = loop(no_graphs, state)

    def dispatch(state):
        state, out = decode_rounds(
            step, runner, weights, state, slots, live, budget, eos, r, max_rounds=r
        )
        tokens, lens = np.asarray(out.tokens), np.asarray(out.lens)
        return state, int(out.num_rounds), tokens, lens

    state, *_ = dispatch(state)  # compile
    per_round, emitted = [], []
    for _ in range(n_disp):
        t0 = time.perf_counter()
        state, num, _, lens = dispatch(state)
        per_round.append((time.perf_counter() - t0) / max(num, 1))
        emitted.append(lens[:num].sum() / max(num, 1) / bs)
    rounds_ms = float(np.median(per_round)) * 1e3
    holder = {"state": state}

    def thunk():
        holder["state"], num, _, _ = dispatch(holder["state"])
        holder["num"] = num

    device_us = profile_kernel_us(thunk, 1)
    device_ms = None if device_us is None else device_us / holder["num"] / 1e3
    row = {
        "mode": mode,
        "bs": bs,
        "step wall ms": step_ms,
        "step wall ms (no graphs)": step_nocb_ms,
        "rounds wall ms": rounds_ms,
        "device ms": device_ms,
        "tokens / round": float(np.mean(emitted)),
    }
    if device_ms:
        row["step wall / device"] = step_ms / device_ms
        row["no graphs / device"] = step_nocb_ms / device_ms
        row["rounds wall / device"] = rounds_ms / device_ms
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--geometry", default="8b", choices=sorted(GEOMETRIES))
    p.add_argument("--modes", default="spec,greedy")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--rounds", type=int, default=32, help="decode_rounds' max_rounds")
    p.add_argument("--dispatches", type=int, default=3, help="timed dispatches")
    p.add_argument("--steps", type=int, default=32, help="timed single steps")
    p.add_argument("--out", default="", help="write lifted_step.{json,md} here")
    args = p.parse_args(argv)
    g = GEOMETRIES[args.geometry]
    target = make_target(g)
    params, draft, dparams = make_params(g, target)
    ffi = os.environ.get("JSPEC_TRITON_FFI", "1") != "0"
    header = (
        f"# lifted step: {device_name()}, {g.name}, prompt {args.prompt}, {args.rounds} rounds a "
        f"dispatch, Triton launch {'typed FFI' if ffi else 'legacy'}, jax {jax.__version__}"
    )
    print(header, flush=True)
    rows = []
    for mode in args.modes.split(","):
        for bs in (int(b) for b in args.batches.split(",")):
            t0 = time.perf_counter()
            rows.append(run_cell(g, target, params, draft, dparams, mode, bs, args))
            print(f"{mode} bs {bs}: {rows[-1]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    table = format_table(rows, COLUMNS)
    print(table, flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "lifted_step.json"), "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "lifted_step.md"), "w") as f:
            f.write(header + "\n\n" + table + "\n")
    return rows


if __name__ == "__main__":
    main()
