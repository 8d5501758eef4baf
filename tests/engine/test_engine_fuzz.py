"""Fuzz the public step API with index misuse (issue 22): random slots in and out of range,
negative, repeated or dead, random live / finished masks, random prompt lengths and token ids
(in and out of the vocabulary) through ``prefill`` / ``spec_decode_step`` / ``greedy_step`` /
``release`` on the tiny model.

After every call: ``jspec.kv.integrity`` (no page leaked or both owned and free, request rows
consistent), ``ok`` equal to an independent host oracle of the input rules (so a good call is
never refused), and a refused call leaves the state bit-identical (but for the padding page).
The pool is sized never to run short, so the oracle needs no page count.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from engine_helpers import (
    DRAFT,
    TARGET,
    TINY,
    assert_same_state,
    check_engine_state,
    snapshot,
    tiny_model,
)
from hypothesis import given
from hypothesis import strategies as st

from jspec.engine import (
    Runner,
    Weights,
    greedy_step,
    init_engine_state,
    make_engine_config,
    prefill,
    release,
    spec_decode_step,
)

M = 2  # batch slots
ECFG = make_engine_config(
    TINY,
    page_size=4,
    topk=2,
    num_steps=2,
    num_draft_tokens=4,
    context_len=32,
    max_running_requests=M,
    max_prompt_len=8,
    batch_buckets=(M,),
    prefill_batch=M,
)
SPEC, GREEDY = Runner(ECFG, TARGET, DRAFT), Runner(ECFG, TARGET)
LP, VOCAB = ECFG.max_prompt_len, TINY.vocab_size
MAX_OPS = 6  # short runs: committed stays far below the context (no width refusal)

slot = st.one_of(st.integers(0, M - 1), st.integers(-3, M + 3))  # mostly in range
token = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([-5, -1, VOCAB, 999]))


@st.composite
def op(draw):
    kind = draw(st.sampled_from(["prefill", "prefill", "step", "step", "release"]))
    slots = draw(st.lists(slot, min_size=M, max_size=M))
    if kind == "prefill":
        lens = draw(st.lists(st.integers(0, LP + 1), min_size=M, max_size=M))
        ids = [
            draw(st.lists(token, min_size=LP, max_size=LP))
            if draw(st.booleans())
            else draw(st.lists(st.integers(0, VOCAB - 1), min_size=LP, max_size=LP))
            for _ in range(M)
        ]
        return kind, slots, lens, ids
    return kind, slots, draw(st.lists(st.booleans(), min_size=M, max_size=M)), None


def expected_ok(kind, slots, mask, ids, live: np.ndarray) -> bool:
    """The input rules of jspec.engine.guards, by hand over Python lists."""
    if kind == "prefill":
        used = [(s, n, row) for s, n, row in zip(slots, mask, ids) if n > 0]
        taken = [s for s, _, _ in used]
        return (
            all(0 <= s < M and not live[s] for s in taken)
            and len(set(taken)) == len(taken)
            and all(n <= LP and all(0 <= t < VOCAB for t in row[:n]) for _, n, row in used)
        )
    named = [s for s, m in zip(slots, mask) if m]
    return all(0 <= s < M and live[s] for s in named) and len(set(named)) == len(named)


def run(state, kind, slots, mask, ids, spec: bool):
    params, dparams = tiny_model()
    runner, weights = (SPEC, Weights(params, dparams)) if spec else (GREEDY, Weights(params))
    slot_idx = jnp.asarray(slots, jnp.int32)
    if kind == "prefill":
        prompt_ids, lens = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)
        state, out = prefill(runner, weights, state, slot_idx, prompt_ids, lens)
        return state, bool(out.ok)
    live = jnp.asarray(mask)
    if kind == "release":
        state, ok = release(runner, state, slot_idx, live, return_ok=True)
        return state, bool(ok)
    step = spec_decode_step if spec else greedy_step
    state, out = step(runner, weights, state, slot_idx, live)
    return state, bool(out.ok)


@given(spec=st.booleans(), ops=st.lists(op(), min_size=1, max_size=MAX_OPS))
def test_index_misuse_never_corrupts_the_state(spec, ops) -> None:
    state = init_engine_state(SPEC if spec else GREEDY)
    for i, (kind, slots, mask, ids) in enumerate(ops):
        want = expected_ok(kind, slots, mask, ids, np.asarray(state.kv.live))
        before = snapshot(state)
        state, ok = run(state, kind, slots, mask, ids, spec)
        what = f"op {i} {kind}({slots}, {mask})"
        check_engine_state(ECFG, state, what)
        assert ok == want, what
        if not ok:
            assert_same_state(before, state, ECFG.spec.page_size)
