"""The drop-ins under jspec's probe switch: a fired probe is an AssertionError naming the probe and
the value (what sglang's debug checks raise); with probes off no checkify runs at all."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from interop import compare
from interop import torch_api as api
from interop._world import Case
from interop.registry import REGISTRY
from jspec import probes

I64 = torch.int64
CASE = Case(page_size=4, topk=2, num_steps=3, batch=2)


def _t(x, dtype=I64):
    return torch.tensor(x, dtype=dtype)


def _alloc():
    return api.PagedTokenToKVPoolAllocator(32, 4, torch.float32, "cpu", None, False)


def test_planted_double_free_is_an_assertion_naming_probe_and_page():
    a = _alloc()
    row = a.alloc(8)
    a.free(row[:4])
    with probes.probes_enabled(), pytest.raises(AssertionError, match="double free of page 1"):
        a.free(row[:4])


def test_planted_invalid_tree_is_an_assertion_under_probes():
    """sglang prints a warning and drops the node; under jspec probes the debug run stops."""
    args = (_t([7]), _t([[-1, 0, 1, 2, 3]]), _t([[2, 0, 5]]), _t([[1, 2, 3]]), _t([5]), 5, 2, 3, 4)
    with probes.probes_enabled(), pytest.raises(AssertionError, match="invalid eagle tree"):
        api.build_tree_kernel_efficient(*args)
    assert api.build_tree_kernel_efficient(*args)[3].tolist() == [[2, -1, 1, -1]]  # probes off


@pytest.mark.parametrize("n_pages", [1, 2, 3])
def test_single_and_few_page_frees_under_probes(n_pages):
    """No padding floor in the drop-in: a free of one page traces with probes on and still names
    a planted double free."""
    a = _alloc()
    row = a.alloc(4 * n_pages)
    with probes.probes_enabled():
        a.free_page_ids(torch.unique(row // 4))
        assert a.available_size() == 32
        with pytest.raises(AssertionError, match=f"double free of page {int(row[0]) // 4}"):
            a.free_page_ids(torch.unique(row // 4)[:1])
        row = a.alloc(4 * n_pages)
        a.free(row[:1])
        assert a.available_size() == 32 - 4 * (n_pages - 1)


def test_probes_off_never_checkify(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("probes.checked ran with probes off")

    monkeypatch.setattr(probes, "checked", boom)
    a = _alloc()
    slots = a.alloc_extend(_t([0]), _t([0]), _t([5]), _t([5]), _t([-1]), 5)
    a.free_segment(slots, start_pos=0)
    a.free_group_begin()
    a.free(a.alloc(4))
    a.free_group_end()
    out = api.build_tree_kernel_efficient(
        _t([7]), _t([[-1, 0, 1, 2, 3]]), _t([[0, 1, 3]]), _t([[1, 2, 3]]), _t([5]), 5, 2, 3, 4
    )
    assert out[3].tolist() == [[1, 3, -1, -1]] and a.available_size() == 32


@pytest.mark.parametrize("name", [op.name for op in REGISTRY])
def test_every_registry_op_runs_with_probes_on(name):
    """Valid inputs: the same outputs as the references with every jspec call checked."""
    op = next(o for o in REGISTRY if o.name == name)
    with probes.probes_enabled():
        (row,) = compare.run_compare([CASE], [op], ["xla"], seed=7, progress=False)
    assert row["status"] == "ok", compare.report([row])


@pytest.mark.parametrize(
    "parents,sel,nxt",
    [
        ([-1, 0, 1, 2, 3], [2, 0], [2, -1, 1]),  # a descending chain: node 1's parent is node 2
        ([-1, 0, 1, 2, 3], [6, 2, 0], [3, -1, 1, 2]),  # the deepest descending chain (S=3)
    ],
    ids=["valid_chain", "max_valid_depth"],
)
def test_trees_sglang_builds_pass_under_probes(parents, sel, nxt):
    """Issue 22: probes on rejected descending selections sglang builds normally (jspec's own
    stricter rule); under the drop-in the probe follows sglang's definition."""
    n = len(sel) + 1
    args = (_t([7]), _t([parents]), _t([sel]), _t([sel]), _t([5]), 5, 2, 3, n)
    with probes.probes_enabled():
        out = api.build_tree_kernel_efficient(*args)
    assert out[3].tolist() == [nxt]
    assert out[3].tolist() == api.build_tree_kernel_efficient(*args)[3].tolist()  # probes off
