"""Every JAX matmul in jspec states its precision (no test sets a global default to hide one).

The GPU's default f32 matmul is TF32 (~1e-3); f32 models and the kernels' references must ask for
``HIGHEST`` where they mean it (``jspec.engine.protocol.matmul_precision``). Walks jspec's AST:
every ``dot`` / ``matmul`` / ``einsum`` / ``dot_general`` call passes ``precision=``, except the
listed ones, and no ``a @ b`` (whose precision cannot be stated) appears in code.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MATMULS = ("dot", "matmul", "einsum", "dot_general", "tensordot")
# (file, function called): why the default precision is exact there.
EXEMPT = {
    # 0/1 adjacency squared with an f32 accumulator: exact in TF32 and bf16 alike.
    ("jspec/kernels/build_tree.py", "dot"),
    # Triton's tl.dot in the raw kernel: input_precision="ieee" on the f32 path, stated there.
    ("jspec/kernels/paged_attention_triton.py", "dot"),
}


def _matmuls(source: str) -> list[tuple[int, str, bool]]:
    """(line, function or "@", passes precision=) for every matmul of a source file."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            out.append((node.lineno, "@", False))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in MATMULS:
                stated = any(k.arg == "precision" for k in node.keywords)
                out.append((node.lineno, node.func.attr, stated))
    return out


def test_every_jspec_matmul_states_its_precision():
    bad = []
    for path in sorted((ROOT / "jspec").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        for line, fn, stated in _matmuls(path.read_text()):
            if not stated and (where, fn) not in EXEMPT:
                bad.append(f"{where}:{line}: {fn} without precision=")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "source, flagged",
    [
        ("jnp.matmul(a, b)\n", True),
        ("jax.lax.dot_general(a, b, dims)\n", True),
        ("a @ b\n", True),
        ("jnp.einsum('ij,jk->ik', a, b, precision=hp)\n", False),
    ],
)
def test_walker_flags_unstated_precision(source, flagged):
    assert any(not stated for _, _, stated in _matmuls(source)) == flagged
