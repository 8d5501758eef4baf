"""Bad slots and token ids through the public step API (issue 22): ``ok=False`` with the state
bit-identical (only the padding page, the write sink of padding entries, may change), a probe
naming the entry when probes are on, and ``check_integrity`` after every call.

One tiny engine config (M = 2 slots, P = 4) shared by every test, so each step compiles once.
"""

from __future__ import annotations

import dataclasses
import functools

import engine_helpers as helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import DRAFT, TARGET, TINY, snapshot, tiny_model

from jspec import probes
from jspec._pytree import replace
from jspec.engine import (
    PagedAttentionBackend,
    Runner,
    Weights,
    greedy_step,
    init_engine_state,
    make_engine_config,
    prefill,
    prefill_chunk,
    release,
    resolve_kernel_policy,
    spec_decode_step,
)

ECFG = make_engine_config(
    TINY,
    page_size=4,
    topk=2,
    num_steps=2,
    num_draft_tokens=4,
    context_len=32,
    max_running_requests=2,
    max_prompt_len=8,
    batch_buckets=(2,),
    prefill_batch=2,
)
SPEC, GREEDY = Runner(ECFG, TARGET, DRAFT), Runner(ECFG, TARGET)
PAGE = ECFG.spec.page_size
PROMPTS = ([1, 2, 3, 4, 5], [7, 8, 9])


def _i32(xs):
    return jnp.asarray(xs, jnp.int32)


def _prompt_batch(prompts):
    ids = np.zeros((len(prompts), ECFG.max_prompt_len), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    return jnp.asarray(ids), _i32([len(p) for p in prompts])


def assert_same_state(before, after) -> None:
    helpers.assert_same_state(before, after, PAGE)


def check_state(state, what: str = "") -> None:
    helpers.check_engine_state(ECFG, state, what)


def spec_state():
    """Both slots live (prompts of 5 and 3 tokens), with a draft."""
    params, dparams = tiny_model()
    ids, lens = _prompt_batch(PROMPTS)
    st, out = prefill(
        SPEC, Weights(params, dparams), init_engine_state(SPEC), _i32([0, 1]), ids, lens
    )
    assert bool(out.ok)
    return st


def greedy_state(slots=(0, 1)):
    params, _ = tiny_model()
    ids, lens = _prompt_batch(PROMPTS[: len(slots)] + ((),) * (2 - len(slots)))
    slot_idx = _i32(list(slots) + [2] * (2 - len(slots)))
    st, out = prefill(GREEDY, Weights(params), init_engine_state(GREEDY), slot_idx, ids, lens)
    assert bool(out.ok)
    return st


def spec_step(st, slots, live):
    params, dparams = tiny_model()
    return spec_decode_step(SPEC, Weights(params, dparams), st, _i32(slots), jnp.asarray(live))


def greedy(st, slots, live):
    params, _ = tiny_model()
    return greedy_step(GREEDY, Weights(params), st, _i32(slots), jnp.asarray(live))


# ---- release ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "slots,finished",
    [([5, 0], [True, False]), ([-1, 0], [True, False]), ([1, 1], [True, True])],
    ids=["slot_past_end", "slot_minus1", "slot_twice"],
)
def test_release_bad_slot_releases_nothing(slots, finished) -> None:
    """Was: release([5]) with M = 2 freed slot 1's pages while slot 1 stayed live on them."""
    st = spec_state()
    before = snapshot(st)
    st, ok = release(SPEC, st, _i32(slots), jnp.asarray(finished), return_ok=True)
    assert not bool(ok)
    assert_same_state(before, st)
    check_state(st, "after a refused release")
    st, ok = release(SPEC, st, _i32([1, 0]), jnp.asarray([True, True]), return_ok=True)
    assert bool(ok) and not np.asarray(st.kv.live).any()
    check_state(st, "after a good release")
    st, ok = release(SPEC, st, _i32([1, 0]), jnp.asarray([True, False]), return_ok=True)
    assert not bool(ok)  # slot 1 is no longer live: a second release is refused
    assert int(st.kv.allocator.num_free) == ECFG.spec.num_pages


# ---- decode steps ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "slots,live",
    [([0, 0], [True, True]), ([0, 7], [True, True]), ([0, 1], [True, True])],
    ids=["slot_twice", "slot_past_end", "never_prefilled"],
)
@pytest.mark.parametrize("mode", ["spec", "greedy"])
def test_step_bad_slot_changes_nothing(mode, slots, live) -> None:
    """Was: a duplicate slot leaked 8 pages; a never-prefilled live slot wrote the padding row."""
    st = spec_state() if mode == "spec" else greedy_state(slots=(0,))
    if mode == "spec" and slots == [0, 1]:
        st = release(SPEC, st, _i32([1, 0]), jnp.asarray([True, False]))  # slot 1 never again
    before = snapshot(st)
    st, out = (spec_step if mode == "spec" else greedy)(st, slots, live)
    assert not bool(out.ok)
    assert_same_state(before, st)
    check_state(st, f"after a refused {mode} step")
    st, out = (spec_step if mode == "spec" else greedy)(st, [0, 2], [True, False])
    assert bool(out.ok)  # the padding entry (slot M, not live) is fine
    check_state(st, f"after a good {mode} step")


# ---- prefill -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "slots,prompts",
    [
        ([0, 2], ([1, 2], ())),  # slot 0 is live
        ([3, 2], ([1, 2], ())),  # out of range
        ([-1, 2], ([1, 2], ())),
        ([0, 0], ([1, 2], [3])),  # a free slot twice (both free: rows are not short)
        ([1, 2], ([1, 999], ())),  # out of vocab (was clamped to 63)
        ([1, 2], ([-5, 2], ())),  # negative id (was clamped to 59)
        ([1, 2], ([1, 64], ())),  # the first id past the vocabulary (vocab_size = 64)
    ],
    ids=[
        "live_slot", "slot_past_end", "slot_minus1", "slot_twice", "id_999", "id_minus5",
        "id_vocab_size",
    ],
)  # fmt: skip
def test_prefill_bad_input_changes_nothing(slots, prompts) -> None:
    params, dparams = tiny_model()
    st = spec_state()
    free = [1, 0] if slots == [0, 0] else [1, 2]  # slot 1 free (and slot 0 for "twice")
    st = release(SPEC, st, _i32(free), jnp.asarray([True, free[1] == 0]))
    before = snapshot(st)
    ids, lens = _prompt_batch(prompts)
    st, out = prefill(SPEC, Weights(params, dparams), st, _i32(slots), ids, lens)
    assert not bool(out.ok) and not np.asarray(out.first_tokens).any()
    assert_same_state(before, st)
    check_state(st, "after a refused prefill")


def test_prefill_reads_no_id_past_prompt_len() -> None:
    """The padding past each prompt may hold anything (-1, ids past the vocabulary): the guard
    checks only ids inside ``prompt_lens``, and the first tokens are zero padding's."""
    params, dparams = tiny_model()
    weights = Weights(params, dparams)
    ids, lens = _prompt_batch(PROMPTS)
    junk = np.asarray(ids).copy()
    for i, p in enumerate(PROMPTS):
        junk[i, len(p) :] = [-1 if j % 2 else 64 for j in range(ECFG.max_prompt_len - len(p))]
    _, clean = prefill(SPEC, weights, init_engine_state(SPEC), _i32([0, 1]), ids, lens)
    st, out = prefill(SPEC, weights, init_engine_state(SPEC), _i32([0, 1]), jnp.asarray(junk), lens)
    assert bool(clean.ok) and bool(out.ok)
    np.testing.assert_array_equal(out.first_tokens, clean.first_tokens)
    check_state(st, "after a prefill with junk padding")


def test_prefill_prompt_len_past_the_padding_changes_nothing() -> None:
    params, dparams = tiny_model()
    st = init_engine_state(SPEC)
    before = snapshot(st)
    ids, _ = _prompt_batch(PROMPTS)
    st, out = prefill(SPEC, Weights(params, dparams), st, _i32([0, 1]), ids, _i32([9, 3]))
    assert not bool(out.ok)
    assert_same_state(before, st)


def test_prefill_chunk_past_max_prefix_len_changes_nothing() -> None:
    """``Runner.max_prefix_len=0`` (first chunks only: the Engine's compile for cuDNN's first
    chunks): a later chunk is refused whole, the state unchanged, and a probe names it; the
    same chunk goes through without the bound."""
    params, _ = tiny_model()
    weights, bounded = Weights(params), Runner(ECFG, TARGET, max_prefix_len=0)
    prompt = [1, 2, 3, 4, 5, 6, 7]

    def chunk(runner, st, start, n):
        ids = np.zeros((2, ECFG.max_prompt_len), np.int32)
        ids[0, :n] = prompt[start : start + n]
        last = start + n == len(prompt)
        return prefill_chunk(
            runner, weights, st, _i32([0, 2]), jnp.asarray(ids), _i32([n, 0]), _i32([start, 0]),
            jnp.asarray([last, False]), _i32([0 if last else prompt[start + n], 0]),
        )  # fmt: skip

    st, out = chunk(bounded, init_engine_state(bounded), 0, 4)  # a first chunk: within it
    assert bool(out.ok)
    before = snapshot(st)
    st, out = chunk(bounded, st, 4, 3)
    assert not bool(out.ok) and not np.asarray(out.first_tokens).any()
    assert_same_state(before, st)
    with pytest.raises(
        probes.ProbeError, match=r"prefill: entry 0: chunk start 4 > max_prefix_len=0"
    ):
        probes.checked(lambda st: chunk(bounded, st, 4, 3))(st)
    st, out = chunk(GREEDY, st, 4, 3)
    fresh = init_engine_state(GREEDY)
    _, whole = prefill(GREEDY, weights, fresh, _i32([0, 2]), *_prompt_batch((prompt, ())))
    assert bool(out.ok) and int(out.first_tokens[0]) == int(whole.first_tokens[0])
    check_state(st, "after the unbounded later chunk")


# ---- probes name the entry ----------------------------------------------------------------------------
def _checked(fn, **kw):
    """``fn`` (a public step) under probes.checked, every argument by keyword."""
    return probes.checked(fn)(**kw)


def test_probes_name_the_bad_entry() -> None:
    params, dparams = tiny_model()
    st = spec_state()
    spec_kw = {"runner": SPEC, "weights": Weights(params, dparams), "state": st}
    with pytest.raises(probes.ProbeError, match=r"spec_decode_step: entry 0: slot 0 given twice"):
        _checked(spec_decode_step, **spec_kw, slot_idx=_i32([0, 0]), live=jnp.asarray([1, 1], bool))
    with pytest.raises(probes.ProbeError, match=r"release: entry 0: slot 5 outside \[0, "):
        _checked(
            release,
            runner=SPEC,
            state=st,
            slot_idx=_i32([5, 0]),
            finished=jnp.asarray([1, 0], bool),
        )
    ids, lens = _prompt_batch(([1, 999], ()))
    with pytest.raises(
        probes.ProbeError,
        match=r"prefill: entry 0: slot 0 is not free \(live, or holding a request\)",
    ):
        _checked(prefill, **spec_kw, slot_idx=_i32([0, 2]), prompt_ids=ids, prompt_lens=lens)
    st = release(SPEC, st, _i32([1, 0]), jnp.asarray([True, False]))
    spec_kw["state"] = st
    with pytest.raises(probes.ProbeError, match=r"prefill: entry 0: token id 999 outside"):
        _checked(prefill, **spec_kw, slot_idx=_i32([1, 2]), prompt_ids=ids, prompt_lens=lens)
    with pytest.raises(probes.ProbeError, match=r"spec_decode_step: entry 1: slot 1 is not live"):
        _checked(spec_decode_step, **spec_kw, slot_idx=_i32([0, 1]), live=jnp.asarray([1, 1], bool))


def test_static_mistakes_name_the_field() -> None:
    st = spec_state()
    with pytest.raises(ValueError, match=r"release: finished.shape=\(3,\) must be"):
        release(SPEC, st, _i32([0, 1]), jnp.ones(3, bool))
    params, dparams = tiny_model()
    ids, lens = _prompt_batch(PROMPTS)
    with pytest.raises(ValueError, match=r"prefill: prompt_ids.dtype=float32"):
        prefill(SPEC, Weights(params, dparams), st, _i32([0, 1]), ids.astype(float), lens)
    with pytest.raises(ValueError, match=r"prefill: prompt_ids.shape=\(3, 8\) must be \(Bp=2,"):
        prefill(SPEC, Weights(params, dparams), st, _i32([0, 1]), jnp.tile(ids, (2, 1))[:3], lens)
    with pytest.raises(ValueError, match=r"spec_decode_step: slot_idx must be a 1-D int array"):
        spec_decode_step(
            SPEC, Weights(params, dparams), st, jnp.asarray([0.0, 1.0]), jnp.ones(2, bool)
        )


def test_spec_step_without_a_draft_names_it() -> None:
    """A draftless runner in spec_decode_step (once an AttributeError on the None draft pool)."""
    params, _ = tiny_model()
    state = init_engine_state(GREEDY)
    with pytest.raises(ValueError, match=r"spec_decode_step: runner.draft is None"):
        spec_decode_step(GREEDY, Weights(params), state, _i32([0, 1]), jnp.zeros(2, bool))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the GPU runs these kernels")
def test_gpu_only_kernels_off_the_gpu_are_refused_before_any_compile(monkeypatch) -> None:
    """An Engine whose kernel policy names a GPU-only kernel on a CPU backend: ValueError naming
    the keyword at construction (its ops would raise only at the first trace)."""
    from jspec.engine import Engine

    monkeypatch.setattr(jax, "jit", lambda *a, **k: pytest.fail("compiled"))
    params, dparams = tiny_model()
    for keyword in ("attention_impl", "rms_norm_impl", "topk_probs_impl"):
        ecfg = dataclasses.replace(ECFG, kernels=resolve_kernel_policy(**{keyword: "triton"}))
        with pytest.raises(ValueError, match=rf"{keyword}='triton' needs a GPU"):
            Engine(ecfg, TARGET, params, DRAFT, dparams)
    # A serving stack's own attention backend replaces the policy's attention kernel.
    own = dataclasses.replace(
        ECFG,
        kernels=resolve_kernel_policy(attention_impl="triton"),
        attention_backend=PagedAttentionBackend("xla"),
    )
    own.check_backend()


# ---- NaN target logits: a probe in prefill, greedy and the spec step ----------------------------------
def _nan_head(params):
    """NaN target logits, the draft untouched (EAGLE-1 shares embed and lm_head, not the norm)."""
    return replace(params, final_norm=params.final_norm * jnp.nan)


@functools.cache
def _good_states():
    return snapshot(greedy_state()), snapshot(spec_state())


def test_nan_target_logits_are_named_by_a_probe() -> None:
    """Was: a NaN lm_head decoded token 0 forever under --checkify (no probe on the logits)."""
    params, dparams = tiny_model()
    bad = _nan_head(params)
    greedy_st, spec_st = (jax.tree.map(jnp.asarray, s) for s in _good_states())
    live = {"slot_idx": _i32([0, 1]), "live": jnp.asarray([True, True])}
    with pytest.raises(probes.ProbeError, match=r"greedy_step: target logits: \d+ NaN"):
        _checked(greedy_step, runner=GREEDY, weights=Weights(bad), state=greedy_st, **live)
    with pytest.raises(probes.ProbeError, match=r"spec_decode_step: target logits: \d+ NaN"):
        _checked(
            spec_decode_step, runner=SPEC, weights=Weights(bad, dparams), state=spec_st,
            **live,
        )  # fmt: skip
    ids, lens = _prompt_batch(PROMPTS)
    with pytest.raises(probes.ProbeError, match=r"prefill: target logits: \d+ NaN"):
        _checked(
            prefill, runner=GREEDY, weights=Weights(bad), state=init_engine_state(GREEDY),
            slot_idx=_i32([0, 1]), prompt_ids=ids, prompt_lens=lens,
        )  # fmt: skip


def test_logit_probes_off_add_nothing() -> None:
    """Probes off: the greedy step's program has no check (the guards' probes trace nothing)."""
    params, _ = tiny_model()
    st = jax.tree.map(jnp.asarray, _good_states()[0])

    def step(p, s):
        return greedy_step(GREEDY, Weights(p), s, _i32([0, 1]), jnp.asarray([True, True]))

    assert not probes.probes_on()
    assert "check" not in str(jax.make_jaxpr(step)(params, st))
    with probes.probes_enabled():
        assert "check" in str(jax.make_jaxpr(step)(params, st))
