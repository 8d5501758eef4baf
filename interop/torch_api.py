"""Every drop-in under its sglang name, in one flat namespace (``from interop import torch_api``).

The functions live in :mod:`interop.kv.dropin`, :mod:`interop.kv.dropin_allocator`,
:mod:`interop.tree.dropin`, :mod:`interop.tree.dropin_layout` and
:mod:`interop.attention_meta.dropin`; tests/interop/test_signatures.py pins each one's signature
to sglang 0.5.23's.
"""

from __future__ import annotations

from interop.attention_meta.dropin import (
    draft_decode_set_expand_metadata,
    generate_draft_decode_kv_indices,
)
from interop.kv.dropin import (
    PagedTokenToKVPoolAllocator,
    assign_req_to_token_pool_func,
    get_alloc_len_per_decode,
    get_last_loc,
    move_kv_cache,
    page_aligned_decode_alloc_lens,
)
from interop.tree.dropin import (
    build_tree_kernel_efficient,
    organize_draft_results,
    select_top_k_tokens,
    tree_speculative_sampling_target_only,
    verify_tree_greedy,
)
from interop.tree.dropin_layout import (
    duplicate_prefix_tail_to_draft_branches,
    move_accept_tokens_to_target_kvcache,
    prepare_for_draft,
)

__all__ = [
    "PagedTokenToKVPoolAllocator",
    "assign_req_to_token_pool_func",
    "build_tree_kernel_efficient",
    "draft_decode_set_expand_metadata",
    "duplicate_prefix_tail_to_draft_branches",
    "generate_draft_decode_kv_indices",
    "get_alloc_len_per_decode",
    "get_last_loc",
    "move_accept_tokens_to_target_kvcache",
    "move_kv_cache",
    "organize_draft_results",
    "page_aligned_decode_alloc_lens",
    "prepare_for_draft",
    "select_top_k_tokens",
    "tree_speculative_sampling_target_only",
    "verify_tree_greedy",
]
