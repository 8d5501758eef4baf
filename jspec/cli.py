"""``jspec`` command line: a thin dispatcher over library entry points (no logic here).

    jspec demo [...]      end-to-end jitted spec decode on a small model (jspec.engine.demo)
    jspec generate [...]  greedy / EAGLE spec decode from checkpoint dirs (jspec.apps.generate)
    jspec compare [...]   jspec vs PyTorch reference side by side (interop.compare)
    jspec bench [...]     all benchmarks in one run (bench.run_all)
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: jspec {demo,generate,compare,bench} [options]   (jspec CMD --help for options)"
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() if argv else usage)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from jspec.engine.demo import main as run
    elif cmd == "generate":
        from jspec.apps.generate import main as run
    elif cmd == "compare":
        from interop.compare import main as run
    elif cmd == "bench":
        from bench.run_all import main as run
    else:
        print(f"jspec: unknown command {cmd!r}\n{usage}", file=sys.stderr)
        return 2
    return int(run(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
