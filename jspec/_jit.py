"""``jit``: ``jax.jit`` as a decorator that keeps the function's signature for type checkers.

jax (0.10, 0.11) types ``jax.jit``'s result as a wrapper called with ``(*Any, **Any) -> Any``,
so every jitted op would read as untyped to a caller's type checker (and to jspec's own
``make lint``). The object returned is jax's own jitted function; only its static type differs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import jax

_P = ParamSpec("_P")
_R = TypeVar("_R")


def jit(**jit_kwargs: Any) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """``functools.partial(jax.jit, **jit_kwargs)``, typed as the function it wraps."""

    def wrap(fun: Callable[_P, _R]) -> Callable[_P, _R]:
        jitted: Callable[_P, _R] = jax.jit(fun, **jit_kwargs)
        return jitted

    return wrap
