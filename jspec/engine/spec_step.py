"""One EAGLE speculative decode step (tree drafting over a KV backend), one jitted function.

SPEC.md §2, for a padded bucket of batch slots (``K`` topk, ``S`` steps, ``N`` tree nodes)::

    1 prepare_decode            back row[0 : L + reserve] (jspec's: grow  KV backend
                                rows to ceil_P(L + 2*alloc_len))          (kv.decode_alloc)
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
    9 commit                    L += accept_len (KV backend); the carry:  SpecCarry
                                bonus = last accepted token, next level

The step is ``spec_decode_step(runner, weights, state, slot_idx, live)``: the static
:class:`jspec.engine.runner.Runner` (config, models, KV backend) and the :class:`Weights`
pytree. The models are seen only through ``jspec.engine.protocol`` (``jspec.engine.model_calls``),
the KV memory only through the runner's KV backend (``jspec.engine.kv_backend``: step 1 and
the lengths of step 9; steps 2, 5, 7 and 8 read its :class:`KVView`); the draft side
(attention passes, phases 3 and 8) is ``jspec.engine.draft_phases``; the phases hand each
other the typed dataclasses of ``jspec.engine.step_types``. The step is one ``jax.jit`` (state
donated) per batch bucket; padding entries are invalid rows (row 0, slot 0, no allocation). If step 1 finds the pages short, or a live entry names a slot
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

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jspec._pytree import replace
from jspec.engine import guards
from jspec.engine.attention import AttnPlan
from jspec.engine.draft_phases import (
    draft_decode_passes,
    phase_draft,
    phase_extend,
    window_metadata,
)
from jspec.engine.kv_backend import KVBackend
from jspec.engine.model_calls import require_draft, run_target, target_logits
from jspec.engine.runner import Runner, Weights, jit_step
from jspec.engine.sampling import SamplingBatch, sample_tree
from jspec.engine.state import EngineConfig, EngineState, commit_carry, gather_slots
from jspec.engine.step_types import (
    AcceptResult,
    DraftPlan,
    DraftResult,
    ExtendResult,
    SpecStepOutput,
    StepBatch,
    VerifyPlan,
    VerifyResult,
)
from jspec.tree.accept import move_accept_tokens_to_target_kvcache, verify_out_cache_loc
from jspec.tree.build import TreeMaskMode, build_tree_kernel_efficient
from jspec.tree.layout import prepare_for_draft
from jspec.tree.verify import compact_accept_to_front, eagle_sample_greedy, fill_bonus_tokens

# ---- phases ----------------------------------------------------------------------------------
# Each phase takes what it uses: the config (bookkeeping), or the runner and weights (model
# phases), and the previous phase's typed value (jspec.engine.step_types). PHASES lists the
# phases after prepare with their time class ("bookkeeping", "draft" or "verify"); call_phase
# runs one (bench/e2e.py jits each on its own to split the step time).


def phase_prepare(
    ecfg: EngineConfig,
    kv_backend: KVBackend,
    state: EngineState,
    slot_idx: jax.Array,
    live: jax.Array,
    max_kv_len: int | None = None,
) -> DraftPlan:
    """1-2: prepare_decode (the KV backend), draft layout + hole duplication, draft attention
    metadata.

    Args:
      slot_idx: i32[Bb] batch slots (padding entries: any value); live: bool[Bb].
      max_kv_len: the draft passes' launch hint (``Runner.max_kv_len``).
    """
    spec = ecfg.spec
    # Pages short (ok False): nothing was allocated; every entry becomes padding (row 0,
    # length 0), so the rest of the step changes no state (a skipped step). Not a lax.cond:
    # a cond keeps the pre-step pools alive for its skip branch, so XLA copied the draft pool
    # (modified below, before the branch) twice per step.
    kv, view, ok = kv_backend.prepare_decode(
        state.kv, slot_idx, live, num_tokens=spec.alloc_reserve_per_decode
    )
    live = view.valid
    dpool, out_cache_loc, positions = prepare_for_draft(
        kv.draft_pool,
        view.token_table,
        view.rows,
        view.seq_lens,
        geometry=spec.geometry,
        valid=live,
        impl=ecfg.kernels.bookkeeping,
    )
    carry = state.carry
    return DraftPlan(
        kv=replace(kv, draft_pool=dpool),
        batch=StepBatch(slot_idx=slot_idx, live=live, view=view, ok=ok),
        out_cache_loc=out_cache_loc,
        positions=positions,
        passes=tuple(draft_decode_passes(ecfg, view, out_cache_loc, max_kv_len)),
        bonus_tokens=gather_slots(carry.bonus_tokens, slot_idx, live),
        topk_p=gather_slots(carry.topk_p, slot_idx, live),
        topk_index=gather_slots(carry.topk_index, slot_idx, live),
        draft_hidden=gather_slots(carry.draft_hidden, slot_idx, live),
    )


def phase_tree(ecfg: EngineConfig, res: DraftResult) -> VerifyPlan:
    """4: build the verify tree (QLEN_ONLY mask) and the verify window row[L : L+N]."""
    spec, view = ecfg.spec, res.batch.view
    tree = build_tree_kernel_efficient(
        res.bonus_tokens,
        res.parent_list,
        res.top_scores_index,
        res.draft_tokens,
        view.seq_lens,
        geometry=spec.geometry,
        mode=TreeMaskMode.QLEN_ONLY,
        impl=ecfg.kernels.bookkeeping,
    )
    verify_loc = verify_out_cache_loc(
        view.token_table,
        view.rows,
        view.seq_lens,
        num_draft_tokens=spec.num_draft_tokens,
        valid=res.batch.live,
    )
    return VerifyPlan(kv=res.kv, batch=res.batch, tree=tree, verify_loc=verify_loc)


def phase_verify(runner: Runner, weights: Weights, plan: VerifyPlan) -> VerifyResult:
    """5: the target over the N tree nodes: prefix pass over the row + tree-masked pass."""
    batch, n = plan.batch.live.shape[0], runner.ecfg.spec.num_draft_tokens
    tree = plan.tree
    meta = window_metadata(
        runner, plan.batch.view, plan.verify_loc.reshape(batch, n), tree.tree_mask
    )
    attn = AttnPlan(write_slot_ids=plan.verify_loc, passes=(meta,))
    tpool, hidden, feature = run_target(
        runner, weights, plan.kv.target_pool, tree.draft_tokens, tree.positions, attn
    )
    return VerifyResult(
        kv=replace(plan.kv, target_pool=tpool),
        batch=plan.batch,
        tree=tree,
        verify_loc=plan.verify_loc,
        target_feature=feature,
        logits=target_logits(runner, weights, hidden),
    )


def phase_accept(
    ecfg: EngineConfig, res: VerifyResult, sampling: SamplingBatch | None = None
) -> AcceptResult:
    """6-7: tree verification (greedy, or sampled given ``sampling``:
    ``jspec.engine.sampling.sample_tree``); K>1: move accepted target KV, compact to the front."""
    spec, view, tree, live = ecfg.spec, res.batch.view, res.tree, res.batch.live
    k, s, n = spec.topk, spec.num_steps, spec.num_draft_tokens
    batch = live.shape[0]
    # accept_index width: the deepest possible path + 1 (S+1 unless the tree is shallower).
    if sampling is not None:
        predict, accept_lens, accept_index = sample_tree(
            res.logits,
            tree,
            view.seq_lens,
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
    tpool, feature = res.kv.target_pool, res.target_feature
    if k > 1:  # for K == 1 the accepted chain already sits at the front (as sglang)
        tpool = move_accept_tokens_to_target_kvcache(
            tpool,
            view.token_table,
            view.rows,
            view.seq_lens,
            res.verify_loc,
            accept_index,
            accept_lens,
            valid=live,
            impl=ecfg.kernels.bookkeeping,
        )
        predict, compacted = compact_accept_to_front(
            predict, feature, accept_index, num_draft_tokens=n
        )
        assert compacted is not None  # a hidden in gives a hidden out
        feature = compacted
    return AcceptResult(
        kv=replace(res.kv, target_pool=tpool),
        batch=res.batch,
        verify_loc=res.verify_loc,
        predict=predict,
        target_feature=feature,
        accept_lens=accept_lens,
        accept_tokens=accept_tokens,
        new_bonus=fill_bonus_tokens(accept_tokens, jnp.maximum(accept_lens, 1)),
    )


def phase_commit(
    kv_backend: KVBackend, state: EngineState, res: ExtendResult
) -> tuple[EngineState, SpecStepOutput]:
    """9: L += accept_len (the KV backend); the carry written back to the batch slots."""
    batch = res.batch
    live = batch.live
    kv = kv_backend.commit(
        res.kv, batch.slot_idx, live, batch.view.seq_lens + res.accept_lens, live
    )
    carry = commit_carry(
        state.carry, batch.slot_idx, live, res.new_bonus, res.next_p, res.next_index,
        res.next_hidden,
    )  # fmt: skip
    return EngineState(kv=kv, carry=carry), SpecStepOutput(
        accept_tokens=res.accept_tokens, accept_lens=res.accept_lens, ok=batch.ok
    )


# Phases after prepare, in order, with the time class bench/e2e.py reports them under.
PHASES: tuple[tuple[str, Callable], ...] = (
    ("draft", phase_draft),
    ("bookkeeping", phase_tree),
    ("verify", phase_verify),
    ("bookkeeping", phase_accept),
    ("draft", phase_extend),
)


def call_phase(kind: str, phase: Callable, runner: Runner, weights: Weights, x, sampling=None):
    """One phase of :data:`PHASES`: bookkeeping phases get the config, the others the runner
    and weights (``sampling`` goes to the accept phase)."""
    if kind != "bookkeeping":
        return phase(runner, weights, x)
    if phase is phase_accept:
        return phase(runner.ecfg, x, sampling)
    return phase(runner.ecfg, x)


def spec_step_body(
    runner: Runner,
    weights: Weights,
    state: EngineState,
    slot_idx: jax.Array,
    live: jax.Array,
    sampling: SamplingBatch | None = None,
) -> tuple[EngineState, SpecStepOutput]:
    """One speculative decode step over a padded bucket of one shard (module docstring).

    Args:
      runner: static config, target, draft and KV backend (``Runner(ecfg, target, draft)``).
      weights: ``Weights(target_params, draft_params)``.
      state: engine state (donated), from ``init_engine_state(runner)`` and prefill.
      slot_idx: i32[Bb] batch slots (padding entries: any value); live: bool[Bb].
      sampling: None (greedy: every token the target's argmax) or the entries' sampling
        parameters (:class:`jspec.engine.sampling.SamplingBatch`, rows as ``slot_idx``):
        exact sampled tree verification (:mod:`jspec.tree.sampling`).

    Returns:
      (state, :class:`SpecStepOutput`).

    Raises:
      ValueError when ``runner.draft`` is None (a plain runner steps with ``greedy_step``).
    """
    require_draft(runner, "spec_decode_step")
    status = runner.kv.slot_status(state.kv)
    ok_in = guards.validate_step_slots(status, slot_idx, live, "spec_decode_step")
    plan = phase_prepare(runner.ecfg, runner.kv, state, slot_idx, live & ok_in, runner.max_kv_len)
    plan = replace(plan, batch=replace(plan.batch, ok=plan.batch.ok & ok_in))  # bad slots: skipped
    x: Any = plan  # each phase hands the next its own step_types value, DraftPlan to ExtendResult
    for kind, phase in PHASES:
        x = call_phase(kind, phase, runner, weights, x, sampling)
        guards.probe_verify_logits(x)  # with probes on: NaN target logits of live rows
    return phase_commit(runner.kv, state, x)


# The public call: the body jitted (runner static, state donated); the engines map the body.
spec_decode_step = jit_step(spec_step_body)
