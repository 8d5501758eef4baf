"""jax-triton's kernel launches through jaxlib's typed-FFI target, which XLA's command buffers
(CUDA graphs) capture.

jax-triton 0.3.1 lowers every raw Triton kernel to the legacy custom call ``triton_kernel_call``
(``api_version=2``, the launch in ``backend_config``). XLA never puts a legacy custom call in a
command buffer, and the flag that once allowed it (``--legacy_command_buffer_custom_call_targets``)
is gone from jax 0.11.2's XLA: every Triton launch in a step split XLA's CUDA graphs and was
launched from the host. jaxlib 0.11.2 also registers ``triton_kernel_call_ffi``: the same
launch (the same serialized kernel call, as an ``opaque`` attribute) behind an FFI handler with
the command-buffer trait (measured on an H100: a jitted chain of 64 tiny Triton kernels, 367 us
through the legacy call, 184 us through the FFI one; with command buffers off, 468 / 597 us).

:func:`install` wraps ``jax.ffi.ffi_lowering`` once so that a lowering asked for the target
:data:`FFI_TARGET` in jax-triton's legacy form becomes the typed-FFI form; every other call
passes through unchanged. :func:`target_name` is what :func:`jspec.kernels._common.triton_call`
passes as jax-triton's ``custom_call_target_name``: the FFI target where jaxlib registers it
(unless ``JSPEC_TRITON_FFI=0``), else the legacy one.

jax-triton's own main branch (after 0.3.1) made the same move: its ``CUSTOM_CALL_TARGET_NAME`` is
``triton_kernel_call_ffi`` and its lowering is ``jax.ffi.ffi_lowering(FFI_TARGET, api_version=4,
operand_output_aliases=..., has_side_effect=...)`` called with ``opaque=zlib.compress(call
proto)``, autotuned calls included: the translation :func:`typed_ffi` makes of 0.3.1's legacy
lowering (the same compressed proto is 0.3.1's ``backend_config``).

Status: the default since 2026-11-27 (H200, bench/RESULTS.md "Session 2026-11-27
(eleventh)"). The engine's decode dispatches (up to 32 rounds in one while loop) run with the
Triton launches inside XLA's CUDA graphs: wall / busy per round 1.03-1.04 against 1.05-1.08
through the legacy call (8B, bs 1 and 64, greedy and spec, one call). XLA updates a command
buffer when the buffers it was recorded with move (a new execution's host inputs), and
re-traces the FFI launches then: a profiled run shows stalls of ~1 ms there, and the sixth
session measured a spec step jitted and called alone at 7.3 ms legacy vs 13.3 ms FFI.
``JSPEC_TRITON_FFI=0`` restores the legacy call (a single-step caller may want it).
"""

from __future__ import annotations

import functools
from typing import Any

LEGACY_TARGET = "triton_kernel_call"
FFI_TARGET = "triton_kernel_call_ffi"
_installed = False


@functools.cache
def ffi_target_registered() -> bool:
    """Whether jaxlib's GPU plugin registers :data:`FFI_TARGET` (jaxlib 0.11.2 does)."""
    try:
        from jax._src.lib import gpu_triton

        cuda_triton = gpu_triton._cuda_triton
        if cuda_triton is None:  # no CUDA plugin
            return False
        return FFI_TARGET in dict(cuda_triton.registrations())
    except (ImportError, AttributeError, TypeError, ValueError):
        return False


def target_name() -> str:
    """jax-triton's ``custom_call_target_name`` for jspec's launches (the FFI one where jaxlib
    registers it, unless ``JSPEC_TRITON_FFI=0``)."""
    from jspec import env

    return FFI_TARGET if env.TRITON_FFI and ffi_target_registered() else LEGACY_TARGET


def typed_ffi(original: Any) -> Any:
    """``original`` (``jax.ffi.ffi_lowering``) with :data:`FFI_TARGET`'s legacy form (``api_version
    2``, the kernel call in ``backend_config``) turned into the typed-FFI form (``api_version 4``,
    the same bytes as the ``opaque`` attribute); any other call unchanged."""

    def ffi_lowering(call_target_name: str, *args: Any, **kwargs: Any) -> Any:
        if call_target_name != FFI_TARGET or kwargs.get("api_version") != 2:
            return original(call_target_name, *args, **kwargs)
        opaque = kwargs.pop("backend_config")
        kwargs["api_version"] = 4
        rule = original(call_target_name, *args, **kwargs)
        return lambda ctx, *operands: rule(ctx, *operands, opaque=opaque)

    # The wrapped function stays reachable (debugging); setattr: a def has no declared attrs.
    setattr(ffi_lowering, "original", original)
    return ffi_lowering


def install() -> None:
    """Wrap ``jax.ffi.ffi_lowering`` with :func:`typed_ffi` (once per process)."""
    global _installed
    if _installed:
        return
    import jax.ffi

    jax.ffi.ffi_lowering = typed_ffi(jax.ffi.ffi_lowering)
    _installed = True
