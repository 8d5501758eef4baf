"""``jspec generate --prompts-file`` (issue 25): JSON lines in, one JSON line per request out in
input order, each request's tokens those of its prompt run alone; per-line sampling; bad lines
one error line naming the file, the line and the field before anything loads; Ctrl-C."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_helpers import DRAFT, TARGET, tiny_model
from test_cli_input import _model, _one_line, no_weight_read_no_compile  # noqa: F401

from jspec.apps import generate
from jspec.apps.prompts_file import PromptLine
from jspec.apps.serving import _record, _Tracker
from jspec.engine.reference import dense_greedy_generate
from jspec.engine.sampling_params import GREEDY
from jspec.engine.scheduler import Engine

SPEC = ["--page-size", "4", "--topk", "2", "--steps", "2", "--draft-tokens", "4"]
# Mixed prompt lengths and budgets: at --max-running 2 the short ones finish first.
PROMPTS = [[5, 17, 3, 42, 8, 11, 60], [1, 2, 3], [9, 30, 31, 32, 33, 34, 35, 36, 37], [7]]
MAX_NEW = [12, 2, 9, 3]


def _toy_loader(model_dir, draft_dir, dtype, say):
    del model_dir, dtype, say
    params, draft = tiny_model()
    return (TARGET, params, DRAFT, draft) if draft_dir else (TARGET, params, None, None)


def _oracle(prompt: list[int], max_new: int) -> list[int]:
    params, _ = tiny_model()
    return dense_greedy_generate(TARGET, params, prompt, max_new)


def _run(capsys, *flags: str) -> tuple[int, list[dict], str]:
    code = generate.main(["--model", "toy", "--no-progress", *SPEC, *flags], loader=_toy_loader)
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    if "--prompts-file" not in flags:  # one prompt: the text, the stats, the JSON object
        lines = lines[-1:]
    return code, [json.loads(line) for line in lines], captured.err


def _jsonl(*objects: object) -> str:
    return "".join(json.dumps(o) + "\n" for o in objects)


def test_stdin_lines_in_input_order_each_as_its_prompt_alone(capsys, monkeypatch):
    """Greedy, four requests at --max-running 2 read from stdin (a blank line skipped): one
    line each in input order, each the prompt's tokens run alone (the dense oracle)."""
    lines = [{"prompt_ids": p, "max_new_tokens": n} for p, n in zip(PROMPTS, MAX_NEW)]
    del lines[3]["max_new_tokens"]  # from --max-new-tokens
    text = _jsonl(*lines[:2]) + "\n" + _jsonl(*lines[2:])
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    code, out, err = _run(
        capsys, "--prompts-file", "-", "--max-running", "2", "--max-new-tokens", "3"
    )
    assert code == 0, err
    assert [o["index"] for o in out] == [0, 1, 2, 3]
    for o, prompt, n in zip(out, PROMPTS, MAX_NEW, strict=True):
        assert o["token_ids"] == _oracle(prompt, n) and o["num_tokens"] == n
        assert o["finish_reason"] == "length" and o["text"] is None
        assert o["num_prompt_tokens"] == len(prompt) and o["ttft_s"] > 0
        assert o["sampling"] == GREEDY.to_dict()
    # the stats on stderr: time to first token apart from decode and total throughput
    assert "TTFT mean" in err and "tokens/s total, decode" in err and "4 request(s)" in err


def test_per_line_sampling_overrides_the_flags(capsys, tmp_path):
    """A line's sampling fields override the flags; a line without any inherits them (seed
    included); ``"temperature": 0`` is greedy. A sampled line's tokens are those of the same
    prompt and parameters given as flags to a one-prompt run (the engine's law: a request's
    tokens depend on its prompt and parameters only)."""
    prompt, flags = PROMPTS[0], ["--temperature", "0.9", "--top-k", "20", "--seed", "5"]
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        _jsonl(
            {"prompt_ids": prompt},
            {"prompt_ids": prompt, "seed": 6, "top_p": 0.9},
            {"prompt_ids": prompt, "temperature": 0},
            {"prompt_ids": prompt, "temperature": 0.9, "top_k": 20, "seed": 5},
        )
    )
    code, out, err = _run(
        capsys, "--prompts-file", str(path), "--max-new-tokens", "8", "--json", *flags
    )
    assert code == 0, err
    summary = json.loads(err)  # --json: the run's stats as one JSON object on stderr
    assert summary["num_requests"] == 4 and summary["num_tokens"] == 32
    assert summary["tokens_per_s"] > 0 and summary["decode_tokens_per_s"] > 0
    assert 0 < summary["ttft_s"]["mean"] <= summary["ttft_s"]["max"]
    base = {"temperature": 0.9, "top_k": 20, "top_p": 1.0, "min_p": 0.0, "seed": 5}
    assert out[0]["sampling"] == out[3]["sampling"] == base
    assert out[1]["sampling"] == {**base, "seed": 6, "top_p": 0.9}
    assert out[2]["sampling"]["temperature"] == 0.0
    assert out[2]["token_ids"] == _oracle(prompt, 8)
    assert out[0]["token_ids"] == out[3]["token_ids"] != out[2]["token_ids"]
    assert out[1]["token_ids"] != out[0]["token_ids"]
    code, single, err = _run(
        capsys, "--prompt-ids", " ".join(map(str, prompt)), "--max-new-tokens", "8", "--json",
        *flags,
    )  # fmt: skip
    assert code == 0, err
    assert single[-1]["token_ids"] == out[0]["token_ids"]


def test_ctrl_c_prints_the_finished_lines_and_exits_130(capsys, tmp_path, monkeypatch):
    """Spec decoding at --max-running 2; a Ctrl-C as soon as one request has all its tokens:
    that request's line (its tokens the oracle's), a note on stderr, exit 130; the engine runs
    clean afterwards (nothing left allocated)."""
    real_generate, seen = Engine.generate, {}

    def generate_then_interrupt(self, prompts, max_new, **kwargs):
        seen["engine"], forward, counts = self, kwargs["on_tokens"], [0] * len(prompts)

        def on_tokens(i, new_ids):
            forward(i, new_ids)
            counts[i] += len(new_ids)
            if counts[i] >= max_new[i]:
                seen["done"] = [j for j, c in enumerate(counts) if c >= max_new[j]]
                raise KeyboardInterrupt

        return real_generate(self, prompts, max_new, **{**kwargs, "on_tokens": on_tokens})

    monkeypatch.setattr(Engine, "generate", generate_then_interrupt)
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        _jsonl(*[{"prompt_ids": p, "max_new_tokens": n} for p, n in zip(PROMPTS, MAX_NEW)])
    )
    code, out, err = _run(capsys, "--draft", "toy", "--prompts-file", str(path), "--max-running", "2")  # fmt: skip
    assert code == 130
    assert [o["index"] for o in out] == seen["done"] and 0 < len(out) < len(PROMPTS)
    for o in out:
        assert o["token_ids"] == _oracle(PROMPTS[o["index"]], MAX_NEW[o["index"]])
    assert err.strip() == (
        f"jspec generate: interrupted: {len(out)} of {len(PROMPTS)} request(s) finished "
        "(their lines are on stdout)"
    )
    outs, stats = real_generate(seen["engine"], PROMPTS[:2], MAX_NEW[:2])
    assert outs == [_oracle(p, n) for p, n in zip(PROMPTS[:2], MAX_NEW[:2])]
    assert stats.leak_check.startswith("ok")


def test_one_prompt_streams_its_ids_and_reports_ttft(capsys, monkeypatch):
    """One prompt: the ids line arrives in pieces (the engine's on_tokens, one per dispatch of
    up to Engine.max_rounds rounds: 40 greedy tokens are two), the whole as before; the JSON
    object separates time to first token from the decode rate."""
    from jspec.apps.stream import StreamPrinter

    pushes, push = [], StreamPrinter.push
    monkeypatch.setattr(StreamPrinter, "push", lambda s, ids: (pushes.append(ids), push(s, ids)))
    ids = " ".join(map(str, PROMPTS[0]))
    code = generate.main(
        [
            "--model",
            "toy",
            "--no-progress",
            "--prompt-ids",
            ids,
            "--max-new-tokens",
            "40",
            "--json",
        ],
        loader=_toy_loader,
    )
    out = capsys.readouterr().out.splitlines()
    result = json.loads(out[-1])
    assert code == 0 and result["token_ids"] == _oracle(PROMPTS[0], 40)
    assert out[0] == " ".join(map(str, result["token_ids"])) and len(pushes) > 1
    assert [t for piece in pushes for t in piece] == result["token_ids"]
    assert result["ttft_s"] > 0 and result["decode_tokens_per_s"] > 0
    assert result["finish_reason"] == "length" and "TTFT" in out[1]


def test_max_rounds_sets_the_stream_cadence(capsys, monkeypatch):
    """``--max-rounds 4``: one prompt's 20 greedy tokens come back in dispatches of at most 4
    rounds (at least 5 pieces; the default's 32 rounds give one), the same tokens."""
    from jspec.apps.stream import StreamPrinter

    pushes, push = [], StreamPrinter.push
    monkeypatch.setattr(StreamPrinter, "push", lambda s, ids: (pushes.append(ids), push(s, ids)))
    ids = " ".join(map(str, PROMPTS[0]))
    argv = ["--model", "toy", "--no-progress", "--prompt-ids", ids, "--max-new-tokens", "20"]
    code = generate.main([*argv, "--max-rounds", "4", "--json"], loader=_toy_loader)
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert code == 0 and result["token_ids"] == _oracle(PROMPTS[0], 20)
    assert len(pushes) >= 5 and sum(map(len, pushes)) == 20


def test_finish_reason_and_the_tracker():
    line = PromptLine(0, "f:1", None, [1, 2], 4, GREEDY)
    tracker = _Tracker([line], eos=[7])
    tracker(0, [3])
    assert not tracker.finished(0) and tracker.first_s[0] >= 0
    tracker(0, [7])
    assert tracker.finished(0)
    assert _record(line, [3, 7], 0.5, {7}, None)["finish_reason"] == "eos"
    assert _record(line, [3, 4, 5, 6], 0.5, {7}, None)["finish_reason"] == "length"


NEW = ["--max-new-tokens", "2"]
GOOD = {"prompt_ids": [1, 2, 3], "max_new_tokens": 2}
# (line 2 of the file, patterns of the one error line); line 1 is GOOD
BAD_LINES = {
    "json": ('{"prompt_ids": [1, 2}', r"prompts\.jsonl:2: not valid JSON \(.* at column 21\)"),
    "not-object": ("[1, 2]", r"prompts\.jsonl:2: expected a JSON object, got list"),
    "no-prompt": ('{"max_new_tokens": 3}', r'prompts\.jsonl:2: give "prompt" .* not neither'),
    "both": ('{"prompt": "a", "prompt_ids": [1]}', r"prompts\.jsonl:2: give .* not both"),
    "oov": ('{"prompt_ids": [1, 50]}', r"prompts\.jsonl:2: prompt_ids\[1\]=50 is outside the vo"),
    "negative-id": ('{"prompt_ids": [1, -2]}', r"prompts\.jsonl:2: prompt_ids\[1\]=-2 must be >="),
    "float-id": ('{"prompt_ids": [1.5]}', r"prompts\.jsonl:2: prompt_ids\[0\]=1\.5 must be an int"),
    "empty-ids": ('{"prompt_ids": []}', r"prompts\.jsonl:2: prompt_ids is empty"),
    "ids-str": ('{"prompt_ids": "1 2"}', r"prompts\.jsonl:2: prompt_ids='1 2' must be a list"),
    "empty-text": ('{"prompt": ""}', r"prompts\.jsonl:2: prompt is empty"),
    "text-int": ('{"prompt": 5}', r"prompts\.jsonl:2: prompt=5 must be a string"),
    "context": (
        '{"prompt_ids": [1, 2], "max_new_tokens": 4000}',
        r"prompts\.jsonl:2: len\(prompt\) \+ max_new_tokens = 2 \+ 4000 exceeds the model's "
        r"max_position_embeddings=2048",
    ),
    "unknown-key": (
        '{"prompt_ids": [1], "temprature": 1}',
        r"prompts\.jsonl:2: unknown key 'temprature' \(known: prompt, prompt_ids, max_new",
    ),
    "duplicate-key": ('{"prompt_ids": [1], "prompt_ids": [2]}', r":2: duplicate key 'prompt_ids'"),
    "top_p": ('{"prompt_ids": [1], "top_p": 1.5}', r"prompts\.jsonl:2: top_p=1\.5 must be in"),
    "temperature": ('{"prompt_ids": [1], "temperature": "hot"}', r":2: temperature='hot' must be"),
    "top_k": ('{"prompt_ids": [1], "top_k": 2.5}', r"prompts\.jsonl:2: top_k=2\.5 must be an int"),
    "seed": ('{"prompt_ids": [1], "seed": -1}', r"prompts\.jsonl:2: seed=-1 must be in"),
    "min_p-nan": (
        '{"prompt_ids": [1], "min_p": NaN}',
        r"prompts\.jsonl:2: min_p=nan must be finite",
    ),
    "max_new": ('{"prompt_ids": [1], "max_new_tokens": 0}', r":2: max_new_tokens=0 must be >= 1"),
    "no-tokenizer": ('{"prompt": "hello"}', r"prompts\.jsonl:2: prompt needs .*tokenizer\.json"),
}


@pytest.mark.usefixtures("no_weight_read_no_compile")
@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_is_one_error_line_before_anything_loads(tmp_path, capsys, case):
    text, pattern = BAD_LINES[case]
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + text + "\n")
    argv = ["--model", str(_model(tmp_path)), "--prompts-file", str(path), "--max-new-tokens", "2"]
    code = generate.main(argv)
    _one_line(code, capsys.readouterr().err, "generate", pattern)


@pytest.mark.usefixtures("no_weight_read_no_compile")
@pytest.mark.parametrize(
    "data,flags,pattern",
    [
        pytest.param(b"", NEW, r"prompts\.jsonl: no prompts \(every line is blank\)", id="blank"),
        pytest.param(b'{"prompt_ids": [1]}\n', [], r":1: no max_new_tokens", id="no-max-new"),
        pytest.param(
            b'{"prompt": "caf\xe9"}', [], r":1: not valid UTF-8 \(byte 0xe9 at column 16", id="utf8"
        ),  # fmt: skip
        pytest.param(
            b'{"prompt_ids": [1]}',
            [*NEW, "--chat"],
            r":1: --chat needs a text prompt",
            id="chat-ids",
        ),  # fmt: skip
        pytest.param(None, NEW, r"--prompts-file .*missing\.jsonl: No such file", id="missing"),
    ],
)
def test_bad_file_before_anything_loads(tmp_path, capsys, data, flags, pattern):
    path = tmp_path / ("prompts.jsonl" if data is not None else "missing.jsonl")
    if data is not None:
        path.write_bytes(data)
    argv = ["--model", str(_model(tmp_path)), "--prompts-file", str(path), *flags]
    _one_line(generate.main(argv), capsys.readouterr().err, "generate", pattern)


def test_prompt_sources_are_exclusive(capsys):
    with pytest.raises(SystemExit) as exit_info:  # argparse's usage error
        generate.main(["--model", "m", "--prompt-ids", "1", "--prompts-file", "f"])
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    code = generate.main(["--model", "m", "--prompt-ids", "1"])
    assert code == 2 and "--max-new-tokens is required" in capsys.readouterr().err
