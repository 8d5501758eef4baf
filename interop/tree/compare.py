"""Comparison ops for the EAGLE tree: select/organize, build_tree, verify, sampling, the draft
layout and the accepted-KV moves (reference vs drop-in)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from interop._adapt import run_jspec
from interop._adapt import to_jax_default as _j
from interop._world import (
    I32,
    I64,
    POISON,
    Case,
    Op,
    Outputs,
    RandomPool,
    World,
    num_slots,
    to_numpy,
)
from interop.tree import dropin as api
from interop.tree import dropin_layout as api_layout
from interop.tree import reference as ref_tree
from interop.tree import reference_layout as ref_spec

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


def _build_args(w: World, rng: np.random.Generator, mode: int, vocab: int = VOCAB) -> tuple:
    """sglang's positional build_tree_kernel_efficient arguments for a random valid draft."""
    c = w.case
    bonus, parent_list, sel, draft = _tree_inputs(w, rng, vocab)
    seq = w.seq_lens
    return (bonus, parent_list, sel, draft, seq, int(seq.sum()), c.topk, c.num_steps,
            c.num_draft_tokens, int(mode))  # fmt: skip


BUILD_OUTPUTS = (
    "tree_mask",
    "positions",
    "retrive_index",
    "retrive_next_token",
    "retrive_next_sibling",
    "draft_tokens",
)


def op_build_tree(w: World, rng: np.random.Generator, impl: str):
    c = w.case
    modes = ref_tree.TreeMaskMode
    args = _build_args(w, rng, modes.FULL_MASK)
    ref: dict[str, np.ndarray] = {}
    got: dict[str, np.ndarray] = {}
    # FULL_MASK (with sglang's ragged flattening) always, plus one other mode (each is a fresh
    # compile): QLEN_ONLY for odd topk, QLEN_ONLY_BITPACKING for even topk
    for mode in (modes.FULL_MASK, modes.QLEN_ONLY if c.topk % 2 else modes.QLEN_ONLY_BITPACKING):
        mode_args = (*args[:-1], int(mode))
        for out, res in (
            (ref, ref_tree.build_tree_kernel_efficient(*mode_args)),
            (got, api.build_tree_kernel_efficient(*mode_args, impl=impl)),
        ):
            out.update({f"{mode.name}.{k}": to_numpy(v) for k, v in zip(BUILD_OUTPUTS, res)})
    return ref, got, {"parent_list": args[1], "top_scores_index": args[2], "seq_lens": w.seq_lens}


def _built_tree(w: World, rng: np.random.Generator, vocab: int):
    args = _build_args(w, rng, ref_tree.TreeMaskMode.QLEN_ONLY, vocab)
    _, _, ridx, nxt, sib, tokens = ref_tree.build_tree_kernel_efficient(*args)
    return tokens.reshape(w.case.batch, -1), ridx, nxt, sib


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


def op_prepare_for_draft(w: World, rng: np.random.Generator, impl: str):
    c = w.case
    pool = RandomPool(num_slots(w), c.page_size, rng)
    a, b = pool.clone(), pool.clone()
    args = (w.req_to_token, w.req_pool_indices, w.seq_lens, c.topk, c.num_steps, c.page_size)
    ref = {"out_cache_loc": to_numpy(ref_spec.prepare_for_draft(*args, a)), **a.outputs()}
    got = {
        "out_cache_loc": to_numpy(api_layout.prepare_for_draft(*args, b, impl=impl)),
        **b.outputs(),
    }
    return ref, got, {"seq_lens": w.seq_lens, "req_pool_indices": w.req_pool_indices}


def op_duplicate_prefix_tail(w: World, rng: np.random.Generator, impl: str):
    c = w.case
    p, s = c.page_size, c.num_steps
    rows = w.req_to_token[w.req_pool_indices]
    lp = w.seq_lens % p
    base = w.seq_lens - lp
    nnp = (lp + s + p - 1) // p
    pool = RandomPool(num_slots(w), p, rng)
    a, b = pool.clone(), pool.clone()
    ref_spec.duplicate_prefix_tail_to_draft_branches(a, rows, base, lp, nnp, c.topk, p)
    api_layout.duplicate_prefix_tail_to_draft_branches(b, rows, base, lp, nnp, c.topk, p, impl=impl)
    return a.outputs(), b.outputs(), {"prefix_base": base, "last_page": lp, "num_new_pages": nnp}


def _accept_paths(case: Case, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """accept_index i64[B, S+1] (global node ids, root first, -1 padded), accept_lens i64[B]."""
    n, width = case.num_draft_tokens, case.num_steps + 1
    index = torch.full((case.batch, width), -1, dtype=I64)
    lens = []
    for b in range(case.batch):
        length = int(rng.integers(1, min(width, n) + 1))
        nodes = [0] + sorted(rng.choice(np.arange(1, n), length - 1, replace=False).tolist())
        index[b, :length] = torch.tensor(nodes) + b * n
        lens.append(length)
    return index, torch.tensor(lens, dtype=I64)


def _verify_window(w: World) -> torch.Tensor:
    n = w.case.num_draft_tokens
    rows = w.req_to_token[w.req_pool_indices]
    pos = w.seq_lens[:, None] + torch.arange(n)
    return torch.gather(rows.to(I64), 1, pos).reshape(-1)


def op_accept_move(w: World, rng: np.random.Generator, impl: str):
    accept_index, accept_lens = _accept_paths(w.case, rng)
    locs = _verify_window(w)
    pool = RandomPool(num_slots(w), w.case.page_size, rng)
    a, b = pool.clone(), pool.clone()
    args = (w.req_to_token, w.req_pool_indices, w.seq_lens, locs, accept_index, accept_lens)
    tgt, src = ref_spec.move_accept_tokens_to_target_kvcache(a, *args)
    tgt2, src2 = api_layout.move_accept_tokens_to_target_kvcache(b, *args, impl=impl)
    return (
        {"tgt": to_numpy(tgt), "src": to_numpy(src), **a.outputs()},
        {"tgt": to_numpy(tgt2), "src": to_numpy(src2), **b.outputs()},
        {"accept_index": accept_index, "accept_lens": accept_lens},
    )


def op_get_src_tgt_cache_loc(w: World, rng: np.random.Generator, impl: str):
    from jspec.tree import accept

    c = w.case
    accept_index, accept_lens = _accept_paths(c, rng)
    locs = _verify_window(w)
    ncd = accept_lens - 1
    flat = accept_index.reshape(-1)
    src, tgt, nfree = ref_spec.get_src_tgt_cache_loc(
        w.seq_lens, locs, flat[flat != -1], ncd, c.num_draft_tokens, c.page_size
    )
    to_free = torch.zeros(int(nfree.sum()), dtype=I64)
    ref_spec.get_target_cache_loc(tgt, to_free, ncd, nfree, locs, c.num_draft_tokens)
    j_src, j_tgt, j_free, j_num = run_jspec(
        accept.get_src_tgt_cache_loc,
        _j(w.seq_lens, "seq_lens"),
        _j(locs, "out_cache_loc"),
        _j(accept_index, "accept_index"),
        _j(ncd, "accept_length"),
        num_draft_tokens=c.num_draft_tokens,
        page_size=c.page_size,
    )
    total, free_total = src.numel(), int(nfree.sum())
    ref = {
        "src": to_numpy(src),
        "tgt": to_numpy(tgt),
        "to_free_slots": to_numpy(to_free),
        "num_to_free": np.asarray([free_total]),
    }
    got = {
        "src": to_numpy(j_src)[:total],
        "tgt": to_numpy(j_tgt)[:total],
        "to_free_slots": to_numpy(j_free)[:free_total],
        "num_to_free": np.asarray([int(j_num)]),
    }
    return ref, got, {"accept_index": accept_index, "accept_lens": accept_lens}


_P = "jspec.kv.pool:move_kv_cache"
OPS: tuple[Op, ...] = (
    Op(
        "prepare_for_draft",
        op_prepare_for_draft,
        ("xla", "pallas"),
        ("jspec.tree.layout:draft_out_cache_loc", _P),
        ref_spec.prepare_for_draft,
        api_layout.prepare_for_draft,
    ),
    Op(
        "duplicate_prefix_tail_to_draft_branches",
        op_duplicate_prefix_tail,
        ("xla", "pallas"),
        ("jspec.tree.layout:duplicate_prefix_tail_to_draft_branches", _P),
        ref_spec.duplicate_prefix_tail_to_draft_branches,
        api_layout.duplicate_prefix_tail_to_draft_branches,
    ),
    Op(
        "move_accept_tokens_to_target_kvcache",
        op_accept_move,
        ("xla", "pallas"),
        ("jspec.tree.accept:accept_kv_move_pairs", _P),
        ref_spec.move_accept_tokens_to_target_kvcache,
        api_layout.move_accept_tokens_to_target_kvcache,
    ),
    Op(
        "get_src_tgt_cache_loc",
        op_get_src_tgt_cache_loc,
        ("xla",),
        ("jspec.tree.accept:get_src_tgt_cache_loc",),
        ref_spec.get_src_tgt_cache_loc,
        None,
    ),
    Op(
        "select_top_k_tokens+organize_draft_results",
        op_draft_tree,
        ("xla",),
        ("jspec.tree.select:organize_draft_results",),
        ref_tree.organize_draft_results,
        api.organize_draft_results,
    ),
    Op(
        "build_tree_kernel_efficient",
        op_build_tree,
        ("xla", "pallas"),
        ("jspec.tree.build:build_tree_kernel_efficient",),
        ref_tree.build_tree_kernel_efficient,
        api.build_tree_kernel_efficient,
    ),
    Op(
        "verify_tree_greedy",
        op_verify_tree_greedy,
        ("xla", "pallas"),
        ("jspec.tree.verify:verify_tree_greedy",),
        ref_tree.verify_tree_greedy,
        api.verify_tree_greedy,
    ),
    Op(
        "tree_speculative_sampling_target_only",
        op_tree_sampling,
        ("xla",),
        ("jspec.tree.sampling:tree_speculative_sampling_target_only",),
        ref_tree.tree_speculative_sampling_target_only,
        api.tree_speculative_sampling_target_only,
    ),
)
