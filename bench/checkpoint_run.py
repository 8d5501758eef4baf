# Over 400 lines: one report of four parts (the in-process bench, cold, warm, a prompts file)
# for issues 13 and 25, sharing the checkpoints, the subprocess runner and the tables.
"""Real-size checkpoint run (issues 13, 25): random weights written as safetensors, then decoded
by ``jspec generate`` from those directories: cold, with a warm compilation cache, and a
prompts file through continuous batching.

    python -m bench.checkpoint_run [--geometry 8b|1b|quick] [--dir /tmp] [--keep]
                                   [--parts bench,cold,warm,prompts] [--modes greedy,spec]
                                   [--max-new-tokens 64] [--prompt-len 128]
                                   [--num-prompts 256] [--max-running 64]
                                   [--prompts-modes spec] [--out checkpoint_run.md]

1. A writer subprocess builds :mod:`bench.real_size`'s geometry (``make_target``,
   ``make_params``: random bf16 LlamaTarget + its matched EAGLE-3 head, made on the device) and
   writes them as Hugging Face directories with ``jspec.models.export.save_llama`` (shards of
   at most 5 GB + index, transformers' default) and ``save_eagle3``, into a fresh directory
   under ``--dir`` (removed at the end unless ``--keep``). Part ``bench``: the same process
   then runs the engine on those in-memory params (no loader, no CLI process): for each of
   ``--modes``, the EngineConfig and Engine that ``jspec generate`` builds for the same flags
   and prompt (``jspec.apps.generate.run_config``, ``jspec.apps.serving.build_engine``:
   ``Engine.warmup``, adaptive speculation on, as in the CLI); run ``bench 1st`` is its first
   ``generate`` (what the CLI times: its only one), run ``bench`` real_size's method (a
   2-token ``generate``, then the timed one). The writer is a process of its own so that
   everything it held (device pool, host copies, the bench engines) is gone before step 2: a
   JAX process keeps its GPU memory pool (75% of the device by default) after ``del`` +
   ``gc``.
2. ``jspec generate`` subprocesses (``python -m jspec.cli generate``), each of ``--modes``:
   greedy (no ``--draft``) and spec (``--draft``, page 16, topk 4, steps 3, 8 draft tokens,
   real_size's and the CLI's defaults), ``--prompt-ids`` (``--prompt-len`` ids from the
   draft's hot ids ``[0, draft_vocab)``, ``np.random.default_rng(1)``: real_size's bs=1
   prompt), ``--max-new-tokens N --json --ignore-eos``.

   * part ``cold``, run ``cold``: ``--no-compilation-cache`` and an empty Triton cache (a cold
     compile whatever ran before).
   * part ``warm``: two runs with the compilation cache on in a fresh directory of this
     mode (``JSPEC_COMPILATION_CACHE=DIR``; the CLI has no directory flag) and a fresh Triton
     cache of this mode: run ``fill`` (empty caches: compiles and stores) then run ``warm``
     (the second invocation: issue 25's "starts generating in < 10 s").

   Every subprocess gets its Triton cache (``TRITON_CACHE_DIR``) under the checkpoint
   directory (:func:`cache_env`): the jax-triton kernels compile while the steps lower, before
   the XLA cache is consulted, and the machine's ``~/.triton/cache`` would make a cold run
   warm.
3. Part ``prompts``, each of ``--prompts-modes``: a JSON-lines file of ``--num-prompts``
   requests given as ``prompt_ids`` (hot ids, ``np.random.default_rng(2)``): request 0 has
   ``--prompt-len`` ids, the others a length uniform in ``[prompt_len // 8, prompt_len]``; about
   a quarter carry their own ``max_new_tokens`` (uniform in ``[max_new // 4, max_new]``), the
   rest take ``--max-new-tokens``. ``jspec generate --prompts-file F --max-running M --json
   --ignore-eos`` runs it (run ``batched``, ``M = --max-running``), then the same file with
   ``--max-running 1`` (run ``alone``: each request by itself, the reference), and every
   request's ids are compared. Both use the mode's cache directory of part ``warm``: the
   ``alone`` engine is the single-prompt run's (request 0 sets the same context and prompt
   bucket), so after part ``warm`` it compiles nothing.

Columns of the single-prompt runs (and of run ``bench``, where they apply):

* ``bytes on disk`` / ``write s``: the directories the run loads (target; spec: target + head;
  the write times the ``save_*`` calls: device-to-host copies, transposes, file writes).
* ``load s`` / ``compile s``: from ``jspec generate``'s progress lines on stderr (``loaded ...
  [x s]``, ``compiled [x s]``; the engine compiles while the weights load, and
  ``compile s`` spans both); ``cache``: that line's note, ``hits/stored`` (the persistent
  cache's hits and writes during the compile; empty with the cache off).
* ``start s``: seconds from this process launching the subprocess (``Popen``: interpreter
  start, imports, load, compile included) until the run's first generated token is on the
  host: the moment this process read the ``generating N tokens`` progress line (printed just
  before ``Engine.generate``), plus the run's ``ttft s``.
* ``ttft s``: the JSON's ``ttft_s``: ``Engine.generate``'s start to the first token (prefill).
* ``process wall s``: the whole subprocess (imports, load, compile, decode, exit).
* ``decode tok/s``: the JSON's ``decode_tokens_per_s``: tokens after the first over the decode
  dispatches' time (what real_size's tok/s is); ``total tok/s``: its ``tokens_per_s``, all
  tokens over ``Engine.generate``'s wall (prefill included).
* ``bench decode tok/s``: part ``bench``'s decode tok/s of the mode (same definition, same
  EngineConfig and prompt, the writer's engine on the in-memory params); ``vs bench %`` =
  ``100 * (decode tok/s / bench decode tok/s - 1)`` (issue 25: within 5%).
* ``accept len``, ``tokens``; ``spec == greedy``: whether spec's ids equal greedy's of the same
  run kind (else how many leading ids agree).

Columns of the prompts-file runs: ``prompts``, ``max running``, ``tokens`` (all requests'),
``load s`` / ``compile s`` / ``cache`` / ``process wall s`` as above; ``run wall s``,
``total tok/s``, ``decode tok/s``, ``ttft mean s`` / ``ttft max s``, ``accept len``: the run's
summary JSON (stderr's last line with ``--json``: ``Engine.generate``'s wall, all tokens over
it; decode over the decode dispatches' time; TTFT from the run's start to each request's first
token, queueing included);
``same as alone``: ``k/N`` requests whose ids equal the ``alone`` run's.

Parts run in the order bench (in the writer), cold, warm, prompts; on a device with a time
limit per call, split them (e.g. ``--parts bench,cold,warm`` and ``--parts prompts``: every
call writes the checkpoints again). ``--out`` is rewritten after every row (the tables, and the rows as JSON in ``OUT.json``), so
a timeout keeps what finished. Exit status 1 when a subprocess fails (its stderr tail is
printed).
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
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.real_size import DRAFT_TOKENS, GEOMETRIES, NEW, PAGE, PROMPT, STEPS, TOPK

PARTS = ("bench", "cold", "warm", "prompts")
MODES = ("greedy", "spec")
COLUMNS = (
    "geometry",
    "mode",
    "run",
    "bytes on disk",
    "write s",
    "load s",
    "compile s",
    "cache",
    "start s",
    "ttft s",
    "process wall s",
    "decode tok/s",
    "bench decode tok/s",
    "vs bench %",
    "total tok/s",
    "accept len",
    "tokens",
    "spec == greedy",
    "error",
)
PROMPTS_COLUMNS = (
    "geometry",
    "mode",
    "run",
    "prompts",
    "max running",
    "tokens",
    "load s",
    "compile s",
    "cache",
    "process wall s",
    "run wall s",
    "total tok/s",
    "decode tok/s",
    "ttft mean s",
    "ttft max s",
    "accept len",
    "same as alone",
    "error",
)
SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")
TIMEOUT_S = 600  # per subprocess
REPO = Path(__file__).resolve().parents[1]
# The writer subprocess: argv = geometry, directory, options (JSON); JSON lines out.
WRITER = (
    "import json, sys; from pathlib import Path; "
    "from bench.checkpoint_run import write_checkpoints; "
    "write_checkpoints(sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]))"
)


def spec_flags(draft: Path | None) -> list[str]:
    """``jspec generate``'s model flags of a run: ``--draft`` and the spec shape, or none."""
    if draft is None:
        return []
    shape = f"--page-size {PAGE} --topk {TOPK} --steps {STEPS} --draft-tokens {DRAFT_TOKENS}"
    return ["--draft", str(draft), *shape.split()]


def write_checkpoints(geometry: str, root: Path, options: dict) -> None:
    """The writer subprocess's work: make the geometry's params, write ``root/target`` and
    ``root/draft``, print one JSON line (bytes on disk and seconds per directory, the device);
    then, for each mode of ``options["bench"]``, the bench's decode rate on these params
    (one JSON line ``{"bench": {mode: {...}}}`` per mode)."""
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
    print(json.dumps(out), flush=True)
    for mode in options.get("bench", []):
        models = (target, params) + ((draft, dparams) if mode == "spec" else (None, None))
        result = bench_decode(root, models, options["prompt"], options["max_new"])
        print(json.dumps({"bench": {mode: result}}), flush=True)


def bench_decode(root: Path, models: tuple, prompt: list[int], max_new: int) -> dict:
    """Part ``bench``: the engine ``jspec generate`` builds for the same flags and prompt
    (its ``run_config`` + ``build_engine``: ``Engine.warmup`` included), on in-memory
    ``models`` (target, params, draft or None, draft params or None). Returns two runs:
    ``"bench 1st"``, the first ``generate`` after the warm-up (the CLI's only one), and
    ``"bench"``, timed as bench.real_size times it (after warmup's background
    compiles finished, a 2-token ``generate``, then the timed one); ``compile_s``:
    ``build_engine``'s seconds, on the first."""
    from jspec.apps._cli import sampling_from_args
    from jspec.apps.generate import _parser, run_config
    from jspec.apps.serving import build_engine, decode_tokens_per_s

    target, params, draft, dparams = models
    argv = ["--model", str(root / "target")]
    argv += spec_flags(None if draft is None else root / "draft")
    argv += ["--prompt-ids", " ".join(map(str, prompt)), "--max-new-tokens", str(max_new)]
    args = _parser().parse_args([*argv, "--ignore-eos"])
    sampling = sampling_from_args(args, args.seed).resolved()
    ecfg, _ = run_config(args, target, draft, prompt)
    t0 = time.perf_counter()
    engine = build_engine(args, ecfg, models, [sampling], lambda _: None)
    compile_s = time.perf_counter() - t0

    def timed() -> dict:
        out, stats = engine.generate([prompt], [max_new], sampling=[sampling])
        return {
            "decode_tokens_per_s": decode_tokens_per_s(stats),
            "tokens_per_s": stats.tokens_per_s,
            "ttft_s": stats.ttft_s[0],
            "mean_accept_len": stats.mean_accept_len if stats.mode == "spec" else 1.0,
            "token_ids": out[0],
        }

    first = {**timed(), "compile_s": compile_s}
    engine.wait_compiles()  # run "bench" without warmup's background compiles running
    engine.generate([prompt], [2], sampling=[sampling])
    return {"bench 1st": first, "bench": timed()}


def _dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


@dataclass
class Child:
    """A finished subprocess: its output, each stderr line with the seconds since launch."""

    returncode: int | None  # None: killed after TIMEOUT_S
    stdout: str
    stderr_lines: list[tuple[float, str]] = field(default_factory=list)
    wall: float = 0.0
    error: str = ""  # "" when it exited 0

    @property
    def stderr(self) -> str:
        return "".join(line for _, line in self.stderr_lines)

    def line_time(self, pattern: str) -> float | None:
        """Seconds from launch to the first stderr line matching ``pattern``, or None."""
        return next((t for t, line in self.stderr_lines if re.search(pattern, line)), None)


def _child(label: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
    """Run ``python argv`` (repo root on the path, ``env`` over this process's): the result
    with ``error`` "" when it exited 0, else the exit status and its stderr tail (printed)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {}), "PYTHONPATH": path},
    )
    out: list[bytes] = []
    child = Child(None, "")

    def read_stderr() -> None:
        for raw in iter(proc.stderr.readline, b""):
            child.stderr_lines.append((time.perf_counter() - t0, raw.decode(errors="replace")))

    readers = [
        threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True),
        threading.Thread(target=read_stderr, daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        child.returncode = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for reader in readers:
        reader.join()
    child.wall = time.perf_counter() - t0
    child.stdout = b"".join(out).decode(errors="replace")
    if child.returncode == 0:
        return child
    tail = child.stderr.strip().splitlines()[-20:]
    if child.returncode is None:
        child.error = f"{label} timed out after {TIMEOUT_S} s"
        print(child.error, file=sys.stderr, flush=True)
    else:
        print(f"{label} exited {child.returncode}; stderr tail:", file=sys.stderr)
        child.error = f"exit {child.returncode}: {(tail or [''])[-1][:120]}"
    print("\n".join(tail), file=sys.stderr, flush=True)
    return child


def cache_env(root: Path, name: str, xla: bool = True) -> dict[str, str]:
    """A subprocess's caches, fresh directories under ``root`` named ``name``: JAX's persistent
    compilation cache (``JSPEC_COMPILATION_CACHE``; ``xla`` False: none) and Triton's kernel
    cache (``TRITON_CACHE_DIR``: the jax-triton kernels compile while the steps lower, before
    the XLA cache is consulted; never the machine's ``~/.triton/cache``)."""
    env = {"TRITON_CACHE_DIR": str(root / f"triton_{name}")}
    if xla:
        env["JSPEC_COMPILATION_CACHE"] = str(root / f"xla_{name}")
    return env


def _progress_s(stderr: str, pattern: str) -> float | str:
    """Seconds from a ``jspec generate`` progress line (``loaded ... [12.3 s]``), or ""."""
    match = re.search(pattern + r"[^\[\n]*\[([0-9.]+) s\]", stderr)
    return float(match.group(1)) if match else ""


def _cache_note(stderr: str) -> str:
    """``"hits/stored"`` of the ``compiled [...] (H from the compilation cache, S stored)``
    line, or "" (the cache off)."""
    match = re.search(
        r"compiled \[[^\]]*\] \((\d+) from the compilation cache, (\d+) stored", stderr
    )
    return f"{match.group(1)}/{match.group(2)}" if match else ""


def _timings(child: Child) -> dict:
    return {
        "load s": _progress_s(child.stderr, "loaded"),
        "compile s": _progress_s(child.stderr, "compiled"),
        "cache": _cache_note(child.stderr),
        "process wall s": child.wall,
    }


def run_generate(
    model: Path,
    draft: Path | None,
    prompt: list[int],
    max_new: int,
    caches: dict[str, str],
) -> dict:
    """One single-prompt ``jspec generate`` subprocess with the environment ``caches``
    (:func:`cache_env`; without ``JSPEC_COMPILATION_CACHE``: ``--no-compilation-cache``);
    its row (timings, JSON fields, ``token_ids``)."""
    argv = ["-m", "jspec.cli", "generate", "--model", str(model), *spec_flags(draft)]
    argv += ["--prompt-ids", " ".join(map(str, prompt)), "--max-new-tokens", str(max_new)]
    if "JSPEC_COMPILATION_CACHE" not in caches:
        argv += ["--no-compilation-cache"]
    label = "jspec generate" + (" --draft" if draft is not None else "")
    child = _child(label, [*argv, "--json", "--ignore-eos"], caches)
    row: dict = {"process wall s": child.wall, "error": child.error}
    if child.error:
        return row
    result = json.loads(child.stdout.strip().splitlines()[-1])
    row.update(_timings(child))
    generating = child.line_time(r"jspec generate: generating \d+ tokens")
    row["start s"] = generating + result["ttft_s"] if generating is not None else ""
    row.update(_result_columns(result))
    return row


def _result_columns(result: dict) -> dict:
    """A row's columns from a single-prompt run's JSON (``jspec generate --json``, or the
    bench part's same fields)."""
    return {
        "ttft s": result["ttft_s"],
        "decode tok/s": result["decode_tokens_per_s"],
        "total tok/s": result["tokens_per_s"],
        "accept len": result["mean_accept_len"],
        "tokens": len(result["token_ids"]),
        "token_ids": result["token_ids"],
    }


def make_prompts(n: int, prompt_len: int, max_new: int, hot: int, seed: int = 2) -> list[dict]:
    """The prompts file's requests (see the module doc): ``prompt_ids`` of mixed lengths from
    ``[0, hot)``, request 0 the longest, about a quarter with their own ``max_new_tokens``."""
    rng = np.random.default_rng(seed)
    low = max(1, prompt_len // 8)
    requests = []
    for i in range(n):
        length = prompt_len if i == 0 else int(rng.integers(low, prompt_len + 1))
        request: dict = {"prompt_ids": rng.integers(0, hot, length).tolist()}
        if i > 0 and rng.random() < 0.25:
            request["max_new_tokens"] = int(rng.integers(max(1, max_new // 4), max_new + 1))
        requests.append(request)
    return requests


def run_prompts_file(
    model: Path,
    draft: Path | None,
    path: Path,
    max_new: int,
    max_running: int,
    caches: dict[str, str],
) -> tuple[dict, list[list[int]] | None]:
    """One ``jspec generate --prompts-file`` subprocess (environment ``caches``): its row and
    each request's ids (None when it failed)."""
    argv = ["-m", "jspec.cli", "generate", "--model", str(model), *spec_flags(draft)]
    argv += ["--prompts-file", str(path), "--max-new-tokens", str(max_new)]
    argv += ["--max-running", str(max_running), "--json", "--ignore-eos"]
    label = f"jspec generate --prompts-file --max-running {max_running}"
    child = _child(label, argv, caches)
    row: dict = {"max running": max_running, "process wall s": child.wall, "error": child.error}
    if child.error:
        return row, None
    records = [json.loads(line) for line in child.stdout.splitlines() if line.strip()]
    summary = json.loads([x for x in child.stderr.splitlines() if x.startswith("{")][-1])
    row.update(_timings(child))
    row.update(
        {
            "prompts": len(records),
            "tokens": sum(r["num_tokens"] for r in records),
            "run wall s": summary["wall_s"],
            "total tok/s": summary["tokens_per_s"],
            "decode tok/s": summary["decode_tokens_per_s"],
            "ttft mean s": summary["ttft_s"]["mean"],
            "ttft max s": summary["ttft_s"]["max"],
            "accept len": summary["mean_accept_len"],
        }
    )
    if [r["index"] for r in records] != list(range(len(records))):
        row["error"] = "output lines not in input order"
    return row, [r["token_ids"] for r in records]


def same_as(spec: list[int], greedy: list[int]) -> str:
    """``"yes"``, or ``"no (k/n leading agree)"``."""
    if spec == greedy:
        return "yes"
    diff = (i for i, (a, b) in enumerate(zip(spec, greedy)) if a != b)
    lead = next(diff, min(len(spec), len(greedy)))
    return f"no ({lead}/{len(greedy)} leading agree)"


def same_count(batched: list[list[int]], alone: list[list[int]]) -> str:
    """``"k/N"``: requests whose ids equal the reference's (N: the reference's count)."""
    return f"{sum(a == b for a, b in zip(batched, alone))}/{len(alone)}"


def _report(header: str, rows: list[dict]) -> str:
    from bench._timing import format_table

    runs = [r for r in rows if r["run"] not in ("batched", "alone")]
    many = [r for r in rows if r["run"] in ("batched", "alone")]
    tables = [format_table(runs, COLUMNS)] if runs else []
    tables += [format_table(many, PROMPTS_COLUMNS)] if many else []
    return "\n\n".join([header, *tables]) + "\n"


def _write(path: str, header: str, rows: list[dict]) -> None:
    """The tables, and the rows (without token ids) as JSON beside them."""
    Path(path).write_text(_report(header, rows))
    bare = [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]
    Path(path + ".json").write_text(json.dumps({"header": header, "rows": bare}, default=str))


def _list(text: str, choices: tuple[str, ...], flag: str) -> list[str]:
    items = [x for x in text.split(",") if x]
    bad = [x for x in items if x not in choices]
    if bad:
        raise SystemExit(f"{flag}: {bad[0]!r} is not one of {','.join(choices)}")
    return items


def main(argv: list[str] | None = None) -> list[dict]:
    """Every row (``run``: bench; the single-prompt runs cold / fill / warm; the prompts
    file's batched / alone); [] when writing the checkpoints failed."""
    from bench._timing import format_table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="8b")
    parser.add_argument("--dir", default=None, help="parent of the checkpoint directory")
    parser.add_argument("--keep", action="store_true", help="keep the written directories")
    parser.add_argument("--parts", default=",".join(PARTS), help="of " + ",".join(PARTS))
    parser.add_argument("--modes", default="greedy,spec", help="of parts bench, cold, warm")
    parser.add_argument("--prompts-modes", default="spec", help="of part prompts")
    parser.add_argument("--max-new-tokens", type=int, default=NEW)
    parser.add_argument("--prompt-len", type=int, default=PROMPT)
    parser.add_argument("--num-prompts", type=int, default=256, help="part prompts' requests")
    parser.add_argument("--max-running", type=int, default=64, help="part prompts' batched run")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    parts = _list(args.parts, PARTS, "--parts")
    modes = _list(args.modes, MODES, "--modes")
    prompts_modes = _list(args.prompts_modes, MODES, "--prompts-modes")
    g = GEOMETRIES[args.geometry]
    if args.dir is not None:
        os.makedirs(args.dir, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f"jspec_ckpt_{g.name}_", dir=args.dir))
    prompt = np.random.default_rng(1).integers(0, g.draft_vocab, args.prompt_len).tolist()
    new = args.max_new_tokens
    rows: list[dict] = []
    header = ""

    def add_run(row: dict) -> None:
        """A single-prompt row, spec's ids checked against greedy's of the same run."""
        run = row["run"]
        greedy = next((r for r in rows if (r["run"], r["mode"]) == (run, "greedy")), None)
        if row["mode"] == "spec" and greedy and "token_ids" in greedy and "token_ids" in row:
            row["spec == greedy"] = same_as(row["token_ids"], greedy["token_ids"])
        add(row, COLUMNS)

    def add(row: dict, columns: tuple[str, ...]) -> None:
        rows.append(row)
        print(format_table([row], columns), flush=True)
        if args.out:  # partial results survive a timeout
            _write(args.out, header, rows)

    try:
        options = {"bench": modes if "bench" in parts else [], "prompt": prompt, "max_new": new}
        writer = _child(
            "checkpoint writer",
            ["-c", WRITER, g.name, str(root), json.dumps(options)],
            cache_env(root, "writer", xla=False),
        )
        lines = [json.loads(x) for x in writer.stdout.splitlines() if x.startswith("{")]
        if not lines or "target" not in lines[0]:
            return rows
        written = lines[0]
        bench = {m: r for line in lines[1:] for m, r in line["bench"].items()}
        t, d = written["target"], written["draft"]
        print(
            f"{g.name}: made in {written['make_s']:.1f} s; target {t['bytes'] / 1e9:.2f} GB "
            f"written in {t['write_s']:.1f} s, draft {d['bytes'] / 1e9:.2f} GB in "
            f"{d['write_s']:.1f} s ({root})",
            flush=True,
        )
        header = (
            f"checkpoint_run on {written['device']}, {time.strftime('%Y-%m-%d %H:%M')}: "
            f"{g.name} random bf16 weights as safetensors (target shards <= "
            f"{SHARD_BYTES / 1e9:g} GB), jspec generate from those directories: prompt of "
            f"{args.prompt_len} hot ids, {new} new tokens, --ignore-eos; spec: page {PAGE}, "
            f"topk {TOPK}, steps {STEPS}, {DRAFT_TOKENS} draft tokens; parts {','.join(parts)}"
        )
        if "prompts" in parts:
            header += (
                f"; prompts file: {args.num_prompts} requests, --max-running {args.max_running}"
                " vs 1"
            )
        for run in ("bench 1st", "bench") if "bench" in parts else ():
            for mode in modes:
                row = {"geometry": g.name, "mode": mode, "run": run, "error": writer.error}
                result = bench.get(mode, {}).get(run)
                if result is not None:
                    row.update(_result_columns(result), error="")
                    row["compile s"] = result.get("compile_s", "")
                add_run(row)
        draft_dir = {"greedy": None, "spec": root / "draft"}
        runs = ["cold"] if "cold" in parts else []
        runs += ["fill", "warm"] if "warm" in parts else []
        for run in runs:
            for mode in modes:
                on_disk = (t,) if mode == "greedy" else (t, d)
                row = {
                    "geometry": g.name,
                    "mode": mode,
                    "run": run,
                    "bytes on disk": sum(x["bytes"] for x in on_disk),
                    "write s": sum(x["write_s"] for x in on_disk),
                }
                # cold: no XLA cache, a Triton cache of its own; fill, warm: one pair per mode
                caches = cache_env(root, mode)
                if run == "cold":
                    caches = cache_env(root, f"cold_{mode}", xla=False)
                row.update(run_generate(root / "target", draft_dir[mode], prompt, new, caches))
                if mode in bench and isinstance(row.get("decode tok/s"), float):
                    ref = bench[mode]["bench"]["decode_tokens_per_s"]
                    row["bench decode tok/s"] = ref
                    row["vs bench %"] = 100.0 * (row["decode tok/s"] / ref - 1.0)
                add_run(row)
        if "prompts" in parts:
            path = root / "prompts.jsonl"
            requests = make_prompts(args.num_prompts, args.prompt_len, new, g.draft_vocab)
            path.write_text("".join(json.dumps(r) + "\n" for r in requests))
            for mode in prompts_modes:
                outs = {}
                for run, running in (("batched", args.max_running), ("alone", 1)):
                    row = {"geometry": g.name, "mode": mode, "run": run}
                    result, outs[run] = run_prompts_file(
                        root / "target", draft_dir[mode], path, new, running, cache_env(root, mode)
                    )
                    row.update(result)
                    if run == "alone" and outs["batched"] is not None and outs["alone"]:
                        batched = next(r for r in rows[::-1] if r["run"] == "batched")
                        batched["same as alone"] = same_count(outs["batched"], outs["alone"])
                    add(row, PROMPTS_COLUMNS)
    finally:
        if args.keep:
            print(f"kept {root}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
    text = _report(header, rows)
    print(text, flush=True)
    if args.out:
        _write(args.out, header, rows)
    return rows


if __name__ == "__main__":
    rows = main(sys.argv[1:])
    sys.exit(0 if rows and not any(r["error"] for r in rows) else 1)
