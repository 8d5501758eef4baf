"""Text <-> token ids through a model directory's ``tokenizer.json`` (``tokenizers`` library).

BOS: by default the tokenizer's own post-processor decides (Llama-2 and Llama-3 files add their
BOS there, as transformers does); ``add_bos=True`` / ``False`` forces it on / off. The chat
template (``chat_template.jinja`` beside ``tokenizer.json``, else ``tokenizer_config.json``'s
``chat_template``: transformers' order) is rendered with jinja2 when jinja2 is installed
(optional) the way transformers renders it: its sandboxed environment (``trim_blocks``,
``lstrip_blocks``, loop controls, its ``tojson``, ``raise_exception`` and ``strftime_now``),
the named special tokens, ``tools`` / ``documents`` None, and the text encoded without added
special tokens.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Sequence
from typing import Any

from jspec.models._json import read_json_object
from jspec.models.hf_config import LlamaConfig

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The named special tokens transformers passes to a chat template (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


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
        template_path = os.path.join(directory, CHAT_TEMPLATE_FILE)
        if os.path.isfile(template_path):  # transformers: the file wins over the config's
            try:
                with open(template_path, encoding="utf-8") as f:
                    tok_cfg = {**tok_cfg, "chat_template": f.read()}
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"{template_path}: not a readable UTF-8 text file ({e})") from None
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
            raise ValueError(
                f"no chat template ({TOKENIZER_CONFIG_FILE} has no chat_template and there is "
                f"no {CHAT_TEMPLATE_FILE})"
            )
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
        template = _compile_template(self._chat_template())
        specials = {}
        for name in SPECIAL_TOKEN_NAMES:
            value = _token_text(self.tokenizer_config.get(name))
            if value is not None:
                specials[name] = str(value)
        # transformers drops a message's None values (templates test for missing keys).
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            text = template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **specials,
            )
        except Exception as e:  # noqa: BLE001 (the model directory's code: any error is its)
            raise ValueError(f"chat template: {e}") from None
        return self.encode(text, add_bos=False)


def _compile_template(source: str) -> Any:
    """``source`` compiled in transformers' chat-template environment (ImportError without
    jinja2; ValueError naming the syntax error)."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError as e:
        raise ImportError(
            "chat templates need jinja2 (pip install jinja2); or pass the prompt as plain text"
        ) from e

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        # transformers' filter: jinja's own escapes HTML characters
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"chat template: line {e.lineno}: {e.message}") from None
