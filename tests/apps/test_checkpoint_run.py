"""bench/checkpoint_run.py on CPU (issue 13): the quick geometry's random bf16 weights written
as safetensors directories, then ``jspec generate`` subprocesses from them, greedy and spec.

The quick head is matched to its target (``bench.real_size.make_params``), and spec decoding is
lossless by construction (verify takes the target's argmax), so spec's ids equal greedy's."""

from __future__ import annotations

from bench.checkpoint_run import COLUMNS, main, same_as

NEW = 8


def test_quick_checkpoint_greedy_and_spec_agree(tmp_path):
    out = tmp_path / "checkpoint_run.md"
    flags = ["--geometry", "quick", "--max-new-tokens", str(NEW), "--prompt-len", "16"]
    rows = main([*flags, "--dir", str(tmp_path / "ckpt"), "--out", str(out)])
    greedy, spec = rows
    assert [r["mode"] for r in rows] == ["greedy", "spec"]
    assert not greedy["error"] and not spec["error"], rows
    assert len(greedy["token_ids"]) == len(spec["token_ids"]) == NEW
    assert spec["token_ids"] == greedy["token_ids"] and spec["spec == greedy"] == "yes"
    assert 1.0 <= spec["accept len"] <= 4.0 and greedy["accept len"] == 1.0
    assert spec["bytes on disk"] > greedy["bytes on disk"] > 0
    assert all(isinstance(r["compile s"], float) and r["process wall s"] > 0 for r in rows)
    assert list((tmp_path / "ckpt").iterdir()) == []  # the directories are removed (no --keep)
    assert "| " + " | ".join(COLUMNS) + " |" in out.read_text()


def test_same_as():
    assert same_as([1, 2, 3], [1, 2, 3]) == "yes"
    assert same_as([1, 5, 3], [1, 2, 3]) == "no (1/3 leading agree)"
    assert same_as([1, 2], [1, 2, 3]) == "no (2/3 leading agree)"
