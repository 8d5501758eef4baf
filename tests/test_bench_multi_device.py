"""bench/multi_device.py on CPU: layouts, the all-reduce count, per-GPU floors, the comparison
with one device and the report, so that a typo does not cost a GPU run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import bench.multi_device as md
from bench._timing import write_with_json
from bench.multi_device import (
    compare_rows,
    layout_batches,
    parse_layouts,
    report,
)
from bench.real_size import GEOMETRIES


def test_parse_layouts_one_device_first():
    assert parse_layouts("2x1,1x2,2x1") == [(1, 1), (2, 1), (1, 2)]
    assert parse_layouts("1x2,1x1") == [(1, 1), (1, 2)]
    with pytest.raises(ValueError, match="DPxTP"):
        parse_layouts("2")
    with pytest.raises(ValueError, match="DPxTP"):
        parse_layouts("0x2")


def test_layout_batches_data_parallel_runs_dp_times_the_largest():
    assert layout_batches(1, [1, 16]) == [1, 16]
    assert layout_batches(2, [1, 16]) == [32]


def test_allreduce_plan_8b():
    from bench.multi_device import allreduce_plan

    g = GEOMETRIES["8b"]
    # Greedy: attention + MLP psum per layer over the bs tokens.
    assert allreduce_plan(g, "greedy", 1) == {1: 64}
    # Spec bs 16: verify (16 x 8 tokens) and the draft extend (16 x 8 rows) = 64 + 2 psums of
    # 128 rows; the 2 draft-loop forwards of 16 x 4 rows: 4 psums of 64 rows.
    assert allreduce_plan(g, "spec", 16) == {128: 66, 64: 4}


def _row(layout, mode, bs, wall, tok_s, floor=None):
    row = {"layout": layout, "mode": mode, "bs": bs, "step ms (wall)": wall, "tok/s": tok_s}
    return row if floor is None else {**row, "floor ms": floor, "step ms (device)": None}


def test_compare_rows_tensor_and_data_parallel():
    rows = [
        _row("1x1", "greedy", 2, 10.0, 100.0, floor=5.0),
        _row("1x2", "greedy", 2, 8.0, 125.0, floor=4.0),
        _row("2x1", "greedy", 4, 10.0, 190.0),
        _row("1x2", "spec", 2, 8.0, 125.0),  # no one-device spec row: nothing to compare
    ]
    outputs = {
        ("1x1", "greedy", 2): [[1, 2], [3, 4]],
        ("1x2", "greedy", 2): [[1, 2], [3, 5]],
        ("2x1", "greedy", 4): [[1, 2], [3, 4], [6], [7]],
        ("1x2", "spec", 2): [[1, 2], [3, 4]],
    }
    compare_rows(rows, outputs)
    one, tp, dp, spec = rows
    assert one["x floor (wall)"] == 2.0 and "x floor (device)" not in one
    assert "step x" not in one and "same as 1 GPU" not in one
    assert (tp["step x"], tp["tok/s x"], tp["same as 1 GPU"]) == (1.25, 1.25, "1/2")
    assert tp["x floor (wall)"] == 2.0
    # Data parallel at bs 4 beside one device at bs 2: its first two prompts are compared.
    assert (dp["step x"], dp["tok/s x"], dp["same as 1 GPU"]) == (1.0, 1.9, "2/2")
    assert "step x" not in spec


def test_kernel_breakdown_groups_families_per_round():
    events = [
        ("ncclDevKernel_AllReduce_Sum_bf16", "psum", 3e6),
        ("gemm_fusion_dot_12", "dot", 2e6),
        ("gemm_fusion_dot_7", "dot", 4e6),
        ("_rms_norm_kernel", "rms", 1e6),
    ]
    assert md.kernel_breakdown(events, rounds=2) == (
        "gemm_fusion_dot_ 3.00; nccl 1.50; _rms_norm_kernel 0.50"
    )
    assert md.kernel_breakdown(events, rounds=1, top=1) == "gemm_fusion_dot_ 6.00"


def test_demo_models_build():
    """``--model demo``'s models: the demo's target and its draft head, weights made."""
    target, params, draft_model, draft = md.demo_models()
    assert params.embed.shape == (target.config.vocab_size, target.config.hidden_size)
    assert draft_model is not None and draft is not None


def test_report_and_write(tmp_path):
    rows = [_row("1x1", "greedy", 1, 5.0, 200.0, floor=4.0)]
    allreduce = {(2, 1): {"tp": 2, "rows": 1, "MB": 0.008, "device us": 9.5, "wall us": 12.0}}
    text = report("header line", rows, allreduce)
    assert text.startswith("header line\n\n| layout | mode | bs | step ms (wall) |")
    assert "All-reduce alone" in text and "| 2 | 1 | 0.01 | 9.50 | 12.0 |" in text
    path = str(tmp_path / "md.md")
    write_with_json(path, text, {"rows": rows, "allreduce": list(allreduce.values())})
    assert open(path).read() == text
    assert json.load(open(path + ".json"))["rows"][0]["tok/s"] == 200.0


_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import json
    import sys
    from bench import multi_device as md
    from bench.real_size import GEOMETRIES, make_engine, make_params, make_target

    # Per-GPU floors of the quick geometry under tp 2: each GPU holds half of the layers and the
    # whole (replicated) LM head and embedding; the all-reduces add their measured times.
    g = GEOMETRIES["quick"]
    target = make_target(g)
    params, draft, dparams = make_params(g, target)
    one = make_engine(g, target, params, draft, dparams, "spec", [2], "auto")
    two = make_engine(g, target, params, draft, dparams, "spec", [2], "auto", tensor_parallel=2)
    lp = md.local_view(two.weights.target)
    assert lp.layers[0].wqkv.shape[1] == g.kv_heads // 2 and lp.lm_head.shape == (64, 512)
    plan = md.allreduce_plan(g, "spec", 2)
    measured = {{"copy TB/s": 1.0, "TFLOP/s": 1.0,
                "allreduce": {{(2, r): {{"MB": 1.0, "device us": None, "wall us": 10.0}}
                              for r in plan}}}}
    f1 = md.gpu_floor(g, one.weights.target, one.weights.draft, "spec", 2, 1, 1, measured)
    f2 = md.gpu_floor(g, two.weights.target, two.weights.draft, "spec", 2, 1, 2, measured)
    assert f1["all-reduce floor ms"] == 0 and f1["all-reduce MB"] == 0
    assert f2["all-reduce floor ms"] == sum(plan.values()) * 10.0 / 1e3
    assert f2["floor ms"] == max(f2["memory floor ms"], f2["compute floor ms"]) + f2[
        "all-reduce floor ms"]
    assert 0.5 * f1["weights GB/GPU"] < f2["weights GB/GPU"] < f1["weights GB/GPU"]
    assert f2["memory floor ms"] < f1["memory floor ms"]
    m = md.measure_allreduce(4, 64, 2)
    assert m["device us"] is None and m["wall us"] > 0 and m["MB"] == 4 * 64 * 2 / 1e6
    del one, two

    # The whole bench, greedy only: one device, then tensor parallel 2.
    rows = md.main(["--model", "quick", "--layouts", "1x2", "--modes", "greedy",
                    "--batches", "1", "--out", {out!r}])
    assert [(r["layout"], r["bs"]) for r in rows] == [("1x1", 1), ("1x2", 1)], rows
    assert not any("FAILED" in r.get("note", "") for r in rows), rows
    assert rows[1]["same as 1 GPU"] == "1/1" and rows[1]["all-reduce floor ms"] > 0, rows
    assert rows[1]["step ms (device)"] is None and rows[1]["leak check"].startswith("ok: 1 x")
    saved = json.load(open({out!r} + ".json"))
    assert saved["rows"][1]["layout"] == "1x2" and saved["allreduce"][0]["tp"] == 2
    print("MULTI DEVICE BENCH OK")
""")


def test_bench_quick_geometry_on_two_cpu_devices(tmp_path):
    """Floors under tp 2 and one end-to-end run (``--model quick``) on 2 forced host devices."""
    out = str(tmp_path / "multi_device.md")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(out=out)],
        env=env,
        cwd=root,
        check=False,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "MULTI DEVICE BENCH OK" in proc.stdout
    assert "| 1x2 | greedy | 1 |" in open(out).read()
