"""select_top_k_tokens / organize_draft_results: upstream EAGLE trace, numpy ports, ties, probes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tree_oracles import _np_topk_indices, draft_tree_from_probs

from jspec import probes
from jspec.tree.build import TreeMaskMode, build_tree_kernel_efficient
from jspec.tree.select import organize_draft_results, select_top_k_tokens, ss_width
from tree_geometry import geom

# The raw draft trace of sglang's test_build_eagle_tree.py (B=2, K=4, S=4, N=8).
SCORE_LIST = [
    [
        [[7.1127e-01, 2.8292e-01, 2.2995e-03, 1.7357e-03]],
        [[9.7476e-01, 2.2219e-02, 6.5031e-04, 1.3212e-04]],
    ],
    [
        [
            [6.9142e-01, 1.2863e-02, 1.6873e-03, 1.1871e-03],
            [2.4787e-01, 1.8818e-02, 1.4204e-02, 9.2235e-04],
            [2.2971e-03, 1.6700e-06, 1.8737e-07, 8.3146e-08],
            [1.2771e-03, 2.4374e-04, 1.7832e-04, 1.1947e-05],
        ],
        [
            [8.4832e-02, 6.6068e-02, 5.8304e-02, 5.7851e-02],
            [2.3616e-03, 1.1243e-03, 5.4368e-04, 2.7768e-04],
            [2.5286e-04, 1.5578e-04, 2.8817e-05, 1.2888e-05],
            [1.2834e-04, 2.5417e-06, 1.1279e-06, 1.6088e-08],
        ],
    ],
    [
        [
            [6.6438e-01, 2.6997e-02, 2.4236e-05, 4.0821e-06],
            [2.4402e-01, 2.8409e-03, 5.0935e-04, 2.9022e-04],
            [1.6178e-02, 2.0567e-03, 4.5892e-04, 3.0034e-05],
            [1.3023e-02, 5.0497e-04, 3.6371e-04, 8.7750e-05],
        ],
        [
            [2.3263e-02, 2.0054e-02, 9.3990e-03, 2.7783e-03],
            [6.4156e-02, 5.5506e-04, 1.0429e-04, 9.7211e-05],
            [4.9950e-02, 5.0630e-03, 9.0068e-04, 3.3656e-04],
            [7.5817e-03, 8.5731e-04, 6.9972e-04, 6.0793e-04],
        ],
    ],
    [
        [
            [6.6420e-01, 1.0525e-04, 6.5864e-05, 1.2253e-06],
            [1.3019e-01, 1.0461e-01, 5.2083e-03, 1.6777e-03],
            [2.0103e-02, 6.7335e-03, 1.2625e-04, 1.0364e-05],
            [1.5142e-02, 7.0819e-04, 9.6595e-05, 8.7951e-05],
        ],
        [
            [5.8608e-02, 1.8840e-03, 7.8535e-04, 4.4400e-04],
            [1.2185e-02, 2.0684e-03, 1.7418e-03, 1.4327e-03],
            [6.2455e-03, 6.1487e-03, 2.6862e-03, 1.8034e-03],
            [1.8590e-03, 1.6151e-03, 1.2481e-03, 3.6038e-04],
        ],
    ],
]
TOKEN_LIST = [
    [[29896, 29906, 29900, 29945], [13, 2, 29871, 28956]],
    [
        [
            29889,
            29974,
            29945,
            29900,
            29974,
            29922,
            29930,
            29958,
            29889,
            29974,
            29930,
            29945,
            29974,
            29922,
            29930,
            29958,
        ],
        [22550, 4136, 16492, 8439, 29871, 2, 3001, 13, 2, 13, 29906, 29946, 2, 13, 29871, 259],
    ],
    [
        [
            29946,
            29945,
            29953,
            29906,
            29896,
            29945,
            29900,
            29906,
            29896,
            29945,
            29906,
            29953,
            29896,
            29945,
            29906,
            29946,
        ],
        [
            29871,
            2,
            29901,
            29889,
            29871,
            2,
            395,
            259,
            29901,
            29871,
            2,
            29889,
            3001,
            1234,
            7146,
            2186,
        ],
    ],
    [
        [
            29946,
            29974,
            29945,
            29930,
            29889,
            29922,
            29974,
            29930,
            29974,
            29946,
            29930,
            29922,
            29889,
            29974,
            29945,
            29922,
        ],
        [
            29941,
            29906,
            2,
            29946,
            29871,
            450,
            319,
            14990,
            29946,
            29941,
            2,
            29906,
            29871,
            2,
            3001,
            13,
        ],
    ],
]
PARENTS_LIST = [
    [[-1, 0, 1, 2, 3], [-1, 0, 1, 2, 3]],
    [[4, 8, 9, 10], [4, 5, 6, 7]],
    [[20, 24, 21, 28], [24, 28, 20, 21]],
    [[36, 40, 41, 44], [36, 40, 44, 45]],
]


def _as(x, dtype):
    return jnp.asarray(np.asarray(x), dtype)


def test_organize_upstream_trace_then_build():
    scores = [_as(s, jnp.float32) for s in SCORE_LIST]
    tokens = [_as(t, jnp.int32) for t in TOKEN_LIST]
    parents = [_as(p, jnp.int32) for p in PARENTS_LIST]
    parent_list, sel, drafts = organize_draft_results(scores, tokens, parents, num_draft_tokens=8)
    assert parent_list.tolist() == [
        [-1, 0, 1, 2, 3, 4, 8, 9, 10, 20, 24, 21, 28],
        [-1, 0, 1, 2, 3, 4, 5, 6, 7, 24, 28, 20, 21],
    ]
    assert sel.tolist() == [[0, 1, 4, 8, 20, 24, 36], [0, 4, 5, 6, 7, 24, 36]]
    assert drafts.tolist() == [
        [29896, 29906, 29889, 29974, 29946, 29896, 29946],
        [13, 22550, 4136, 16492, 8439, 29871, 29941],
    ]
    out = build_tree_kernel_efficient(
        _as([29974, 13], jnp.int32),
        parent_list,
        sel,
        drafts,
        _as([5, 10], jnp.int32),
        geometry=geom(topk=4, num_steps=4, num_draft_tokens=8),
        mode=TreeMaskMode.QLEN_ONLY,
    )
    assert out.positions.tolist() == [5, 6, 6, 7, 7, 8, 8, 9, 10, 11, 12, 12, 12, 12, 13, 14]
    assert out.draft_tokens.tolist()[:3] == [29974, 29896, 29906]


def _np_select(step, topk_p, topk_index, hidden, scores, k):
    """numpy port of SPEC §7.2."""
    if step == 0:
        b = topk_p.shape[0]
        return (
            topk_index.reshape(-1),
            np.repeat(hidden, k, axis=0),
            topk_p,
            (topk_p[:, None, :], topk_index, np.tile(np.arange(-1, k), (b, 1))),
        )
    b = topk_p.shape[0] // k
    expand = scores[:, :, None] * topk_p.reshape(b, k, k)
    cs_idx = _np_topk_indices(expand.reshape(b, -1), k)
    cs_p = np.take_along_axis(expand.reshape(b, -1), cs_idx, axis=1)
    tokens = topk_index.reshape(b, k * k)
    input_ids = np.take_along_axis(tokens, cs_idx, axis=1).reshape(-1)
    rows = (cs_idx // k + np.arange(b)[:, None] * k).reshape(-1)
    return input_ids, hidden[rows], cs_p, (expand, tokens, cs_idx + k * k * (step - 1) + k)


@pytest.mark.parametrize("k,b", [(1, 2), (3, 2), (4, 3)])
def test_select_top_k_tokens_matches_numpy(k, b):
    rng = np.random.default_rng(k)
    hidden = rng.standard_normal((b, 5)).astype(np.float32)
    topk_p = rng.random((b, k), dtype=np.float32)
    topk_index = rng.integers(0, 1000, (b, k)).astype(np.int32)
    scores = None
    for step in range(3):
        got = select_top_k_tokens(
            step,
            _as(topk_p, jnp.float32),
            _as(topk_index, jnp.int32),
            _as(hidden, jnp.float32),
            scores,
            topk=k,
            vocab_size=1000,
        )
        want = _np_select(
            step, topk_p, topk_index, hidden, None if scores is None else np.asarray(scores), k
        )
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6)
        _, hidden_next, scores, _ = got
        topk_p = rng.random((b * k, k), dtype=np.float32)
        topk_index = rng.integers(0, 1000, (b * k, k)).astype(np.int32)
        hidden = np.asarray(hidden_next) + rng.standard_normal(hidden_next.shape).astype(np.float32)


@pytest.mark.parametrize("k,s,n,b", [(2, 3, 8, 2), (4, 4, 16, 2), (8, 5, 32, 2), (1, 4, 5, 1)])
def test_draft_loop_matches_numpy_oracle(k, s, n, b):
    """select_top_k_tokens x S + organize == the numpy draft loop (test oracle)."""
    rng = np.random.default_rng(n)
    scores0 = rng.random((b, k), dtype=np.float32) * 0.98 + 0.01
    step_ps = [rng.random((b, k, k), dtype=np.float32) * 0.98 + 0.01 for _ in range(1, s)]
    vocab = 50
    tok = [rng.integers(0, vocab, (b, k))] + [
        rng.integers(0, vocab, (b * k, k)) for _ in range(1, s)
    ]
    hidden = jnp.zeros((b, 3), jnp.float32)
    scores, score_list, token_list, parents_list = None, [], [], []
    for i in range(s):
        topk_p = scores0 if i == 0 else step_ps[i - 1].reshape(b * k, k)
        _, hidden, scores, (sc, tk, par) = select_top_k_tokens(
            i, _as(topk_p, jnp.float32), _as(tok[i], jnp.int32), hidden, scores, topk=k
        )
        score_list.append(sc)
        token_list.append(tk)
        parents_list.append(par)
    parent_list, sel, drafts = organize_draft_results(
        score_list, token_list, parents_list, num_draft_tokens=n
    )
    want_parent_list, want_sel, _ = draft_tree_from_probs(scores0, step_ps, k, n)
    np.testing.assert_array_equal(parent_list, want_parent_list)
    np.testing.assert_array_equal(sel, want_sel)
    assert parent_list.shape == (b, k * (s - 1) + 1 if s > 1 else 0)
    ss_tokens = np.concatenate([np.asarray(t) for t in token_list], axis=1)
    np.testing.assert_array_equal(drafts, np.take_along_axis(ss_tokens, want_sel, axis=1))
    out = build_tree_kernel_efficient(
        jnp.zeros(b, jnp.int32),
        parent_list,
        sel,
        drafts,
        jnp.full((b,), 3, jnp.int32),
        geometry=geom(topk=k, num_steps=s, num_draft_tokens=n),
        mode=TreeMaskMode.QLEN_ONLY,
    )
    assert out.is_valid.all()


def test_ties_pick_lower_index():
    k, b = 3, 1
    # step >= 1: all K*K expanded scores equal -> branches 0, 1, 2 of row 0 (flat 0, 1, 2).
    out = select_top_k_tokens(
        1,
        jnp.full((k, k), 0.5),
        jnp.arange(k * k).reshape(k, k),
        jnp.zeros((k, 2)),
        jnp.ones((b, k)),
        topk=k,
    )
    assert out[3][2].tolist() == [[k, k + 1, k + 2]]
    assert out[0].tolist() == [0, 1, 2]
    # organize: equal scores -> the N-1 lowest flat indices.
    scores = [jnp.ones((1, 1, k)), jnp.ones((1, k, k))]
    tokens = [jnp.zeros((1, k), jnp.int32), jnp.zeros((1, k * k), jnp.int32)]
    parents = [jnp.zeros((1, k + 1), jnp.int32), jnp.zeros((1, k), jnp.int32)]
    _, sel, _ = organize_draft_results(scores, tokens, parents, num_draft_tokens=6)
    assert sel.tolist() == [[0, 1, 2, 3, 4]]


def test_single_step_parent_list_is_empty():
    scores = [jnp.ones((2, 1, 4))]
    tokens = [jnp.zeros((2, 4), jnp.int32)]
    parents = [jnp.zeros((2, 5), jnp.int32)]
    parent_list, sel, _ = organize_draft_results(scores, tokens, parents, num_draft_tokens=3)
    assert parent_list.shape == (2, 0) and sel.shape == (2, 2)


def test_probes_name_nan_and_vocab():
    def step0(p, idx):
        return select_top_k_tokens(0, p, idx, jnp.zeros((1, 2)), None, topk=2, vocab_size=10)[0]

    good_p, good_idx = jnp.array([[0.5, 0.25]]), jnp.array([[1, 9]], jnp.int32)
    assert probes.checked(step0)(good_p, good_idx).tolist() == [1, 9]
    with pytest.raises(probes.ProbeError, match=r"step=0\): draft topk_p: 1 NaN"):
        probes.checked(step0)(jnp.array([[0.5, jnp.nan]]), good_idx)
    with pytest.raises(probes.ProbeError, match="topk_index vs vocab: max value 10 >= high"):
        probes.checked(step0)(good_p, jnp.array([[1, 10]], jnp.int32))
    assert "check" not in str(jax.make_jaxpr(step0)(good_p, good_idx))


def test_static_errors():
    with pytest.raises(ValueError, match="num_draft_tokens=6: num_draft_tokens - 1 must be"):
        organize_draft_results(
            [jnp.ones((1, 1, 4))],
            [jnp.zeros((1, 4), jnp.int32)],
            [jnp.zeros((1, 5), jnp.int32)],
            num_draft_tokens=6,
        )
    with pytest.raises(ValueError, match="scores must be given at step=1"):
        select_top_k_tokens(
            1, jnp.ones((4, 2)), jnp.ones((4, 2), jnp.int32), jnp.ones((4, 3)), None, topk=2
        )
    with pytest.raises(ValueError, match=r"topk_p.shape=\(3, 2\) must be \(B\*topk"):
        select_top_k_tokens(
            1,
            jnp.ones((3, 2)),
            jnp.ones((3, 2), jnp.int32),
            jnp.ones((3, 3)),
            jnp.ones((1, 2)),
            topk=2,
        )
    assert ss_width(8, 5) == 8 + 4 * 64
