"""Data-parallel shards and tensor-parallel heads (shard_map over 4 host devices) give the
one-device outputs; zero-element state leaves stay out of the shard_map (jax 0.11's crash,
bench/repro_shard_map_crash.py).

XLA's host device count must be set before JAX starts, so the checks run in subprocesses.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import sys
    sys.path.insert(0, {helpers!r})
    import jax
    from engine_helpers import (TINY, TARGET, DRAFT, CONTEXT_LEN, MAX_PROMPT, MAX_NEW,
                                greedy_baseline, tiny_model, tiny_prompts)
    from jspec.engine.scheduler import Engine
    from jspec.engine.state import make_engine_config

    assert len(jax.devices()) == 4, jax.devices()
    params, draft = tiny_model()
    ecfg = make_engine_config(TINY, page_size=16, topk=4, num_steps=3, num_draft_tokens=8,
                              context_len=CONTEXT_LEN, max_running_requests=1,
                              max_prompt_len=MAX_PROMPT, batch_buckets=(1,))
    lens = (3, 17, 9, 30, 5, 12)
    prompts = tiny_prompts(lens)
    arrivals = [0, 0, 1, 2, 3, 3]
    out4, st4 = Engine(ecfg, TARGET, params, DRAFT, draft, num_devices=4).generate(prompts, MAX_NEW,
                                                                    arrivals=arrivals)
    out1, st1 = Engine(ecfg, TARGET, params, DRAFT, draft, num_devices=1).generate(prompts, MAX_NEW,
                                                                    arrivals=arrivals)
    assert out4 == out1, (out4, out1)
    assert out4 == [list(o) for o in greedy_baseline(lens)]
    assert st4.request_accept_lens == st1.request_accept_lens
    assert st4.leak_check.startswith("ok: 4 x"), st4.leak_check
    print("MULTIDEVICE OK", st4.num_decode_steps, st1.num_decode_steps)
""")


_TP_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import sys
    sys.path.insert(0, {helpers!r})
    import jax
    import numpy as np
    from engine_helpers import (TINY, TARGET, DRAFT, CONTEXT_LEN, MAX_PROMPT, MAX_NEW, tiny_model,
                                tiny_prompts)
    from jspec.models import LlamaConfig, LlamaTarget, toy_eagle1, toy_llama_params
    from jspec.engine.scheduler import Engine
    from jspec.engine.state import make_engine_config

    def ecfg(model, tp, running=2):
        return make_engine_config(model, page_size=16, topk=4, num_steps=3, num_draft_tokens=8,
                                  context_len=CONTEXT_LEN, max_running_requests=running,
                                  max_prompt_len=MAX_PROMPT, batch_buckets=(running,),
                                  tensor_parallel=tp)

    lens = {lens!r}
    prompts = tiny_prompts(lens)
    arrivals = {arrivals!r}
    params, draft = tiny_model()
    # The one-device run (this ecfg(TINY, 1), these prompts and arrivals): the test's process
    # computed it (_one_device_spec), its compile shared with the two-process test's reference.
    ref, ref_accept_lens = {ref!r}, {ref_accept_lens!r}

    # 2 data-parallel shards x 2 tensor-parallel devices: spec and plain greedy.
    eng = Engine(ecfg(TINY, 2), TARGET, params, DRAFT, draft, num_devices=2)
    # The layers and the pools really are split over tp (1 of the 2 KV heads per device).
    wqkv = eng.weights.target.layers[0].wqkv
    assert wqkv.sharding.spec == jax.sharding.PartitionSpec(None, "tp", None, None)
    assert wqkv.addressable_shards[0].data.shape == (32, 1, 4, 8)  # 1 KV head, its 2 q heads
    assert eng.state.kv.target_pool.k.addressable_shards[0].data.shape[1:] == (2, 688, 1, 8)
    assert eng.state.kv.allocator.free_pages.addressable_shards[0].data.shape[0] == 1
    out, stats = eng.generate(prompts, MAX_NEW, arrivals=arrivals)
    assert out == ref, (out, ref)
    assert stats.request_accept_lens == ref_accept_lens
    assert stats.leak_check.startswith("ok: 2 x"), stats.leak_check
    greedy, _ = Engine(ecfg(TINY, 2), TARGET, params, num_devices=2).generate(
        prompts, MAX_NEW, arrivals=arrivals)
    assert greedy == ref, (greedy, ref)

    # One shard over 4 tensor-parallel devices (4 KV heads: one per device), with checkify.
    wide = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=8, num_kv_heads=4, head_dim=8)
    wtarget = LlamaTarget(wide)
    wparams = toy_llama_params(wtarget, 0, residual_scale=1.5)
    wdraft_model, wdraft = toy_eagle1(wtarget, wparams, 1, hidden_mix=1.0)
    wref, _ = Engine(ecfg(wide, 1, 4), wtarget, wparams, wdraft_model, wdraft).generate(
        prompts, MAX_NEW)
    wout, wstats = Engine(ecfg(wide, 4, 4), wtarget, wparams, wdraft_model, wdraft,
                          checkify=True).generate(
        prompts, MAX_NEW)
    assert wout == wref, (wout, wref)
    assert wstats.leak_check.startswith("ok: 1 x"), wstats.leak_check

    # The demo's flags: 2 shards x 2 tensor-parallel devices.
    from test_engine_demo import TINY_ARGS
    from jspec.apps.demo import main
    assert main(TINY_ARGS + ["--devices", "2", "--tensor-parallel", "2", "--temperature", "0"]) == 0
    print("TENSOR PARALLEL OK", stats.num_decode_steps, wstats.mean_accept_len)
""")


def _run(script: str, marker: str, **fields: object) -> None:
    helpers = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-c", script.format(helpers=helpers, **fields)],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker in proc.stdout


def test_four_shards_equal_one_device():
    _run(_SCRIPT, "MULTIDEVICE OK")


_LENS = (3, 17, 9, 30, 5, 12)
_ARRIVALS = (0, 0, 1, 2, 3, 3)


@functools.cache
def _one_device_spec(arrivals: tuple[int, ...] | None) -> tuple[list, list]:
    """Tokens and per-request accept lengths of the one-device spec engine (page 16, topk 4,
    3 steps, 8 draft tokens, 2 running) on the ``_LENS`` prompts: the reference of the
    tensor-parallel script and of the two-process test (one compile in this process serves both)."""
    from engine_helpers import (
        CONTEXT_LEN,
        DRAFT,
        MAX_NEW,
        MAX_PROMPT,
        TARGET,
        TINY,
        tiny_model,
        tiny_prompts,
    )

    from jspec.engine.scheduler import Engine
    from jspec.engine.state import make_engine_config

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
    )
    kw = {} if arrivals is None else {"arrivals": list(arrivals)}
    out, stats = Engine(ecfg, TARGET, params, DRAFT, draft).generate(
        tiny_prompts(_LENS), MAX_NEW, **kw
    )
    accept = [[int(a) for a in r] for r in stats.request_accept_lens]
    return out, accept


def test_tensor_parallel_equals_one_device():
    """dp=2 x tp=2 (spec and greedy) and dp=1 x tp=4 (spec, checkify on) == one device; the
    demo runs with --devices 2 --tensor-parallel 2."""
    ref, ref_accept_lens = _one_device_spec(_ARRIVALS)
    _run(
        _TP_SCRIPT,
        "TENSOR PARALLEL OK",
        lens=_LENS,
        arrivals=list(_ARRIVALS),
        ref=ref,
        ref_accept_lens=ref_accept_lens,
    )


def _two_device_layouts_give_one_device_tokens() -> None:
    """dp2 x tp1 and dp1 x tp2 == one device (greedy tokens), greedy and spec, on the ``jspec
    demo`` model (f32) and flags; every allocator balanced after the run."""
    from jspec.apps.demo import _build_models, _parser, _plan_models
    from jspec.engine.scheduler import Engine
    from jspec.engine.state import make_engine_config

    args = _parser().parse_args([])
    target, _, _ = _plan_models(args)
    params, draft_model, draft = _build_models(args, target)
    rng = np.random.default_rng(0)
    lens = rng.integers(4, 41, 8)
    prompts = [rng.integers(0, target.config.vocab_size, int(n)).tolist() for n in lens]

    def run(dp: int, tp: int, spec: bool) -> list[list[int]]:
        ecfg = make_engine_config(
            target,
            page_size=16,
            topk=4,
            num_steps=3,
            num_draft_tokens=8,
            context_len=128,
            max_running_requests=4,
            max_prompt_len=int(lens.max()),
            tensor_parallel=tp,
        )
        models = (draft_model, draft) if spec else ()
        out, stats = Engine(ecfg, target, params, *models, num_devices=dp).generate(prompts, 24)
        assert stats.leak_check.startswith(f"ok: {dp} x"), (dp, tp, spec, stats.leak_check)
        return out

    reference = run(1, 1, spec=False)
    assert run(1, 1, spec=True) == reference
    for dp, tp in ((2, 1), (1, 2)):
        for spec in (False, True):
            assert run(dp, tp, spec) == reference, (dp, tp, spec)


@pytest.mark.gpu
def test_two_gpus_give_one_gpu_tokens():
    """On a machine with 2+ GPUs (``JSPEC_TEST_GPU=1``): both 2-GPU layouts, greedy and spec,
    give the one-GPU tokens (issue 24: jax 0.11.2 crashed compiling every 2-device layout)."""
    import jax

    if sum(d.platform == "gpu" for d in jax.devices()) < 2:
        pytest.skip("needs 2 GPUs")
    _two_device_layouts_give_one_device_tokens()


@pytest.mark.gpu
def test_tensor_parallel_long_prompts_through_cudnn():
    """tp 2 on 2 GPUs, a bf16 model, prompts whose first chunk goes through cuDNN (the default
    for bf16 on the GPU) inside the shard_map: the one-GPU tokens and (within bf16 rounding)
    KV pool; allocators balanced."""
    import jax
    from test_paged_prefill_cudnn import check_long_runs, long_prompt_run

    if sum(d.platform == "gpu" for d in jax.devices()) < 2:
        pytest.skip("needs 2 GPUs")
    one, two = long_prompt_run("cudnn"), long_prompt_run("cudnn", tensor_parallel=2)
    assert one.cudnn_traces >= 1 and two.cudnn_traces >= 1, (one.cudnn_traces, two.cudnn_traces)
    assert one.pool.shape == two.pool.shape
    check_long_runs(two, one)


_ZERO_ELEMENT_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import re
    from typing import NamedTuple
    import jax
    import jax.numpy as jnp
    from jspec.engine import sharding

    class Cfg(NamedTuple):
        tensor_parallel: int = 1

    class Run(NamedTuple):
        ecfg: Cfg = Cfg()

    def body(runner, params, state, slot_idx, empty_arg):
        # The greedy state's pattern: a zero-element leaf (draft_hidden [M, 0]) carried through.
        assert state["hidden"].shape == (4, 0) and empty_arg.shape == (0, 3), state
        assert params["empty"].shape == (0,)
        x = state["x"].at[slot_idx].add(params["w"])
        return dict(state, x=x), x.sum()

    state = {{"x": jnp.zeros((2, 4)), "hidden": jnp.zeros((2, 4, 0), jnp.bfloat16)}}
    state = sharding.stack_states([{{k: v[d] for k, v in state.items()}} for d in range(2)], 2)
    params = {{"w": jnp.ones(()), "empty": jnp.zeros((0,))}}
    args = (jnp.array([[1], [2]]), jnp.zeros((2, 0, 3)))
    for checkify in (False, True):
        fn = sharding.sharded(body, Run(), 2, checkify)
        text = fn.lower(params, state, *args).as_text()
        edges = [line for line in text.splitlines()
                 if "sdy.manual_computation" in line or "sdy.return" in line]
        assert edges and not any(re.search(r"tensor<(?:[0-9]+x)*0x", e) for e in edges), edges
        outs = fn(params, state, *args)
        state, out = outs[0] if checkify else outs
        assert state["hidden"].shape == (2, 4, 0) and state["hidden"].dtype == jnp.bfloat16
        assert out.tolist() == [1.0 + checkify] * 2, out
        if checkify:
            assert sharding.first_error(outs[1], 2) is None
    print("ZERO ELEMENT OK")
""")


def test_zero_element_state_leaves_stay_out_of_shard_map():
    """A zero-element state leaf, param and argument (the greedy engine's ``draft_hidden [M, 0]``)
    go through :func:`sharding.sharded` over 2 devices without being shard_map operands or results:
    jax 0.11 segfaults compiling such a shard_map (bench/repro_shard_map_crash.py)."""
    _run(_ZERO_ELEMENT_SCRIPT, "ZERO ELEMENT OK")


_PROCESS_SCRIPT = textwrap.dedent("""
    import json
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import sys
    sys.path.insert(0, {helpers!r})
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address="127.0.0.1:{port}", num_processes=2,
                               process_id={pid})
    assert jax.process_count() == 2 and len(jax.devices()) == 4
    from engine_helpers import (TINY, TARGET, DRAFT, CONTEXT_LEN, MAX_PROMPT, MAX_NEW, tiny_model,
                                tiny_prompts)
    from jspec.engine.scheduler import Engine
    from jspec.engine.state import make_engine_config

    params, draft = tiny_model()
    ecfg = make_engine_config(TINY, page_size=16, topk=4, num_steps=3, num_draft_tokens=8,
                              context_len=CONTEXT_LEN, max_running_requests=2,
                              max_prompt_len=MAX_PROMPT, batch_buckets=(2,), tensor_parallel=2)
    out, stats = Engine(ecfg, TARGET, params, DRAFT, draft, num_devices=2).generate(
        tiny_prompts({lens!r}), MAX_NEW)
    print("OUT" + json.dumps([out, stats.leak_check]))
""")


def test_two_processes_with_jax_distributed():
    """Multi-host, emulated: 2 processes x 2 CPU devices joined by ``jax.distributed``; the mesh
    is 2 data-parallel shards (one per process) x 2 tensor-parallel devices (within a process).
    Every process runs the same host loop and gets the one-device tokens."""
    import json
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    helpers = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _PROCESS_SCRIPT.format(helpers=helpers, port=port, pid=pid, lens=_LENS),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (stdout, stderr) in zip(procs, results, strict=True):
        assert p.returncode == 0, stdout + stderr
    ref, _ = _one_device_spec(None)  # no arrivals
    for stdout, _ in results:
        out, leak = json.loads(stdout.split("OUT", 1)[1])
        assert out == ref
        assert leak.startswith("ok: 2 x"), leak


def test_weight_shapes_get_the_shardings_replicate_would_place_them_by():
    """sharding.replicate of jax.ShapeDtypeStruct weights (an engine built before they load:
    jspec generate on any layout) gives each leaf the NamedSharding its loaded array gets."""
    import jax
    from engine_helpers import TARGET, tiny_model

    from jspec.engine import sharding

    params, _ = tiny_model()
    shapes = jax.eval_shape(lambda: params)
    placed = sharding.replicate(TARGET, params, 1, 1)  # one device: as it is
    assert placed is params and sharding.replicate(TARGET, shapes, 1, 1) is shapes
    mesh = sharding.make_mesh(1, 1)
    specs = sharding.param_specs(TARGET, params, 1)
    real = sharding._place(params, specs, mesh)
    abstract = sharding._place(shapes, specs, mesh)
    assert jax.tree.structure(real) == jax.tree.structure(abstract)
    for x, a in zip(jax.tree.leaves(real), jax.tree.leaves(abstract), strict=True):
        assert isinstance(a, jax.ShapeDtypeStruct)
        assert (a.shape, a.dtype, a.sharding) == (x.shape, x.dtype, x.sharding)
