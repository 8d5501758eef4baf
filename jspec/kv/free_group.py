"""sglang ``free_group_begin`` / ``free_group_end`` over the functional allocator (SPEC.md §10).

Host-side and mutable, unlike the rest of :mod:`jspec.kv`: a group collects slot ids and releases
them with one :func:`jspec.kv.allocator.free` call.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jspec.kv.allocator import PagedAllocator, free

__all__ = ["FreeGroup"]


class FreeGroup:
    """sglang ``free_group_begin`` / ``free_group_end``: defer frees, release them in one batch.

    Host-side and mutable (not a pytree). ``end`` runs one :func:`free` over the concatenation of
    everything added, so pages freed several times inside the group are released once.

    Example::

        group = FreeGroup(); group.begin(); group.add(slots_a); group.add(slots_b, valid_b)
        a = group.end(a)
    """

    def __init__(self) -> None:
        self._active = False
        self._slot_ids: list[Any] = []
        self._valid: list[Any] = []

    @property
    def active(self) -> bool:
        return self._active

    def begin(self) -> None:
        """Start a group; raises ``RuntimeError`` if one is already open (no nesting)."""
        if self._active:
            raise RuntimeError("free_group_begin: nested free groups are not allowed")
        self._active = True
        self._slot_ids, self._valid = [], []

    def add(self, slot_ids: jax.Array, valid: jax.Array | None = None) -> None:
        """Defer ``free(slot_ids, valid=valid)`` to :meth:`end` (slot_ids: i32[M])."""
        if not self._active:
            raise RuntimeError("FreeGroup.add outside free_group_begin/end")
        slot_ids = jnp.asarray(slot_ids, jnp.int32).reshape(-1)
        self._slot_ids.append(slot_ids)
        self._valid.append(
            jnp.ones(slot_ids.shape, bool)
            if valid is None
            else jnp.asarray(valid, bool).reshape(-1)
        )

    def end(self, a: PagedAllocator, *, return_ok: bool = False) -> Any:
        """Close the group and free everything added, in one :func:`free` call.

        All or nothing, as :func:`free`: one bad slot (page 0, out of range, already free)
        frees nothing. ``return_ok=True`` returns ``(a', ok: bool[])`` so the caller sees it.
        """
        if not self._active:
            raise RuntimeError("free_group_end without free_group_begin")
        self._active = False
        slot_ids, valid = self._slot_ids, self._valid
        self._slot_ids, self._valid = [], []
        if not slot_ids:
            return (a, jnp.asarray(True)) if return_ok else a
        return free(a, jnp.concatenate(slot_ids), valid=jnp.concatenate(valid), return_ok=return_ok)
