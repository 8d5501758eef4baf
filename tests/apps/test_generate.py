"""``jspec generate`` end to end over the toy models (a loader hook) and, when ``jspec.models``
is present, over a tiny Hugging Face Llama checkpoint written by transformers."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_helpers import DRAFT, TARGET, tiny_model

from jspec.apps.generate import main, parse_prompt_ids
from jspec.engine.inputs import InputError
from jspec.engine.reference import dense_greedy_generate

PROMPT = [5, 17, 3, 42, 8, 11, 60]
FLAGS = [
    "--model",
    "toy",
    "--prompt-ids",
    " ".join(map(str, PROMPT)),
    "--max-new-tokens",
    "12",
    "--page-size",
    "4",
    "--topk",
    "2",
    "--steps",
    "2",
    "--draft-tokens",
    "4",
    "--json",
]


def _toy_loader(model_dir, draft_dir, dtype, say):
    del model_dir, dtype
    say("toy models")
    params, draft = tiny_model()
    return (TARGET, params, DRAFT, draft) if draft_dir else (TARGET, params, None, None)


def _run(flags, capsys):
    code = main(flags, loader=_toy_loader)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_greedy_and_spec_equal_the_dense_oracle(capsys):
    params, _ = tiny_model()
    oracle = dense_greedy_generate(TARGET, params, PROMPT, 12)
    code, out, err = _run(FLAGS, capsys)
    assert code == 0, err
    greedy = json.loads(out.strip().splitlines()[-1])
    assert greedy["mode"] == "greedy" and greedy["token_ids"] == oracle
    assert greedy["tokens_per_s"] > 0 and "compiling" in err  # progress on stderr
    code, out, err = _run(FLAGS + ["--draft", "toy", "--no-progress"], capsys)
    assert code == 0, err
    spec = json.loads(out.strip().splitlines()[-1])
    assert spec["mode"] == "spec" and spec["token_ids"] == oracle
    assert 1.0 <= spec["mean_accept_len"] <= 3.0
    assert "mean acceptance length" in out and err == ""


@pytest.mark.parametrize(
    "flags,match",
    [
        pytest.param(
            ["--prompt-ids", "1 2 64"],
            r"prompt 0\[2\]=64 is outside the vocabulary",
            id="out_of_vocab",
        ),
        pytest.param(["--prompt-ids", "1 x"], "expected integers", id="not_ints"),
        pytest.param(["--prompt-ids", " "], "--prompt-ids is empty", id="empty"),
        pytest.param(["--max-new-tokens", "0"], "--max-new-tokens=0 must be >= 1", id="zero_new"),
        pytest.param(["--devices", "0"], "--devices=0 must be >= 1", id="devices"),
        pytest.param(["--page-size", "3"], "page_size", id="page_size"),
    ],
)
def test_bad_input_one_line_exit_2(flags, match, capsys):
    t0 = time.perf_counter()
    code, out, err = _run(FLAGS + flags, capsys)
    assert code == 2, (out, err)
    last = err.strip().splitlines()[-1]
    assert last.startswith("jspec generate: error: ") and re.search(match, last), err
    assert "Traceback" not in err
    assert time.perf_counter() - t0 < 10.0


def test_prompt_text_needs_a_tokenizer(capsys):
    code, _, err = _run(
        ["--model", "/nonexistent", "--prompt", "hi", "--max-new-tokens", "2"], capsys
    )
    assert code == 2 and "tokenizer.json" in err


def test_parse_prompt_ids():
    assert parse_prompt_ids("1 2,3") == [1, 2, 3]
    with pytest.raises(InputError):
        parse_prompt_ids("1.5")


SAMPLED = ["--temperature", "0.9", "--top-p", "0.95", "--top-k", "20", "--seed", "31"]


def test_sampled_generate_is_reproducible_and_reports_its_parameters(capsys):
    """Same seed, same tokens (plain and spec each); the JSON carries the parameters used; an
    unseeded run reports the seed it drew, and replaying that seed gives its tokens."""
    runs = {}
    for label, extra in (("plain", []), ("spec", ["--draft", "toy", "--no-progress"])):
        outs = []
        for _ in range(2):
            code, out, err = _run(FLAGS + SAMPLED + extra, capsys)
            assert code == 0, err
            outs.append(json.loads(out.strip().splitlines()[-1]))
        assert outs[0]["token_ids"] == outs[1]["token_ids"]
        assert outs[0]["sampling"] == {
            "temperature": 0.9,
            "top_k": 20,
            "top_p": 0.95,
            "min_p": 0.0,
            "seed": 31,
        }
        runs[label] = outs[0]
    assert "T 0.9, top-k 20, top-p 0.95, seed 31" in out
    params, _ = tiny_model()
    assert runs["plain"]["token_ids"] != dense_greedy_generate(TARGET, params, PROMPT, 12)
    # Unseeded: SAMPLED's filters (the plain engine compiled for them above), T 1, no seed.
    unseeded = ["--temperature", "1.0", *SAMPLED[2:6]]
    code, out, err = _run(FLAGS + unseeded, capsys)
    drawn = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and isinstance(drawn["sampling"]["seed"], int)
    code, out, err = _run(FLAGS + unseeded + ["--seed", str(drawn["sampling"]["seed"])], capsys)
    assert json.loads(out.strip().splitlines()[-1])["token_ids"] == drawn["token_ids"]


@pytest.mark.parametrize(
    "flags,match",
    [
        pytest.param(["--temperature", "-1"], r"temperature=-1.0 must be >= 0", id="temperature"),
        pytest.param(["--top-p", "0"], r"top_p=0.0 must be in \(0, 1\]", id="top_p_zero"),
        pytest.param(["--top-p", "1.5"], r"top_p=1.5 must be in \(0, 1\]", id="top_p_big"),
        pytest.param(["--top-k", "-3"], r"top_k=-3 must be >= 0", id="top_k"),
        pytest.param(["--min-p", "2"], r"min_p=2.0 must be in \[0, 1\]", id="min_p"),
        pytest.param(["--seed", "-5"], r"seed=-5 must be in \[0, 2\*\*64\)", id="seed"),
    ],
)
def test_bad_sampling_flags_one_line_exit_2(flags, match, capsys):
    test_bad_input_one_line_exit_2(flags, match, capsys)
