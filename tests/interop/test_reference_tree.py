"""PyTorch tree references (build, select, verify, sampling) vs SPEC.md §13.1-13.3 goldens and
hand-derived cases."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from interop.kv import reference as memory
from interop.kv.reference_allocator import PagedTokenToKVPoolAllocator as _Allocator
from interop.tree import reference as tree

sizing = memory


def PagedTokenToKVPoolAllocator(size, page_size, need_sort=False):
    """The reference allocator in debug mode (sglang's constructor has no defaults)."""
    return _Allocator(size, page_size, torch.float32, "cpu", None, need_sort, debug_mode=True)


I64 = torch.int64


def _t(x, dtype=I64):
    return torch.tensor(x, dtype=dtype)


# ---- §13.1 / §13.2 build_tree ------------------------------------------------------------------
GOLDEN_PARENTS = [
    [-1, 0, 1, 2, 3, 4, 8, 9, 10, 20, 24, 21, 28],
    [-1, 0, 1, 2, 3, 4, 5, 6, 7, 24, 28, 20, 21],
]
GOLDEN_SELECTED = [[0, 1, 4, 8, 20, 24, 36], [0, 4, 5, 6, 7, 24, 36]]
GOLDEN_DRAFT = [
    [29896, 29906, 29889, 29974, 29946, 29896, 29946],
    [13, 22550, 4136, 16492, 8439, 29871, 29941],
]


def _golden_tree(mode=tree.TreeMaskMode.FULL_MASK, fill_prefix_mask=True):
    return tree.build_tree_kernel_efficient(
        _t([29974, 13]),
        _t(GOLDEN_PARENTS),
        _t(GOLDEN_SELECTED),
        _t(GOLDEN_DRAFT),
        _t([5, 10]),
        15,
        4,
        4,
        8,
        tree_mask_mode=mode,
        fill_prefix_mask=fill_prefix_mask,
    )


def test_build_tree_golden():
    mask, positions, ridx, nxt, sib, draft = _golden_tree()
    assert positions.tolist() == [5, 6, 6, 7, 7, 8, 8, 9, 10, 11, 12, 12, 12, 12, 13, 14]
    assert ridx.tolist() == [list(range(8)), list(range(8, 16))]
    assert nxt.tolist() == [[1, 3, 4, 5, 6, 7, -1, -1], [1, 2, -1, 6, -1, -1, 7, -1]]
    assert sib.tolist() == [[-1, 2, -1, -1, -1, -1, -1, -1], [-1, -1, 3, 4, 5, -1, -1, -1]]
    assert draft.tolist() == [
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
    assert positions.dtype == I64 and nxt.dtype == I64
    assert mask.shape == (15 * 8 + 2 * 64,)
    block0 = mask[: 8 * 13].view(8, 13)
    block1 = mask[8 * 13 :].view(8, 18)
    assert bool(block0[:, :5].all()) and bool(block1[:, :10].all())  # prefix columns filled
    # request 0: two interleaved chains; request 1: a star-ish tree
    chain = [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 1, 0, 0],
        [1, 0, 1, 0, 1, 0, 1, 0],
        [1, 1, 0, 1, 0, 1, 0, 1],
    ]
    assert block0[:, 5:].int().tolist() == chain
    star = [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0],
        [1, 1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1, 1],
    ]
    assert block1[:, 10:].int().tolist() == star


def test_build_tree_skip_prefix_fill_and_qlen_modes():
    full = _golden_tree()
    skip = _golden_tree(fill_prefix_mask=False)
    for a, b in zip(full[1:], skip[1:]):
        assert torch.equal(a, b)
    b0_full, b0_skip = full[0][:104].view(8, 13), skip[0][:104].view(8, 13)
    assert torch.equal(b0_full[:, 5:], b0_skip[:, 5:]) and not bool(b0_skip[:, :5].any())
    qlen = _golden_tree(tree.TreeMaskMode.QLEN_ONLY)[0].view(2, 8, 8)
    assert torch.equal(qlen[0], b0_full[:, 5:])
    packed = _golden_tree(tree.TreeMaskMode.QLEN_ONLY_BITPACKING)[0]
    assert packed.dtype == torch.uint8 and packed.shape == (16,)
    words = [sum(int(b) << j for j, b in enumerate(row)) for row in qlen.reshape(16, 8)]
    assert packed.to(I64).tolist() == words


def test_build_tree_hand_topk2_and_chain():
    mask, pos, _, nxt, sib, _ = tree.build_tree_kernel_efficient(
        _t([7]),
        _t([[-1, 0, 1]]),
        _t([[0, 1, 2]]),
        _t([[11, 12, 13]]),
        _t([5]),
        5,
        2,
        2,
        4,
        tree_mask_mode=tree.TreeMaskMode.QLEN_ONLY,
    )
    assert nxt.tolist() == [[1, 3, -1, -1]] and sib.tolist() == [[-1, 2, -1, -1]]
    assert pos.tolist() == [5, 6, 6, 7]
    assert ["".join(str(int(v)) for v in r) for r in mask.view(4, 4)] == [
        "1000",
        "1100",
        "1010",
        "1101",
    ]
    # chain topk=1, S=3, N=4: parent_list = arange(-1, S-1), selected = arange(S)
    mask, pos, _, nxt, _, _ = tree.build_tree_kernel_efficient(
        _t([7]),
        _t([[-1, 0, 1]]),
        _t([[0, 1, 2]]),
        _t([[1, 2, 3]]),
        _t([9]),
        9,
        1,
        3,
        4,
        tree_mask_mode=tree.TreeMaskMode.QLEN_ONLY,
    )
    assert pos.tolist() == [9, 10, 11, 12] and nxt.tolist() == [[1, 2, 3, -1]]
    assert torch.equal(mask.view(4, 4), torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_build_tree_mtp_step1_empty_parent_list():
    _, pos, _, nxt, sib, _ = tree.build_tree_kernel_efficient(
        _t([7, 8]),
        torch.empty(2, 0, dtype=I64),
        _t([[0], [0]]),
        _t([[1], [2]]),
        _t([3, 4]),
        7,
        1,
        1,
        2,
    )
    assert pos.tolist() == [3, 4, 4, 5] and nxt.tolist() == [[1, -1], [1, -1]]
    assert sib.tolist() == [[-1, -1], [-1, -1]]


def test_select_after_step_0_needs_scores():
    """Regression: scores=None past step 0 raised AttributeError (None.unsqueeze); now a
    ValueError naming the argument, as jspec.tree.select_top_k_tokens."""
    bs, k, hidden = 2, 2, 3
    topk_p = torch.softmax(torch.randn(bs * k, k), -1)
    topk_index = torch.randint(0, 50, (bs * k, k))
    with pytest.raises(ValueError, match="scores must be given"):
        tree.select_top_k_tokens(1, topk_p, topk_index, torch.randn(bs * k, hidden), None, k)


def test_select_and_organize_reproduce_a_small_tree():
    torch.manual_seed(0)
    bs, k, steps, n, hidden = 2, 2, 3, 6, 3
    topk_p = torch.softmax(torch.randn(bs, k), -1)
    topk_index = torch.randint(0, 50, (bs, k))
    h = torch.randn(bs, hidden)
    scores, infos = None, []
    for i in range(steps):
        ids, h, scores, info = tree.select_top_k_tokens(i, topk_p, topk_index, h, scores, k)
        assert ids.shape == (bs * k,) and h.shape == (bs * k, hidden)
        infos.append(info)
        topk_p = torch.softmax(torch.randn(bs * k, k), -1)
        topk_index = torch.randint(0, 50, (bs * k, k))
    parent_list, sel, _ = tree.organize_draft_results(
        [x[0] for x in infos], [x[1] for x in infos], [x[2] for x in infos], n
    )
    assert parent_list.shape == (bs, k * (steps - 1) + 1) and sel.shape == (bs, n - 1)
    assert bool((sel[:, 1:] > sel[:, :-1]).all())
    # every selected node's parent is selected (top-k of cumulative products is ancestor-closed)
    for b in range(bs):
        for s in sel[b].tolist():
            if s >= k:
                assert int(parent_list[b, s // k]) in sel[b].tolist()


# ---- §13.3 verify -----------------------------------------------------------------------------------
def _verify_inputs():
    candidates = _t([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
    ridx = _t([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])
    nxt = _t([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]])
    sib = _t([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]])
    logits = torch.full((2, 6, 20), 1.0)
    for (b, j), tok in {(0, 0): 3, (0, 3): 4, (0, 4): 5, (1, 0): 11, (1, 4): 12}.items():
        logits[b, j, tok] = 10
    for b in range(2):
        for j in range(6):
            if logits[b, j].max() < 10:
                logits[b, j, 18] = 10
    return candidates, ridx, nxt, sib, logits


def test_verify_tree_greedy_golden():
    candidates, ridx, nxt, sib, logits = _verify_inputs()
    predicts = torch.full((12,), -1, dtype=torch.int32)
    accept = torch.full((2, 4), -1, dtype=torch.int32)
    num = torch.zeros(2, dtype=torch.int32)
    tree.verify_tree_greedy(predicts, accept, num, candidates, ridx, nxt, sib, logits.argmax(-1))
    assert predicts.tolist() == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
    assert accept.tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]] and num.tolist() == [3, 2]


def test_verify_hand_chain():
    predicts = torch.full((4,), -1, dtype=torch.int32)
    accept = torch.full((1, 4), -1, dtype=torch.int32)
    num = torch.zeros(1, dtype=torch.int32)
    tree.verify_tree_greedy(
        predicts,
        accept,
        num,
        _t([[10, 3, 4, 5]]),
        _t([[0, 1, 2, 3]]),
        _t([[1, 2, 3, -1]]),
        _t([[-1, -1, -1, -1]]),
        _t([[3, 4, 9, 9]]),
    )
    assert predicts.tolist() == [3, 4, 9, -1] and accept.tolist() == [[0, 1, 2, -1]]
    assert num.tolist() == [2]


@pytest.mark.parametrize(
    "thresholds,want",
    [
        (
            (1.0, 1.0),
            (
                [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18],
                [[0, 3, 4, 5], [6, 10, 11, -1]],
                [3, 2],
            ),
        ),
        (
            (0.0, 0.0),
            (
                [1, 2, 18, -1, -1, -1, 11, -1, -1, -1, 12, 18],
                [[0, 1, 2, -1], [6, 10, 11, -1]],
                [2, 2],
            ),
        ),
    ],
)
def test_tree_speculative_sampling_golden(thresholds, want):
    candidates, ridx, nxt, sib, logits = _verify_inputs()
    probs = torch.softmax(logits / 0.01, -1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        predicts = torch.full((12,), -1, dtype=torch.int32)
        accept = torch.full((2, 4), -1, dtype=torch.int32)
        num = torch.zeros(2, dtype=torch.int32)
        coins = torch.rand(2, 6, generator=gen).clamp(min=1e-6)
        final = torch.rand(2, generator=gen)
        tree.tree_speculative_sampling_target_only(
            predicts,
            accept,
            num,
            candidates,
            ridx,
            nxt,
            sib,
            coins,
            final,
            probs,
            torch.zeros_like(probs),
            threshold_single=thresholds[0],
            threshold_acc=thresholds[1],
        )
        assert (predicts.tolist(), accept.tolist(), num.tolist()) == want
