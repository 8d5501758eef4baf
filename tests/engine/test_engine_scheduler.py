"""Continuous batching: admission under a small pool, EOS, validation, buckets, warmup."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import (
    CONTEXT_LEN,
    DRAFT,
    MAX_NEW,
    MAX_PROMPT,
    TARGET,
    TINY,
    assert_same_state,
    greedy_baseline,
    snapshot,
    tiny_model,
    tiny_prompts,
)

from jspec.engine.rounds import RoundsOutput
from jspec.engine.scheduler import Engine, Request
from jspec.engine.state import make_engine_config


def _spec_engine(**kw):
    params, draft = tiny_model()
    opts = {
        "page_size": 16,
        "topk": 4,
        "num_steps": 2,
        "num_draft_tokens": 6,
        "context_len": CONTEXT_LEN,
        "max_running_requests": 4,
        "max_prompt_len": MAX_PROMPT,
        "batch_buckets": (2, 4),
    }
    opts.update(kw)
    return Engine(
        make_engine_config(TINY, **opts), TARGET, params, DRAFT, draft, check_every_step=True
    )


def _small_pool() -> int:
    """Pages such that any two of the tiny requests fit at once but never three."""
    probe = _spec_engine()
    need = sorted(
        probe.lifetime_pages(Request(i, p, MAX_NEW)) for i, p in enumerate(tiny_prompts())
    )
    assert need[-1] + need[-2] < need[0] + need[1] + need[2]
    return need[-1] + need[-2]


def _record_dispatches(engine, monkeypatch) -> list[tuple[bool, int]]:
    """(whether a request was queued, rounds asked) of every decode dispatch ``engine`` makes."""
    seen: list[tuple[bool, int]] = []
    decode_step, call_rounds = engine._decode_step, engine._call_rounds
    waiting = [False]

    def _decode_step(loop, stats, max_rounds=None):
        waiting[0] = bool(loop.pending)
        return decode_step(loop, stats, max_rounds)

    def _call_rounds(slot_idx, live, budget, num_rounds, *args, **kwargs):
        seen.append((waiting[0], num_rounds))
        return call_rounds(slot_idx, live, budget, num_rounds, *args, **kwargs)

    monkeypatch.setattr(engine, "_decode_step", _decode_step)
    monkeypatch.setattr(engine, "_call_rounds", _call_rounds)
    return seen


def test_small_pool_waits_for_pages_and_stays_lossless(monkeypatch):
    """Two requests wait for pages; meanwhile each dispatch runs until a running request can
    first end by its budget (no stop ids: more than one round), not one round at a time."""
    engine = _spec_engine(num_pages=_small_pool())
    dispatches = _record_dispatches(engine, monkeypatch)
    out, stats = engine.generate(tiny_prompts(), MAX_NEW)
    assert out == [list(o) for o in greedy_baseline()]
    waiting = [rounds for queued, rounds in dispatches if queued]
    per_round = engine.ecfg.spec.num_steps + 1
    assert waiting and max(waiting) == -(-(MAX_NEW - 1) // per_round) > 1, dispatches
    assert max(stats.batch_sizes) == 2  # never more than two running: the bucket-2 graph ran
    assert stats.leak_check.startswith("ok")
    # The same engine (state reused after the leak check) runs again identically.
    again, _ = engine.generate(tiny_prompts(), MAX_NEW)
    assert again == out


def test_eos_and_single_token_requests(monkeypatch):
    baseline = [list(o) for o in greedy_baseline()]
    eos = baseline[1][4]
    engine = _spec_engine(num_pages=_small_pool())  # same config: no new compile
    engine.eos_token_id = eos
    monkeypatch.setattr("jspec.engine.scheduler.WAITING_ROUNDS", 2)
    dispatches = _record_dispatches(engine, monkeypatch)
    out, stats = engine.generate(tiny_prompts(), [MAX_NEW, MAX_NEW, 1, MAX_NEW])
    # a stop id may free a slot before any budget does: the queue waits at most 2 rounds
    assert max(rounds for queued, rounds in dispatches if queued) <= 2, dispatches
    for got, ref, limit in zip(out, baseline, [MAX_NEW, MAX_NEW, 1, MAX_NEW], strict=True):
        ref = ref[:limit]
        if eos in ref:
            ref = ref[: ref.index(eos) + 1]
        assert got == ref
    assert stats.leak_check.startswith("ok")


def test_attention_impl_resolution(monkeypatch):
    """auto: the page-table Triton kernels on GPU (prefill chunks through cuDNN for bf16 / f16
    models), the reference elsewhere; a given attention_backend replaces both."""
    import dataclasses

    import jax

    from jspec.engine.attention import PagedAttentionBackend

    on_gpu = jax.default_backend() == "gpu"
    assert TINY.dtype == "float32"
    assert make_engine_config(TINY).kernels.attention == ("triton" if on_gpu else "xla")
    half = dataclasses.replace(TINY, dtype="bfloat16")
    for impl in ("xla", "triton", "cudnn"):
        cfg = make_engine_config(half if impl == "cudnn" else TINY, attention_impl=impl)
        assert cfg.kernels.attention == impl
        assert cfg.attention == PagedAttentionBackend(impl)
    with pytest.raises(ValueError, match="attention_impl='cudnn' takes bf16 / f16 models"):
        make_engine_config(TINY, attention_impl="cudnn")
    own = PagedAttentionBackend("xla")
    assert make_engine_config(TINY, attention_impl="triton", attention_backend=own).attention is own
    with pytest.raises(ValueError, match="attention_backend=.* must define write_kv and attend"):
        make_engine_config(TINY, attention_backend=object())
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert make_engine_config(TINY).kernels.attention == "triton"
    assert make_engine_config(half).kernels.attention == "cudnn"


def test_validation_errors():
    engine = _spec_engine()
    with pytest.raises(ValueError, match="max_prompt_len"):
        engine.generate([[1] * (MAX_PROMPT + 1)], 2)
    with pytest.raises(ValueError, match="context_len"):
        engine.generate([[1, 2]], CONTEXT_LEN)
    with pytest.raises(ValueError, match="num_pages"):
        _spec_engine(num_pages=4).generate([[1, 2]], 4)
    with pytest.raises(ValueError, match="largest bucket must be <= max_running_requests"):
        make_engine_config(TINY, max_running_requests=2, batch_buckets=(4,))
    with pytest.raises(ValueError, match="draft_attention"):
        make_engine_config(TINY, draft_attention="flash")
    with pytest.raises(ValueError, match="attention_impl='flash' must be one of"):
        make_engine_config(TINY, attention_impl="flash")
    with pytest.raises(ValueError, match="tensor_parallel=4 must divide num_kv_heads=2"):
        make_engine_config(TINY, tensor_parallel=4)
    with pytest.raises(ValueError, match="tensor_parallel=0"):
        make_engine_config(TINY, tensor_parallel=0)
    with pytest.raises(ValueError, match="2 = 4 devices: only 1"):
        Engine(
            make_engine_config(TINY, tensor_parallel=2),
            TARGET,
            tiny_model()[0],
            DRAFT,
            tiny_model()[1],
            num_devices=2,
        )


def test_warmup_is_a_no_op_on_the_bookkeeping():
    """Warm-up runs every compiled call once on all-padding inputs, the decode rounds' loop
    body included (num_rounds -1): the state stays bit-identical but for the padding page."""
    engine = _spec_engine(num_pages=_small_pool())
    before = snapshot(engine.state)
    engine.warmup()
    assert_same_state(before, snapshot(engine.state), page_size=16)
    assert engine.check_leaks().startswith("ok")
    assert not np.any(np.asarray(engine.state.kv.live))
    # the warm-up dispatch ran its round (a plain all-padding dispatch runs none)
    m, d = engine.ecfg.spec.max_running_requests, engine.num_devices
    idx, none = np.full((d, 2), m, np.int32), np.zeros((d, 2), bool)
    zeros = np.zeros((d, 2), np.int32)
    assert int(np.max(engine._call_rounds(idx, none, zeros, -1).num_rounds)) == 1
    assert int(np.max(engine._call_rounds(idx, none, zeros, 1).num_rounds)) == 0
    assert_same_state(before, snapshot(engine.state), page_size=16)


def test_check_leaks_refuses_each_leak_alone(monkeypatch):
    """The after-run leak check (``RunStats.leak_check``) raises on a req_to_token row not
    given back, or a slot still marked live, each alone (every page free), naming it."""
    import dataclasses

    engine = _spec_engine(num_pages=_small_pool())
    clean = engine._host_shards()
    st = clean[0]
    live = np.asarray(st.live).copy()
    live[1] = True
    rows = dataclasses.replace(st.req_rows, num_free=st.req_rows.num_free - 1)
    cases = {
        r"free rows=\d+ of": dataclasses.replace(st, req_rows=rows),
        r"live slots=1": dataclasses.replace(st, live=live),
    }
    for message, leaked in cases.items():
        monkeypatch.setattr(engine, "_host_shards", lambda leaked=leaked: [leaked, *clean[1:]])
        with pytest.raises(AssertionError, match=message):
            engine.check_leaks()
    monkeypatch.setattr(engine, "_host_shards", lambda: clean)
    assert engine.check_leaks().startswith("ok")


def test_a_dispatch_that_runs_no_round_raises_instead_of_spinning(monkeypatch):
    """A decode dispatch that runs no round yet reports no shortage cannot make progress: the
    engine raises (naming it) instead of retrying forever."""
    engine = _spec_engine(num_pages=_small_pool())
    calls = []

    def no_round(slot_idx, live, budget, num_rounds, *args, **kwargs):
        calls.append(num_rounds)
        if len(calls) > 20:  # without the guard: fail, do not hang
            raise AssertionError("the engine retried a dispatch that ran no round")
        d, width = slot_idx.shape
        return RoundsOutput(
            tokens=np.zeros((d, 1, width, 1), np.int32),
            lens=np.zeros((d, 1, width), np.int32),
            num_rounds=np.zeros((d,), np.int32),
            ok=np.ones((d,), bool),
        )

    monkeypatch.setattr(engine, "_call_rounds", no_round)
    with pytest.raises(RuntimeError, match=r"ran no round for \d+ running request"):
        engine.generate(tiny_prompts()[:2], MAX_NEW)
    assert len(calls) == 1


def test_a_prefill_with_nothing_left_raises_instead_of_spinning(monkeypatch):
    """A request left prefilling after its last chunk (here: the call's ``is_last`` turned
    False behind the scheduler's back) would get empty chunks forever: the engine raises,
    naming it."""
    engine = _spec_engine(num_pages=_small_pool())
    real, calls = engine._call_prefill, []

    def last_not_last(slot_idx, token_ids, lens, starts, is_last, *args):
        calls.append(int(lens.sum()))
        if len(calls) > 20:  # without the guard: fail, do not hang
            raise AssertionError("the engine repeated a prefill that cannot advance")
        out = real(slot_idx, token_ids, lens, starts, is_last, *args)
        is_last[:] = False
        return out

    monkeypatch.setattr(engine, "_call_prefill", last_not_last)
    with pytest.raises(RuntimeError, match=r"request\(s\) \[0\] are prefilling with nothing"):
        engine.generate(tiny_prompts()[:1], MAX_NEW)
    assert len(calls) == 1 and calls[0] > 0


def test_spec_step_with_pages_short_changes_no_state():
    """prepare_for_decode finds the pool short: ok False, every entry becomes padding and the
    step leaves the state as it was (only the padding page, a write sink, may change)."""
    import jax

    params, draft = tiny_model()
    ecfg = make_engine_config(
        TINY,
        page_size=16,
        topk=4,
        num_steps=3,
        num_draft_tokens=8,
        context_len=CONTEXT_LEN,
        max_running_requests=2,
        max_prompt_len=MAX_PROMPT,
        batch_buckets=(2,),
        num_pages=3,
    )
    engine = Engine(ecfg, TARGET, params, DRAFT, draft)
    prompts = np.zeros((1, 2, MAX_PROMPT), np.int32)
    prompts[0, 0, :30] = tiny_prompts((30,))[0]
    _, ok = engine._call_prefill(
        np.array([[0, 2]], np.int32), prompts, np.array([[30, 0]], np.int32)
    )
    assert ok.all()
    before = jax.tree.map(np.array, engine.state)
    out = engine._call_step(np.array([[0, 2]], np.int32), np.array([[True, False]]))
    tokens, lens, ok = out.accept_tokens, out.accept_lens, out.ok
    assert not ok.any() and not lens.any() and not tokens.any()
    after = jax.tree.map(np.array, engine.state)
    page = ecfg.spec.page_size

    def same(path, b, a):
        name = jax.tree_util.keystr(path)
        if name.startswith((".kv.target_pool", ".kv.draft_pool")):  # [D, layers, slots, ...]
            b, a = b[:, :, page:], a[:, :, page:]
        np.testing.assert_array_equal(a, b, err_msg=name)

    jax.tree_util.tree_map_with_path(same, before, after)


def test_gemm_impl_compile_options(monkeypatch):
    """``gemm_impl``: validated; "auto" turns the Triton GEMM emitter off (cuBLAS) on GPU for
    calls of >= CUBLAS_MIN_TOKENS target tokens only; nothing off the GPU. Resolved once, in
    make_engine_config (the policy's gemm_compiler_options)."""
    import jax

    from jspec.kernels import policy as st

    with pytest.raises(ValueError, match="gemm_impl"):
        make_engine_config(TINY, max_running_requests=2, gemm_impl="cudnn")
    auto = make_engine_config(TINY, max_running_requests=2).kernels
    cublas = make_engine_config(TINY, max_running_requests=2, gemm_impl="cublas").kernels
    xla = make_engine_config(TINY, max_running_requests=2, gemm_impl="xla").kernels
    off = (("xla_gpu_enable_triton_gemm", False),)
    if jax.default_backend() != "gpu":
        assert auto.gemm_compiler_options(512) == cublas.gemm_compiler_options(512) == ()
    monkeypatch.setattr(st.jax, "default_backend", lambda: "gpu")
    auto = make_engine_config(TINY, max_running_requests=2).kernels  # resolved on the "GPU"
    assert auto.gemm_compiler_options(st.CUBLAS_MIN_TOKENS - 1) == ()
    assert auto.gemm_compiler_options(st.CUBLAS_MIN_TOKENS) == off
    assert cublas.gemm_compiler_options(1) == off
    assert xla.gemm_compiler_options(4096) == ()


def test_finished_searches_each_new_token_once_for_a_stop_id():
    """``Engine._finished``: a stop id among the tokens since the last call ends the request
    (output cut after it), the first new token included; tokens already searched are not
    searched again; without a stop id the budget ends it."""
    from types import SimpleNamespace

    engine = SimpleNamespace(eos_token_id=[2, 3])
    req = Request(0, [1], 100, output=[5, 6, 7])
    assert not Engine._finished(engine, req) and req.stop_scanned == 3
    req.output.extend([2, 9, 3])  # the first new token is a stop id
    assert Engine._finished(engine, req) and req.output == [5, 6, 7, 2]
    old = Request(1, [1], 100, output=[5, 2, 7], stop_scanned=3)  # 2 was searched already
    assert not Engine._finished(engine, old) and old.output == [5, 2, 7]
    budget = Request(2, [1], 4, output=[5, 6, 7, 8, 9])
    assert Engine._finished(SimpleNamespace(eos_token_id=None), budget)
    assert budget.output == [5, 6, 7, 8]


def _take_rounds_oracle(out, order, running, stats, wall, spec):
    """The host pass written as plain loops (round, shard, entry): the oracle of the
    vectorized ``Engine._take_rounds``."""
    num = [int(x) for x in np.asarray(out.num_rounds).reshape(-1)]
    lens, tokens = np.asarray(out.lens), np.asarray(out.tokens)
    emitted = []
    for r in range(max(num)):
        stats.num_decode_steps += 1
        stats.step_s.append(wall / max(num))
        stats.batch_sizes.append(int((lens[:, r] > 0).sum()))
        for s, slots in enumerate(order):
            if r >= num[s]:
                continue
            for i, slot in enumerate(slots):
                n = int(lens[s, r, i])
                if n:
                    running[s][slot].output.extend(tokens[s, r, i, :n].tolist())
                    emitted.append(n)
                    if spec:
                        running[s][slot].accept_lens.append(n)
                        stats.accept_lens.append(n)
    return float(np.mean(emitted)) if emitted else 0.0


@pytest.mark.parametrize("mode,plain", [("spec", False), ("spec", True), ("greedy", False)])
def test_take_rounds_equals_the_plain_loops(mode, plain):
    """``Engine._take_rounds`` on random dispatches of two shards (fewer rounds on one, entries
    that stopped mid-dispatch, padding entries past each shard's requests holding garbage
    lengths): outputs, acceptance lists, stats and the returned mean equal the loops'."""
    from types import SimpleNamespace

    from jspec.engine.scheduler import RunStats

    rng = np.random.default_rng(7)
    w = 8 if mode == "spec" else 1
    for trial in range(20):
        d, r, bb = 2, int(rng.integers(1, 6)), 8
        num = rng.integers(0, r + 1, d).astype(np.int32)
        num[rng.integers(d)] = r
        lens = rng.integers(1, w + 1, (d, r, bb)).astype(np.int32)
        lens[rng.random((d, r, bb)) < 0.2] = 0
        order = [sorted(rng.choice(16, int(rng.integers(1, bb + 1)), replace=False).tolist())]
        order.append(sorted(rng.choice(16, int(rng.integers(0, bb + 1)), replace=False).tolist()))
        for s in range(d):  # rounds past a shard's count: zero, as the device leaves them
            lens[s, num[s] :] = 0
        out = SimpleNamespace(
            num_rounds=num, lens=lens, tokens=rng.integers(0, 999, (d, r, bb, w)).astype(np.int32)
        )

        def fresh():
            runs = [{slot: Request(slot, [1], 99, output=[5]) for slot in o} for o in order]
            return runs, RunStats(mode=mode)

        got_run, got_stats = fresh()
        engine = SimpleNamespace(mode=mode)
        got = Engine._take_rounds(engine, out, order, got_run, got_stats, 0.5, plain)
        want_run, want_stats = fresh()
        want = _take_rounds_oracle(
            out, order, want_run, want_stats, 0.5, mode == "spec" and not plain
        )
        assert got == pytest.approx(want), trial
        for got_shard, want_shard in zip(got_run, want_run):
            for slot in want_shard:
                assert got_shard[slot].output == want_shard[slot].output, (trial, slot)
                assert got_shard[slot].accept_lens == want_shard[slot].accept_lens
        for field in ("num_decode_steps", "step_s", "batch_sizes", "accept_lens"):
            assert getattr(got_stats, field) == getattr(want_stats, field), (trial, field)
