"""The sampled tree step emits exactly the target's law, for any tree; mutants of it do not.

The unit under test is the spec step's sampled accept branch as the engine calls it
(``jspec.engine.spec_step.sample_tree``: temperature / top-k / min-p / top-p processing, the
counter-based coins, the exact sibling walk), over fixed trees whose target rows come from a
logits table indexed by (depth, token), so the law of one step's output is known exactly
(``sampling_stats.tree_step_law``). Every trial is one batch row with its own seed; ``n``
trials per (tree, parameters) case, judged by chi-square (fail at p < 1e-6) with TV reported.

Trees (``N`` up to 12, max depth 4): a topk-1 chain, topk 2 / depth 3, topk 4 / depth 4,
duplicate siblings (two children with one token, different subtrees; also at depth 2), and
zero-probability first siblings (-inf logits; and tokens cut by top-k / min-p / top-p under
those parameters). Parameters: T 0.7 + top-p 0.9, T 1.3 + top-k 3 + min-p 0.05, T 1.

The grid test feeds dyadic target probabilities (multiples of 1/16) and walk coins uniform on
the 16-grid: still exact for the half-open walk (every CDF breakpoint lies on the grid, so
``P(coin < c) = c``), while a closed comparison (``coin <= cdf``) accepts on ties: the only way
a sampling test can see that boundary.

Mutants (``mutants.py``: the real source with one expression changed) must fail: each is shown
to be caught, so the tests have power. ``JSPEC_SAMPLING_N`` sets ``n`` (default 2e4; the slow
test runs 2e5).
"""

from __future__ import annotations

import collections
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mutants import MUTANTS, apply_mutant
from sampling_stats import dyadic_rows, judge, processed_np, top_p_margin, tree_step_law

import jspec.engine.sampling as engine_sampling
from jspec.engine import spec_step
from jspec.engine.sampling import SamplingBatch
from jspec.tree.build import BuildTreeOutput
from jspec.tree.sampling import LossyThresholds, tree_speculative_sampling_target_only
from jspec.tree.sampling_keys import seed_words

V, PERIOD, MAX_DEPTH, N_NODES, ROOT_TOKEN = 6, 4, 4, 12, 1
N_CI = int(os.environ.get("JSPEC_SAMPLING_N", 20_000))
N_SLOW = 200_000
PARAM_SETS = {
    "T0.7_top_p0.9": dict(temperature=0.7, top_p=0.9),
    "T1.3_top_k3_min_p0.05": dict(temperature=1.3, top_k=3, min_p=0.05),
    "T1": dict(temperature=1.0),
}
# parents (node 0 the root), and how each node's token is chosen from its parent's row:
# "topK" the K-th most likely, "low" the least likely possible, "zero" an impossible token
# (-inf logit), "dupJ" node J's token (a duplicate sibling).
TREES = {
    "chain_topk1_depth3": ([-1, 0, 1, 2], ["", "top1", "top1", "top2"]),
    "topk2_depth3": ([-1, 0, 0, 1, 1, 3, 3], ["", "top1", "top2", "top1", "low", "top1", "zero"]),
    "topk4_depth4": (
        [-1, 0, 0, 0, 0, 1, 1, 1, 5, 5, 8, 8],
        ["", "top2", "top1", "zero", "low", "top1", "top2", "top3", "top1", "zero", "top1", "top2"],
    ),
    "duplicates": (
        [-1, 0, 0, 0, 1, 2, 2, 2, 5, 4],
        ["", "top1", "dup1", "top2", "top1", "top2", "dup5", "top1", "top1", "top1"],
    ),
    "zero_prob_first": ([-1, 0, 0, 0, 1, 1], ["", "zero", "top1", "zero", "zero", "top1"]),
}


def _make_table(seed: int = 7) -> np.ndarray:
    """f32[PERIOD * V, V] logits with a few -inf entries per row, every top-p cut of every
    parameter set at least 2e-3 away from a cumulative mass (no cut decided by rounding)."""
    rng = np.random.default_rng(seed)
    while True:
        table = rng.normal(0.0, 1.3, (PERIOD * V, V))
        forbid = rng.random(table.shape) < 0.2
        forbid[np.arange(len(table)), np.argmin(table, -1)] = True  # every row has one
        forbid[np.arange(len(table)), np.argmax(table, -1)] = False
        table = np.where(forbid, -np.inf, table).astype(np.float32)
        margins = [top_p_margin(row, **p) for row in table for p in PARAM_SETS.values()]
        if min(margins) > 2e-3:
            return table


TABLE = _make_table()


def _depths(parents):
    depth = [0] * len(parents)
    for j, p in enumerate(parents):
        depth[j] = depth[p] + 1 if p >= 0 else 0
    return depth


def _tokens(parents, kinds, row_of, impossible=-np.inf) -> list[int]:
    """Each node's token, chosen by its kind from its parent's row ``row_of(depth, token)``
    (logits, or probabilities with ``impossible=0``)."""
    depth = _depths(parents)
    tokens = [ROOT_TOKEN] + [0] * (len(parents) - 1)
    for j in range(1, len(parents)):
        kind, row = kinds[j], np.asarray(row_of(depth[parents[j]], tokens[parents[j]]))
        possible = [t for t in np.argsort(-row, kind="stable") if row[t] > impossible]
        if kind.startswith("dup"):
            tokens[j] = tokens[int(kind[3:])]
        elif kind.startswith("top"):
            tokens[j] = int(possible[min(int(kind[3:]) - 1, len(possible) - 1)])
        elif kind == "low":
            tokens[j] = int(possible[-1])
        else:  # zero: an impossible token of that row
            tokens[j] = int(np.flatnonzero(row <= impossible)[0])
    return tokens


def _logit_row(depth, token):
    return TABLE[(depth % PERIOD) * V + token]


def _links(parents):
    """sglang's retrive_next_token / retrive_next_sibling (children in node order), padded to
    ``N_NODES`` with unlinked nodes."""
    next_token, next_sibling = [-1] * N_NODES, [-1] * N_NODES
    last_child = {}
    for j, p in enumerate(parents):
        if p < 0:
            continue
        if p in last_child:
            next_sibling[last_child[p]] = j
        else:
            next_token[p] = j
        last_child[p] = j
    return next_token, next_sibling


def _case_law(tree: str, set_name: str) -> dict:
    parents, kinds = TREES[tree]
    params = PARAM_SETS[set_name]
    tokens = _tokens(parents, kinds, _logit_row)
    depth = _depths(parents)
    rows = np.stack(
        [processed_np(_logit_row(depth[j], tokens[j]), **params) for j in range(len(parents))]
    )
    return tree_step_law(parents, tokens, rows, MAX_DEPTH)


def _batch(cases, n, seed_offset=0):
    """Host arrays of ``n`` trials per case: logits, tree, sampling parameters."""
    b = len(cases) * n
    logits = np.zeros((b, N_NODES, V), np.float32)
    tokens = np.zeros((b, N_NODES), np.int32)
    next_token = np.full((b, N_NODES), -1, np.int32)
    next_sibling = np.full((b, N_NODES), -1, np.int32)
    fields = collections.defaultdict(list)
    for c, (tree, set_name) in enumerate(cases):
        parents, kinds = TREES[tree]
        tok = _tokens(parents, kinds, _logit_row)
        depth = _depths(parents)
        sl = slice(c * n, (c + 1) * n)
        for j in range(len(parents)):
            logits[sl, j] = _logit_row(depth[j], tok[j])
            tokens[sl, j] = tok[j]
        next_token[sl], next_sibling[sl] = _links(parents)
        params = PARAM_SETS[set_name]
        fields["temperature"] += [params["temperature"]] * n
        fields["top_k"] += [params.get("top_k", 0)] * n
        fields["top_p"] += [params.get("top_p", 1.0)] * n
        fields["min_p"] += [params.get("min_p", 0.0)] * n
    tree = BuildTreeOutput(
        tree_mask=jnp.zeros((b, 1, 1), bool),
        positions=jnp.zeros((b * N_NODES,), jnp.int32),
        retrive_index=jnp.arange(b * N_NODES, dtype=jnp.int32).reshape(b, N_NODES),
        retrive_next_token=jnp.asarray(next_token),
        retrive_next_sibling=jnp.asarray(next_sibling),
        draft_tokens=jnp.asarray(tokens.reshape(-1)),
        is_valid=jnp.ones((b,), bool),
    )
    # seed_words(seed_offset + i) for every trial, in numpy (a Python loop over ~3e5 trials cost
    # seconds per call); the first and last checked against seed_words itself.
    ids = np.uint64(seed_offset) + np.arange(b, dtype=np.uint64)
    seeds = np.stack([ids >> np.uint64(32), ids & np.uint64(0xFFFFFFFF)], -1).astype(np.uint32)
    assert [tuple(seeds[i]) for i in (0, -1)] == [seed_words(int(ids[i])) for i in (0, -1)]
    sampling = SamplingBatch(
        temperature=jnp.asarray(np.asarray(fields["temperature"], np.float32)),
        seed=jnp.asarray(seeds),
        top_k=jnp.asarray(np.asarray(fields["top_k"], np.int32)),
        top_p=jnp.asarray(np.asarray(fields["top_p"], np.float32)),
        min_p=jnp.asarray(np.asarray(fields["min_p"], np.float32)),
    )
    return jnp.asarray(logits.reshape(-1, V)), tree, sampling


def _emitted(predict, accept_lens, accept_index) -> np.ndarray:
    """i32[B, MAX_DEPTH + 1]: each trial's emitted tokens (-1 past its accept length)."""
    predict, lens, idx = (np.asarray(x) for x in (predict, accept_lens, accept_index))
    toks = predict[np.maximum(idx, 0)]
    return np.where(np.arange(idx.shape[1])[None, :] < lens[:, None], toks, -1)


def run_sampled_step(cases, n, *, lossy=None, seed_offset=0) -> dict:
    """``{case: [emitted token tuples]}`` through the engine's sampled accept branch (looked up
    at call time: a mutant swapped in by ``monkeypatch`` is what runs)."""
    logits, tree, sampling = _batch(cases, n, seed_offset)
    if lossy is not None:
        sampling = SamplingBatch(**{**sampling.__dict__, "lossy": lossy})
    lens = jnp.full((tree.retrive_index.shape[0],), 5, jnp.int32)

    @jax.jit
    def step(logits, tree, lens, sampling):
        return spec_step.sample_tree(logits, tree, lens, sampling, num_spec_steps=MAX_DEPTH + 1)

    out = _emitted(*step(logits, tree, lens, sampling))
    return {
        case: [tuple(int(t) for t in row if t >= 0) for row in out[c * n : (c + 1) * n]]
        for c, case in enumerate(cases)
    }


ALL_CASES = [(tree, params) for tree in TREES for params in PARAM_SETS]


def _verdicts(samples: dict, label: str = "") -> list:
    return [
        judge(s, _case_law(*case), f"{label}{case[0]}/{case[1]}") for case, s in samples.items()
    ]


def test_tree_token_choices_cover_the_cases():
    """The trees hold what their names say: impossible siblings, duplicates, cut tokens."""
    for tree, (parents, kinds) in TREES.items():
        tokens = _tokens(parents, kinds, _logit_row)
        depth = _depths(parents)
        for j, kind in enumerate(kinds):
            row = _logit_row(depth[parents[j]], tokens[parents[j]]) if j else None
            if kind == "zero":
                assert row[tokens[j]] == -np.inf, (tree, j)
        if tree == "duplicates":
            assert tokens[1] == tokens[2] and tokens[5] == tokens[6]
    cut = processed_np(_logit_row(0, ROOT_TOKEN), **PARAM_SETS["T0.7_top_p0.9"])
    assert (cut == 0).sum() > (_logit_row(0, ROOT_TOKEN) == -np.inf).sum()  # top-p cut some


def test_sampled_tree_step_is_exact():
    """Every (tree, parameters) case matches its exact law (chi-square, p >= 1e-6)."""
    verdicts = _verdicts(run_sampled_step(ALL_CASES, N_CI))
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, bad


def skip_unless_slow(request) -> None:
    """The project's slow convention: slow tests run only under ``-m slow``."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("large n: run with -m slow")


@pytest.mark.slow
def test_sampled_tree_step_is_exact_large_n(request):
    skip_unless_slow(request)
    verdicts = _verdicts(run_sampled_step(ALL_CASES, N_SLOW, seed_offset=10**9), "slow ")
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, bad


# ---- the grid: dyadic probabilities, coins on the 16-grid -------------------------------------
GRID = 16


# f32[PERIOD * V, V]: rows of multiples of 1/16 (some 0), sums exactly 1.
DYADIC = dyadic_rows(np.random.default_rng(3), PERIOD * V, V, 4, GRID)
GRID_TREES = ("topk4_depth4", "duplicates", "zero_prob_first")


def run_grid(trees, n, verify=None, seed: int = 0) -> dict:
    """``{tree: [emitted tuples]}``: the engine's verify op (``jspec.engine.sampling.
    tree_sampling_verify`` at call time) on dyadic rows, walk coins on the 16-grid."""
    verify = verify or engine_sampling.tree_sampling_verify
    rng = np.random.default_rng(seed)
    out = {}
    for tree in trees:
        parents, kinds = TREES[tree]
        tokens = _tokens(parents, kinds, lambda d, t: DYADIC[(d % PERIOD) * V + t], 0.0)
        depth = _depths(parents)
        probs = np.zeros((N_NODES, V), np.float32)
        for j in range(len(parents)):
            probs[j] = DYADIC[(depth[j] % PERIOD) * V + tokens[j]]
        nt, ns = _links(parents)
        cand = np.zeros(N_NODES, np.int32)
        cand[: len(tokens)] = tokens
        args = (
            jnp.asarray(np.tile(cand, (n, 1))),
            jnp.arange(n * N_NODES, dtype=jnp.int32).reshape(n, N_NODES),
            jnp.asarray(np.tile(nt, (n, 1)), jnp.int32),
            jnp.asarray(np.tile(ns, (n, 1)), jnp.int32),
            jnp.asarray(rng.integers(0, GRID, (n, N_NODES)) / GRID, jnp.float32),
            jnp.asarray(rng.random(n), jnp.float32),
            jnp.asarray(np.broadcast_to(probs, (n, N_NODES, V))),
        )
        predicts, accept_index, num = verify(*args, num_spec_steps=MAX_DEPTH + 1)
        emitted = _emitted(predicts, np.asarray(num) + 1, accept_index)
        out[tree] = [tuple(int(t) for t in row if t >= 0) for row in emitted]
    return out


def _grid_law(tree):
    parents, kinds = TREES[tree]
    tokens = _tokens(parents, kinds, lambda d, t: DYADIC[(d % PERIOD) * V + t], 0.0)
    depth = _depths(parents)
    rows = np.stack([DYADIC[(depth[j] % PERIOD) * V + tokens[j]] for j in range(len(parents))])
    return tree_step_law(parents, tokens, rows.astype(np.float64), MAX_DEPTH)


def _grid_verdicts(samples, label=""):
    return [judge(s, _grid_law(tree), f"{label}grid/{tree}") for tree, s in samples.items()]


def test_grid_coins_are_exact():
    """Half-open on the grid: exact even when coins hit CDF breakpoints (1 in 16 draws)."""
    bad = [str(v) for v in _grid_verdicts(run_grid(GRID_TREES, N_CI)) if not v.ok]
    assert not bad, bad


def _sglang_0_5_23(*args, num_spec_steps, lossy=None, predicts_init=0):
    del lossy
    return tree_speculative_sampling_target_only(
        *args, num_spec_steps=num_spec_steps, predicts_init=predicts_init
    )


def test_sglang_0_5_23_kernel_is_not_exact():
    """The parity op (``coin <= cdf``, zero-probability candidates accepted, duplicates counted
    twice): caught on the grid (it emits tokens of probability 0) and on duplicates."""
    grid = _grid_verdicts(run_grid(GRID_TREES, N_CI, _sglang_0_5_23), "sglang-0.5.23 ")
    assert any(v.outside_support for v in grid), [str(v) for v in grid]
    assert not all(v.ok for v in grid)


# ---- mutants -----------------------------------------------------------------------------------
# Each mutant and where it must be caught: "grid" or the cases of the continuous run.
CATCH = {
    "le_boundary": "grid",
    "duplicate_counted_twice": [("duplicates", p) for p in PARAM_SETS],
    "sibling_not_cumulative": [(t, "T1") for t in TREES],
    "residual_not_removed": [(t, "T1") for t in TREES],
    "child_row": [(t, "T1") for t in TREES],
    "temperature_twice": [(t, "T0.7_top_p0.9") for t in TREES],
    "coin_reused": [(t, "T1") for t in TREES],
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_fails(name, monkeypatch):
    assert set(CATCH) == set(MUTANTS)  # every mutant has its catch
    apply_mutant(name, monkeypatch)
    if CATCH[name] == "grid":
        verdicts = _grid_verdicts(run_grid(GRID_TREES, N_CI), f"mutant {name} ")
    else:
        verdicts = _verdicts(run_sampled_step(CATCH[name], N_CI), f"mutant {name} ")
    assert not all(v.ok for v in verdicts), f"mutant {name} survived: {MUTANTS[name][3]}"


@pytest.mark.parametrize(
    "lossy",
    [LossyThresholds(threshold_single=0.3), LossyThresholds(threshold_acc=0.8)],
    ids=["threshold_single_0.3", "threshold_acc_0.8"],
)
def test_lossy_thresholds_change_the_distribution(lossy):
    """sglang's thresholds != 1 (the explicit lossy option) are caught as not exact."""
    cases = [(t, "T1") for t in TREES]
    verdicts = _verdicts(run_sampled_step(cases, N_CI, lossy=lossy), f"lossy {lossy} ")
    assert not all(v.ok for v in verdicts)


def test_greedy_rows_accept_as_verify_tree_greedy():
    """temperature 0 rows of a sampled batch: the greedy verify's outputs exactly."""
    from jspec.tree.verify import eagle_sample_greedy

    cases = [(t, "T1") for t in TREES]
    logits, tree, sampling = _batch(cases, 3)
    sampling = SamplingBatch(**{**sampling.__dict__, "temperature": sampling.temperature * 0})
    b = tree.retrive_index.shape[0]
    lens = jnp.full((b,), 5, jnp.int32)
    got = spec_step.sample_tree(logits, tree, lens, sampling, num_spec_steps=MAX_DEPTH + 1)
    want = eagle_sample_greedy(
        logits,
        tree.draft_tokens.reshape(b, N_NODES),
        tree.retrive_index,
        tree.retrive_next_token,
        tree.retrive_next_sibling,
        num_spec_steps=MAX_DEPTH + 1,
        impl="xla",
    )
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_array_equal(_emitted(*got), _emitted(*want))
