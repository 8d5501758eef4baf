"""``jspec generate --prompts-file``: JSON lines in, checked line by line before anything loads.

Each non-blank line is one JSON object, one request::

    {"prompt": "text", "max_new_tokens": 64, "temperature": 0.7, "seed": 1}
    {"prompt_ids": [1, 2, 3]}

``prompt`` (text, needs the model's tokenizer) or ``prompt_ids`` (token ids), exactly one;
optional ``max_new_tokens`` (else the ``--max-new-tokens`` flag) and ``temperature``, ``top_k``,
``top_p``, ``min_p``, ``seed`` (each overrides its flag; a line without a seed uses ``--seed``,
or draws its own when that is not given either). Blank lines are skipped (no output line);
any other key is an error. Every error is an :class:`InputError` naming the file, the line
number and the field (``prompts.jsonl:3: top_p=1.5 must be in (0, 1] (1 is off)``).

The checks come in three passes, each before what it guards: :func:`read_prompts_file` (JSON,
keys, types, sampling values) before the tokenizer loads, :func:`encode_prompts` (text -> ids,
``--chat``) before the model's config is read, :func:`check_prompts` (ids in the vocabulary,
the model's ``max_position_embeddings``) before a weight is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from jspec._strict_json import loads_unique_keys
from jspec.engine.inputs import InputError, check_count, check_token_ids
from jspec.engine.sampling_params import SamplingParams

STDIN = "-"
SAMPLING_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams))
KEYS = ("prompt", "prompt_ids", "max_new_tokens", *SAMPLING_KEYS)


@dataclasses.dataclass
class PromptLine:
    """One request of a prompts file."""

    index: int  # its place among the file's requests (blank lines skipped), 0-based
    where: str  # "FILE:LINE", the prefix of its error messages
    text: str | None  # the "prompt" text, or None
    ids: list[int] | None  # "prompt_ids", or the encoded text (None until encode_prompts)
    max_new_tokens: int  # the line's, else the --max-new-tokens flag's
    sampling: SamplingParams  # resolved: a sampled line has its seed

    @property
    def token_ids(self) -> list[int]:
        """The prompt's ids: ``prompt_ids``, or the text's once :func:`encode_prompts` ran."""
        if self.ids is None:
            raise ValueError(f"{self.where}: ids=None: encode_prompts fills in a text prompt's ids")
        return self.ids


def _read_bytes(path: str) -> tuple[bytes, str]:
    """The file's bytes and the name its messages use (``<stdin>`` for ``-``)."""
    if path == STDIN:
        stream = getattr(sys.stdin, "buffer", None)
        data = stream.read() if stream is not None else sys.stdin.read().encode("utf-8")
        return data, "<stdin>"
    try:
        with open(path, "rb") as f:
            return f.read(), path
    except OSError as e:
        raise InputError(f"--prompts-file {path}: {e.strerror or e}") from None


def read_prompts_file(
    path: str, *, base: SamplingParams, max_new_tokens: int | None
) -> list[PromptLine]:
    """Parse and check every line of ``path`` (``-``: stdin) without the model.

    Args:
      base: the sampling flags (unresolved: a line without a seed draws its own unless the
        flags give one).
      max_new_tokens: the ``--max-new-tokens`` flag, or None (then every line must give one).
    """
    data, name = _read_bytes(path)
    lines: list[PromptLine] = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        where = f"{name}:{number}"
        try:
            text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise InputError(
                f"{where}: not valid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"
            ) from None
        if not text.strip():
            continue
        try:
            obj = loads_unique_keys(text)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        except ValueError as e:  # a duplicate key
            raise InputError(f"{where}: {e}") from None
        lines.append(_parse_line(obj, len(lines), where, base, max_new_tokens))
    if not lines:
        raise InputError(f"{name}: no prompts (every line is blank)")
    return lines


def _parse_line(
    obj: Any, index: int, where: str, base: SamplingParams, max_new_tokens: int | None
) -> PromptLine:
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(KEYS))
    if unknown:
        raise InputError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(KEYS)})")
    has_text, has_ids = "prompt" in obj, "prompt_ids" in obj
    if has_text == has_ids:
        what = "both" if has_text else "neither"
        raise InputError(f'{where}: give "prompt" (text) or "prompt_ids" (token ids), not {what}')
    text, ids = obj.get("prompt"), obj.get("prompt_ids")
    try:
        if has_text:
            _check_text(text)
        else:
            ids = _check_ids(ids)
        if "max_new_tokens" in obj:
            max_new_tokens = check_count("max_new_tokens", obj["max_new_tokens"])
        elif max_new_tokens is None:
            raise InputError("no max_new_tokens (give it on the line or --max-new-tokens)")
        sampling = {k: obj[k] for k in SAMPLING_KEYS if k in obj}
        params = SamplingParams.from_dict(sampling, base=base).resolved()
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    return PromptLine(index, where, text, ids, max_new_tokens, params)


def _check_text(text: Any) -> None:
    from jspec.models.tokenizer import check_text

    if not isinstance(text, str):
        raise InputError(f"prompt={text!r} must be a string (token ids go in prompt_ids)")
    if not text:
        raise InputError("prompt is empty")
    try:
        check_text(text, "prompt")
    except ValueError as e:
        raise InputError(str(e)) from None


def _check_ids(ids: Any) -> list[int]:
    if not isinstance(ids, list):
        raise InputError(f"prompt_ids={ids!r} must be a list of token ids")
    if not ids:
        raise InputError("prompt_ids is empty: give at least one token id")
    for i, tok in enumerate(ids):
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise InputError(f"prompt_ids[{i}]={tok!r} must be an int token id")
        if tok < 0:
            raise InputError(f"prompt_ids[{i}]={tok} must be >= 0")
    return ids


def encode_prompt(tokenizer: Any, text: str, *, chat: bool) -> list[int]:
    """``text``'s ids: plain, or (``chat``) as one user message through the chat template with
    the generation prompt added (``InputError`` when the template is missing or raises)."""
    if not chat:
        ids = tokenizer.encode(text)
    else:
        try:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        except (ValueError, ImportError) as e:
            raise InputError(f"--chat: {e}") from None
    if not ids:
        raise InputError("prompt encodes to no tokens")
    return ids


def encode_prompts(lines: list[PromptLine], tokenizer: Any, model_dir: str, *, chat: bool) -> None:
    """Fill in the ids of the text lines (``--chat``: through the chat template)."""
    for line in lines:
        if line.text is None:
            if chat:
                raise InputError(f"{line.where}: --chat needs a text prompt, not prompt_ids")
            continue
        if tokenizer is None:
            raise InputError(
                f"{line.where}: prompt needs {os.path.join(model_dir, 'tokenizer.json')}; "
                "or give prompt_ids"
            )
        try:
            line.ids = encode_prompt(tokenizer, line.text, chat=chat)
        except InputError as e:
            raise InputError(f"{line.where}: {e}") from None


def check_prompts(lines: Sequence[PromptLine], target: Any) -> None:
    """Every line's ids in ``[0, target.vocab_size)`` and its prompt + max_new_tokens within
    the model's ``max_position_embeddings`` (when ``target.config`` has one)."""
    limit = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    for line in lines:
        field = "prompt_ids" if line.text is None else "prompt (encoded)"
        try:
            check_token_ids(field, line.token_ids, target.vocab_size)
        except InputError as e:
            raise InputError(f"{line.where}: {e}") from None
        if limit is not None and len(line.token_ids) + line.max_new_tokens > limit:
            raise InputError(
                f"{line.where}: len(prompt) + max_new_tokens = {len(line.token_ids)} + "
                f"{line.max_new_tokens} exceeds the model's max_position_embeddings={limit}"
            )
