"""Environment toggles, read in this one module (debug switches only; never config)."""

from __future__ import annotations

import os


def _env_bool(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() in ("1", "true", "yes", "on")


# Probes (checkify checks standing in for sglang's SGLANG_ENABLE_ASYNC_ASSERT).
ENABLE_ASYNC_ASSERT: bool = _env_bool("JSPEC_ENABLE_ASYNC_ASSERT")
# Tests: run kernels compiled for the GPU instead of Pallas interpret mode.
TEST_GPU: bool = _env_bool("JSPEC_TEST_GPU")
# The jspec commands' persistent XLA compilation cache (jspec.apps.compile_cache): a directory,
# or "0" / "off" for none; unset: the user cache dir below.
COMPILATION_CACHE: str | None = os.environ.get("JSPEC_COMPILATION_CACHE") or None
# The user cache dir (XDG base directories): $XDG_CACHE_HOME, else ~/.cache.
USER_CACHE_DIR: str = os.environ.get("XDG_CACHE_HOME") or os.path.join(
    os.path.expanduser("~"), ".cache"
)
# Raw Triton launches through jaxlib's typed-FFI target (jspec.kernels.triton_ffi, captured in
# XLA's command buffers) unless "0": the default since the eleventh session (H200, 8B, 32-round
# dispatches, one call: wall / busy 1.03-1.04 vs 1.05-1.08 through jax-triton's legacy call).
TRITON_FFI: bool = _env_bool("JSPEC_TRITON_FFI", default=True)
