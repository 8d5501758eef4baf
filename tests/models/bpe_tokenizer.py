"""A tokenizer directory built here (nothing downloaded): a byte-level BPE trained on a few
words, so multi-byte characters span several tokens, with Llama-3-style special tokens and a
chat template; and transformers' ids for a chat, to compare against."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CORPUS = "hello world, jax is fast. café naïve 日本語 🙂 the user asks"
VOCAB = 300
# Llama-3.1's shape: a system block with the tools when there are any, tojson, a namespace,
# loop controls, trim.
LLAMA3 = (
    "{{- bos_token }}{% set ns = namespace(n=0) %}"
    "{% if tools is not none %}<|start_header_id|>system<|end_header_id|>\n\n"
    "{{ tools | tojson(indent=2) }}<|eot_id|>{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
MESSAGES = [{"role": "user", "content": "  hello 日本語 🙂 "}]


def write_bpe_tokenizer(directory: Path, template: str, *, as_file: bool = False) -> Path:
    """``directory/tokenizer.json`` (byte-level BPE of :data:`VOCAB` ids trained on
    :data:`CORPUS`) and ``tokenizer_config.json`` with ``template``, or (``as_file``) the
    template in ``chat_template.jinja`` and another in the config."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS] * 10, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": SPECIALS[0], "eos_token": SPECIALS[3]}
    if as_file:  # transformers: chat_template.jinja wins over the config's template
        (directory / "chat_template.jinja").write_text(template)
        config["chat_template"] = PLAIN
    else:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def transformers_chat_ids(directory: Path, messages: list[dict]) -> list[int]:
    """``transformers``' ``apply_chat_template`` ids (the generation prompt added)."""
    import transformers

    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(directory))
    return list(
        tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
