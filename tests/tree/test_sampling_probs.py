"""The processed target distribution (temperature, top-k, min-p, top-p) against a sort-based
float64 oracle, the sort-free threshold search, and plain inverse-CDF sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampling_stats import dyadic_rows, judge, processed_np, top_p_margin

from jspec import probes
from jspec.tree.sampling import sample_from_probs
from jspec.tree.sampling_probs import kth_largest, mass_pivot, target_probs_from_logits


def _rows(rng, num, v, ties=False, forbid=0.0):
    logits = rng.normal(0, 2.0, (num, v)).astype(np.float32)
    if ties:  # exact ties, at the top and in the middle
        logits[:, 1] = logits[:, 0]
        logits[:, v // 2 : v // 2 + 3] = logits[:, v // 2 : v // 2 + 1]
    if forbid:
        mask = rng.random((num, v)) < forbid
        mask[np.arange(num), np.argmax(logits, -1)] = False
        logits = np.where(mask, -np.inf, logits).astype(np.float32)
    return logits


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("v", [2, 7, 64, 1000])
def test_matches_sort_based_oracle(v, ties):
    rng = np.random.default_rng(v + ties)
    b, n = 16, 3
    logits = _rows(rng, b * n, v, ties=ties, forbid=0.1)
    temps = rng.choice([0.0, 0.3, 1.0, 1.7], b).astype(np.float32)
    top_ks = rng.choice([0, 1, 2, 5, v, v + 3], b).astype(np.int32)
    top_ps = rng.choice([1.0, 0.95, 0.6, 0.2], b).astype(np.float32)
    min_ps = rng.choice([0.0, 0.01, 0.3], b).astype(np.float32)
    got = np.asarray(
        target_probs_from_logits(
            jnp.asarray(logits),
            jnp.asarray(temps),
            jnp.asarray(top_ks),
            jnp.asarray(top_ps),
            jnp.asarray(min_ps),
        )
    ).reshape(b * n, v)
    checked = 0
    for r in range(b * n):
        params = dict(
            temperature=float(temps[r // n]),
            top_k=int(top_ks[r // n]),
            top_p=float(top_ps[r // n]),
            min_p=float(min_ps[r // n]),
        )
        if top_p_margin(logits[r], **params) < 1e-5:
            continue  # a cut decided by rounding: f32 and f64 may both be right
        want = processed_np(logits[r], **params)
        np.testing.assert_array_equal(got[r] > 0, want > 0, err_msg=f"row {r} {params}")
        np.testing.assert_allclose(got[r], want, rtol=2e-5, atol=1e-7, err_msg=str(params))
        checked += 1
    assert checked > 0.8 * b * n


@pytest.mark.gpu
@pytest.mark.parametrize("v", [7, 64, 1000])
def test_matches_sort_based_oracle_compiled_on_gpu(v):
    """The same comparison where ``-m gpu`` selects it, on the GPU's fusions: they once
    recomputed the softmax inside each consumer, rounding each its own way, so a threshold read
    from one copy dropped its own token from another (``top_k=2`` kept one token)."""
    for ties in (False, True):
        test_matches_sort_based_oracle(v, ties)


def test_rows_are_materialised_once_before_the_thresholds():
    """CPU guard of the GPU test above (CI has no GPU): the filters read one barrier'd copy
    of the row values, never a softmax XLA may recompute per consumer."""
    args = (jnp.zeros((2, 8)), jnp.ones((2,)), jnp.full((2,), 3), jnp.full((2,), 0.9), None)
    assert "optimization_barrier" in str(jax.make_jaxpr(target_probs_from_logits)(*args))


def test_greedy_rows_are_one_hot_first_argmax():
    logits = jnp.asarray([[1.0, 3.0, 3.0, -jnp.inf], [0.0, 0.0, 0.0, 0.0]])
    got = target_probs_from_logits(
        logits, jnp.zeros(2), jnp.asarray([1, 2]), jnp.asarray([0.5, 0.5])
    )
    np.testing.assert_array_equal(got[:, 0], [[0, 1, 0, 0], [1, 0, 0, 0]])


def test_absent_filters_compile_nothing_extra():
    logits = jnp.ones((2, 5))
    plain = target_probs_from_logits(logits, jnp.ones(2))
    filtered = target_probs_from_logits(
        logits, jnp.ones(2), jnp.zeros(2, jnp.int32), jnp.ones(2), jnp.zeros(2)
    )
    np.testing.assert_allclose(plain, filtered)
    np.testing.assert_allclose(plain, 0.2)


@pytest.mark.parametrize("ways", [2, 5, 16])
def test_threshold_search_is_exact_with_ties_and_zeros(ways):
    rng = np.random.default_rng(ways)
    for v in (1, 2, 3, 17, 300):
        p = rng.dirichlet(np.full(v, 0.5), 40).astype(np.float32)
        p[:10, : v // 2] = 0.0
        p[10:20, : (v + 1) // 2] = p[10:20, :1]  # ties
        k = rng.integers(1, v + 1, 40).astype(np.int32)
        got = np.asarray(kth_largest(jnp.asarray(p), jnp.asarray(k), ways=ways))
        want = np.array([np.sort(row)[::-1][kk - 1] for row, kk in zip(p, k)])
        np.testing.assert_array_equal(got, want)
        target = (rng.uniform(1e-3, 1.0, 40) * p.sum(-1)).astype(np.float32)
        got = np.asarray(mass_pivot(jnp.asarray(p), jnp.asarray(target), ways=ways))
        for row, t, g in zip(p, target, got):
            mass = lambda x: row[row >= x].sum(dtype=np.float32)  # noqa: E731
            assert g in row and mass(g) >= t
            above = row[row > g]
            assert above.size == 0 or mass(above.min()) < t


def test_threshold_search_rejects_one_way():
    with pytest.raises(ValueError, match="ways"):
        kth_largest(jnp.ones((1, 4)), jnp.ones(1, jnp.int32), ways=1)


def test_nan_logits_probe():
    logits = jnp.asarray([[0.0, jnp.nan]])
    with pytest.raises(probes.ProbeError, match="target logits"):
        probes.checked(target_probs_from_logits)(logits, jnp.ones(1))


def test_sample_from_probs_law_and_support():
    probs = np.array([0.5, 0.0, 0.125, 0.25, 0.0, 0.125], np.float32)
    n = 40_000
    coins = np.random.default_rng(0).random(n).astype(np.float32)
    got = np.asarray(sample_from_probs(jnp.asarray(np.tile(probs, (n, 1))), jnp.asarray(coins)))
    verdict = judge([(int(t),) for t in got], {(i,): float(p) for i, p in enumerate(probs)})
    assert verdict.ok, verdict
    edge = sample_from_probs(
        jnp.asarray([[0.0, 0.5, 0.5], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]),
        jnp.asarray([0.0, 0.3, 1 - 2**-24]),
    )
    assert edge.tolist() == [1, 0, 1]  # coin 0: never a zero-probability token


@pytest.mark.parametrize("v", [100, 1000])
def test_sample_from_probs_coin_near_one_is_a_token_with_mass(v):
    """The top coins of the grid: ``coin * sum`` can round past ``cumsum[-1]`` (the two sum in
    different orders); the draw is then the last token with mass, never token ``V - 1`` of
    probability 0 (FlashInfer's ``last_valid_id``)."""
    rng = np.random.default_rng(v)
    rows = 200
    probs = rng.dirichlet(np.full(v, 0.3), rows).astype(np.float32)
    probs[rng.random((rows, v)) < 0.3] = 0.0
    probs[:, -1] = 0.0
    last_valid = v - 1 - np.argmax(probs[:, ::-1] > 0, axis=-1)
    for k in (1, 2, 3):
        coins = jnp.full((rows,), 1 - k * 2**-24, jnp.float32)
        got = np.asarray(sample_from_probs(jnp.asarray(probs), coins))
        assert (probs[np.arange(rows), got] > 0).all(), got[probs[np.arange(rows), got] == 0]
        assert (got <= last_valid).all()


def test_sample_from_probs_is_half_open_on_the_grid():
    """Dyadic rows, one coin per point of the 16-grid: token ``v`` owns ``[cdf[v-1], cdf[v])``,
    so each token is drawn exactly ``16 * p[v]`` times (a coin on a breakpoint goes up)."""
    grid, v, rows = 16, 7, 12
    probs = dyadic_rows(np.random.default_rng(11), rows, v, 4, grid)
    coins = np.arange(grid, dtype=np.float32) / grid
    got = np.asarray(
        sample_from_probs(jnp.asarray(np.repeat(probs, grid, 0)), jnp.asarray(np.tile(coins, rows)))
    ).reshape(rows, grid)
    for r in range(rows):
        np.testing.assert_array_equal(np.bincount(got[r], minlength=v), probs[r] * grid)


@pytest.mark.parametrize(
    "present",
    [("top_k",), ("top_p",), ("min_p",), ("top_k", "top_p"), ("top_p", "min_p")],
    ids=lambda p: "+".join(p),
)
def test_each_filter_alone_matches_the_oracle(present):
    """Filters left None (static absence, as ``pack_sampling`` leaves the unused ones): the
    ones given still cut, the absent ones keep everything."""
    rng = np.random.default_rng(len("".join(present)))
    b, n, v = 8, 2, 16
    logits = _rows(rng, b * n, v)
    temps = rng.choice([0.5, 1.0, 1.5], b).astype(np.float32)
    values = dict(
        top_k=rng.choice([1, 3, 6], b).astype(np.int32),
        top_p=rng.choice([0.3, 0.7, 0.9], b).astype(np.float32),
        min_p=rng.choice([0.05, 0.2], b).astype(np.float32),
    )
    got = np.asarray(
        target_probs_from_logits(
            jnp.asarray(logits),
            jnp.asarray(temps),
            *(
                jnp.asarray(values[k]) if k in present else None
                for k in ("top_k", "top_p", "min_p")
            ),
        )
    ).reshape(b * n, v)
    for r in range(b * n):
        params = {k: values[k][r // n].item() for k in present}
        if top_p_margin(logits[r], float(temps[r // n]), **params) < 1e-5:
            continue  # a cut decided by rounding
        want = processed_np(logits[r], float(temps[r // n]), **params)
        np.testing.assert_array_equal(got[r] > 0, want > 0, err_msg=f"row {r} {params}")
        np.testing.assert_allclose(got[r], want, rtol=2e-5, atol=1e-7, err_msg=str(params))


def test_top_p_one_keeps_tokens_below_the_mass_resolution():
    """``top_p`` 1 beside rows that cut: tokens far below the f32 resolution of the row's mass
    (adding one does not change the sum) are still kept."""
    logits = np.array([[0.0, -30.0, 1.0, -40.0], [2.0, 0.0, -35.0, -1.0]], np.float32)
    got = np.asarray(
        target_probs_from_logits(
            jnp.asarray(logits), jnp.ones(2), top_ps=jnp.asarray([1.0, 0.5], jnp.float32)
        )
    )[:, 0]
    want = [processed_np(logits[0]), processed_np(logits[1], top_p=0.5)]
    np.testing.assert_array_equal(got > 0, np.stack(want) > 0)
    np.testing.assert_allclose(got, np.stack(want), rtol=2e-6, atol=0)


@pytest.mark.parametrize("ways", [2, 16])
def test_mass_pivot_target_on_a_cumulative_mass(ways):
    """Dyadic rows (every partial sum exact in f32), each target exactly a cumulative mass of
    the sorted row: the pivot is the value where the mass first reaches it (``>=``)."""
    rng = np.random.default_rng(ways + 1)
    rows, v, grid = 64, 9, 64
    p = dyadic_rows(rng, rows, v, 6, grid)
    desc = -np.sort(-p, axis=-1)
    cut = rng.integers(0, 6, rows)
    target = np.cumsum(desc, axis=-1)[np.arange(rows), cut]
    got = np.asarray(mass_pivot(jnp.asarray(p), jnp.asarray(target), ways=ways))
    np.testing.assert_array_equal(got, desc[np.arange(rows), cut])
