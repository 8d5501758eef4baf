"""``jspec demo``: end-to-end EAGLE tree speculative decoding on a small model, checked lossless.

Builds a small Llama target (:class:`jspec.models.LlamaTarget` with the toy init
:func:`jspec.models.toy_llama_params`) and its EAGLE-1 head (:func:`jspec.models.toy_eagle1`)
in seconds, or loads checkpoint directories through :mod:`jspec.models`, runs
the same prompts through plain greedy decoding and through the jitted speculative step with
continuous batching, and prints tokens/s for both, the mean acceptance length, the lossless
check (spec tokens == greedy tokens, asserted) and the allocator balance (leak check). Then,
unless ``--temperature 0``, a sampled run of both (default T 1; request i seeded ``--seed +
i``): tokens/s and the acceptance length when sampling. Compiles are kept in the persistent
compilation cache (:mod:`jspec.apps.compile_cache`; ``--no-compilation-cache``): a second run
with the same flags loads them.

    python -m jspec.cli demo [--page-size 16 --topk 4 --steps 3 --draft-tokens 8]
                             [--temperature 1 --top-k 0 --top-p 1 --min-p 0 --seed 0]
                             [--checkify] [--devices N] [--tensor-parallel T] ...
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from collections.abc import Sequence

import numpy as np

from jspec.apps._cli import (
    add_sampling_args,
    add_spec_args,
    check_context,
    check_run_memory,
    check_spec_args,
    describe_sampling,
    engine_config_from_args,
    run_cli,
    sampling_from_args,
    setup_devices,
)
from jspec.apps.compile_cache import add_cache_flag, count_cache_events, use_compilation_cache

# The demo's workload is built on the host, one random prompt per --num-prompts.
MAX_NUM_PROMPTS = 4096


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jspec demo", description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("speculative decoding")
    add_spec_args(g)
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=6)
    g.add_argument("--max-new-tokens", type=int, default=48)
    g.add_argument("--max-running", type=int, default=4, help="max running requests per device")
    g.add_argument(
        "--staggered", action="store_true", help="requests arrive over time (continuous batching)"
    )
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the toy model, the prompts and the sampled run (request i: seed + i)",
    )
    g = p.add_argument_group("model")
    g.add_argument("--vocab-size", type=int, default=512)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--intermediate-size", type=int, default=256)
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--num-heads", type=int, default=4)
    g.add_argument("--num-kv-heads", type=int, default=2)
    g.add_argument("--head-dim", type=int, default=32)
    g.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="bf16 may flip near-tied argmaxes between verify and plain decode",
    )
    g.add_argument(
        "--residual-scale",
        type=float,
        default=2.0,
        help="how strongly the context overrides the dominant transition",
    )
    g.add_argument(
        "--weights",
        default="",
        help="target checkpoint directory (HF Llama family; its config.json replaces the "
        "model flags above; default: the built toy)",
    )
    g.add_argument(
        "--draft-weights",
        default="",
        help="draft head directory (EAGLE-1 / EAGLE-3; default: the built toy head)",
    )
    g = p.add_argument_group("run")
    g.add_argument(
        "--checkify",
        action="store_true",
        help="all probes on (jspec.probes.checked); report that none fired",
    )
    g.add_argument(
        "--devices",
        type=int,
        default=1,
        help="data-parallel shards (each with its own pools and requests)",
    )
    g.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        help="devices per shard, splitting heads and MLP (sglang --tp-size); "
        "uses devices x tensor-parallel devices in all",
    )
    g.add_argument("--no-progress", action="store_true")
    add_cache_flag(g)
    add_sampling_args(p, temperature=1.0)
    return p


class _Progress:
    """A plain-text progress bar on stdout."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled, self.last = label, enabled, -1

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        width = 30
        filled = int(width * done / max(total, 1))
        if filled == self.last and done < total:
            return
        self.last = filled
        print(
            f"\r  {self.label:<6} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} tokens",
            end="",
            flush=True,
        )

    def close(self) -> None:
        if self.enabled:
            print(flush=True)


def _plan_models(args: argparse.Namespace) -> tuple:
    """``(target, draft, weight bytes)`` without building or reading a weight: the toy's models
    from the model flags, or checkpoint directories' configs and file headers
    (``jspec.models.checkpoint.inspect_*``: every check before a weight is read). A bad flag or
    file raises ``InputError`` naming it."""
    from jspec.engine.inputs import InputError
    from jspec.models import Eagle1Draft, LlamaConfig, LlamaTarget
    from jspec.models.checkpoint import inspect_draft, inspect_llama, weight_bytes

    try:
        if args.weights:
            target, nbytes = inspect_llama(args.weights, dtype=args.dtype)
        else:
            cfg = LlamaConfig(
                vocab_size=args.vocab_size,
                hidden_size=args.hidden_size,
                intermediate_size=args.intermediate_size,
                num_layers=args.num_layers,
                num_heads=args.num_heads,
                num_kv_heads=args.num_kv_heads,
                head_dim=args.head_dim,
                dtype=args.dtype,
            )
            target = LlamaTarget(cfg)
            nbytes = weight_bytes(target)
        if args.draft_weights:
            draft, draft_bytes = inspect_draft(args.draft_weights, target, dtype=target.dtype)
        else:
            draft = Eagle1Draft(target.config)  # toy_eagle1's model
            draft_bytes = weight_bytes(draft)
    except (ValueError, OSError) as e:
        raise InputError(str(e)) from None
    return target, draft, nbytes + draft_bytes


def _build_models(args: argparse.Namespace, target) -> tuple:
    """``(params, draft, draft_params)`` for :func:`_plan_models`'s ``target``: the toy init
    and its EAGLE-1 head, or the checkpoint directories read through :mod:`jspec.models`."""
    from jspec.engine.inputs import InputError
    from jspec.models import load_draft, load_llama, toy_eagle1, toy_llama_params

    try:
        if args.weights:
            target, params = load_llama(args.weights, dtype=args.dtype)
        else:
            params = toy_llama_params(target, args.seed, residual_scale=args.residual_scale)
        if args.draft_weights:
            draft_model, draft = load_draft(args.draft_weights, target, dtype=target.dtype)
        else:
            draft_model, draft = toy_eagle1(target, params, args.seed + 1)
    except (ValueError, OSError) as e:
        raise InputError(str(e)) from None
    return params, draft_model, draft


def main(argv: Sequence[str] | None = None) -> int:
    """``jspec demo``; bad flags: one line on stderr, exit status 2."""
    return run_cli(_main, "jspec demo", argv)


def _main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(argv) if argv is not None else None)
    from jspec.engine.inputs import InputError, check_count

    check_spec_args(args)
    check_count("--num-prompts", args.num_prompts)
    if args.num_prompts > MAX_NUM_PROMPTS:
        raise InputError(f"--num-prompts={args.num_prompts} must be <= {MAX_NUM_PROMPTS}")
    check_count("--seed", args.seed, 0)
    sampling = sampling_from_args(args, args.seed)
    sampled = [dataclasses.replace(sampling, seed=args.seed + i) for i in range(args.num_prompts)]
    sampling_from_args(args, args.seed + args.num_prompts - 1)  # the last seed fits too
    setup_devices(args.devices, args.tensor_parallel)
    use_compilation_cache(args.no_compilation_cache)

    import jax

    from jspec import probes
    from jspec.engine.scheduler import Engine

    t_build = time.perf_counter()
    target, draft_model, nbytes = _plan_models(args)
    cfg = target.config
    rng = np.random.default_rng(args.seed)
    lens = rng.integers(4, 41, args.num_prompts)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in lens]
    arrivals = [int(i * 3) for i in range(args.num_prompts)] if args.staggered else None
    max_prompt = int(max(lens))
    context_len = check_context(target, max_prompt, args.max_new_tokens)
    ecfg = engine_config_from_args(
        args,
        target,
        draft_model,
        context_len=context_len,
        max_running_requests=args.max_running,
        max_prompt_len=max_prompt,
    )
    check_run_memory(ecfg, target, draft_model, weight_bytes=nbytes, num_devices=args.devices)
    params, draft_model, draft = _build_models(args, target)
    devices = jax.devices()
    layout = (
        f"{args.devices} x {args.tensor_parallel} (data x tensor parallel)"
        if args.tensor_parallel > 1
        else f"{args.devices}"
    )
    print(
        f"jspec demo on {layout} x {devices[0].platform}:{getattr(devices[0], 'device_kind', '')}"
    )
    print(
        f"  model: vocab {cfg.vocab_size}, hidden {cfg.hidden_size}, {cfg.num_layers} layers, "
        f"{cfg.num_heads}/{cfg.num_kv_heads} heads x {cfg.head_dim}, {cfg.dtype}; "
        f"{type(draft_model).__name__} draft head (1 layer)  "
        f"[{time.perf_counter() - t_build:.1f} s]"
    )
    spec = ecfg.spec
    print(
        f"  spec: page_size {spec.page_size}, topk {spec.topk}, steps {spec.num_steps}, "
        f"draft tokens {spec.num_draft_tokens}, draft attention {ecfg.draft_attention}, "
        f"kernels {ecfg.kernels}; "
        f"{spec.num_pages} pages/device, buckets {ecfg.batch_buckets}"
    )
    print(
        f"  workload: {len(prompts)} prompts (len {int(min(lens))}-{max_prompt}), "
        f"{args.max_new_tokens} new tokens each, <= {args.max_running} running per device"
    )

    def run(engine: Engine, label: str, sampling=None):
        bar = _Progress(label, not args.no_progress)
        out, stats = engine.generate(
            prompts, args.max_new_tokens, arrivals=arrivals, progress=bar, sampling=sampling
        )
        bar.close()
        return out, stats

    # Probes on (--checkify or JSPEC_ENABLE_ASYNC_ASSERT=1): the engines run checkified.
    checkify = args.checkify or probes.probes_on()
    ctx = probes.probes_enabled(True) if args.checkify else contextlib.nullcontext()
    fired = None
    with ctx:
        t0 = time.perf_counter()
        greedy = Engine(ecfg, target, params, num_devices=args.devices, checkify=checkify)
        spec_engine = Engine(
            ecfg, target, params, draft_model, draft, num_devices=args.devices, checkify=checkify
        )
        with count_cache_events() as cached:
            greedy.warmup(sampling)
            spec_engine.warmup(sampling)
        note = cached.describe()
        print(
            f"  compiled prefill / decode / release for {len(ecfg.batch_buckets)} bucket(s) "
            f"[{time.perf_counter() - t0:.1f} s]" + (f" ({note})" if note else "")
        )
        try:
            ref, g_stats = run(greedy, "greedy")
            out, s_stats = run(spec_engine, "spec")
            if not sampling.is_greedy:
                _, gs_stats = run(greedy, "plain~", sampled)
                _, ss_stats = run(spec_engine, "spec~", sampled)
        except probes.ProbeError as e:
            fired = str(e)
    if fired is not None:
        print(f"checkify: a probe fired: {fired}")
        return 1

    lossless = out == ref
    print(f"tokens generated: {s_stats.num_tokens} (spec), {g_stats.num_tokens} (greedy)")
    print(
        f"plain greedy:     {g_stats.tokens_per_s:9.1f} tokens/s  "
        f"({g_stats.num_decode_steps} decode steps, {g_stats.wall_s:.2f} s)"
    )
    print(
        f"spec decode:      {s_stats.tokens_per_s:9.1f} tokens/s  "
        f"({s_stats.num_decode_steps} decode steps, {s_stats.wall_s:.2f} s)  "
        f"speedup x{s_stats.tokens_per_s / max(g_stats.tokens_per_s, 1e-9):.2f}"
    )
    print(
        f"mean acceptance length: {s_stats.mean_accept_len:.2f} tokens/step/request "
        f"(max {spec.num_steps + 1})"
    )
    print(
        f"lossless check: {'PASS' if lossless else 'FAIL'} (spec tokens == plain greedy "
        f"tokens for all {len(prompts)} prompts)"
    )
    if not sampling.is_greedy:
        print(
            f"sampled ({describe_sampling(sampling)} + i): "
            f"plain {gs_stats.tokens_per_s:.1f} tokens/s, "
            f"spec {ss_stats.tokens_per_s:.1f} tokens/s (speedup "
            f"x{ss_stats.tokens_per_s / max(gs_stats.tokens_per_s, 1e-9):.2f}), mean acceptance "
            f"length {ss_stats.mean_accept_len:.2f} tokens/step/request"
        )
    print(f"allocator balance: spec {s_stats.leak_check}; greedy {g_stats.leak_check}")
    if checkify:
        print("checkify: all probes on, none fired")
    if not lossless:
        for i, (a, b) in enumerate(zip(out, ref, strict=True)):
            if a != b:
                j = (
                    next(k for k in range(min(len(a), len(b))) if a[k] != b[k])
                    if any(x != y for x, y in zip(a, b))
                    else min(len(a), len(b))
                )
                print(
                    f"  prompt {i}: first difference at token {j}: spec {a[j : j + 5]} vs "
                    f"greedy {b[j : j + 5]}"
                )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
