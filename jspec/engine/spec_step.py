"""One EAGLE speculative decode step (tree drafting over the paged KV pools), one jitted function.

SPEC.md §2, for a padded bucket of batch slots (``K`` topk, ``S`` steps, ``N`` tree nodes)::

    1 prepare_for_decode        grow rows to ceil_P(L + 2*alloc_len)      kv.decode_alloc
    2 prepare_for_draft         out_cache_loc[B,K,S] (holey for P>1, K>1) tree.layout
                                + prefix-tail duplication (draft pool)
    3 draft loop, i = 0..S-1    select_top_k_tokens; for i < S-1 a draft  tree.select,
                                forward of the B*K branch tokens at L+i,  attention_meta
                                KV -> out_cache_loc[:, :, i]; attention =
                                FA3 cascade (pass A full prefix pages +
                                pass B expand page table, LSE merge) or
                                kv_indices
    4 organize + build tree     tree mask (QLEN_ONLY), positions, links   tree.build
    5 target verify             N nodes at row[L:L+N]: prefix pass over   tree.accept
                                the row + tree-masked pass over the window
    6 verify_tree_greedy        predict, accept_index, accept_lens        tree.verify
    7 accept                    K>1: move accepted target KV to           tree.accept,
                                row[L:L+a]; compact predict/hidden        tree.verify
    8 draft extend              N tokens at L..L+N-1 (compacted predict,
                                target hidden), draft KV -> the window;
                                row a-1 gives next topk_p/index/hidden
    9 commit                    L += accept_len, bonus = last accepted token

The models are seen only through ``jspec.engine.protocol`` (``target``, ``draft`` static,
their params beside them, ``jspec.engine.model_calls``); the draft side (attention passes, phases
3 and 8) is ``jspec.engine.draft_phases``; the phases hand each other the typed
dataclasses of ``jspec.engine.step_types``. The step is one ``jax.jit`` (state donated) per
batch bucket; padding entries are invalid rows
(row 0, slot 0, no allocation). If step 1 finds the pages short, or a live entry names a slot
out of range, twice or not live (``jspec.engine.guards``), every entry becomes padding and the
step changes no state (``ok`` False). Output: :class:`SpecStepOutput`.

Draft vocab and features: the draft's top-K over its own vocab is mapped to target ids at once
(``draft.to_target_ids``), so tree tokens are target ids everywhere. The target forwards of
verify (and prefill) capture ``draft.capture_layers``: the draft's first forward after them
gets that feature (EAGLE-3 aux ``[T, len * H]``; EAGLE-1 the final hidden ``[T, H]``), its
later forwards (the draft loop) its own hidden ``[T, Hd]``.

Losslessness: every emitted token is the target's argmax given the prefix and the accepted
path, i.e. exactly plain greedy decoding; the draft only decides how many are emitted per step.
Given a ``sampling`` batch, phase 6 is the exact sampled tree verification instead
(``jspec.engine.sampling``): the emitted tokens have the law of sampling the processed target
distribution autoregressively, whatever the draft.
In bf16, verify (N queries, prefix + tree passes) and plain decode (1 query) are numerically
different computations of the same logits and may flip a near-tied argmax: test in f32.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jspec._pytree import replace
from jspec.attention_meta.metadata import AttentionMetadata, row_page_table
from jspec.config import ceil_div
from jspec.engine import guards
from jspec.engine.attention import AttnPlan
from jspec.engine.draft_phases import draft_decode_passes, phase_draft, phase_extend
from jspec.engine.model_calls import run_target, target_logits
from jspec.engine.sampling import SamplingBatch, sample_tree
from jspec.engine.state import (
    EngineConfig,
    EngineState,
    check_engine_models,
    gather_req_kv_state,
    gather_slots,
    scatter_slots,
)
from jspec.engine.step_types import (
    AcceptResult,
    DraftPlan,
    DraftResult,
    ExtendResult,
    SpecStepOutput,
    StepBatch,
    StepBuffers,
    VerifyPlan,
    VerifyResult,
)
from jspec.kv.decode_alloc import ReqKVState, commit_kv_lens, prepare_for_decode
from jspec.tree.accept import move_accept_tokens_to_target_kvcache, verify_out_cache_loc
from jspec.tree.build import TreeMaskMode, build_tree_kernel_efficient
from jspec.tree.layout import prepare_for_draft
from jspec.tree.verify import compact_accept_to_front, eagle_sample_greedy, fill_bonus_tokens

# ---- phases ----------------------------------------------------------------------------------
# Every phase is ``phase(ecfg, target, target_params, draft, draft_params, x) -> y`` over the
# typed values of jspec.engine.step_types; bench/e2e.py also jits each one on its own to split
# the step time. PHASES = ((kind, phase), ...) after prepare; kind is "bookkeeping", "draft" or
# "verify".


def phase_prepare(
    ecfg: EngineConfig,
    target: Any,
    params: Any,
    draft: Any,
    draft_params: Any,
    state: EngineState,
    slot_idx: jax.Array,
    live: jax.Array,
) -> DraftPlan:
    """1-2: prepare_for_decode, draft layout + hole duplication, draft attention metadata.

    Args:
      slot_idx: i32[Bb] batch slots (padding entries: any value); live: bool[Bb].
    """
    del target, params, draft, draft_params
    spec = ecfg.spec
    reqs = gather_req_kv_state(state, slot_idx, live)
    allocator, r2t, reqs, ok = prepare_for_decode(
        state.allocator, state.req_to_token, reqs, spec, impl=ecfg.kernels.bookkeeping
    )
    # Pages short (ok False): nothing was allocated; every entry becomes padding (row 0,
    # length 0), so the rest of the step changes no state (a skipped step). Not a lax.cond:
    # a cond keeps the pre-step pools alive for its skip branch, so XLA copied the draft pool
    # (modified below, before the branch) twice per step.
    live = live & ok
    reqs = ReqKVState(
        committed_lens=jnp.where(live, reqs.committed_lens, 0),
        allocated_lens=jnp.where(live, reqs.allocated_lens, 0),
        req_pool_indices=jnp.where(live, reqs.req_pool_indices, 0),
        valid=live,
    )
    seq_lens, rpi = reqs.committed_lens, reqs.req_pool_indices
    dpool, out_cache_loc, positions = prepare_for_draft(
        state.draft_pool,
        r2t,
        rpi,
        seq_lens,
        geometry=spec.geometry,
        valid=live,
        impl=ecfg.kernels.bookkeeping,
    )
    return DraftPlan(
        buffers=StepBuffers(
            allocator=allocator, req_to_token=r2t, target_pool=state.target_pool, draft_pool=dpool
        ),
        batch=StepBatch(slot_idx=slot_idx, live=live, reqs=reqs, ok=ok),
        out_cache_loc=out_cache_loc,
        positions=positions,
        passes=tuple(draft_decode_passes(ecfg, r2t, rpi, seq_lens, out_cache_loc)),
        bonus_tokens=gather_slots(state.bonus_tokens, slot_idx, live),
        topk_p=gather_slots(state.topk_p, slot_idx, live),
        topk_index=gather_slots(state.topk_index, slot_idx, live),
        draft_hidden=gather_slots(state.draft_hidden, slot_idx, live),
    )


def phase_tree(
    ecfg: EngineConfig, target: Any, params: Any, draft: Any, draft_params: Any, res: DraftResult
) -> VerifyPlan:
    """4: build the verify tree (QLEN_ONLY mask) and the verify window row[L : L+N]."""
    del target, params, draft, draft_params
    spec, reqs = ecfg.spec, res.batch.reqs
    tree = build_tree_kernel_efficient(
        res.bonus_tokens,
        res.parent_list,
        res.top_scores_index,
        res.draft_tokens,
        reqs.committed_lens,
        geometry=spec.geometry,
        mode=TreeMaskMode.QLEN_ONLY,
        impl=ecfg.kernels.bookkeeping,
    )
    verify_loc = verify_out_cache_loc(
        res.buffers.req_to_token,
        reqs.req_pool_indices,
        reqs.committed_lens,
        num_draft_tokens=spec.num_draft_tokens,
        valid=res.batch.live,
    )
    return VerifyPlan(buffers=res.buffers, batch=res.batch, tree=tree, verify_loc=verify_loc)


def phase_verify(
    ecfg: EngineConfig, target: Any, params: Any, draft: Any, draft_params: Any, plan: VerifyPlan
) -> VerifyResult:
    """5: the target over the N tree nodes: prefix pass over the row + tree-masked pass."""
    spec, reqs, tree = ecfg.spec, plan.batch.reqs, plan.tree
    batch, n, p = plan.batch.live.shape[0], spec.num_draft_tokens, spec.page_size
    # The prefix pages [0, L) read once for all N tree queries; the N verify slots as the tail
    # with the tree's ancestor mask.
    meta = AttentionMetadata(
        page_table=row_page_table(
            plan.buffers.req_to_token,
            reqs.req_pool_indices,
            page_size=p,
            max_pages=ceil_div(spec.context_len, p),
        ),
        kv_lens=reqs.committed_lens,
        tail_slot_ids=plan.verify_loc.reshape(batch, n),
        tail_mask=tree.tree_mask,
        page_size=p,
    )
    attn = AttnPlan(write_slot_ids=plan.verify_loc, passes=(meta,))
    tpool, hidden, feature = run_target(
        ecfg,
        target,
        params,
        plan.buffers.target_pool,
        tree.draft_tokens,
        tree.positions,
        attn,
        draft,
        draft_params,
    )
    return VerifyResult(
        buffers=replace(plan.buffers, target_pool=tpool),
        batch=plan.batch,
        tree=tree,
        verify_loc=plan.verify_loc,
        target_feature=feature,
        logits=target_logits(target, params, hidden),
    )


def phase_accept(
    ecfg: EngineConfig,
    target: Any,
    params: Any,
    draft: Any,
    draft_params: Any,
    res: VerifyResult,
    sampling: SamplingBatch | None = None,
) -> AcceptResult:
    """6-7: tree verification (greedy, or sampled given ``sampling``:
    ``jspec.engine.sampling.sample_tree``); K>1: move accepted target KV, compact to the front."""
    del target, params, draft, draft_params
    spec, reqs, tree, live = ecfg.spec, res.batch.reqs, res.tree, res.batch.live
    k, s, n = spec.topk, spec.num_steps, spec.num_draft_tokens
    batch = live.shape[0]
    # accept_index width: the deepest possible path + 1 (S+1 unless the tree is shallower).
    if sampling is not None:
        predict, accept_lens, accept_index = sample_tree(
            res.logits,
            tree,
            reqs.committed_lens,
            sampling,
            num_spec_steps=min(s, n - 1) + 1,
            tp_axis=ecfg.tp_axis,
        )
    else:
        predict, accept_lens, accept_index = eagle_sample_greedy(
            res.logits,
            tree.draft_tokens.reshape(batch, n),
            tree.retrive_index,
            tree.retrive_next_token,
            tree.retrive_next_sibling,
            num_spec_steps=min(s, n - 1) + 1,
            impl=ecfg.kernels.bookkeeping,
        )
    accept_lens = jnp.where(live, accept_lens, 0).astype(jnp.int32)
    accept_tokens = jnp.where(accept_index >= 0, predict[jnp.maximum(accept_index, 0)], 0)
    accept_tokens = jnp.where(live[:, None], accept_tokens, 0).astype(jnp.int32)
    tpool, feature = res.buffers.target_pool, res.target_feature
    if k > 1:  # for K == 1 the accepted chain already sits at the front (as sglang)
        tpool = move_accept_tokens_to_target_kvcache(
            tpool,
            res.buffers.req_to_token,
            reqs.req_pool_indices,
            reqs.committed_lens,
            res.verify_loc,
            accept_index,
            accept_lens,
            valid=live,
        )
        predict, feature = compact_accept_to_front(
            predict, feature, accept_index, num_draft_tokens=n
        )
    return AcceptResult(
        buffers=replace(res.buffers, target_pool=tpool),
        batch=res.batch,
        verify_loc=res.verify_loc,
        predict=predict,
        target_feature=feature,
        accept_lens=accept_lens,
        accept_tokens=accept_tokens,
        new_bonus=fill_bonus_tokens(accept_tokens, jnp.maximum(accept_lens, 1)),
    )


def phase_commit(
    ecfg: EngineConfig, state: EngineState, res: ExtendResult
) -> tuple[EngineState, SpecStepOutput]:
    """9: L += accept_len; write the bucket rows back to their batch slots."""
    del ecfg
    slot_idx, live = res.batch.slot_idx, res.batch.live
    new_reqs = commit_kv_lens(res.batch.reqs, res.accept_lens)

    def put(x, v):
        return scatter_slots(x, slot_idx, live, v)

    buffers = res.buffers
    state = replace(
        state,
        allocator=buffers.allocator,
        req_to_token=buffers.req_to_token,
        target_pool=buffers.target_pool,
        draft_pool=buffers.draft_pool,
        committed_lens=put(state.committed_lens, new_reqs.committed_lens),
        allocated_lens=put(state.allocated_lens, new_reqs.allocated_lens),
        bonus_tokens=put(state.bonus_tokens, res.new_bonus),
        topk_p=put(state.topk_p, res.next_p),
        topk_index=put(state.topk_index, res.next_index),
        draft_hidden=put(state.draft_hidden, res.next_hidden),
    )
    return state, SpecStepOutput(
        accept_tokens=res.accept_tokens, accept_lens=res.accept_lens, ok=res.batch.ok
    )


# Phases after prepare, in order, with the time class bench/e2e.py reports them under.
PHASES = (
    ("draft", phase_draft),
    ("bookkeeping", phase_tree),
    ("verify", phase_verify),
    ("bookkeeping", phase_accept),
    ("draft", phase_extend),
)


def spec_step_body(
    ecfg: EngineConfig,
    target: Any,
    params: Any,
    draft: Any,
    draft_params: Any,
    state: EngineState,
    slot_idx: jax.Array,
    live: jax.Array,
    sampling: SamplingBatch | None = None,
) -> tuple[EngineState, SpecStepOutput]:
    """The unjitted step (what :func:`spec_decode_step` jits and the sharded engine maps)."""
    check_engine_models(ecfg, target, draft)
    ok_in = guards.validate_step_slots(state, slot_idx, live, "spec_decode_step")
    x = phase_prepare(ecfg, target, params, draft, draft_params, state, slot_idx, live & ok_in)
    x = replace(x, batch=replace(x.batch, ok=x.batch.ok & ok_in))  # bad slots: a skipped step
    for _, phase in PHASES:
        if phase is phase_accept and sampling is not None:
            phase = functools.partial(phase_accept, sampling=sampling)
        x = phase(ecfg, target, params, draft, draft_params, x)
        guards.probe_verify_logits(x)  # with probes on: NaN target logits of live rows
    return phase_commit(ecfg, state, x)


@functools.partial(jax.jit, static_argnames=("ecfg", "target", "draft"), donate_argnames=("state",))
def spec_decode_step(
    ecfg: EngineConfig,
    target: Any,
    params: Any,
    draft: Any,
    draft_params: Any,
    state: EngineState,
    slot_idx: jax.Array,
    live: jax.Array,
    sampling: SamplingBatch | None = None,
) -> tuple[EngineState, SpecStepOutput]:
    """One speculative decode step over a padded bucket of one shard (module docstring).

    Args:
      ecfg: static engine config (``make_engine_config(target, ...)``).
      target, draft: static models (``jspec.engine.protocol``); params, draft_params: their
        weights.
      state: engine state (donated), from ``init_engine_state(ecfg, draft)`` and prefill.
      slot_idx: i32[Bb] batch slots (padding entries: any value); live: bool[Bb].
      sampling: None (greedy: every token the target's argmax) or the entries' sampling
        parameters (:class:`jspec.engine.sampling.SamplingBatch`, rows as ``slot_idx``):
        exact sampled tree verification (:mod:`jspec.tree.sampling`).

    Returns:
      (state, :class:`SpecStepOutput`).
    """
    return spec_step_body(
        ecfg, target, params, draft, draft_params, state, slot_idx, live, sampling
    )
