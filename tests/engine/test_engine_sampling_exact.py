"""Through the whole engine: sampled tokens have exactly the target's autoregressive law.

``Engine.generate`` (prefill's sampled first token, the spec steps' sampled tree verification,
continuous batching, release) over :class:`sampling_models.TableTarget` / ``TableDraft``: the
target's law of the first 3 tokens after a prompt is known exactly (a position-dependent
Markov table, float64 oracle), whatever the draft proposes. The draft's tables are noisy copies
of the target's (often right), it proposes impossible tokens (the target's -inf entries) and,
through a non-injective draft-to-target map, duplicate siblings; top-p / top-k / min-p cut
rows. ``n`` requests per parameter set share one prompt and differ by seed; all parameter sets
(and greedy requests) share each batch, so one compiled step serves them all. The joint of
the first 1, 2 and 3 emitted tokens is judged by chi-square (fail at p < 1e-6), TV reported;
greedy requests must give the argmax chain.

CI: the spec engine at topk 4 / depth 4 (10 tree nodes) and the plain sampled engine,
``n = 2e4`` per set; and the toy Llama (context-dependent law, exact by dense enumeration). Slow: topk 1 and 2 trees at ``n = 1e5``, and mutants through the engine.
"""

from __future__ import annotations

import functools
import os
import pathlib
import sys

import numpy as np
import pytest
from sampling_models import TableDraft, TableTarget, exact_joint, make_tables

from jspec.engine import Engine, SamplingParams, make_engine_config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tree"))
from mutants import apply_mutant  # noqa: E402
from sampling_stats import judge, processed_np, top_p_margin  # noqa: E402
from test_sampling_exact import skip_unless_slow  # noqa: E402

V, PERIOD, PROMPT, NUM_TOKENS = 6, 3, [1, 2], 3
N_CI = int(os.environ.get("JSPEC_SAMPLING_N", 20_000))
N_SLOW = 100_000
# Batch width: a sampled request's tokens are a function of (prompt, parameters, seed) only
# (test_engine_sampling_repro.py), so the width changes no sample and no verdict (checked: the
# chi-square lines are identical at 2048 and 256). It sets the host cost: admission sums the
# running requests' pages for every request it admits, O(n * width) in all, which made the 80k
# requests at width 2048 a ~2 min host loop.
MAX_RUNNING = 256
PARAM_SETS = {
    "T0.7_top_p0.9": dict(temperature=0.7, top_p=0.9),
    "T1.3_top_k3_min_p0.05": dict(temperature=1.3, top_k=3, min_p=0.05),
    "T1": dict(temperature=1.0),
}


@functools.cache
def tables() -> tuple[dict, dict]:
    """Target / draft params whose top-p cuts are all >= 2e-3 from a cumulative mass."""
    for seed in range(100):
        tparams, dparams = make_tables(seed, V, PERIOD)
        table = np.asarray(tparams["table"])
        if min(top_p_margin(r, **p) for r in table for p in PARAM_SETS.values()) > 2e-3:
            return tparams, dparams
    raise AssertionError("no table with clear top-p margins")


def greedy_chain() -> list[int]:
    table, out, prev = np.asarray(tables()[0]["table"]), [], PROMPT[-1]
    for i in range(NUM_TOKENS):
        prev = int(np.argmax(table[((len(PROMPT) - 1 + i) % PERIOD) * V + prev]))
        out.append(prev)
    return out


def make_engine(*, spec=True, topk=4, steps=4, draft_tokens=10, **kwargs) -> Engine:
    target, draft = TableTarget(V, PERIOD), TableDraft(V, V, PERIOD)
    ecfg = make_engine_config(
        target,
        page_size=4,
        topk=topk,
        num_steps=steps,
        num_draft_tokens=draft_tokens,
        context_len=16,
        max_running_requests=MAX_RUNNING,
        max_prompt_len=len(PROMPT),
        batch_buckets=(MAX_RUNNING,),
        prefill_batch=MAX_RUNNING,
    )
    tparams, dparams = tables()
    if spec:
        return Engine(ecfg, target, tparams, draft, dparams, **kwargs)
    return Engine(ecfg, target, tparams, **kwargs)


def sample_sets(engine: Engine, n: int, seed_offset: int = 0) -> tuple[dict, list]:
    """``{set: [first NUM_TOKENS tokens of each request]}`` and the greedy requests' outputs,
    every set (and greedy) interleaved in the same batches; request i has seed offset + i."""
    names = list(PARAM_SETS) + ["greedy"]
    params = []
    for i in range(n * len(names)):
        name = names[i % len(names)]
        if name == "greedy":
            params.append(SamplingParams())
        else:
            params.append(SamplingParams(**PARAM_SETS[name], seed=seed_offset + i))
    out, stats = engine.generate([PROMPT] * len(params), NUM_TOKENS, sampling=params)
    assert stats.leak_check.startswith("ok"), stats.leak_check
    by_set = {
        name: [tuple(o[:NUM_TOKENS]) for o in out[k :: len(names)]] for k, name in enumerate(names)
    }
    return {k: v for k, v in by_set.items() if k != "greedy"}, by_set["greedy"]


def judge_sets(samples: dict, label: str) -> list:
    """Verdicts of the joint of the first 1, 2 and 3 tokens, per parameter set."""
    table = np.asarray(tables()[0]["table"])
    verdicts = []
    for name, seqs in samples.items():
        law3 = exact_joint(table, PERIOD, PROMPT, NUM_TOKENS, PARAM_SETS[name])
        for k in range(1, NUM_TOKENS + 1):
            law = {}
            for seq, p in law3.items():
                law[seq[:k]] = law.get(seq[:k], 0.0) + p
            verdicts.append(judge([s[:k] for s in seqs], law, f"{label}{name} first {k}"))
    return verdicts


def assert_exact(engine: Engine, n: int, label: str, seed_offset: int = 0) -> None:
    samples, greedy = sample_sets(engine, n, seed_offset)
    assert all(list(g) == greedy_chain() for g in greedy), greedy[:3]
    bad = [str(v) for v in judge_sets(samples, label) if not v.ok]
    assert not bad, bad


def test_spec_engine_sampling_is_exact():
    """topk 4, depth 4, 10 nodes: duplicate and impossible siblings, cut rows, greedy mixed."""
    assert_exact(make_engine(), N_CI, "spec topk4 depth4 ")


def test_plain_engine_sampling_is_exact():
    """The plain decode step (no draft) and prefill sample the same processed law."""
    assert_exact(make_engine(spec=False), N_CI, "plain ")


@pytest.mark.slow
@pytest.mark.parametrize(
    "topk,steps,draft_tokens", [(1, 3, 4), (2, 3, 6), (4, 4, 10)], ids=["chain", "topk2", "topk4"]
)
def test_spec_engine_sampling_is_exact_large_n(topk, steps, draft_tokens, request):
    skip_unless_slow(request)
    engine = make_engine(topk=topk, steps=steps, draft_tokens=draft_tokens)
    assert_exact(engine, N_SLOW, f"spec topk{topk} depth{steps} ", seed_offset=10**9)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["temperature_twice", "child_row", "coin_reused"])
def test_mutant_fails_through_the_engine(name, monkeypatch, request):
    """Mutants swapped into the engine (fresh compiles) fail the same judgement."""
    skip_unless_slow(request)
    from jspec.engine import sharding

    apply_mutant(name, monkeypatch)
    sharding.sharded.cache_clear()
    try:
        samples, _ = sample_sets(make_engine(), N_CI)
        verdicts = judge_sets(samples, f"mutant {name} ")
    finally:
        sharding.sharded.cache_clear()
    assert not all(v.ok for v in verdicts), f"mutant {name} survived"


def test_spec_engine_sampling_is_exact_with_a_context_dependent_model():
    """The toy Llama (vocab 8, f32): its law depends on the whole context through attention, so
    the sampled paths' KV bookkeeping (accepted non-first siblings moved into place, the draft
    extend over them) is part of what is judged. Exact law: the dense no-cache forward over all
    73 prefixes (f32 logits; T 1.6, no cut that rounding could decide)."""
    import jax
    import jax.numpy as jnp

    from jspec.engine.reference import _dense_attn_fn
    from jspec.models import LlamaConfig, LlamaTarget, toy_eagle1, toy_llama_params

    cfg = LlamaConfig(
        vocab_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    target = LlamaTarget(cfg)
    params = toy_llama_params(target, 0, residual_scale=1.5)
    draft, dparams = toy_eagle1(target, params, 1, hidden_mix=1.0)
    prompt, params_t = [3, 1, 6], dict(temperature=1.6)

    @jax.jit
    def next_logits(ids, length):
        pos = jnp.arange(ids.shape[0], dtype=jnp.int32)
        _, hidden, _ = target.forward(params, None, ids, pos, _dense_attn_fn(length))
        return target.logits(params, hidden[length - 1][None])[0]

    def law_after(seq):
        ids = np.zeros(8, np.int32)
        ids[: len(seq)] = seq
        return processed_np(np.asarray(next_logits(jnp.asarray(ids), len(seq))), **params_t)

    law = {}
    q1 = law_after(prompt)
    for a in range(8):
        q2 = law_after(prompt + [a])
        for b in range(8):
            q3 = law_after(prompt + [a, b])
            for c in range(8):
                law[(a, b, c)] = q1[a] * q2[b] * q3[c]
    ecfg = make_engine_config(
        target,
        page_size=4,
        topk=4,
        num_steps=3,
        num_draft_tokens=8,
        context_len=16,
        max_running_requests=MAX_RUNNING,
        max_prompt_len=len(prompt),
        batch_buckets=(MAX_RUNNING,),
        prefill_batch=MAX_RUNNING,
    )
    engine = Engine(ecfg, target, params, draft, dparams)
    n = N_CI
    sampling = [SamplingParams(**params_t, seed=i) for i in range(n)]
    out, stats = engine.generate([prompt] * n, NUM_TOKENS, sampling=sampling)
    assert stats.mean_accept_len > 1.2, stats.mean_accept_len  # the tree really accepts
    verdict = judge([tuple(o[:3]) for o in out], law, "spec toy-llama T1.6 first 3")
    assert verdict.ok, verdict
