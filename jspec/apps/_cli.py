"""Host-side helpers shared by the ``jspec`` commands (``demo``, ``generate``): device count
on CPU, the spec flags' checks, and the one-line error exit."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


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
