"""bench/checkpoint_run.py on CPU (issues 13, 25): the quick geometry's random bf16 weights
written as safetensors directories, then ``jspec generate`` subprocesses from them: cold greedy
and spec; the bench part, a warm compilation cache and a prompts file (greedy, to keep the CPU
time down: each spec batch bucket compiles three round kinds).

The quick head is matched to its target (``bench.real_size.make_params``), and spec decoding is
lossless by construction (verify takes the target's argmax), so spec's ids equal greedy's."""

from __future__ import annotations

import json

from bench.checkpoint_run import (
    COLUMNS,
    PROMPTS_COLUMNS,
    main,
    make_prompts,
    same_as,
    same_count,
)

NEW = 8
QUICK = ["--geometry", "quick", "--max-new-tokens", str(NEW), "--prompt-len", "16"]


def test_quick_checkpoint_greedy_and_spec_agree(tmp_path):
    out = tmp_path / "checkpoint_run.md"
    rows = main([*QUICK, "--parts", "cold", "--dir", str(tmp_path / "ckpt"), "--out", str(out)])
    greedy, spec = rows
    assert [r["mode"] for r in rows] == ["greedy", "spec"]
    assert [r["run"] for r in rows] == ["cold", "cold"]
    assert not greedy["error"] and not spec["error"], rows
    assert len(greedy["token_ids"]) == len(spec["token_ids"]) == NEW
    assert spec["token_ids"] == greedy["token_ids"] and spec["spec == greedy"] == "yes"
    assert 1.0 <= spec["accept len"] <= 4.0 and greedy["accept len"] == 1.0
    assert spec["bytes on disk"] > greedy["bytes on disk"] > 0
    assert all(isinstance(r["compile s"], float) and r["process wall s"] > 0 for r in rows)
    assert all(r["cache"] == "" for r in rows)  # --no-compilation-cache
    for r in rows:  # launch -> first token: after the load and the compile (which overlap)
        assert max(r["load s"], r["compile s"]) < r["start s"] < r["process wall s"], r
        assert r["decode tok/s"] > 0 and r["total tok/s"] > 0 and r["ttft s"] >= 0
    assert list((tmp_path / "ckpt").iterdir()) == []  # the directories are removed (no --keep)
    assert "| " + " | ".join(COLUMNS) + " |" in out.read_text()


def test_quick_bench_warm_cache_and_prompts_file(tmp_path):
    """Parts bench, warm and prompts (greedy): the second invocation loads every compile from
    the cache; 6 prompts of mixed lengths at --max-running 2 give each request's ids alone."""
    out = tmp_path / "checkpoint_run.md"
    flags = ["--parts", "bench,warm,prompts", "--modes", "greedy", "--prompts-modes", "greedy"]
    flags += ["--num-prompts", "6", "--max-running", "2", "--out", str(out)]
    rows = main([*QUICK, *flags, "--dir", str(tmp_path / "ckpt")])
    by_run = {r["run"]: r for r in rows}
    assert list(by_run) == ["bench 1st", "bench", "fill", "warm", "batched", "alone"], rows
    assert not any(r["error"] for r in rows), rows
    first, bench, fill, warm = (by_run[k] for k in ("bench 1st", "bench", "fill", "warm"))
    # The writer's engine on the in-memory params and generate on the written checkpoint.
    assert first["token_ids"] == bench["token_ids"] == fill["token_ids"] == warm["token_ids"]
    assert len(warm["token_ids"]) == NEW and bench["decode tok/s"] > 0
    assert isinstance(first["compile s"], float)
    for r in (fill, warm):
        assert r["bench decode tok/s"] == bench["decode tok/s"]
        assert isinstance(r["vs bench %"], float)
    # The fill run stores every compile, the warm run stores none and hits them all.
    hits, stored = map(int, fill["cache"].split("/"))
    assert hits == 0 and stored > 0, fill
    assert warm["cache"] == f"{stored}/0", warm
    assert isinstance(warm["start s"], float) and 0 < warm["start s"] < warm["process wall s"]
    assert warm["start s"] < fill["start s"] and warm["compile s"] < fill["compile s"]

    batched, alone = by_run["batched"], by_run["alone"]
    requests = make_prompts(6, 16, NEW, 128)
    expected = sum(r.get("max_new_tokens", NEW) for r in requests)
    assert (batched["max running"], alone["max running"]) == (2, 1)
    assert batched["prompts"] == alone["prompts"] == 6
    assert batched["tokens"] == alone["tokens"] == expected
    assert batched["same as alone"] == "6/6"
    assert batched["total tok/s"] > 0 and batched["decode tok/s"] > 0
    assert 0 <= batched["ttft mean s"] <= batched["ttft max s"]
    # The alone engine is the single-prompt run's: all of it from part warm's cache.
    assert alone["cache"].endswith("/0") and int(alone["cache"].split("/")[0]) > 0, alone

    text = out.read_text()
    assert "| " + " | ".join(COLUMNS) + " |" in text
    assert "| " + " | ".join(PROMPTS_COLUMNS) + " |" in text
    saved = json.loads((tmp_path / "checkpoint_run.md.json").read_text())
    assert [r["run"] for r in saved["rows"]] == list(by_run)


def test_make_prompts():
    requests = make_prompts(64, 128, 64, 32000)
    lengths = [len(r["prompt_ids"]) for r in requests]
    assert lengths[0] == 128 and "max_new_tokens" not in requests[0]
    assert min(lengths) >= 16 and max(lengths) == 128 and len(set(lengths)) > 10
    own = [r["max_new_tokens"] for r in requests if "max_new_tokens" in r]
    assert 4 <= len(own) <= 32 and all(16 <= n <= 64 for n in own)
    assert all(0 <= i < 32000 for r in requests for i in r["prompt_ids"])
    assert make_prompts(64, 128, 64, 32000) == requests  # seeded


def test_same_as():
    assert same_as([1, 2, 3], [1, 2, 3]) == "yes"
    assert same_as([1, 5, 3], [1, 2, 3]) == "no (1/3 leading agree)"
    assert same_as([1, 2], [1, 2, 3]) == "no (2/3 leading agree)"
    assert same_count([[1], [2, 3], [4]], [[1], [2, 4], [4]]) == "2/3"
