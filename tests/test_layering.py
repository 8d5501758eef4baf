"""Layering: jspec's modules import downward only, with no cycle between layers.

Walks every module under ``jspec/`` with ``ast`` (module-level, function-level and
``TYPE_CHECKING`` imports alike: a type import upward is still an upward dependency)::

    jspec.cli, jspec.apps  ->  jspec.models  ->  jspec.engine  ->  jspec.tree, jspec.attention_meta
      ->  jspec.kv  ->  jspec.kernels  ->  jspec.probes, jspec.config, jspec.env, jspec.sentinels,
          jspec._*  (the bottom layer)

A module may import its own layer or any layer below. Within one layer, the packages must not
import each other in a cycle (e.g. tree <-> attention_meta). jspec never imports ``interop`` or
``bench``. Layers not written yet (jspec.apps, jspec.models) are allowed; a new top-level
module of jspec must be given a layer here.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "jspec"

# Rank of every unit (package or top-level module); higher is upper.
LAYERS: dict[str, int] = {
    "jspec.cli": 6,
    "jspec.apps": 6,
    "jspec.models": 5,
    "jspec.engine": 4,
    "jspec.tree": 3,
    "jspec.attention_meta": 3,
    "jspec.kv": 2,
    "jspec.kernels": 1,
    "jspec.probes": 0,
    "jspec.config": 0,
    "jspec.env": 0,
    "jspec.sentinels": 0,
}
BOTTOM_PRIVATE_RANK = 0  # jspec._pytree, jspec._layout, jspec._compact, ...
FORBIDDEN_TOP = ("interop", "bench")
# No exceptions: `jspec compare` names its module as a string in jspec.cli.COMMANDS and loads
# the (packaged) interop only when that command runs; bench is never imported.
ALLOWED: set[tuple[str, str]] = set()


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _unit(module: str) -> str | None:
    """The layer unit of a jspec module: ``jspec.<first part>`` (None for ``jspec`` itself)."""
    parts = module.split(".")
    return None if len(parts) < 2 else ".".join(parts[:2])


def _rank(unit: str) -> int:
    if unit in LAYERS:
        return LAYERS[unit]
    if unit.split(".")[1].startswith("_"):
        return BOTTOM_PRIVATE_RANK
    raise KeyError(unit)


def _imports(path: pathlib.Path, module: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement of the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((target, node.lineno))
            # ``from jspec import kv`` imports the sub-package jspec.kv.
            if target == "jspec":
                out += [(f"jspec.{alias.name}", node.lineno) for alias in node.names]
    return out


def _all_imports() -> list[tuple[str, str, str, int]]:
    """(importer module, imported module, file, line) over every jspec module."""
    rows = []
    for path in sorted(PKG.rglob("*.py")):
        module = _module_name(path)
        for target, line in _imports(path, module):
            rows.append((module, target, str(path.relative_to(ROOT)), line))
    return rows


def test_every_unit_has_a_layer():
    units = {_unit(_module_name(p)) for p in PKG.rglob("*.py")} - {None}
    missing = []
    for unit in sorted(units):
        try:
            _rank(unit)
        except KeyError:
            missing.append(unit)
    assert not missing, f"give these jspec units a layer in LAYERS: {missing}"


def test_no_upward_import():
    bad = []
    for module, target, where, line in _all_imports():
        unit, target_unit = _unit(module), _unit(target)
        if unit is None or not target.startswith("jspec.") or target_unit == unit:
            continue  # jspec/__init__.py re-exports everything; imports inside one unit
        if _rank(target_unit) > _rank(unit):
            bad.append(
                f"{where}:{line}: {module} ({_rank(unit)}) imports {target} ({_rank(target_unit)})"
            )
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_cycle_between_units():
    graph: dict[str, set[str]] = {}
    for module, target, _, _ in _all_imports():
        unit, target_unit = _unit(module), _unit(target)
        if unit and target.startswith("jspec.") and target_unit != unit:
            graph.setdefault(unit, set()).add(target_unit)

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cycles = sorted(u for u in graph if u in reach(u))
    assert not cycles, f"import cycle through {cycles}: { ({u: sorted(graph[u]) for u in cycles}) }"


def test_jspec_never_imports_interop_or_bench():
    bad = [
        f"{where}:{line}: {module} imports {target}"
        for module, target, where, line in _all_imports()
        if target.split(".")[0] in FORBIDDEN_TOP and (module, target.split(".")[0]) not in ALLOWED
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "source, message",
    [
        ("from jspec.tree.build import x\n", "upward"),
        ("from jspec.kv import pool\n", "upward"),
        ("if TYPE_CHECKING:\n    from jspec.kv.pool import KVPool\n", "upward"),
    ],
)
def test_walker_sees_upward_imports(tmp_path, source, message):
    """The walker itself: a kernels module importing kv/tree is reported (mutation check)."""
    path = tmp_path / "fake.py"
    path.write_text(source)
    targets = [t for t, _ in _imports(path, "jspec.kernels.fake")]
    assert any(_rank(_unit(t)) > _rank("jspec.kernels") for t in targets), message
