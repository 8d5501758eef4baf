"""The loaders' machinery: what a model wants from a checkpoint (:class:`Want`), the header checks
(:func:`check_source`), and the read to the device with a finiteness check (:func:`load`).

Header checks, before a byte of weights is read (ValueError naming the tensor and the file):

* every wanted tensor present (optional ones may be absent), with the wanted shape and a
  float (or, for integer tensors, an integer) dtype;
* every tensor of the checkpoint accounted for: wanted, or one of the documented ``ignored``
  patterns (e.g. ``rotary_emb.inv_freq`` buffers of older conversions). A tensor of a layer past
  ``num_hidden_layers`` or a name jspec does not know is an error, not a silent drop: config and
  weights disagree, or the checkpoint holds weights (biases, quantization scales) jspec would
  ignore and compute wrongly without.

During the read, every float tensor is checked finite on its device (``isfinite`` reduced to
one bool in the same jitted call that transposes ``nn.Linear`` weights, so no extra compile for
those; one transfer of the flags per shard). NaN / Inf weights raise ValueError naming the
tensor: a model with them only ever produces NaN logits, which greedy decoding turns into
token 0 without a word.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec._jit import jit
from jspec.models._sources import TensorSource

Progress = Callable[[int, int], None]  # (tensors loaded, tensors in all)
FLOAT_DTYPES = ("F32", "BF16", "F16")
INT_DTYPES = ("I64", "I32")
# Buffers some conversions saved beside the weights; jspec computes RoPE from the config.
ROTARY_BUFFERS = r"(.+\.)?rotary_emb\.inv_freq"
_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")
_READ_THREADS = 4


@dataclasses.dataclass(frozen=True)
class Want:
    name: str  # HF tensor name
    shape: tuple[int, ...]  # jspec layout; the file holds shape[::-1] when transposed
    transpose: bool = False
    optional: bool = False
    integer: bool = False

    @property
    def file_shape(self) -> tuple[int, ...]:
        return self.shape[::-1] if self.transpose else self.shape


def num_bytes(wants: Iterable[Want], dtype: Any) -> int:
    """Device bytes of ``wants`` loaded in ``dtype`` (integer tensors as i32)."""
    itemsize = jnp.dtype(dtype).itemsize
    return sum(int(np.prod(w.shape)) * (4 if w.integer else itemsize) for w in wants)


def _unknown(source: TensorSource, name: str, what: str, num_layers: int | None) -> ValueError:
    file = source.file_of(name)
    layer = _LAYER.match(name)
    if layer is not None and num_layers is not None and int(layer.group(1)) >= num_layers:
        return ValueError(
            f"tensor {name!r} in {file} is for layer {layer.group(1)}, but config.json says "
            f"num_hidden_layers={num_layers}: config and weights disagree"
        )
    return ValueError(
        f"tensor {name!r} in {file} is not a {what} weight jspec knows (it would be ignored: "
        "a bias, a quantization scale or another model's weight computes a different model)"
    )


def check_source(
    source: TensorSource,
    wants: dict[str, Want],
    *,
    what: str,
    ignored: tuple[str, ...] = (ROTARY_BUFFERS,),
    num_layers: int | None = None,
) -> None:
    """Names, shapes and dtypes from the headers (see the module docstring).

    Args:
      what: the model kind named in errors (``"LlamaForCausalLM"``).
      ignored: regexes (full match) of tensors the checkpoint may hold and jspec does not load.
      num_layers: the config's depth, to name a tensor of a layer past it.
    """
    missing = [w.name for w in wants.values() if not w.optional and not source.has(w.name)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"tensor {missing[0]!r}{more} is missing from {source.describe()}")
    wanted = {w.name for w in wants.values()}
    skip = re.compile("|".join(f"(?:{p})" for p in ignored)) if ignored else None
    for name in source.names():
        if name not in wanted and not (skip is not None and skip.fullmatch(name)):
            raise _unknown(source, name, what, num_layers)
    for want in wants.values():
        if not source.has(want.name):
            continue
        shape, dtype = source.info(want.name)
        if shape != want.file_shape:
            raise ValueError(
                f"tensor {want.name!r} in {source.file_of(want.name)} has shape "
                f"{shape}, expected {want.file_shape}"
            )
        ok = INT_DTYPES if want.integer else FLOAT_DTYPES
        if dtype not in ok:
            raise ValueError(
                f"tensor {want.name!r} in {source.file_of(want.name)} has dtype "
                f"{dtype}, expected one of {ok}"
            )


def _finite(x: jax.Array) -> jax.Array:
    """bool[]: no NaN / Inf in ``x``. ``sum(x * 0)`` is 0 unless an element is NaN or +-Inf
    (``inf * 0`` is NaN, and an add always propagates NaN; XLA CPU's max-reduce does not).
    NOTE: it compiles in about half the time of ``isfinite(x).all()`` (one compile per shape)."""
    return jnp.isfinite(jnp.sum(x * 0))


@jit()
def _transpose_checked(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x.T, _finite(x)


_all_finite = jax.jit(_finite)


def _platform(device: Any) -> str:
    """The platform of a load's target (a ``Device``, a ``Sharding``, or None: the default)."""
    if device is None:
        return jax.devices()[0].platform
    if isinstance(device, jax.Device):
        return device.platform
    return next(iter(device.device_set)).platform


def _to_device(arr: np.ndarray, want: Want, dtype: Any, device: Any) -> tuple[jax.Array, Any]:
    """One file tensor in the jspec layout on ``device`` and its finiteness flag (a device bool;
    None for integer tensors). ``nn.Linear`` weights are transposed on the device when it is one
    device (a host transpose of an 8B checkpoint's 15 GB ran at ~0.25 GB/s); for another
    ``Sharding`` (laid out for the transposed shape) on the host."""
    if want.integer:
        return jax.device_put(np.asarray(arr, np.int32), device), None
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is named below
        host = np.asarray(arr, dtype=dtype)  # no copy when the file holds ``dtype``
    if host is arr and _platform(device) == "cpu":
        # XLA:CPU may alias an aligned host array: never the checkpoint file's mapped pages
        # (a rewrite of the file would change the weights, a truncation fault on read).
        host = host.copy()
    if not want.transpose:
        out = jax.device_put(host, device)
        return out, _all_finite(out)
    if device is None or isinstance(device, jax.Device):
        return _transpose_checked(jax.device_put(host, device))
    out = jax.device_put(np.ascontiguousarray(host.T), device)
    return out, _all_finite(out)


def _raise_nonfinite(source: TensorSource, flags: list[tuple[str, Any]], dtype: Any) -> None:
    """ValueError naming the first tensor whose flag is False (one transfer for all flags)."""
    values = jax.device_get([flag for _, flag in flags])
    bad = [name for (name, _), ok in zip(flags, values, strict=True) if not bool(ok)]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise ValueError(
            f"tensor {bad[0]!r} in {source.file_of(bad[0])} holds NaN or Inf values as "
            f"{jnp.dtype(dtype).name}{more}"
        )


def load(
    source: TensorSource,
    wants: dict[str, Want],
    dtype: Any,
    device: Any,
    progress: Progress | None,
) -> dict[str, jax.Array]:
    """Read file by file, each tensor straight to ``device`` in ``dtype`` (checked finite);
    the headers must have passed :func:`check_source`. The copies to the device run on
    ``_READ_THREADS`` threads (a host-to-device copy releases the GIL; one thread left the
    link idle while Python moved to the next tensor)."""
    by_name = {w.name: key for key, w in wants.items() if source.has(w.name)}
    out: dict[str, jax.Array] = {}
    with concurrent.futures.ThreadPoolExecutor(_READ_THREADS) as pool:
        for arrays in source.read(list(by_name)):
            futures = {
                pool.submit(_to_device, arr, wants[by_name[name]], dtype, device): name
                for name, arr in arrays
            }
            flags: list[tuple[str, Any]] = []
            for future in concurrent.futures.as_completed(futures):
                name = futures[future]
                out[by_name[name]], flag = future.result()
                if flag is not None:
                    flags.append((name, flag))
                if progress is not None:
                    progress(len(out), len(by_name))
            if flags:  # per file: a NaN is named before the next file is read
                _raise_nonfinite(source, sorted(flags), dtype)
    return out


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checkpoint directory checked from its config and headers: the model, what to read."""

    model: Any  # LlamaTarget | Eagle3Draft | Eagle1Draft
    source: TensorSource
    wants: dict[str, Want]
    dtype: Any  # the jnp dtype the weights load in

    @property
    def avals(self) -> dict[str, jax.ShapeDtypeStruct]:
        """What :meth:`read` returns, as shapes and dtypes (integer tensors as i32)."""
        return {
            key: jax.ShapeDtypeStruct(w.shape, jnp.int32 if w.integer else self.dtype)
            for key, w in self.wants.items()
            if self.source.has(w.name)
        }

    @property
    def num_bytes(self) -> int:
        return num_bytes((w for w in self.wants.values() if self.source.has(w.name)), self.dtype)

    def read(self, device: Any, progress: Progress | None) -> dict[str, jax.Array]:
        return load(self.source, self.wants, self.dtype, device, progress)
