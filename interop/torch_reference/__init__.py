"""PyTorch references of every jspec op, with sglang's call signatures and in-place conventions.

Written from shared/SPEC.md (no sglang import), plain torch ops and loops, runnable on CPU.
Modules: ``allocator`` (PagedTokenToKVPoolAllocator), ``memory`` (ReqToTokenPool,
assign_req_to_token_pool, MHATokenToKVPool, move_kv_cache), ``sizing``, ``spec`` (draft layout,
accepted-KV moves; re-exports ``tree``), ``tree`` (select/organize/build/verify/sampling),
``attention`` (expand page_table, FlashInfer kv_indices).
"""
