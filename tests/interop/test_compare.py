"""The comparison harness: diffing, planted one-element differences, CLI, n/a and sglang rows."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("torch")

from interop import compare
from interop._world import Case, make_world
from interop.registry import REGISTRY

CASE = Case(page_size=4, topk=2, num_steps=3, batch=3)


@pytest.fixture(autouse=True)
def _fresh_jit_caches():
    """Planted tests patch jspec ops under jitted wrappers: drop their traces afterwards."""
    yield
    import jax

    jax.clear_caches()


def _op(name):
    return next(op for op in REGISTRY if op.name == name)


def test_compare_outputs_ints_floats_shapes():
    ok = compare.compare_outputs(
        {"a": np.arange(6).reshape(2, 3)}, {"a": np.arange(6).reshape(2, 3).astype(np.int32)}
    )
    assert ok["ok"] and ok["first_diff"] is None
    got = np.arange(6).reshape(2, 3)
    got[1, 2] = 9
    bad = compare.compare_outputs({"a": np.arange(6).reshape(2, 3)}, {"a": got})
    assert not bad["ok"]
    assert bad["first_diff"] == {
        "output": "a",
        "index": [1, 2],
        "expected": 5,
        "got": 9,
        "shape": [2, 3],
    }
    assert bad["outputs"]["a"]["num_diff"] == 1
    shape = compare.compare_outputs({"a": np.zeros(3)}, {"a": np.zeros(4)})
    assert not shape["ok"] and "shape (3,) vs (4,)" in shape["first_diff"]["why"]
    missing = compare.compare_outputs({"a": np.zeros(3)}, {})
    assert not missing["ok"]
    floats = compare.compare_outputs(
        {"x": np.array([1.0, np.nan])}, {"x": np.array([1.0 + 1e-7, np.nan])}, rtol=1e-6
    )
    assert floats["ok"] and floats["outputs"]["x"]["max_abs"] == pytest.approx(1e-7)
    assert not compare.compare_outputs({"x": np.array([1.0])}, {"x": np.array([1.0 + 1e-7])})["ok"]


def test_request_of_and_describe_inputs():
    assert compare._request_of([3, 4], [2, 1], 3) == 2
    assert compare._request_of([12], [7], 3) == 1  # flat request-major (B*N)
    assert compare._request_of([6, 4], [3, 0], 3) == 1  # rows (b, t): B*K
    assert compare._request_of([5, 2], [4, 0], 3) is None
    desc = compare.describe_inputs(
        {"seq_lens": np.array([5, 6, 7]), "big": np.zeros(100), "k": np.array([1, 2])}, 3, 1
    )
    assert desc == {"seq_lens[1]": [6], "k": [1, 2]}


def test_planted_difference_in_verify_is_reported(monkeypatch):
    from jspec.tree import verify

    real = verify.verify_tree_greedy

    def flipped(*args, **kwargs):
        predicts, accept_index, num = real(*args, **kwargs)
        return predicts, accept_index, num.at[1].add(1)  # one element off

    monkeypatch.setattr(verify, "verify_tree_greedy", flipped)
    rows = compare.run_compare([CASE], [_op("verify_tree_greedy")], ["xla"], progress=False)
    (row,) = rows
    assert row["status"] == "MISMATCH"
    diff = row["first_diff"]
    assert diff["output"] == "accept_token_num" and diff["index"] == [1]
    assert diff["got"] == diff["expected"] + 1 and diff["request"] == 1
    assert "candidates[1]" in diff["inputs"] and "target_predict[1]" in diff["inputs"]
    assert row["outputs"]["predicts"]["ok"] and row["outputs"]["accept_index"]["ok"]
    text = compare.report(rows)
    assert "MISMATCH verify_tree_greedy" in text and "accept_token_num[1]" in text


def test_planted_difference_in_an_attention_meta_op(monkeypatch):
    from jspec.attention_meta import page_table

    real = page_table.draft_decode_set_expand_metadata

    def flipped(*args, **kwargs):
        seqlens, table = real(*args, **kwargs)
        return seqlens, table.at[3, 0].add(1)

    monkeypatch.setattr(page_table, "draft_decode_set_expand_metadata", flipped)
    (row,) = compare.run_compare(
        [CASE], [_op("draft_decode_set_expand_metadata")], ["xla"], progress=False
    )
    assert row["status"] == "MISMATCH"
    assert row["first_diff"]["output"].endswith("page_table")
    assert row["first_diff"]["index"] == [3, 0]
    assert row["first_diff"]["request"] == 1  # row 3 = (b=1, t=1) with K=2


def test_errors_and_unavailable_ops(monkeypatch):
    broken = dataclasses.replace(
        _op("page_aligned_decode_alloc_lens"), name="broken", run=lambda w, rng, impl: 1 / 0
    )
    missing = dataclasses.replace(
        _op("page_aligned_decode_alloc_lens"), name="missing", requires=("jspec.no_such_module:fn",)
    )
    rows = compare.run_compare([CASE], [broken, missing], ["xla"], progress=False)
    by_op = {r["op"]: r for r in rows}
    assert by_op["broken"]["status"] == "ERROR" and "ZeroDivisionError" in by_op["broken"]["detail"]
    assert by_op["missing"]["status"] == "n/a"
    assert "not available: jspec.no_such_module" in by_op["missing"]["detail"]
    assert compare.summarize(rows)["ERROR"] == 1


def test_main_json_exit_codes_and_sglang(tmp_path, capsys, monkeypatch):
    out = tmp_path / "cmp.json"
    code = compare.main(
        [
            "--ops",
            "page_aligned_decode_alloc_lens,get_last_loc",
            "--impl",
            "xla",
            "--json",
            str(out),
            "--sglang",
            "--no-progress",
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    assert data["summary"]["ok"] == 2 * len(compare.GRIDS["small"])
    assert data["summary"]["MISMATCH"] == 0
    printed = capsys.readouterr().out
    assert "skipped: sglang not importable" in printed and "| op " in printed
    import jspec.kv.req_to_token as r2t

    real = r2t.get_last_loc
    monkeypatch.setattr(r2t, "get_last_loc", lambda *a: real(*a) + 1)
    assert compare.main(["--ops", "get_last_loc", "--impl", "xla", "--no-progress"]) == 1
    with pytest.raises(SystemExit):
        compare.main(["--ops", "no_such_op"])


@pytest.mark.parametrize("impl", ["foo", "xla,foo", ","])
def test_an_unknown_impl_is_a_usage_error(impl, capsys):
    """Not a run of nothing that exits 0 ("total: 0")."""
    with pytest.raises(SystemExit) as exc:
        compare.main(["--ops", "get_last_loc", "--impl", impl, "--no-progress"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--impl={impl!r}: unknown impls" in err and "'pallas'" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rtol", "-1"], "--rtol=-1.0 must be >= 0"),
        (["--atol", "nan"], "--atol=nan must be >= 0"),
        (["--json", "/nonexistent/dir/out.json"], "its directory does not exist"),
    ],
)
def test_bad_flags_are_usage_errors_before_the_run(args, message, capsys, monkeypatch):
    monkeypatch.setattr(compare, "run_compare", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(SystemExit) as exc:
        compare.main(["--ops", "get_last_loc", "--impl", "xla", "--no-progress", *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_an_unwritable_json_is_one_line_and_exit_2(tmp_path, capsys):
    target = tmp_path / "taken"
    target.mkdir()  # a directory where the file should go: open() fails after the run
    code = compare.main(
        ["--ops", "get_last_loc", "--impl", "xla", "--no-progress", "--json", str(target)]
    )
    err = capsys.readouterr().err
    assert (
        code == 2 and err.startswith(f"jspec compare: --json {target}: ") and err.count("\n") == 1
    )


def test_cli_dispatch():
    from jspec.cli import main as cli

    assert (
        cli(
            ["compare", "--ops", "page_aligned_decode_alloc_lens", "--impl", "xla", "--no-progress"]
        )
        == 0
    )


def test_worlds_are_valid():
    rng = np.random.default_rng(0)
    for case in compare.grid_cases("small"):
        w = make_world(case, rng)
        p = case.page_size
        for row, alloc_len in zip(w.req_pool_indices.tolist(), w.allocated.tolist()):
            slots = w.req_to_token[row, :alloc_len]
            pages = (slots // p).reshape(-1, p)
            assert bool((pages == pages[:, :1]).all())  # one physical page per row page
            assert bool((slots % p == np.arange(alloc_len) % p).all())
            assert int(pages.min()) >= 1  # never the padding page
        used = w.req_to_token[w.req_pool_indices].reshape(-1)
        used = used[used != 0]
        assert len(np.unique(used.numpy())) == used.numel()  # no slot shared
