"""Shared plumbing of the drop-ins (``interop.{kv,tree,attention_meta}.dropin*``).

* :func:`to_jax_default` / :func:`to_torch_as`: the DLPack shim with the drop-ins' defaults.
* :func:`jspec_module`: jspec modules resolved at call time, so tests can monkeypatch an op.
* :func:`run_jspec`: every jspec op a drop-in calls goes through it. With jspec's probe switch
  off it is a plain call (no checkify cost). With probes on (``JSPEC_ENABLE_ASYNC_ASSERT=1`` or
  ``jspec.probes.probes_enabled()``) the op runs under ``jspec.probes.checked`` and a fired probe
  surfaces as an ``AssertionError`` naming the probe and the offending value, which is what
  sglang's own debug checks raise, so PyTorch callers' handlers keep working.
"""

from __future__ import annotations

import enum
import functools
import importlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch

from interop.dlpack import to_jax, to_torch
from jspec.config import TreeGeometry

_STATIC_TYPES = (bool, int, float, str, type(None), enum.Enum, np.dtype, type, TreeGeometry)


def jspec_module(name: str) -> Any:
    """Import a jspec module at call time, so tests can monkeypatch its ops."""
    return importlib.import_module(name)


def tree_geometry(
    *, topk: int, page_size: int, num_steps: int = 1, num_draft_tokens: int = 1
) -> TreeGeometry:
    """The :class:`jspec.config.TreeGeometry` of an sglang call's loose ``topk`` / ``page_size``
    (/ ``num_steps`` / ``num_draft_tokens``) arguments, built at the drop-in boundary.

    A field the sglang function does not take defaults to 1 (a one-step, one-node tree is valid
    for every topk and page size); the op it is passed to does not read it.
    """
    return TreeGeometry(
        topk=topk, num_steps=num_steps, num_draft_tokens=num_draft_tokens, page_size=page_size
    )


def to_jax_default(t: torch.Tensor, what: str) -> jax.Array:
    """A torch tensor as a JAX array on JAX's default device (zero-copy on the same device)."""
    return to_jax(t, what=what, device="default")


def to_torch_as(
    a: jax.Array,
    like: torch.Tensor | None = None,
    dtype: torch.dtype = torch.int64,
    device: Any = None,
) -> torch.Tensor:
    """A JAX result as a torch tensor on ``like``'s device (or ``device``), in ``dtype``."""
    device = like.device if like is not None else device
    return to_torch(a).to(device=device, dtype=dtype)


def _is_static(x: Any) -> bool:
    return isinstance(x, _STATIC_TYPES)


@functools.lru_cache(maxsize=256)
def _bound(fn: Callable[..., Any], static_pos: tuple, static_kw: tuple) -> Callable[..., Any]:
    """``fn`` with its static (hashable, non-array) arguments bound; arrays stay arguments.

    One object per (fn, static arguments): ``probes.checked`` caches on it.
    """
    kw = dict(static_kw)
    statics = dict(static_pos)

    def bound(*dynamic: Any, **dynamic_kw: Any) -> Any:
        it = iter(dynamic)
        n = len(dynamic) + len(statics)
        args = [statics[i] if i in statics else next(it) for i in range(n)]
        return fn(*args, **kw, **dynamic_kw)

    return bound


def _split(args: tuple, kwargs: dict) -> tuple[tuple, tuple, tuple, dict]:
    static_pos = tuple((i, a) for i, a in enumerate(args) if _is_static(a))
    dynamic = tuple(a for a in args if not _is_static(a))
    static_kw = tuple(sorted((k, v) for k, v in kwargs.items() if _is_static(v)))
    dynamic_kw = {k: v for k, v in kwargs.items() if not _is_static(v)}
    return static_pos, dynamic, static_kw, dynamic_kw


def run_jspec(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a jspec op; under jspec's probe switch, checked (a fired probe -> AssertionError)."""
    probes = jspec_module("jspec.probes")
    if not probes.probes_on():
        return fn(*args, **kwargs)
    static_pos, dynamic, static_kw, dynamic_kw = _split(args, kwargs)
    try:
        return probes.checked(_bound(fn, static_pos, static_kw))(*dynamic, **dynamic_kw)
    except probes.ProbeError as err:
        if isinstance(err, AssertionError):
            raise
        raise AssertionError(str(err)) from err
