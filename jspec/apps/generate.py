"""``jspec generate``: text (or token ids) in, text out, from checkpoint directories.

    jspec generate --model DIR [--draft DIR] (--prompt TEXT | --prompt-ids "1 2 3")
                   --max-new-tokens N [--chat] [--json] [--no-progress] [spec flags of jspec demo]
                   [--temperature T --top-k K --top-p P --min-p M --seed S]
    jspec generate --model DIR [--draft DIR] --prompts-file FILE|- [--max-new-tokens N]
                   [--max-running N] [--chat] [...]

Without ``--draft`` it decodes plainly; with it, EAGLE tree speculative decoding (lossless:
greedy gives the same tokens, sampling the same distribution). ``--temperature 0`` (default) is
greedy; above 0 it samples (top-k, top-p, min-p applied once to the target's distribution),
reproducibly from ``--seed`` (drawn at random when not given, and reported). One prompt: it
streams the text (or the ids) to stdout as tokens are accepted, then prints tokens/s, and for
spec the mean acceptance length; with ``--json`` the last stdout line is one JSON object
(``token_ids``, ``mode``, ``sampling`` (the parameters used, seed included),
``mean_accept_len``, ``tokens_per_s``, ``decode_tokens_per_s``, ``ttft_s``, ...). Progress
(loading, compiling) goes to stderr.

``--prompts-file`` (JSON lines, ``-`` = stdin; :mod:`jspec.apps.prompts_file`) runs every
line as one request through the engine's continuous batching (``--max-running`` at once) and
prints one JSON line per request in input order (:mod:`jspec.apps.serving`). ``--chat`` wraps
each text prompt as one user message in the tokenizer's chat template. Compiles are kept in a
persistent cache (:mod:`jspec.apps.compile_cache`; ``--no-compilation-cache``).

Models come from ``jspec.models`` (a Hugging Face Llama-family directory, an EAGLE-3 or EAGLE-1
head directory); :func:`main` takes a ``loader`` hook so that any models following
``jspec.engine.protocol`` run through the same app.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from jspec.apps._cli import (
    add_sampling_args,
    add_spec_args,
    check_context,
    check_run_memory,
    check_spec_args,
    engine_config_from_args,
    run_cli,
    sampling_from_args,
    setup_devices,
)
from jspec.apps.compile_cache import add_cache_flag, use_compilation_cache
from jspec.apps.prompts_file import encode_prompt, encode_prompts, read_prompts_file
from jspec.apps.serving import (
    build_engine,
    generate_all,
    many_config,
    print_single,
    run_many,
)
from jspec.apps.stream import StreamPrinter
from jspec.engine.inputs import InputError, check_count, validate_requests
from jspec.engine.scheduler import DEFAULT_MAX_ROUNDS

# loader(model_dir, draft_dir | None, dtype | None, progress) -> (target, params, draft, dparams)
Loader = Callable[[str, "str | None", "str | None", Callable[[str], None]], tuple]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jspec generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="target model directory (HF Llama family)")
    p.add_argument("--draft", default=None, help="draft head directory (EAGLE-3 / EAGLE-1)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json in --model)")
    src.add_argument("--prompt-ids", help='prompt token ids, e.g. "1 2 3" or "1,2,3"')
    src.add_argument(
        "--prompts-file",
        metavar="FILE",
        help='JSON lines, one request each ({"prompt": ...} or {"prompt_ids": [...]}, '
        "optional max_new_tokens and sampling fields); - reads stdin; out: one JSON line each",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="tokens to generate (required with --prompt / --prompt-ids; with --prompts-file "
        "the default of lines without max_new_tokens)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="apply the tokenizer's chat template (a single user message, generation prompt)",
    )
    p.add_argument(
        "--max-running",
        type=int,
        default=8,
        help="requests of a prompts file running at once, per --devices shard "
        "(max_running_requests; the others wait their turn)",
    )
    p.add_argument(
        "--max-rounds",
        type=int,
        default=DEFAULT_MAX_ROUNDS,
        help="decode rounds per device dispatch (Engine's max_rounds, default "
        f"{DEFAULT_MAX_ROUNDS}): fewer stream one prompt's text in smaller bursts and pay the "
        "dispatch's host cost more often",
    )
    add_cache_flag(p)
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    g = p.add_argument_group("speculative decoding (as jspec demo)")
    g.add_argument(
        "--no-adaptive",
        action="store_true",
        help="speculate every round (default: decode plainly while the draft's acceptance does "
        "not pay for the spec step, jspec.engine.SpecPolicy)",
    )
    add_spec_args(g)
    g = p.add_argument_group("serving size")
    g.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=8192,
        help="prompt tokens per prefill call (sglang's flag; longer prompts take several)",
    )
    g.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help="size the KV pool from device memory: weights + pool take at most this fraction "
        "(sglang's flag, e.g. 0.9; GPU only); default: a pool for the request's whole context",
    )
    g.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="weights / activations / KV dtype (default: the checkpoint's)",
    )
    g.add_argument("--devices", type=int, default=1, help="data-parallel shards")
    g.add_argument("--tensor-parallel", type=int, default=1, help="devices per shard")
    g.add_argument("--checkify", action="store_true", help="all probes on")
    add_sampling_args(p)
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampling seed in [0, 2**64) (default: drawn at random, reported in the output)",
    )
    return p


def parse_prompt_ids(text: str) -> list[int]:
    """``"1 2 3"`` / ``"1,2,3"`` -> ``[1, 2, 3]`` (:class:`InputError` on anything else: only
    ASCII decimal integers, so ``"1_0"`` is not 10 and ``"١"`` is not 1)."""
    items = text.replace(",", " ").split()
    if not items:
        raise InputError("--prompt-ids is empty: give at least one token id")
    for item in items:
        if re.fullmatch(r"-?[0-9]+", item) is None:
            raise InputError(
                f"--prompt-ids={text!r}: {item!r} is not an integer (expected integers "
                "separated by spaces or commas)"
            )
    return [int(x) for x in items]


def hf_loader(
    model_dir: str, draft_dir: str | None, dtype: str | None, say: Callable[[str], None]
) -> tuple[Any, Any, Any, Any]:
    """Target (and draft) from Hugging Face directories through ``jspec.models``."""
    from jspec.models import load_draft, load_llama

    def bar(what: str) -> Callable[[int, int], None]:
        def progress(done: int, total: int) -> None:
            if done == total or done % max(total // 10, 1) == 0:
                say(f"loading {what}: {done}/{total} tensors")

        return progress

    try:
        target, params = load_llama(model_dir, dtype=dtype, progress=bar("target"))
        if draft_dir is None:
            return target, params, None, None
        draft, draft_params = load_draft(draft_dir, target, dtype=dtype, progress=bar("draft"))
    except (ValueError, OSError) as e:
        raise InputError(str(e)) from None
    return target, params, draft, draft_params


def hf_abstract(
    model_dir: str, draft_dir: str | None, dtype: str | None
) -> tuple[Any, Any, Any, Any]:
    """:func:`hf_loader`'s result with every array a ``jax.ShapeDtypeStruct`` (headers only)."""
    from jspec.models.checkpoint import abstract_draft, abstract_llama

    try:
        target, params = abstract_llama(model_dir, dtype=dtype)
        if draft_dir is None:
            return target, params, None, None
        draft, draft_params = abstract_draft(draft_dir, target, dtype=dtype)
    except (ValueError, OSError) as e:
        raise InputError(str(e)) from None
    return target, params, draft, draft_params


def hf_inspect(model_dir: str, draft_dir: str | None, dtype: str | None) -> tuple[Any, Any, int]:
    """``(target, draft | None, weight bytes)`` of the directories :func:`hf_loader` would load,
    from their configs and file headers only (every check before a weight is read)."""
    from jspec.models.checkpoint import inspect_draft, inspect_llama

    try:
        target, nbytes = inspect_llama(model_dir, dtype=dtype)
        if draft_dir is None:
            return target, None, nbytes
        draft, draft_bytes = inspect_draft(draft_dir, target, dtype=dtype)
    except (ValueError, OSError) as e:
        raise InputError(str(e)) from None
    return target, draft, nbytes + draft_bytes


def _load_tokenizer(model_dir: str) -> Any | None:
    """``jspec.models.Tokenizer`` of ``model_dir/tokenizer.json``, or None when the directory
    has none (a file it cannot read: ``InputError`` naming it)."""
    if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return None
    from jspec.models import Tokenizer

    try:
        return Tokenizer.from_dir(model_dir)
    except (ValueError, OSError) as e:
        raise InputError(str(e)) from None


def _eos_ids(model_dir: str, target: Any) -> list[int]:
    """EOS ids: the target config's, else ``generation_config.json`` / ``config.json``'s."""
    eos = getattr(getattr(target, "config", None), "eos_token_ids", None)
    if eos is None:
        from jspec.models import read_eos_token_ids

        try:
            eos = read_eos_token_ids(model_dir)
        except ValueError as e:
            raise InputError(str(e)) from None
    return [int(e) for e in eos or ()]


def main(argv: Sequence[str] | None = None, *, loader: Loader | None = None) -> int:
    """``jspec generate``; bad input: one line on stderr, exit status 2."""
    return run_cli(lambda a: _main(a, loader or hf_loader), "jspec generate", argv)


def _main(argv: Sequence[str] | None, loader: Loader) -> int:
    args = _parser().parse_args(list(argv) if argv is not None else None)
    check_spec_args(args)
    flags_sampling = sampling_from_args(args, args.seed)
    lines = None
    if args.prompts_file is not None:
        lines = read_prompts_file(
            args.prompts_file, base=flags_sampling, max_new_tokens=args.max_new_tokens
        )
    elif args.max_new_tokens is None:
        raise InputError("--max-new-tokens is required with --prompt / --prompt-ids")
    sampling = flags_sampling.resolved()
    prompt_ids = parse_prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
    if args.chat and prompt_ids is not None:
        raise InputError('--chat needs text: --prompt, or a prompts file\'s "prompt"')
    if args.prompt is not None:
        if not args.prompt:
            raise InputError("--prompt is empty")
        from jspec.models.tokenizer import check_text

        try:
            check_text(args.prompt, "--prompt")
        except ValueError as e:
            raise InputError(str(e)) from None
    setup_devices(args.devices, args.tensor_parallel)
    use_compilation_cache(args.no_compilation_cache)

    def say(msg: str) -> None:
        if not args.no_progress:
            print(f"jspec generate: {msg}", file=sys.stderr, flush=True)

    # Everything that can be checked without the weights is, before they load: the tokenizer
    # and the prompts, then (for checkpoint directories) configs, file headers, context, memory.
    if loader is hf_loader:
        for flag, path in (("--model", args.model), ("--draft", args.draft)):
            if path is not None and not os.path.isdir(path):
                raise InputError(f"{flag} {path}: no such directory (a checkpoint directory)")
    tokenizer = _load_tokenizer(args.model)
    if lines is not None:
        encode_prompts(lines, tokenizer, args.model, chat=args.chat)
    elif prompt_ids is None:
        if tokenizer is None:
            raise InputError(
                f"--prompt needs {os.path.join(args.model, 'tokenizer.json')}; or give --prompt-ids"
            )
        try:
            prompt_ids = encode_prompt(tokenizer, args.prompt, chat=args.chat)
        except InputError as e:
            raise InputError(f"--prompt={args.prompt!r}: {e}") from None
    if loader is hf_loader:
        target, draft, nbytes = hf_inspect(args.model, args.draft, args.dtype)
        if lines is not None:
            ecfg = many_config(args, target, draft, lines)
        else:
            # NOTE: the parser's required group gives --prompts-file, --prompt-ids or --prompt,
            # and --prompt's text was encoded above: one prompt always has its ids here.
            assert prompt_ids is not None
            ecfg, _ = run_config(args, target, draft, prompt_ids)
        check_run_memory(ecfg, target, draft, weight_bytes=nbytes, num_devices=args.devices)

    def load() -> tuple[Any, Any, Any, Any]:
        t0 = time.perf_counter()
        target, params, draft, draft_params = loader(args.model, args.draft, args.dtype, say)
        say(
            f"loaded {type(target).__name__}"
            + (f" + {type(draft).__name__}" if draft else "")
            + f" [{time.perf_counter() - t0:.1f} s]"
        )
        return target, params, draft, draft_params

    # jspec's loader: the engine compiles against the weights' shapes (from the file headers)
    # on a background thread while they load; another loader: load, then compile.
    deferred = None
    if loader is hf_loader:
        target, params, draft, draft_params = hf_abstract(args.model, args.draft, args.dtype)
        deferred = lambda: load()[1::2]  # noqa: E731 (params, draft params)
    else:
        target, params, draft, draft_params = load()
    from jspec.probes import ProbeError

    eos = [] if args.ignore_eos else _eos_ids(args.model, target)
    try:
        if lines is not None:
            ecfg = many_config(args, target, draft, lines)
            models = (target, params, draft, draft_params)
            return run_many(
                args, ecfg, models, lines, say, eos=eos, tokenizer=tokenizer, load=deferred
            )
        assert prompt_ids is not None  # as above: one prompt always has its ids here
        stream = StreamPrinter(tokenizer)
        try:
            out, stats = generate_ids(
                args,
                target,
                params,
                draft,
                draft_params,
                prompt_ids,
                say,
                eos=eos,
                sampling=sampling,
                on_tokens=lambda _, new_ids: stream.push(new_ids),
                load=deferred,
            )
        finally:
            stream.finish()
    except ProbeError as e:
        print(f"jspec generate: a probe fired: {e}", file=sys.stderr)
        return 1
    print_single(args, out, stats, tokenizer, sampling, prompt_ids, eos)
    return 0


def run_config(
    args: argparse.Namespace, target: Any, draft: Any, prompt_ids: Sequence[int]
) -> tuple[Any, int]:
    """``(EngineConfig, context_len)`` of one prompt: the flags and the prompt checked against
    the models and the model's ``max_position_embeddings`` (``InputError`` naming the field)."""
    max_new = check_count("--max-new-tokens", args.max_new_tokens)
    context_len = check_context(target, len(prompt_ids), max_new)
    ecfg = engine_config_from_args(
        args,
        target,
        draft,
        context_len=context_len,
        max_running_requests=1,
        max_prompt_len=len(prompt_ids),
        shortest_prompt=len(prompt_ids),
    )
    validate_requests(
        [list(prompt_ids)],
        max_new,
        vocab_size=target.vocab_size,
        max_prompt_len=ecfg.max_prompt_len,
        context_len=context_len,
    )
    return ecfg, context_len


def generate_ids(
    args: argparse.Namespace,
    target: Any,
    params: Any,
    draft: Any,
    draft_params: Any,
    prompt_ids: Sequence[int],
    say: Callable[[str], None],
    *,
    eos: Sequence[int] = (),
    sampling: Any = None,
    on_tokens: Callable[[int, list[int]], None] | None = None,
    load: Callable[[], tuple[Any, Any]] | None = None,
) -> tuple[list[int], Any]:
    """Validate, build the engine, compile (with progress) and generate for one prompt
    (``sampling``: its resolved ``jspec.engine.SamplingParams``, None = greedy; ``on_tokens``:
    ``Engine.generate``'s, request 0's tokens as they come; ``load``: ``build_engine``'s, the
    params then being shapes)."""
    ecfg, _ = run_config(args, target, draft, prompt_ids)
    models = (target, params, draft, draft_params)
    engine = build_engine(args, ecfg, models, [sampling], say, eos=eos, load=load)
    max_new = [args.max_new_tokens]
    outs, stats = generate_all(args, engine, [prompt_ids], max_new, [sampling], say, on_tokens)
    return outs[0], stats
