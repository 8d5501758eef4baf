"""The apps' tests run ``main`` in this process: keep the persistent compilation cache off there
(it is process-wide in JAX, and would land in the user's cache dir); the cache's own test turns
it on in subprocesses."""

from __future__ import annotations

import pytest

from jspec import env


@pytest.fixture(autouse=True)
def _no_compilation_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(env, "COMPILATION_CACHE", "off")
