"""Host-side helpers shared by the ``jspec`` commands (``demo``, ``generate``): device count
on CPU, the spec flags' checks, the sampling flags, and the one-line error exit."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any


def force_host_devices(num: int) -> None:
    """On CPU, ask for ``num`` host devices if JAX has not started its backends yet.

    ``jax.config.update("jax_num_cpu_devices", n)`` (public) raises once the backends are up;
    then the devices stay as they are and :func:`jspec.engine.sharding.check_devices` reports
    the shortfall in one line. Nothing happens when ``XLA_FLAGS`` already sets a count.
    """
    if num <= 1 or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", num)
    except RuntimeError:  # backends already initialized: keep the devices there are
        pass


def check_spec_args(args: argparse.Namespace) -> None:
    """Host checks of the spec / run flags shared by ``jspec demo`` and ``jspec generate``
    (``InputError`` naming the flag, before anything is built or compiled)."""
    from jspec.engine.inputs import check_count

    for flag in (
        "page_size",
        "topk",
        "steps",
        "draft_tokens",
        "devices",
        "tensor_parallel",
        "max_new_tokens",
        "max_running",
    ):
        if hasattr(args, flag):
            check_count("--" + flag.replace("_", "-"), getattr(args, flag))


def run_cli(main_fn, prog: str, argv: Sequence[str] | None) -> int:
    """Run a CLI ``main``: bad input (``InputError``, a config ``ValueError`` raised before
    the first compile) becomes one line ``prog: error: ...`` on stderr and exit status 2."""
    from jspec.engine.inputs import InputError

    try:
        return main_fn(argv)
    except InputError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def engine_config_from_args(
    args: argparse.Namespace,
    target: Any,
    draft: Any,
    *,
    context_len: int,
    max_running_requests: int,
    max_prompt_len: int,
) -> Any:
    """The ``EngineConfig`` that the spec flags ask for, checked against the models and the
    devices; a bad value raises ``InputError`` naming it (before any compile)."""
    from jspec.engine.inputs import InputError
    from jspec.engine.sharding import check_devices
    from jspec.engine.state import check_engine_models, make_engine_config

    try:
        ecfg = make_engine_config(
            target,
            page_size=args.page_size,
            topk=args.topk,
            num_steps=args.steps,
            num_draft_tokens=args.draft_tokens,
            context_len=context_len,
            max_running_requests=max_running_requests,
            max_prompt_len=max_prompt_len,
            draft_attention=args.draft_attention,
            tensor_parallel=args.tensor_parallel,
            impl=args.impl,
            attention_impl=args.attention_impl,
        )
        check_engine_models(ecfg, target, draft)
        check_devices(args.devices, args.tensor_parallel)
    except ValueError as e:
        raise InputError(str(e)) from None
    return ecfg


def add_sampling_args(parser: argparse.ArgumentParser, *, temperature: float = 0.0) -> None:
    """``--temperature --top-k --top-p --min-p --seed`` (``jspec.engine.SamplingParams``)."""
    g = parser.add_argument_group(
        "sampling (exact: the tokens follow the processed target distribution, any draft)"
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=temperature,
        help=f"0 = greedy (default {temperature:g})",
    )
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (1 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="keep p >= min_p * max p (0 = off)")


def sampling_from_args(args: argparse.Namespace, seed: int | None) -> Any:
    """The flags' ``SamplingParams`` (``InputError`` naming the bad field, before any build or
    compile). A prompts file's line may override any field: ``SamplingParams.from_dict(line,
    base=sampling_from_args(args, seed))``."""
    from jspec.engine.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=seed,
    )


def describe_sampling(sampling: Any) -> str:
    """``"T 0.8, top-p 0.9, seed 7"``: a sampled run's parameters that are on."""
    parts = [f"T {sampling.temperature:g}"]
    if sampling.top_k:
        parts.append(f"top-k {sampling.top_k}")
    if sampling.top_p < 1:
        parts.append(f"top-p {sampling.top_p:g}")
    if sampling.min_p:
        parts.append(f"min-p {sampling.min_p:g}")
    return ", ".join(parts + [f"seed {sampling.seed}"])
