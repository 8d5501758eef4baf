"""The one registry of interop ops, by sglang name: reference, drop-in and comparison.

Every entry is an :class:`interop._world.Op`: ``name`` (sglang's), ``run`` (the comparison:
``(world, rng, impl) -> (reference outputs, jspec outputs, inputs)``), ``impls``, ``requires``,
``reference`` (the PyTorch reference) and ``dropin`` (jspec behind sglang's signature, None where
sglang has no such function any more). The ops live beside jspec's packages:
:mod:`interop.kv.compare`, :mod:`interop.tree.compare`, :mod:`interop.attention_meta.compare`.
"""

from __future__ import annotations

from interop._world import Op
from interop.attention_meta.compare import OPS as _ATTENTION_META_OPS
from interop.kv.compare import OPS as _KV_OPS
from interop.tree.compare import OPS as _TREE_OPS

REGISTRY: tuple[Op, ...] = _KV_OPS + _TREE_OPS + _ATTENTION_META_OPS


def op(name: str) -> Op:
    """The registry entry of one op (sglang name); KeyError naming the known ones."""
    for entry in REGISTRY:
        if entry.name == name:
            return entry
    raise KeyError(f"unknown op {name!r}; known: {[e.name for e in REGISTRY]}")
