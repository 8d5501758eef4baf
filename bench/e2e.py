"""End-to-end engine benchmark: spec decode vs plain greedy, and the per-step time split.

    python -m bench.e2e [--quick] [--configs demo,bs64]

Per config two rows (plain greedy, spec): generated tokens/s over the whole run (continuous
batching, prefill included), mean decode-step wall time, mean acceptance length, the lossless
check. The spec row also splits one steady-state step into its phases, each jitted and timed on
its own (donated inputs, wall time incl. dispatch, median):

* draft: the S-1 draft forwards + top-k selection + organize, and the draft extend;
* verify: the target forward over the N tree nodes;
* bookkeeping: prepare_for_decode, draft layout / hole copy / attention metadata, build tree,
  verify_tree_greedy, accepted-KV move and compaction, commit.

``step ms (fused)`` is the one-jit step on the same snapshot. Configs: ``demo`` = the
``jspec demo`` default (page 16, topk 4, steps 3, 8 draft tokens, 6 prompts x 48 tokens);
``bs64`` = 64 requests, page 16, topk 8, steps 5, 32 draft tokens (same model).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from bench._timing import device_name, format_table

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

COLUMNS = ("config", "mode", "tokens/s", "step ms", "accept len", "step ms (fused)",
           "draft ms", "verify ms", "bookkeeping ms", "bookkeeping %", "lossless", "note")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    page_size: int
    topk: int
    num_steps: int
    num_draft_tokens: int
    num_prompts: int
    max_new_tokens: int
    max_running: int
    prefill_batch: int


def _cases(quick: bool) -> dict[str, Case]:
    if quick:
        return {"demo": Case("demo", 16, 4, 3, 8, 3, 8, 4, 1),
                "bs64": Case("bs4-k4-s2 (quick)", 16, 4, 2, 6, 4, 6, 4, 2)}
    return {"demo": Case("demo", 16, 4, 3, 8, 6, 48, 4, 1),
            "bs64": Case("bs64-k8-s5", 16, 8, 5, 32, 64, 32, 64, 8)}


def _model(quick: bool):
    from jspec.engine.model import ModelConfig, init_draft_params, init_target_params

    if quick:
        cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8)
        params = init_target_params(cfg, 0, residual_scale=1.5)
    else:  # the jspec demo default
        cfg = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4,
                          num_heads=4, num_kv_heads=2, head_dim=32)
        params = init_target_params(cfg, 0, residual_scale=2.0)
    return cfg, params, init_draft_params(cfg, params, 1)


def _median_ms(fn, make_args, iters: int) -> float:
    """Median wall ms of ``fn(*make_args())`` (fresh donated inputs each call, made untimed)."""
    jax.block_until_ready(fn(*make_args()))
    samples = []
    for _ in range(iters):
        args = make_args()
        jax.block_until_ready(args)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _steady_state(engine, prompts, max_new: int):
    """Admit every prompt and run two decode steps; return (state, slot_idx, live) of shard 0."""
    import collections

    from jspec.engine.scheduler import Request, RunStats

    spec = engine.ecfg.spec
    pending = collections.deque(Request(i, p, max_new) for i, p in enumerate(prompts))
    running = [{}]
    free_slots = [list(range(spec.max_running_requests))]
    engine._admit(0, pending, running, free_slots)
    stats = RunStats(mode="spec")
    for _ in range(2):
        engine._decode_step(running, stats)
    slot_idx, live, _ = engine._bucket_arrays(running)
    return engine._shard_state(0), jnp.asarray(slot_idx[0]), jnp.asarray(live[0])


def _split(engine, prompts, case: Case, iters: int) -> dict[str, float]:
    """Per-phase and fused step times on a steady-state snapshot."""
    from jspec.engine import spec_step as ss

    ecfg, params, draft = engine.ecfg, engine.params, engine.draft
    state, slot_idx, live = _steady_state(engine, prompts, case.max_new_tokens)
    jit = functools.partial(jax.jit, donate_argnums=(0,))
    prepare = jit(lambda st, si, lv: ss.phase_prepare(ecfg, params, draft, st, si, lv))
    ms = {"draft": 0.0, "verify": 0.0, "bookkeeping": 0.0}
    ms["bookkeeping"] += _median_ms(prepare, lambda: (_copy(state), slot_idx, live), iters)
    ctx = prepare(_copy(state), slot_idx, live)
    for kind, phase in ss.PHASES:
        fn = jit(functools.partial(lambda ph, c: ph(ecfg, params, draft, c), phase))
        snap = ctx
        ms[kind] += _median_ms(fn, lambda snap=snap: (_copy(snap),), iters)
        ctx = fn(_copy(ctx))
    commit = jax.jit(lambda st, c: ss.phase_commit(ecfg, st, c), donate_argnums=(0, 1))
    ms["bookkeeping"] += _median_ms(commit, lambda: (_copy(state), _copy(ctx)), iters)
    # The engine's own (already compiled) step on the stacked one-shard snapshot.
    stacked = jax.tree.map(lambda x: x[None], state)
    ms["fused"] = _median_ms(
        lambda st: engine._step(params, draft, st, slot_idx[None], live[None]),
        lambda: (_copy(stacked),), iters)
    return ms


def _run_case(case: Case, model, quick: bool, split: bool = True) -> list[dict]:
    from jspec.engine.scheduler import Engine
    from jspec.engine.state import make_engine_config

    cfg, params, draft = model
    rng = np.random.default_rng(0)
    lens = rng.integers(4, 41 if not quick else 20, case.num_prompts)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in lens]
    context_len = 1 << int(np.ceil(np.log2(int(lens.max()) + case.max_new_tokens + 1)))
    ecfg = make_engine_config(
        cfg, page_size=case.page_size, topk=case.topk, num_steps=case.num_steps,
        num_draft_tokens=case.num_draft_tokens, context_len=context_len,
        max_running_requests=case.max_running, max_prompt_len=int(lens.max()),
        batch_buckets=(case.max_running,), prefill_batch=case.prefill_batch)
    rows = []
    outputs = {}
    for mode in ("greedy", "spec"):
        row = {"config": case.name, "mode": mode}
        try:
            engine = Engine(ecfg, params, draft if mode == "spec" else None)
            engine.generate(prompts[:1], 2)  # compile prefill / step / release
            out, stats = engine.generate(prompts, case.max_new_tokens)
            outputs[mode] = out
            row.update({"tokens/s": stats.tokens_per_s,
                        "step ms": stats.decode_s / max(stats.num_decode_steps, 1) * 1e3,
                        "accept len": stats.mean_accept_len if mode == "spec" else 1.0})
            if mode == "spec":
                row["lossless"] = "PASS" if out == outputs.get("greedy") else "FAIL"
            if mode == "spec" and split:
                ms = _split(engine, prompts[:case.max_running], case, 5 if quick else 20)
                total = ms["draft"] + ms["verify"] + ms["bookkeeping"]
                row.update({"step ms (fused)": ms["fused"], "draft ms": ms["draft"],
                            "verify ms": ms["verify"], "bookkeeping ms": ms["bookkeeping"],
                            "bookkeeping %": 100.0 * ms["bookkeeping"] / total})
        except Exception as e:  # noqa: BLE001 - report the failure in the row, keep going
            traceback.print_exc()
            row["note"] = f"FAILED: {type(e).__name__}: {e}"[:200]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and batch (CPU smoke)")
    parser.add_argument("--configs", default="demo,bs64")
    args = parser.parse_args(argv)
    cases = _cases(args.quick)
    model = _model(args.quick)
    rows: list[dict] = []
    for name in [c for c in args.configs.split(",") if c]:
        if name not in cases:
            rows.append({"config": name, "note": f"unknown config (choose {sorted(cases)})"})
            continue
        # --quick: the phase split (7 extra compiles) only for the first config.
        rows.extend(_run_case(cases[name], model, args.quick, split=not args.quick or not rows))
    print(f"e2e on {device_name()} ({'quick' if args.quick else 'full'}); model vocab "
          f"{model[0].vocab_size}, hidden {model[0].hidden_size}, {model[0].num_layers} layers, "
          f"{model[0].dtype}")
    print(format_table(rows, COLUMNS))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
