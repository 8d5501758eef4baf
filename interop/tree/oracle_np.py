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
    bs, n = candidates.shape
    predicts = np.full(bs * n, predicts_init, np.int64)
    accept = np.full((bs, num_spec_steps), -1, np.int64)
    num = np.zeros(bs, np.int64)
    target_flat = np.asarray(target_predict).reshape(-1)
    for bx in range(bs):
        last = int(retrive_index[bx, 0])
        accept[bx, 0] = last
        correct, cur = 0, 0
        for _ in range(1, num_spec_steps):
            cur = int(next_token[bx, cur])
            while cur != -1:
                draft_idx = int(retrive_index[bx, cur])
                if int(candidates[bx, cur]) == int(target_flat[last]):
                    predicts[last] = int(target_flat[last])
                    correct += 1
                    accept[bx, correct] = draft_idx
                    last = draft_idx
                    break
                cur = int(next_sibling[bx, cur])
            if cur == -1:
                break
        num[bx] = correct
        predicts[last] = int(target_flat[last])
    return predicts, accept, num


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
    q = np.asarray(target_probs, np.float32)
    coins = np.asarray(coins, np.float32)
    bs, n = candidates.shape
    v = q.shape[-1]
    t_acc = np.float32(max(threshold_acc, 1e-9))
    predicts = np.full(bs * n, predicts_init, np.int64)
    accept = np.full((bs, num_spec_steps), -1, np.int64)
    num = np.zeros(bs, np.int64)
    for b in range(bs):
        draft_probs = np.zeros((n, v), np.float32)
        prob_acc = np.float32(0)
        row = 0
        coin = coins[b, 0]
        last = int(retrive_index[b, 0])
        accept[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, num_spec_steps):
            cur = int(next_token[b, cur])
            while cur != -1:
                tok = int(candidates[b, cur])
                p = q[b, row, tok]
                prob_acc = np.float32(prob_acc + p)
                if coin <= prob_acc / t_acc or p >= threshold_single:
                    prob_acc = np.float32(0)
                    row = cur
                    coin = coins[b, cur]
                    predicts[last] = tok
                    accepted += 1
                    accept[b, accepted] = int(retrive_index[b, cur])
                    last = int(retrive_index[b, cur])
                    break
                draft_probs[row, tok] = q[b, row, tok]
                if draft_probs_out is not None:
                    draft_probs_out[b, row, tok] = q[b, row, tok]
                cur = int(next_sibling[b, cur])
            if cur == -1:
                break
        num[b] = accepted
        qrow = q[b, row]
        prow = draft_probs[row] if accepted != num_spec_steps - 1 else np.zeros(v, np.float32)
        resid = np.maximum(qrow - prow, 0).astype(np.float32)
        u = np.float32(final_coins[b]) * resid.sum(dtype=np.float32)
        cdf = np.cumsum(resid, dtype=np.float32)
        hits = np.nonzero((cdf > u) & (resid > 0))[0]
        predicts[last] = int(hits[0]) if hits.size else v - 1
    return predicts, accept, num
