"""``jspec`` command line: a thin dispatcher over library entry points (no logic here).

    jspec demo [...]      end-to-end jitted spec decode on a small model (jspec.apps.demo)
    jspec generate [...]  greedy / EAGLE spec decode from checkpoint dirs (jspec.apps.generate)
    jspec compare [...]   jspec vs PyTorch reference side by side (interop.compare; needs torch)

Every command lives in an installed package (``jspec`` or ``interop``): the benchmarks are not
packaged and run from a checkout (``python -m bench.run_all``, ``make bench-gpu``).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import warnings
from collections.abc import Iterator

# command -> (module, function taking argv and returning an exit code). Only modules of the
# installed distribution (pyproject's packages.find: jspec*, interop*); tests/test_cli.py runs
# every entry's --help from a clean directory to hold that.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("jspec.apps.demo", "main"),
    "generate": ("jspec.apps.generate", "main"),
    "compare": ("interop.compare", "main"),
}

PALLAS_TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"


@contextlib.contextmanager
def quiet_pallas_triton() -> Iterator[None]:
    """Silence jax 0.11's Pallas-Triton ``DeprecationWarning`` inside this block only.

    NOTE (shared/PLATFORM.md fact 2): jax >= 0.11 warns from the pallas_call GPU *lowering*
    rule, i.e. when the ``jit`` that encloses a kernel compiles, not when ``pallas_call`` is
    traced. jspec's kernel ops are jitted, so a filter around their ``pallas_call`` lines would
    never see it; this scope goes around what compiles them in the processes jspec owns (the
    ``jspec`` CLI). Importing jspec changes no warning filter; under pytest the filter in
    pyproject.toml applies. Python's default filters already hide a DeprecationWarning raised
    inside jax (it is shown only under ``-W`` or pytest). 0.10 (CPU) does not warn.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=PALLAS_TRITON_DEPRECATION, category=DeprecationWarning
        )
        yield


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = f"usage: jspec {{{','.join(COMMANDS)}}} [options]   (jspec CMD --help for options)"
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() if argv else usage)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"jspec: unknown command {cmd!r}\n{usage}", file=sys.stderr)
        return 2
    module, func = COMMANDS[cmd]
    run = getattr(importlib.import_module(module), func)
    with quiet_pallas_triton():  # jspec's own kernels compile in here (jax 0.11 GPU warning)
        return int(run(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
