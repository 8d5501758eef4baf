"""PyTorch references of sglang's EAGLE tree ops (SPEC.md §7.2-§7.4, §8.1, §8.2).

Same names, argument order and in-place conventions as sglang / sgl_kernel; the CUDA kernels
(``build_tree_efficient``, ``VerifyTreeGreedy``, ``TreeSpeculativeSamplingTargetOnly``) are
ported as per-request Python loops. Index outputs are int64 like sglang's.

Tree node numbering (one request): node 0 is the root (the previous bonus token); node
``j >= 1`` is ``top_scores_index[j-1]``, a flat "ss index" into the concatenated step lists::

    ss index s < K                       -> step-0 token s, parent = root
    s = K + (i-1)*K^2 + r*K + c          -> step-i token, parent = parent_list[s // K]

NOTE: ties in ``torch.topk`` are implementation defined (jspec breaks ties by lower index);
the comparison harness draws continuous random scores so ties do not occur.
``build_tree_kernel_efficient`` (and ``TreeMaskMode``) live in :mod:`.reference_build_tree`
(sglang's kernel on every input it accepts, malformed trees included) and are re-exported here.
"""

from __future__ import annotations

import numpy as np
import torch

from interop.tree import oracle_np
from interop.tree.reference_build_tree import (  # noqa: F401  (re-exports)
    TreeMaskMode,
    build_tree_kernel_efficient,
)


# ---- drafting (SPEC §7.2, §7.3) ---------------------------------------------------------------
def select_top_k_tokens(
    i: int,
    topk_p: torch.Tensor,
    topk_index: torch.Tensor,
    hidden_states: torch.Tensor,
    scores: torch.Tensor | None,
    topk: int,
):
    """One draft step's branch selection; returns ``(input_ids, hidden, scores, tree_info)``."""
    if i == 0:
        batch = topk_p.shape[0]
        input_ids = topk_index.flatten()
        hidden_states = hidden_states.repeat_interleave(topk, dim=0)
        parents = torch.arange(-1, topk, dtype=torch.int64, device=topk_p.device)
        tree_info = (topk_p.unsqueeze(1), topk_index, parents.unsqueeze(0).repeat(batch, 1))
        return input_ids, hidden_states, topk_p, tree_info
    if scores is None:
        raise ValueError(f"scores must be given at step i={i}")
    expand_scores = scores.unsqueeze(2) * topk_p.reshape(-1, topk, topk)  # (B, K, K)
    cs_p, cs_index = torch.topk(expand_scores.flatten(start_dim=1), topk, dim=-1)
    topk_index = topk_index.reshape(-1, topk**2)
    input_ids = torch.gather(topk_index, 1, cs_index).flatten()
    if hidden_states.shape[0] > 0:
        base = torch.arange(0, hidden_states.shape[0], topk, device=cs_index.device)
        selected = cs_index.flatten() // topk + base.repeat_interleave(topk)
        hidden_states = hidden_states[selected, :]
    tree_info = (expand_scores, topk_index, cs_index + (topk**2 * (i - 1) + topk))
    return input_ids, hidden_states, cs_p, tree_info


def organize_draft_results(
    score_list: list[torch.Tensor],
    token_list: list[torch.Tensor],
    parents_list: list[torch.Tensor],
    num_draft_token: int,
):
    """``(parent_list, top_scores_index (sorted), draft_tokens)`` from the per-step tree info."""
    flat_scores = torch.cat(score_list, dim=1).flatten(1)
    ss_tokens = torch.cat(token_list, dim=1)
    top_scores_index = torch.topk(flat_scores, num_draft_token - 1, dim=-1).indices
    top_scores_index = torch.sort(top_scores_index).values
    draft_tokens = torch.gather(ss_tokens, 1, top_scores_index)
    if len(parents_list) > 1:
        parent_list = torch.cat(parents_list[:-1], dim=1)
    else:
        parent_list = torch.empty(
            parents_list[0].shape[0], 0, dtype=torch.int64, device=parents_list[0].device
        )
    return parent_list, top_scores_index, draft_tokens


# ---- verify (SPEC §8.1, §8.2): sglang's in-place convention over the one numpy port -----------
def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().numpy()


def write_accepted(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    out: tuple,
) -> None:
    """The verify kernels' write set from a full result ``(predicts, accept_index, num)`` (numpy or
    torch): the accepted nodes' ``predicts``, the written (``!= -1``) ``accept_index`` entries and
    the counts. Everything else keeps the caller's values."""
    new_predicts, new_accept, new_num = (torch.as_tensor(x).to(predicts.device) for x in out)
    written = new_accept != -1
    accept_index[written] = new_accept[written].to(accept_index.dtype)
    ids = new_accept[written].to(torch.int64)
    predicts[ids] = new_predicts[ids].to(predicts.dtype)
    accept_token_num.copy_(new_num)


def verify_tree_greedy(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy tree acceptance, written in place into ``predicts`` (``[B*N]``, global node ids),
    ``accept_index`` (``[B, S+1]``, caller-initialised to -1) and ``accept_token_num`` (``[B]``,
    number of accepted drafts, root excluded). Unaccepted ``predicts`` entries are untouched."""
    out = oracle_np.verify_tree_greedy_np(
        _np(candidates),
        _np(retrive_index),
        _np(retrive_next_token),
        _np(retrive_next_sibling),
        _np(target_predict),
        accept_index.shape[1],
    )
    write_accepted(predicts, accept_index, accept_token_num, out)


def tree_speculative_sampling_target_only(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """Target-only tree sampling (sgl_kernel), in place like :func:`verify_tree_greedy`.

    ``target_probs``/``draft_probs``: f32 ``[B, N, V]`` (rows by local node index; ``draft_probs``
    zeros on entry, rejected siblings' target probs are written into it). ``uniform_samples``
    ``[B, N]`` are the per-node coins, ``uniform_samples_for_final_sampling`` ``[B]``.
    """
    rejected = _np(draft_probs).astype(np.float32, copy=True)
    out = oracle_np.tree_sampling_np(
        _np(candidates),
        _np(retrive_index),
        _np(retrive_next_token),
        _np(retrive_next_sibling),
        _np(uniform_samples),
        _np(uniform_samples_for_final_sampling),
        _np(target_probs),
        accept_index.shape[1],
        threshold_single,
        threshold_acc,
        draft_probs_out=rejected,
    )
    draft_probs.copy_(torch.from_numpy(rejected).to(draft_probs.dtype))
    write_accepted(predicts, accept_index, accept_token_num, out)
