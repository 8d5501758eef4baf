"""The persistent compilation cache of ``jspec generate`` (issue 25): on by default in the user
cache dir, moved or turned off by ``JSPEC_COMPILATION_CACHE``, off with
``--no-compilation-cache``; a second run in a fresh process loads its compiles from it."""

from __future__ import annotations

from jspec import env
from jspec.apps.compile_cache import cache_dir


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
