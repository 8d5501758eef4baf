"""Comparison ops for the draft-decode attention metadata and the decode sizing."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from interop import torch_api as api
from interop.compare_world import I32, POISON, World, to_numpy
from interop.torch_reference import attention as ref_attn
from interop.torch_reference import sizing as ref_sizing
from interop.torch_reference import spec as ref_spec


def op_expand_metadata(w: World, rng: np.random.Generator, impl: str):
    c = w.case
    out = ref_spec.prepare_for_draft(
        w.req_to_token, w.req_pool_indices, w.seq_lens, c.topk, c.num_steps, c.page_size
    ).view(-1, c.num_steps)
    lp = (w.seq_lens % c.page_size).to(I32)
    ref, got = {}, {}
    for d in range(1, c.num_steps + 1):
        # cuda-graph path (live columns only, width d+1) every step; the eager path (all S
        # columns, width S) at the first step only: each step is a fresh compile
        variants = [("graph", out[:, :d], d + 1)] + (
            [("eager", out, c.num_steps)] if d == 1 else []
        )
        for tag, loc, width in variants:
            for res, fn, kw in (
                (ref, ref_attn.draft_decode_set_expand_metadata, {}),
                (got, api.draft_decode_set_expand_metadata, {"impl": impl}),
            ):
                seqlens = torch.full((loc.shape[0],), POISON, dtype=I32)
                table = torch.full((loc.shape[0], width), POISON, dtype=I32)
                fn(seqlens, table, lp, d, loc.contiguous(), c.topk, c.page_size, **kw)
                res[f"d{d}.{tag}.cache_seqlens"] = to_numpy(seqlens)
                res[f"d{d}.{tag}.page_table"] = to_numpy(table)
    # jspec's public wrapper (slices the S-wide cache_loc to d itself, zeros past the distinct
    # pages) vs the reference on the sliced cache_loc with a zero-initialised table
    from jspec.attention_meta import page_table as jspec_pt

    seqlens = torch.zeros(out.shape[0], dtype=I32)
    table = torch.zeros(out.shape[0], 2, dtype=I32)
    ref_attn.draft_decode_set_expand_metadata(
        seqlens, table, lp, 1, out[:, :1].contiguous(), c.topk, c.page_size
    )
    j_seqlens, j_table = jspec_pt.draft_decode_set_expand_metadata(
        api._j(lp, "last_page_lens"),
        1,
        api._j(out, "cache_loc"),
        topk=c.topk,
        page_size=c.page_size,
        impl=impl,
    )
    ref.update(
        {"public.d1.cache_seqlens": to_numpy(seqlens), "public.d1.page_table": to_numpy(table)}
    )
    got.update(
        {"public.d1.cache_seqlens": to_numpy(j_seqlens), "public.d1.page_table": to_numpy(j_table)}
    )
    return ref, got, {"last_page_lens": lp, "cache_loc": out}


def op_kv_indices(w: World, rng: np.random.Generator, impl: str):
    c = w.case
    b, k, s = c.batch, c.topk, c.num_steps
    width = b * k * (int(w.seq_lens.max()) + s) + 5
    positions = torch.repeat_interleave(w.seq_lens, k)
    outs = []
    for fn, kw in (
        (ref_attn.generate_draft_decode_kv_indices, {}),
        (api.generate_draft_decode_kv_indices, {"impl": impl}),
    ):
        kv_indices = torch.full((s, width), POISON, dtype=I32)
        kv_indptr = torch.full((s, b * k + 2), POISON, dtype=I32)
        fn(
            w.req_pool_indices,
            w.req_to_token,
            w.seq_lens,
            kv_indices,
            kv_indptr,
            positions,
            w.req_to_token.shape[1],
            width,
            b * k + 2,
            1 << (b - 1).bit_length(),
            1 << s,
            1 << (b * k - 1).bit_length(),
            c.page_size,
            **kw,
        )
        outs.append({"kv_indices": to_numpy(kv_indices), "kv_indptr": to_numpy(kv_indptr)})
    return outs[0], outs[1], {"seq_lens": w.seq_lens, "req_pool_indices": w.req_pool_indices}


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

    reserve = ref_sizing.get_alloc_reserve_per_decode(**kw)
    reqs = [
        Req(int(n), int(a) - int(rng.integers(0, 2)) * int(a))
        for n, a in zip(w.seq_lens, w.allocated)
    ]
    ref_cur, ref_nxt, ref_need = ref_sizing.page_aligned_decode_alloc_lens(
        reqs, reserve, c.page_size
    )
    cur, nxt, need = api.page_aligned_decode_alloc_lens(reqs, reserve, c.page_size)
    ref = {
        "alloc_len": np.asarray([ref_sizing.get_alloc_len_per_decode(**kw)]),
        "cur": to_numpy(ref_cur),
        "nxt": to_numpy(ref_nxt),
        "need": np.asarray([ref_need]),
    }
    got = {
        "alloc_len": np.asarray([api.get_alloc_len_per_decode(**kw)]),
        "cur": to_numpy(cur),
        "nxt": to_numpy(nxt),
        "need": np.asarray([need]),
    }
    return ref, got, {"seq_lens": w.seq_lens}
