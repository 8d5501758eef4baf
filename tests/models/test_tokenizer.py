"""Tokenizer wrapper over a tiny tokenizer.json built here (nothing downloaded)."""

from __future__ import annotations

import json

import pytest
from bpe_tokenizer import LLAMA3, MESSAGES, PLAIN, transformers_chat_ids, write_bpe_tokenizer
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, processors

from jspec.models import LlamaConfig
from jspec.models.tokenizer import Tokenizer

WORDS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "hello", "world", "jax", "is", "fast"]
CONFIG = LlamaConfig(
    vocab_size=len(WORDS),
    hidden_size=8,
    intermediate_size=8,
    num_layers=1,
    num_heads=1,
    num_kv_heads=1,
    head_dim=8,
    bos_token_ids=(1,),
    eos_token_ids=(2,),
)
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _write(directory, *, adds_bos=True, template=TEMPLATE):
    tok = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<|user|>", "<|assistant|>"])
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 1)]
        )
    tok.save(str(directory / "tokenizer.json"))
    tok_cfg = {"bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    if template is not None:
        tok_cfg["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return directory


@pytest.mark.parametrize("adds_bos", [True, False], ids=["post-processor-bos", "no-bos"])
def test_encode_decode_and_bos(tmp_path, adds_bos):
    tok = Tokenizer.from_dir(_write(tmp_path, adds_bos=adds_bos), CONFIG)
    body = [5, 6, 7, 8, 9]
    assert tok.encode("hello world jax is fast") == ([1] if adds_bos else []) + body
    assert tok.encode("hello world jax is fast", add_bos=True) == [1, *body]
    assert tok.encode("hello world jax is fast", add_bos=False) == body
    assert tok.decode([1, *body, 2]) == "hello world jax is fast"
    assert "<s>" in tok.decode([1, 5], skip_special_tokens=False)
    assert tok.is_eos(2) and not tok.is_eos(5) and tok.vocab_size == len(WORDS)


def test_chat_template(tmp_path):
    pytest.importorskip("jinja2")
    tok = Tokenizer.from_dir(_write(tmp_path), CONFIG)
    ids = tok.apply_chat_template([{"role": "user", "content": "hello jax"}])
    assert ids == [1, 3, 5, 7, 4]
    with pytest.raises(ValueError, match="unknown role system"):
        tok.apply_chat_template([{"role": "system", "content": "hi"}])


def test_missing_files(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path, CONFIG)
    tok = Tokenizer.from_dir(_write(tmp_path, template=None))
    with pytest.raises(ValueError, match="chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "hello"}])
    with pytest.raises(ValueError, match="bos_token_id"):
        tok.encode("hello", add_bos=True)  # no config: no BOS id


# ---- issue 22: bad tokenizer files and text name the file / the field ---------------------------
@pytest.mark.parametrize(
    "file,text,match",
    [
        pytest.param(
            "tokenizer.json", "{not a tokenizer", "not a readable tokenizers file", id="json"
        ),
        pytest.param(
            "tokenizer.json", '{"version": "1.0"}', "not a readable tokenizers", id="fields"
        ),
        pytest.param("tokenizer_config.json", "{,", r"not valid JSON \(.*line 1", id="config-json"),
        pytest.param("tokenizer_config.json", "[]", "expected a JSON object", id="config-list"),
    ],
)
def test_corrupt_tokenizer_files_name_the_file(tmp_path, file, text, match):
    _write(tmp_path)
    (tmp_path / file).write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        Tokenizer.from_dir(tmp_path, CONFIG)
    assert str(info.value).startswith(str(tmp_path / file)) and "\n" not in str(info.value)


def test_text_that_is_not_utf8_is_named(tmp_path):
    tok = Tokenizer.from_dir(_write(tmp_path), CONFIG)
    bad = b"hello \xff world".decode("utf-8", "surrogateescape")  # how argv carries it
    with pytest.raises(ValueError, match=r"text is not valid UTF-8 \(at character 6: b'\\xff"):
        tok.encode(bad)


@pytest.mark.parametrize("as_file", [False, True], ids=["tokenizer_config", "chat_template.jinja"])
@pytest.mark.parametrize("template", [LLAMA3, PLAIN], ids=["llama3", "plain"])
def test_chat_template_ids_equal_transformers(tmp_path, template, as_file):
    """transformers' rendering (its environment, special tokens, tools None, no added special
    tokens; ``chat_template.jinja`` over the config's template): the same ids."""
    pytest.importorskip("jinja2")
    pytest.importorskip("transformers")
    directory = write_bpe_tokenizer(tmp_path / "tok", template, as_file=as_file)
    messages = [*MESSAGES, {"role": "skip", "content": "x"}]
    ours = Tokenizer.from_dir(directory).apply_chat_template(messages)
    assert ours == transformers_chat_ids(directory, messages)
    assert len(ours) > len(Tokenizer.from_dir(directory).encode(MESSAGES[0]["content"]))
