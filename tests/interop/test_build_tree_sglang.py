"""build_tree_kernel_efficient: sglang 0.5.23's kernel rules on malformed trees and wide inputs.

Expected values are worked out by hand from the kernel's rules (links: parent found anywhere in
``sel``, head insertion from node N-1 down; walk: at most ``spec_steps`` steps, stopping at the
root or at an unselected parent). Both the drop-in and the PyTorch reference must give them.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from interop import torch_api as api
from interop.tree import reference as ref
from interop.tree.reference_build_tree import TreeMaskMode

I64 = torch.int64
BUILDERS = (ref.build_tree_kernel_efficient, api.build_tree_kernel_efficient)


def _t(x, dtype=I64):
    return torch.tensor(x, dtype=dtype)


def _rows(mask, n):
    return ["".join(str(int(v)) for v in r) for r in mask.view(-1, n)]


# K=2, S=3. Each case: (parent_list row, selected row, L, N, next_token, next_sibling,
# positions, QLEN mask rows).
CASES = {
    # node 1's parent (token 0) is node 2, selected LATER; node 3's parent token 1 is not selected
    "descending": (
        [-1, 0, 1, 2, 3],
        [2, 0, 5],
        5,
        4,
        [2, -1, 1, -1],
        [-1, -1, -1, -1],
        [5, 7, 6, 6],
        ["1000", "1110", "1010", "1001"],
    ),
    # nodes 1 and 2 are each other's parent: the walk goes round the cycle spec_steps=3 times
    "cyclic": (
        [-1, 4, 2, 0, 0],
        [2, 4],
        4,
        3,
        [-1, 2, 1],
        [-1, -1, -1],
        [4, 7, 7],
        ["100", "111", "111"],
    ),
    # node 1 is its own parent: next_token[1] = 1, the walk stays on it
    "self_parent": ([-1, 2, 0, 0, 0], [2], 6, 2, [-1, 1], [-1, -1], [6, 9], ["10", "11"]),
    # two children of the root and a grandchild whose parent comes first: a valid tree
    "valid": (
        [-1, 0, 1, 2, 3],
        [0, 1, 3],
        5,
        4,
        [1, 3, -1, -1],
        [-1, 2, -1, -1],
        [5, 6, 6, 7],
        ["1000", "1100", "1010", "1101"],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("build", BUILDERS, ids=("reference", "dropin"))
def test_hand_computed_trees(name, build):
    parents, sel, seq_len, n, nxt, sib, pos, rows = CASES[name]
    draft = _t([[100 + j for j in range(len(sel))]])
    args = (_t([7]), _t([parents]), _t([sel]), draft, _t([seq_len]), seq_len, 2, 3, n)
    mask, positions, ridx, next_token, next_sibling, tokens = build(*args, TreeMaskMode.QLEN_ONLY)
    assert next_token.tolist() == [nxt] and next_sibling.tolist() == [sib]
    assert positions.tolist() == pos and ridx.tolist() == [list(range(n))]
    assert _rows(mask, n) == rows
    assert tokens.tolist() == [7, *draft[0].tolist()]
    packed, *_ = build(*args, TreeMaskMode.QLEN_ONLY_BITPACKING)
    assert packed.to(I64).tolist() == [int(r[::-1], 2) for r in rows]
    full, *_ = build(*args, TreeMaskMode.FULL_MASK)
    block = full.view(n, seq_len + n)
    assert bool(block[:, :seq_len].all()) and _rows(block[:, seq_len:].contiguous(), n) == rows


@pytest.mark.parametrize("build", BUILDERS, ids=("reference", "dropin"))
def test_malformed_request_beside_a_valid_one(build):
    """Per-request rules: a malformed request does not disturb its neighbour."""
    desc, valid = CASES["descending"], CASES["valid"]
    parents = _t([desc[0], valid[0]])
    sel = _t([desc[1], valid[1]])
    out = build(
        _t([7, 8]), parents, sel, sel + 100, _t([5, 5]), 10, 2, 3, 4, TreeMaskMode.QLEN_ONLY
    )
    assert out[3].tolist() == [desc[4], valid[4]] and out[4].tolist() == [desc[5], valid[5]]
    assert out[1].tolist() == desc[6] + valid[6]
    assert _rows(out[0], 4) == desc[7] + valid[7]


@pytest.mark.parametrize("build", BUILDERS, ids=("reference", "dropin"))
def test_wider_selected_index_and_parent_list_are_read_as_sglang_reads_them(build):
    """sglang reads the first N-1 columns of each selected_index row and parent_list by index."""
    _, sel_a, seq_len, n, nxt, sib, pos, rows = CASES["valid"]
    parents = [[-1, 0, 1, 2, 3, 99, 98], [-1, 0, 1, 2, 3, 97, 96]]
    sel = [sel_a + [5, 1], sel_a + [4, 0]]  # garbage past N-1 columns
    out = build(
        _t([1, 2]),
        _t(parents),
        _t(sel),
        _t([[9, 9, 9]] * 2),
        _t([seq_len] * 2),
        2 * seq_len,
        2,
        3,
        n,
        TreeMaskMode.QLEN_ONLY,
    )
    assert out[3].tolist() == [nxt, nxt] and out[4].tolist() == [sib, sib]
    assert out[1].tolist() == pos + pos and _rows(out[0], n) == rows + rows


def test_narrower_selected_index_is_refused():
    with pytest.raises(ValueError, match="top_scores_index"):
        api.build_tree_kernel_efficient(
            _t([1]), _t([[-1, 0, 1, 2, 3]]), _t([[0, 1]]), _t([[5, 6]]), _t([4]), 4, 2, 3, 4
        )


@pytest.mark.parametrize("name", ("descending", "valid"))
@pytest.mark.parametrize("build", BUILDERS, ids=("reference", "dropin"))
def test_buffers_are_filled_as_sglang_fills_them(build, name):
    """FULL_MASK + tree_mask_buf + fill_prefix_mask=False: prefix cells keep the buffer's values;
    QLEN_ONLY / BITPACKING buffers are filled whole (True / 0) before the rows are written."""
    parents, sel, seq_len, n, *_, rows = CASES[name]
    args = (_t([7]), _t([parents]), _t([sel]), _t([sel]), _t([seq_len]), seq_len, 2, 3, n)
    size = n * (seq_len + n)
    buf = torch.zeros(size + 5, dtype=torch.bool)
    buf[1] = True  # a stale prefix cell
    out = build(*args, TreeMaskMode.FULL_MASK, buf, False)
    assert out[0] is buf
    block = buf[:size].view(n, seq_len + n)
    assert block[0, :seq_len].tolist() == [False, True, False, False, False]
    assert not bool(block[1:, :seq_len].any()) and not bool(buf[size:].any())
    assert _rows(block[:, seq_len:].contiguous(), n) == rows
    qbuf = torch.zeros(n * n + 3, dtype=torch.bool)
    build(*args, TreeMaskMode.QLEN_ONLY, qbuf)
    assert _rows(qbuf[: n * n], n) == rows and bool(qbuf[n * n :].all())
    pbuf = torch.full((n + 2,), 255, dtype=torch.uint8)
    build(*args, TreeMaskMode.QLEN_ONLY_BITPACKING, pbuf)
    assert pbuf.tolist() == [int(r[::-1], 2) for r in rows] + [0, 0]


def test_dropin_uses_jspec_on_valid_trees(monkeypatch):
    """A valid tree is built by jspec (the comparison target), not by the reference rules."""
    from interop.tree import reference_build_tree

    def boom(*a, **k):
        raise AssertionError("the sglang-rules fallback ran on a valid tree")

    monkeypatch.setattr(reference_build_tree, "sglang_tree", boom)
    parents, sel, seq_len, n, nxt, *_ = CASES["valid"]
    out = api.build_tree_kernel_efficient(
        _t([7]), _t([parents]), _t([sel]), _t([sel]), _t([seq_len]), seq_len, 2, 3, n
    )
    assert out[3].tolist() == [nxt]
