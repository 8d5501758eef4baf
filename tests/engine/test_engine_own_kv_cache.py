"""examples/own_kv_cache.py: the spec step over a KV cache kept as per-request block tables with
a block allocator written outside jspec (public names only) is lossless against plain greedy
decoding over jspec's paged allocator, and jspec's paged backend is never called on that path."""

from __future__ import annotations

import functools
import pathlib
import runpy

import numpy as np
import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "own_kv_cache.py"


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 64, n).tolist() for n in (3, 9)]


@functools.cache
def _greedy() -> list[list[int]]:
    """Plain greedy decoding of the prompts over jspec's paged allocator (page 4), run once for
    every case: greedy tokens do not depend on the page size or topk (the lossless grid checks
    pages 1 / 16 / 64 against one greedy baseline), so each case compiled its own for nothing."""
    greedy, _ = runpy.run_path(str(EXAMPLE))["run"](_prompts(), 12, spec=False, own_kv=False)
    return greedy


@pytest.mark.parametrize(
    "page_size,topk", [(4, 2), (1, 2), (2, 3)], ids=["holey_P4_K2", "P1_K2", "holey_P2_K3"]
)
def test_block_table_kv_backend_is_lossless(monkeypatch, page_size, topk):
    ns = runpy.run_path(str(EXAMPLE))
    prompts = _prompts()
    kw = {"page_size": page_size, "topk": topk}
    greedy = _greedy()

    from jspec.engine import PagedKVBackend

    def refuse(*args, **kwargs):
        raise AssertionError("jspec's paged KV backend called on the block-table path")

    for method in ("init_state", "prepare_decode", "prepare_prefill", "commit", "release"):
        monkeypatch.setattr(PagedKVBackend, method, refuse)
    spec, accept_lens = ns["run"](prompts, 12, spec=True, own_kv=True, **kw)
    assert spec == greedy
    assert max(accept_lens) > 1


def test_block_table_kv_backend_bad_slots_change_nothing():
    """The input guards serve any KV backend: a slot given twice is ok=False, the block tables,
    lengths and carry bit-identical (only the pools' padding block may change)."""
    import jax
    import jax.numpy as jnp

    from jspec.engine import (
        Runner,
        Weights,
        init_engine_state,
        make_engine_config,
        prefill,
        spec_decode_step,
    )

    ns = runpy.run_path(str(EXAMPLE))
    target, params, draft, dparams = ns["toy_models"]()
    ecfg = make_engine_config(
        target, page_size=4, topk=2, num_steps=3, num_draft_tokens=6, context_len=64,
        max_running_requests=2, max_prompt_len=8, batch_buckets=(2,), prefill_batch=2,
    )  # fmt: skip
    runner = Runner(ecfg, target, draft, kv=ns["BlockTableBackend"](4, 40, 20, 2))
    weights = Weights(params, dparams)
    ids = jnp.asarray([[1, 2, 3, 4, 5, 0, 0, 0], [7, 8, 9, 0, 0, 0, 0, 0]], jnp.int32)
    slots = jnp.asarray([0, 1], jnp.int32)
    state, out = prefill(runner, weights, init_engine_state(runner), slots, ids, slots * 0 + 5)
    assert bool(out.ok)
    before = jax.tree.map(np.array, state)
    state, out = spec_decode_step(
        runner, weights, state, jnp.asarray([0, 0], jnp.int32), jnp.asarray([True, True])
    )
    assert not bool(out.ok) and not np.asarray(out.accept_lens).any()

    def same(path, b, a):
        name = jax.tree_util.keystr(path)
        a = np.asarray(a)
        if name.startswith((".kv.target_pool", ".kv.draft_pool")):
            b, a = b[:, 4:], a[:, 4:]  # the padding block (slots 0..3) is the padding sink
        np.testing.assert_array_equal(a, b, err_msg=name)

    jax.tree_util.tree_map_with_path(same, before, state)
    state, out = spec_decode_step(runner, weights, state, slots, jnp.asarray([True, True]))
    assert bool(out.ok) and np.asarray(out.accept_lens).min() >= 1
