"""numpy oracles of sglang's greedy and sampling tree verify (SPEC.md §8.1, §8.2).

The one serial port of each kernel: the PyTorch references (:mod:`interop.tree.reference`) wrap
them with sglang's in-place convention, and jspec's own tree tests (tests/tree/tree_oracles.py)
use them directly. numpy only: importing this imports neither torch nor jax.

* :func:`verify_tree_greedy_np` - sglang's ``_ref_verify_tree_greedy`` / ``VerifyTreeGreedy``.
* :func:`tree_sampling_np` - the FlashInfer-derived ``TreeSpeculativeSamplingTargetOnly``.

Both return ``(predicts i64[B*N] (untouched entries = predicts_init), accept_index i64[B, S+1]
(-1 padded), accept_token_num i64[B])``.
"""

from __future__ import annotations

import numpy as np


def _outputs(bs: int, n: int, num_spec_steps: int, predicts_init: int):
    """Fresh ``(predicts i64[B*N], accept_index i64[B, S+1], accept_token_num i64[B])``."""
    predicts = np.full(bs * n, predicts_init, np.int64)
    accept = np.full((bs, num_spec_steps), -1, np.int64)
    return predicts, accept, np.zeros(bs, np.int64)


def _walk(b, candidates, retrive_index, next_token, next_sibling, num_spec_steps, out, accepts):
    """Request ``b``'s accept walk, the same in both kernels: from the root, try each level's
    children in sibling order; ``accepts(cur, last)`` (local node, last accepted global id)
    decides, in visit order. An accepted node's token is ``predicts[last]``; its global id
    goes into ``accept_index``. Returns ``(number of accepted drafts, last accepted global id)``.
    """
    predicts, accept, _ = out
    last = int(retrive_index[b, 0])
    accept[b, 0] = last
    accepted, cur = 0, 0
    for _ in range(1, num_spec_steps):
        cur = int(next_token[b, cur])
        while cur != -1:
            if accepts(cur, last):
                predicts[last] = int(candidates[b, cur])
                last = int(retrive_index[b, cur])
                accepted += 1
                accept[b, accepted] = last
                break
            cur = int(next_sibling[b, cur])
        if cur == -1:
            break
    return accepted, last


def verify_tree_greedy_np(
    candidates,
    retrive_index,
    next_token,
    next_sibling,
    target_predict,
    num_spec_steps: int,
    predicts_init: int = -1,
):
    """Serial port of sglang's ``_ref_verify_tree_greedy``."""
    candidates, retrive_index, next_token, next_sibling = (
        np.asarray(x) for x in (candidates, retrive_index, next_token, next_sibling)
    )
    links = (candidates, retrive_index, next_token, next_sibling)
    bs, n = candidates.shape
    out = _outputs(bs, n, num_spec_steps, predicts_init)
    predicts, _, num = out
    target_flat = np.asarray(target_predict).reshape(-1)
    for bx in range(bs):
        # A child matches when its token is the target's prediction after the last accepted.
        num[bx], last = _walk(
            bx,
            *links,
            num_spec_steps,
            out,
            lambda cur, last: int(candidates[bx, cur]) == int(target_flat[last]),
        )
        predicts[last] = int(target_flat[last])
    return out


def tree_sampling_np(
    candidates,
    retrive_index,
    next_token,
    next_sibling,
    coins,
    final_coins,
    target_probs,
    num_spec_steps: int,
    threshold_single=1.0,
    threshold_acc=1.0,
    predicts_init: int = -1,
    draft_probs_out=None,
):
    """Serial port of the FlashInfer-derived ``TreeSpeculativeSamplingTargetOnly`` kernel.

    ``draft_probs_out`` (f32[B, N, V] or None): receives each rejected sibling's target
    probability at ``[b, row, token]``, as the kernel writes its ``draft_probs`` argument.
    """
    candidates, retrive_index, next_token, next_sibling = (
        np.asarray(x) for x in (candidates, retrive_index, next_token, next_sibling)
    )
    links = (candidates, retrive_index, next_token, next_sibling)
    q = np.asarray(target_probs, np.float32)
    coins = np.asarray(coins, np.float32)
    bs, n = candidates.shape
    v = q.shape[-1]
    t_acc = np.float32(max(threshold_acc, 1e-9))
    out = _outputs(bs, n, num_spec_steps, predicts_init)
    predicts, _, num = out
    for b in range(bs):
        draft_probs = np.zeros((n, v), np.float32)
        # row: the last accepted local node (whose target distribution the siblings draw from).
        prob_acc, row, coin = np.float32(0), 0, coins[b, 0]

        def accepts(cur: int, last: int) -> bool:  # (called within this iteration only)
            del last
            nonlocal prob_acc, row, coin
            tok = int(candidates[b, cur])
            p = q[b, row, tok]
            prob_acc = np.float32(prob_acc + p)
            if coin <= prob_acc / t_acc or p >= threshold_single:
                prob_acc, row, coin = np.float32(0), cur, coins[b, cur]
                return True
            draft_probs[row, tok] = p
            if draft_probs_out is not None:
                draft_probs_out[b, row, tok] = p
            return False

        num[b], last = _walk(b, *links, num_spec_steps, out, accepts)
        qrow = q[b, row]
        prow = draft_probs[row] if num[b] != num_spec_steps - 1 else np.zeros(v, np.float32)
        resid = np.maximum(qrow - prow, 0).astype(np.float32)
        u = np.float32(final_coins[b]) * resid.sum(dtype=np.float32)
        cdf = np.cumsum(resid, dtype=np.float32)
        hits = np.nonzero((cdf > u) & (resid > 0))[0]
        predicts[last] = int(hits[0]) if hits.size else v - 1
    return out
