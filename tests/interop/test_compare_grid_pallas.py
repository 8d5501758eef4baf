"""The small comparison grid (CI): every op with a Pallas kernel (interpret mode on CPU), and
the raw Triton kernels when a GPU is present."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from interop import compare
from interop.registry import REGISTRY


def _run(impl):
    ops = [op for op in REGISTRY if impl in op.impls]
    rows = compare.run_compare(compare.grid_cases("small"), ops, [impl], progress=False)
    bad = [r for r in rows if r["status"] != "ok"]
    assert not bad, compare.report(bad)
    return rows


def test_small_grid_pallas():
    rows = _run("pallas")
    assert len(rows) == sum("pallas" in op.impls for op in REGISTRY) * len(compare.GRIDS["small"])


@pytest.mark.gpu
def test_small_grid_triton():
    if not compare._on_gpu():
        pytest.skip("impl='triton' needs a JAX GPU backend")
    _run("triton")
