"""Run every benchmark in one process and print (and optionally save) one markdown report.

    python -m bench.run_all [--quick] [--only move_kv_cache,build_tree] [--out report.md]

Each bench prints its own tables as it runs; the report is that output, captured as it is
printed (run_all renders nothing a second time: it used to re-print every bench's rows).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import io
import subprocess
import sys
import time
import traceback

from bench._timing import copy_bandwidth_tbs, device_name

BENCHES = (
    "move_kv_cache",
    "alloc",
    "draft_layout",
    "build_tree",
    "verify_tree_greedy",
    "attention_meta",
    "topk_probs",
    "paged_attention",
    "e2e",
    "real_size",
)


def _commit() -> str:
    import os

    if os.environ.get("JSPEC_COMMIT"):  # the device copy has no .git: the caller passes it
        return os.environ["JSPEC_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001 - not a git checkout (device copy)
        return "unknown"


class _Tee(io.TextIOBase):
    """Writes to every stream: the console (live progress) and the report buffer."""

    def __init__(self, *streams: io.TextIOBase) -> None:
        self._streams = streams

    def write(self, text: str) -> int:
        for stream in self._streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self._streams:
            stream.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--only", default="", help="comma-separated bench names")
    parser.add_argument("--out", default="", help="also write the report here")
    args = parser.parse_args(argv)
    names = [n for n in (args.only.split(",") if args.only else BENCHES) if n]
    header = (
        f"# jspec bench {datetime.date.today()} on {device_name()}, commit {_commit()}\n\n"
        f"measured copy bandwidth: {copy_bandwidth_tbs():.2f} TB/s (read + write)\n"
    )
    print(header, flush=True)
    parts = [header]
    failed = 0
    for name in names:
        t0 = time.perf_counter()
        print(f"## {name}\n", flush=True)
        captured = io.StringIO()
        try:
            with contextlib.redirect_stdout(_Tee(sys.stdout, captured)):
                importlib.import_module(f"bench.{name}").main(["--quick"] if args.quick else [])
        except Exception:  # noqa: BLE001 - one broken bench must not hide the others
            failed += 1
            failure = f"\nFAILED:\n```\n{traceback.format_exc()}```\n"
            print(failure, flush=True)
            captured.write(failure)
        tail = f"\n({time.perf_counter() - t0:.1f} s)\n"
        print(tail, flush=True)
        parts.append(f"## {name}\n\n{captured.getvalue().rstrip()}\n{tail}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(parts))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
