"""Strict reading of a checkpoint's JSON files (``config.json``, ``generation_config.json``,
``model.safetensors.index.json``, ``tokenizer_config.json``) and of their typed fields.

Every error is a ``ValueError`` naming the file (:func:`read_json_object`, :func:`in_file`) and
the field: ``hidden_size=16.9 must be an integer`` rather than a silent ``int(16.9) == 16``,
``rope_theta='inf' must be a finite number`` rather than ``float("inf")``, a duplicated key
rather than the last one winning. ``null`` counts as absent for optional fields (transformers
writes unset optional fields as ``null``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from typing import Any

from jspec._strict_json import loads_unique_keys

_MISSING = object()


def read_json_object(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object stored in ``path``.

    Raises:
      ValueError naming ``path``: unreadable, not UTF-8, not JSON (with line and column), a key
        given twice, or a top-level value that is not an object.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
        obj = loads_unique_keys(text)
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    except (ValueError, RecursionError) as e:  # a duplicated key; absurd nesting
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level, got {_kind(obj)}")
    return obj


@contextlib.contextmanager
def in_file(path: str | os.PathLike) -> Iterator[None]:
    """Prefix a ``ValueError`` raised inside with ``path: `` (unless it names the file)."""
    path = os.fspath(path)
    try:
        yield
    except ValueError as e:
        if path in str(e):
            raise
        raise ValueError(f"{path}: {e}") from None


@contextlib.contextmanager
def in_object(key: str) -> Iterator[None]:
    """Prefix a ``ValueError`` raised inside with ``key.`` (the enclosing object's name)."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"{key}.{e}") from None


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    return names.get(type(value), "null" if value is None else f"a {type(value).__name__}")


def _get(raw: dict[str, Any], key: str, default: Any) -> Any:
    value = raw.get(key)
    if value is None:
        if default is _MISSING:
            raise ValueError(f"{key} is missing (or null)")
        return default
    return value


def get_int(raw: dict[str, Any], key: str, default: Any = _MISSING, *, minimum: int = 1) -> Any:
    """``raw[key]`` as a JSON integer ``>= minimum`` (``default`` when absent or null)."""
    value = _get(raw, key, default)
    if value is default and default is not _MISSING:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}={value!r} must be an integer >= {minimum}, got {_kind(value)}")
    if value < minimum:
        raise ValueError(f"{key}={value} must be an integer >= {minimum}")
    return value


def get_float(raw: dict[str, Any], key: str, default: Any = _MISSING, *, positive: bool = True):
    """``raw[key]`` as a finite JSON number (``> 0`` when ``positive``)."""
    value = _get(raw, key, default)
    if value is default and default is not _MISSING:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key}={value!r} must be a finite number, got {_kind(value)}")
    if positive and not value > 0:
        raise ValueError(f"{key}={value!r} must be > 0")
    return float(value)


def get_bool(raw: dict[str, Any], key: str, default: bool) -> bool:
    """``raw[key]`` as a JSON boolean (``default`` when absent or null)."""
    value = _get(raw, key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{key}={value!r} must be true or false, got {_kind(value)}")
    return value


def get_str(raw: dict[str, Any], key: str, default: Any = _MISSING) -> Any:
    """``raw[key]`` as a JSON string (``default`` when absent or null)."""
    value = _get(raw, key, default)
    if value is default and default is not _MISSING:
        return value
    if not isinstance(value, str):
        raise ValueError(f"{key}={value!r} must be a string, got {_kind(value)}")
    return value


def get_object(raw: dict[str, Any], key: str) -> dict[str, Any] | None:
    """``raw[key]`` as a JSON object, or None when absent or null."""
    value = raw.get(key)
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{key}={value!r} must be a JSON object (or null), got {_kind(value)}")
    return value


def get_int_list(
    raw: dict[str, Any], key: str, *, minimum: int = 0, scalar_ok: bool = False
) -> tuple[int, ...] | None:
    """``raw[key]`` as a tuple of integers ``>= minimum`` (one integer too when ``scalar_ok``),
    or None when absent or null."""
    value = raw.get(key)
    if value is None:
        return None
    items = [value] if scalar_ok and not isinstance(value, list) else value
    if not isinstance(items, list):
        raise ValueError(f"{key}={value!r} must be a list of integers, got {_kind(value)}")
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < minimum:
            raise ValueError(f"{key}={value!r}: every entry must be an integer >= {minimum}")
    return tuple(items)


def get_token_ids(raw: dict[str, Any], key: str, vocab_size: int) -> tuple[int, ...] | None:
    """``bos_token_id`` / ``eos_token_id`` (an int or a list), each id inside the vocabulary;
    None when absent or null."""
    ids = get_int_list(raw, key, scalar_ok=True)
    for i in ids or ():
        if i >= vocab_size:
            raise ValueError(
                f"{key}={raw[key]!r}: id {i} is outside the vocabulary [0, {vocab_size})"
            )
    return ids


def get_dtype(raw: dict[str, Any], override: str | None, choices: Any) -> str:
    """The dtype name: ``override``, else the file's ``dtype`` / ``torch_dtype`` (default
    float32); ValueError unless it is one of ``choices``."""
    if override is not None:
        name = override
    else:
        key = "dtype" if raw.get("dtype") is not None else "torch_dtype"
        name = get_str(raw, key, "float32").removeprefix("torch.")
    if name not in choices:
        raise ValueError(f"dtype={name!r} is not supported: use one of {sorted(choices)}")
    return name
