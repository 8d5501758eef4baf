"""build_tree_kernel_efficient: SPEC §13.1 goldens, python-loop oracle, invariants (the Pallas
kernel vs its reference: ``test_build_tree_kernel.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tree_oracles import (
    gen_draft_tree,
    ref_build_tree,
    ref_flat_full_mask,
    topk1_chain_inputs,
)

from jspec import probes
from jspec.tree.build import (
    TreeMaskMode,
    bitpack_dtype,
    build_tree_kernel_efficient,
    flatten_full_mask,
)
from tree_geometry import geom, with_geometry

QLEN, FULL, BITS = TreeMaskMode.QLEN_ONLY, TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY_BITPACKING
IMPLS = ["xla", "pallas"]

# ---- SPEC §13.1 golden (B=2, K=4, S=4, N=8) ---------------------------------------------------
G_PARENT_LIST = [
    [-1, 0, 1, 2, 3] + [4, 8, 9, 10] + [20, 24, 21, 28],
    [-1, 0, 1, 2, 3] + [4, 5, 6, 7] + [24, 28, 20, 21],
]
G_SEL = [[0, 1, 4, 8, 20, 24, 36], [0, 4, 5, 6, 7, 24, 36]]
G_DRAFTS = [
    [29896, 29906, 29889, 29974, 29946, 29896, 29946],
    [13, 22550, 4136, 16492, 8439, 29871, 29941],
]
G_BONUS = [29974, 13]
G_SEQ_LENS = [5, 10]
G_POSITIONS = [5, 6, 6, 7, 7, 8, 8, 9, 10, 11, 12, 12, 12, 12, 13, 14]
G_NEXT_TOKEN = [[1, 3, 4, 5, 6, 7, -1, -1], [1, 2, -1, 6, -1, -1, 7, -1]]
G_NEXT_SIBLING = [[-1, 2, -1, -1, -1, -1, -1, -1], [-1, -1, 3, 4, 5, -1, -1, -1]]
G_TOKENS = [
    29974,
    29896,
    29906,
    29889,
    29974,
    29946,
    29896,
    29946,
    13,
    13,
    22550,
    4136,
    16492,
    8439,
    29871,
    29941,
]


def _i32(x):
    return jnp.asarray(x, jnp.int32)  # traced or host values


def _run(
    parent_list,
    sel,
    seq_lens,
    *,
    topk,
    num_steps,
    mode=QLEN,
    impl="xla",
    drafts=None,
    bonus=None,
    max_seq_len=None,
    **kw,
):
    sel = np.asarray(sel)
    b, nsel = sel.shape
    drafts = np.zeros_like(sel) if drafts is None else drafts
    bonus = np.zeros(b, np.int32) if bonus is None else bonus
    if mode == FULL and max_seq_len is None:
        max_seq_len = int(np.max(seq_lens, initial=0)) + 3
    return build_tree_kernel_efficient(
        _i32(bonus),
        _i32(parent_list),
        _i32(sel),
        _i32(drafts),
        _i32(seq_lens),
        geometry=geom(topk=topk, num_steps=num_steps, num_draft_tokens=nsel + 1),
        mode=mode,
        max_seq_len=max_seq_len,
        impl=impl,
        **with_geometry(kw),
    )


def _unpack(words, n):
    words = np.asarray(words).astype(np.uint64)
    return ((words[..., None] >> np.arange(n, dtype=np.uint64)) & 1).astype(bool)


def _assert_matches_oracle(out, parent_list, sel, seq_lens, topk, mode):
    n = np.asarray(sel).shape[1] + 1
    ridx, nt, ns, pos, mask, valid = ref_build_tree(parent_list, sel, seq_lens, topk, n)
    np.testing.assert_array_equal(out.retrive_index, ridx)
    np.testing.assert_array_equal(out.retrive_next_token, nt)
    np.testing.assert_array_equal(out.retrive_next_sibling, ns)
    np.testing.assert_array_equal(out.positions, pos)
    np.testing.assert_array_equal(out.is_valid, valid)
    if mode == QLEN:
        np.testing.assert_array_equal(out.tree_mask, mask)
    elif mode == BITS:
        assert out.tree_mask.dtype == bitpack_dtype(n)
        np.testing.assert_array_equal(_unpack(out.tree_mask, n), mask)
    else:
        np.testing.assert_array_equal(
            flatten_full_mask(out.tree_mask, seq_lens), ref_flat_full_mask(mask, seq_lens)
        )
    return mask


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", list(TreeMaskMode), ids=lambda m: m.name)
def test_golden_eagle_trace(impl, mode):
    out = _run(
        G_PARENT_LIST,
        G_SEL,
        G_SEQ_LENS,
        topk=4,
        num_steps=4,
        mode=mode,
        impl=impl,
        drafts=G_DRAFTS,
        bonus=G_BONUS,
        max_seq_len=16,
    )
    assert out.positions.tolist() == G_POSITIONS
    assert out.retrive_index.tolist() == [list(range(8)), list(range(8, 16))]
    assert out.retrive_next_token.tolist() == G_NEXT_TOKEN
    assert out.retrive_next_sibling.tolist() == G_NEXT_SIBLING
    assert out.draft_tokens.tolist() == G_TOKENS
    assert out.is_valid.tolist() == [True, True]
    mask = _assert_matches_oracle(out, G_PARENT_LIST, G_SEL, G_SEQ_LENS, 4, mode)
    # Request 0: two interleaved chains (1-3-5-7 and 2-4-6); request 1: star-ish under node 1.
    assert [int(r.sum()) for r in mask[0]] == [1, 2, 2, 3, 3, 4, 4, 5]
    assert mask[1, 7].nonzero()[0].tolist() == [0, 1, 3, 6, 7]
    if mode == FULL:
        assert out.tree_mask.shape == (2, 8, 16 + 8)
        tm = np.asarray(out.tree_mask)
        assert tm[0, :, :5].all() and tm[1, :, :10].all()  # prefix columns: the fill
        assert not tm[0, :, 5 + 8 :].any() and not tm[1, :, 10 + 8 :].any()  # padding: False


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_topk2(impl):
    out = _run([[-1, 0, 1]], [[0, 1, 2]], [5], topk=2, num_steps=2, impl=impl)
    assert out.retrive_index.tolist() == [[0, 1, 2, 3]]
    assert out.retrive_next_token.tolist() == [[1, 3, -1, -1]]
    assert out.retrive_next_sibling.tolist() == [[-1, 2, -1, -1]]
    assert out.positions.tolist() == [5, 6, 6, 7]
    assert np.asarray(out.tree_mask[0]).astype(int).tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 1, 0, 1],
    ]
    bits = _run([[-1, 0, 1]], [[0, 1, 2]], [5], topk=2, num_steps=2, mode=BITS, impl=impl)
    assert bits.tree_mask.tolist() == [[0b1, 0b11, 0b101, 0b1011]]


@pytest.mark.parametrize("mode", [QLEN, FULL])
def test_chain_topk1(mode):
    parent_list, sel = topk1_chain_inputs(2, 3)
    seq_lens = [7, 12]
    out = _run(parent_list, sel, seq_lens, topk=1, num_steps=3, mode=mode)
    mask = _assert_matches_oracle(out, parent_list, sel, seq_lens, 1, mode)
    for b in range(2):
        np.testing.assert_array_equal(mask[b], np.tril(np.ones((4, 4), bool)))
        assert out.positions[4 * b : 4 * b + 4].tolist() == [seq_lens[b] + i for i in range(4)]


@pytest.mark.parametrize("width", [0, 1])
@pytest.mark.parametrize("impl", IMPLS)
def test_mtp_step1(width, impl):
    """S == 1: parent_list (B, 0) from organize, or (B, 1) = [-1] (K*(S-1)+1)."""
    parent_list = np.full((2, width), -1, np.int32)
    out = _run(parent_list, [[0], [0]], [7, 12], topk=1, num_steps=1, impl=impl)
    assert out.retrive_next_token.tolist() == [[1, -1], [1, -1]]
    assert out.positions.tolist() == [7, 8, 12, 13]
    np.testing.assert_array_equal(out.tree_mask, np.tril(np.ones((2, 2, 2), bool)))


def test_skip_prefix_fill_preserves_tree_blocks():
    parent_list, sel = topk1_chain_inputs(2, 3)
    seq_lens = np.array([5, 10])
    filled = _run(parent_list, sel, seq_lens, topk=1, num_steps=3, mode=FULL, max_seq_len=12)
    skipped = _run(
        parent_list,
        sel,
        seq_lens,
        topk=1,
        num_steps=3,
        mode=FULL,
        max_seq_len=12,
        fill_prefix_mask=False,
    )
    for b, length in enumerate(seq_lens):
        f, s = np.asarray(filled.tree_mask[b]), np.asarray(skipped.tree_mask[b])
        np.testing.assert_array_equal(f[:, length:], s[:, length:])  # every tree cell
        assert f[:, :length].all() and not s[:, :length].any()
    for name in ("positions", "retrive_index", "retrive_next_token", "retrive_next_sibling"):
        np.testing.assert_array_equal(getattr(filled, name), getattr(skipped, name), err_msg=name)


RANDOM_CASES = [  # (topk, num_steps, num_draft_tokens, bs)
    (1, 1, 2, 2),
    (1, 5, 6, 2),
    (2, 3, 8, 2),
    (2, 6, 23, 2),
    (4, 3, 16, 2),
    (4, 6, 64, 1),
    (8, 2, 32, 2),
    (8, 5, 64, 2),
]
# Mask layouts other than QLEN are checked on these cases only (compile time on CPU).
ALL_MODE_CASES = {(2, 3, 8, 2), (8, 2, 32, 2), (4, 6, 64, 1)}


def _invariants(out, seq_lens, num_steps, n):
    mask = np.asarray(out.tree_mask)
    depths = np.asarray(out.positions).reshape(-1, n) - np.asarray(seq_lens)[:, None]
    for b in range(mask.shape[0]):
        assert mask[b].diagonal().all()
        assert not np.triu(mask[b], 1).any()
        assert depths[b, 0] == 0 and (depths[b, 1:] >= 1).all() and (depths[b] <= num_steps).all()
        np.testing.assert_array_equal(depths[b], mask[b].sum(1) - 1)


@pytest.mark.parametrize("topk,num_steps,n,bs", RANDOM_CASES)
def test_random_trees_match_python_loop(topk, num_steps, n, bs):
    rng = np.random.default_rng(1234 + n)
    parent_list, sel = gen_draft_tree(rng, bs, topk, num_steps, n)
    seq_lens = rng.integers(1, 64, bs)
    out = _run(parent_list, sel, seq_lens, topk=topk, num_steps=num_steps, mode=QLEN)
    _assert_matches_oracle(out, parent_list, sel, seq_lens, topk, QLEN)
    assert out.is_valid.all()
    _invariants(out, seq_lens, num_steps, n)
    if (topk, num_steps, n, bs) not in ALL_MODE_CASES:
        return
    full = _run(parent_list, sel, seq_lens, topk=topk, num_steps=num_steps, mode=FULL)
    _assert_matches_oracle(full, parent_list, sel, seq_lens, topk, FULL)
    if n <= 32:
        bits = _run(parent_list, sel, seq_lens, topk=topk, num_steps=num_steps, mode=BITS)
        _assert_matches_oracle(bits, parent_list, sel, seq_lens, topk, BITS)


@st.composite
def tree_shapes(draw):
    """Tree shapes: random (K, S, N) configurations x random probabilities and lengths.

    The (K, S, N, B) buckets are the RANDOM_CASES ones so that jit compilations are shared.
    """
    topk, num_steps, n, bs = draw(st.sampled_from(RANDOM_CASES))
    return topk, num_steps, n, bs, draw(st.integers(0, 2**31 - 1))


@given(tree_shapes())
def test_hypothesis_tree_shapes(shape):
    topk, num_steps, n, bs, seed = shape
    rng = np.random.default_rng(seed)
    parent_list, sel = gen_draft_tree(rng, bs, topk, num_steps, n)
    seq_lens = rng.integers(0, 40, bs)
    out = _run(parent_list, sel, seq_lens, topk=topk, num_steps=num_steps)
    _assert_matches_oracle(out, parent_list, sel, seq_lens, topk, QLEN)
    _invariants(out, seq_lens, num_steps, n)


# ---- invalid trees -----------------------------------------------------------------------------
def _corrupt(entry, value):
    parent_list = np.array(G_PARENT_LIST)
    parent_list[0, entry] = value
    return parent_list


@pytest.mark.parametrize("impl", IMPLS)
def test_invalid_leaf_is_unlinked(impl):
    # Node 6 of request 0 (sel 24, parent_list[6]) gets a parent token that is not selected.
    parent_list = _corrupt(6, 12)
    out = _run(parent_list, G_SEL, G_SEQ_LENS, topk=4, num_steps=4, impl=impl)
    _assert_matches_oracle(out, parent_list, G_SEL, G_SEQ_LENS, 4, QLEN)
    assert out.is_valid.tolist() == [False, True]
    assert 6 not in np.asarray(out.retrive_next_token[0]).tolist()
    assert 6 not in np.asarray(out.retrive_next_sibling[0]).tolist()
    assert np.asarray(out.tree_mask[0, 6]).nonzero()[0].tolist() == [0, 6]
    assert int(out.positions[6]) == G_SEQ_LENS[0] + 1
    np.testing.assert_array_equal(
        out.tree_mask[1], _run(G_PARENT_LIST, G_SEL, G_SEQ_LENS, topk=4, num_steps=4).tree_mask[1]
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_invalid_inner_node_keeps_descendants(impl):
    parent_list = _corrupt(5, 13)  # node 5 (sel 20) loses its parent; node 7 hangs below it
    out = _run(parent_list, G_SEL, G_SEQ_LENS, topk=4, num_steps=4, impl=impl)
    _assert_matches_oracle(out, parent_list, G_SEL, G_SEQ_LENS, 4, QLEN)
    assert np.asarray(out.tree_mask[0, 7]).nonzero()[0].tolist() == [0, 5, 7]
    assert int(out.retrive_next_token[0, 5]) == 7


def test_invalid_tree_probe_names_request_and_node():
    parent_list = _corrupt(5, 13)

    def f(pl_):
        return _run(pl_, G_SEL, G_SEQ_LENS, topk=4, num_steps=4).is_valid

    with pytest.raises(probes.ProbeError, match="invalid eagle tree: request 0 node 5"):
        probes.checked(f)(parent_list)
    assert probes.checked(f)(np.array(G_PARENT_LIST)).tolist() == [True, True]


def test_probes_off_add_nothing():
    args = [_i32(x) for x in (G_BONUS, G_PARENT_LIST, G_SEL, G_DRAFTS, G_SEQ_LENS)]

    def fn(*a):
        return build_tree_kernel_efficient(
            *a, geometry=geom(topk=4, num_steps=4, num_draft_tokens=8), mode=FULL, max_seq_len=16
        )

    assert "check" not in str(jax.make_jaxpr(fn)(*args))
    with probes.probes_enabled():
        assert "check" in str(jax.make_jaxpr(fn)(*args))


def test_seq_len_probe():
    with pytest.raises(probes.ProbeError, match="seq_lens vs max_seq_len: max value 10 > high"):
        probes.checked(
            lambda s: (
                _run(
                    G_PARENT_LIST, G_SEL, s, topk=4, num_steps=4, mode=FULL, max_seq_len=9
                ).positions
            )
        )(_i32(G_SEQ_LENS))


# ---- static validation -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            {"num_draft_tokens": 8, "num_steps": 1},
            "num_draft_tokens=8: num_draft_tokens - 1 must be",
        ),
        ({"num_draft_tokens": 8, "num_steps": 3}, r"parent_list.shape=\(2, 13\) must be"),
        ({"num_draft_tokens": 8, "num_steps": 4, "mode": FULL}, "max_seq_len=None must be an int"),
        (
            {"num_draft_tokens": 8, "num_steps": 4, "impl": "triton"},
            "impl='triton' is not available",
        ),
    ],
)
def test_static_errors(kwargs, match):
    args = [_i32(x) for x in (G_BONUS, G_PARENT_LIST, G_SEL, G_DRAFTS, G_SEQ_LENS)]
    kwargs = {"topk": 4, "mode": QLEN, **kwargs}
    with pytest.raises(ValueError, match=match):
        build_tree_kernel_efficient(*args, **with_geometry(kwargs))


def test_bitpack_needs_n_le_32():
    with pytest.raises(ValueError, match="num_draft_tokens=33 must be <= 32"):
        bitpack_dtype(33)
    assert [bitpack_dtype(n) for n in (2, 8, 9, 16, 17, 32)] == [
        jnp.uint8,
        jnp.uint8,
        jnp.uint16,
        jnp.uint16,
        jnp.uint32,
        jnp.uint32,
    ]


def test_empty_batch():
    out = _run(np.zeros((0, 13)), np.zeros((0, 7)), np.zeros((0,)), topk=4, num_steps=4)
    assert out.positions.shape == (0,) and out.tree_mask.shape == (0, 8, 8)
