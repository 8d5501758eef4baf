"""The README quick start (examples/quickstart.py) runs and gives SPEC.md §14's numbers."""

from __future__ import annotations

import pathlib
import runpy

import numpy as np


def test_quickstart_matches_worked_example(capsys) -> None:
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"
    ns = runpy.run_path(str(path))
    assert bool(ns["ok"])
    np.testing.assert_array_equal(ns["reqs"].allocated_lens, [40])  # nxt = ceil4(7 + 32)
    rows = np.asarray(ns["rows"])[1]
    np.testing.assert_array_equal(ns["out_cache_loc"][0], rows[[[7, 8, 9], [15, 16, 17]]])
    np.testing.assert_array_equal(ns["seqlens"], [5, 5])
    np.testing.assert_array_equal(ns["page_table"][:, :2], rows[[[7, 8], [15, 16]]] // 4)
    # Branch 1's holes (positions 12..14) carry the prefix tail's draft KV (positions 4..6).
    pool = ns["draft_pool"]
    assert np.all(np.asarray(pool.k[:, rows[4:7]]) != 0)  # real (random) prefix KV, not zeros
    np.testing.assert_array_equal(pool.k[:, rows[12:15]], pool.k[:, rows[4:7]])


def test_quickstart_uses_only_public_names() -> None:
    import ast
    import importlib

    import jspec

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"
    module = ast.parse(path.read_text())
    namespaces = {}
    for node in ast.walk(module):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jspec"):
            assert node.module == "jspec", f"import from the top-level namespace: {node.module}"
            for alias in node.names:
                assert alias.name in jspec.__all__, alias.name
                namespaces[alias.asname or alias.name] = getattr(jspec, alias.name)
    used = [
        (node.value.id, node.attr)
        for node in ast.walk(module)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in namespaces
        and hasattr(namespaces[node.value.id], "__all__")
    ]
    assert used
    private = [
        f"{ns}.{attr}"
        for ns, attr in used
        if attr not in importlib.import_module(namespaces[ns].__name__).__all__
    ]
    assert not private, private
