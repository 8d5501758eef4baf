"""Where a checkpoint directory's tensors live: names, shapes, dtypes, and reading them.

* ``model.safetensors.index.json`` (``weight_map``: name -> shard file; a shard must be a plain
  file name beside the index), else every ``*.safetensors`` file of the directory (a tensor in
  two of them is an error: nothing says which to load); headers are read up front (no weights),
  tensors later as zero-copy views of the file mapped into memory (:func:`_mapped_tensors`;
  ``safe_open(...).get_tensor`` copies each tensor on the host at ~1 GB/s, which was most of an
  8B checkpoint's load).
* ``pytorch_model.bin`` (some published EAGLE heads): only through
  ``torch.load(weights_only=True)`` when torch is importable (never a plain unpickle); otherwise a
  ``ValueError`` tells the user how to convert it to safetensors once.
"""

from __future__ import annotations

import glob
import json
import mmap
import os
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np

from jspec.models._json import read_json_object

INDEX_FILE = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
_TORCH_DTYPES = {
    "float32": "F32",
    "bfloat16": "BF16",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "bool": "BOOL",
}


class TensorSource:
    """Tensor name -> (file, shape, dtype) of one directory, and a reader by file."""

    def __init__(
        self,
        directory: str,
        entries: dict[str, tuple[str, tuple[int, ...], str]],
        tensors: dict[str, np.ndarray] | None = None,
    ) -> None:
        self.directory = directory
        self._entries = entries  # name -> (file name, shape, safetensors dtype string)
        self._tensors = tensors  # preloaded arrays (the torch .bin path), else None

    def has(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        """Every tensor name of the checkpoint, sorted."""
        return sorted(self._entries)

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        """``(shape, dtype)`` of a tensor, dtype as safetensors spells it ("BF16", "I64")."""
        _, shape, dtype = self._entries[name]
        return shape, dtype

    def file_of(self, name: str) -> str:
        return self._entries[name][0]

    def describe(self) -> str:
        files = sorted({f for f, _, _ in self._entries.values()})
        shown = ", ".join(files[:4]) + (f", ... ({len(files)} files)" if len(files) > 4 else "")
        return f"{self.directory} ({shown or 'no tensors'})"

    def read(self, names: list[str]) -> Iterator[Iterator[tuple[str, np.ndarray]]]:
        """Per file (in file order), an iterator of ``(name, array)`` of the wanted tensors."""
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.file_of(name), []).append(name)
        for file in sorted(by_file):
            yield self._read_file(file, by_file[file])

    def _read_file(self, file: str, names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
        if self._tensors is not None:
            for name in names:
                yield name, self._tensors[name]
            return
        yield from _mapped_tensors(os.path.join(self.directory, file), names)


def _np_dtype(code: str) -> Any:
    """The numpy dtype of a safetensors dtype string (little-endian, as the format stores)."""
    if code == "BF16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4"}[code])


def _mapped_tensors(path: str, names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` of ``names`` in the safetensors file ``path``: read-only views of the
    file mapped into memory (no host copy; the pages come from the page cache as the device
    copy reads them). The header was checked by :func:`_read_headers`; the byte ranges are
    checked here against the shape, the dtype and the file's size (ValueError naming both)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    data = np.frombuffer(mapped, np.uint8)
    for name in names:
        entry = header[name]
        dtype = _np_dtype(entry["dtype"])
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (8 + size + int(o) for o in entry["data_offsets"])
        if end - begin != int(np.prod(shape)) * dtype.itemsize or end > data.size:
            raise ValueError(
                f"{path}: tensor {name!r} spans bytes [{begin}, {end}) of {data.size}, "
                f"not {shape} x {dtype.itemsize} bytes inside the file"
            )
        yield name, data[begin:end].view(dtype).reshape(shape)


def _read_headers(directory: str, files: list[str]) -> dict[str, dict[str, Any]]:
    """File -> {name: (file, shape, dtype)} from the safetensors headers (no weights read).

    Raises:
      ValueError naming the file: missing, unreadable, or not a safetensors file (zero bytes,
        truncated, a bad header).
    """
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError as e:  # pragma: no cover - safetensors is a dependency
        raise ImportError(
            "reading checkpoints needs the 'safetensors' package (pip install safetensors)"
        ) from e
    headers: dict[str, dict[str, Any]] = {}
    for file in files:
        path = os.path.join(directory, file)
        if not os.path.isfile(path):
            raise ValueError(f"shard {file!r} named by {INDEX_FILE} is missing from {directory}")
        try:
            with safe_open(path, framework="np") as f:
                header = {}
                for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    part = f.get_slice(name)
                    header[name] = (file, tuple(int(d) for d in part.get_shape()), part.get_dtype())
        except (SafetensorError, OSError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{path}: not a readable safetensors file ({reason})") from None
        headers[file] = header
    return headers


def _merge(
    directory: str, headers: dict[str, dict[str, Any]], chosen: dict[str, str]
) -> dict[str, Any]:
    """One entry per tensor name: the file ``chosen`` names (the index), else the only file
    that holds it; ValueError naming both files when two hold a tensor nobody chose."""
    entries: dict[str, Any] = {}
    for file, header in headers.items():
        for name, entry in header.items():
            if name in chosen:
                continue
            if name in entries:
                raise ValueError(
                    f"tensor {name!r} is in both {entries[name][0]} and {file} of {directory} "
                    f"and no {INDEX_FILE} names the one to load"
                )
            entries[name] = entry
    for name, file in chosen.items():
        entries[name] = headers[file][name]
    return entries


def _torch_to_numpy(tensor: Any) -> np.ndarray:
    import torch

    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _bin_source(directory: str) -> TensorSource:
    path = os.path.join(directory, BIN_FILE)
    try:
        import torch
    except ImportError:
        raise ValueError(
            f"{path} is a PyTorch pickle: jspec reads safetensors. Convert it once with torch: "
            'python -c "import torch, safetensors.torch as st; '
            f"st.save_file(torch.load('{path}', weights_only=True), "
            f"'{os.path.join(directory, 'model.safetensors')}')\""
        ) from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (UnpicklingError, RuntimeError, EOFError, ...)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"{path}: refused by torch.load(weights_only=True) ({reason}); convert the "
            "checkpoint to safetensors from a trusted copy"
        ) from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in state.items()
    ):
        raise ValueError(f"{path}: expected a flat dict of tensor name -> tensor")
    tensors = {}
    for name, t in state.items():
        try:
            tensors[name] = _torch_to_numpy(t)
        except (TypeError, RuntimeError):  # float8, complex, ...: no numpy dtype to read into
            raise ValueError(
                f"{path}: tensor {name!r} has dtype {t.dtype}, which jspec cannot read"
            ) from None
    entries = {
        name: (
            BIN_FILE,
            tuple(t.shape),
            _TORCH_DTYPES.get(str(state[name].dtype).removeprefix("torch."), "?"),
        )
        for name, t in tensors.items()
    }
    return TensorSource(directory, entries, tensors)


def _shard_file(index: str, tensor: Any, file: Any) -> str:
    """A shard named by the index's ``weight_map``: a plain file name inside the model directory.

    The NAME is checked, not the resolved target: in a Hugging Face cache snapshot every file is
    a symlink into ``../../blobs``, which stays allowed; ``../x.safetensors``, an absolute path
    or a sub-directory in the name is refused (the index would load a file from elsewhere).
    """
    if not isinstance(tensor, str) or not isinstance(file, str):
        raise ValueError(f"{index}: weight_map[{tensor!r}]={file!r} must map a name to a file name")
    if file in ("", ".", "..") or "/" in file or "\\" in file or os.path.isabs(file):
        raise ValueError(
            f"{index}: weight_map[{tensor!r}]={file!r} is not a file name inside the model "
            "directory (shards must sit beside the index)"
        )
    return file


def _indexed_source(directory: str, index: str) -> TensorSource:
    raw = read_json_object(index)
    weight_map = raw.get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(
            f"{index}: weight_map must be an object of tensor name -> shard file, "
            f"got {'nothing' if weight_map is None else type(weight_map).__name__}"
        )
    weight_map = {name: _shard_file(index, name, file) for name, file in weight_map.items()}
    headers = _read_headers(directory, sorted(set(weight_map.values())))
    for name, file in weight_map.items():
        if name not in headers[file]:
            raise ValueError(f"{index}: weight_map maps {name!r} to {file}, which does not hold it")
    return TensorSource(directory, _merge(directory, headers, weight_map))


def open_source(directory: str | os.PathLike) -> TensorSource:
    """The :class:`TensorSource` of a model directory (headers only; weights stay on disk).

    Raises:
      ValueError naming the file: no weights found; a bad index (not JSON, no ``weight_map``
        object, a shard name outside the directory, a shard that is missing or does not hold
        the tensor mapped to it); a file that is not safetensors; a tensor held by two files
        without an index; a ``pytorch_model.bin`` without torch or refused by
        ``torch.load(weights_only=True)``.
    """
    directory = os.fspath(directory)
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        return _indexed_source(directory, index)
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.safetensors")))
    if files:
        return TensorSource(directory, _merge(directory, _read_headers(directory, files), {}))
    if os.path.isfile(os.path.join(directory, BIN_FILE)):
        return _bin_source(directory)
    raise ValueError(
        f"no weights in {directory}: expected model.safetensors, shards with "
        f"{INDEX_FILE}, or {BIN_FILE}"
    )
