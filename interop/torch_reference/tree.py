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
NOTE: an invalid tree (a node whose parent was not selected) is defined here as in jspec:
the node gets no links, and its ancestor walk stops (as if it reached the root), so its mask
row holds self + root and its position is ``L + 1``. sglang prints a warning and leaves the
node unlinked; its mask/position loop is undefined in that case.
"""

from __future__ import annotations

import enum
import math

import torch


class TreeMaskMode(enum.IntEnum):
    FULL_MASK = 0
    QLEN_ONLY = 1
    QLEN_ONLY_BITPACKING = 2


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
    num_draft_tokens: int,
):
    """``(parent_list, top_scores_index (sorted), draft_tokens)`` from the per-step tree info."""
    flat_scores = torch.cat(score_list, dim=1).flatten(1)
    ss_tokens = torch.cat(token_list, dim=1)
    top_scores_index = torch.topk(flat_scores, num_draft_tokens - 1, dim=-1).indices
    top_scores_index = torch.sort(top_scores_index).values
    draft_tokens = torch.gather(ss_tokens, 1, top_scores_index)
    if len(parents_list) > 1:
        parent_list = torch.cat(parents_list[:-1], dim=1)
    else:
        parent_list = torch.empty(
            parents_list[0].shape[0], 0, dtype=torch.int64, device=parents_list[0].device
        )
    return parent_list, top_scores_index, draft_tokens


# ---- build_tree_kernel_efficient (SPEC §7.4) ----------------------------------------------------
def _parent_node(sel: list[int], parents: list[int], node: int, topk: int) -> int | None:
    """Node index of ``node``'s parent (0 = root), or None if the parent was not selected."""
    parent_tb = sel[node - 1] // topk
    if parent_tb == 0:
        return 0
    token = parents[parent_tb]
    for pos, s in enumerate(sel):
        if s == token:
            return pos + 1
    return None


def _ancestor_sets(sel: list[int], parents: list[int], n: int, topk: int) -> list[list[int]]:
    """For each node: its tree columns set in the mask (self, ancestors, root; root = 0)."""
    rows = [[0]]
    for node in range(1, n):
        cols, cur = [0], node
        while cur is not None and cur != 0 and len(cols) <= n:  # bound guards malformed input
            cols.append(cur)
            cur = _parent_node(sel, parents, cur, topk)
        rows.append(cols)
    return rows


def _packed_dtype(n: int) -> torch.dtype:
    return [torch.uint8, torch.uint16, torch.uint32][math.ceil(math.log2((n + 7) // 8))]


def build_tree_kernel_efficient(
    verified_id: torch.Tensor,
    parent_list: torch.Tensor,
    top_scores_index: torch.Tensor,
    draft_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_sum: int,
    topk: int,
    spec_steps: int,
    num_verify_tokens: int,
    tree_mask_mode: int = TreeMaskMode.FULL_MASK,
    tree_mask_buf: torch.Tensor | None = None,
    position_buf: torch.Tensor | None = None,
    fill_prefix_mask: bool = True,
):
    """Port of ``_ref_build_tree`` / the CUDA ``build_tree_efficient`` kernel.

    Returns ``(tree_mask, positions i64[B*N], retrive_index, retrive_next_token,
    retrive_next_sibling i64[B,N], draft_tokens[B*N])``. FULL_MASK ``tree_mask`` is sglang's
    flat ``bool[sum(L)*N + B*N*N]`` (request blocks of ``N x (L_b + N)``, prefix columns
    ``fill_prefix_mask``); QLEN_ONLY is ``bool[B*N*N]``; QLEN_ONLY_BITPACKING is
    ``uint8/16/32[B*N]`` (bit j of row i: j is self or an ancestor; bit 0 = root).
    """
    n = num_verify_tokens
    bs = seq_lens.numel()
    device = seq_lens.device
    draft_tokens_flat = torch.cat((verified_id.unsqueeze(1), draft_tokens), dim=1).flatten()
    lens = [int(x) for x in seq_lens]
    if tree_mask_mode == TreeMaskMode.FULL_MASK:
        size = seq_lens_sum * n + n * n * bs
        fill = bool(fill_prefix_mask)
        tree_mask = torch.full((size,), fill, dtype=torch.bool, device=device)
    elif tree_mask_mode == TreeMaskMode.QLEN_ONLY:
        tree_mask = torch.full((n * n * bs,), True, dtype=torch.bool, device=device)
    else:
        tree_mask = torch.zeros((n * bs,), dtype=_packed_dtype(n), device=device)
    if tree_mask_buf is not None:
        tree_mask_buf.view(-1)[: tree_mask.numel()].copy_(tree_mask)
        tree_mask = tree_mask_buf
    positions = torch.empty(bs * n, dtype=torch.int64, device=device)
    retrive = torch.full((3, bs, n), -1, dtype=torch.int64, device=device)
    retrive_index, next_token, next_sibling = retrive[0], retrive[1], retrive[2]
    words = [0] * (bs * n)
    flat_mask = tree_mask.view(-1)
    block_start = 0
    for b in range(bs):
        sel = [int(x) for x in top_scores_index[b]]
        parents = [int(x) for x in parent_list[b]]
        seq_len = lens[b]
        # links: walk nodes N-1..1, head-insert into the parent's child list
        for node in range(n - 1, 0, -1):
            retrive_index[b, node] = b * n + node
            parent = _parent_node(sel, parents, node, topk)
            if parent is None:
                continue  # sglang: "WARNING: invalid eagle tree", node left unlinked
            if next_token[b, parent] != -1:
                next_sibling[b, node] = next_token[b, parent]
            next_token[b, parent] = node
        retrive_index[b, 0] = b * n
        for node, cols in enumerate(_ancestor_sets(sel, parents, n, topk)):
            positions[b * n + node] = seq_len + len(cols) - 1
            if tree_mask_mode == TreeMaskMode.FULL_MASK:
                row = block_start + node * (seq_len + n) + seq_len
                flat_mask[row : row + n] = False
                flat_mask[[row + c for c in cols]] = True
            elif tree_mask_mode == TreeMaskMode.QLEN_ONLY:
                row = (b * n + node) * n
                flat_mask[row : row + n] = False
                flat_mask[[row + c for c in cols]] = True
            else:
                words[b * n + node] = sum(1 << c for c in cols)
        block_start += seq_len * n + n * n
    if tree_mask_mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
        flat_mask.copy_(torch.tensor(words, dtype=torch.int64).to(tree_mask.dtype))
    if position_buf is not None:
        position_buf.view(-1)[: positions.numel()].copy_(positions)
        positions = position_buf
    return tree_mask, positions, retrive_index, next_token, next_sibling, draft_tokens_flat


# ---- verify (SPEC §8.1, §8.2) ------------------------------------------------------------------
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
    bs, num_spec = accept_index.shape
    target_flat = target_predict.reshape(-1)
    for b in range(bs):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, num_spec):
            cur = int(retrive_next_token[b, cur])
            while cur != -1:
                if int(candidates[b, cur]) == int(target_flat[last]):
                    predicts[last] = target_flat[last]
                    accepted += 1
                    accept_index[b, accepted] = retrive_index[b, cur]
                    last = int(retrive_index[b, cur])
                    break
                cur = int(retrive_next_sibling[b, cur])
            if cur == -1:
                break
        accept_token_num[b] = accepted
        predicts[last] = target_flat[last]


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
    bs, num_spec = accept_index.shape
    vocab = target_probs.shape[-1]
    for b in range(bs):
        prob_acc = torch.zeros((), dtype=target_probs.dtype)
        coin = uniform_samples[b, 0]
        row = 0  # local node whose target row is current
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, num_spec):
            cur = int(retrive_next_token[b, cur])
            while cur != -1:
                token = int(candidates[b, cur])
                q = target_probs[b, row, token]
                prob_acc = prob_acc + q
                if coin <= prob_acc / threshold_acc or q >= threshold_single:
                    prob_acc = torch.zeros((), dtype=target_probs.dtype)
                    row, coin = cur, uniform_samples[b, cur]
                    predicts[last] = token
                    accepted += 1
                    accept_index[b, accepted] = retrive_index[b, cur]
                    last = int(retrive_index[b, cur])
                    break
                draft_probs[b, row, token] = q
                cur = int(retrive_next_sibling[b, cur])
            if cur == -1:
                break
        accept_token_num[b] = accepted
        q_row = target_probs[b, row]
        p_row = draft_probs[b, row] if accepted != num_spec - 1 else torch.zeros_like(q_row)
        relu = torch.clamp(q_row - p_row, min=0)
        u = uniform_samples_for_final_sampling[b] * relu.sum()
        hits = torch.nonzero((relu > 0) & (torch.cumsum(relu, 0) > u))
        predicts[last] = int(hits[0, 0]) if hits.numel() else vocab - 1
