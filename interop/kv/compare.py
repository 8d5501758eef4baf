"""Comparison ops for the KV bookkeeping: allocator, req_to_token, KV moves, decode sizing.

Each op is ``(world, rng, impl) -> (reference outputs, jspec outputs, inputs)``: the torch
reference (:mod:`interop.kv.reference`, :mod:`interop.kv.reference_allocator`) against the
drop-in (:mod:`interop.kv.dropin`, jspec behind sglang's signatures).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from interop._world import I64, POISON, Op, Outputs, RandomPool, World, num_slots, to_numpy
from interop.kv import dropin as api
from interop.kv import reference as ref_mem
from interop.kv import reference_allocator as ref_alloc


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
        (ref_mem.assign_req_to_token_pool_func, {}),
        (api.assign_req_to_token_pool_func, {"impl": impl}),
    ):
        t = table.clone()
        fn(w.req_pool_indices, t, start, end, locs, b, **kw)
        outs.append({"req_to_token": to_numpy(t)})
    return outs[0], outs[1], inputs


def op_get_last_loc(w: World, rng: np.random.Generator, impl: str):
    prefix = torch.tensor([int(rng.integers(0, a + 1)) for a in w.allocated.tolist()], dtype=I64)
    args = (w.req_to_token, w.req_pool_indices, prefix)
    return (
        {"last_loc": to_numpy(ref_alloc.get_last_loc(*args))},
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
        alloc.free_segment(t(rows[1][start:]), start_pos=start)
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
            ref_alloc.PagedTokenToKVPoolAllocator(
                size, w.case.page_size, torch.float32, "cpu", None, need_sort
            ),
        )
        got = allocator_script(
            w,
            np.random.default_rng(seed),
            api.PagedTokenToKVPoolAllocator(
                size, w.case.page_size, torch.float32, "cpu", None, need_sort, impl=impl
            ),
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


def op_sizing(w: World, rng: np.random.Generator, impl: str):
    c = w.case
    kw = {
        "page_size": c.page_size,
        "topk": c.topk,
        "num_steps": c.num_steps,
        "num_draft_tokens": c.num_draft_tokens,
    }

    @dataclasses.dataclass
    class Req:
        kv_committed_len: int
        kv_allocated_len: int

    reserve = ref_mem.get_alloc_reserve_per_decode(**kw)
    reqs = [
        Req(int(n), int(a) - int(rng.integers(0, 2)) * int(a))
        for n, a in zip(w.seq_lens, w.allocated)
    ]

    def sizing(mod: Any) -> Outputs:
        """One side's decode sizing: the reference module or the drop-in, same calls."""
        cur, nxt, need = mod.page_aligned_decode_alloc_lens(
            reqs, reserve=reserve, page_size=c.page_size
        )
        return {
            "alloc_len": np.asarray([mod.get_alloc_len_per_decode(**kw)]),
            "cur": to_numpy(cur),
            "nxt": to_numpy(nxt),
            "need": np.asarray([need]),
        }

    return sizing(ref_mem), sizing(api), {"seq_lens": w.seq_lens}


_A, _R, _P = (
    "jspec.kv.allocator:alloc_extend",
    "jspec.kv.req_to_token:get_last_loc",
    "jspec.kv.pool:move_kv_cache",
)
OPS: tuple[Op, ...] = (
    Op(
        "PagedTokenToKVPoolAllocator",
        _op_allocator(False),
        ("xla", "pallas"),
        (_A,),
        ref_alloc.PagedTokenToKVPoolAllocator,
        api.PagedTokenToKVPoolAllocator,
    ),
    Op(
        "PagedTokenToKVPoolAllocator(need_sort)",
        _op_allocator(True),
        ("xla",),
        (_A,),
        ref_alloc.PagedTokenToKVPoolAllocator,
        api.PagedTokenToKVPoolAllocator,
    ),
    Op(
        "assign_req_to_token_pool_func",
        op_assign_req_to_token_pool,
        ("xla", "pallas"),
        ("jspec.kv.req_to_token:assign_req_to_token_pool",),
        ref_mem.assign_req_to_token_pool_func,
        api.assign_req_to_token_pool_func,
    ),
    Op("get_last_loc", op_get_last_loc, ("xla",), (_R,), ref_alloc.get_last_loc, api.get_last_loc),
    Op(
        "move_kv_cache",
        op_move_kv_cache,
        ("xla", "pallas", "triton"),
        (_P,),
        ref_mem.move_kv_cache,
        api.move_kv_cache,
    ),
    Op(
        "page_aligned_decode_alloc_lens",
        op_sizing,
        ("xla",),
        ("jspec.config:SpecConfig",),
        ref_mem.page_aligned_decode_alloc_lens,
        api.page_aligned_decode_alloc_lens,
    ),
)
