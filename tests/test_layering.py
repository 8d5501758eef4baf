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

Over jspec and interop together, module by module: no import circle (``a`` imports ``b``, which
imports ``a``, even lazily inside a function), and no private name across packages: a module of
one unit (``jspec.<X>``, or ``interop``) never imports a ``_name`` module or symbol that lives in
another unit (``jspec.<Y>._private``, ``jspec.<Y>.mod._fn``; interop -> anything private in
jspec, and ``jspec.kernels`` as a whole). jspec's own bottom modules ``jspec._*`` serve all of
jspec, not interop. interop's
call-time module names (``jspec_module("jspec.kv.pool")``, ``"module:function"`` strings) count
as imports.
"""

from __future__ import annotations

import ast
import pathlib
import re

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
# Private imports across units, by (importer module, imported module).
ALLOWED_PRIVATE: set[tuple[str, str]] = set()
TOPS = ("jspec", "interop")  # the packages walked module by module
INTERNAL = "jspec.kernels"  # private to jspec as a whole (ops are public through their concept)
# A string naming a jspec module (interop's call-time imports): "jspec.kv.pool[:function]".
MODULE_STRING = re.compile(r"^(jspec(?:\.[A-Za-z_]\w*)+)(?::([A-Za-z_]\w*))?$")


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


def _modules() -> dict[str, pathlib.Path]:
    """Every module of jspec and interop, by dotted name."""
    return {_module_name(p): p for top in TOPS for p in sorted((ROOT / top).rglob("*.py"))}


MODULES = _modules()


def _references(
    path: pathlib.Path, module: str, *, strings: bool = False
) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) for every import of the file, at any depth.

    ``from m import a`` gives ``(m.a, None)`` when ``m.a`` is a module, else ``(m, "a")``;
    with ``strings``, a string constant naming a jspec module counts as well.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[str, str | None, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append(
                    (sub, None, node.lineno)
                    if sub in MODULES
                    else (target, alias.name, node.lineno)
                )
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = MODULE_STRING.match(node.value)
            if match:
                out.append((match.group(1), match.group(2), node.lineno))
    return out


def _imports(path: pathlib.Path, module: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement of the file."""
    return [(target, line) for target, _, line in _references(path, module)]


def _all_imports() -> list[tuple[str, str, str, int]]:
    """(importer module, imported module, file, line) over every jspec module."""
    rows = []
    for path in sorted(PKG.rglob("*.py")):
        module = _module_name(path)
        for target, line in _imports(path, module):
            rows.append((module, target, str(path.relative_to(ROOT)), line))
    return rows


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every node reachable from ``start`` in one or more steps."""
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


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

    cycles = sorted(u for u in graph if u in _reach(graph, u))
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


# ---- module by module: circles and private names ----------------------------------------------
def _module_graph() -> dict[str, set[str]]:
    """Module -> the jspec / interop modules it imports (the longest known prefix of each)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        edges = graph.setdefault(module, set())
        for target, _, _ in _references(path, module):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != module:
                edges.add(target)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that reach themselves, grouped by the circle they share."""
    reached = {module: _reach(graph, module) for module in graph}
    groups = {
        frozenset(m for m in reached[module] if module in reached[m])
        for module in graph
        if module in reached[module]
    }
    return sorted(sorted(group) for group in groups)


def _owner(module: str) -> str:
    """The unit a module belongs to for privacy: ``jspec.<first part>``, or the top package."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "jspec" and len(parts) > 1 else parts[0]


def _private_crossing(module: str, target: str, name: str | None) -> bool:
    """``module`` imports a private (``_name``, not dunder) module or name of another unit."""
    top, target_top = module.split(".")[0], target.split(".")[0]
    if target_top not in TOPS or _owner(target) == _owner(module):
        return False
    if top != "jspec" and _owner(target) == INTERNAL:
        return True
    # Inside jspec the bottom modules jspec._* are shared; from interop nothing private is.
    parts = target.split(".")[2 if top == target_top == "jspec" else 1 :] + [name] * bool(name)
    return any(part.startswith("_") and not part.startswith("__") for part in parts)


def test_no_import_circle():
    circles = _circles(_module_graph())
    assert not circles, f"import circles (move the shared pieces into the lower module): {circles}"


def test_no_private_import_across_packages():
    bad = []
    for module, path in MODULES.items():
        for target, name, line in _references(path, module, strings=True):
            if (module, target) in ALLOWED_PRIVATE or not _private_crossing(module, target, name):
                continue
            where = path.relative_to(ROOT)
            bad.append(f"{where}:{line}: {module} imports {target}{'.' + name if name else ''}")
    assert not bad, "private names across packages:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "module, target, name, private",
    [
        ("jspec.tree.build", "jspec.kernels._common", None, True),
        ("jspec.tree.build", "jspec.kernels.build_tree", "_build_tree_pallas", True),
        ("interop.kv.dropin", "jspec.kernels._common", "next_power_of_2", True),
        ("interop.kv.dropin", "jspec._pytree", None, True),
        ("interop.triton_meta", "jspec.kernels.triton_meta", "get_kernel", True),
        ("jspec.kv.pool", "jspec.kernels.move_kv_cache", "move_kv_cache", False),
        ("jspec.kv.pool", "interop._adapt", None, True),
        ("jspec.kv.pool", "jspec._pytree", None, False),  # jspec's shared bottom modules
        ("jspec.kv.allocator", "jspec.kv._freelist", None, False),  # inside one unit
        ("interop.kv.dropin", "interop._adapt", "run_jspec", False),
        ("interop.kv.dropin", "jspec.kv.pool", "move_kv_cache", False),
        ("interop.kv.dropin", "jspec", "__version__", False),
    ],
)
def test_walker_sees_private_crossings(module, target, name, private):
    """The privacy rule itself, on named cases (mutation check)."""
    assert _private_crossing(module, target, name) == private


def test_walker_sees_circles(tmp_path):
    """Circles through lazy and TYPE_CHECKING imports are found; a chain is not a circle."""
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from jspec.kernels import move_kv_cache\n")
    typed = tmp_path / "typed.py"
    typed.write_text("if TYPE_CHECKING:\n    from jspec.kv.allocator import PagedAllocator\n")
    assert _references(lazy, "jspec.kernels.x")[0][:2] == ("jspec.kernels.move_kv_cache", None)
    assert _references(typed, "jspec.kv.y")[0][:2] == ("jspec.kv.allocator", "PagedAllocator")
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_importing_jspec_loads_no_triton():
    """Triton loads only when a Triton kernel is first launched: CPU test runs must set
    ``TRITON_INTERPRET`` before triton's first import (``tests/triton_interpret.py``), and an
    install without a GPU stack imports every public package. A kernel module imported at a
    package's top (``jspec.kv`` importing ``kernels.kv_write_triton``) fails this."""
    import subprocess
    import sys

    code = (
        "import sys, jspec, jspec.kv, jspec.tree, jspec.attention_meta, jspec.engine, "
        "jspec.models, jspec.apps.serving; "
        "assert 'triton' not in sys.modules, sorted(m for m in sys.modules if 'triton' in m)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
