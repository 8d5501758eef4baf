"""Independent pure-python/numpy oracles for the tree tests (ports of sglang's test references).

* :func:`gen_draft_tree` - ``_gen_draft_tree`` (test_spec_kernels.py): simulate
  select_top_k_tokens + organize_draft_results with random probabilities.
* :func:`ref_build_tree` - ``_ref_build_tree``: serial loops, QLEN mask (+ optional invalid
  handling as jspec defines it).
* :func:`ref_verify_tree_greedy` - ``_ref_verify_tree_greedy``, and :func:`ref_tree_sampling` - a
  serial port of the FlashInfer target-only sampling kernel: the one port of each lives in
  :mod:`interop.tree.oracle_np` (numpy only), shared with the PyTorch references.

Nothing here imports jspec.
"""

from __future__ import annotations

import numpy as np

from interop.tree.oracle_np import tree_sampling_np as ref_tree_sampling  # noqa: F401
from interop.tree.oracle_np import verify_tree_greedy_np as ref_verify_tree_greedy  # noqa: F401


def topk1_chain_inputs(bs: int, num_steps: int):
    """MTP chain (topk=1): parent_list arange(-1, S-1) (width 0 when S == 1), sel arange(S)."""
    width = num_steps if num_steps > 1 else 0
    parent_list = np.tile(np.arange(-1, width - 1, dtype=np.int32), (bs, 1)).reshape(bs, width)
    sel = np.tile(np.arange(num_steps, dtype=np.int32), (bs, 1))
    return parent_list, sel


def _np_topk_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Row-wise indices of the k largest values (value desc, index asc on ties)."""
    order = np.lexsort((np.broadcast_to(np.arange(x.shape[1]), x.shape), -x), axis=1)
    return order[:, :k]


def draft_tree_from_probs(scores0, step_ps, topk: int, num_draft_tokens: int):
    """The EAGLE draft loop on given probabilities (numpy): step-0 scores f32[B, K] and, per
    step i >= 1, f32[B, K, K] child probabilities. Returns (parent_list, sel, score_flat)."""
    bs = scores0.shape[0]
    score_chunks = [scores0]
    parents_chunks = [np.tile(np.arange(-1, topk, dtype=np.int64), (bs, 1))]
    cum = scores0
    for i, step_p in enumerate(step_ps, start=1):
        expand = cum[:, :, None] * step_p
        flat = expand.reshape(bs, -1)
        idx = _np_topk_indices(flat, topk)
        cum = np.take_along_axis(flat, idx, axis=1)
        score_chunks.append(flat)
        parents_chunks.append(idx + topk * topk * (i - 1) + topk)
    score_flat = np.concatenate(score_chunks, axis=1)
    sel = np.sort(_np_topk_indices(score_flat, num_draft_tokens - 1), axis=1)
    if step_ps:
        parent_list = np.concatenate(parents_chunks[:-1], axis=1)
    else:
        parent_list = np.zeros((bs, 0), np.int64)
    return parent_list.astype(np.int32), sel.astype(np.int32), score_flat


def gen_draft_tree(
    rng: np.random.Generator, bs: int, topk: int, num_steps: int, num_draft_tokens: int
):
    """Random valid (parent_list i32[B, K(S-1)+1], sel i32[B, N-1]) via the EAGLE draft loop.

    Probabilities lie in (0, 1): a child's score is below its parent's, so the global top-k
    keeps full ancestor chains.
    """
    scores0 = rng.random((bs, topk), dtype=np.float32) * 0.98 + 0.01
    step_ps = [
        rng.random((bs, topk, topk), dtype=np.float32) * 0.98 + 0.01 for _ in range(1, num_steps)
    ]
    parent_list, sel, _ = draft_tree_from_probs(scores0, step_ps, topk, num_draft_tokens)
    return parent_list, sel


def ref_build_tree(parent_list, sel, seq_lens, topk: int, num_draft_tokens: int):
    """Serial reference. Returns (retrive_index, next_token, next_sibling, positions[B*N],
    qlen mask bool[B, N, N], is_valid bool[B]).

    Invalid nodes (parent not selected): unlinked, parent treated as the root for the mask
    and positions (jspec's defined behaviour; sglang's CUDA kernel skips the link).
    """
    parent_list, sel, seq_lens = (np.asarray(x) for x in (parent_list, sel, seq_lens))
    bs, n = sel.shape[0], num_draft_tokens
    retrive_index = np.full((bs, n), -1, np.int64)
    next_token = np.full((bs, n), -1, np.int64)
    next_sibling = np.full((bs, n), -1, np.int64)
    positions = np.zeros(bs * n, np.int64)
    mask = np.zeros((bs, n, n), bool)
    is_valid = np.ones(bs, bool)
    for b in range(bs):
        off = b * n
        s = [int(x) for x in sel[b]]
        parents = [int(x) for x in parent_list[b]]
        retrive_index[b] = np.arange(off, off + n)
        parent_pos = [0] * n
        linked = [True] * n
        for i in range(1, n):
            tb = s[i - 1] // topk if s[i - 1] >= 0 else -1
            if tb == 0:
                parent_pos[i] = 0
                continue
            ptok = parents[tb] if 1 <= tb < len(parents) else None
            if ptok is not None and ptok in s and s.index(ptok) + 1 < i:
                parent_pos[i] = s.index(ptok) + 1
            else:
                parent_pos[i] = 0
                linked[i] = False
                is_valid[b] = False
        for i in range(n - 1, 0, -1):  # head insertion, kernel order
            if not linked[i]:
                continue
            p = parent_pos[i]
            if next_token[b, p] != -1:
                next_sibling[b, i] = next_token[b, p]
            next_token[b, p] = i
        positions[off] = int(seq_lens[b])
        mask[b, :, 0] = True
        for i in range(1, n):
            ancestors, j = [], i
            while j != 0:
                ancestors.append(j)
                j = parent_pos[j]
            positions[off + i] = int(seq_lens[b]) + len(ancestors)
            for j in ancestors:
                mask[b, i, j] = True
    return retrive_index, next_token, next_sibling, positions, mask, is_valid


def ref_flat_full_mask(mask, seq_lens, fill: bool = True) -> np.ndarray:
    """sglang's flat FULL_MASK buffer (ΣL·N + B·N²) from a qlen mask."""
    blocks = []
    for b in range(mask.shape[0]):
        n = mask.shape[1]
        block = np.full((n, int(seq_lens[b]) + n), fill, bool)
        block[:, int(seq_lens[b]) :] = mask[b]
        blocks.append(block.reshape(-1))
    return np.concatenate(blocks)
