"""Host-side helpers shared by the ``jspec`` commands (``demo``, ``generate``): the spec and
resource flags' checks (with their documented bounds), the sampling flags, the device setup, the
context and memory checks, and the one-line error exit. Everything here runs before a weight is
read or anything compiles."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Any

# --page-size bound: twice the largest page sglang's attention backends use (cutlass MLA, 128);
# a larger page only inflates the pool (each request holds at least one page per decode reserve).
MAX_PAGE_SIZE = 256
# --devices x --tensor-parallel bound for CPU host devices (jax_num_cpu_devices): thousands of
# host devices make XLA's compile crawl and abort; on GPU the devices present are the bound.
MAX_HOST_DEVICES = 64
# One flag per kernel family of the engine's policy (jspec.kernels.policy.CHOICES, each also
# "auto"): flag -> (make_engine_config keyword, family, help). The README names the same
# choices; tests/apps/test_cli_input.py holds them equal.
KERNEL_FLAGS = {
    "--kernel-impl": (
        "impl",
        "bookkeeping",
        "tree / attention-metadata / KV bookkeeping kernels: auto = Pallas on GPU, jnp elsewhere",
    ),
    "--attention-impl": (
        "attention_impl",
        "attention",
        "paged attention of the model (page tables in): auto = cudnn on GPU for bf16 / f16 "
        "models (triton for f32, or where this jax lacks the cuDNN call), the pure-jnp "
        "reference elsewhere; triton = the Triton kernels; cudnn = Triton, long prefill chunks "
        "through cuDNN (bf16 / f16)",
    ),
    "--gemm-impl": (
        "gemm_impl",
        "gemm",
        "the model's matmuls on GPU: auto = cuBLAS for calls of >= 64 tokens, XLA's Triton "
        "GEMMs below",
    ),
    "--rms-norm-impl": (
        "rms_norm_impl",
        "rms_norm",
        "the models' RMSNorm: auto = XLA's fusion; triton = one Triton launch (GPU, bf16 / f16)",
    ),
    "--topk-probs-impl": (
        "topk_probs_impl",
        "topk_probs",
        "the draft's top-k: auto = the bookkeeping impl (Triton on GPU for vocabularies wider "
        "than one Pallas tile)",
    ),
}
EXIT_INTERRUPTED = 130  # 128 + SIGINT: the shell's status of a Ctrl-C


def force_host_devices(num: int) -> None:
    """On CPU, ask for ``num`` host devices if JAX has not started its backends yet.

    ``jax.config.update("jax_num_cpu_devices", n)`` (public) raises once the backends are up;
    then the devices stay as they are and :func:`jspec.engine.sharding.check_devices` reports
    the shortfall in one line. Nothing happens when ``XLA_FLAGS`` already sets a count, or past
    :data:`MAX_HOST_DEVICES` (:func:`setup_devices` refuses that on CPU).
    """
    if num <= 1 or num > MAX_HOST_DEVICES:
        return
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", num)
    except RuntimeError:  # backends already initialized: keep the devices there are
        pass


def setup_devices(devices: int, tensor_parallel: int) -> None:
    """Devices for ``--devices`` x ``--tensor-parallel`` (:func:`force_host_devices`), refused
    past :data:`MAX_HOST_DEVICES` on CPU (``InputError``). Whether the devices exist is checked
    with the engine config (:func:`engine_config_from_args`, before any weight loads for
    checkpoint directories), after the config's own checks."""
    from jspec.engine.inputs import InputError

    need = devices * tensor_parallel
    force_host_devices(need)
    import jax

    if need > MAX_HOST_DEVICES and jax.default_backend() == "cpu":
        raise InputError(
            f"--devices {devices} x --tensor-parallel {tensor_parallel} = {need} CPU host "
            f"devices: at most {MAX_HOST_DEVICES}"
        )


def kernel_choices(flag: str) -> tuple[str, ...]:
    """The values ``flag`` (a :data:`KERNEL_FLAGS` key) accepts: ``"auto"`` and its family's."""
    from jspec.engine import KERNEL_CHOICES

    return ("auto",) + KERNEL_CHOICES[KERNEL_FLAGS[flag][1]]


def add_kernel_args(group: Any) -> None:
    """The :data:`KERNEL_FLAGS` (each ``auto`` by default; checked by :func:`check_spec_args`
    so a bad name is one line naming the flag, not argparse's usage block)."""
    for flag, (dest, _family, text) in KERNEL_FLAGS.items():
        group.add_argument(
            flag, dest=dest, default="auto", metavar="|".join(kernel_choices(flag)), help=text
        )


def add_spec_args(group: Any) -> None:
    """The spec flags of ``jspec demo`` and ``jspec generate`` (read by
    :func:`engine_config_from_args`, checked by :func:`check_spec_args`), then the kernel flags."""
    group.add_argument("--page-size", type=int, default=16)
    group.add_argument("--topk", type=int, default=4)
    group.add_argument("--steps", type=int, default=3, help="speculative_num_steps")
    group.add_argument("--draft-tokens", type=int, default=8, help="speculative_num_draft_tokens")
    group.add_argument("--draft-attention", choices=("cascade", "kv_indices"), default="cascade")
    add_kernel_args(group)


def kernel_impls(args: argparse.Namespace) -> dict[str, Any]:
    """The kernel flags as ``make_engine_config`` keywords (``Any``: passed whole beside its
    other, differently typed keywords)."""
    return {dest: getattr(args, dest) for dest, _family, _text in KERNEL_FLAGS.values()}


def check_spec_args(args: argparse.Namespace) -> None:
    """Host checks of the spec / run flags shared by ``jspec demo`` and ``jspec generate``
    (``InputError`` naming the flag, before anything is built or compiled): counts >= 1,
    ``--steps <= MAX_NUM_STEPS`` (the draft loop is unrolled: compile time grows with it),
    ``--page-size <= MAX_PAGE_SIZE``, ``--draft-tokens <= MAX_NUM_DRAFT_TOKENS``, and every
    kernel flag one of its family's names."""
    from jspec.config import MAX_NUM_DRAFT_TOKENS, MAX_NUM_STEPS
    from jspec.engine.inputs import InputError, check_count

    for flag, (dest, _family, _text) in KERNEL_FLAGS.items():
        if getattr(args, dest) not in kernel_choices(flag):
            raise InputError(
                f"{flag}={getattr(args, dest)!r} must be one of {'|'.join(kernel_choices(flag))}"
            )

    for flag in (
        "page_size",
        "topk",
        "steps",
        "draft_tokens",
        "devices",
        "tensor_parallel",
        "max_new_tokens",
        "max_running",
        "max_rounds",
    ):
        if getattr(args, flag, None) is not None:  # None: not given (a flag not required)
            check_count("--" + flag.replace("_", "-"), getattr(args, flag))
    for flag, bound, why in (
        ("steps", MAX_NUM_STEPS, "the draft loop is unrolled: compile time grows with it"),
        ("page_size", MAX_PAGE_SIZE, "twice the largest page sglang's attention backends use, 128"),
        ("draft_tokens", MAX_NUM_DRAFT_TOKENS, "sglang's tree kernels' limit"),
    ):
        if getattr(args, flag) > bound:
            name = "--" + flag.replace("_", "-")
            raise InputError(f"{name}={getattr(args, flag)} must be <= {bound} ({why})")


def check_context(target: Any, prompt_len: int, max_new_tokens: int) -> int:
    """The engine's context length (a power of two holding the prompt, the new tokens and one
    more); ``InputError`` when the request runs past the model's ``max_position_embeddings``
    (read from ``target.config`` when it has one)."""
    from jspec.engine.inputs import InputError

    limit = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    if limit is not None and prompt_len + max_new_tokens > limit:
        raise InputError(
            f"len(prompt) + --max-new-tokens = {prompt_len} + {max_new_tokens} "
            f"exceeds the model's max_position_embeddings={limit}"
        )
    return 1 << (prompt_len + max_new_tokens).bit_length()


def check_run_memory(
    ecfg: Any, target: Any, draft: Any, *, weight_bytes: int, num_devices: int
) -> None:
    """``InputError`` with the numbers when the run cannot fit the device (or host) memory
    (:mod:`jspec.apps.memory`); ``weight_bytes``: 0 once the weights are resident."""
    from jspec.apps.memory import check_memory, estimate_memory

    estimate = estimate_memory(ecfg, target, draft, weight_bytes=weight_bytes)
    check_memory(estimate, num_devices=num_devices * ecfg.tensor_parallel)


def run_cli(main_fn, prog: str, argv: Sequence[str] | None) -> int:
    """Run a CLI ``main``: bad input (``InputError``, a config ``ValueError`` raised before
    the first compile) becomes one line ``prog: error: ...`` on stderr and exit status 2; a
    Ctrl-C that ``main`` leaves unhandled, ``prog: interrupted`` and exit status 130."""
    from jspec.engine.inputs import InputError

    try:
        return main_fn(argv)
    except InputError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        print(f"{prog}: error: {'; '.join(lines)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def engine_config_from_args(
    args: argparse.Namespace,
    target: Any,
    draft: Any,
    *,
    context_len: int,
    max_running_requests: int,
    max_prompt_len: int,
    shortest_prompt: int = 0,
) -> Any:
    """The ``EngineConfig`` that the spec flags ask for, checked against the models and the
    devices; a bad value raises ``InputError`` naming it (before any compile). Decode launch
    hints (``kv_len_buckets``) shorter than ``shortest_prompt`` are dropped: no dispatch of
    these prompts could use them, and warm-up would compile each."""
    from jspec.engine.inputs import InputError
    from jspec.engine.runner import check_engine_models
    from jspec.engine.sharding import check_devices
    from jspec.engine.state import make_engine_config

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
            **kernel_impls(args),
            chunked_prefill_size=getattr(args, "chunked_prefill_size", 8192),
            mem_fraction_static=getattr(args, "mem_fraction_static", None),
            draft=draft,
        )
        hints = tuple(b for b in ecfg.kv_len_buckets if b > shortest_prompt)
        ecfg = dataclasses.replace(ecfg, kv_len_buckets=hints)
        check_engine_models(ecfg, target, draft)
        check_devices(args.devices, args.tensor_parallel)
        ecfg.check_backend()  # a kernel flag naming a GPU-only kernel off the GPU
        if draft is not None and args.topk > draft.vocab_size:
            raise ValueError(
                f"--topk={args.topk} must be <= the draft's vocab_size={draft.vocab_size}"
            )
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
