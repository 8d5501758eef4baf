"""JSON objects whose keys are unique: a repeated key is an error, not the last one winning.

Shared by the checkpoint readers (``jspec.models._json``) and the prompts file
(``jspec.apps.prompts_file``); each adds its own file / line prefix to the message.
"""

from __future__ import annotations

import json
from typing import Any


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def loads_unique_keys(text: str) -> Any:
    """``json.loads(text)``, but a key given twice in one object raises ``ValueError``
    (``duplicate key 'name'``); ``json.JSONDecodeError`` (a ``ValueError``) as usual."""
    return json.loads(text, object_pairs_hook=_unique_keys)
