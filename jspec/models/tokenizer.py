"""Text <-> token ids through a model directory's ``tokenizer.json`` (``tokenizers`` library).

BOS: by default the tokenizer's own post-processor decides (Llama-2 and Llama-3 files add their
BOS there, as transformers does); ``add_bos=True`` / ``False`` forces it on / off. The chat
template (``tokenizer_config.json``'s ``chat_template``) is rendered with jinja2 when jinja2 is
installed (optional; transformers' sandboxed environment and its ``raise_exception`` helper).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from jspec.models._json import read_json_object
from jspec.models.hf_config import LlamaConfig

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def _token_text(value: Any) -> str | None:
    """``tokenizer_config.json`` spells special tokens as strings or ``{"content": ...}``."""
    return value.get("content") if isinstance(value, dict) else value


def check_text(text: str, name: str = "text") -> str:
    """``text`` if it can be encoded as UTF-8; ValueError naming ``name`` otherwise (a command
    line argument of invalid UTF-8 bytes arrives as lone surrogates, which ``tokenizers``
    rejects with a bare exception)."""
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = text.encode("utf-8", "surrogateescape")[e.start : e.start + 4]
        raise ValueError(
            f"{name} is not valid UTF-8 (at character {e.start}: {raw!r}); give UTF-8 text"
        ) from None
    return text


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the model's BOS / EOS ids.

    Args:
      tokenizer: the loaded ``tokenizers.Tokenizer``.
      bos_token_ids, eos_token_ids: from the model config (first BOS is the one prepended).
      tokenizer_config: parsed ``tokenizer_config.json`` (chat template, token strings) or {}.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        bos_token_ids: Sequence[int] = (),
        eos_token_ids: Sequence[int] = (),
        tokenizer_config: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.bos_token_ids = tuple(bos_token_ids)
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer_config = tokenizer_config or {}

    @classmethod
    def from_dir(cls, directory: str | os.PathLike, config: LlamaConfig | None = None) -> Tokenizer:
        """Load ``directory/tokenizer.json`` (+ ``tokenizer_config.json`` when present).

        Raises:
          ValueError naming the file: no ``tokenizer.json`` in the directory, a file the
            ``tokenizers`` library cannot read, a ``tokenizer_config.json`` that is not a JSON
            object.
        """
        from tokenizers import Tokenizer as HFTokenizer

        directory = os.fspath(directory)
        path = os.path.join(directory, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise ValueError(
                f"{directory} has no {TOKENIZER_FILE}: pass token ids instead "
                "(--prompt-ids) or add the model's tokenizer.json"
            )
        tok_cfg: dict[str, Any] = {}
        cfg_path = os.path.join(directory, TOKENIZER_CONFIG_FILE)
        if os.path.isfile(cfg_path):
            tok_cfg = read_json_object(cfg_path)
        try:
            tokenizer = HFTokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception)
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{path}: not a readable tokenizers file ({reason})") from None
        return cls(
            tokenizer,
            bos_token_ids=config.bos_token_ids if config else (),
            eos_token_ids=config.eos_token_ids if config else (),
            tokenizer_config=tok_cfg,
        )

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (added tokens included)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``.

        Args:
          add_bos: None: the tokenizer's post-processor decides; True: exactly one leading BOS
            (the config's first ``bos_token_id``); False: no special tokens added.
        """
        check_text(text)
        if add_bos is None:
            return list(self.tokenizer.encode(text, add_special_tokens=True).ids)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        if not add_bos:
            return ids
        if not self.bos_token_ids:
            raise ValueError("add_bos=True but the model config has no bos_token_id")
        return ids if ids[:1] == [self.bos_token_ids[0]] else [self.bos_token_ids[0], *ids]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (special tokens dropped by default)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def is_eos(self, token_id: int) -> bool:
        return int(token_id) in self.eos_token_ids

    def _chat_template(self) -> str:
        template = self.tokenizer_config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if not template:
            raise ValueError(f"{TOKENIZER_CONFIG_FILE} has no chat_template")
        return template

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a chat (``[{"role": ..., "content": ...}]``) rendered by the template.

        The rendered text carries its own special tokens (BOS included), so it is encoded
        without adding any.

        Raises:
          ValueError: no template, or the template raised (``raise_exception``).
          ImportError: jinja2 is not installed.
        """
        try:
            import jinja2.sandbox
        except ImportError as e:
            raise ImportError(
                "chat templates need jinja2 (pip install jinja2); or pass the prompt as plain text"
            ) from e

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        text = env.from_string(self._chat_template()).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=_token_text(self.tokenizer_config.get("bos_token")) or "",
            eos_token=_token_text(self.tokenizer_config.get("eos_token")) or "",
        )
        return self.encode(text, add_bos=False)
