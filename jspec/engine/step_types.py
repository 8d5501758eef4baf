"""Typed values handed between the phases of a decode step, and the steps' outputs.

A speculative step (``jspec.engine.spec_step``) is a chain of pure phases, each taking the
previous phase's dataclass and returning its own::

    phase_prepare(kv)     -> DraftPlan      1-2  pages, draft layout, draft attention passes
    phase_draft           -> DraftResult    3    draft loop, organize_draft_results
    phase_tree            -> VerifyPlan     4    verify tree + verify window slots
    phase_verify          -> VerifyResult   5    target forward over the tree
    phase_accept          -> AcceptResult   6-7  greedy verify, accepted-KV move, compaction
    phase_extend          -> ExtendResult   8    draft extend, next first tree level
    phase_commit(state, ExtendResult) -> EngineState, SpecStepOutput   9  lengths, carry

Shapes: ``Bb`` the batch bucket, ``K`` topk, ``S`` num_steps, ``N`` num_draft_tokens,
``H`` the target hidden size, ``Hd`` the draft's (the target feature reaches the phases already
combined by ``draft.combine_hidden_states``), ``V`` the target vocab,
``M`` max_running_requests, ``R`` the token table's row width. Padding entries of the bucket
are invalid rows (row 0, length 0, slot 0).
"""

from __future__ import annotations

from typing import Any

import jax

from jspec._pytree import pytree_dataclass
from jspec.engine.kv_backend import KVView
from jspec.tree.build import BuildTreeOutput


@pytree_dataclass
class StepBatch:
    """The bucket's requests (fixed for the step once prepare ran)."""

    # i32[Bb]: batch slot of each entry (padding entries: any value)
    slot_idx: jax.Array
    # bool[Bb]: live entries (all False when ok is False)
    live: jax.Array
    # the entries' token slots and committed lengths L after prepare_decode (padding: row 0,
    # length 0; jspec.engine.kv_backend.KVView)
    view: KVView
    # bool[]: the pages sufficed (else the step changes no state)
    ok: jax.Array


@pytree_dataclass
class DraftPlan:
    """Phase 1-2 output: the draft loop's inputs."""

    # the KV backend's state, threaded through every phase (its pools updated in place)
    kv: Any
    batch: StepBatch
    # i32[Bb, K, S]: draft-pool slot of every branch token of every draft step
    out_cache_loc: jax.Array
    # i32[Bb*K]: position of the step-0 branch tokens (L), + i at step i
    positions: jax.Array
    # passes[i]: tuple of AttentionMetadata read by draft step i (i = 0 .. S-2)
    passes: tuple
    # i32[Bb]: the tree roots (last emitted token, no KV yet)
    bonus_tokens: jax.Array
    # f32[Bb, K] / i32[Bb, K] (TARGET ids): the first tree level
    topk_p: jax.Array
    topk_index: jax.Array
    # dtype[Bb, Hd]: the draft hidden state that produced them
    draft_hidden: jax.Array


@pytree_dataclass
class DraftResult:
    """Phase 3 output: the draft tree (sglang ``organize_draft_results``)."""

    kv: Any  # the KV backend's state (pools updated in place)
    batch: StepBatch
    # i32[Bb]: the tree roots
    bonus_tokens: jax.Array
    # i32[Bb, (S-1)*K + 1]: parent of every top-scored token (flat ss index)
    parent_list: jax.Array
    # i32[Bb, N-1]: the selected tokens' flat ss indices, sorted
    top_scores_index: jax.Array
    # i32[Bb, N-1]: the selected tokens (TARGET ids)
    draft_tokens: jax.Array


@pytree_dataclass
class VerifyPlan:
    """Phase 4 output: the verify tree and where its N nodes' target KV goes."""

    kv: Any  # the KV backend's state (pools updated in place)
    batch: StepBatch
    # tree mask (QLEN_ONLY, bool[Bb, N, N]), positions i32[Bb*N], retrive_* i32[Bb, N],
    # draft_tokens i32[Bb*N] (root then the N-1 drafts)
    tree: BuildTreeOutput
    # i32[Bb*N]: the verify window row[L : L+N] (slot 0 on padding entries)
    verify_loc: jax.Array


@pytree_dataclass
class VerifyResult:
    """Phase 5 output: the target over the tree (target pool written at verify_loc)."""

    kv: Any  # the KV backend's state (pools updated in place)
    batch: StepBatch
    tree: BuildTreeOutput
    verify_loc: jax.Array  # i32[Bb*N]
    # dtype[Bb*N, Hd]: the draft's input from the target (draft.combine_hidden_states)
    target_feature: jax.Array
    # f32[Bb*N, V]
    logits: jax.Array


@pytree_dataclass
class AcceptResult:
    """Phase 6-7 output: the accepted paths, compacted to the front of each request's block."""

    kv: Any  # the KV backend's state (pools updated in place)
    batch: StepBatch
    verify_loc: jax.Array  # i32[Bb*N]
    # i32[Bb*N]: the token after each accepted node (argmax or sampled), accepted path first
    predict: jax.Array
    # dtype[Bb*N, Hd]: target_feature in the same order
    target_feature: jax.Array
    # i32[Bb]: tokens emitted (0 on padding entries)
    accept_lens: jax.Array
    # i32[Bb, S+1]: the emitted tokens ([:accept_len] valid, 0 after)
    accept_tokens: jax.Array
    # i32[Bb]: the next tree roots (last accepted token)
    new_bonus: jax.Array


@pytree_dataclass
class ExtendResult:
    """Phase 8 output: the draft's first tree level for the next step."""

    kv: Any  # the KV backend's state (pools updated in place)
    batch: StepBatch
    accept_lens: jax.Array  # i32[Bb]
    accept_tokens: jax.Array  # i32[Bb, S+1]
    new_bonus: jax.Array  # i32[Bb]
    # f32[Bb, K] / i32[Bb, K] (TARGET ids) / dtype[Bb, Hd]
    next_p: jax.Array
    next_index: jax.Array
    next_hidden: jax.Array


@pytree_dataclass
class SpecStepOutput:
    """What one speculative step emitted."""

    # i32[Bb, S+1]: the emitted tokens, [:accept_len] valid (0 after, 0 on padding entries)
    accept_tokens: jax.Array
    # i32[Bb]: tokens emitted per entry (0 on padding entries)
    accept_lens: jax.Array
    # bool[]: False when the pages were short (the step changed no state)
    ok: jax.Array


@pytree_dataclass
class GreedyStepOutput:
    """What one plain greedy step emitted."""

    # i32[Bb]: the next token of each entry, greedy or sampled (0 on padding entries)
    next_tokens: jax.Array
    # bool[]: False when the pages were short (the step changed no state)
    ok: jax.Array


@pytree_dataclass
class PrefillOutput:
    """What one prefill (admission) call emitted."""

    # i32[Bp]: the first token after each prompt, greedy or sampled (0 on padding entries)
    first_tokens: jax.Array
    # bool[]: False when the rows or pages were short (the call changed no state)
    ok: jax.Array
