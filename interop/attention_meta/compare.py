"""Comparison ops for the draft-decode attention metadata: reference vs drop-in."""

from __future__ import annotations

import functools

import numpy as np
import torch

from interop._adapt import run_jspec, tree_geometry
from interop._adapt import to_jax_default as _j
from interop._world import I32, POISON, Op, World, to_numpy
from interop.attention_meta import dropin as api
from interop.attention_meta import reference as ref_attn
from interop.tree import reference_layout as ref_spec


def op_expand_metadata(w: World, rng: np.random.Generator, impl: str):
    c = w.case
    out = ref_spec.prepare_for_draft(
        w.req_to_token, w.req_pool_indices, w.seq_lens, c.topk, c.num_steps, c.page_size
    ).view(-1, c.num_steps)
    lp = (w.seq_lens % c.page_size).to(I32)
    ref: dict[str, np.ndarray] = {}
    got: dict[str, np.ndarray] = {}
    for d in range(1, c.num_steps + 1):
        # cuda-graph path (live columns only, width d+1) every step; the eager path (all S
        # columns, width S) at the first step only: each step is a fresh compile
        variants = [("graph", out[:, :d], d + 1)] + (
            [("eager", out, c.num_steps)] if d == 1 else []
        )
        for tag, loc, width in variants:
            for res, fn in (
                (ref, ref_attn.draft_decode_set_expand_metadata),
                (got, functools.partial(api.draft_decode_set_expand_metadata, impl=impl)),
            ):
                seqlens = torch.full((loc.shape[0],), POISON, dtype=I32)
                table = torch.full((loc.shape[0], width), POISON, dtype=I32)
                fn(seqlens, table, lp, d, loc.contiguous(), c.topk, c.page_size)
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
    j_seqlens, j_table = run_jspec(
        jspec_pt.draft_decode_set_expand_metadata,
        _j(lp, "last_page_lens"),
        1,
        _j(out, "cache_loc"),
        geometry=tree_geometry(topk=c.topk, page_size=c.page_size),
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
    for fn in (
        ref_attn.generate_draft_decode_kv_indices,
        functools.partial(api.generate_draft_decode_kv_indices, impl=impl),
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
        )
        outs.append({"kv_indices": to_numpy(kv_indices), "kv_indptr": to_numpy(kv_indptr)})
    return outs[0], outs[1], {"seq_lens": w.seq_lens, "req_pool_indices": w.req_pool_indices}


OPS: tuple[Op, ...] = (
    Op(
        "draft_decode_set_expand_metadata",
        op_expand_metadata,
        ("xla", "pallas", "triton"),
        ("jspec.attention_meta.page_table:draft_decode_set_expand_metadata",),
        ref_attn.draft_decode_set_expand_metadata,
        api.draft_decode_set_expand_metadata,
    ),
    Op(
        "generate_draft_decode_kv_indices",
        op_kv_indices,
        ("xla", "pallas", "triton"),
        ("jspec.attention_meta.kv_indices:generate_draft_decode_kv_indices",),
        ref_attn.generate_draft_decode_kv_indices,
        api.generate_draft_decode_kv_indices,
    ),
)
