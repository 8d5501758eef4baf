"""``jspec generate --chat`` (issue 25): the prompt ids are transformers' ``apply_chat_template``
ids, for ``--prompt`` and for a prompts file's lines; the streamed text is the decoded tokens;
a missing or broken template is one error line before anything loads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from bpe_tokenizer import LLAMA3, MESSAGES, VOCAB, transformers_chat_ids, write_bpe_tokenizer
from test_checkpoint_errors import RAW, llama_tensors, write_llama
from test_cli_input import _one_line, no_weight_read_no_compile  # noqa: F401

from jspec.apps import generate
from jspec.models.tokenizer import Tokenizer


def _model(tmp_path: Path) -> Path:
    model = write_bpe_tokenizer(tmp_path / "model", LLAMA3)
    return write_llama(model, llama_tensors(vocab=VOCAB), {**RAW, "vocab_size": VOCAB})


def test_chat_prompt_and_prompts_file_use_the_template(tmp_path, capsys):
    """``--chat --prompt``: the prompt ids are transformers' and the streamed text line is the
    decoded tokens; ``--chat --prompts-file``: each text line templated the same way."""
    model = _model(tmp_path)
    want = transformers_chat_ids(model, MESSAGES)
    flags = ["--model", str(model), "--chat", "--max-new-tokens", "5", "--no-progress"]
    code = generate.main([*flags, "--prompt", MESSAGES[0]["content"], "--json"])
    out = capsys.readouterr().out.splitlines()
    result = json.loads(out[-1])
    assert code == 0 and result["prompt_ids"] == want
    tok = Tokenizer.from_dir(model)
    assert out[0] == result["text"] == tok.decode(result["token_ids"])
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": MESSAGES[0]["content"]}) + "\n")
    code = generate.main([*flags, "--prompts-file", str(path)])
    line = json.loads(capsys.readouterr().out)
    assert code == 0 and line["num_prompt_tokens"] == len(want)
    assert line["token_ids"] == result["token_ids"] and line["text"] == result["text"]


@pytest.mark.usefixtures("no_weight_read_no_compile")
@pytest.mark.parametrize(
    "template,pattern",
    [
        pytest.param(None, r"--chat: no chat template \(tokenizer_config\.json has no", id="none"),
        pytest.param("{% if %}", r"--chat: chat template: line 1: ", id="syntax"),
        pytest.param("{{ raise_exception('no users') }}", r"chat template: no users", id="raises"),
    ],
)
def test_chat_template_errors_are_one_line(tmp_path, capsys, template, pattern):
    model = _model(tmp_path)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    if template is not None:
        config["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    argv = ["--model", str(model), "--chat", "--prompt", "hello", "--max-new-tokens", "2"]
    _one_line(generate.main(argv), capsys.readouterr().err, "generate", pattern)
