"""Serving-size behaviour on the tiny model: chunked prefill, optimistic admission with
preemption, and a step workspace that does not grow with the KV pool.

Every run is checked token for token against the plain greedy baseline (f32) and for leaks.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_helpers import (
    ARRIVALS,
    CONTEXT_LEN,
    DRAFT,
    MAX_NEW,
    MAX_PROMPT,
    TARGET,
    TINY,
    greedy_baseline,
    tiny_engine,
    tiny_model,
    tiny_prompts,
)

from jspec.engine.memory import kv_bytes_per_token, num_pages_for_memory
from jspec.engine.runner import ENGINE_COMPILER_OPTIONS, Runner
from jspec.engine.state import make_engine_config


def _cfg(**kw):
    opts = {
        "page_size": 4,
        "topk": 2,
        "num_steps": 2,
        "num_draft_tokens": 4,
        "context_len": CONTEXT_LEN,
        "max_running_requests": 4,
        "max_prompt_len": MAX_PROMPT,
        "batch_buckets": (1, 2, 4),
    }
    opts.update(kw)
    return make_engine_config(TINY, **opts)


def _baseline():
    return [list(o) for o in greedy_baseline()]


@pytest.mark.parametrize("spec", [False, True], ids=["greedy", "spec"])
def test_chunked_prefill_equals_one_shot(spec):
    """Prompts of 3..30 tokens prefilled 8 tokens per call (2 prompts per call, several calls
    each, interleaved with decode steps of earlier requests): the one-shot tokens."""
    ecfg = _cfg(prefill_batch=2, chunked_prefill_size=16, prefill_buckets=(4, 8))
    assert ecfg.max_chunk_len == 8
    engine = tiny_engine(ecfg, spec=spec, check_every_step=True)
    out, stats = engine.generate(tiny_prompts(), MAX_NEW, arrivals=ARRIVALS)
    assert out == _baseline()
    assert stats.leak_check.startswith("ok")
    assert stats.num_prefill_calls >= sum(-(-n // 8) for n in (17, 30)) // 2 + 2
    assert all(t > 0 for t in stats.ttft_s)


def test_first_chunks_compile_with_the_prefix_bound(monkeypatch):
    """Where the kernel policy reads a prefix bound (cuDNN's prefill, GPU only; here forced on
    for the reference attention, which ignores it): calls of first chunks run with
    ``max_prefix_len=0``, later chunks without a bound, warm-up compiles both, and the tokens
    are the one-shot ones. A later chunk sent with the bound would be refused whole (the
    prefill's guard) and the run would not finish."""
    from jspec.engine import lifecycle
    from jspec.kernels.policy import KernelPolicy

    monkeypatch.setattr(KernelPolicy, "reads_prefix_bound", lambda self, n: n >= 8)
    ecfg = _cfg(prefill_batch=2, chunked_prefill_size=16, prefill_buckets=(4, 8))
    engine = tiny_engine(ecfg, spec=False)
    engine.warmup()
    prefills = {k[-1] for k in engine._fns if k[0] is lifecycle.prefill_chunk_body}
    assert prefills == {0, None}
    seen = []
    real = engine._call

    def spy(body, num_tokens, *args, prefix_len=None, **kw):
        if body is lifecycle.prefill_chunk_body:
            seen.append((prefix_len, int(np.max(args[3]))))  # (bound, the call's last start)
        return real(body, num_tokens, *args, prefix_len=prefix_len, **kw)

    engine._call = spy
    out, stats = engine.generate(tiny_prompts(), MAX_NEW, arrivals=ARRIVALS)
    assert out == _baseline() and stats.leak_check.startswith("ok")
    assert (0, 0) in seen and any(b is None and start > 0 for b, start in seen)
    assert all(start == 0 for b, start in seen if b == 0)


def test_prefill_buckets_validation():
    with pytest.raises(ValueError, match="prefill_buckets"):
        _cfg(prefill_buckets=(8, 4))
    with pytest.raises(ValueError, match="prefill_buckets"):
        _cfg(prefill_batch=2, chunked_prefill_size=8, prefill_buckets=(8,))
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        _cfg(prefill_batch=2, chunked_prefill_size=1)
    assert _cfg(chunked_prefill_size=8192).prefill_chunk_buckets == (MAX_PROMPT,)
    big = _cfg(context_len=8192, max_prompt_len=8192, chunked_prefill_size=8192)
    assert big.prefill_chunk_buckets == (128, 512, 2048, 8192)
    assert big.prefill_bucket_for(513) == 2048


def test_kv_len_buckets_default_and_validation():
    """The launch hints: 512 keys and every 4x below context_len for the Triton attention,
    none for the reference (it ignores them); explicit buckets validated, naming the field."""
    assert _cfg(attention_impl="xla", context_len=8192, max_prompt_len=64).kv_len_buckets == ()
    tri = _cfg(attention_impl="triton", context_len=8192, max_prompt_len=64)
    assert tri.kv_len_buckets == (512, 2048)
    assert _cfg(attention_impl="triton", context_len=512).kv_len_buckets == ()
    assert _cfg(attention_impl="triton", context_len=513).kv_len_buckets == (512,)
    assert [tri.kv_len_bucket_for(n) for n in (1, 512, 513, 2048, 2049)] == [
        512,
        512,
        2048,
        2048,
        None,
    ]
    for bad in ((16, 8), (8, 8), (0,), (CONTEXT_LEN,), [8]):
        with pytest.raises(ValueError, match="kv_len_buckets"):
            _cfg(kv_len_buckets=bad) if not isinstance(bad, list) else dataclasses.replace(
                _cfg(), kv_len_buckets=bad
            )
    with pytest.raises(ValueError, match="max_kv_len=0"):
        Runner(_cfg(), TARGET, max_kv_len=0)


def test_kv_len_buckets_change_no_token():
    """Spec dispatches compiled per launch hint (short ones under 16 / 32 keys, the rest for
    the width) give the baseline tokens; the hints were used (a jitted step per hint).

    One batch bucket (4): a dispatch's hint is a function of its requests' lengths only, not of
    the batch width (``Engine._kv_len_for``), and the attention plans from the hint and the page
    table alone; every other bucket would compile each hint's step again for the same check."""
    ecfg = _cfg(kv_len_buckets=(16, 32), batch_buckets=(4,))
    engine = tiny_engine(ecfg, spec=True, check_every_step=True)
    out, stats = engine.generate(tiny_prompts(), MAX_NEW, arrivals=ARRIVALS)
    assert out == _baseline() and stats.leak_check.startswith("ok")
    hints = {key[3] for key in engine._fns}
    assert {32, None} <= hints, hints


@pytest.mark.parametrize("spec", [False, True], ids=["greedy", "spec"])
def test_optimistic_admission_preempts_and_loses_no_token(spec):
    """A pool too small for every request's lifetime: optimistic admission runs more requests
    than fit to the end; a decode step that finds the pages short preempts the newest, which
    is prefilled again later with its prompt + emitted tokens: the baseline tokens, no leak."""
    ecfg = _cfg(num_pages=24 if spec else 12)
    engine = tiny_engine(ecfg, spec=spec, admission="optimistic", check_every_step=True)
    out, stats = engine.generate(tiny_prompts(), MAX_NEW)
    assert out == _baseline()
    assert stats.num_preemptions > 0
    assert stats.leak_check.startswith("ok")
    # The same pool under "reserve" admission runs fewer at once and never preempts.
    reserve = tiny_engine(ecfg, spec=spec, check_every_step=True)
    out, stats = reserve.generate(tiny_prompts(), MAX_NEW)
    assert out == _baseline() and stats.num_preemptions == 0


def test_admission_is_validated():
    with pytest.raises(ValueError, match="admission='lazy'"):
        tiny_engine(_cfg(), spec=False, admission="lazy")


def test_step_workspace_does_not_grow_with_the_pool():
    """XLA's buffer assignment of the compiled spec step, prefill chunk and greedy step: the
    temporaries are the same for a 4x larger pool (the pools are donated and updated in place;
    nothing in a step is sized by the pool)."""
    import jax

    from jspec.engine import sharding
    from jspec.engine.greedy import greedy_step_body
    from jspec.engine.lifecycle import prefill_chunk_body
    from jspec.engine.memory import compiled_workspace_bytes
    from jspec.engine.spec_step import spec_step_body

    def workspace(num_pages, body, spec, *args):
        engine = tiny_engine(_cfg(num_pages=num_pages), spec=spec)
        fn = sharding.sharded(body, engine.runner, 1)
        host = [np.asarray(a)[None] for a in args]
        compiled = fn.lower(engine.weights, engine.state, *host).compile()
        pool = sum(x.nbytes for x in jax.tree.leaves(engine.state.kv.target_pool))
        return compiled_workspace_bytes(compiled), pool

    m = 4
    slots, live = np.full(4, m, np.int32), np.zeros(4, bool)
    chunk = (np.full(2, m, np.int32), np.zeros((2, 8), np.int32)) + (np.zeros(2, np.int32),) * 2
    chunk += (np.zeros(2, bool), np.zeros(2, np.int32))
    for body, spec, args in (
        (spec_step_body, True, (slots, live)),
        (greedy_step_body, False, (slots, live)),
        (prefill_chunk_body, True, chunk),
    ):
        small, pool_small = workspace(64, body, spec, *args)
        big, pool_big = workspace(256, body, spec, *args)
        assert pool_big > 3 * pool_small
        assert big <= small + 4096, (body.__name__, small, big)


@pytest.mark.gpu
def test_no_rematerialization_beside_a_pool_that_fills_the_gpu():
    """XLA's rematerialization budget is 80% of device memory minus a program's arguments, so
    beside KV pools that fill the GPU it recomputes what it can on every step (the 8B spec step
    ran each layer's QKV projection twice: ``jspec.engine.runner.ENGINE_COMPILER_OPTIONS``). The
    spec step over pools the size of the device's memory (abstract: nothing is allocated)
    compiles with no rematerialized instruction under the engine's options, through ``jit_step``
    and ``sharding.sharded``; with XLA's defaults (the control) it has some."""
    import jax
    import jax.numpy as jnp

    from jspec.engine import sharding
    from jspec.engine.memory import device_memory
    from jspec.engine.runner import Weights, compiler_options, init_engine_state, jit_step
    from jspec.engine.spec_step import spec_step_body

    limit, _ = device_memory()
    ecfg = _cfg(num_pages=int(limit // (kv_bytes_per_token(TINY, TINY) * 4)))
    params, draft = tiny_model()
    runner = Runner(ecfg, TARGET, DRAFT)
    state = jax.eval_shape(lambda: init_engine_state(runner))
    weights = Weights(params, draft)
    slots, live = jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.bool_)

    def hlo(fn, *args):
        return fn.lower(*args).compile().as_text()

    plain = jax.jit(spec_step_body, static_argnums=0, donate_argnums=2)
    assert ".remat" in hlo(plain, runner, weights, state, slots, live)  # the control
    assert compiler_options() == dict(ENGINE_COMPILER_OPTIONS)
    assert ".remat" not in hlo(jit_step(spec_step_body), runner, weights, state, slots, live)
    stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, *x.shape), x.dtype), state)
    fn = sharding.sharded(spec_step_body, runner, 1)
    one = jax.ShapeDtypeStruct((1, 4), jnp.int32), jax.ShapeDtypeStruct((1, 4), jnp.bool_)
    assert ".remat" not in hlo(fn, weights, stacked, *one)


def test_engine_compiler_options():
    """Rematerialization off, then the caller's pairs (later wins: the GEMM policy and tensor
    parallel's options add to it); importing the engine initialized no JAX backend for them."""
    import subprocess
    import sys

    from jspec.engine import runner as runner_mod

    off = {"xla_disable_hlo_passes": "rematerialization"}
    assert runner_mod.compiler_options() == off == dict(ENGINE_COMPILER_OPTIONS)
    both = runner_mod.compiler_options((("xla_gpu_enable_triton_gemm", False),))
    assert both == {**off, "xla_gpu_enable_triton_gemm": False}
    assert runner_mod.compiler_options((("xla_disable_hlo_passes", ""),)) == {
        "xla_disable_hlo_passes": ""
    }
    code = (
        "import jspec.engine, jax._src.xla_bridge as xb; "
        "assert not xb._backends, sorted(xb._backends); print('NO BACKEND')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert "NO BACKEND" in out.stdout, out.stderr[-2000:]


def test_public_steps_nest_inside_a_callers_jit():
    """``jit_step``'s steps compile with the engine's options at top level; inside a caller's
    own jit (JAX refuses compile options on a nested jit) they trace as a plain nested jit,
    with the same result (here: an all-padding greedy step, which changes nothing)."""
    import jax
    import jax.numpy as jnp

    from jspec.engine.greedy import greedy_step
    from jspec.engine.runner import Weights, init_engine_state

    params, _ = tiny_model()
    runner = Runner(_cfg(), TARGET)
    slots, live = jnp.full((2,), 4, jnp.int32), jnp.zeros((2,), bool)
    top = greedy_step(runner, Weights(params), init_engine_state(runner), slots, live)
    nested = jax.jit(lambda w, st: greedy_step(runner, w, st, slots, live))(
        Weights(params), init_engine_state(runner)
    )
    jax.tree.map(np.testing.assert_array_equal, top, nested)
    shapes = jax.eval_shape(
        lambda w, st: greedy_step(runner, w, st, slots, live),
        Weights(params),
        init_engine_state(runner),
    )
    assert jax.tree.structure(shapes) == jax.tree.structure(top)


def test_num_pages_for_memory():
    """sglang's rule: KV = free after weights - limit * (1 - fraction), per page of both pools."""
    per_token = kv_bytes_per_token(TINY, TINY)
    assert per_token == 2 * 2 * (2 * 2 * 8 * 4)  # K and V, 2 layers, 2 heads x 8, f32, 2 pools
    gib = 2**30
    pages = num_pages_for_memory(
        TINY, TINY, page_size=4, mem_fraction_static=0.9, memory=(10 * gib, 2 * gib)
    )
    assert pages == int((10 * gib - 2 * gib - int(10 * gib * 0.1)) // (per_token * 4)) - 1
    with pytest.raises(ValueError, match="smaller than the step workspace"):
        num_pages_for_memory(
            TINY,
            None,
            page_size=4,
            mem_fraction_static=0.9,
            memory=(10 * gib, 2 * gib),
            workspace_bytes=2 * gib,
        )
    with pytest.raises(ValueError, match="no room for one KV page"):
        num_pages_for_memory(
            TINY, None, page_size=4, mem_fraction_static=0.5, memory=(10 * gib, 6 * gib)
        )
    with pytest.raises(ValueError, match="mem_fraction_static=1.5"):
        num_pages_for_memory(TINY, None, page_size=4, mem_fraction_static=1.5, memory=(1, 0))
    with pytest.raises(ValueError, match="reports no memory statistics"):
        make_engine_config(TINY, mem_fraction_static=0.9)  # CPU: no memory_stats
