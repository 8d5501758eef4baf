"""EAGLE tree drafting and verification (sglang ``eagle_utils`` / ``eagle_info`` ops).

The step in order: :func:`topk_probs` (draft top-k proposal), :func:`select_top_k_tokens` and
:func:`organize_draft_results` (tree expansion), :func:`prepare_for_draft` (holey draft slot
layout), :func:`build_tree_kernel_efficient` (verify-tree metadata), :func:`verify_tree_greedy`
/ :func:`tree_sampling_verify` (accept path; for exact sampling :func:`target_probs_from_logits`
gives the processed distribution, :func:`uniform_coins` reproducible coins), then the accept
bookkeeping (:func:`move_accept_tokens_to_target_kvcache`, ...). Every op takes arrays plus the
tree's static shape as ``geometry=`` (:class:`jspec.config.TreeGeometry`, validated once when
built; ``SpecConfig.geometry``), or, for ops that read one size only, that size (``topk=``,
``num_draft_tokens=``); ``impl=`` picks the kernel.
"""

from __future__ import annotations

from jspec.kernels.topk_probs import topk_probs
from jspec.tree.accept import (
    accept_kv_move_pairs,
    get_src_tgt_cache_loc,
    move_accept_tokens_to_target_kvcache,
    verify_out_cache_loc,
)
from jspec.tree.build import (
    BuildTreeOutput,
    TreeMaskMode,
    build_tree_kernel_efficient,
    flatten_full_mask,
)
from jspec.tree.layout import (
    draft_out_cache_loc,
    draft_positions,
    duplicate_prefix_tail_to_draft_branches,
    max_prefix_tail_pairs,
    prefix_tail_copy_pairs,
    prepare_for_draft,
)
from jspec.tree.sampling import (
    LossyThresholds,
    sample_from_probs,
    target_probs_from_logits,
    tree_sampling_verify,
    tree_speculative_sampling_target_only,
)
from jspec.tree.sampling_keys import seed_words, uniform_coins
from jspec.tree.select import organize_draft_results, select_top_k_tokens
from jspec.tree.verify import (
    compact_accept_to_front,
    eagle_sample_greedy,
    fill_accept_out_cache_loc,
    fill_bonus_tokens,
    verify_tree_greedy,
)

__all__ = [
    "BuildTreeOutput",
    "LossyThresholds",
    "TreeMaskMode",
    "accept_kv_move_pairs",
    "build_tree_kernel_efficient",
    "compact_accept_to_front",
    "draft_out_cache_loc",
    "draft_positions",
    "duplicate_prefix_tail_to_draft_branches",
    "eagle_sample_greedy",
    "fill_accept_out_cache_loc",
    "fill_bonus_tokens",
    "flatten_full_mask",
    "get_src_tgt_cache_loc",
    "max_prefix_tail_pairs",
    "move_accept_tokens_to_target_kvcache",
    "organize_draft_results",
    "prefix_tail_copy_pairs",
    "prepare_for_draft",
    "sample_from_probs",
    "seed_words",
    "select_top_k_tokens",
    "target_probs_from_logits",
    "topk_probs",
    "tree_sampling_verify",
    "tree_speculative_sampling_target_only",
    "uniform_coins",
    "verify_out_cache_loc",
    "verify_tree_greedy",
]
