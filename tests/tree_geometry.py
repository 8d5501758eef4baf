"""Test helpers: a :class:`jspec.config.TreeGeometry` from loose keyword sizes.

The ops take ``geometry=``; tests spell the sizes they vary. Fields an op does not read default
to 1 (a one-step, one-node tree is valid for every topk and page size).
"""

from __future__ import annotations

from typing import Any

from jspec.config import TreeGeometry

FIELDS = ("topk", "num_steps", "num_draft_tokens", "page_size")


def geom(
    *, topk: int = 1, num_steps: int = 1, num_draft_tokens: int = 1, page_size: int = 1
) -> TreeGeometry:
    """``TreeGeometry`` with unread fields 1."""
    return TreeGeometry(
        topk=topk, num_steps=num_steps, num_draft_tokens=num_draft_tokens, page_size=page_size
    )


def with_geometry(kw: dict[str, Any]) -> dict[str, Any]:
    """``kw`` with its ``topk`` / ``num_steps`` / ``num_draft_tokens`` / ``page_size`` entries
    replaced by one ``geometry=`` (built here: a bad size raises its ``ValueError`` here)."""
    sizes = {k: v for k, v in kw.items() if k in FIELDS}
    rest = {k: v for k, v in kw.items() if k not in FIELDS}
    return rest | {"geometry": geom(**sizes)} if sizes else rest
