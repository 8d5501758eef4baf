"""examples/own_kv_cache.py: the spec step over a KV cache kept as per-request block tables with
a block allocator written outside jspec (public names only) is lossless against plain greedy
decoding over jspec's paged allocator, and jspec's paged backend is never called on that path."""

from __future__ import annotations

import pathlib
import runpy

import numpy as np
import pytest


@pytest.mark.parametrize(
    "page_size,topk", [(4, 2), (1, 2), (2, 3)], ids=["holey_P4_K2", "P1_K2", "holey_P2_K3"]
)
def test_block_table_kv_backend_is_lossless(monkeypatch, page_size, topk):
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "own_kv_cache.py"
    ns = runpy.run_path(str(path))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 64, n).tolist() for n in (3, 9)]
    kw = {"page_size": page_size, "topk": topk}
    greedy, _ = ns["run"](prompts, 12, spec=False, own_kv=False, **kw)

    from jspec.engine import PagedKVBackend

    def refuse(*args, **kwargs):
        raise AssertionError("jspec's paged KV backend called on the block-table path")

    for method in ("init_state", "prepare_decode", "prepare_prefill", "commit", "release"):
        monkeypatch.setattr(PagedKVBackend, method, refuse)
    spec, accept_lens = ns["run"](prompts, 12, spec=True, own_kv=True, **kw)
    assert spec == greedy
    assert max(accept_lens) > 1
