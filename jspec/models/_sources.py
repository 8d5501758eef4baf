"""Where a checkpoint directory's tensors live: names, shapes, dtypes, and reading them.

* ``model.safetensors.index.json`` (``weight_map``: name -> shard file), else every
  ``*.safetensors`` file of the directory; headers are read up front (no weights), tensors later
  one at a time with ``safe_open(..., framework="np")``.
* ``pytorch_model.bin`` (some published EAGLE heads): only through
  ``torch.load(weights_only=True)`` when torch is importable (never a plain unpickle); otherwise a
  ``ValueError`` tells the user how to convert it to safetensors once.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

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
        from safetensors import safe_open

        with safe_open(os.path.join(self.directory, file), framework="np") as f:
            for name in names:
                yield name, f.get_tensor(name)


def _safetensors_entries(directory: str, files: list[str]) -> dict[str, Any]:
    try:
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - safetensors is a dependency
        raise ImportError(
            "reading checkpoints needs the 'safetensors' package (pip install safetensors)"
        ) from e
    entries: dict[str, Any] = {}
    for file in files:
        path = os.path.join(directory, file)
        if not os.path.isfile(path):
            raise ValueError(f"shard {file!r} named by {INDEX_FILE} is missing from {directory}")
        with safe_open(path, framework="np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                part = f.get_slice(name)
                entries[name] = (file, tuple(int(d) for d in part.get_shape()), part.get_dtype())
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
    state = torch.load(path, map_location="cpu", weights_only=True)
    tensors = {name: _torch_to_numpy(t) for name, t in state.items()}
    entries = {
        name: (
            BIN_FILE,
            tuple(t.shape),
            _TORCH_DTYPES.get(str(state[name].dtype).removeprefix("torch."), "?"),
        )
        for name, t in tensors.items()
    }
    return TensorSource(directory, entries, tensors)


def open_source(directory: str | os.PathLike) -> TensorSource:
    """The :class:`TensorSource` of a model directory (headers only; weights stay on disk).

    Raises:
      ValueError: no weights found, a shard named by the index is missing, or a
        ``pytorch_model.bin`` without torch.
    """
    directory = os.fspath(directory)
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        entries = _safetensors_entries(directory, files)
        return TensorSource(
            directory, {n: e for n, e in entries.items() if weight_map.get(n, e[0]) == e[0]}
        )
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.safetensors")))
    if files:
        return TensorSource(directory, _safetensors_entries(directory, files))
    if os.path.isfile(os.path.join(directory, BIN_FILE)):
        return _bin_source(directory)
    raise ValueError(
        f"no weights in {directory}: expected model.safetensors, shards with "
        f"{INDEX_FILE}, or {BIN_FILE}"
    )
