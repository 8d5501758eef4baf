"""tree_speculative_sampling_target_only: §13.3 goldens, serial kernel port, chi-square, probs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampling_stats import dyadic_rows
from test_verify import (
    G_CANDIDATES,
    G_NEXT_SIBLING,
    G_NEXT_TOKEN,
    G_RIDX,
    _random_tree,
    golden_logits,
)
from tree_oracles import ref_tree_sampling

from jspec import probes
from jspec.tree.sampling import (
    LossyThresholds,
    target_probs_from_logits,
    tree_sampling_verify,
    tree_speculative_sampling_target_only,
)


def _i32(x):
    return jnp.asarray(np.asarray(x), jnp.int32)


def _sample(cand, ridx, nt, ns, coins, final, probs, s1, ts=1.0, ta=1.0, init=-1):
    return tree_speculative_sampling_target_only(
        _i32(cand),
        _i32(ridx),
        _i32(nt),
        _i32(ns),
        jnp.asarray(coins, jnp.float32),
        jnp.asarray(final, jnp.float32),
        jnp.asarray(probs, jnp.float32),
        num_spec_steps=s1,
        threshold_single=ts,
        threshold_acc=ta,
        predicts_init=init,
    )


@pytest.mark.parametrize(
    "ts,ta,predicts,accept,num",
    [
        (
            1.0,
            1.0,
            [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18],
            [[0, 3, 4, 5], [6, 10, 11, -1]],
            [3, 2],
        ),
        (
            0.0,
            0.0,
            [1, 2, 18, -1, -1, -1, 11, -1, -1, -1, 12, 18],
            [[0, 1, 2, -1], [6, 10, 11, -1]],
            [2, 2],
        ),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_golden_low_temperature(ts, ta, predicts, accept, num, seed):
    probs = target_probs_from_logits(jnp.asarray(golden_logits()), jnp.array([0.01, 0.01]))
    rng = np.random.default_rng(seed)
    coins = rng.uniform(1e-6, 1.0, (2, 6))
    final = rng.uniform(0.0, 1.0, 2)
    got = _sample(
        G_CANDIDATES, G_RIDX, G_NEXT_TOKEN, G_NEXT_SIBLING, coins, final, probs, 4, ts, ta
    )
    assert got[0].tolist() == predicts
    assert got[1].tolist() == accept
    assert got[2].tolist() == num


@pytest.mark.parametrize("ts,ta", [(1.0, 1.0), (0.6, 0.8), (0.0, 0.0)])
def test_matches_serial_kernel_port(ts, ta):
    rng = np.random.default_rng(5)
    bs, topk, steps, n, v = 6, 4, 3, 12, 6
    for _ in range(2):
        cand, ridx, nt, ns, _ = _random_tree(rng, bs, topk, steps, n, vocab=v)
        probs = rng.dirichlet(np.full(v, 0.7), (bs, n)).astype(np.float32)
        coins = rng.random((bs, n), dtype=np.float32)
        final = rng.random(bs, dtype=np.float32)
        got = _sample(cand, ridx, nt, ns, coins, final, probs, steps + 1, ts, ta)
        want = ref_tree_sampling(cand, ridx, nt, ns, coins, final, probs, steps + 1, ts, ta)
        for name, g, w in zip(("predicts", "accept_index", "accept_token_num"), got, want):
            np.testing.assert_array_equal(g, w, err_msg=name)


def test_matches_serial_kernel_port_on_the_grid():
    """Dyadic probabilities (multiples of 1/8, zeros included) and coins on the 8-grid (0
    included): coins land on CDF breakpoints, where the kernel's closed ``coin <= prob_acc``
    accepts (a zero-probability first sibling at coin 0 too)."""
    rng = np.random.default_rng(6)
    bs, topk, steps, n, v, grid = 16, 4, 3, 12, 6, 8
    for _ in range(3):
        cand, ridx, nt, ns, _ = _random_tree(rng, bs, topk, steps, n, vocab=v)
        probs = dyadic_rows(rng, bs * n, v, 3, grid).reshape(bs, n, v)
        coins = (rng.integers(0, grid, (bs, n)) / grid).astype(np.float32)
        final = (rng.integers(0, grid, bs) / grid).astype(np.float32)
        got = _sample(cand, ridx, nt, ns, coins, final, probs, steps + 1)
        want = ref_tree_sampling(cand, ridx, nt, ns, coins, final, probs, steps + 1, 1.0, 1.0)
        for name, g, w in zip(("predicts", "accept_index", "accept_token_num"), got, want):
            np.testing.assert_array_equal(g, w, err_msg=name)


def _chi_square(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize(
    "q_root",
    [
        [0.30, 0.05, 0.20, 0.10, 0.25, 0.10],  # children tokens {4, 0, 2} hold 75% of the mass
        [0.05, 0.10, 0.10, 0.40, 0.15, 0.20],  # children hold 20%: mostly the residual path
    ],
)
def test_first_token_distribution_is_target(q_root):
    """thresholds (1, 1): the first emitted token is distributed as the root's target probs."""
    num = 4000
    v, n = len(q_root), 5
    q = np.full((n, v), 1.0 / v, np.float32)
    q[0] = q_root
    # Root children 1, 2, 3 (tokens 4, 0, 2) in sibling order; node 4 is a child of node 1.
    cand = np.tile([0, 4, 0, 2, 1], (num, 1))
    nt = np.tile([1, 4, -1, -1, -1], (num, 1))
    ns = np.tile([-1, 2, 3, -1, -1], (num, 1))
    ridx = np.arange(num * n).reshape(num, n)
    rng = np.random.default_rng(42)
    coins = rng.random((num, n), dtype=np.float32)
    final = rng.random(num, dtype=np.float32)
    predicts, _, _ = _sample(cand, ridx, nt, ns, coins, final, np.broadcast_to(q, (num, n, v)), 3)
    first = np.asarray(predicts).reshape(num, n)[:, 0]
    counts = np.bincount(first, minlength=v).astype(np.float64)
    # df = 5: P(chi2 > 20.52) = 0.001.
    assert _chi_square(counts, np.asarray(q_root)) < 20.52, counts


def test_target_probs_temperature_top_k_top_p():
    rng = np.random.default_rng(0)
    b, n, v = 3, 2, 8
    logits = rng.standard_normal((b * n, v)).astype(np.float32)
    temps = np.array([0.7, 1.0, 2.0], np.float32)
    top_ks = np.array([3, 0, 8], np.int32)  # 0 and V: no-op
    top_ps = np.array([1.0, 0.6, 0.9], np.float32)
    got = np.asarray(
        target_probs_from_logits(
            jnp.asarray(logits), jnp.asarray(temps), jnp.asarray(top_ks), jnp.asarray(top_ps)
        )
    )
    x = logits.reshape(b, n, v) / temps[:, None, None]
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = p.copy()
    for i in range(b):
        for j in range(n):
            row = want[i, j]
            if 0 < top_ks[i] < v:
                row = np.where(row >= np.sort(row)[::-1][top_ks[i] - 1], row, 0)
                row = row / row.sum()
            if top_ps[i] < 1:
                desc = np.sort(row)[::-1]
                cut = int(np.argmax(np.cumsum(desc) >= top_ps[i]))
                row = np.where(row >= desc[cut], row, 0)
                row = row / row.sum()
            want[i, j] = row
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert (got[0] > 0).sum(-1).tolist() == [3, 3]
    plain = target_probs_from_logits(jnp.asarray(logits), jnp.asarray(temps))
    np.testing.assert_allclose(plain, p, rtol=1e-5, atol=1e-7)


def test_probes():
    probs = np.full((2, 6, 20), 0.05, np.float32)

    def f(p):
        return _sample(
            G_CANDIDATES,
            G_RIDX,
            G_NEXT_TOKEN,
            G_NEXT_SIBLING,
            np.full((2, 6), 0.5),
            np.full(2, 0.5),
            p,
            4,
        )[2]

    probes.checked(f)(jnp.asarray(probs))
    probs[1, 2, 3] = np.nan
    with pytest.raises(probes.ProbeError, match="target_probs: 1 NaN"):
        probes.checked(f)(jnp.asarray(probs))
    assert "check" not in str(jax.make_jaxpr(f)(jnp.asarray(probs)))


def _root_children(tokens, n):
    """Trees of a root (node 0) whose children 1..K carry ``tokens[b]`` (i32[B, K]), padded to
    ``n`` nodes: ``(candidates, retrive_index, next_token, next_sibling)``."""
    num, k = tokens.shape
    cand = np.zeros((num, n), np.int32)
    cand[:, 1 : k + 1] = tokens
    nt = np.full((num, n), -1, np.int32)
    ns = np.full((num, n), -1, np.int32)
    if k:
        nt[:, 0] = 1
        ns[:, 1:k] = np.arange(2, k + 1)
    return _i32(cand), _i32(np.arange(num * n).reshape(num, n)), _i32(nt), _i32(ns)


def test_exact_bonus_coin_near_one_is_a_token_with_mass():
    """A childless root: the bonus is the root row's inverse CDF. Its top coins can round past
    ``cumsum[-1]``; the bonus is then the last token with mass, never a token of probability
    0 (token ``V - 1`` here)."""
    rng = np.random.default_rng(21)
    num, n, v = 300, 2, 200
    probs = np.zeros((num, n, v), np.float32)
    probs[:, 0] = rng.dirichlet(np.full(v, 0.3), num)
    probs[:, 0][rng.random((num, v)) < 0.3] = 0.0
    probs[:, 0, -1] = 0.0
    probs[:, 1] = 1.0 / v
    for k in (1, 2, 3):
        predicts, accept, _ = tree_sampling_verify(
            *_root_children(np.zeros((num, 0), np.int32), n),
            jnp.zeros((num, n), jnp.float32),
            jnp.full((num,), 1 - k * 2**-24, jnp.float32),
            jnp.asarray(probs),
            num_spec_steps=2,
        )
        bonus = np.asarray(predicts).reshape(num, n)[:, 0]
        assert (np.asarray(accept)[:, 1] == -1).all()
        assert (probs[np.arange(num), 0, bonus] > 0).all(), bonus


def _inverse_cdf_np(q, coin):
    """The half-open inverse CDF of one row (float64): the first token whose CDF passes
    ``coin * sum(q)``."""
    q = np.asarray(q, np.float64)
    return int(np.argmax((np.cumsum(q) > coin * q.sum()) & (q > 0)))


def test_exact_every_child_rejected_by_rounding_bonus_from_the_row():
    """The children's tokens hold the root row's whole support but its f32 mass is
    ``1 - 2**-24``: the coin ``1 - 2**-24`` rejects them all and the residual is empty; the
    bonus is then drawn from the whole row (never the empty residual's ``V - 1``)."""
    rng = np.random.default_rng(22)
    num, n, v = 64, 5, 6
    row = np.array([0.5, 0.25, 0.25 - 2**-24], np.float32)
    probs = np.full((num, n, v), 1.0 / v, np.float32)
    probs[:, 0] = 0.0
    tokens = np.zeros((num, 3), np.int32)
    for b in range(num):
        support = rng.choice(v - 1, 3, replace=False)  # token V - 1 has no mass
        probs[b, 0, support] = row
        tokens[b] = rng.permutation(support)
    final = rng.random(num, dtype=np.float32)
    want = [_inverse_cdf_np(probs[b, 0], final[b]) for b in range(num)]
    cand, ridx, nt, ns = _root_children(tokens, n)
    predicts, accept, num_acc = tree_sampling_verify(
        cand,
        ridx,
        nt,
        ns,
        jnp.full((num, n), 1 - 2**-24, jnp.float32),
        jnp.asarray(final),
        jnp.asarray(probs),
        num_spec_steps=2,
    )
    assert np.asarray(num_acc).tolist() == [0] * num
    np.testing.assert_array_equal(np.asarray(predicts).reshape(num, n)[:, 0], want)


def test_exact_static_errors():
    z = jnp.zeros((2, 4), jnp.int32)
    coins, final, probs = jnp.zeros((2, 4)), jnp.zeros(2), jnp.full((2, 4, 5), 0.2)
    for verify in (tree_sampling_verify, tree_speculative_sampling_target_only):
        with pytest.raises(ValueError, match=r"num_spec_steps=0 must be an int >= 1 \(S\+1\)"):
            verify(z, z, z, z, coins, final, probs, num_spec_steps=0)


def test_exact_one_spec_step_is_plain_sampling():
    """``num_spec_steps`` 1 (max depth 0): no child is ever accepted, not even one of
    probability 1, and the token emitted is the root row's plain inverse-CDF draw."""
    rng = np.random.default_rng(23)
    bs, topk, steps, n, v = 8, 4, 3, 12, 6
    cand, ridx, nt, ns, _ = _random_tree(rng, bs, topk, steps, n, vocab=v)
    probs = rng.dirichlet(np.full(v, 0.7), (bs, n)).astype(np.float32)
    first_child_token = np.asarray(cand)[np.arange(bs), np.asarray(nt)[:, 0]]
    probs[:2, 0] = np.eye(v)[first_child_token[:2]]  # a child of probability 1
    coins = rng.random((bs, n), dtype=np.float32)
    final = rng.random(bs, dtype=np.float32)
    predicts, accept, num = tree_sampling_verify(
        _i32(cand),
        _i32(ridx),
        _i32(nt),
        _i32(ns),
        jnp.asarray(coins),
        jnp.asarray(final),
        jnp.asarray(probs),
        num_spec_steps=1,
        predicts_init=-1,
    )
    ridx = np.asarray(ridx)
    assert np.asarray(num).tolist() == [0] * bs
    np.testing.assert_array_equal(accept, ridx[:, :1])
    want = np.full(bs * n, -1)
    want[ridx[:, 0]] = [_inverse_cdf_np(probs[b, 0], final[b]) for b in range(bs)]
    np.testing.assert_array_equal(predicts, want)


@pytest.mark.parametrize("num_spec_steps", [2, 3])
def test_exact_walk_stops_at_max_depth(num_spec_steps):
    """Trees deeper than ``num_spec_steps - 1``, distinct tokens, every row one-hot on the
    token of the child that leads deepest: the walk accepts that path down to depth
    ``num_spec_steps - 1`` and no deeper, and emits the path's next token as the bonus."""
    rng = np.random.default_rng(24 + num_spec_steps)
    bs, topk, steps, n, v = 6, 2, 4, 10, 12
    _, ridx, nt, ns, _ = _random_tree(rng, bs, topk, steps, n, vocab=v)
    ridx, nt, ns = np.asarray(ridx), np.asarray(nt), np.asarray(ns)
    cand = np.stack([rng.permutation(v)[:n] for _ in range(bs)])
    probs = np.full((bs, n, v), 1.0 / v, np.float32)
    paths = []
    for b in range(bs):

        def children(j, b=b):
            c = nt[b, j]
            while c >= 0:
                yield c
                c = ns[b, c]

        def deepest(j):  # the longest path of nodes below j
            return max(([c, *deepest(c)] for c in children(j)), key=len, default=[])

        path = deepest(0)
        assert len(path) >= num_spec_steps  # deeper than the cap
        for parent, child in zip([0, *path], path):
            probs[b, parent] = np.eye(v)[cand[b, child]]
        paths.append(path)
    predicts, accept, num = tree_sampling_verify(
        _i32(cand),
        _i32(ridx),
        _i32(nt),
        _i32(ns),
        jnp.asarray(rng.random((bs, n), dtype=np.float32)),
        jnp.asarray(rng.random(bs, dtype=np.float32)),
        jnp.asarray(probs),
        num_spec_steps=num_spec_steps,
    )
    assert np.asarray(num).tolist() == [num_spec_steps - 1] * bs
    predicts = np.asarray(predicts)
    for b, path in enumerate(paths):
        kept = path[: num_spec_steps - 1]
        assert np.asarray(accept)[b].tolist() == [ridx[b, j] for j in [0, *kept]]
        emitted = [int(predicts[ridx[b, j]]) for j in [0, *kept]]
        assert emitted == [int(cand[b, j]) for j in path[:num_spec_steps]]


@pytest.mark.parametrize(
    "lossy,q_children,coin,accepted",
    [
        pytest.param(LossyThresholds(threshold_single=0.5), [0.5], 0.9, 1, id="single_reached"),
        pytest.param(LossyThresholds(threshold_single=0.5), [0.25, 0.5], 0.9, 2, id="single_2nd"),
        pytest.param(LossyThresholds(threshold_single=0.5), [0.375], 0.9, 0, id="single_below"),
        pytest.param(LossyThresholds(threshold_single=0.0), [0.0], 0.5, 0, id="single0_q0"),
        pytest.param(LossyThresholds(threshold_single=0.0), [0.0, 0.125], 0.5, 2, id="single0"),
        pytest.param(LossyThresholds(threshold_acc=0.5), [0.25], 0.4375, 1, id="acc_scaled"),
        pytest.param(LossyThresholds(threshold_acc=0.5), [0.25], 0.5, 0, id="acc_half_open"),
        pytest.param(LossyThresholds(threshold_acc=0.0), [0.0, 0.25], 0.99, 2, id="acc0_q0"),
        pytest.param(LossyThresholds(1.0, 1.0), [0.25, 0.5], 0.5, 2, id="exact_thresholds"),
    ],
)
def test_exact_walk_lossy_thresholds(lossy, q_children, coin, accepted):
    """The exact walk under explicit lossy thresholds, one root and its children (distinct
    tokens, dyadic probabilities): accept the first child with ``q > 0`` and ``q >=
    threshold_single`` or ``coin < prob_acc / threshold_acc`` (0: none accepted)."""
    rng = np.random.default_rng(len(q_children) + int(coin * 16))
    v, k = 6, len(q_children)
    n = k + 1
    tokens = rng.choice(v, k, replace=False)
    root = np.zeros(v, np.float32)
    root[tokens] = q_children
    rest = [t for t in range(v) if t not in tokens]
    root[rest] = (1.0 - sum(q_children)) / len(rest)
    probs = np.broadcast_to(np.stack([root] + [np.full(v, 1 / v, np.float32)] * k), (1, n, v))
    cand, ridx, nt, ns = _root_children(tokens[None], n)
    coins = np.full((1, n), 0.0, np.float32)
    coins[0, 0] = coin
    _, accept, num = tree_sampling_verify(
        cand,
        ridx,
        nt,
        ns,
        jnp.asarray(coins),
        jnp.asarray([0.5], jnp.float32),
        jnp.asarray(probs),
        num_spec_steps=2,
        lossy=lossy,
    )
    assert int(num[0]) == (accepted > 0)
    assert np.asarray(accept)[0].tolist() == [0, accepted if accepted else -1]
