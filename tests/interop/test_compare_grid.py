"""The small comparison grid (CI): every op, jspec's XLA impl vs the PyTorch references."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from interop import compare
from interop.registry import REGISTRY


def _assert_all_ok(rows):
    bad = [r for r in rows if r["status"] not in ("ok",)]
    assert not bad, compare.report(bad)


def test_small_grid_xla():
    rows = compare.run_compare(compare.grid_cases("small"), REGISTRY, ["xla"], progress=False)
    assert len(rows) == len(REGISTRY) * len(compare.GRIDS["small"])
    _assert_all_ok(rows)
