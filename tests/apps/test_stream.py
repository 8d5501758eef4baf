"""Incremental detokenization (issue 25's streaming): the pieces concatenate to the text, and no
piece splits a multi-byte character (byte-level tokens of one character are held back)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from bpe_tokenizer import PLAIN, write_bpe_tokenizer

from jspec.apps.stream import TextStream
from jspec.models.tokenizer import Tokenizer


def test_text_stream_never_splits_a_character(tmp_path):
    tok = Tokenizer.from_dir(write_bpe_tokenizer(tmp_path / "tok", PLAIN))
    ids = tok.encode("hello 日本語 🙂 café naïve")
    stream = TextStream(tok.decode)
    pieces = [stream.push([i]) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tok.decode(ids)
    assert "" in pieces[:-1] and not any("\ufffd" in p for p in pieces)  # some held back
