"""Shared kernel plumbing: ``impl=`` selection, Pallas-Triton launch settings, and the packed
segment bookkeeping of the references (:func:`segment_owners`).

Every op with a kernel exposes ``impl: "xla" | "pallas" | "triton"``:

* ``"xla"``: the pure-jnp ``*_reference`` path, the oracle.
* ``"pallas"``: ``pl.pallas_call`` with the Triton lowering (jax 0.10 and 0.11). On a non-GPU
  backend it runs in interpret mode automatically (``interpret=None``).
* ``"triton"``: a raw Triton kernel through ``jax_triton.triton_call`` (GPU only; on CPU the
  same Triton source is tested through Triton's interpreter on torch tensors).

NOTE (shared/PLATFORM.md): every Pallas load/store block must hold a power-of-2 number of
elements; integer vector atomics are broken up to jax 0.11.2; no checks inside kernels.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

IMPLS = ("xla", "pallas", "triton")


def resolve_impl(impl: str, available: tuple[str, ...], op: str) -> str:
    """Validate ``impl`` for ``op``; raises ``ValueError`` naming the choices."""
    if impl not in available:
        raise ValueError(f"impl={impl!r} is not available for {op}; choose one of {available}")
    if impl in ("triton", "cudnn") and not on_gpu():
        raise ValueError(
            f"impl={impl!r} for {op} needs a GPU backend (jax_triton, cuDNN); "
            f"jax.default_backend()={jax.default_backend()!r}"
        )
    return impl


def interpreting() -> bool:
    """Whether Triton kernels created now run in Triton's interpreter (``TRITON_INTERPRET``)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


_TRITON_JITTED: dict[tuple[Callable[..., Any], bool], Any] = {}


def triton_jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit(fn)``, created on first use per mode: compiled, or Triton's interpreter when
    ``TRITON_INTERPRET`` is set then (a kernel decorated at import would fix the mode for the
    whole process; CPU tests run the same source interpreted on torch tensors)."""
    key = (fn, interpreting())
    if key not in _TRITON_JITTED:
        import triton

        _TRITON_JITTED[key] = triton.jit(fn)
    return _TRITON_JITTED[key]


class TritonLaunch(NamedTuple):
    """One launch of a raw Triton kernel: ``kernel[grid](*pointers, **options)``.

    The pointers follow the kernel's parameter order (inputs, then outputs); ``jax_triton``'s
    ``triton_call`` takes the same three as ``kernel=``, ``grid=`` and keywords (:func:`triton_call`).
    """

    kernel: Any  # the ``triton.jit`` kernel of the current mode (:func:`triton_jit`)
    grid: tuple[int, ...]
    options: dict[str, int]  # constexpr metaparameters, num_warps, num_stages


def jax_triton_call(*args: Any, **kwargs: Any) -> Any:
    """``jax_triton.triton_call`` (imports jax_triton: GPU only) through jaxlib's
    command-buffer-compatible FFI target where it is registered (:mod:`jspec.kernels.triton_ffi`):
    the one way jspec launches a raw Triton kernel."""
    from jspec.kernels import triton_ffi

    jt = import_jax_triton()
    kwargs.setdefault("custom_call_target_name", triton_ffi.target_name())
    return jt.triton_call(*args, **kwargs)


def triton_call(launch: TritonLaunch, *args: Any, **kwargs: Any) -> Any:
    """:func:`jax_triton_call` of a launch on JAX arrays."""
    return jax_triton_call(
        *args, kernel=launch.kernel, grid=launch.grid, **launch.options, **kwargs
    )


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def resolve_interpret(interpret: bool | None) -> bool:
    """``None`` means: compile on GPU, interpret elsewhere."""
    return (not on_gpu()) if interpret is None else bool(interpret)


def triton_params(num_warps: int = 4, num_stages: int = 1):
    """Compiler params for the Pallas Triton lowering (the only GPU lowering of pallas_call)."""
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_call(
    kernel: Callable[..., Any],
    *,
    interpret: bool | None,
    num_warps: int = 4,
    num_stages: int = 1,
    **kwargs: Any,
) -> Callable[..., Any]:
    """``pl.pallas_call(kernel, **kwargs)`` with the Triton lowering's launch params (none in
    interpret mode): the one place a Pallas kernel meets :func:`triton_params`. ``interpret``
    is the op's own argument (``None``: :func:`resolve_interpret`'s default)."""
    from jax.experimental import pallas as pl

    interpret = resolve_interpret(interpret)
    params = None if interpret else triton_params(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(kernel, interpret=interpret, compiler_params=params, **kwargs)


def validate_tuning(**knobs: int | None) -> None:
    """Trace-time check of launch knobs (``block_*``, ``num_warps``): each None (the default)
    or a power of 2 >= 1; ``ValueError`` naming the knob otherwise."""
    from jspec import probes

    for name, val in knobs.items():
        probes.static_check(
            val is None or (isinstance(val, int) and val >= 1 and val & (val - 1) == 0),
            f"{name}={val!r} must be None or a power of 2 >= 1",
        )


def import_jax_triton():
    """Import ``jax_triton`` (GPU only) without leaking its process-wide side effect.

    NOTE (shared/PLATFORM.md §8): importing jax-triton 0.3.1 sets ``TRITON_CACHE_DIR=""`` for
    the whole process, which breaks torch's own Triton launches ("Could not create or locate
    cache dir"). The previous value is restored (or the variable removed) after the import.
    Its kernel compiles are stored beside JAX's persistent compilation cache when that is on
    (:mod:`jspec.kernels.triton_cache`: jax-triton itself keeps them for the process only).
    """
    import os

    from jspec.kernels import triton_cache, triton_ffi

    previous = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton

    if previous is None:
        if os.environ.get("TRITON_CACHE_DIR") == "":
            del os.environ["TRITON_CACHE_DIR"]
    else:
        os.environ["TRITON_CACHE_DIR"] = previous
    triton_cache.install(jax_triton)
    triton_ffi.install()
    return jax_triton


def segment_owners(seg_start: jax.Array, seg_len: jax.Array, size: int) -> jax.Array:
    """Owner segment of every entry of a packed buffer (the references' inverse of packing)::

        seg_start [0 2 2 5]   seg_len [2 0 3 1]   size 7
        owners    [0 0 2 2 2 3 3]   (entries past the total: the last segment)

    Args:
      seg_start: i32[num_segs] where each segment starts in the buffer (an exclusive cumsum
        of ``seg_len``).
      seg_len: i32[num_segs] segment lengths; empty segments (``<= 0``) own nothing.
      size: static buffer length ``M`` (``>= 1``); ``num_segs >= 1``.

    Returns:
      i32[size]: the last non-empty segment starting at or before each entry, clipped to
      ``[0, num_segs)`` (row-start marks, then a running max: O(M + B), no searchsorted).
    """
    num_segs = seg_start.shape[0]
    marks = (
        jnp.full((size,), -1, jnp.int32)
        .at[jnp.where(seg_len > 0, seg_start, size)]
        .max(jnp.arange(num_segs, dtype=jnp.int32), mode="drop")
    )
    return jnp.clip(jax.lax.cummax(marks), 0, num_segs - 1)
