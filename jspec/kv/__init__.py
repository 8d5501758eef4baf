"""The paged KV cache: pool, page allocator, req_to_token rows, decode-step allocation.

sglang's ``MHATokenToKVPool``, ``PagedTokenToKVPoolAllocator``, ``ReqToTokenPool`` and
``alloc_for_spec_decode`` as pure functions over registered pytrees (``new = f(state, ...)``).
Constructors take a :class:`jspec.config.SpecConfig`; per-step ops take arrays plus keyword
geometry, and ``impl="xla" | "pallas" | ...`` picks the kernel where one exists.
:func:`prepare_for_decode` takes the ``SpecConfig`` (its reserve sizes are derived from it).
"""

from __future__ import annotations

from jspec.kv.allocator import (
    PagedAllocator,
    alloc,
    alloc_decode,
    alloc_extend,
    allocator_from_config,
    available_size,
    free,
    free_page_ids,
    free_segment,
    init_allocator,
    merge_and_sort_free,
)
from jspec.kv.decode_alloc import (
    ReqKVState,
    commit_kv_lens,
    init_req_kv_state,
    page_aligned_decode_alloc_lens,
    prepare_for_decode,
    release_kv_cache,
)
from jspec.kv.free_group import FreeGroup
from jspec.kv.integrity import (
    AllocatorIntegrityError,
    check_integrity,
    integrity_violations,
    owned_page_mask,
)
from jspec.kv.pool import KVPool, get_kv, init_kv_pool, move_kv_cache, set_kv_buffer
from jspec.kv.req_to_token import (
    ReqRowAllocator,
    alloc_req_rows,
    assign_req_to_token_pool,
    free_req_rows,
    get_last_loc,
    init_req_rows,
    init_req_to_token,
)

__all__ = [
    "AllocatorIntegrityError",
    "FreeGroup",
    "KVPool",
    "PagedAllocator",
    "ReqKVState",
    "ReqRowAllocator",
    "alloc",
    "alloc_decode",
    "alloc_extend",
    "alloc_req_rows",
    "allocator_from_config",
    "assign_req_to_token_pool",
    "available_size",
    "check_integrity",
    "commit_kv_lens",
    "free",
    "free_page_ids",
    "free_req_rows",
    "free_segment",
    "get_kv",
    "get_last_loc",
    "init_allocator",
    "init_kv_pool",
    "init_req_kv_state",
    "init_req_rows",
    "init_req_to_token",
    "integrity_violations",
    "merge_and_sort_free",
    "move_kv_cache",
    "owned_page_mask",
    "page_aligned_decode_alloc_lens",
    "prepare_for_decode",
    "release_kv_cache",
    "set_kv_buffer",
]
