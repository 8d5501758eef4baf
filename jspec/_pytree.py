"""Registered frozen dataclasses: the one way jspec declares state pytrees.

Array fields are pytree children; fields declared with :func:`static_field` are part of the
treedef (hashable, static under ``jax.jit``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, dataclass_transform

import jax
import jax.numpy as jnp

T = TypeVar("T")


def static_field(**kwargs: Any) -> Any:
    """A dataclass field that is static (part of the treedef, not a leaf)."""
    return dataclasses.field(metadata={"static": True}, **kwargs)


# NOTE: dataclass_transform tells type checkers the decorated class is a frozen dataclass
# (its generated __init__, its fields, static_field among the field specifiers).
@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, static_field))
def pytree_dataclass(cls: type[T]) -> type[T]:
    """``@dataclass(frozen=True)`` + ``jax.tree_util.register_dataclass``."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    return jax.tree_util.register_dataclass(cls)


replace = dataclasses.replace


def tree_where(ok: jax.Array, new: T, old: T) -> T:
    """``new`` where ``ok`` (bool[]) else ``old``, leaf by leaf: an all-or-nothing state
    transition without ``lax.cond``. ``new`` and ``old`` have one tree structure."""
    return jax.tree.map(lambda x, y: jnp.where(ok, x, y), new, old)
