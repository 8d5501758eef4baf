"""The persistent compilation cache of ``jspec generate`` and ``jspec demo`` (issue 25): on by
default in the user cache dir, moved or turned off by ``JSPEC_COMPILATION_CACHE``, off with
``--no-compilation-cache``; a second run in a fresh process loads its compiles from it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from test_cli_input import _model

from jspec import env
from jspec.apps.compile_cache import cache_dir

REPO = Path(__file__).resolve().parents[2]


def test_cache_dir_default_env_and_off(monkeypatch, tmp_path):
    monkeypatch.setattr(env, "USER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(env, "COMPILATION_CACHE", None)
    assert cache_dir() == str(tmp_path / "cache" / "jspec" / "xla")
    assert cache_dir(enabled=False) is None  # --no-compilation-cache
    monkeypatch.setattr(env, "COMPILATION_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == str(tmp_path / "mine")
    for off in ("0", "off", "OFF"):
        monkeypatch.setattr(env, "COMPILATION_CACHE", off)
        assert cache_dir() is None


def _jspec(cache: Path, *argv: str) -> subprocess.CompletedProcess:
    """``jspec *argv`` in a fresh process with its cache in ``cache`` (exit 0 asserted)."""
    proc = subprocess.run(
        [sys.executable, "-m", "jspec.cli", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={
            **os.environ,
            "PYTHONPATH": str(REPO),
            "JAX_PLATFORMS": "cpu",
            "JSPEC_COMPILATION_CACHE": str(cache),
        },
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _generate(model: Path, cache: Path) -> str:
    """``jspec generate`` in a fresh process with its cache in ``cache``; its stderr."""
    argv = ["--model", str(model), "--prompt-ids", "1 2 3", "--max-new-tokens", "3", "--json"]
    return _jspec(cache, "generate", *argv).stderr


def _files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


def test_second_process_loads_the_compiles(tmp_path):
    model, cache = _model(tmp_path), tmp_path / "xla"
    first = _generate(model, cache)
    stored = _files(cache)
    match = re.search(
        r"compiled \[[0-9.]+ s\] \(0 from the compilation cache, (\d+) stored\)", first
    )
    assert match and int(match.group(1)) > 0 and stored, first
    second = _generate(model, cache)
    match = re.search(
        r"compiled \[[0-9.]+ s\] \((\d+) from the compilation cache, 0 stored\)", second
    )
    assert match and int(match.group(1)) > 0, second
    assert _files(cache) == stored  # nothing compiled anew


TINY_DEMO = (
    "--vocab-size 64 --hidden-size 32 --intermediate-size 64 --num-layers 2 --num-heads 4 "
    "--num-kv-heads 2 --head-dim 8 --num-prompts 1 --max-new-tokens 4 --max-running 1 "
    "--temperature 0 --no-progress"
).split()


def test_demo_second_process_loads_the_compiles(tmp_path):
    cache = tmp_path / "xla"
    first = _jspec(cache, "demo", *TINY_DEMO).stdout
    match = re.search(r"\] \(0 from the compilation cache, (\d+) stored\)", first)
    assert match and int(match.group(1)) > 0 and "lossless check: PASS" in first, first
    stored = _files(cache)
    second = _jspec(cache, "demo", *TINY_DEMO).stdout
    match = re.search(r"\] \((\d+) from the compilation cache, 0 stored\)", second)
    assert match and int(match.group(1)) > 0 and "lossless check: PASS" in second, second
    assert _files(cache) == stored
    off = _jspec(cache, "demo", *TINY_DEMO, "--no-compilation-cache").stdout
    assert "from the compilation cache" not in off and "lossless check: PASS" in off, off
