"""Zero-copy torch <-> JAX conversion through DLPack, with sglang's hazards handled.

``to_jax(tensor)`` / ``to_torch(array)`` share memory whenever DLPack allows it, and make every
copy deliberate. What is zero-copy (measured, shared/PLATFORM.md §9 for GPU; torch 2.13 +
jax 0.10.2 on CPU)::

    dtype                         GPU          CPU
    bool int8 uint8 int16 int32   zero-copy    zero-copy (buffer 64-byte aligned, else JAX copies)
    fp16 bf16 fp32 uint16 uint32  zero-copy    zero-copy (same alignment rule)
    compact, permuted (x.t())     zero-copy    zero-copy (JAX keeps a non-default layout)
    int64 / fp64, x64 off         JAX silently truncates to a 32-bit COPY: 2**33+5 -> 5
    strided views (x[::2])        rejected by JAX ("trivial (compact) striding")
    requires_grad                 rejected by torch ("use tensor.detach()")

Hazards and what this module does about them (the "DLPack shim rules" of PLATFORM.md):

* int64 index tensors (sglang's ``out_cache_loc``, ``retrive_*``, ``accept_index``): with
  ``int64="int32"`` (default) they are range-checked and cast in torch (one copy); a value
  outside int32 raises ``ValueError`` naming the value and its flat index. ``int64="x64"`` keeps
  them (zero-copy) and requires ``jax_enable_x64``; ``int64="error"`` refuses them. float64
  always needs ``jax_enable_x64`` (there is no silent cast to float32).
* Strided views are made contiguous (a documented copy) or refused with ``strict=True``.
* ``requires_grad`` tensors are detached (no copy).
* CUDA streams: the export runs inside ``torch.cuda.stream(stream)`` (default: torch's current
  stream), so JAX waits on the producing stream; ``sync=True`` also synchronises it.
* Donation: a JAX array imported from torch aliases torch's storage, and donating it lets XLA
  write its output into torch's memory. ``safe_for_donation=True`` returns an XLA-owned copy
  (``jnp.array(x, copy=True)``; never ``from_dlpack(copy=True)``, which is unimplemented on GPU).
* The other direction aliases too: ``to_torch(array)`` is a writable view of an *immutable* JAX
  buffer. Writing into it, or donating ``array`` afterwards, corrupts one side; pass
  ``copy=True`` when the tensor will be written or outlive the array.

NOTE: convert each index tensor once and keep the result (each conversion costs ~50 us).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
INT64_MODES = ("int32", "x64", "error")
_WIDE_DTYPES = (torch.int64, torch.float64, torch.uint64)


def x64_enabled() -> bool:
    # NOTE: jax declares its flags as dynamic Config attributes, which mypy cannot see.
    return bool(jax.config.jax_enable_x64)  # type: ignore[attr-defined]


def _is_compact(tensor: torch.Tensor) -> bool:
    """True if the strides are a permutation of a dense layout (what DLPack import accepts)."""
    dims = [(st, sz) for st, sz in zip(tensor.stride(), tensor.shape) if sz != 1]
    expected = 1
    for stride, size in sorted(dims):
        if stride != expected:
            return False
        expected *= size
    return True


def _stream_ctx(tensor: torch.Tensor, stream: Any) -> Any:
    if tensor.device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(
        stream if stream is not None else torch.cuda.current_stream(tensor.device)
    )


def check_int32_range(tensor: torch.Tensor, what: str = "tensor") -> None:
    """Raise ``ValueError`` naming the first value of ``tensor`` outside int32 (syncs on GPU)."""
    if tensor.numel() == 0:
        return
    flat = tensor.reshape(-1)
    bad = (flat < INT32_MIN) | (flat > INT32_MAX)
    if bool(bad.any()):
        index = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"to_jax: {what} ({tensor.dtype}) value {int(flat[index])} at flat index "
            f"{index} does not fit int32 [{INT32_MIN}, {INT32_MAX}]; jspec indices "
            f"are int32 (pass int64='x64' with jax_enable_x64 to keep int64)"
        )


def _prepare(tensor: torch.Tensor, *, int64: str, strict: bool, what: str) -> torch.Tensor:
    """Torch-side fixes before export: detach, dtype policy, contiguity. Copies only if needed."""
    if int64 not in INT64_MODES:
        raise ValueError(f"int64={int64!r} must be one of {INT64_MODES}")
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.dtype in _WIDE_DTYPES:
        if int64 == "error":
            raise ValueError(
                f"to_jax: {what} has dtype {tensor.dtype} and int64='error'; cast it "
                f"to a 32-bit dtype first"
            )
        if int64 == "x64" or tensor.dtype == torch.float64:
            # NOTE: without x64 JAX would silently truncate to a 32-bit copy.
            if not x64_enabled():
                raise ValueError(
                    f"to_jax: {what} has dtype {tensor.dtype} but jax_enable_x64 is "
                    f"off; enable it (jax.config.update('jax_enable_x64', True)) "
                    f"or cast in torch first"
                )
        else:
            check_int32_range(tensor, what)
            tensor = tensor.to(torch.int32)  # deliberate copy (compact result)
    if not _is_compact(tensor):
        if strict:
            raise ValueError(
                f"to_jax: {what} is a strided view (shape={tuple(tensor.shape)}, "
                f"stride={tensor.stride()}) that DLPack cannot share; call "
                f".contiguous() or pass strict=False to copy"
            )
        tensor = tensor.contiguous()  # documented copy
    return tensor


def to_jax(
    tensor: torch.Tensor,
    *,
    int64: str = "int32",
    copy: bool = False,
    strict: bool = False,
    safe_for_donation: bool = False,
    stream: Any = None,
    sync: bool = False,
    device: Any = None,
    what: str = "tensor",
) -> jax.Array:
    """A torch tensor as a JAX array, zero-copy when DLPack allows it.

    Args:
      tensor: any-dtype dense torch tensor on CPU or CUDA (another layout or device, e.g. a
        sparse or ``meta`` tensor: ``ValueError`` naming ``what``).
      int64: policy for int64 (and uint64) tensors: ``"int32"`` range-checks and casts (copy;
        ``ValueError`` naming the first value outside int32), ``"x64"`` keeps int64 zero-copy
        (needs ``jax_enable_x64``), ``"error"`` refuses. float64 always needs ``jax_enable_x64``.
      copy: return an XLA-owned copy (same as ``safe_for_donation``).
      strict: refuse strided views (``ValueError``) instead of copying them contiguous.
      safe_for_donation: never alias torch memory: the result may be donated to a jitted
        function without XLA writing into the torch tensor.
      stream: the CUDA stream that produced ``tensor`` (default: torch's current stream).
      sync: also ``synchronize()`` that stream before exporting (belt and braces).
      device: optional JAX device to ``device_put`` the result on (a copy across devices), or
        ``"default"``: JAX's default device when the tensor lives on another platform (a CPU
        tensor while JAX runs on a GPU), else no move.
      what: name used in error messages.

    Returns:
      a ``jax.Array`` with the tensor's shape; dtype as torch's except int64 -> int32 by default.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"to_jax: {what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(
            f"to_jax: {what} has layout {tensor.layout}; DLPack shares dense tensors only "
            f"(call .to_dense() first)"
        )
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"to_jax: {what} is on device {tensor.device}; DLPack shares CPU and CUDA tensors only"
        )
    with _stream_ctx(tensor, stream):
        tensor = _prepare(tensor, int64=int64, strict=strict, what=what)
        if sync and tensor.device.type == "cuda":
            torch.cuda.current_stream(tensor.device).synchronize()
        array = jax.dlpack.from_dlpack(tensor)
    if device == "default":
        device = _default_device_for(tensor)
    if device is not None:
        array = jax.device_put(array, device)
    if copy or safe_for_donation:
        array = jnp.array(array, copy=True)
    return array


def _default_device_for(tensor: torch.Tensor) -> Any:
    default = jax.devices()[0]
    platform = "gpu" if tensor.device.type == "cuda" else tensor.device.type
    return None if default.platform == platform else default


def to_torch(array: jax.Array, *, copy: bool = False) -> torch.Tensor:
    """A JAX array as a torch tensor, zero-copy (a view of the JAX buffer) unless ``copy``.

    NOTE: the zero-copy view is writable although JAX arrays are immutable: use ``copy=True``
    if the tensor will be written, or if ``array`` may be donated while the tensor lives.
    """
    if not isinstance(array, jax.Array):
        array = jnp.asarray(array)
    tensor = torch.from_dlpack(array)
    return tensor.clone() if copy else tensor


def shares_memory(tensor: torch.Tensor, array: jax.Array) -> bool:
    """True if ``array``'s buffer starts at ``tensor``'s data pointer (zero-copy test)."""
    if tensor.numel() == 0:
        return True
    return int(array.unsafe_buffer_pointer()) == int(tensor.data_ptr())


# ---- pytrees ------------------------------------------------------------------------------------
def _map_tree(fn: Callable[[Any], Any], tree: Any, is_leaf: Callable[[Any], bool]) -> Any:
    """Map ``fn`` over leaves of dicts, lists, tuples (incl. namedtuples) and dataclasses."""
    if is_leaf(tree):
        return fn(tree)
    if isinstance(tree, dict):
        return type(tree)((k, _map_tree(fn, v, is_leaf)) for k, v in tree.items())
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_map_tree(fn, v, is_leaf) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tree(fn, v, is_leaf) for v in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        changes = {
            f.name: _map_tree(fn, getattr(tree, f.name), is_leaf)
            for f in dataclasses.fields(tree)
            if f.init
        }
        return dataclasses.replace(tree, **changes)
    return tree


def tree_to_jax(tree: Any, **kwargs: Any) -> Any:
    """:func:`to_jax` on every torch tensor in a dict/list/tuple/dataclass tree."""
    return _map_tree(lambda t: to_jax(t, **kwargs), tree, lambda x: isinstance(x, torch.Tensor))


def tree_to_torch(tree: Any, **kwargs: Any) -> Any:
    """:func:`to_torch` on every JAX array in a dict/list/tuple/dataclass tree (jspec pytrees too)."""
    return _map_tree(lambda a: to_torch(a, **kwargs), tree, lambda x: isinstance(x, jax.Array))
