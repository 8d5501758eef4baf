"""Comparison ops for the EAGLE tree: select/organize, build_tree, verify, sampling."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from interop import torch_api as api
from interop.compare_world import I32, I64, POISON, Case, Outputs, World, to_numpy
from interop.torch_reference import tree as ref_tree

VOCAB = 32000
SAMPLING_VOCAB = 8


def _draft_steps(case: Case, rng: np.random.Generator, vocab: int = VOCAB):
    """Per-step (topk_p, topk_index) inputs of the draft loop, plus the initial hidden states."""
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    b, k = case.batch, case.topk
    steps = []
    for i in range(case.num_steps):
        rows = b if i == 0 else b * k
        probs = torch.softmax(torch.randn(rows, min(64, vocab), generator=gen), -1)
        p, idx = torch.topk(probs, k, dim=-1)
        steps.append((p, (idx * 997 + 13) % vocab))
    return steps, torch.randn(b, 4, generator=gen)


def _run_draft(select: Callable, organize: Callable, case: Case, steps, hidden0):
    outs, infos, scores, hidden = {}, [], None, hidden0
    for i, (topk_p, topk_index) in enumerate(steps):
        ids, hidden, scores, info = select(i, topk_p, topk_index, hidden, scores, case.topk)
        outs.update(
            {
                f"step{i}.input_ids": to_numpy(ids),
                f"step{i}.hidden": to_numpy(hidden),
                f"step{i}.scores": to_numpy(scores),
                f"step{i}.score_entry": to_numpy(info[0]),
                f"step{i}.tokens": to_numpy(info[1]),
                f"step{i}.parents": to_numpy(info[2]),
            }
        )
        infos.append(info)
    parent_list, sel, draft = organize(
        [x[0] for x in infos], [x[1] for x in infos], [x[2] for x in infos], case.num_draft_tokens
    )
    outs.update(
        parent_list=to_numpy(parent_list),
        top_scores_index=to_numpy(sel),
        draft_tokens=to_numpy(draft),
    )
    return outs, (parent_list, sel, draft)


def op_draft_tree(w: World, rng: np.random.Generator, impl: str):
    steps, hidden = _draft_steps(w.case, rng)
    ref, _ = _run_draft(
        ref_tree.select_top_k_tokens, ref_tree.organize_draft_results, w.case, steps, hidden
    )
    got, _ = _run_draft(api.select_top_k_tokens, api.organize_draft_results, w.case, steps, hidden)
    return ref, got, {"seq_lens": w.seq_lens}


def _tree_inputs(w: World, rng: np.random.Generator, vocab: int = VOCAB):
    steps, hidden = _draft_steps(w.case, rng, vocab)
    _, (parent_list, sel, draft) = _run_draft(
        ref_tree.select_top_k_tokens, ref_tree.organize_draft_results, w.case, steps, hidden
    )
    bonus = torch.tensor(rng.integers(0, vocab, w.case.batch), dtype=I64)
    return bonus, parent_list, sel, draft


def op_build_tree(w: World, rng: np.random.Generator, impl: str):
    c = w.case
    bonus, parent_list, sel, draft = _tree_inputs(w, rng)
    ref, got = {}, {}
    # FULL_MASK (with sglang's ragged flattening) always, plus one other mode (each is a fresh
    # compile): QLEN_ONLY for odd topk, QLEN_ONLY_BITPACKING for even topk
    modes = ref_tree.TreeMaskMode
    for mode in (modes.FULL_MASK, modes.QLEN_ONLY if c.topk % 2 else modes.QLEN_ONLY_BITPACKING):
        args = (
            bonus,
            parent_list,
            sel,
            draft,
            w.seq_lens,
            int(w.seq_lens.sum()),
            c.topk,
            c.num_steps,
            c.num_draft_tokens,
            int(mode),
        )
        names = (
            "tree_mask",
            "positions",
            "retrive_index",
            "retrive_next_token",
            "retrive_next_sibling",
            "draft_tokens",
        )
        for out, res in (
            (ref, ref_tree.build_tree_kernel_efficient(*args)),
            (got, api.build_tree_kernel_efficient(*args, impl=impl)),
        ):
            out.update({f"{mode.name}.{k}": to_numpy(v) for k, v in zip(names, res)})
    return ref, got, {"parent_list": parent_list, "top_scores_index": sel, "seq_lens": w.seq_lens}


def _built_tree(w: World, rng: np.random.Generator, vocab: int):
    c = w.case
    bonus, parent_list, sel, draft = _tree_inputs(w, rng, vocab)
    _, _, ridx, nxt, sib, tokens = ref_tree.build_tree_kernel_efficient(
        bonus,
        parent_list,
        sel,
        draft,
        w.seq_lens,
        int(w.seq_lens.sum()),
        c.topk,
        c.num_steps,
        c.num_draft_tokens,
        int(ref_tree.TreeMaskMode.QLEN_ONLY),
    )
    return tokens.reshape(c.batch, -1), ridx, nxt, sib


def _accept_outputs(fn: Callable, case: Case, args: tuple, **kw) -> Outputs:
    predicts = torch.full((case.batch * case.num_draft_tokens,), POISON, dtype=I32)
    accept = torch.full((case.batch, case.num_steps + 1), -1, dtype=I32)
    num = torch.full((case.batch,), POISON, dtype=I32)
    fn(predicts, accept, num, *args, **kw)
    return {
        "predicts": to_numpy(predicts),
        "accept_index": to_numpy(accept),
        "accept_token_num": to_numpy(num),
    }


def op_verify_tree_greedy(w: World, rng: np.random.Generator, impl: str):
    candidates, ridx, nxt, sib = _built_tree(w, rng, VOCAB)
    # targets: a random child's token 70% of the time, so accepted paths are non-trivial
    target = torch.tensor(rng.integers(0, VOCAB, candidates.shape), dtype=I64)
    for b in range(candidates.shape[0]):
        for j in range(candidates.shape[1]):
            child = int(nxt[b, j])
            while child != -1 and rng.random() < 0.5 and int(sib[b, child]) != -1:
                child = int(sib[b, child])
            if child != -1 and rng.random() < 0.7:
                target[b, j] = candidates[b, child]
    args = (candidates, ridx, nxt, sib, target)
    return (
        _accept_outputs(ref_tree.verify_tree_greedy, w.case, args),
        _accept_outputs(api.verify_tree_greedy, w.case, args, impl=impl),
        {"candidates": candidates, "retrive_next_token": nxt, "target_predict": target},
    )


def op_tree_sampling(w: World, rng: np.random.Generator, impl: str):
    candidates, ridx, nxt, sib = _built_tree(w, rng, SAMPLING_VOCAB)
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    shape = tuple(candidates.shape)
    probs = torch.softmax(2 * torch.randn(*shape, SAMPLING_VOCAB, generator=gen), -1)
    coins = torch.rand(*shape, generator=gen)
    final = torch.rand(shape[0], generator=gen)
    t_single, t_acc = [(1.0, 1.0), (0.6, 0.8), (0.0, 0.0)][int(rng.integers(0, 3))]
    args = (
        candidates,
        ridx,
        nxt,
        sib,
        coins,
        final,
        probs,
        torch.zeros_like(probs),
        t_single,
        t_acc,
    )
    return (
        _accept_outputs(ref_tree.tree_speculative_sampling_target_only, w.case, args),
        _accept_outputs(api.tree_speculative_sampling_target_only, w.case, args),
        {"candidates": candidates, "coins": coins, "thresholds": torch.tensor([t_single, t_acc])},
    )
