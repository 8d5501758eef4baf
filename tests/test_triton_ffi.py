"""jspec.kernels.triton_ffi: jax-triton's legacy lowering turned into jaxlib's typed-FFI call
(the launch XLA's command buffers capture), the default where jaxlib registers it
(JSPEC_TRITON_FFI=0: the legacy call). The rewrite is checked on a stand-in lowering here; the
kernels' GPU tests (``-m gpu``, run with the default) check it compiled."""

from __future__ import annotations

import importlib

import jax
import pytest

from jspec.kernels import triton_ffi


def _recorder():
    calls = []

    def ffi_lowering(name, *args, **kwargs):
        calls.append((name, args, dict(kwargs)))
        return lambda ctx, *operands, **attrs: (name, ctx, operands, attrs)

    return calls, ffi_lowering


def test_the_ffi_target_in_legacy_form_becomes_typed_ffi_with_the_call_as_opaque():
    calls, original = _recorder()
    lowering = triton_ffi.typed_ffi(original)
    rule = lowering(
        triton_ffi.FFI_TARGET,
        api_version=2,
        backend_config=b"compressed kernel call",
        operand_output_aliases={0: 0},
    )
    assert calls == [
        (triton_ffi.FFI_TARGET, (), {"api_version": 4, "operand_output_aliases": {0: 0}})
    ]
    assert rule("ctx", "x", "y") == (
        triton_ffi.FFI_TARGET,
        "ctx",
        ("x", "y"),
        {"opaque": b"compressed kernel call"},
    )


@pytest.mark.parametrize(
    "name,kwargs",
    [
        (triton_ffi.LEGACY_TARGET, {"api_version": 2, "backend_config": b"call"}),
        ("some_other_ffi_target", {"api_version": 4}),
        (triton_ffi.FFI_TARGET, {"api_version": 4}),  # already typed: left alone
    ],
)
def test_every_other_lowering_passes_through_unchanged(name, kwargs):
    calls, original = _recorder()
    triton_ffi.typed_ffi(original)(name, **kwargs)
    assert calls == [(name, (), kwargs)]


def test_the_legacy_target_where_jaxlib_has_no_ffi_one():
    if jax.default_backend() == "gpu":
        pytest.skip("CPU: no GPU plugin, so no FFI target")
    assert not triton_ffi.ffi_target_registered()
    assert triton_ffi.target_name() == triton_ffi.LEGACY_TARGET


def test_the_switch_is_on_unless_set_to_0(monkeypatch):
    from jspec import env

    try:
        monkeypatch.delenv("JSPEC_TRITON_FFI", raising=False)
        assert importlib.reload(env).TRITON_FFI  # unset: on
        monkeypatch.setenv("JSPEC_TRITON_FFI", "0")
        assert not importlib.reload(env).TRITON_FFI
    finally:
        monkeypatch.undo()
        importlib.reload(env)  # the process's own switches back


def test_the_switch_picks_the_target(monkeypatch):
    from jspec import env

    monkeypatch.setattr(triton_ffi, "ffi_target_registered", lambda: True)
    monkeypatch.setattr(env, "TRITON_FFI", False)
    assert triton_ffi.target_name() == triton_ffi.LEGACY_TARGET
    monkeypatch.setattr(env, "TRITON_FFI", True)
    assert triton_ffi.target_name() == triton_ffi.FFI_TARGET


@pytest.mark.gpu
def test_gpu_jaxlib_registers_the_ffi_target():
    # jaxlib 0.11.2 does (a device probe, 2026-11-26)
    assert triton_ffi.ffi_target_registered()
