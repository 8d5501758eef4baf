"""A persistent cache of jax-triton's kernel compiles, beside JAX's compilation cache.

jax-triton 0.3.1 compiles a raw Triton kernel while a jitted function lowers
(``jax_triton.triton_lib.get_or_create_triton_kernel``: Python AST -> TTIR -> PTX), before JAX's
persistent compilation cache is consulted, and keeps the result only in a process-local dict:
Triton's own on-disk cache is never used. Every process start paid it again: 12 kernels,
the largest single part of a warm ``jspec generate`` start on the 8B model (H100, measured with
cProfile: ~10 s of 27 s of compile under the profiler).

:func:`install` wraps that function once: when JAX's compilation cache is on
(``jax_compilation_cache_dir``), a compile is stored as one JSON file under
``<dir>/jax_triton/`` and later processes rebuild the kernel object from it without compiling.
The key is everything the compile depends on: the kernel's source hash with its dependencies
(``JITFunction.cache_key``), argument dtypes and specialization, constexprs, launch options, the
GPU's compute capability, and the Triton and jax-triton versions. A file that cannot be read
is compiled again (and rewritten); with the cache off nothing changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from typing import Any

_SUBDIR = "jax_triton"
_installed = False


class _Recorder:
    """Stands in for jaxlib's ``gpu_triton`` module during one compile: records the arguments
    of the ``TritonKernel`` it builds (name, warps, CTAs, shared memory, binary, TTIR, compute
    capability), forwarding everything else."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self.kernel_args: tuple | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def TritonKernel(self, *args: Any) -> Any:  # noqa: N802 (jaxlib's name)
        self.kernel_args = args
        return self._lib.TritonKernel(*args)


def cache_dir() -> str | None:
    """``<jax_compilation_cache_dir>/jax_triton``, or None when JAX's cache is off."""
    import jax

    # NOTE: jax declares its flags as dynamic Config attributes, which mypy cannot see.
    root = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]
    return os.path.join(root, _SUBDIR) if root else None


def cache_key(
    fn: Any, arg_dtypes: Any, scalar_args: Any, options: dict[str, Any], versions: tuple
) -> str | None:
    """The hex digest naming a compile (``versions``: Triton's and jax-triton's), or None when
    a part has no stable text (an object whose ``repr`` holds its address: not stored)."""
    scalars = [
        (int(i), str(dtype), "none" if v is None else "one" if v == 1 else "value")
        for i, dtype, v in scalar_args
    ]
    parts = [
        fn.cache_key,
        list(map(str, arg_dtypes)),
        scalars,
        sorted((k, repr(v)) for k, v in options.items()),
        list(versions),
    ]
    text = json.dumps(parts, default=repr)
    if " at 0x" in text:
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def _load(path: str, lib: Any) -> tuple[Any, dict] | None:
    try:
        with open(path, encoding="utf-8") as f:
            entry = json.load(f)
        kernel = lib.TritonKernel(*entry["kernel"])
        attrs = {tuple(k): v for k, v in entry["attrs"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return kernel, attrs


def _store(path: str, kernel_args: tuple, attrs: dict) -> None:
    """Write atomically (a temporary file renamed): a reader never sees half a file."""
    entry = {"kernel": list(kernel_args), "attrs": [[list(k), v] for k, v in attrs.items()]}
    try:
        text = json.dumps(entry)
    except TypeError:  # a binary that is not text (ROCm's hsaco path): not stored
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def cached(original: Any, module: Any, versions: tuple) -> Any:
    """``original`` (jax-triton's ``get_or_create_triton_kernel`` of ``module``, its
    ``triton_lib``) served from and stored into :func:`cache_dir`; ``versions`` (Triton's and
    jax-triton's) are part of every key."""
    memory: dict[str, tuple[Any, dict]] = {}
    # One compile at a time: a miss swaps the module's gpu_triton for a recorder, which must
    # not record a compile another thread (the Engine's background compiles) runs meanwhile.
    lock = threading.Lock()

    def get_or_create_triton_kernel(*args: Any, **kw: Any) -> Any:
        with lock:
            return lookup(*args, **kw)

    def lookup(backend_init_func, platform, fn, arg_dtypes, scalar_args, **kw):
        directory = cache_dir()
        if directory is None or platform != "cuda":
            return original(backend_init_func, platform, fn, arg_dtypes, scalar_args, **kw)
        lib = module.triton_kernel_call_lib
        options = {k: v for k, v in kw.items() if k != "dump"}
        if options.get("compute_capability") is None:
            options["compute_capability"] = lib.get_compute_capability(0)
        key = cache_key(fn, arg_dtypes, scalar_args, options, versions)
        if key is None or kw.get("dump"):
            return original(backend_init_func, platform, fn, arg_dtypes, scalar_args, **kw)
        if key in memory:
            return memory[key]
        path = os.path.join(directory, key + ".json")
        hit = _load(path, lib)
        if hit is None:
            recorder = _Recorder(lib)
            module.triton_kernel_call_lib = recorder
            try:
                hit = original(backend_init_func, platform, fn, arg_dtypes, scalar_args, **kw)
            finally:
                module.triton_kernel_call_lib = lib
            if recorder.kernel_args is not None:  # None: jax-triton's own memory served it
                _store(path, recorder.kernel_args, hit[1])
        memory[key] = hit
        return hit

    # The wrapped function stays reachable (debugging); setattr: a def has no declared attrs.
    setattr(get_or_create_triton_kernel, "original", original)
    return get_or_create_triton_kernel


def install(jax_triton: Any) -> None:
    """Wrap ``jax_triton``'s kernel compile with :func:`cached` (once per process)."""
    global _installed
    if _installed:
        return
    import triton

    module = jax_triton.triton_lib
    versions = (triton.__version__, jax_triton.__version__)
    module.get_or_create_triton_kernel = cached(
        module.get_or_create_triton_kernel, module, versions
    )
    _installed = True
