"""jspec: speculative-decoding bookkeeping (EAGLE tree drafting over a paged KV cache) in JAX.

The public API, one namespace per concept (each with ``__all__``)::

    jspec.SpecConfig, jspec.BatchBuckets   static configuration (jspec.config)
    jspec.TreeGeometry                     the draft tree's shape, the ops' ``geometry=``
    jspec.kv                               KV pool, page allocator, req_to_token, decode alloc
    jspec.tree                             draft tree expansion, layout, build, verify, accept
    jspec.attention_meta                   FA3 page tables, FlashInfer kv_indices
    jspec.probes                           checkify probes (checked, probes_enabled)
    jspec.sentinels                        padding / missing-node values
    jspec.engine                           the model protocol, jitted spec / greedy steps, Engine
    jspec.models                           HF Llama targets, EAGLE-3 / EAGLE-1 heads, loaders

Sub-packages load on first attribute access, so ``from jspec import SpecConfig`` stays light.
``jspec.kernels`` is internal (ops are called through their concept package with ``impl=``).
"""

from __future__ import annotations

import importlib
from typing import Any

from jspec.config import BatchBuckets, SpecConfig, TreeGeometry

__all__ = [
    "BatchBuckets",
    "SpecConfig",
    "TreeGeometry",
    "attention_meta",
    "engine",
    "kv",
    "models",
    "probes",
    "sentinels",
    "tree",
]
__version__ = "0.1.0"

_SUBMODULES = ("attention_meta", "engine", "kv", "models", "probes", "sentinels", "tree")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"jspec.{name}")
    raise AttributeError(f"module 'jspec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SUBMODULES))
