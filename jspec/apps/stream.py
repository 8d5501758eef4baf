"""Incremental detokenization: the text of a growing list of token ids, piece by piece, without
splitting a multi-byte character across pieces (TGI's / vLLM's prefix-offset scheme).

Each :meth:`TextStream.push` decodes only a short window: the ids from ``prefix`` on, minus
the text of ``prefix:read`` (decoded on its own, so a tokenizer that drops a leading space or
merges across a boundary treats both decodes alike). A window whose text ends in U+FFFD (an
incomplete UTF-8 sequence of byte-level tokens) is held back until more ids complete it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

_INCOMPLETE = "\ufffd"


class TextStream:
    """Text pieces of ``ids`` as they arrive.

    Args:
      decode: ``decode(ids) -> str`` (e.g. ``jspec.models.Tokenizer.decode``).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # ids[prefix:read]: the context of the next window, already emitted
        self._read = 0  # ids[:read] are emitted

    def push(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids``; the text they complete ("" while a character is incomplete)."""
        self.ids.extend(int(i) for i in new_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end comes out as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        if len(text) <= len(before) or (text.endswith(_INCOMPLETE) and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(before) :]


class StreamPrinter:
    """One request's text (without a tokenizer: its ids, space-separated) on stdout as it
    grows, then a newline: what ``print(text)`` prints at the end, a piece at a time."""

    def __init__(self, tokenizer: Any) -> None:
        self.text = TextStream(tokenizer.decode) if tokenizer is not None else None
        self.num_ids = 0

    def push(self, new_ids: list[int]) -> None:
        if self.text is not None:
            piece = self.text.push(new_ids)
        else:
            piece = " ".join(str(t) for t in new_ids)
            piece = (" " if self.num_ids and piece else "") + piece
        self.num_ids += len(new_ids)
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()

    def finish(self) -> None:
        sys.stdout.write((self.text.flush() if self.text is not None else "") + "\n")
        sys.stdout.flush()
