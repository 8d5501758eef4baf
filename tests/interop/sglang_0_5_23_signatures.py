"""sglang 0.5.23's signatures of every function and method the drop-in mirrors (recorded table).

Read from the published ``sglang==0.5.23`` wheel (``sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64
.whl``) with ``ast``; each entry is ``name -> ((parameter, kind, default source or None), ...)``
in order, ``self`` left out. ``None`` means "no default"; ``'None'`` is a default of None;
``TreeMaskMode.FULL_MASK`` is recorded as its value ``'0'``.

``DOCUMENTED_DIFFERENCES``: drop-ins whose sglang counterpart takes scheduler / server objects
(or global server args), with the reason; tests/interop/test_signatures.py pins their jspec
signatures instead, so they change only on purpose.
"""

# fmt: off
SIGNATURES = {
    # sglang/srt/speculative/spec_utils.py:474
    'select_top_k_tokens': (
        ('i', 'POSITIONAL_OR_KEYWORD', None),
        ('topk_p', 'POSITIONAL_OR_KEYWORD', None),
        ('topk_index', 'POSITIONAL_OR_KEYWORD', None),
        ('hidden_states', 'POSITIONAL_OR_KEYWORD', None),
        ('scores', 'POSITIONAL_OR_KEYWORD', None),
        ('topk', 'POSITIONAL_OR_KEYWORD', None),
    ),
    # sglang/srt/speculative/eagle_utils.py:100
    'organize_draft_results': (
        ('score_list', 'POSITIONAL_OR_KEYWORD', None),
        ('token_list', 'POSITIONAL_OR_KEYWORD', None),
        ('parents_list', 'POSITIONAL_OR_KEYWORD', None),
        ('num_draft_token', 'POSITIONAL_OR_KEYWORD', None),
    ),
    # sglang/srt/speculative/eagle_utils.py:138
    'build_tree_kernel_efficient': (
        ('bonus_tokens', 'POSITIONAL_OR_KEYWORD', None),
        ('parent_list', 'POSITIONAL_OR_KEYWORD', None),
        ('top_scores_index', 'POSITIONAL_OR_KEYWORD', None),
        ('draft_tokens', 'POSITIONAL_OR_KEYWORD', None),
        ('seq_lens', 'POSITIONAL_OR_KEYWORD', None),
        ('seq_lens_sum', 'POSITIONAL_OR_KEYWORD', None),
        ('topk', 'POSITIONAL_OR_KEYWORD', None),
        ('spec_steps', 'POSITIONAL_OR_KEYWORD', None),
        ('num_verify_tokens', 'POSITIONAL_OR_KEYWORD', None),
        ('tree_mask_mode', 'POSITIONAL_OR_KEYWORD', '0'),
        ('tree_mask_buf', 'POSITIONAL_OR_KEYWORD', 'None'),
        ('fill_prefix_mask', 'POSITIONAL_OR_KEYWORD', 'True'),
    ),
    # sglang/kernels/ops/speculative/tree.py:61
    'verify_tree_greedy': (
        ('predicts', 'POSITIONAL_OR_KEYWORD', None),
        ('accept_index', 'POSITIONAL_OR_KEYWORD', None),
        ('accept_token_num', 'POSITIONAL_OR_KEYWORD', None),
        ('candidates', 'POSITIONAL_OR_KEYWORD', None),
        ('retrive_index', 'POSITIONAL_OR_KEYWORD', None),
        ('retrive_next_token', 'POSITIONAL_OR_KEYWORD', None),
        ('retrive_next_sibling', 'POSITIONAL_OR_KEYWORD', None),
        ('target_predict', 'POSITIONAL_OR_KEYWORD', None),
    ),
    # sglang/kernels/ops/speculative/sampling.py:33
    'tree_speculative_sampling_target_only': (
        ('predicts', 'POSITIONAL_OR_KEYWORD', None),
        ('accept_index', 'POSITIONAL_OR_KEYWORD', None),
        ('accept_token_num', 'POSITIONAL_OR_KEYWORD', None),
        ('candidates', 'POSITIONAL_OR_KEYWORD', None),
        ('retrive_index', 'POSITIONAL_OR_KEYWORD', None),
        ('retrive_next_token', 'POSITIONAL_OR_KEYWORD', None),
        ('retrive_next_sibling', 'POSITIONAL_OR_KEYWORD', None),
        ('uniform_samples', 'POSITIONAL_OR_KEYWORD', None),
        ('uniform_samples_for_final_sampling', 'POSITIONAL_OR_KEYWORD', None),
        ('target_probs', 'POSITIONAL_OR_KEYWORD', None),
        ('draft_probs', 'POSITIONAL_OR_KEYWORD', None),
        ('threshold_single', 'POSITIONAL_OR_KEYWORD', '1.0'),
        ('threshold_acc', 'POSITIONAL_OR_KEYWORD', '1.0'),
        ('deterministic', 'POSITIONAL_OR_KEYWORD', 'True'),
    ),
    # sglang/srt/layers/attention/flashattention_backend.py:3544
    'draft_decode_set_expand_metadata': (
        ('cache_seqlens_int32', 'POSITIONAL_OR_KEYWORD', None),
        ('page_table', 'POSITIONAL_OR_KEYWORD', None),
        ('last_page_lens', 'POSITIONAL_OR_KEYWORD', None),
        ('decode_length', 'POSITIONAL_OR_KEYWORD', None),
        ('cache_loc', 'POSITIONAL_OR_KEYWORD', None),
        ('topk', 'POSITIONAL_OR_KEYWORD', None),
        ('page_size', 'POSITIONAL_OR_KEYWORD', None),
    ),
    # sglang/kernels/ops/speculative/cache_locs.py:161
    'generate_draft_decode_kv_indices': (
        ('req_pool_indices', 'POSITIONAL_OR_KEYWORD', None),
        ('req_to_token', 'POSITIONAL_OR_KEYWORD', None),
        ('paged_kernel_lens', 'POSITIONAL_OR_KEYWORD', None),
        ('kv_indices', 'POSITIONAL_OR_KEYWORD', None),
        ('kv_indptr', 'POSITIONAL_OR_KEYWORD', None),
        ('positions', 'POSITIONAL_OR_KEYWORD', None),
        ('row_stride', 'POSITIONAL_OR_KEYWORD', None),
        ('kv_indices_stride', 'POSITIONAL_OR_KEYWORD', None),
        ('kv_indptr_stride', 'POSITIONAL_OR_KEYWORD', None),
        ('bs_upper', 'POSITIONAL_OR_KEYWORD', None),
        ('iter_upper', 'POSITIONAL_OR_KEYWORD', None),
        ('num_tokens_upper', 'POSITIONAL_OR_KEYWORD', None),
        ('page_size', 'POSITIONAL_OR_KEYWORD', None),
        ('window_size', 'POSITIONAL_OR_KEYWORD', '0'),
        ('sink_size', 'POSITIONAL_OR_KEYWORD', '0'),
        ('NUM_STEPS', 'POSITIONAL_OR_KEYWORD', '0'),
        ('ENTRY_PAGE_SIZE', 'POSITIONAL_OR_KEYWORD', '1'),
        ('v2p', 'POSITIONAL_OR_KEYWORD', 'None'),
        ('TRANSLATE', 'POSITIONAL_OR_KEYWORD', 'False'),
    ),
    # sglang/srt/mem_cache/allocation_sizing.py:28
    'get_alloc_len_per_decode': (
    ),
    # sglang/srt/mem_cache/allocation_sizing.py:73
    'page_aligned_decode_alloc_lens': (
        ('reqs', 'POSITIONAL_OR_KEYWORD', None),
        ('reserve', 'KEYWORD_ONLY', None),
        ('page_size', 'KEYWORD_ONLY', None),
    ),
    # sglang/srt/mem_cache/allocation.py:108
    'get_last_loc': (
        ('req_to_token', 'POSITIONAL_OR_KEYWORD', None),
        ('req_pool_indices_tensor', 'POSITIONAL_OR_KEYWORD', None),
        ('prefix_lens_tensor', 'POSITIONAL_OR_KEYWORD', None),
    ),
    # sglang/srt/mem_cache/allocation.py:737
    'assign_req_to_token_pool_func': (
        ('req_pool_indices', 'POSITIONAL_OR_KEYWORD', None),
        ('req_to_token', 'POSITIONAL_OR_KEYWORD', None),
        ('start_offset', 'POSITIONAL_OR_KEYWORD', None),
        ('end_offset', 'POSITIONAL_OR_KEYWORD', None),
        ('out_cache_loc', 'POSITIONAL_OR_KEYWORD', None),
        ('batch_size', 'POSITIONAL_OR_KEYWORD', None),
    ),
    # sglang/srt/speculative/eagle_worker_common.py:65
    'duplicate_prefix_tail_to_draft_branches': (
        ('token_to_kv_pool', 'POSITIONAL_OR_KEYWORD', None),
        ('rows', 'POSITIONAL_OR_KEYWORD', None),
        ('prefix_base', 'POSITIONAL_OR_KEYWORD', None),
        ('last_page', 'POSITIONAL_OR_KEYWORD', None),
        ('num_new_pages', 'POSITIONAL_OR_KEYWORD', None),
        ('topk', 'POSITIONAL_OR_KEYWORD', None),
        ('page_size', 'POSITIONAL_OR_KEYWORD', None),
    ),
    # sglang/srt/speculative/spec_utils.py:859
    'move_accept_tokens_to_target_kvcache': (
        ('batch', 'POSITIONAL_OR_KEYWORD', None),
        ('accept_index', 'POSITIONAL_OR_KEYWORD', None),
        ('num_correct_drafts', 'POSITIONAL_OR_KEYWORD', None),
        ('token_to_kv_pool_allocator', 'POSITIONAL_OR_KEYWORD', None),
    ),
    # sglang/srt/speculative/eagle_worker_common.py:241
    'prepare_for_draft': (
        ('draft_input', 'POSITIONAL_OR_KEYWORD', None),
        ('req_to_token_pool', 'POSITIONAL_OR_KEYWORD', None),
        ('batch', 'POSITIONAL_OR_KEYWORD', None),
        ('cuda_graph_runner', 'POSITIONAL_OR_KEYWORD', None),
        ('draft_model_runner', 'POSITIONAL_OR_KEYWORD', None),
        ('topk', 'POSITIONAL_OR_KEYWORD', None),
        ('num_steps', 'POSITIONAL_OR_KEYWORD', None),
        ('target_translator', 'KEYWORD_ONLY', 'None'),
        ('num_draft_tokens', 'KEYWORD_ONLY', 'None'),
    ),
    # sglang/srt/mem_cache/allocator/paged.py:143 (PagedTokenToKVPoolAllocator)
    'PagedTokenToKVPoolAllocator.__init__': (
        ('size', 'POSITIONAL_OR_KEYWORD', None),
        ('page_size', 'POSITIONAL_OR_KEYWORD', None),
        ('dtype', 'POSITIONAL_OR_KEYWORD', None),
        ('device', 'POSITIONAL_OR_KEYWORD', None),
        ('kvcache', 'POSITIONAL_OR_KEYWORD', None),
        ('need_sort', 'POSITIONAL_OR_KEYWORD', None),
    ),
    # sglang/srt/mem_cache/allocator/paged.py:168 (PagedTokenToKVPoolAllocator)
    'PagedTokenToKVPoolAllocator.available_size': (
    ),
    # sglang/srt/mem_cache/allocator/base.py:202 (BaseTokenToKVPoolAllocator)
    'PagedTokenToKVPoolAllocator.get_kvcache': (
    ),
    # sglang/srt/mem_cache/allocator/paged.py:171 (PagedTokenToKVPoolAllocator)
    'PagedTokenToKVPoolAllocator.get_all_free_pages': (
    ),
    # sglang/srt/mem_cache/allocator/paged.py:174 (PagedTokenToKVPoolAllocator)
    'PagedTokenToKVPoolAllocator.merge_and_sort_free': (
    ),
    # sglang/srt/mem_cache/allocator/paged.py:181 (PagedTokenToKVPoolAllocator)
    'PagedTokenToKVPoolAllocator.alloc': (
        ('need_size', 'POSITIONAL_OR_KEYWORD', None),
    ),
    # sglang/srt/mem_cache/allocator/paged.py:204 (PagedTokenToKVPoolAllocator)
    'PagedTokenToKVPoolAllocator.alloc_extend': (
        ('prefix_lens', 'POSITIONAL_OR_KEYWORD', None),
        ('prefix_lens_cpu', 'POSITIONAL_OR_KEYWORD', None),
        ('seq_lens', 'POSITIONAL_OR_KEYWORD', None),
        ('seq_lens_cpu', 'POSITIONAL_OR_KEYWORD', None),
        ('last_loc', 'POSITIONAL_OR_KEYWORD', None),
        ('extend_num_tokens', 'POSITIONAL_OR_KEYWORD', None),
        ('num_new_pages', 'POSITIONAL_OR_KEYWORD', 'None'),
    ),
    # sglang/srt/mem_cache/allocator/paged.py:279 (PagedTokenToKVPoolAllocator)
    'PagedTokenToKVPoolAllocator.alloc_decode': (
        ('seq_lens', 'POSITIONAL_OR_KEYWORD', None),
        ('seq_lens_cpu', 'POSITIONAL_OR_KEYWORD', None),
        ('last_loc', 'POSITIONAL_OR_KEYWORD', None),
    ),
    # sglang/srt/mem_cache/allocator/paged.py:328 (PagedTokenToKVPoolAllocator)
    'PagedTokenToKVPoolAllocator.free': (
        ('free_index', 'POSITIONAL_OR_KEYWORD', None),
    ),
    # sglang/srt/mem_cache/allocator/paged.py:340 (PagedTokenToKVPoolAllocator)
    'PagedTokenToKVPoolAllocator.free_segment': (
        ('free_index', 'POSITIONAL_OR_KEYWORD', None),
        ('start_pos', 'KEYWORD_ONLY', None),
    ),
    # sglang/srt/mem_cache/allocator/base.py:295 (BaseTokenToKVPoolAllocator)
    'PagedTokenToKVPoolAllocator.free_segments': (
        ('segments', 'POSITIONAL_OR_KEYWORD', None),
    ),
    # sglang/srt/mem_cache/allocator/paged.py:359 (PagedTokenToKVPoolAllocator)
    'PagedTokenToKVPoolAllocator.free_page_ids': (
        ('page_ids', 'POSITIONAL_OR_KEYWORD', None),
    ),
    # sglang/srt/mem_cache/allocator/paged.py:382 (PagedTokenToKVPoolAllocator)
    'PagedTokenToKVPoolAllocator.free_group_begin': (
    ),
    # sglang/srt/mem_cache/allocator/paged.py:386 (PagedTokenToKVPoolAllocator)
    'PagedTokenToKVPoolAllocator.free_group_end': (
    ),
    # sglang/srt/mem_cache/allocator/paged.py:395 (PagedTokenToKVPoolAllocator)
    'PagedTokenToKVPoolAllocator.clear': (
    ),
    # sglang/srt/mem_cache/allocator/paged.py:406 (PagedTokenToKVPoolAllocator)
    'PagedTokenToKVPoolAllocator.get_cpu_copy': (
        ('indices', 'POSITIONAL_OR_KEYWORD', None),
        ('mamba_indices', 'POSITIONAL_OR_KEYWORD', 'None'),
        ('req_pool_index', 'POSITIONAL_OR_KEYWORD', 'None'),
    ),
    # sglang/srt/mem_cache/allocator/paged.py:413 (PagedTokenToKVPoolAllocator)
    'PagedTokenToKVPoolAllocator.load_cpu_copy': (
        ('kv_cache_cpu', 'POSITIONAL_OR_KEYWORD', None),
        ('indices', 'POSITIONAL_OR_KEYWORD', None),
        ('mamba_indices', 'POSITIONAL_OR_KEYWORD', 'None'),
        ('req_pool_index', 'POSITIONAL_OR_KEYWORD', 'None'),
    ),
}
# fmt: on

DOCUMENTED_DIFFERENCES = {
    "get_alloc_len_per_decode": (
        (
            "sglang 0.5.23 takes no arguments and reads the global server_args; the drop-in takes "
            "page_size, topk, num_steps, num_draft_tokens (and max_num_draft_tokens) as keywords"
        ),
        ("page_size", "topk", "num_steps", "num_draft_tokens", "max_num_draft_tokens"),
    ),
    "prepare_for_draft": (
        (
            "sglang 0.5.23 takes (draft_input, req_to_token_pool, batch, cuda_graph_runner, "
            "draft_model_runner, topk, num_steps, *, target_translator, num_draft_tokens); the "
            "drop-in takes the tensors it reads and returns out_cache_loc"
        ),
        (
            "req_to_token",
            "req_pool_indices",
            "seq_lens",
            "topk",
            "num_steps",
            "page_size",
            "draft_token_to_kv_pool",
            "impl",
            "interpret",
        ),
    ),
    "move_accept_tokens_to_target_kvcache": (
        (
            "sglang 0.5.23 takes (batch, accept_index, num_correct_drafts, "
            "token_to_kv_pool_allocator); the drop-in takes the pool and the tensors it reads and "
            "returns the (tgt, src) pairs"
        ),
        (
            "token_to_kv_pool",
            "req_to_token",
            "req_pool_indices",
            "seq_lens",
            "out_cache_loc",
            "accept_index",
            "accept_lens",
            "impl",
            "interpret",
        ),
    ),
    "move_kv_cache": (
        (
            "sglang 0.5.23's move_kv_cache is a KV-pool method (self, tgt_loc, src_loc); the drop-in "
            "takes the pool's per-layer K and V buffers"
        ),
        ("k_buffers", "v_buffers", "tgt_loc", "src_loc", "impl", "interpret"),
    ),
}
