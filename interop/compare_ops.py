"""Comparison ops for the KV, layout, accept, metadata and sizing bookkeeping, and the registry.

Each op is ``(world, rng, impl) -> (reference outputs, jspec outputs, inputs)``; jspec runs
through :mod:`interop.torch_api` (sglang's signatures) or directly where sglang has no such
function any more (``get_src_tgt_cache_loc``, removed with spec V1).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from interop import compare_meta_ops as meta_ops
from interop import compare_tree_ops as tree_ops
from interop import torch_api as api
from interop.compare_world import (
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
from interop.torch_reference import memory as ref_mem
from interop.torch_reference import spec as ref_spec
from interop.torch_reference.allocator import PagedTokenToKVPoolAllocator as RefAllocator
from interop.torch_reference.allocator import get_last_loc as ref_get_last_loc


def op_assign_req_to_token_pool(w: World, rng: np.random.Generator, impl: str):
    b = w.case.batch
    start = torch.tensor([int(rng.integers(0, a + 1)) for a in w.allocated.tolist()], dtype=I64)
    end = torch.minimum(start + torch.tensor(rng.integers(0, 9, b)), w.allocated)
    total = int((end - start).sum())
    locs = torch.tensor(rng.permutation(num_slots(w))[:total], dtype=I64)
    table = torch.full_like(w.req_to_token, POISON)
    inputs = {
        "req_pool_indices": w.req_pool_indices,
        "start_offset": start,
        "end_offset": end,
        "out_cache_loc": locs,
    }
    outs = []
    for fn, kw in (
        (ref_mem.assign_req_to_token_pool, {}),
        (api.assign_req_to_token_pool, {"impl": impl}),
    ):
        t = table.clone()
        fn(w.req_pool_indices, t, start, end, locs, b, **kw)
        outs.append({"req_to_token": to_numpy(t)})
    return outs[0], outs[1], inputs


def op_get_last_loc(w: World, rng: np.random.Generator, impl: str):
    prefix = torch.tensor([int(rng.integers(0, a + 1)) for a in w.allocated.tolist()], dtype=I64)
    args = (w.req_to_token, w.req_pool_indices, prefix)
    return (
        {"last_loc": to_numpy(ref_get_last_loc(*args))},
        {"last_loc": to_numpy(api.get_last_loc(*args))},
        {"prefix_lens": prefix},
    )


def allocator_script(w: World, rng: np.random.Generator, alloc: Any) -> Outputs:
    """A fixed call sequence (extend, decode, extend, free, free_segment, alloc, group, OOM)."""
    p, t = w.case.page_size, torch.tensor
    lens = w.seq_lens.tolist()
    out: Outputs = {}
    slots = alloc.alloc_extend(
        t([0] * len(lens)), t([0] * len(lens)), t(lens), t(lens), t([-1] * len(lens)), sum(lens)
    )
    rows, cu = [], 0
    for n in lens:
        rows.append(slots[cu : cu + n].tolist())
        cu += n
    out["extend0"] = to_numpy(slots)
    seq = [n + 1 for n in lens]
    dec = alloc.alloc_decode(t(seq), t(seq), t([r[-1] for r in rows]))
    out["decode"] = to_numpy(dec)
    for r, s in zip(rows, dec.tolist()):
        r.append(s)
    extra = [int(rng.integers(0, 2 * p + 2)) for _ in rows]
    pre = [len(r) for r in rows]
    new = [a + e for a, e in zip(pre, extra)]
    slots = alloc.alloc_extend(t(pre), t(pre), t(new), t(new), t([r[-1] for r in rows]), sum(extra))
    out["extend1"] = to_numpy(slots)
    alloc.free(t(rows[0]))
    if len(rows) > 1 and len(rows[1]) > p:
        start = p * int(rng.integers(0, len(rows[1]) // p))
        alloc.free_segment(t(rows[1][start:]), start)
    got = alloc.alloc(2 * p)
    out["alloc"] = to_numpy(got if got is not None else t([-1]))
    alloc.free_group_begin()
    if len(rows) > 2:
        alloc.free(t(rows[2]))
    if got is not None:
        alloc.free_page_ids(got[:1] // p)
    alloc.free_group_end()
    out["extend2"] = to_numpy(
        alloc.alloc_extend(t([0]), t([0]), t([2 * p + 1]), t([2 * p + 1]), t([-1]), 2 * p + 1)
    )
    out["available_size"] = np.asarray([alloc.available_size()])
    out["free_pages"] = to_numpy(alloc.free_pages)
    out["release_pages"] = to_numpy(alloc.release_pages)
    # NOTE: after a failed alloc in need_sort mode sglang keeps the merge it did first, jspec
    # returns the input state unchanged (a documented deviation), so only availability is
    # compared after it.
    out["oom"] = to_numpy(t([-1]) if alloc.alloc((w.num_pages + 1) * p) is None else t([0]))
    out["available_size_after_oom"] = np.asarray([alloc.available_size()])
    return out


def _op_allocator(need_sort: bool):
    def run(w: World, rng: np.random.Generator, impl: str):
        size = w.num_pages * w.case.page_size
        seed = int(rng.integers(1 << 30))
        ref = allocator_script(
            w,
            np.random.default_rng(seed),
            RefAllocator(size, w.case.page_size, need_sort=need_sort),
        )
        got = allocator_script(
            w,
            np.random.default_rng(seed),
            api.PagedTokenToKVPoolAllocator(size, w.case.page_size, need_sort=need_sort, impl=impl),
        )
        return ref, got, {"seq_lens": w.seq_lens}

    return run


def op_move_kv_cache(w: World, rng: np.random.Generator, impl: str):
    n_slots = num_slots(w)
    # a reverse shift (tgt = src + 1, overlapping), random pairs with distinct targets (sources
    # may be other pairs' targets) and two (0 -> 0) padding pairs
    shift_src = torch.arange(4, dtype=I64) + int(rng.integers(1, n_slots - 5))
    free = np.setdiff1d(np.arange(1, n_slots), (shift_src + 1).numpy())
    n = int(rng.integers(1, min(len(free), 24) + 1))
    rand_tgt = torch.tensor(rng.permutation(free)[:n], dtype=I64)
    rand_src = torch.tensor(rng.integers(0, n_slots, n), dtype=I64)
    zeros = torch.zeros(2, dtype=I64)
    tgt = torch.cat([rand_tgt, shift_src + 1, zeros])
    src = torch.cat([rand_src, shift_src, zeros])
    pool = RandomPool(n_slots, w.case.page_size, rng)
    a, b = pool.clone(), pool.clone()
    ref_mem.move_kv_cache(a.k_buffer, a.v_buffer, tgt, src)
    api.move_kv_cache(b.k_buffer, b.v_buffer, tgt, src, impl=impl)
    return a.outputs(), b.outputs(), {"tgt_loc": tgt, "src_loc": src}


def op_prepare_for_draft(w: World, rng: np.random.Generator, impl: str):
    c = w.case
    pool = RandomPool(num_slots(w), c.page_size, rng)
    a, b = pool.clone(), pool.clone()
    args = (w.req_to_token, w.req_pool_indices, w.seq_lens, c.topk, c.num_steps, c.page_size)
    ref = {"out_cache_loc": to_numpy(ref_spec.prepare_for_draft(*args, a)), **a.outputs()}
    got = {"out_cache_loc": to_numpy(api.prepare_for_draft(*args, b, impl=impl)), **b.outputs()}
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
    api.duplicate_prefix_tail_to_draft_branches(b, rows, base, lp, nnp, c.topk, p, impl=impl)
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
    tgt2, src2 = api.move_accept_tokens_to_target_kvcache(b, *args, impl=impl)
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
    j_src, j_tgt, j_free, j_num = accept.get_src_tgt_cache_loc(
        api._j(w.seq_lens, "seq_lens"),
        api._j(locs, "out_cache_loc"),
        api._j(accept_index, "accept_index"),
        api._j(ncd, "accept_length"),
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


_A, _R, _P = (
    "jspec.kv.allocator:alloc_extend",
    "jspec.kv.req_to_token:get_last_loc",
    "jspec.kv.pool:move_kv_cache",
)
REGISTRY: tuple[Op, ...] = (
    Op("allocator", _op_allocator(False), ("xla", "pallas"), (_A,)),
    Op("allocator_need_sort", _op_allocator(True), ("xla",), (_A,)),
    Op(
        "assign_req_to_token_pool",
        op_assign_req_to_token_pool,
        ("xla", "pallas"),
        ("jspec.kv.req_to_token:assign_req_to_token_pool",),
    ),
    Op("get_last_loc", op_get_last_loc, ("xla",), (_R,)),
    Op("move_kv_cache", op_move_kv_cache, ("xla", "pallas", "triton"), (_P,)),
    Op(
        "prepare_for_draft",
        op_prepare_for_draft,
        ("xla", "pallas"),
        ("jspec.tree.layout:draft_out_cache_loc", _P),
    ),
    Op(
        "duplicate_prefix_tail_to_draft_branches",
        op_duplicate_prefix_tail,
        ("xla", "pallas"),
        ("jspec.tree.layout:duplicate_prefix_tail_to_draft_branches", _P),
    ),
    Op(
        "move_accept_tokens_to_target_kvcache",
        op_accept_move,
        ("xla", "pallas"),
        ("jspec.tree.accept:accept_kv_move_pairs", _P),
    ),
    Op(
        "get_src_tgt_cache_loc",
        op_get_src_tgt_cache_loc,
        ("xla",),
        ("jspec.tree.accept:get_src_tgt_cache_loc",),
    ),
    Op(
        "select_top_k_tokens+organize_draft_results",
        tree_ops.op_draft_tree,
        ("xla",),
        ("jspec.tree.select:organize_draft_results",),
    ),
    Op(
        "build_tree_kernel_efficient",
        tree_ops.op_build_tree,
        ("xla", "pallas"),
        ("jspec.tree.build:build_tree_kernel_efficient",),
    ),
    Op(
        "verify_tree_greedy",
        tree_ops.op_verify_tree_greedy,
        ("xla", "pallas"),
        ("jspec.tree.verify:verify_tree_greedy",),
    ),
    Op(
        "tree_speculative_sampling_target_only",
        tree_ops.op_tree_sampling,
        ("xla",),
        ("jspec.tree.sampling:tree_speculative_sampling_target_only",),
    ),
    Op(
        "draft_decode_set_expand_metadata",
        meta_ops.op_expand_metadata,
        ("xla", "pallas", "triton"),
        (
            "jspec.kernels.expand_page_table:expand_page_table",
            "jspec.attention_meta.page_table:draft_decode_set_expand_metadata",
        ),
    ),
    Op(
        "generate_draft_decode_kv_indices",
        meta_ops.op_kv_indices,
        ("xla", "pallas", "triton"),
        ("jspec.attention_meta.kv_indices:generate_draft_decode_kv_indices",),
    ),
    Op(
        "sizing",
        meta_ops.op_sizing,
        ("xla",),
        ("jspec.kv.decode_alloc:page_aligned_decode_alloc_lens",),
    ),
)
