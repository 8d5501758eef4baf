"""examples/foreign_attention.py: the spec step driven through an attention backend written
outside jspec (page-by-page gather in plain JAX, public names only) is lossless, and jspec's own
attention op is never called on that path."""

from __future__ import annotations

import pathlib
import runpy

import numpy as np


def test_foreign_attention_backend_is_lossless(monkeypatch):
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "foreign_attention.py"
    ns = runpy.run_path(str(path))
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 64, n).tolist() for n in (3, 9)]
    greedy, _ = ns["run"](prompts, 10, spec=False)

    import jspec.engine.attention as attention

    def refuse(*args, **kwargs):
        raise AssertionError("jspec's paged_attention called on the foreign-backend path")

    monkeypatch.setattr(attention, "paged_attention", refuse)
    spec, stats = ns["run"](prompts, 10, backend=ns["PageGatherBackend"]())
    assert spec == greedy
    assert stats.leak_check.startswith("ok")
    assert max(stats.accept_lens) > 1
