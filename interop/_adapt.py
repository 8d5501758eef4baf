"""Shared plumbing of the torch adapters (:mod:`interop.torch_api`, ``torch_api_*``)."""

from __future__ import annotations

import importlib
from typing import Any

import jax
import torch

from interop.dlpack import to_jax, to_torch


def jspec_module(name: str) -> Any:
    """Import a jspec module at call time, so tests can monkeypatch its ops."""
    return importlib.import_module(name)


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
