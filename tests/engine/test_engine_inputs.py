"""Host inputs are validated before anything compiles (issue 11 §2), with errors naming the
field; the CLI turns them into one line on stderr and exit status 2."""

from __future__ import annotations

import time

import pytest
from engine_helpers import CONTEXT_LEN, MAX_PROMPT, TINY, tiny_engine

from jspec.engine.inputs import InputError, check_count, check_token_ids, validate_requests
from jspec.engine.state import make_engine_config

LIMITS = {"vocab_size": 64, "max_prompt_len": 8, "context_len": 16}


@pytest.mark.parametrize(
    "prompts,max_new,match",
    [
        pytest.param(
            [[1, 2, 64]],
            4,
            r"prompt 0\[2\]=64 is outside the vocabulary \[0, "
            r"vocab_size=64\)",
            id="id_past_vocab",
        ),
        pytest.param([[1, -1]], 4, r"prompt 0\[1\]=-1 is outside", id="negative_id"),
        pytest.param([[1], [2, 2.5]], 4, r"prompt 1\[1\]=2.5 must be an int", id="float_id"),
        pytest.param([[1, 2]], 0, r"max_new_tokens=0 must be >= 1", id="zero_new_tokens"),
        pytest.param([[1, 2]], -3, r"max_new_tokens=-3 must be >= 1", id="negative_new_tokens"),
        pytest.param(
            [[1, 2]], [4, 4], r"max_new_tokens has 2 entries for 1 prompts", id="new_tokens_length"
        ),
        pytest.param([], 4, r"prompts is empty", id="no_prompts"),
        pytest.param([[1], []], 4, r"prompt 1 is empty", id="empty_prompt"),
        pytest.param([[1] * 9], 4, r"prompt 0: length 9 exceeds max_prompt_len=8", id="too_long"),
        pytest.param([[1] * 8], 9, r"8 \+ 9 exceeds context_len=16", id="past_context"),
    ],
)
def test_validate_requests_rejects(prompts, max_new, match):
    with pytest.raises(InputError, match=match):
        validate_requests(prompts, max_new, **LIMITS)


@pytest.mark.parametrize("max_new", [True, 2.5, None], ids=["bool", "float", "none"])
def test_validate_requests_bad_max_new_tokens_names_it(max_new):
    """A scalar max_new_tokens that is not an int (True once reached len(): a TypeError)."""
    with pytest.raises(InputError, match=r"max_new_tokens=.* must be an int >= 1"):
        validate_requests([[1, 2]], max_new, **LIMITS)


def test_validate_requests_accepts_the_edges():
    prompts, max_new, arrivals = validate_requests([[0, 63], [5] * 8], [14, 8], **LIMITS)
    assert prompts == [[0, 63], [5] * 8] and max_new == [14, 8] and arrivals == [0, 0]


def test_counts_and_ids():
    assert check_count("n", 3) == 3
    for bad in (0, -1, True, 2.0, "3"):
        with pytest.raises(InputError, match="n="):
            check_count("n", bad)
    assert check_token_ids("p", [0, 3], 4) == [0, 3]
    with pytest.raises(InputError, match=r"p\[1\]=4"):
        check_token_ids("p", [0, 4], 4)


def test_engine_rejects_bad_requests_before_compiling():
    """Out-of-vocab ids (once clamped: [1, 2, 64] decoded as [1, 2, 63]) and zero token
    budgets fail at once, with nothing compiled (the engine never ran)."""
    ecfg = make_engine_config(
        TINY,
        page_size=16,
        topk=2,
        num_steps=2,
        num_draft_tokens=3,
        context_len=CONTEXT_LEN,
        max_running_requests=1,
        max_prompt_len=MAX_PROMPT,
        batch_buckets=(1,),
    )
    engine = tiny_engine(ecfg)
    t0 = time.perf_counter()
    with pytest.raises(InputError, match=r"prompt 0\[2\]=64 is outside the vocabulary"):
        engine.generate([[1, 2, 64]], 4)
    with pytest.raises(InputError, match="max_new_tokens=0"):
        engine.generate([[1, 2]], 0)
    with pytest.raises(InputError, match="prompt 0 is empty"):
        engine.generate([[]], 2)
    assert time.perf_counter() - t0 < 2.0
    with pytest.raises(InputError, match="num_devices=0"):
        tiny_engine(ecfg, num_devices=0)


@pytest.mark.parametrize(
    "flags,match",
    [
        pytest.param(["--max-new-tokens", "0"], "--max-new-tokens=0 must be >= 1", id="new_tokens"),
        pytest.param(["--num-prompts", "0"], "--num-prompts=0 must be >= 1", id="num_prompts"),
        pytest.param(["--devices", "0"], "--devices=0 must be >= 1", id="devices"),
        pytest.param(["--topk", "-2"], "--topk=-2 must be >= 1", id="topk"),
        pytest.param(
            ["--tensor-parallel", "3"],
            "tensor_parallel=3 must divide num_kv_heads=2",
            id="tensor_parallel",
        ),
        pytest.param(["--num-heads", "3"], "num_heads=3 must be a multiple", id="model_config"),
    ],
)
def test_demo_bad_flags_one_line_exit_2(flags, match, capsys):
    from test_engine_demo import TINY_ARGS

    from jspec.apps.demo import main

    t0 = time.perf_counter()
    assert main(TINY_ARGS + flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("jspec demo: error: ") and match in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert time.perf_counter() - t0 < 10.0  # before any compile
