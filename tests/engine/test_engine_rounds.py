"""``jspec.engine.decode_rounds``: several public steps in one dispatch, each entry stopped on
the device at its budget or a stop id, over jspec's paged KV backend and over a KV cache of the
caller's own (examples/own_kv_cache.py's block tables).

The oracle is the single public step itself: a round must be that step's transition, with the
entries still running as ``live``. Each case runs the rounds and the same number of single steps
from one prefilled state and compares every round's tokens and the final state (integers and
masks exactly; floats to the f32 ulp: the two programs are compiled apart; the pools' padding
page aside)."""

from __future__ import annotations

import functools
import pathlib
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import assert_same_state

from jspec.engine import (
    Runner,
    Weights,
    decode_rounds,
    greedy_step,
    init_engine_state,
    make_engine_config,
    prefill,
    spec_decode_step,
)

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "own_kv_cache.py"
PAGE, NUM = 4, 2
PROMPTS = ([5, 9, 13, 2, 40], [7, 8, 9])


@functools.cache
def _example():
    return runpy.run_path(str(EXAMPLE))


def _setup(spec: bool, own_kv: bool, num_blocks: int | None = None):
    """(runner, weights, prefilled state, first tokens) for PROMPTS in slots 0 and 1."""
    ns = _example()
    target, params, draft, dparams = ns["toy_models"]()
    ecfg = make_engine_config(
        target, page_size=PAGE, topk=2, num_steps=3, num_draft_tokens=6, context_len=64,
        max_running_requests=NUM, max_prompt_len=8, batch_buckets=(NUM,), prefill_batch=NUM,
    )  # fmt: skip
    kv = None
    if own_kv:
        per = -(-(ecfg.spec.context_len + ecfg.spec.alloc_reserve_per_decode) // PAGE)
        kv = ns["BlockTableBackend"](PAGE, num_blocks or NUM * per, per, NUM)
    runner = Runner(ecfg, target, draft if spec else None, kv=kv)
    weights = Weights(params, dparams if spec else None)
    ids = np.zeros((NUM, 8), np.int32)
    for i, p in enumerate(PROMPTS):
        ids[i, : len(p)] = p
    lens = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
    slots = jnp.arange(NUM, dtype=jnp.int32)
    state, out = prefill(runner, weights, init_engine_state(runner), slots, jnp.asarray(ids), lens)
    assert bool(out.ok)
    return runner, weights, state, slots


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _emitted(out):
    if hasattr(out, "accept_tokens"):
        return np.asarray(out.accept_tokens), np.asarray(out.accept_lens)
    return np.asarray(out.next_tokens)[:, None], np.ones(NUM, np.int32)


def _single_steps(step, runner, weights, state, slots, budget, eos, rounds, sampling=None):
    """The rounds' oracle: ``rounds`` single calls of ``step`` with the same stop rule.
    Returns (state, tokens [R, B, W], lens [R, B], rounds that ran, ok)."""
    live = np.ones(NUM, bool)
    left = np.asarray(budget, np.int64).copy()
    toks, lens = [], []
    for _ in range(rounds):
        if not live.any():
            break
        state, out = step(runner, weights, state, slots, jnp.asarray(live), sampling)
        if not bool(out.ok):
            return state, toks, lens, len(lens), False
        t, n = _emitted(out)
        n = np.where(live, n, 0)
        toks.append(np.where(live[:, None], t, 0))
        lens.append(n)
        hit = [any(int(x) in eos for x in t[i, : n[i]]) for i in range(NUM)]
        left -= n
        live &= ~(np.asarray(hit) | (left <= 0))
    return state, toks, lens, len(lens), True


def _assert_same_state(a, b):
    """Equal states, the pools' padding page aside (padding entries all write token slots
    ``[0, P)``, in no set order on the GPU); floats to the f32 ulp."""
    assert_same_state(b, a, PAGE, float_tol=(1e-5, 1e-6))


def _compare(step, runner, weights, state, slots, budget, eos, rounds, sampling=None):
    ref_state, toks, lens, ran, ok = _single_steps(
        step, runner, weights, _copy(state), slots, budget, eos, rounds, sampling
    )
    eos_ids = jnp.asarray(list(eos) or [], jnp.int32).reshape(-1)
    live = jnp.ones((NUM,), bool)
    new, out = decode_rounds(
        step, runner, weights, state, slots, live, jnp.asarray(budget, jnp.int32), eos_ids,
        rounds, sampling, max_rounds=rounds,
    )  # fmt: skip
    assert int(out.num_rounds) == ran and bool(out.ok) == ok
    got_t, got_n = np.asarray(out.tokens), np.asarray(out.lens)
    for r in range(ran):
        np.testing.assert_array_equal(got_n[r], lens[r])
        for i in range(NUM):
            assert got_t[r, i, : lens[r][i]].tolist() == toks[r][i, : lens[r][i]].tolist()
    assert not got_n[ran:].any()  # rounds that did not run emitted nothing
    _assert_same_state(new, ref_state)
    return new, out, lens


@pytest.mark.parametrize("own_kv", [False, True], ids=["paged", "block_tables"])
def test_spec_rounds_are_single_steps_with_budgets(own_kv):
    """Entry 1's budget of 1 stops it after its first round (a spec round emits >= 1 token),
    entry 0 runs all four rounds; both backends."""
    runner, weights, state, slots = _setup(spec=True, own_kv=own_kv)
    _, out, lens = _compare(spec_decode_step, runner, weights, state, slots, [64, 1], (), 4)
    assert int(out.num_rounds) == 4
    assert lens[0][1] >= 1 and all(n[1] == 0 for n in lens[1:])  # stopped after its round
    assert sum(n[0] for n in lens) > 4  # the draft was accepted somewhere (not greedy alone)


def test_spec_rounds_stop_an_entry_at_a_stop_id():
    """A stop id among an entry's tokens ends it after that round; the other runs on."""
    runner, weights, state, slots = _setup(spec=True, own_kv=False)
    first = _single_steps(spec_decode_step, runner, weights, _copy(state), slots, [64] * 2, (), 1)
    toks, lens = first[1][0], first[2][0]
    stop = int(toks[0, lens[0] - 1])  # entry 0's last token of the first round
    _, _, got = _compare(spec_decode_step, runner, weights, state, slots, [64, 64], (stop,), 3)
    assert got[0][0] >= 1 and all(n[0] == 0 for n in got[1:])  # entry 0 ended there
    assert got[1][1] >= 1  # entry 1 ran on


def test_a_stop_id_equal_to_the_padding_stops_nobody():
    """A step's tokens past its emitted count are 0: a stop id 0 (a real id in many
    vocabularies) is matched only among the emitted tokens, so no entry stops on padding."""
    runner, weights, state, slots = _setup(spec=True, own_kv=False)
    _, _, lens = _compare(spec_decode_step, runner, weights, state, slots, [64, 64], (0,), 3)
    assert all(n.min() >= 1 for n in lens)  # both entries ran every round
    assert any(n.max() < 4 for n in lens)  # some round left padding past its tokens


def test_sampled_spec_rounds_are_single_steps():
    """Sampled requests (T = 0.9, one seed each): a round's coins come from the request's
    seed and positions, so the rounds draw what as many single steps draw."""
    from jspec.engine import SamplingBatch

    runner, weights, state, slots = _setup(spec=True, own_kv=False)
    sampling = SamplingBatch(
        temperature=jnp.full((NUM,), 0.9, jnp.float32),
        seed=jnp.asarray([[0, 11], [0, 12]], jnp.uint32),
    )
    _, _, lens = _compare(
        spec_decode_step, runner, weights, state, slots, [64, 64], (), 3, sampling
    )
    assert all(n.min() >= 1 for n in lens)


def test_greedy_rounds_are_single_steps():
    runner, weights, state, slots = _setup(spec=False, own_kv=False)
    _, _, lens = _compare(greedy_step, runner, weights, state, slots, [3, 64], (), 5)
    assert [int(n[0]) for n in lens] == [1, 1, 1, 0, 0] and all(n[1] == 1 for n in lens)


def test_rounds_end_early_when_blocks_run_short():
    """A block-table cache with blocks for a few rounds only: the dispatch returns the rounds
    that fit (``ok`` False), the state that of as many single steps (the refused round
    changed nothing), then a release gives every block back."""
    from jspec.engine import release

    runner, weights, state, slots = _setup(spec=True, own_kv=True, num_blocks=21)
    new, out, _ = _compare(spec_decode_step, runner, weights, state, slots, [64, 64], (), 8)
    assert not bool(out.ok) and 0 < int(out.num_rounds) < 8
    new = release(runner, new, slots, jnp.ones((NUM,), bool))
    assert int(new.kv.num_free) == 21


def test_bad_arguments_raise_naming_them():
    runner, weights, state, slots = _setup(spec=True, own_kv=False)
    live, budget, eos = jnp.ones((NUM,), bool), jnp.full((NUM,), 4, jnp.int32), jnp.zeros(0)
    args = (runner, weights, state, slots, live, budget, eos, 2)
    with pytest.raises(ValueError, match=r"step=.* must be one of"):
        decode_rounds(lambda *a: None, *args)
    with pytest.raises(ValueError, match=r"max_rounds=0 must be >= 1"):
        decode_rounds(spec_decode_step, *args, max_rounds=0)
    bad = (runner, weights, state, slots, live, budget[:1], eos, 2)
    with pytest.raises(ValueError, match=r"budget\.shape=\(1,\) must be \(2,\)"):
        decode_rounds(spec_decode_step, *bad)
    bad = (runner, weights, state, slots, live, budget, eos[None], 2)
    with pytest.raises(ValueError, match=r"eos_ids\.shape"):
        decode_rounds(spec_decode_step, *bad)
    bad = (runner, weights, state, slots, live, budget, eos, jnp.asarray([2]))
    with pytest.raises(ValueError, match=r"num_rounds\.shape"):
        decode_rounds(spec_decode_step, *bad)


def test_rounds_nest_inside_a_callers_jit():
    """Inside a caller's own jit (a scheduler step of its own), decode_rounds traces as a plain
    nested jit (JAX refuses compile options there) with the top-level call's result."""
    runner, weights, state, slots = _setup(spec=False, own_kv=False)
    live, budget = jnp.ones((NUM,), bool), jnp.asarray([2, 3], jnp.int32)
    eos = jnp.zeros((0,), jnp.int32)

    def call(w, st):
        return decode_rounds(greedy_step, runner, w, st, slots, live, budget, eos, 4, max_rounds=4)

    nested = jax.jit(call)(weights, _copy(state))
    top = call(weights, state)
    _assert_same_state(nested[0], top[0])
    jax.tree.map(np.testing.assert_array_equal, nested[1], top[1])
    assert int(top[1].num_rounds) == 3 and np.asarray(top[1].lens).sum() == 5
