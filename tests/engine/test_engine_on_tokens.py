"""``Engine.generate(on_tokens=)`` (issue 25: ``jspec generate`` streams and keeps the finished
requests of a Ctrl-C'd run): every request's tokens arrive in order, once, already cut at EOS and
max_new_tokens, so that their concatenation is the request's output."""

from __future__ import annotations

import pytest
from engine_helpers import TINY, tiny_engine, tiny_prompts

from jspec.engine.state import make_engine_config

ECFG = make_engine_config(
    TINY,
    page_size=4,
    topk=2,
    num_steps=2,
    num_draft_tokens=4,
    context_len=32,
    max_running_requests=2,
    max_prompt_len=8,
)
PROMPTS = tiny_prompts((5, 3, 8))
MAX_NEW = [20, 2, 12]  # more than one dispatch of rounds (max_rounds 8)


@pytest.mark.parametrize("spec", [False, True], ids=["greedy", "spec"])
def test_on_tokens_concatenate_to_the_outputs(spec: bool) -> None:
    engine = tiny_engine(ECFG, spec=spec, max_rounds=8)
    want, _ = engine.generate(PROMPTS, MAX_NEW)
    # a token that stops request 2 early, as EOS (its first occurrence there at 3 or later)
    stop = next(i for i, t in enumerate(want[2]) if i >= 3 and t not in want[2][:i])
    eos = want[2][stop]
    engine = tiny_engine(ECFG, spec=spec, eos_token_id=eos, max_rounds=8)
    calls: list[tuple[int, list[int]]] = []
    outs, _ = engine.generate(PROMPTS, MAX_NEW, on_tokens=lambda i, ids: calls.append((i, ids)))
    got = [[t for i, ids in calls if i == r for t in ids] for r in range(len(PROMPTS))]
    assert got == outs and outs[2] == want[2][: stop + 1]
    assert all(ids for _, ids in calls) and len(calls) > len(PROMPTS)  # pieces, none empty
