"""Probes: checkify checks standing in for sglang's async device asserts (SPEC.md §11).

Two kinds of check live here:

* **Static checks** (always on): shapes, widths and buffer capacities known at trace time.
  They raise ``ValueError`` while tracing, so a too-narrow buffer can never be written past
  silently (the sglang bugs of PRs #26972, #27338, #27360).
* **Dynamic probes** (off by default): ``detect_nan``, ``detect_inf``, ``detect_oob``,
  ``detect_in_closed_range``, ``detect_page_aligned``, ``assert_async``. When probes are off
  they return before touching the tracer, so they add **nothing** to the jaxpr. When on, they
  emit ``checkify.check``s naming the probe message and the offending value; run the function
  under :func:`checked` to surface them (or set ``runtime_errors=True`` for plain ``jit``).

Probes are on when ``JSPEC_ENABLE_ASYNC_ASSERT=1`` (read in ``jspec.env``) or inside
``with probes_enabled():``. The switch is read at trace time; toggling it clears JAX's
compilation caches so that functions traced in the other mode are retraced.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from jspec import env

_STATE = {"enabled": env.ENABLE_ASYNC_ASSERT}

# Error classes surfaced by `checked`: user checks (our probes) plus OOB indexing and NaN
# from checkify's own instrumentation are not included by default: probes are explicit.
PROBE_ERRORS = checkify.user_checks


class ProbeError(RuntimeError):
    """A dynamic probe fired: the message names the probe and the offending value."""


def probes_on() -> bool:
    """Whether dynamic probes are emitted by functions traced now."""
    return _STATE["enabled"]


@contextlib.contextmanager
def probes_enabled(enabled: bool = True, *, runtime_errors: bool = False) -> Iterator[None]:
    """Turn dynamic probes on (or off) for functions traced inside the block.

    Args:
      enabled: the probe switch inside the block.
      runtime_errors: also set ``jax_experimental_unsafe_xla_runtime_errors`` so that probes
        fire under plain ``jax.jit`` (raising ``JaxRuntimeError`` at sync time, like sglang's
        async asserts) instead of requiring :func:`checked`.
    """
    prev = _STATE["enabled"]
    prev_rt = jax.config.jax_experimental_unsafe_xla_runtime_errors
    changed = prev != enabled
    _STATE["enabled"] = enabled
    if runtime_errors:
        jax.config.update("jax_experimental_unsafe_xla_runtime_errors", True)
    if changed:
        jax.clear_caches()
    try:
        yield
    finally:
        _STATE["enabled"] = prev
        if runtime_errors:
            jax.config.update("jax_experimental_unsafe_xla_runtime_errors", prev_rt)
        if changed:
            jax.clear_caches()


def checked(fn: Callable[..., Any], *, raise_error: bool = True) -> Callable[..., Any]:
    """Run ``fn`` with probes on under ``checkify.checkify``.

    Returns a function with ``fn``'s signature. With ``raise_error=True`` it returns ``fn``'s
    output and raises :class:`ProbeError` (message names the probe and value) if a probe fired;
    with ``raise_error=False`` it returns ``(err, out)`` where ``err.get()`` is the message or
    None.
    """
    checked_fn = checkify.checkify(fn, errors=PROBE_ERRORS)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with probes_enabled(True):
            err, out = checked_fn(*args, **kwargs)
            msg = err.get()
        if raise_error:
            if msg is not None:
                raise ProbeError(msg)
            return out
        return err, out

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
    checkify.check(count == 0, msg + f": {{count}} {what} value(s), first at flat index {{first}}",
                   count=count, first=first)


def detect_nan(x: jax.Array, msg: str, *, where: jax.Array | None = None) -> None:
    """Probe: no NaN in ``x`` (entries where ``where`` is False are ignored)."""
    if not _skip(x):
        _detect_values(jnp.isnan(x), "NaN", msg, where)


def detect_inf(x: jax.Array, msg: str, *, where: jax.Array | None = None) -> None:
    """Probe: no +-Inf in ``x``."""
    if not _skip(x):
        _detect_values(jnp.isinf(x), "Inf", msg, where)


def detect_oob(x: jax.Array, low: Any, high: Any, msg: str, *,
               where: jax.Array | None = None) -> None:
    """Probe: ``low <= x < high``; the low and the high bound are reported separately."""
    if _skip(x):
        return
    info = jnp.iinfo(x.dtype) if jnp.issubdtype(x.dtype, jnp.integer) else jnp.finfo(x.dtype)
    x_min = jnp.min(_masked(x, where, info.max))
    x_max = jnp.max(_masked(x, where, info.min))
    checkify.check(x_min >= low, msg + ": min value {v} < low bound {b}", v=x_min, b=jnp.asarray(low))
    checkify.check(x_max < high, msg + ": max value {v} >= high bound {b}", v=x_max, b=jnp.asarray(high))


def detect_in_closed_range(x: jax.Array, low: Any, high: Any, msg: str, *,
                           where: jax.Array | None = None) -> None:
    """Probe: ``low <= x <= high``."""
    if _skip(x):
        return
    info = jnp.iinfo(x.dtype) if jnp.issubdtype(x.dtype, jnp.integer) else jnp.finfo(x.dtype)
    x_min = jnp.min(_masked(x, where, info.max))
    x_max = jnp.max(_masked(x, where, info.min))
    checkify.check(x_min >= low, msg + ": min value {v} < low bound {b}", v=x_min, b=jnp.asarray(low))
    checkify.check(x_max <= high, msg + ": max value {v} > high bound {b}", v=x_max, b=jnp.asarray(high))


def detect_page_aligned(x: jax.Array, page_size: int, msg: str, *,
                        where: jax.Array | None = None) -> None:
    """Probe: every ``x % page_size == 0``. Skipped when ``page_size <= 1``."""
    if page_size <= 1 or _skip(x):
        return
    bad = _masked(x % page_size != 0, where, False)
    first = jnp.argmax(bad.reshape(-1))
    value = x.reshape(-1)[first]
    checkify.check(~jnp.any(bad), msg + ": value {v} at flat index {i} is not a multiple of "
                   f"page_size={page_size}", v=value, i=first)


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
        raise ValueError(f"{what}: needs {used} but buffer holds {capacity}"
                         + (f" ({extra})" if extra else ""))


def static_check(cond: bool, msg: str) -> None:
    """Trace-time check on static values: ``ValueError(msg)`` when ``cond`` is False."""
    if not cond:
        raise ValueError(msg)


def static_check_shape(x: Any, shape: tuple[int, ...], name: str) -> None:
    """Trace-time check of an array's static shape."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be {tuple(shape)}")


def static_check_dtype(x: Any, dtypes: Any, name: str) -> None:
    """Trace-time check of an array's dtype (one dtype or a tuple of them)."""
    if not isinstance(dtypes, tuple):
        dtypes = (dtypes,)
    if jnp.dtype(x.dtype) not in tuple(jnp.dtype(d) for d in dtypes):
        raise ValueError(f"{name}.dtype={x.dtype} must be one of {[str(jnp.dtype(d)) for d in dtypes]}")
