"""Probes: checkify checks standing in for sglang's async device asserts (SPEC.md §11).

Two kinds of check live here:

* **Static checks** (always on): shapes, widths and buffer capacities known at trace time.
  They raise ``ValueError`` while tracing, so a too-narrow buffer can never be written past
  silently (the sglang bugs of PRs #26972, #27338, #27360).
* **Dynamic probes** (off by default): ``detect_nan``, ``detect_inf``, ``detect_oob``,
  ``detect_in_closed_range``, ``detect_page_aligned``, ``assert_async``. When probes are off
  they return before touching the tracer, so they add **nothing** to the jaxpr. When on, they
  emit ``checkify.check``s whose message names the probe and the offending value.

The switch, one mechanism everywhere:

* Probes are on when ``JSPEC_ENABLE_ASYNC_ASSERT=1`` (read once in ``jspec.env``) or inside
  ``with probes_enabled():``. The switch is a ``jax.make_user_context`` value, so it is part of
  every ``jax.jit`` cache key: a function traced with probes off and the same function traced
  with probes on are two cache entries, both kept. Toggling the switch never clears JAX's
  caches and never recompiles unrelated functions.
* While probes are on, ``jax_experimental_unsafe_xla_runtime_errors`` is on too, so a probe
  works wherever the code runs: eagerly (raises ``checkify.JaxRuntimeError`` at once), under
  plain ``jax.jit`` (raises ``jax.errors.JaxRuntimeError`` at sync time, the analogue of
  sglang's async asserts; the text holds the probe message and value), and under
  ``checkify.checkify`` (functionalized: an ``Error`` value, no host callback).
* :func:`checked` (``jax.jit(checkify.checkify(fn))``, cached per function) runs ``fn`` with
  probes on and raises :class:`ProbeError`, an ``AssertionError`` like sglang's debug asserts,
  naming the probe and the value. The engine's steps and the PyTorch drop-in go through it.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jspec import env

__all__ = [
    "ProbeError",
    "assert_async",
    "assert_buffer_fits",
    "checked",
    "detect_in_closed_range",
    "detect_inf",
    "detect_nan",
    "detect_oob",
    "detect_page_aligned",
    "probes_enabled",
    "probes_on",
    "static_check",
    "static_check_dtype",
    "static_check_int",
    "static_check_int_arg",
    "static_check_power_of_2",
    "static_check_shape",
]

_RUNTIME_ERRORS_FLAG = "jax_experimental_unsafe_xla_runtime_errors"


class _ClearingSwitch:
    """Fallback for a jax without ``make_user_context``: clears caches when the value changes."""

    def __init__(self, default_value: bool) -> None:
        self.value = default_value

    @contextlib.contextmanager
    def __call__(self, new_value: bool) -> Iterator[None]:
        prev, self.value = self.value, new_value
        if prev != new_value:
            jax.clear_caches()
        try:
            yield
        finally:
            self.value = prev
            if prev != new_value:
                jax.clear_caches()


def _make_switch(default_value: bool) -> Any:
    make = getattr(jax, "make_user_context", None)
    return _ClearingSwitch(default_value) if make is None else make(default_value=default_value)


# The switch: a jit-cache-keyed context value (``jax.make_user_context``, in jax 0.10.2).
_SWITCH = _make_switch(bool(env.ENABLE_ASYNC_ASSERT))
if env.ENABLE_ASYNC_ASSERT:
    jax.config.update(_RUNTIME_ERRORS_FLAG, True)

# Error classes surfaced by `checked`: our probes (user checks). checkify's own OOB / NaN
# instrumentation is not included: probes are explicit.
PROBE_ERRORS = checkify.user_checks


class ProbeError(AssertionError):
    """A dynamic probe fired: the message names the probe and the offending value.

    An ``AssertionError``, like sglang's debug asserts, so PyTorch callers' handlers work.
    """


def probes_on() -> bool:
    """Whether dynamic probes are emitted by functions traced now."""
    return bool(_SWITCH.value)


@contextlib.contextmanager
def probes_enabled(enabled: bool = True, *, runtime_errors: bool = True) -> Iterator[None]:
    """Turn dynamic probes on (or off) for functions traced and run inside the block.

    No cache is cleared: the switch is part of the jit cache key (see the module docstring).

    Args:
      enabled: the probe switch inside the block.
      runtime_errors: while ``enabled``, also set ``jax_experimental_unsafe_xla_runtime_errors``
        so probes fire under plain ``jax.jit`` (``JaxRuntimeError`` at sync time) instead of
        failing to lower. Restored on exit.
    """
    prev_rt = bool(getattr(jax.config, _RUNTIME_ERRORS_FLAG))
    set_rt = enabled and runtime_errors and not prev_rt
    if set_rt:
        jax.config.update(_RUNTIME_ERRORS_FLAG, True)
    try:
        with _SWITCH(bool(enabled)):
            yield
    finally:
        if set_rt:
            jax.config.update(_RUNTIME_ERRORS_FLAG, prev_rt)


def _is_static(value: Any) -> bool:
    """Keyword values without array leaves (ints, strings, configs, None) are static."""
    leaves = jax.tree.leaves(value)
    if any(isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves):
        return False
    try:
        hash(value)
    except TypeError:
        return False
    return True


# fn -> {(raise_error, static kwargs) -> jitted checkified fn}; weak so closures are not kept.
_CHECKED_CACHE: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


def _checkified(fn: Callable[..., Any], static: dict[str, Any]) -> Callable[..., Any]:
    key = tuple(sorted(static.items()))
    try:
        per_fn = _CHECKED_CACHE.setdefault(fn, {})
    except TypeError:  # not weak-referenceable: cache on nothing (still one jit per call)
        per_fn = {}
    jf = per_fn.get(key)
    if jf is None:
        body = functools.partial(fn, **static) if static else fn
        jf = jax.jit(checkify.checkify(body, errors=PROBE_ERRORS))
        per_fn[key] = jf
    return jf


def checked(fn: Callable[..., Any], *, raise_error: bool = True) -> Callable[..., Any]:
    """Run ``fn`` with probes on under ``jax.jit(checkify.checkify(fn))``.

    The compiled function is cached per ``fn`` (second call: no retrace). Positional arguments
    are traced; keyword arguments without array leaves (``max_slots=8``, ``impl="xla"``, a
    config) are static, one compile per value.

    Returns a function with ``fn``'s signature. With ``raise_error=True`` it returns ``fn``'s
    output and raises :class:`ProbeError` (message names the probe and value) if a probe fired;
    with ``raise_error=False`` it returns ``(err, out)`` where ``err.get()`` is the message or
    None.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        static = {k: v for k, v in kwargs.items() if _is_static(v)}
        dynamic = {k: v for k, v in kwargs.items() if k not in static}
        with _SWITCH(True):
            err, out = _checkified(fn, static)(*args, **dynamic)
        if not raise_error:
            return err, out
        msg = err.get()
        if msg is not None:
            raise ProbeError(msg)
        return out

    return wrapper


# ---- dynamic probes -------------------------------------------------------------------------
def _skip(x: Any) -> bool:
    return not probes_on() or x is None or jnp.size(x) == 0


def _masked(x: jax.Array, where: jax.Array | None, fill: Any) -> jax.Array:
    if where is None:
        return x
    return jnp.where(jnp.broadcast_to(where, x.shape), x, fill)


def _detect_values(bad: jax.Array, what: str, msg: str, where: jax.Array | None) -> None:
    bad = _masked(bad, where, False)
    count = jnp.sum(bad)
    first = jnp.argmax(bad.reshape(-1))
    checkify.check(
        count == 0,
        msg + f": {{count}} {what} value(s), first at flat index {{first}}",
        count=count,
        first=first,
    )


def detect_nan(x: jax.Array, msg: str, *, where: jax.Array | None = None) -> None:
    """Probe: no NaN in ``x`` (entries where ``where`` is False are ignored)."""
    if not _skip(x):
        _detect_values(jnp.isnan(x), "NaN", msg, where)


def detect_inf(x: jax.Array, msg: str, *, where: jax.Array | None = None) -> None:
    """Probe: no +-Inf in ``x``."""
    if not _skip(x):
        _detect_values(jnp.isinf(x), "Inf", msg, where)


def _detect_range(
    x: jax.Array, low: Any, high: Any, msg: str, where: jax.Array | None, *, closed: bool
) -> None:
    """``low <= x`` and ``x < high`` (``x <= high`` when ``closed``), each bound reported."""
    if _skip(x):
        return
    info = jnp.iinfo(x.dtype) if jnp.issubdtype(x.dtype, jnp.integer) else jnp.finfo(x.dtype)
    x_min = jnp.min(_masked(x, where, info.max))
    x_max = jnp.max(_masked(x, where, info.min))
    checkify.check(
        x_min >= low, msg + ": min value {v} < low bound {b}", v=x_min, b=jnp.asarray(low)
    )
    below_high, op = (x_max <= high, ">") if closed else (x_max < high, ">=")
    checkify.check(
        below_high, msg + f": max value {{v}} {op} high bound {{b}}", v=x_max, b=jnp.asarray(high)
    )


def detect_oob(
    x: jax.Array, low: Any, high: Any, msg: str, *, where: jax.Array | None = None
) -> None:
    """Probe: ``low <= x < high``; the low and the high bound are reported separately."""
    _detect_range(x, low, high, msg, where, closed=False)


def detect_in_closed_range(
    x: jax.Array, low: Any, high: Any, msg: str, *, where: jax.Array | None = None
) -> None:
    """Probe: ``low <= x <= high``."""
    _detect_range(x, low, high, msg, where, closed=True)


def detect_page_aligned(
    x: jax.Array, page_size: int, msg: str, *, where: jax.Array | None = None
) -> None:
    """Probe: every ``x % page_size == 0``. Skipped when ``page_size <= 1``."""
    if page_size <= 1 or _skip(x):
        return
    bad = _masked(x % page_size != 0, where, False)
    first = jnp.argmax(bad.reshape(-1))
    value = x.reshape(-1)[first]
    checkify.check(
        ~jnp.any(bad),
        msg + f": value {{v}} at flat index {{i}} is not a multiple of page_size={page_size}",
        v=value,
        i=first,
    )


def assert_async(cond: Any, msg: str, **values: Any) -> None:
    """Probe: a scalar boolean condition; ``msg`` may format ``values`` as ``{name}``.

    ``cond`` and each value may be zero-argument callables: they are only evaluated when
    probes are on, so the caller's expression adds nothing to the jaxpr when off
    (``assert_async(lambda: jnp.all(x < n), "x < n")``).
    """
    if not probes_on():
        return
    cond = cond() if callable(cond) else cond
    values = {k: jnp.asarray(v() if callable(v) else v) for k, v in values.items()}
    checkify.check(jnp.asarray(cond), msg, **values)


# ---- static (trace-time, always on) checks -----------------------------------------------------
def assert_buffer_fits(used: int, capacity: int, what: str, **ctx: Any) -> None:
    """Trace-time check ``used <= capacity`` (sglang ``assert_buffer_fits``), always on."""
    if int(used) > int(capacity):
        extra = ", ".join(f"{k}={v}" for k, v in ctx.items())
        raise ValueError(
            f"{what}: needs {used} but buffer holds {capacity}" + (f" ({extra})" if extra else "")
        )


def static_check(cond: bool, msg: str) -> None:
    """Trace-time check on static values: ``ValueError(msg)`` when ``cond`` is False."""
    if not cond:
        raise ValueError(msg)


def static_check_int(value: Any, name: str, *, low: int = 1) -> None:
    """Trace-time check: ``value`` is a Python int ``>= low`` (``ValueError`` naming ``name``)."""
    if not (isinstance(value, int) and value >= low):
        raise ValueError(f"{name}={value!r} must be an int >= {low}")


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def static_check_int_arg(value: Any, name: str) -> None:
    """Trace-time check of an integer argument that may also be traced (a count, a size).

    A Python / NumPy int must fit int32 (the jit boundary would wrap ``2**32 + 4`` to 4); a
    float or a bool is refused (it would truncate ``4.9`` to 4); an array (NumPy or JAX,
    concrete or traced) must have an integer dtype, and a NumPy array's values must fit int32.

    Raises:
      ValueError naming ``name``.
    """
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}={value!r} must be an integer, not a bool")
    if isinstance(value, (int, np.integer)):
        if not _INT32_MIN <= int(value) <= _INT32_MAX:
            raise ValueError(f"{name}={int(value)} does not fit int32")
        return
    if isinstance(value, (float, complex, np.floating, np.complexfloating)):
        raise ValueError(f"{name}={value!r} must be an integer (a float would be truncated)")
    dtype = getattr(value, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{name}={value!r}: must be an integer or an integer array")
    if isinstance(value, np.ndarray) and value.size:
        lo, hi = int(value.min()), int(value.max())
        if lo < _INT32_MIN or hi > _INT32_MAX:
            raise ValueError(f"{name} holds {lo if lo < _INT32_MIN else hi}: does not fit int32")


def static_check_power_of_2(value: Any, name: str) -> None:
    """Trace-time check: ``value`` is a Python int power of 2 (``ValueError`` naming ``name``)."""
    if not (isinstance(value, int) and value >= 1 and value & (value - 1) == 0):
        raise ValueError(f"{name}={value!r} must be a power of 2")


def static_check_shape(x: Any, shape: tuple[int, ...], name: str) -> None:
    """Trace-time check of an array's static shape."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be {tuple(shape)}")


def static_check_dtype(x: Any, dtypes: Any, name: str) -> None:
    """Trace-time check of an array's dtype (one dtype or a tuple of them)."""
    if not isinstance(dtypes, tuple):
        dtypes = (dtypes,)
    if jnp.dtype(x.dtype) not in tuple(jnp.dtype(d) for d in dtypes):
        raise ValueError(
            f"{name}.dtype={x.dtype} must be one of {[str(jnp.dtype(d)) for d in dtypes]}"
        )
