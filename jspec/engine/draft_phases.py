"""The draft side of the EAGLE spec step (:mod:`jspec.engine.spec_step`): the draft attention
passes of the draft loop, the draft loop itself (phase 3) and the draft extend (phase 8).

Draft attention (SPEC §5-6), per draft step ``0 .. S-2`` over the ``B*K`` branch queries:
``cascade`` (FA3: a full-prefix-pages pass + an expanded-page-table pass, LSE merged) or
``kv_indices`` (FlashInfer: one pass per branch over its kv_indices segment).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec._pytree import replace
from jspec.attention_meta.metadata import AttentionMetadata, causal_tail_mask
from jspec.config import ceil_div
from jspec.engine.attention import AttnPlan
from jspec.engine.kv_backend import KVView, row_metadata
from jspec.engine.model_calls import draft_topk, run_draft
from jspec.engine.runner import Runner, Weights
from jspec.engine.state import EngineConfig
from jspec.engine.step_types import AcceptResult, DraftPlan, DraftResult, ExtendResult
from jspec.tree.select import organize_draft_results, select_top_k_tokens


def draft_decode_passes(
    ecfg: EngineConfig, view: KVView, out_cache_loc: jax.Array, max_kv_len: int | None = None
) -> list[tuple]:
    """Attention passes of draft steps ``0 .. S-2`` for the B*K branch queries (``max_kv_len``:
    pass A's launch hint, :attr:`jspec.engine.runner.Runner.max_kv_len`).

    ``cascade`` (FA3, SPEC §5): pass A reads the full prefix pages ``[0, L - L%P)`` through
    ``draft_decode_normal_metadata`` (K queries per request, non-causal); pass B reads
    ``lp + d`` tokens of each branch through the ``draft_decode_set_expand_metadata`` page
    table (``d = step + 1``: the prefix tail / holes, then this branch's draft tokens). Both
    come from one ``draft_decode_metadata`` call and are read as they are: a page table and
    lengths. ``kv_indices`` (FlashInfer, SPEC §6): one pass per branch over its segment
    ``kv_indices[step, indptr[z] : indptr[z+1]]`` (the prefix, then the branch's own draft slots
    0..step), read as a page table of page size 1 (FlashInfer's token-level indices).

    Returns:
      ``passes[step]``: a tuple of :class:`jspec.attention_meta.AttentionMetadata`.
    """
    spec = ecfg.spec
    k, p, s = spec.topk, spec.page_size, spec.num_steps
    req_to_token, req_pool_indices, seq_lens = view.token_table, view.rows, view.seq_lens
    batch = seq_lens.shape[0]
    if s == 1:
        return []
    if ecfg.draft_attention == "kv_indices":
        from jspec.attention_meta.kv_indices import generate_draft_decode_kv_indices

        width = spec.context_len + s
        kv_indices, kv_indptr = generate_draft_decode_kv_indices(
            req_pool_indices,
            req_to_token,
            seq_lens,
            geometry=spec.geometry,
            kv_indices_width=batch * k * width,
            impl=ecfg.kernels.bookkeeping,
        )
        cols = jnp.arange(width, dtype=jnp.int32)
        passes = []
        for step in range(s - 1):
            start = kv_indptr[step, :-1]
            seg_len = kv_indptr[step, 1:] - start  # L_b + step + 1
            idx = jnp.clip(start[:, None] + cols[None, :], 0, kv_indices.shape[1] - 1)
            passes.append(
                (AttentionMetadata(page_table=kv_indices[step][idx], kv_lens=seg_len, page_size=1),)
            )
        return passes
    from jspec.attention_meta.page_table import draft_decode_metadata

    meta = draft_decode_metadata(
        req_to_token,
        req_pool_indices,
        seq_lens,
        out_cache_loc,
        geometry=spec.geometry,
        max_pages=ceil_div(spec.context_len, p),
        impl=ecfg.kernels.bookkeeping,
    )
    normal, expand = meta.normal, meta.expand
    pass_a = AttentionMetadata(
        page_table=normal.page_table,
        kv_lens=normal.cache_seqlens,
        page_size=p,
        max_kv_len=max_kv_len,
    )
    return [
        (
            pass_a,
            AttentionMetadata(
                page_table=expand.page_table[step],  # i32[B*K, S] page ids
                kv_lens=expand.cache_seqlens[step],
                page_size=p,
            ),
        )
        for step in range(s - 1)
    ]


def window_metadata(
    runner: Runner, view: KVView, window_slots: jax.Array, mask: jax.Array
) -> AttentionMetadata:
    """One pass over an N-token window at ``row[L : L+N]`` (target verify, draft extend): the
    prefix pages ``[0, L)`` read once for all N queries, the window slots i32[Bb, N] as the tail
    with ``mask`` bool[Bb, N, N] (the tree's ancestors, or causal)."""
    return row_metadata(
        runner.ecfg.spec,
        view,
        view.seq_lens,
        tail_slot_ids=window_slots,
        tail_mask=mask,
        max_kv_len=runner.max_kv_len,
    )


def phase_draft(runner: Runner, weights: Weights, plan: DraftPlan) -> DraftResult:
    """3: S selections and S-1 draft forwards of width B*K, then organize_draft_results."""
    spec = runner.ecfg.spec
    k, s, n = spec.topk, spec.num_steps, spec.num_draft_tokens
    batch = plan.batch.live.shape[0]
    cache_loc = plan.out_cache_loc.reshape(batch * k, s)
    topk_p, topk_index, hidden = plan.topk_p, plan.topk_index, plan.draft_hidden
    dpool = plan.kv.draft_pool
    score_list, token_list, parents_list = [], [], []
    scores = None
    for i in range(s):
        input_ids, hidden, scores, (sc, tok, par) = select_top_k_tokens(
            i, topk_p, topk_index, hidden, scores, topk=k, vocab_size=runner.target.vocab_size
        )
        score_list.append(sc)
        token_list.append(tok)
        parents_list.append(par)
        if i == s - 1:
            break  # the last step's tokens are leaves: no forward
        attn = AttnPlan(write_slot_ids=cache_loc[:, i], passes=plan.passes[i])
        dpool, hidden = run_draft(
            runner, weights, dpool, input_ids, hidden, plan.positions + i, attn
        )
        topk_p, topk_index = draft_topk(runner, weights, hidden)
    parent_list, top_scores_index, draft_tokens = organize_draft_results(
        score_list, token_list, parents_list, num_draft_tokens=n
    )
    return DraftResult(
        kv=replace(plan.kv, draft_pool=dpool),
        batch=plan.batch,
        bonus_tokens=plan.bonus_tokens,
        parent_list=parent_list,
        top_scores_index=top_scores_index,
        draft_tokens=draft_tokens,
    )


def phase_extend(runner: Runner, weights: Weights, res: AcceptResult) -> ExtendResult:
    """8: draft extend of the N window tokens on the target feature; row accept_len-1 seeds
    the next step's first tree level."""
    view = res.batch.view
    n = runner.ecfg.spec.num_draft_tokens
    batch = res.batch.live.shape[0]
    ext_pos = (view.seq_lens[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]).reshape(-1)
    meta = window_metadata(
        runner, view, res.verify_loc.reshape(batch, n), causal_tail_mask(batch, n)
    )
    attn = AttnPlan(write_slot_ids=res.verify_loc, passes=(meta,))
    dpool, ext_hidden = run_draft(
        runner, weights, res.kv.draft_pool, res.predict, res.target_feature, ext_pos, attn
    )
    select = jnp.arange(batch) * n + jnp.maximum(res.accept_lens, 1) - 1
    next_hidden = ext_hidden[select]
    next_p, next_index = draft_topk(runner, weights, next_hidden)
    return ExtendResult(
        kv=replace(res.kv, draft_pool=dpool),
        batch=res.batch,
        accept_lens=res.accept_lens,
        accept_tokens=res.accept_tokens,
        new_bonus=res.new_bonus,
        next_p=next_p,
        next_index=next_index,
        next_hidden=next_hidden,
    )
