"""The engine run behind ``jspec generate``: build the engine for the checked requests, compile
(through the persistent compilation cache), generate with continuous batching, and report.

A prompts file's run prints one JSON line per request on stdout, in input order::

    {"index": 0, "token_ids": [...], "text": "...", "num_tokens": 12, "num_prompt_tokens": 7,
     "finish_reason": "length", "sampling": {"temperature": 0.0, ...}, "ttft_s": 0.031}

(``text``: null without a tokenizer; ``finish_reason``: ``"eos"`` when the last token is a stop
id, else ``"length"``; ``sampling``: the parameters used, a drawn seed included; ``ttft_s``:
seconds from the run's start to the request's first token, ``RunStats.ttft_s``), then the run's
stats on stderr (one JSON object with ``--json``). Ctrl-C prints the lines of the requests
that finished (their ``ttft_s`` as the host loop handed the first token over: up to one
dispatch later) and a note on stderr, and exits 130; the engine frees everything before its
next run (``Engine.reset``) and is dropped here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jspec.apps._cli import (
    EXIT_INTERRUPTED,
    check_context,
    check_run_memory,
    describe_sampling,
    engine_config_from_args,
)
from jspec.apps.compile_cache import count_cache_events
from jspec.apps.prompts_file import PromptLine, check_prompts


def decode_tokens_per_s(stats: Any) -> float:
    """Tokens after each request's first over the decode dispatches' time."""
    return (stats.num_tokens - stats.num_requests) / stats.decode_s if stats.decode_s > 0 else 0.0


def _warm_sampling(params: Sequence[Any]) -> Any:
    """One sampled ``SamplingParams`` whose filters are on wherever any request's are (the
    variant ``Engine.warmup`` compiles), or None when every request is greedy."""
    from jspec.engine.sampling_params import SamplingParams

    sampled = [p for p in params if not p.is_greedy]
    if not sampled:
        return None
    return SamplingParams(
        temperature=1.0,
        top_k=max(p.top_k for p in sampled),
        top_p=min(p.top_p for p in sampled),
        min_p=max(p.min_p for p in sampled),
        seed=0,
    )


def build_engine(
    args: argparse.Namespace,
    ecfg: Any,
    models: tuple[Any, Any, Any, Any],
    sampling: Sequence[Any],
    say: Callable[[str], None],
    *,
    eos: Sequence[int] = (),
    load: Callable[[], tuple[Any, Any]] | None = None,
) -> Any:
    """The engine of ``models`` (target, params, draft, draft params), compiled with progress
    for the requests' ``sampling`` (one resolved ``SamplingParams`` each).

    ``load``: None (the params are the weights), or a callable returning ``(params, draft
    params)``: then ``models``' params are their shapes (``jax.ShapeDtypeStruct`` leaves) and
    prefill and the decode rounds compile on a background thread while ``load`` runs
    (``Engine.precompile``, ``Engine.set_weights``)."""
    from jspec import probes
    from jspec.engine.scheduler import Engine

    target, params, draft, draft_params = models
    if load is None:  # the weights are resident now (counted in the free memory already)
        check_run_memory(ecfg, target, draft, weight_bytes=0, num_devices=args.devices)
    checkify = args.checkify or probes.probes_on()
    with probes.probes_enabled(True) if args.checkify else contextlib.nullcontext():
        engine = Engine(
            ecfg,
            target,
            params,
            draft,
            draft_params,
            num_devices=args.devices,
            eos_token_id=list(eos) or None,
            checkify=checkify,
            adaptive=not getattr(args, "no_adaptive", False),
            max_rounds=args.max_rounds,
        )
        t0 = time.perf_counter()
        say(
            f"compiling prefill / decode / release for {len(ecfg.batch_buckets)} bucket(s) "
            f"(context {ecfg.spec.context_len}, page size {ecfg.spec.page_size}) ..."
        )
        warm = _warm_sampling(sampling)
        with count_cache_events() as cached:
            if load is not None:
                engine.precompile(warm)
                try:
                    engine.set_weights(*load())
                except BaseException:
                    engine.cancel_compiles()
                    raise
            # adaptive speculation's fallback rounds compile only if acceptance looks poor
            engine.warmup(warm, background=True)
    note = cached.describe()
    say(f"compiled [{time.perf_counter() - t0:.1f} s]" + (f" ({note})" if note else ""))
    return engine


def generate_all(
    args: argparse.Namespace,
    engine: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    sampling: Sequence[Any],
    say: Callable[[str], None],
    on_tokens: Callable[[int, list[int]], None] | None = None,
) -> tuple[list[list[int]], Any]:
    """``engine.generate`` of every request (under ``--checkify``'s probes when asked); then
    the background compiles nothing will use any more are dropped (the process's exit waits
    only for one already running)."""
    from jspec import probes

    say(f"generating {sum(max_new_tokens)} tokens for {len(prompts)} request(s)")
    try:
        with probes.probes_enabled(True) if args.checkify else contextlib.nullcontext():
            return engine.generate(
                [list(p) for p in prompts],
                list(max_new_tokens),
                sampling=list(sampling),
                on_tokens=on_tokens,
            )
    finally:
        engine.cancel_compiles()


def many_config(
    args: argparse.Namespace, target: Any, draft: Any, lines: Sequence[PromptLine]
) -> Any:
    """The ``EngineConfig`` of a prompts file's requests (``--max-running`` at once, a context
    holding the longest), every line checked against the model first."""
    check_prompts(lines, target)
    longest = max(lines, key=lambda line: len(line.token_ids) + line.max_new_tokens)
    context_len = check_context(target, len(longest.token_ids), longest.max_new_tokens)
    return engine_config_from_args(
        args,
        target,
        draft,
        context_len=context_len,
        max_running_requests=min(args.max_running, len(lines)),
        max_prompt_len=max(len(line.token_ids) for line in lines),
        shortest_prompt=min(len(line.token_ids) for line in lines),
    )


class _Tracker:
    """Each request's tokens as the engine hands them over (``on_tokens``), and when the first
    came after ``t_start`` (set when generation starts): what a Ctrl-C prints."""

    def __init__(self, lines: Sequence[PromptLine], eos: Sequence[int]) -> None:
        self.lines, self.eos = lines, set(eos)
        self.tokens: list[list[int]] = [[] for _ in lines]
        self.first_s: list[float] = [-1.0] * len(lines)
        self.t_start = time.perf_counter()

    def __call__(self, index: int, new_ids: list[int]) -> None:
        if not self.tokens[index]:
            self.first_s[index] = time.perf_counter() - self.t_start
        self.tokens[index].extend(new_ids)

    def finished(self, index: int) -> bool:
        tokens = self.tokens[index]
        return bool(tokens) and (
            len(tokens) >= self.lines[index].max_new_tokens or tokens[-1] in self.eos
        )


def _record(line: PromptLine, tokens: list[int], ttft_s: float, eos: set, tokenizer: Any) -> dict:
    return {
        "index": line.index,
        "token_ids": tokens,
        "text": tokenizer.decode(tokens) if tokenizer is not None else None,
        "num_tokens": len(tokens),
        "num_prompt_tokens": len(line.token_ids),
        "finish_reason": "eos" if tokens and tokens[-1] in eos else "length",
        "sampling": line.sampling.to_dict(),
        "ttft_s": ttft_s,
    }


def run_many(
    args: argparse.Namespace,
    ecfg: Any,
    models: tuple[Any, Any, Any, Any],
    lines: Sequence[PromptLine],
    say: Callable[[str], None],
    *,
    eos: Sequence[int],
    tokenizer: Any,
    load: Callable[[], tuple[Any, Any]] | None = None,
) -> int:
    """Run a prompts file's requests; JSON lines on stdout, stats on stderr; exit status (130
    after Ctrl-C, with the finished requests' lines printed); ``load``: ``build_engine``'s."""
    prompts = [line.token_ids for line in lines]
    max_new = [line.max_new_tokens for line in lines]
    sampling = [line.sampling for line in lines]
    tracker = _Tracker(lines, eos)
    try:
        engine = build_engine(args, ecfg, models, sampling, say, eos=eos, load=load)
        tracker.t_start = time.perf_counter()
        outs, stats = generate_all(args, engine, prompts, max_new, sampling, say, tracker)
    except KeyboardInterrupt:
        done = [i for i in range(len(lines)) if tracker.finished(i)]
        for i in done:
            record = _record(lines[i], tracker.tokens[i], tracker.first_s[i], set(eos), tokenizer)
            print(json.dumps(record), flush=True)
        print(
            f"jspec generate: interrupted: {len(done)} of {len(lines)} request(s) finished "
            "(their lines are on stdout)",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_INTERRUPTED
    for line, tokens, ttft in zip(lines, outs, stats.ttft_s, strict=True):
        print(json.dumps(_record(line, tokens, ttft, set(eos), tokenizer)))
    summary = run_summary(stats, args.steps)
    if args.json:
        print(json.dumps(summary), file=sys.stderr)
    else:
        print(f"jspec generate: {describe_summary(summary)}", file=sys.stderr)
    return 0


def run_summary(stats: Any, num_steps: int) -> dict:
    """The run's stats as a JSON-ready dict (TTFT apart from decode and total throughput)."""
    ttft = np.asarray(stats.ttft_s, float)
    return {
        "mode": stats.mode,
        "num_requests": stats.num_requests,
        "num_tokens": stats.num_tokens,
        "wall_s": stats.wall_s,
        "tokens_per_s": stats.tokens_per_s,
        "decode_tokens_per_s": decode_tokens_per_s(stats),
        "ttft_s": {
            "mean": float(ttft.mean()),
            "p50": float(np.median(ttft)),
            "max": float(ttft.max()),
        },
        "num_decode_steps": stats.num_decode_steps,
        "mean_accept_len": stats.mean_accept_len if stats.mode == "spec" else 1.0,
        "max_accept_len": num_steps + 1 if stats.mode == "spec" else 1,
    }


def describe_summary(s: dict) -> str:
    """One line of :func:`run_summary`'s numbers."""
    ttft = s["ttft_s"]
    text = (
        f"{s['num_requests']} request(s), {s['num_tokens']} tokens in {s['wall_s']:.2f} s: "
        f"{s['tokens_per_s']:.1f} tokens/s total, decode {s['decode_tokens_per_s']:.1f} "
        f"tokens/s, TTFT mean {ttft['mean']:.3f} s (p50 {ttft['p50']:.3f}, max "
        f"{ttft['max']:.3f}); {s['mode']}, {s['num_decode_steps']} decode steps"
    )
    if s["mode"] == "spec":
        text += f", mean acceptance length {s['mean_accept_len']:.2f} (max {s['max_accept_len']})"
    return text


def print_single(
    args: argparse.Namespace,
    out: list[int],
    stats: Any,
    tokenizer: Any,
    sampling: Any,
    prompt_ids: Sequence[int],
    eos: Sequence[int],
) -> None:
    """The stats lines (and the ``--json`` object) of a one-prompt run; the text is out."""
    text = tokenizer.decode(out) if tokenizer is not None else None
    mode = stats.mode
    how = "greedy" if sampling.is_greedy else describe_sampling(sampling)
    ttft = stats.ttft_s[0] if stats.ttft_s else 0.0
    decode_rate = decode_tokens_per_s(stats)
    print(
        f"{stats.num_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s ({mode}, {how}, "
        f"{stats.num_decode_steps} decode steps, {stats.wall_s:.2f} s; TTFT {ttft:.3f} s, "
        f"decode {decode_rate:.1f} tokens/s)"
    )
    if mode == "spec":
        print(
            f"mean acceptance length: {stats.mean_accept_len:.2f} tokens/step "
            f"(max {args.steps + 1})"
        )
    if args.json:
        print(
            json.dumps(
                {
                    "token_ids": out,
                    "mode": mode,
                    "sampling": sampling.to_dict(),
                    "text": text,
                    "mean_accept_len": stats.mean_accept_len if mode == "spec" else 1.0,
                    "tokens_per_s": stats.tokens_per_s,
                    "decode_tokens_per_s": decode_rate,
                    "ttft_s": ttft,
                    "wall_s": stats.wall_s,
                    "num_tokens": stats.num_tokens,
                    "num_decode_steps": stats.num_decode_steps,
                    "finish_reason": "eos" if out and out[-1] in set(eos) else "length",
                    "prompt_ids": list(prompt_ids),
                }
            )
        )
