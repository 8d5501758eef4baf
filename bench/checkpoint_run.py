"""Real-size checkpoint run (issue 13): random weights written as safetensors, then decoded by
``jspec generate`` from those directories, greedy and spec.

    python -m bench.checkpoint_run [--geometry 8b|1b|quick] [--dir /tmp] [--keep]
                                   [--max-new-tokens 64] [--prompt-len 128]
                                   [--out checkpoint_run.md]

1. A writer subprocess builds :mod:`bench.real_size`'s geometry (``make_target``,
   ``make_params``: random bf16 LlamaTarget + its matched EAGLE-3 head, made on the device) and
   writes them as Hugging Face directories with ``jspec.models.export.save_llama`` (shards of
   at most 5 GB + index, transformers' default) and ``save_eagle3``, into a fresh directory
   under ``--dir`` (removed at the end unless ``--keep``). It is a process of its own so that
   everything it held (device pool, host copies) is gone before step 2: a JAX process keeps its
   GPU memory pool (75% of the device by default) after ``del`` + ``gc``.
2. ``jspec generate`` runs twice as a subprocess (``python -m jspec.cli generate``) with
   ``--prompt-ids`` (``--prompt-len`` ids from the draft's hot ids ``[0, draft_vocab)``,
   ``np.random.default_rng(1)``: real_size's bs=1 prompt), ``--max-new-tokens N --json
   --ignore-eos``: greedy (no ``--draft``) and spec (``--draft``, page 16, topk 4, steps 3,
   8 draft tokens, real_size's and the CLI's defaults).

Measured per run: ``bytes on disk`` / ``write s`` of the directories the run loads (target;
spec: target + head; the write times the ``save_*`` calls: device-to-host copies, transposes,
file writes), ``load s`` and ``compile s`` (cold: ``--no-compilation-cache``) from
``jspec generate``'s progress lines,
``process wall s`` (the whole subprocess: imports, load, compile, decode), ``tok/s`` and
``accept len`` from its JSON line, and whether spec's tokens equal greedy's (else how many
leading tokens agree). Exit status 1 when a subprocess fails (its stderr tail is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.real_size import DRAFT_TOKENS, GEOMETRIES, NEW, PAGE, PROMPT, STEPS, TOPK

COLUMNS = (
    "geometry",
    "mode",
    "bytes on disk",
    "write s",
    "load s",
    "compile s",
    "process wall s",
    "tok/s",
    "accept len",
    "tokens",
    "spec == greedy",
    "error",
)
SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")
TIMEOUT_S = 600  # per subprocess
REPO = Path(__file__).resolve().parents[1]
# The writer subprocess: argv = geometry, directory; one JSON line out.
WRITER = (
    "import json, sys; from pathlib import Path; "
    "from bench.checkpoint_run import write_checkpoints; "
    "print(json.dumps(write_checkpoints(sys.argv[1], Path(sys.argv[2]))))"
)


def write_checkpoints(geometry: str, root: Path) -> dict:
    """The writer subprocess's work: make the geometry's params, write ``root/target`` and
    ``root/draft``; returns bytes on disk and seconds per directory, and the device."""
    from bench._timing import device_name
    from bench.real_size import make_params, make_target
    from jspec.models.export import save_eagle3, save_llama

    g = GEOMETRIES[geometry]
    target = make_target(g)
    t0 = time.perf_counter()
    params, draft, dparams = make_params(g, target)
    out: dict = {"device": device_name(), "make_s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    save_llama(root / "target", target, params, max_shard_bytes=SHARD_BYTES)
    out["target"] = {"bytes": _dir_bytes(root / "target"), "write_s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    save_eagle3(root / "draft", draft, dparams, num_target_layers=g.layers)
    out["draft"] = {"bytes": _dir_bytes(root / "draft"), "write_s": time.perf_counter() - t0}
    return out


def _dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def _child(label: str, argv: list[str]) -> tuple[subprocess.CompletedProcess | None, float, str]:
    """Run ``python argv`` (repo root on the path): (the process, None on timeout; wall s;
    error: "" when it exited 0, else the exit status and its stderr tail, also printed)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, *argv],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": path},
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        error = f"{label} timed out after {TIMEOUT_S} s"
        print(error, file=sys.stderr, flush=True)
        return None, time.perf_counter() - t0, error
    wall = time.perf_counter() - t0
    if proc.returncode == 0:
        return proc, wall, ""
    tail = proc.stderr.strip().splitlines()[-20:]
    print(f"{label} exited {proc.returncode}; stderr tail:", file=sys.stderr)
    print("\n".join(tail), file=sys.stderr, flush=True)
    return proc, wall, f"exit {proc.returncode}: {(tail or [''])[-1][:120]}"


def _progress_s(stderr: str, pattern: str) -> float | str:
    """Seconds from a ``jspec generate`` progress line (``loaded ... [12.3 s]``), or ""."""
    match = re.search(pattern + r"[^\[\n]*\[([0-9.]+) s\]", stderr)
    return float(match.group(1)) if match else ""


def run_generate(model: Path, draft: Path | None, prompt: list[int], max_new: int) -> dict:
    """One ``jspec generate`` subprocess; its row (timings, JSON fields, ``token_ids``)."""
    argv = ["-m", "jspec.cli", "generate", "--model", str(model)]
    if draft is not None:
        argv += ["--draft", str(draft), "--page-size", str(PAGE), "--topk", str(TOPK)]
        argv += ["--steps", str(STEPS), "--draft-tokens", str(DRAFT_TOKENS)]
    argv += ["--prompt-ids", " ".join(map(str, prompt)), "--max-new-tokens", str(max_new)]
    argv += ["--no-compilation-cache"]  # compile s: a cold compile, whatever ran before
    label = "jspec generate" + (" --draft" if draft is not None else "")
    proc, wall, error = _child(label, [*argv, "--json", "--ignore-eos"])
    row: dict = {"process wall s": wall, "error": error}
    if proc is None or error:
        return row
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    row.update(
        {
            "load s": _progress_s(proc.stderr, "loaded"),
            "compile s": _progress_s(proc.stderr, "compiled"),
            "tok/s": result["tokens_per_s"],
            "accept len": result["mean_accept_len"],
            "tokens": len(result["token_ids"]),
            "token_ids": result["token_ids"],
        }
    )
    return row


def same_as(spec: list[int], greedy: list[int]) -> str:
    """``"yes"``, or ``"no (k/n leading agree)"``."""
    if spec == greedy:
        return "yes"
    diff = (i for i, (a, b) in enumerate(zip(spec, greedy)) if a != b)
    lead = next(diff, min(len(spec), len(greedy)))
    return f"no ({lead}/{len(greedy)} leading agree)"


def main(argv: list[str] | None = None) -> list[dict]:
    """The two rows (greedy, spec); [] when writing the checkpoints failed."""
    from bench._timing import format_table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="8b")
    parser.add_argument("--dir", default=None, help="parent of the checkpoint directory")
    parser.add_argument("--keep", action="store_true", help="keep the written directories")
    parser.add_argument("--max-new-tokens", type=int, default=NEW)
    parser.add_argument("--prompt-len", type=int, default=PROMPT)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    g = GEOMETRIES[args.geometry]
    if args.dir is not None:
        os.makedirs(args.dir, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f"jspec_ckpt_{g.name}_", dir=args.dir))
    rows: list[dict] = []
    try:
        proc, _, error = _child("checkpoint writer", ["-c", WRITER, g.name, str(root)])
        if error:
            return rows
        written = json.loads(proc.stdout.strip().splitlines()[-1])
        t, d = written["target"], written["draft"]
        print(
            f"{g.name}: made in {written['make_s']:.1f} s; target {t['bytes'] / 1e9:.2f} GB "
            f"written in {t['write_s']:.1f} s, draft {d['bytes'] / 1e9:.2f} GB in "
            f"{d['write_s']:.1f} s ({root})",
            flush=True,
        )
        prompt = np.random.default_rng(1).integers(0, g.draft_vocab, args.prompt_len).tolist()
        for mode, draft in (("greedy", None), ("spec", root / "draft")):
            on_disk = (t,) if draft is None else (t, d)
            row = {
                "geometry": g.name,
                "mode": mode,
                "bytes on disk": sum(x["bytes"] for x in on_disk),
                "write s": sum(x["write_s"] for x in on_disk),
            }
            row.update(run_generate(root / "target", draft, prompt, args.max_new_tokens))
            rows.append(row)
            print(format_table([row], COLUMNS), flush=True)
        greedy, spec = rows
        if "token_ids" in greedy and "token_ids" in spec:
            spec["spec == greedy"] = same_as(spec["token_ids"], greedy["token_ids"])
    finally:
        if args.keep:
            print(f"kept {root}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
    header = (
        f"checkpoint_run on {written['device']}, {time.strftime('%Y-%m-%d %H:%M')}: "
        f"{g.name} random bf16 weights as safetensors (target shards <= {SHARD_BYTES / 1e9:g} "
        f"GB), jspec generate from those directories: prompt of {args.prompt_len} hot ids, "
        f"{args.max_new_tokens} new tokens, --ignore-eos; spec: page {PAGE}, topk {TOPK}, "
        f"steps {STEPS}, {DRAFT_TOKENS} draft tokens"
    )
    text = f"{header}\n\n{format_table(rows, COLUMNS)}\n"
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text)
    return rows


if __name__ == "__main__":
    rows = main(sys.argv[1:])
    sys.exit(0 if rows and not any(r["error"] for r in rows) else 1)
