# Over 400 lines: `jspec compare` end to end (run, diff, report, CLI) over one row format.
"""Side-by-side comparison of jspec and the PyTorch references (``jspec compare``).

For every op of :data:`interop.registry.REGISTRY`, every grid :class:`Case` and every
requested ``impl``, fresh random **valid** inputs are drawn (the same inputs for every impl of
one op and case), the torch reference and jspec run on clones of them, and every output is
compared: integers and bools exactly, floats by max abs / rel error (``--rtol``, default exact).
A mismatch reports the first differing index, both values and the inputs of that request.

    python -m interop.compare --grid small --impl xla,pallas --json out.json
    jspec compare --ops build_tree_kernel_efficient,verify_tree_greedy --grid full

Exit code: 0 if every row is ``ok`` (or ``n/a`` / ``skipped``), 1 on any mismatch or error.
``--sglang`` also runs real sglang functions against the references where sglang is importable
(otherwise one ``skipped: sglang not importable`` row).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import itertools
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np

GRIDS = {
    # CPU CI: < 2 minutes with every impl (Pallas in interpret mode)
    "small": [(1, 1, 3, 2), (4, 2, 3, 3), (16, 4, 2, 2)],
    "full": list(itertools.product((1, 4, 16, 64), (1, 2, 4, 8), (1, 3, 5), (1, 4, 16))),
}
DEFAULT_IMPLS = ("xla", "pallas", "triton")
MAX_SHOWN = 24


def grid_cases(name: str) -> list[Any]:
    from interop._world import Case

    return [Case(*c, max_draft_tokens=8 if name == "small" else 32) for c in GRIDS[name]]


# ---- output comparison ---------------------------------------------------------------------------
def _short(x: Any) -> Any:
    arr = np.asarray(x)
    flat = arr.reshape(-1).tolist()
    return flat[:MAX_SHOWN] + (["..."] if len(flat) > MAX_SHOWN else [])


def compare_outputs(
    ref: dict[str, np.ndarray], got: dict[str, np.ndarray], *, rtol: float = 0.0, atol: float = 0.0
) -> dict[str, Any]:
    """Compare two output dicts; returns ``{"ok", "outputs": {name: summary}, "first_diff"}``."""
    summaries: dict[str, Any] = {}
    first: dict[str, Any] | None = None
    for name in ref.keys() | got.keys():
        if name not in ref or name not in got:
            summaries[name] = {"ok": False, "why": "missing on one side"}
            first = first or {"output": name, "why": "missing on one side"}
            continue
        a, b = np.asarray(ref[name]), np.asarray(got[name])
        if a.shape != b.shape:
            summaries[name] = {"ok": False, "why": f"shape {a.shape} vs {b.shape}"}
            first = first or {"output": name, "why": f"shape {a.shape} vs {b.shape}"}
            continue
        is_float = np.issubdtype(a.dtype, np.floating) or np.issubdtype(b.dtype, np.floating)
        if is_float:
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            bad = ~np.isclose(a64, b64, rtol=rtol, atol=atol, equal_nan=True)
            err = np.abs(a64 - b64)
            err = np.where(np.isnan(err), 0.0, err)
            summary = {
                "kind": "float",
                "max_abs": float(err.max(initial=0.0)),
                "max_rel": float((err / np.maximum(np.abs(a64), 1e-30)).max(initial=0.0)),
            }
        else:
            bad = a.astype(np.int64) != b.astype(np.int64)
            summary = {"kind": "int"}
        summary["ok"] = not bool(bad.any())
        summary["num_diff"] = int(bad.sum())
        summaries[name] = summary
        if bad.any() and first is None:
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            first = {
                "output": name,
                "index": list(index),
                "expected": a[index].item(),
                "got": b[index].item(),
                "shape": list(a.shape),
            }
    ok = all(s["ok"] for s in summaries.values())
    return {"ok": ok, "outputs": dict(sorted(summaries.items())), "first_diff": first}


def _request_of(shape: Sequence[int], index: Sequence[int], batch: int) -> int | None:
    """The batch row an output element belongs to (outputs are request-major)."""
    if not shape or batch <= 0:
        return None
    if shape[0] == batch:
        return index[0]
    if shape[0] % batch == 0:  # request-major rows: (B*N,), (B*K, W), ...
        return index[0] // (shape[0] // batch)
    return None


def describe_inputs(inputs: dict[str, Any], batch: int, request: int | None) -> dict[str, Any]:
    """The inputs relevant to one request (its rows), or small inputs whole."""
    out: dict[str, Any] = {}
    for name, value in inputs.items():
        arr = np.asarray(value.cpu() if hasattr(value, "cpu") else value)
        if request is not None and arr.ndim >= 1 and arr.shape[0] == batch:
            out[f"{name}[{request}]"] = _short(arr[request])
        elif arr.size <= MAX_SHOWN:
            out[name] = _short(arr)
    return out


# ---- running -------------------------------------------------------------------------------------
def op_unavailable(op: Any) -> str | None:
    """None if every ``module:attr`` the op needs imports, else the reason."""
    for req in op.requires:
        module, attr = req.split(":")
        try:
            if not hasattr(importlib.import_module(module), attr):
                return f"not available: {module}.{attr} missing"
        except Exception as err:  # noqa: BLE001 - any import failure means "not available"
            return f"not available: {module} ({type(err).__name__}: {err})"
    return None


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


class Progress:
    """A plain-text progress bar on stderr."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30) -> None:
        self.total, self.done, self.enabled, self.width = max(total, 1), 0, enabled, width
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        line = (
            f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
            f"{time.perf_counter() - self.t0:5.1f}s {label}"
        )
        if self.tty:
            sys.stderr.write("\r" + line[:120].ljust(120))
            if self.done == self.total:
                sys.stderr.write("\n")
        elif self.done == self.total or self.done % max(self.total // 10, 1) == 0:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def run_compare(
    cases: Sequence[Any],
    ops: Sequence[Any],
    impls: Sequence[str],
    *,
    seed: int = 0,
    rtol: float = 0.0,
    atol: float = 0.0,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """One row per (op, case, impl); see the module docstring."""
    from interop._world import make_world

    gpu = _on_gpu()
    work = [
        (op, case, impl)
        for op in ops
        for case in cases
        for impl in op.impls
        if impl in impls and (impl != "triton" or gpu)
    ]
    bar = Progress(len(work), progress)
    rows: list[dict[str, Any]] = []
    unavailable = {op.name: op_unavailable(op) for op in ops}
    for op_i, op in enumerate(ops):
        if unavailable[op.name]:
            rows.append(
                {
                    "op": op.name,
                    "config": "*",
                    "impl": "*",
                    "status": "n/a",
                    "detail": unavailable[op.name],
                }
            )
    for op, case, impl in work:
        bar.step(f"{op.name} {case} {impl}")
        if unavailable[op.name]:
            continue
        row: dict[str, Any] = {"op": op.name, "config": str(case), "impl": impl}
        op_seed = [seed, [o.name for o in ops].index(op.name), list(cases).index(case)]
        t0 = time.perf_counter()
        try:
            rng = np.random.default_rng(op_seed)
            world = make_world(case, rng)
            ref, got, inputs = op.run(world, rng, impl)
            result = compare_outputs(ref, got, rtol=rtol, atol=atol)
        except Exception as err:  # noqa: BLE001 - one failing op must not stop the run
            row.update(
                status="ERROR",
                detail=f"{type(err).__name__}: {err}"[:300],
                traceback=traceback.format_exc(limit=6),
            )
            rows.append(row | {"seconds": round(time.perf_counter() - t0, 3)})
            continue
        row["seconds"] = round(time.perf_counter() - t0, 3)
        row["outputs"] = result["outputs"]
        if result["ok"]:
            floats = [s for s in result["outputs"].values() if s.get("kind") == "float"]
            max_err = max((s["max_abs"] for s in floats), default=None)
            row.update(
                status="ok",
                detail=f"{len(result['outputs'])} outputs equal"
                + (f", max abs err {max_err:.2e}" if max_err else ""),
            )
        else:
            diff = result["first_diff"]
            request = _request_of(diff.get("shape", ()), diff.get("index", ()), case.batch)
            diff["request"] = request
            diff["inputs"] = describe_inputs(inputs, case.batch, request)
            row.update(status="MISMATCH", first_diff=diff, detail=_diff_line(diff))
        rows.append(row)
    return rows


def _diff_line(diff: dict[str, Any]) -> str:
    if "index" not in diff:
        return f"{diff['output']}: {diff.get('why')}"
    return (
        f"{diff['output']}[{','.join(map(str, diff['index']))}]: expected "
        f"{diff['expected']} got {diff['got']}"
    )


def sglang_rows() -> list[dict[str, Any]]:
    """Real sglang vs the torch references, where sglang is importable (see module docstring)."""
    if importlib.util.find_spec("sglang") is None:
        return [
            {
                "op": "sglang",
                "config": "*",
                "impl": "sglang",
                "status": "skipped",
                "detail": "skipped: sglang not importable",
            }
        ]
    import torch

    from interop._world import make_world
    from interop.kv.compare import allocator_script
    from interop.kv.reference_allocator import PagedTokenToKVPoolAllocator as Ref

    rows = []
    try:
        paged = importlib.import_module("sglang.srt.mem_cache.allocator.paged")
    except Exception as err:  # noqa: BLE001
        return [
            {
                "op": "allocator",
                "config": "*",
                "impl": "sglang",
                "status": "skipped",
                "detail": f"skipped: sglang allocator not importable ({err})"[:300],
            }
        ]
    for case in grid_cases("small"):
        rng_seed = 1234
        world = make_world(case, np.random.default_rng(rng_seed))
        size = world.num_pages * case.page_size
        row = {"op": "allocator", "config": str(case), "impl": "sglang"}
        try:
            ref = allocator_script(
                world,
                np.random.default_rng(7),
                Ref(size, case.page_size, torch.float32, "cpu", None, False),
            )
            got = allocator_script(
                world,
                np.random.default_rng(7),
                paged.PagedTokenToKVPoolAllocator(
                    size, case.page_size, torch.float32, "cpu", None, False
                ),
            )
        except Exception as err:  # noqa: BLE001 - sglang on CPU may lack its kernels
            rows.append(row | {"status": "skipped", "detail": f"skipped: {err}"[:300]})
            continue
        result = compare_outputs(ref, got)
        rows.append(
            row
            | (
                {"status": "ok", "detail": "equal"}
                if result["ok"]
                else {
                    "status": "MISMATCH",
                    "detail": _diff_line(result["first_diff"]),
                    "first_diff": result["first_diff"],
                }
            )
        )
    return rows


# ---- report --------------------------------------------------------------------------------------
def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]

    def line(vals):
        return "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(columns), sep] + [line(r) for r in cells])


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    counts = {"total": len(rows)}
    for status in ("ok", "MISMATCH", "ERROR", "n/a", "skipped"):
        counts[status] = sum(r["status"] == status for r in rows)
    return counts


def report(rows: Sequence[dict[str, Any]]) -> str:
    parts = [format_table(rows, ("op", "config", "impl", "status", "detail"))]
    for r in rows:
        if r["status"] == "MISMATCH" and "first_diff" in r:
            d = r["first_diff"]
            parts.append(
                f"\nMISMATCH {r['op']} [{r['config']}] impl={r['impl']}: "
                f"{_diff_line(d)} (request {d.get('request')})\n  inputs: "
                + json.dumps(d.get("inputs", {}), default=str)
            )
        elif r["status"] == "ERROR":
            parts.append(
                f"\nERROR {r['op']} [{r['config']}] impl={r['impl']}:\n"
                + r.get("traceback", r["detail"])
            )
    s = summarize(rows)
    parts.append("\n" + ", ".join(f"{k}: {v}" for k, v in s.items()))
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jspec compare", description=__doc__.split("\n")[0])
    parser.add_argument("--grid", choices=sorted(GRIDS), default="small")
    parser.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    parser.add_argument(
        "--impl",
        default=",".join(DEFAULT_IMPLS),
        help="comma-separated jspec impls (triton runs only on a GPU)",
    )
    parser.add_argument("--json", default="", help="write rows and summary to this path")
    parser.add_argument(
        "--sglang", action="store_true", help="also compare real sglang functions where importable"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rtol", type=float, default=0.0, help="float tolerance (relative)")
    parser.add_argument("--atol", type=float, default=0.0, help="float tolerance (absolute)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(list(argv) if argv is not None else None)

    from interop.registry import REGISTRY

    wanted = [o for o in args.ops.split(",") if o]
    unknown = sorted(set(wanted) - {op.name for op in REGISTRY})
    if unknown:
        parser.error(f"unknown ops {unknown}; choose from {[op.name for op in REGISTRY]}")
    ops = [op for op in REGISTRY if not wanted or op.name in wanted]
    impls = [i for i in args.impl.split(",") if i]
    for flag, tol in (("--rtol", args.rtol), ("--atol", args.atol)):
        if not tol >= 0:  # NaN too
            parser.error(f"{flag}={tol} must be >= 0")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json {args.json}: its directory does not exist")
    known = sorted({impl for op in REGISTRY for impl in op.impls})
    bad = sorted(set(impls) - set(known))
    if bad or not impls:
        parser.error(f"--impl={args.impl!r}: unknown impls {bad}; choose from {known}")
    t0 = time.perf_counter()
    rows = run_compare(
        grid_cases(args.grid),
        ops,
        impls,
        seed=args.seed,
        rtol=args.rtol,
        atol=args.atol,
        progress=not args.no_progress,
    )
    if args.sglang:
        rows += sglang_rows()
    print(report(rows))
    summary = summarize(rows) | {"seconds": round(time.perf_counter() - t0, 1)}
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump({"summary": summary, "rows": rows}, f, indent=1, default=str)
        except OSError as e:
            print(f"jspec compare: --json {args.json}: {e.strerror or e}", file=sys.stderr)
            return 2
    return 1 if summary["MISMATCH"] or summary["ERROR"] else 0


if __name__ == "__main__":
    sys.exit(main())
