# Over 400 lines: one pipeline bench (run, steady-state snapshot, profiler split, report) whose
# pieces bench/real_size.py reuses.
"""End-to-end engine benchmark: spec decode vs plain greedy, and the per-step time split.

    python -m bench.e2e [--quick] [--configs demo,bs64] [--out e2e.md] [--no-split]
                        [--impl auto|xla|pallas] [--attention-impl auto|xla|triton]
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python -m bench.e2e   # exact device split

Per config two rows (plain greedy, spec): generated tokens/s over the whole run (continuous
batching, prefill included), mean decode-step wall time, mean acceptance length, the lossless
check. The spec row also splits one steady-state step two ways.

**Wall split** (first table): each phase jitted and timed on its own (donated inputs, wall time
incl. dispatch, median):

* draft: the S-1 draft forwards + top-k selection + organize, and the draft extend;
* verify: the target forward over the N tree nodes;
* bookkeeping: prepare_for_decode, draft layout / hole copy / attention metadata, build tree,
  verify_tree_greedy, accepted-KV move and compaction, commit.

``step ms (fused, wall)`` is the engine's one-jit step on the same snapshot.

**Device split** (second table, GPU only): the summed GPU kernel time of that fused step from a
profiler trace (:func:`bench._timing.profile_split_us`), each kernel classed by the HLO op it
runs: ``model`` = ops under ``jax.named_scope(jspec.engine.protocol.MODEL_SCOPE)`` (every model
forward and LM head; ``draft us`` / ``verify us`` = its ``draft`` / ``target`` sub-scopes: the
draft forwards + draft extend, and the target's verify forward), ``bookkeeping`` = everything
else, *including* kernels that could not be
attributed to an HLO op (conservative). A fusion is classed by its root op; ``mixed us`` is the
time of model-rooted kernels into which XLA fused bookkeeping ops (index math fused into KV
writes and embedding gathers): ``bookkeeping us + mixed us`` bounds the bookkeeping above.

Command buffers: with XLA's default CUDA-graph command buffers the profiler does not name the
HLO op of a kernel inside the graph; the split then falls back to matching kernel names to
instruction names (cuBLAS / Triton kernels stay unattributed, so bookkeeping is overstated).
No command buffers, exact split: run with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` (an
empty list turns them off; bench/device_run.sh does so for its e2e-split.md). The ``command
buffers`` column says which mode ran; ``step us (device)`` with them on is the normal-mode
device time of the step.

For ``bs64`` (bs=64, topk=8, steps=5, page 16) ``vs sglang anchors`` = device bookkeeping /
the sum of sglang's per-op device times for the same ops at B=64 (shared/ANCHORS.md, H200):
attention metadata (cascade draft attention: ``draft_decode_set_expand_metadata``), build tree,
verify, and the accepted-KV move (measured there on 32 layers x 2 KB rows, a far bigger pool
than this model's); ``(no move)`` leaves the move out of the sum, the strict comparison.
The target (GitHub issue): below 1/3.

Configs: ``demo`` = the ``jspec demo`` default (page 16, topk 4, steps 3, 8 draft tokens,
6 prompts x 48 tokens); ``bs64`` = 64 requests, page 16, topk 8, steps 5, 32 draft tokens
(same model).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import statistics
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from bench._timing import (
    MIXED_SUFFIX,
    UNATTRIBUTED,
    device_name,
    format_table,
    profile_split_us,
)

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

COLUMNS = (
    "config",
    "mode",
    "tokens/s",
    "step ms",
    "accept len",
    "step ms (fused, wall)",
    "draft ms (wall)",
    "verify ms (wall)",
    "bookkeeping ms (wall)",
    "bookkeeping % (wall)",
    "lossless",
    "note",
)
DEVICE_COLUMNS = (
    "config",
    "mode",
    "step us (device)",
    "model us",
    "draft us",
    "verify us",
    "bookkeeping us",
    "unattributed us",
    "mixed us",
    "bookkeeping % (device)",
    "vs sglang anchors",
    "vs sglang anchors (no move)",
    "command buffers",
)

# sglang 0.5.23's own ops at B=64 on the H200, device us per call (shared/ANCHORS.md): the ops
# of jspec's step bookkeeping. Metadata: the engine's default draft attention is "cascade", so
# ``draft_decode_set_expand_metadata`` (torch.compile, d=5: 94-117 us; the low end, to be
# conservative). The move: sglang's tiled ``copy_all_layer_kv_cache_tiled``, n=64 rows of 32
# layers x K and V x 2 KB rows (a much larger pool geometry than the bench model's).
SGLANG_METADATA_US_B64 = 94.0
SGLANG_BUILD_TREE_US_B64 = 50.0
SGLANG_VERIFY_US_B64 = 9.0
SGLANG_MOVE_KV_US_N64 = 722.0
SGLANG_ANCHOR_NO_MOVE_US = SGLANG_METADATA_US_B64 + SGLANG_BUILD_TREE_US_B64 + SGLANG_VERIFY_US_B64
SGLANG_ANCHOR_US = SGLANG_ANCHOR_NO_MOVE_US + SGLANG_MOVE_KV_US_N64


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
    compare_anchors: bool = False  # the ANCHORS.md shapes (bs 64, topk 8, steps 5, page 16)


def _cases(quick: bool) -> dict[str, Case]:
    if quick:
        return {
            "demo": Case("demo", 16, 4, 3, 8, 3, 8, 4, 1),
            "bs64": Case("bs4-k4-s2 (quick)", 16, 4, 2, 6, 4, 6, 4, 2),
        }
    return {
        "demo": Case("demo", 16, 4, 3, 8, 6, 48, 4, 1),
        "bs64": Case("bs64-k8-s5", 16, 8, 5, 32, 64, 32, 64, 8, compare_anchors=True),
    }


def _model(quick: bool):
    from jspec.models import LlamaConfig, LlamaTarget, toy_eagle1, toy_llama_params

    if quick:
        cfg = LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
        )
        residual_scale = 1.5
    else:  # the jspec demo default
        cfg = LlamaConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
        )
        residual_scale = 2.0
    target = LlamaTarget(cfg)
    params = toy_llama_params(target, 0, residual_scale=residual_scale)
    return (target, params, *toy_eagle1(target, params, 1))


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


# Rounds per dispatch on the way to the steady state (whatever the engine's max_rounds): the
# timed step's context stays the prompt + a few rounds, as the tables were measured.
STEADY_ROUNDS = 8


def _steady_state(engine, prompts, max_new: int):
    """Admit and prefill every prompt, run two decode dispatches of at most
    :data:`STEADY_ROUNDS` rounds; return (state, slot_idx, live) of shard 0."""
    loop = admit_all(engine, prompts, max_new)
    from jspec.engine.scheduler import RunStats

    stats = RunStats(mode=engine.mode)
    for _ in range(2):
        engine._decode_step(loop, stats, max_rounds=STEADY_ROUNDS)
    slot_idx, live, _ = engine._bucket_arrays(loop.running)
    return engine._shard_state(0), jnp.asarray(slot_idx[0]), jnp.asarray(live[0])


def steady_max_len(engine, prompts) -> int:
    """An upper bound on the tokens a request holds in :func:`_steady_state` and one step
    after it (the prompt, three dispatches of ``max_rounds`` rounds of at most ``num_steps + 1``
    tokens, a page): the timed step's launch hint (``Engine._step_for``)."""
    spec = engine.ecfg.spec
    per_round = spec.num_steps + 1 if engine.mode == "spec" else 1
    rounds = min(STEADY_ROUNDS, engine.max_rounds)
    return max(map(len, prompts)) + 3 * rounds * per_round + spec.page_size


def admit_all(engine, prompts, max_new: int, stats=None, sampling=None):
    """The engine's host loop up to "every prompt is live": admission and prefill rounds (no
    decode step); returns the loop bookkeeping (``jspec.engine.scheduler._Loop``).
    ``sampling``: one resolved (seeded) ``SamplingParams`` per prompt, or None (greedy)."""
    import collections
    import time

    from jspec.engine.scheduler import Request, RunStats, _Loop

    d, m = engine.num_devices, engine.ecfg.spec.max_running_requests
    loop = _Loop(
        pending=collections.deque(
            Request(
                i,
                list(p),
                max_new,
                prefill_ids=list(p),
                **({} if sampling is None else {"sampling": sampling[i]}),
            )
            for i, p in enumerate(prompts)
        ),
        prefilling=[[] for _ in range(d)],
        running=[{} for _ in range(d)],
        free_slots=[list(range(m)) for _ in range(d)],
        t_start=time.perf_counter(),
    )
    stats = RunStats(mode=engine.mode) if stats is None else stats
    while loop.pending or any(loop.prefilling):
        engine._admit(0, loop)
        if not any(loop.prefilling):
            raise RuntimeError("admit_all: the pool or the batch slots cannot hold every prompt")
        engine._prefill_round(loop, stats)
    return loop


def _command_buffers_off() -> bool:
    """True when XLA_FLAGS sets ``--xla_gpu_enable_command_buffer=`` to an empty list."""
    values = re.findall(r"--xla_gpu_enable_command_buffer=(\S*)", os.environ.get("XLA_FLAGS", ""))
    return bool(values) and values[-1].strip("'\"") == ""


def _classify(op_name: str) -> str:
    """``target`` / ``draft`` for HLO ops under the model's named scopes (target = the verify
    forward in a spec step), else ``bookkeeping``."""
    from jspec.engine.protocol import MODEL_SCOPE

    parts = op_name.split("/")
    if MODEL_SCOPE not in parts:
        return "bookkeeping"
    sub = parts[parts.index(MODEL_SCOPE) + 1 :]
    return "draft" if sub and sub[0] == "draft" else "target"


def _op_key(op_name: str) -> str:
    """A bookkeeping kernel's op for the ``--top`` table: its op_name's last scopes (jit /
    shard_map / cond wrappers dropped); every model kernel is ``"model"``."""
    from jspec.engine.protocol import MODEL_SCOPE

    parts = [
        p
        for p in op_name.split("/")
        if p
        and p not in ("jit(main)", "shard_map", "cond", "branch_0_fun", "branch_1_fun")
        and not p.startswith(("jit(fn)", "jit(<lambda>)", "jit(per_shard)"))
    ]
    if MODEL_SCOPE in parts:
        return "model:" + "/".join(parts[parts.index(MODEL_SCOPE) + 1 :][-4:])
    if op_name.startswith("@"):  # no op_name metadata: the HLO instruction
        return op_name
    return "/".join(parts[-4:]) or "(no op_name)"


def _device_row(split: dict[str, float], case: Case) -> dict:
    """The device-split columns from ``profile_split_us``'s per-class us.

    Unattributed kernels count as bookkeeping; kernels fusing ops of both classes count by
    their root op, and ``mixed us`` is the model-rooted ones (their fused bookkeeping index
    math is in ``model us``: ``bookkeeping us + mixed us`` bounds the bookkeeping above).
    """
    unattributed = split.get(UNATTRIBUTED, 0.0)
    mixed = split.get("target" + MIXED_SUFFIX, 0.0) + split.get("draft" + MIXED_SUFFIX, 0.0)
    draft = split.get("draft", 0.0) + split.get("draft" + MIXED_SUFFIX, 0.0)
    target = split.get("target", 0.0) + split.get("target" + MIXED_SUFFIX, 0.0)
    bookkeeping = (
        split.get("bookkeeping", 0.0) + split.get("bookkeeping" + MIXED_SUFFIX, 0.0) + unattributed
    )
    row = {
        "step us (device)": split["total"],
        "model us": draft + target,
        "draft us": draft,
        "verify us": target,
        "bookkeeping us": bookkeeping,
        "unattributed us": unattributed,
        "mixed us": mixed,
        "bookkeeping % (device)": 100.0 * bookkeeping / split["total"],
        "command buffers": "off" if _command_buffers_off() else "on (split by kernel name)",
    }
    row["_by_op"] = {k[3:]: v for k, v in split.items() if k.startswith("by:")}
    if case.compare_anchors:
        row["vs sglang anchors"] = bookkeeping / SGLANG_ANCHOR_US
        row["vs sglang anchors (no move)"] = bookkeeping / SGLANG_ANCHOR_NO_MOVE_US
    return row


def _split(
    engine, prompts, case: Case, iters: int
) -> tuple[dict[str, float], dict[str, float] | None]:
    """Per-phase and fused step wall ms, and the fused step's device us split (None on CPU),
    on a steady-state snapshot."""
    from jspec.engine import spec_step as ss

    runner, weights = engine.runner, engine.weights
    state, slot_idx, live = _steady_state(engine, prompts, case.max_new_tokens)
    jit = functools.partial(jax.jit, donate_argnums=(0,))
    prepare = jit(lambda st, si, lv: ss.phase_prepare(runner.ecfg, runner.kv, st, si, lv))
    ms = {"draft": 0.0, "verify": 0.0, "bookkeeping": 0.0}
    ms["bookkeeping"] += _median_ms(prepare, lambda: (_copy(state), slot_idx, live), iters)
    ctx = prepare(_copy(state), slot_idx, live)
    for kind, phase in ss.PHASES:
        fn = jit(
            functools.partial(
                lambda k, ph, c: ss.call_phase(k, ph, runner, weights, c), kind, phase
            )
        )
        snap = ctx
        ms[kind] += _median_ms(fn, lambda snap=snap: (_copy(snap),), iters)
        ctx = fn(_copy(ctx))
    commit = jax.jit(lambda st, c: ss.phase_commit(runner.kv, st, c), donate_argnums=(0, 1))
    ms["bookkeeping"] += _median_ms(commit, lambda: (_copy(state), _copy(ctx)), iters)
    # The engine's own (already compiled) step on the stacked one-shard snapshot.
    stacked = jax.tree.map(lambda x: x[None], state)
    step = engine._step_for(int(slot_idx.shape[-1]), steady_max_len(engine, prompts))
    ms["fused"] = _median_ms(
        lambda st: step(weights, st, slot_idx[None], live[None]),
        lambda: (_copy(stacked),),
        iters,
    )
    device_us = profile_split_us(
        step,
        lambda: (weights, _copy(stacked), slot_idx[None], live[None]),
        _classify,
        breakdown=_op_key,
    )
    return ms, device_us


def _run_case(
    case: Case,
    model,
    quick: bool,
    split: bool = True,
    impl: str = "auto",
    attention_impl: str = "auto",
) -> list[dict]:
    from jspec.engine.scheduler import Engine
    from jspec.engine.state import make_engine_config

    target, params, draft_model, draft = model
    rng = np.random.default_rng(0)
    lens = rng.integers(4, 41 if not quick else 20, case.num_prompts)
    prompts = [rng.integers(0, target.vocab_size, int(n)).tolist() for n in lens]
    context_len = 1 << int(np.ceil(np.log2(int(lens.max()) + case.max_new_tokens + 1)))
    ecfg = make_engine_config(
        target,
        page_size=case.page_size,
        topk=case.topk,
        num_steps=case.num_steps,
        num_draft_tokens=case.num_draft_tokens,
        context_len=context_len,
        max_running_requests=case.max_running,
        max_prompt_len=int(lens.max()),
        batch_buckets=(case.max_running,),
        prefill_batch=case.prefill_batch,
        impl=impl,
        attention_impl=attention_impl,
    )
    rows = []
    outputs = {}
    for mode in ("greedy", "spec"):
        row = {"config": case.name, "mode": mode}
        try:
            engine = (
                Engine(ecfg, target, params, draft_model, draft)
                if mode == "spec"
                else Engine(ecfg, target, params)
            )
            engine.generate(prompts[:1], 2)  # compile prefill / step / release
            out, stats = engine.generate(prompts, case.max_new_tokens)
            outputs[mode] = out
            row.update(
                {
                    "tokens/s": stats.tokens_per_s,
                    "step ms": stats.decode_s / max(stats.num_decode_steps, 1) * 1e3,
                    "accept len": stats.mean_accept_len if mode == "spec" else 1.0,
                }
            )
            if mode == "spec":
                row["lossless"] = "PASS" if out == outputs.get("greedy") else "FAIL"
            if mode == "spec" and split:
                ms, device_us = _split(
                    engine, prompts[: case.max_running], case, 5 if quick else 20
                )
                total = ms["draft"] + ms["verify"] + ms["bookkeeping"]
                row.update(
                    {
                        "step ms (fused, wall)": ms["fused"],
                        "draft ms (wall)": ms["draft"],
                        "verify ms (wall)": ms["verify"],
                        "bookkeeping ms (wall)": ms["bookkeeping"],
                        "bookkeeping % (wall)": 100.0 * ms["bookkeeping"] / total,
                    }
                )
                if device_us is not None:
                    row.update(_device_row(device_us, case))
        except Exception as e:  # noqa: BLE001 - report the failure in the row, keep going
            traceback.print_exc()
            row["note"] = f"FAILED: {type(e).__name__}: {e}"[:200]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and batch (CPU smoke)")
    parser.add_argument("--configs", default="demo,bs64")
    parser.add_argument("--out", default="", help="also write the printed report here")
    parser.add_argument(
        "--impl",
        default="auto",
        choices=("auto", "xla", "pallas"),
        help="bookkeeping kernels (EngineConfig.impl; auto = pallas on GPU)",
    )
    parser.add_argument(
        "--no-split",
        action="store_true",
        help="tokens/s and step ms only (no per-phase or device split)",
    )
    parser.add_argument(
        "--attention-impl",
        default="auto",
        choices=("auto", "xla", "triton"),
        help="model attention (make_engine_config's attention_impl; auto = triton on GPU)",
    )
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if on_gpu and not _command_buffers_off():
        print(
            "note: XLA command buffers are on: the device split matches kernel names to HLO "
            "ops and leaves cuBLAS/Triton kernels unattributed (counted as bookkeeping). Exact:"
            " XLA_FLAGS=--xla_gpu_enable_command_buffer=",
            flush=True,
        )
    cases = _cases(args.quick)
    model = _model(args.quick)
    rows: list[dict] = []
    for name in [c for c in args.configs.split(",") if c]:
        if name not in cases:
            rows.append({"config": name, "note": f"unknown config (choose {sorted(cases)})"})
            continue
        # --quick: the phase split (7 extra compiles) only for the first config.
        rows.extend(
            _run_case(
                cases[name],
                model,
                args.quick,
                split=not args.no_split and (not args.quick or not rows),
                impl=args.impl,
                attention_impl=args.attention_impl,
            )
        )
    text = (
        f"e2e on {device_name()} ({'quick' if args.quick else 'full'}); model vocab "
        f"{model[0].vocab_size}, hidden {model[0].hidden_size}, {model[0].num_layers} "
        f"layers, {model[0].dtype}; bookkeeping impl {args.impl}, attention impl "
        f"{args.attention_impl}\n\n"
        f"{format_table(rows, COLUMNS)}\n\n"
        f"{_device_report(rows, on_gpu)}"
    )
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return rows


def _device_report(rows: list[dict], on_gpu: bool) -> str:
    """The device-split table of the spec rows and how to read it."""
    spec_rows = [r for r in rows if r.get("mode") == "spec"]
    if not on_gpu:
        return "device split: GPU only (no GPU kernels in a CPU profiler trace)"
    bounds = "".join(
        f"\n{r['config']}: counting the mixed kernels as bookkeeping too: "
        f"{(r['bookkeeping us'] + r['mixed us']) / SGLANG_ANCHOR_US:.2f} vs sglang anchors, "
        f"{(r['bookkeeping us'] + r['mixed us']) / SGLANG_ANCHOR_NO_MOVE_US:.2f} (no move)."
        for r in spec_rows
        if "vs sglang anchors" in r
    )
    return (
        f"Fused step, device time per step (GPU kernel time from a profiler trace):\n\n"
        f"{format_table(spec_rows, DEVICE_COLUMNS)}\n\n"
        "model = ops under jax.named_scope('jspec_model') (forwards + LM heads); bookkeeping "
        "= everything else, unattributed kernels included (conservative). A kernel where "
        "XLA fused ops of both is classed by its root op; mixed us = the model-rooted ones "
        "(KV writes, embedding gathers with bookkeeping index math fused in), inside model "
        "us: bookkeeping us + mixed us is an upper bound on the bookkeeping.\n"
        f"vs sglang anchors = bookkeeping us / {SGLANG_ANCHOR_US:.0f} us, the sum of "
        f"sglang's B=64 ops (shared/ANCHORS.md): attention metadata "
        f"{SGLANG_METADATA_US_B64:.0f} + build tree {SGLANG_BUILD_TREE_US_B64:.0f} + verify "
        f"{SGLANG_VERIFY_US_B64:.1f} + move_kv_cache {SGLANG_MOVE_KV_US_N64:.0f} (n=64 rows, "
        f"32 layers x 2 KB: a bigger pool geometry than this model's); (no move) = / "
        f"{SGLANG_ANCHOR_NO_MOVE_US:.0f} us, the strict one. Target: < 0.33.{bounds}"
        f"{''.join(_top_ops(r) for r in spec_rows)}"
    )


def _top_ops(row: dict, top: int = 12) -> str:
    """The ``top`` most expensive bookkeeping and model ops of a spec row's fused step."""
    by_op = row.get("_by_op") or {}
    text = ""
    for title, is_model in (("bookkeeping", False), ("model", True)):
        ops = sorted(
            ((us, key) for key, us in by_op.items() if key.startswith("model:") == is_model),
            reverse=True,
        )
        if ops:
            lines = "".join(f"\n| {key} | {us:.1f} |" for us, key in ops[:top])
            text += (
                f"\n\n{row['config']}: top {title} ops by device us per step (op_name's "
                f"last scopes)\n\n| op | us |\n|---|---|{lines}"
            )
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
