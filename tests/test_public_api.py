# Over 400 lines: most of it is the recorded public surface (regenerated, not hand-written).
"""The public surface, pinned: names and signatures of everything in each public ``__all__``.

A change to this table must be on purpose: regenerate it with
``python tests/test_public_api.py`` and review the diff. ``jspec.kernels`` is internal (empty
``__all__``); ops are public through their concept package.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import sys
from typing import Any

import pytest

PUBLIC_MODULES = (
    "jspec",
    "jspec.config",
    "jspec.sentinels",
    "jspec.probes",
    "jspec.kv",
    "jspec.tree",
    "jspec.attention_meta",
    "jspec.kernels",
    "jspec.engine",
    "jspec.models",
)


def _describe(obj: Any) -> str:
    """A stable one-line description: module, enum members, class/def signature, or value."""
    if inspect.ismodule(obj):
        return "module"
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        return "enum(" + ", ".join(f"{m.name}={m.value}" for m in obj) + ")"
    if isinstance(obj, type) and issubclass(obj, BaseException):
        return "exception(" + ", ".join(b.__name__ for b in obj.__bases__) + ")"
    if hasattr(obj, "__origin__"):  # a typing alias; its repr names jax-version internals
        return f"alias of {obj.__origin__.__module__}.{obj.__origin__.__qualname__}"
    if callable(obj):
        fn = getattr(obj, "__wrapped__", obj)  # jax.jit keeps the Python function here
        kind = "class" if isinstance(obj, type) else "def"
        return f"{kind}{inspect.signature(fn)}"
    return f"= {obj!r}"


def _surface(module_name: str) -> dict[str, str]:
    module = importlib.import_module(module_name)
    return {name: _describe(getattr(module, name)) for name in module.__all__}


# ---- the recorded table (regenerate: python tests/test_public_api.py) -------------------------
RECORDED: dict[str, dict[str, str]] = {
    "jspec": {
        "BatchBuckets": "class(sizes: 'tuple[int, ...]') -> None",
        "SpecConfig": "class(page_size: 'int' = 16, topk: 'int' = 4, num_steps: 'int' = 3, "
        "num_draft_tokens: 'int' = 8, context_len: 'int' = 1024, "
        "max_running_requests: 'int' = 8, num_pages: 'int' = 1024, num_layers: 'int' = 2, "
        "num_kv_heads: 'int' = 2, head_dim: 'int' = 64, dtype: 'str' = 'bfloat16', "
        "max_num_draft_tokens: 'int' = 0, spec_enabled: 'bool' = True) -> None",
        "TreeGeometry": "class(topk: 'int', num_steps: 'int', num_draft_tokens: 'int', "
        "page_size: 'int') -> None",
        "attention_meta": "module",
        "engine": "module",
        "kv": "module",
        "models": "module",
        "probes": "module",
        "sentinels": "module",
        "tree": "module",
    },
    "jspec.config": {
        "INT32_LIMIT": "= 2147483648",
        "MAX_NUM_DRAFT_TOKENS": "= 1024",
        "MAX_NUM_STEPS": "= 16",
        "BatchBuckets": "class(sizes: 'tuple[int, ...]') -> None",
        "SpecConfig": "class(page_size: 'int' = 16, topk: 'int' = 4, num_steps: 'int' = 3, "
        "num_draft_tokens: 'int' = 8, context_len: 'int' = 1024, "
        "max_running_requests: 'int' = 8, num_pages: 'int' = 1024, num_layers: 'int' = 2, "
        "num_kv_heads: 'int' = 2, head_dim: 'int' = 64, dtype: 'str' = 'bfloat16', "
        "max_num_draft_tokens: 'int' = 0, spec_enabled: 'bool' = True) -> None",
        "TreeGeometry": "class(topk: 'int', num_steps: 'int', num_draft_tokens: 'int', "
        "page_size: 'int') -> None",
        "ceil_div": "def(a: '_IntOrArray', b: 'int') -> '_IntOrArray'",
        "check_geometry": "def(geometry: 'Any', where: 'str') -> 'TreeGeometry'",
        "ceil_to_multiple": "def(a: 'int', b: 'int') -> 'int'",
        "next_power_of_2": "def(x: 'int') -> 'int'",
    },
    "jspec.sentinels": {
        "NOT_ACCEPTED": "= -1",
        "NO_NODE": "= -1",
        "PAD_PAGE_ID": "= 0",
        "PAD_ROW": "= 0",
        "PAD_SLOT_ID": "= 0",
        "ROOT_PARENT": "= -1",
        "SEQ_LEN_FILL_VALUE": "= 1",
    },
    "jspec.probes": {
        "ProbeError": "exception(AssertionError)",
        "assert_async": "def(cond: 'Any', msg: 'str', **values: 'Any') -> 'None'",
        "assert_buffer_fits": "def(used: 'int', capacity: 'int', what: 'str', **ctx: 'Any') -> 'None'",
        "checked": "def(fn: 'Callable[..., Any]', *, raise_error: 'bool' = True) -> 'Callable[..., Any]'",
        "detect_in_closed_range": "def(x: 'jax.Array', low: 'Any', high: 'Any', msg: 'str', *, "
        "where: 'jax.Array | None' = None) -> 'None'",
        "detect_inf": "def(x: 'jax.Array', msg: 'str', *, where: 'jax.Array | None' = None) -> 'None'",
        "detect_nan": "def(x: 'jax.Array', msg: 'str', *, where: 'jax.Array | None' = None) -> 'None'",
        "detect_oob": "def(x: 'jax.Array', low: 'Any', high: 'Any', msg: 'str', *, "
        "where: 'jax.Array | None' = None) -> 'None'",
        "detect_page_aligned": "def(x: 'jax.Array', page_size: 'int', msg: 'str', *, "
        "where: 'jax.Array | None' = None) -> 'None'",
        "probes_enabled": "def(enabled: 'bool' = True, *, runtime_errors: 'bool' = True) -> 'Iterator[None]'",
        "probes_on": "def() -> 'bool'",
        "static_check": "def(cond: 'bool', msg: 'str') -> 'None'",
        "static_check_dtype": "def(x: 'Any', dtypes: 'Any', name: 'str') -> 'None'",
        "static_check_int": "def(value: 'Any', name: 'str', *, low: 'int' = 1) -> 'None'",
        "static_check_int_arg": "def(value: 'Any', name: 'str') -> 'None'",
        "static_check_power_of_2": "def(value: 'Any', name: 'str') -> 'None'",
        "static_check_shape": "def(x: 'Any', shape: 'tuple[int, ...]', name: 'str') -> 'None'",
    },
    "jspec.kv": {
        "AllocatorIntegrityError": "exception(AssertionError)",
        "FreeGroup": "class() -> 'None'",
        "KVPool": "class(k: 'jax.Array', v: 'jax.Array', page_size: 'int' = 1) -> None",
        "PagedAllocator": "class(free_pages: 'jax.Array', num_free: 'jax.Array', staged_pages: 'jax.Array', "
        "num_staged: 'jax.Array', page_size: 'int', num_pages: 'int', "
        "need_sort: 'bool' = False) -> None",
        "ReqKVState": "class(committed_lens: 'jax.Array', allocated_lens: 'jax.Array', "
        "req_pool_indices: 'jax.Array', valid: 'jax.Array') -> None",
        "ReqRowAllocator": "class(free_rows: 'jax.Array', num_free: 'jax.Array') -> None",
        "alloc": "def(a: 'PagedAllocator', num_slots: 'jax.Array', *, "
        "max_slots: 'int') -> 'tuple[PagedAllocator, jax.Array, jax.Array]'",
        "alloc_decode": "def(a: 'PagedAllocator', seq_lens: 'jax.Array', last_loc: 'jax.Array', *, "
        "valid: 'jax.Array | None' = None, impl: 'str' = 'xla', "
        "interpret: 'bool | None' = None, "
        "merge_rule: 'str' = 'sglang') -> 'tuple[PagedAllocator, jax.Array, jax.Array]'",
        "alloc_extend": "def(a: 'PagedAllocator', prefix_lens: 'jax.Array', seq_lens: 'jax.Array', "
        "last_loc: 'jax.Array', *, max_new_slots: 'int', valid: 'jax.Array | None' = None, "
        "impl: 'str' = 'xla', interpret: 'bool | None' = None, "
        "merge_rule: 'str' = 'sglang') -> 'tuple[PagedAllocator, jax.Array, jax.Array]'",
        "alloc_req_rows": "def(r: 'ReqRowAllocator', num: 'jax.Array', *, "
        "max_rows: 'int') -> 'tuple[ReqRowAllocator, jax.Array, jax.Array]'",
        "allocator_from_config": "def(cfg: 'SpecConfig', *, need_sort: 'bool' = False) -> 'PagedAllocator'",
        "assign_req_to_token_pool": "def(req_to_token: 'jax.Array', req_pool_indices: 'jax.Array', "
        "start_offset: 'jax.Array', end_offset: 'jax.Array', out_cache_loc: 'jax.Array', *, "
        "impl: 'str' = 'xla', interpret: 'bool | None' = None, "
        "return_ok: 'bool' = False) -> 'Any'",
        "available_size": "def(a: 'PagedAllocator') -> 'jax.Array'",
        "check_integrity": "def(a: 'PagedAllocator', owned_mask: 'jax.Array | None' = None, *, "
        "what: 'str' = '') -> 'None'",
        "commit_kv_lens": "def(reqs: 'ReqKVState', accept_lens: 'jax.Array', *, "
        "return_ok: 'bool' = False) -> 'Any'",
        "free": "def(a: 'PagedAllocator', slot_ids: 'jax.Array', *, "
        "valid: 'jax.Array | None' = None, return_ok: 'bool' = False) -> 'Any'",
        "free_page_ids": "def(a: 'PagedAllocator', page_ids: 'jax.Array', *, "
        "valid: 'jax.Array | None' = None, return_ok: 'bool' = False) -> 'Any'",
        "free_req_rows": "def(r: 'ReqRowAllocator', rows: 'jax.Array', *, valid: 'jax.Array | None' = None, "
        "return_ok: 'bool' = False) -> 'Any'",
        "free_segment": "def(a: 'PagedAllocator', row_slot_ids: 'jax.Array', start: 'jax.Array', "
        "end: 'jax.Array', *, return_ok: 'bool' = False) -> 'Any'",
        "get_kv": "def(pool: 'KVPool', layer: 'int', slot_ids: 'jax.Array') -> 'tuple[jax.Array, "
        "jax.Array]'",
        "get_last_loc": "def(req_to_token: 'jax.Array', req_pool_indices: 'jax.Array', "
        "prefix_lens: 'jax.Array') -> 'jax.Array'",
        "init_allocator": "def(num_pages: 'int', page_size: 'int', *, "
        "need_sort: 'bool' = False) -> 'PagedAllocator'",
        "init_kv_pool": "def(cfg: 'SpecConfig', *, fill: 'float' = 0.0) -> 'KVPool'",
        "init_req_kv_state": "def(max_batch: 'int') -> 'ReqKVState'",
        "init_req_rows": "def(cfg: 'SpecConfig') -> 'ReqRowAllocator'",
        "init_req_to_token": "def(cfg: 'SpecConfig') -> 'jax.Array'",
        "integrity_violations": "def(a: 'PagedAllocator', owned_mask: 'jax.Array | None' = None) -> 'dict[str, "
        "jax.Array]'",
        "merge_and_sort_free": "def(a: 'PagedAllocator') -> 'PagedAllocator'",
        "move_kv_cache": "def(pool: 'KVPool', tgt_slot_ids: 'jax.Array', src_slot_ids: 'jax.Array', *, "
        "impl: 'str' = 'xla', interpret: 'bool | None' = None, block_rows: 'int' = 16, "
        "block_elems: 'int' = 8192, num_warps: 'int' = 8, "
        "single_block_rows: 'int' = 64) -> 'KVPool'",
        "owned_page_mask": "def(req_to_token: 'jax.Array', req_pool_indices: 'jax.Array', "
        "allocated_lens: 'jax.Array', *, num_pages: 'int', page_size: 'int', "
        "valid: 'jax.Array | None' = None) -> 'jax.Array'",
        "page_aligned_decode_alloc_lens": "def(committed_lens: 'jax.Array', allocated_lens: 'jax.Array', *, reserve: 'int', "
        "page_size: 'int', valid: 'jax.Array | None' = None) -> 'tuple[jax.Array, jax.Array, "
        "jax.Array]'",
        "prepare_for_decode": "def(allocator: 'PagedAllocator', req_to_token: 'jax.Array', reqs: 'ReqKVState', "
        "cfg: 'SpecConfig', *, impl: 'str' = 'xla', interpret: 'bool | None' = None, "
        "max_new_slots: 'int | None' = None) -> 'tuple[PagedAllocator, jax.Array, "
        "ReqKVState, jax.Array]'",
        "release_kv_cache": "def(allocator: 'PagedAllocator', req_to_token: 'jax.Array', reqs: 'ReqKVState', "
        "finished: 'jax.Array', *, return_ok: 'bool' = False) -> 'Any'",
        "set_kv_buffer": "def(pool: 'KVPool', layer: 'int', slot_ids: 'jax.Array', k: 'jax.Array', "
        "v: 'jax.Array', *, impl: 'str' = 'xla') -> 'KVPool'",
    },
    "jspec.tree": {
        "BuildTreeOutput": "class(tree_mask: 'jax.Array', positions: 'jax.Array', retrive_index: 'jax.Array', "
        "retrive_next_token: 'jax.Array', retrive_next_sibling: 'jax.Array', "
        "draft_tokens: 'jax.Array', is_valid: 'jax.Array') -> None",
        "LossyThresholds": "class(threshold_single: 'float' = 1.0, threshold_acc: 'float' = 1.0) -> None",
        "TreeMaskMode": "enum(FULL_MASK=0, QLEN_ONLY=1, QLEN_ONLY_BITPACKING=2)",
        "accept_kv_move_pairs": "def(req_to_token: 'jax.Array', req_pool_indices: 'jax.Array', "
        "seq_lens: 'jax.Array', out_cache_loc: 'jax.Array', accept_index: 'jax.Array', "
        "accept_lens: 'jax.Array', valid: 'jax.Array | None' = None) -> 'tuple[jax.Array, "
        "jax.Array, jax.Array]'",
        "build_tree_kernel_efficient": "def(bonus_tokens: 'jax.Array', parent_list: 'jax.Array', "
        "top_scores_index: 'jax.Array', draft_tokens: 'jax.Array', seq_lens: 'jax.Array', *, "
        "geometry: 'TreeGeometry', mode: 'TreeMaskMode' = <TreeMaskMode.FULL_MASK: 0>, "
        "max_seq_len: 'int | None' = None, fill_prefix_mask: 'bool' = True, "
        "impl: 'str' = 'xla', interpret: 'bool | None' = None, "
        "probe_valid_tree: 'bool' = True) -> 'BuildTreeOutput'",
        "compact_accept_to_front": "def(predict: 'jax.Array', hidden: 'jax.Array | None', accept_index: 'jax.Array', *, "
        "num_draft_tokens: 'int') -> 'tuple[jax.Array, jax.Array | None]'",
        "draft_out_cache_loc": "def(req_to_token: 'jax.Array', req_pool_indices: 'jax.Array', "
        "seq_lens: 'jax.Array', *, geometry: 'TreeGeometry', "
        "valid: 'jax.Array | None' = None, impl: 'str' = 'xla', "
        "interpret: 'bool | None' = None) -> 'jax.Array'",
        "draft_positions": "def(seq_lens: 'jax.Array', *, topk: 'int') -> 'jax.Array'",
        "duplicate_prefix_tail_to_draft_branches": "def(draft_pool: 'KVPool', req_to_token: 'jax.Array', req_pool_indices: 'jax.Array', "
        "seq_lens: 'jax.Array', *, geometry: 'TreeGeometry', max_pairs: 'int | None' = None, "
        "valid: 'jax.Array | None' = None, impl: 'str' = 'xla', "
        "move_impl: 'str | None' = None, interpret: 'bool | None' = None) -> 'KVPool'",
        "eagle_sample_greedy": "def(logits: 'jax.Array', candidates: 'jax.Array', retrive_index: 'jax.Array', "
        "retrive_next_token: 'jax.Array', retrive_next_sibling: 'jax.Array', *, "
        "num_spec_steps: 'int', impl: 'str' = 'xla', "
        "interpret: 'bool | None' = None) -> 'tuple[jax.Array, jax.Array, jax.Array]'",
        "fill_accept_out_cache_loc": "def(accept_index: 'jax.Array', out_cache_loc: 'jax.Array') -> 'jax.Array'",
        "fill_bonus_tokens": "def(accept_tokens: 'jax.Array', accept_lens: 'jax.Array') -> 'jax.Array'",
        "flatten_full_mask": "def(tree_mask, seq_lens) -> 'np.ndarray'",
        "get_src_tgt_cache_loc": "def(seq_lens: 'jax.Array', out_cache_loc: 'jax.Array', accept_index: 'jax.Array', "
        "accept_length: 'jax.Array', *, num_draft_tokens: 'int', page_size: 'int', "
        "valid: 'jax.Array | None' = None) -> 'tuple[jax.Array, jax.Array, jax.Array, "
        "jax.Array]'",
        "max_prefix_tail_pairs": "def(batch_size: 'int', *, geometry: 'TreeGeometry') -> 'int'",
        "move_accept_tokens_to_target_kvcache": "def(target_pool: 'KVPool', req_to_token: 'jax.Array', "
        "req_pool_indices: 'jax.Array', seq_lens: 'jax.Array', out_cache_loc: 'jax.Array', "
        "accept_index: 'jax.Array', accept_lens: 'jax.Array', *, "
        "valid: 'jax.Array | None' = None, impl: 'str' = 'xla', "
        "interpret: 'bool | None' = None) -> 'KVPool'",
        "organize_draft_results": "def(score_list: 'list[jax.Array] | tuple[jax.Array, ...]', "
        "token_list: 'list[jax.Array] | tuple[jax.Array, ...]', "
        "parents_list: 'list[jax.Array] | tuple[jax.Array, ...]', *, "
        "num_draft_tokens: 'int') -> 'tuple[jax.Array, jax.Array, jax.Array]'",
        "prefix_tail_copy_pairs": "def(req_to_token: 'jax.Array', req_pool_indices: 'jax.Array', "
        "seq_lens: 'jax.Array', *, geometry: 'TreeGeometry', max_pairs: 'int', "
        "valid: 'jax.Array | None' = None, impl: 'str' = 'xla', "
        "interpret: 'bool | None' = None) -> 'tuple[jax.Array, jax.Array, jax.Array]'",
        "prepare_for_draft": "def(draft_pool: 'KVPool', req_to_token: 'jax.Array', req_pool_indices: 'jax.Array', "
        "seq_lens: 'jax.Array', *, geometry: 'TreeGeometry', max_pairs: 'int | None' = None, "
        "valid: 'jax.Array | None' = None, impl: 'str' = 'xla', "
        "move_impl: 'str | None' = None, interpret: 'bool | None' = None, "
        "return_ok: 'bool' = False) -> 'Any'",
        "sample_from_probs": "def(probs: 'jax.Array', coins: 'jax.Array') -> 'jax.Array'",
        "seed_words": "def(seed: 'int') -> 'tuple[int, int]'",
        "select_top_k_tokens": "def(step: 'int', topk_p: 'jax.Array', topk_index: 'jax.Array', hidden: 'jax.Array', "
        "scores: 'jax.Array | None', *, topk: 'int', "
        "vocab_size: 'int | None' = None) -> 'tuple[jax.Array, jax.Array, jax.Array, "
        "tuple[jax.Array, jax.Array, jax.Array]]'",
        "target_probs_from_logits": "def(logits: 'jax.Array', temperatures: 'jax.Array', "
        "top_ks: 'jax.Array | None' = None, top_ps: 'jax.Array | None' = None, "
        "min_ps: 'jax.Array | None' = None) -> 'jax.Array'",
        "topk_probs": "def(logits: 'jax.Array', topk: 'int', *, impl: 'str' = 'xla', "
        "interpret: 'bool | None' = None, block_rows: 'int | None' = None, "
        "num_warps: 'int | None' = None, "
        "block_cols: 'int | None' = None) -> 'tuple[jax.Array, jax.Array]'",
        "tree_sampling_verify": "def(candidates: 'jax.Array', retrive_index: 'jax.Array', "
        "retrive_next_token: 'jax.Array', retrive_next_sibling: 'jax.Array', "
        "coins: 'jax.Array', final_coins: 'jax.Array', target_probs: 'jax.Array', *, "
        "num_spec_steps: 'int', lossy: 'LossyThresholds | None' = None, "
        "predicts_init: 'int' = 0) -> 'tuple[jax.Array, jax.Array, jax.Array]'",
        "tree_speculative_sampling_target_only": "def(candidates: 'jax.Array', retrive_index: 'jax.Array', "
        "retrive_next_token: 'jax.Array', retrive_next_sibling: 'jax.Array', "
        "uniform_samples: 'jax.Array', uniform_samples_for_final_sampling: 'jax.Array', "
        "target_probs: 'jax.Array', *, num_spec_steps: 'int', "
        "threshold_single: 'float | jax.Array' = 1.0, "
        "threshold_acc: 'float | jax.Array' = 1.0, deterministic: 'bool' = True, "
        "predicts_init: 'int' = 0) -> 'tuple[jax.Array, jax.Array, jax.Array]'",
        "uniform_coins": "def(seeds: 'jax.Array', stream: 'int', positions: 'jax.Array', "
        "num_nodes: 'int | None' = None) -> 'jax.Array'",
        "verify_out_cache_loc": "def(req_to_token: 'jax.Array', req_pool_indices: 'jax.Array', "
        "seq_lens: 'jax.Array', *, num_draft_tokens: 'int', "
        "valid: 'jax.Array | None' = None) -> 'jax.Array'",
        "verify_tree_greedy": "def(candidates: 'jax.Array', retrive_index: 'jax.Array', "
        "retrive_next_token: 'jax.Array', retrive_next_sibling: 'jax.Array', "
        "target_predict: 'jax.Array', *, num_spec_steps: 'int', predicts_init: 'int' = 0, "
        "impl: 'str' = 'xla', interpret: 'bool | None' = None) -> 'tuple[jax.Array, "
        "jax.Array, jax.Array]'",
    },
    "jspec.attention_meta": {
        "AttentionMetadata": "class(page_table: 'jax.Array', kv_lens: 'jax.Array', "
        "q_lens: 'jax.Array | None' = None, tail_slot_ids: 'jax.Array | None' = None, "
        "tail_mask: 'jax.Array | None' = None, page_size: 'int' = 1, causal: 'bool' = False, "
        "max_kv_len: 'int | None' = None, max_prefix_len: 'int | None' = None) -> None",
        "DraftDecodeMetadata": "class(normal: 'NormalMetadata', expand: 'ExpandMetadata') -> None",
        "ExpandMetadata": "class(cache_seqlens: 'jax.Array', cu_seqlens_q: 'jax.Array', "
        "cu_seqlens_k: 'jax.Array', page_table: 'jax.Array') -> None",
        "NormalMetadata": "class(cache_seqlens: 'jax.Array', cu_seqlens_q: 'jax.Array', "
        "cu_seqlens_k: 'jax.Array', page_table: 'jax.Array') -> None",
        "causal_tail_mask": "def(num_rows: 'int', num_queries: 'int') -> 'jax.Array'",
        "draft_decode_metadata": "def(req_to_token: 'jax.Array', req_pool_indices: 'jax.Array', "
        "seq_lens: 'jax.Array', out_cache_loc: 'jax.Array', *, geometry: 'TreeGeometry', "
        "max_pages: 'int', impl: 'str' = 'xla', "
        "interpret: 'bool | None' = None) -> 'DraftDecodeMetadata'",
        "draft_decode_normal_metadata": "def(req_to_token: 'jax.Array', req_pool_indices: 'jax.Array', "
        "seq_lens: 'jax.Array', *, geometry: 'TreeGeometry', "
        "max_pages: 'int') -> 'NormalMetadata'",
        "draft_decode_set_expand_metadata": "def(last_page_lens: 'jax.Array', decode_length: 'int', cache_loc: 'jax.Array', *, "
        "geometry: 'TreeGeometry', page_table_width: 'int | None' = None, "
        "num_cols: 'int | None' = None, impl: 'str' = 'xla', "
        "interpret: 'bool | None' = None) -> 'tuple[jax.Array, jax.Array]'",
        "draft_kv_indices_triton_launch": "def(num_seqs: 'int', kv_indices_width: 'int', row_width: 'int', *, "
        "geometry: 'TreeGeometry', block_tokens: 'int' = 1024) -> 'TritonLaunch'",
        "draft_kv_indices_used_len": "def(sum_seq_lens: 'Any', topk: 'int', num_seqs_times_topk: 'Any', "
        "it: 'Any') -> 'Any'",
        "expand_page_table_triton_launch": "def(num_rows: 'int', row_stride: 'int', *, decode_length: 'int', "
        "geometry: 'TreeGeometry', page_table_width: 'int | None' = None, "
        "num_cols: 'int | None' = None, block_rows: 'int' = 128) -> 'TritonLaunch'",
        "generate_draft_decode_kv_indices": "def(req_pool_indices: 'jax.Array', req_to_token: 'jax.Array', "
        "seq_lens: 'jax.Array', *, geometry: 'TreeGeometry', kv_indices_width: 'int', "
        "max_bs: 'int | None' = None, max_seq_len: 'int | None' = None, "
        "kv_indices_buffer: 'jax.Array | None' = None, impl: 'str' = 'xla', "
        "interpret: 'bool | None' = None, block_tokens: 'int' = 1024) -> 'tuple[jax.Array, "
        "jax.Array]'",
        "row_page_table": "def(req_to_token: 'jax.Array', req_pool_indices: 'jax.Array', *, page_size: 'int', "
        "max_pages: 'int') -> 'jax.Array'",
    },
    "jspec.kernels": {},
    "jspec.engine": {
        "AttentionBackend": "class(*args, **kwargs)",
        "AttnFn": "alias of collections.abc.Callable",
        "AttnPlan": "class(write_slot_ids: 'jax.Array', passes: 'tuple[AttentionMetadata, ...]') "
        "-> None",
        "DraftModel": "class(*args, **kwargs)",
        "Engine": "class(ecfg: 'EngineConfig', target: 'TargetModel', target_params: 'Any', "
        "draft: 'DraftModel | None' = None, draft_params: 'Any' = None, *, "
        "num_devices: 'int' = 1, eos_token_id: 'int | Sequence[int] | None' = None, "
        "check_every_step: 'bool' = False, checkify: 'bool' = False, "
        "admission: 'str' = 'reserve', max_rounds: 'int' = 32, adaptive: 'bool' = False, "
        "lossy_thresholds: 'LossyThresholds | None' = None) -> 'None'",
        "EngineConfig": "class(spec: 'SpecConfig', max_prompt_len: 'int', batch_buckets: 'tuple[int, ...]', "
        "prefill_batch: 'int' = 1, draft_attention: 'str' = 'cascade', "
        "kernels: 'KernelPolicy' = KernelPolicy(bookkeeping='xla', attention='xla', "
        "gemm='xla', cublas_min_tokens=0, rms_norm='xla', topk_probs='xla'), "
        "tensor_parallel: 'int' = 1, attention_backend: 'Any' = None, "
        "chunked_prefill_size: 'int' = 8192, prefill_buckets: 'tuple[int, "
        "...] | None' = None, mem_fraction_static: 'float | None' = None, "
        "kv_len_buckets: 'tuple[int, ...]' = ()) -> None",
        "EngineState": "class(kv: 'Any', carry: 'SpecCarry') -> None",
        "GreedyStepOutput": "class(next_tokens: 'jax.Array', ok: 'jax.Array') -> None",
        "InputError": "exception(ValueError)",
        "KERNEL_CHOICES": "= {'bookkeeping': ('xla', 'pallas'), 'attention': ('xla', 'triton', "
        "'cudnn'), 'gemm': ('xla', 'cublas'), 'rms_norm': ('xla', 'triton'), 'topk_probs': "
        "('xla', 'pallas', 'triton')}",
        "KVBackend": "class(*args, **kwargs)",
        "KVView": "class(token_table: 'jax.Array', rows: 'jax.Array', seq_lens: 'jax.Array', "
        "valid: 'jax.Array') -> None",
        "KernelPolicy": "class(bookkeeping: 'str' = 'xla', attention: 'str' = 'xla', gemm: 'str' = 'xla', "
        "cublas_min_tokens: 'int' = 0, rms_norm: 'str' = 'xla', "
        "topk_probs: 'str' = 'xla') -> None",
        "PagedAttentionBackend": "class(impl: 'str' = 'xla') -> None",
        "PagedKVBackend": "class(ecfg: 'EngineConfig') -> None",
        "PagedKVState": "class(allocator: 'PagedAllocator', req_rows: 'ReqRowAllocator', "
        "req_to_token: 'jax.Array', target_pool: 'KVPool', draft_pool: 'KVPool | None', "
        "committed_lens: 'jax.Array', allocated_lens: 'jax.Array', "
        "req_pool_indices: 'jax.Array', live: 'jax.Array') -> None",
        "PrefillOutput": "class(first_tokens: 'jax.Array', ok: 'jax.Array') -> None",
        "Request": "class(rid: 'int', prompt: 'list[int]', max_new_tokens: 'int', "
        "arrival_step: 'int' = 0, "
        "sampling: 'SamplingParams' = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, "
        "min_p=0.0, seed=None), output: 'list[int]' = <factory>, "
        "accept_lens: 'list[int]' = <factory>, shard: 'int' = -1, slot: 'int' = -1, "
        "prefill_ids: 'list[int]' = <factory>, prefilled: 'int' = 0, "
        "admitted_at: 'int' = -1, ttft_s: 'float' = -1.0, num_preemptions: 'int' = 0, "
        "stop_scanned: 'int' = 0) -> None",
        "RunStats": "class(mode: 'str', num_requests: 'int' = 0, num_tokens: 'int' = 0, "
        "num_decode_steps: 'int' = 0, prefill_s: 'float' = 0.0, decode_s: 'float' = 0.0, "
        "wall_s: 'float' = 0.0, accept_lens: 'list[int]' = <factory>, "
        "batch_sizes: 'list[int]' = <factory>, step_s: 'list[float]' = <factory>, "
        "request_accept_lens: 'list[list[int]]' = <factory>, "
        "ttft_s: 'list[float]' = <factory>, num_prefill_calls: 'int' = 0, "
        "num_preemptions: 'int' = 0, leak_check: 'str' = '', "
        "sampling: 'list[SamplingParams]' = <factory>, policy: 'list[tuple[str, "
        "int]]' = <factory>) -> None",
        "RoundsOutput": "class(tokens: 'jax.Array', lens: 'jax.Array', num_rounds: 'jax.Array', "
        "ok: 'jax.Array') -> None",
        "Runner": "class(ecfg: 'EngineConfig', target: 'TargetModel', "
        "draft: 'DraftModel | None' = None, kv: 'KVBackend | None' = None, "
        "max_kv_len: 'int | None' = None, max_prefix_len: 'int | None' = None) -> 'None'",
        "SamplingBatch": "class(temperature: 'jax.Array', seed: 'jax.Array', "
        "top_k: 'jax.Array | None' = None, top_p: 'jax.Array | None' = None, "
        "min_p: 'jax.Array | None' = None, lossy: 'LossyThresholds | None' = None) -> None",
        "SamplingParams": "class(temperature: 'float' = 0.0, top_k: 'int' = 0, top_p: 'float' = 1.0, "
        "min_p: 'float' = 0.0, seed: 'int | None' = None) -> None",
        "SpecCarry": "class(bonus_tokens: 'jax.Array', topk_p: 'jax.Array', topk_index: 'jax.Array', "
        "draft_hidden: 'jax.Array') -> None",
        "SpecPolicy": "class(alpha: 'float' = 0.3, warmup: 'int' = 2, try_plain_below: 'float' = 2.0, "
        "probe_every: 'int' = 4, max_probe_every: 'int' = 64, retire_after: 'int' = 2, "
        "accept_len: 'float | None' = None, t_spec: 'float | None' = None, "
        "t_plain: 'float | None' = None, spec_dispatches: 'int' = 0, "
        "plain_dispatches: 'int' = 0, plain_streak: 'int' = 0, failed_probes: 'int' = 0, "
        "probe_interval: 'int | None' = None, accepted_any: 'bool' = False, "
        "retired: 'bool' = False) -> None",
        "SpecStepOutput": "class(accept_tokens: 'jax.Array', accept_lens: 'jax.Array', ok: 'jax.Array') -> None",
        "TargetModel": "class(*args, **kwargs)",
        "Weights": "class(target: 'Any', draft: 'Any' = None) -> None",
        "decode_rounds": "def(step: 'Callable[..., Any]', runner: 'Runner', weights: 'Weights', "
        "state: 'EngineState', slot_idx: 'jax.Array', live: 'jax.Array', budget: 'jax.Array', "
        "eos_ids: 'jax.Array', num_rounds: 'int | jax.Array', "
        "sampling: 'SamplingBatch | None' = None, *, max_rounds: 'int' = 32) -> "
        "'tuple[EngineState, RoundsOutput]'",
        "greedy_step": "def(runner: 'Runner', weights: 'Weights', state: 'EngineState', "
        "slot_idx: 'jax.Array', live: 'jax.Array', "
        "sampling: 'SamplingBatch | None' = None) -> 'tuple[EngineState, GreedyStepOutput]'",
        "init_engine_state": "def(runner: 'Runner', kv: 'Any' = None) -> 'EngineState'",
        "kv_bytes_per_token": "def(target: 'Any', draft: 'Any' = None) -> 'int'",
        "make_engine_config": "def(target: 'Any', *, page_size: 'int' = 16, topk: 'int' = 4, num_steps: 'int' = 3, "
        "num_draft_tokens: 'int' = 8, context_len: 'int' = 256, "
        "max_running_requests: 'int' = 8, max_prompt_len: 'int' = 64, "
        "num_pages: 'int | None' = None, batch_buckets: 'tuple[int, ...] | None' = None, "
        "prefill_batch: 'int' = 1, draft_attention: 'str' = 'cascade', impl: 'str' = 'auto', "
        "tensor_parallel: 'int' = 1, attention_impl: 'str' = 'auto', "
        "gemm_impl: 'str' = 'auto', rms_norm_impl: 'str' = 'auto', "
        "topk_probs_impl: 'str' = 'auto', attention_backend: 'Any' = None, "
        "chunked_prefill_size: 'int' = 8192, prefill_buckets: 'tuple[int, "
        "...] | None' = None, mem_fraction_static: 'float | None' = None, "
        "draft: 'Any' = None, kv_len_buckets: 'tuple[int, "
        "...] | None' = None) -> 'EngineConfig'",
        "num_pages_for_memory": "def(target: 'Any', draft: 'Any', *, page_size: 'int', mem_fraction_static: 'float', "
        "tensor_parallel: 'int' = 1, memory: 'tuple[int, int] | None' = None, "
        "workspace_bytes: 'int' = 0) -> 'int'",
        "prefill": "def(runner: 'Runner', weights: 'Weights', state: 'EngineState', "
        "slot_idx: 'jax.Array', prompt_ids: 'jax.Array', prompt_lens: 'jax.Array', "
        "sampling: 'SamplingBatch | None' = None) -> 'tuple[EngineState, PrefillOutput]'",
        "prefill_chunk": "def(runner: 'Runner', weights: 'Weights', state: 'EngineState', "
        "slot_idx: 'jax.Array', token_ids: 'jax.Array', chunk_lens: 'jax.Array', "
        "starts: 'jax.Array', is_last: 'jax.Array', next_ids: 'jax.Array', "
        "sampling: 'SamplingBatch | None' = None) -> 'tuple[EngineState, PrefillOutput]'",
        "release": "def(runner: 'Runner', state: 'EngineState', slot_idx: 'jax.Array', "
        "finished: 'jax.Array', *, return_ok: 'bool' = False) "
        "-> 'EngineState | tuple[EngineState, jax.Array]'",
        "resolve_kernel_policy": "def(*, impl: 'str' = 'auto', attention_impl: 'str' = 'auto', "
        "gemm_impl: 'str' = 'auto', rms_norm_impl: 'str' = 'auto', "
        "topk_probs_impl: 'str' = 'auto', hidden_size: 'int' = 0, "
        "vocab_size: 'int' = 0, dtype: 'Any' = None, backend: 'str | None' = None) -> "
        "'KernelPolicy'",
        "spec_decode_step": "def(runner: 'Runner', weights: 'Weights', state: 'EngineState', "
        "slot_idx: 'jax.Array', live: 'jax.Array', "
        "sampling: 'SamplingBatch | None' = None) -> 'tuple[EngineState, SpecStepOutput]'",
        "validate_requests": "def(prompts: 'Sequence[Sequence[int]]', max_new_tokens: 'int | Sequence[int]', *, "
        "vocab_size: 'int', max_prompt_len: 'int', context_len: 'int', "
        "arrivals: 'Sequence[int] | None' = None) -> 'tuple[list[list[int]], list[int], "
        "list[int]]'",
        "view_from_page_table": "def(page_table: 'jax.Array', seq_lens: 'jax.Array', valid: 'jax.Array', *, "
        "page_size: 'int') -> 'KVView'",
    },
    "jspec.models": {
        "with_kernel_policy": "def(model: 'Any', kernels: 'KernelPolicy') -> 'Any'",
        "MODEL_SCOPE": "= 'jspec_model'",
        "AttnFn": "alias of collections.abc.Callable",
        "Eagle1Draft": "class(config: 'LlamaConfig', capture_layers: 'tuple[int, ...]' = (), "
        "rms_norm_impl: 'str' = 'xla') -> None",
        "Eagle1Params": "class(fc: 'jax.Array', fc_bias: 'jax.Array | None', layer: 'LayerParams', "
        "final_norm: 'jax.Array | None') -> None",
        "Eagle3Config": "class(hidden_size: 'int', intermediate_size: 'int', num_heads: 'int', "
        "num_kv_heads: 'int', head_dim: 'int', vocab_size: 'int', draft_vocab_size: 'int', "
        "rms_norm_eps: 'float' = 1e-06, rope_theta: 'float' = 10000.0, "
        "rope_scaling: 'RopeScaling | None' = None, aux_layer_ids: 'tuple[int, "
        "...] | None' = None, num_aux: 'int' = 3, dtype: 'str' = 'float32') -> None",
        "Eagle3Draft": "class(config: 'Eagle3Config', capture_layers: 'tuple[int, ...]', "
        "rms_norm_impl: 'str' = 'xla') -> None",
        "Eagle3Params": "class(fc: 'jax.Array', fc_bias: 'jax.Array | None', hidden_norm: 'jax.Array', "
        "layer: 'LayerParams', final_norm: 'jax.Array', lm_head: 'jax.Array', "
        "d2t: 'jax.Array') -> None",
        "LayerParams": "class(attn_norm: 'jax.Array | None', wqkv: 'jax.Array', wo: 'jax.Array', "
        "mlp_norm: 'jax.Array', w_gate_up: 'jax.Array', w_down: 'jax.Array') -> None",
        "LlamaConfig": "class(vocab_size: 'int', hidden_size: 'int', intermediate_size: 'int', "
        "num_layers: 'int', num_heads: 'int', num_kv_heads: 'int', head_dim: 'int', "
        "rms_norm_eps: 'float' = 1e-06, rope_theta: 'float' = 10000.0, "
        "rope_scaling: 'RopeScaling | None' = None, tie_word_embeddings: 'bool' = False, "
        "dtype: 'str' = 'float32', bos_token_ids: 'tuple[int, ...]' = (), "
        "eos_token_ids: 'tuple[int, ...]' = (), "
        "max_position_embeddings: 'int' = 2048) -> None",
        "LlamaParams": "class(embed: 'jax.Array', layers: 'tuple', final_norm: 'jax.Array', "
        "lm_head: 'jax.Array | None') -> None",
        "LlamaTarget": "class(config: 'LlamaConfig', rms_norm_impl: 'str' = 'xla') -> None",
        "RopeScaling": "class(factor: 'float', low_freq_factor: 'float', high_freq_factor: 'float', "
        "original_max_position_embeddings: 'int', rope_type: 'str' = 'llama3') -> None",
        "Tokenizer": "class(tokenizer: 'Any', *, bos_token_ids: 'Sequence[int]' = (), "
        "eos_token_ids: 'Sequence[int]' = (), tokenizer_config: 'dict[str, "
        "Any] | None' = None) -> 'None'",
        "load_draft": "def(directory: 'str | os.PathLike', target: 'LlamaTarget', *, "
        "dtype: 'str | None' = None, device: 'Any' = None, "
        "progress: 'Progress | None' = None) -> 'tuple[Eagle3Draft | Eagle1Draft, "
        "Eagle3Params | Eagle1Params]'",
        "load_eagle1": "def(directory: 'str | os.PathLike', target: 'LlamaTarget', *, "
        "dtype: 'str | None' = None, device: 'Any' = None, "
        "progress: 'Progress | None' = None) -> 'tuple[Eagle1Draft, Eagle1Params]'",
        "load_eagle3": "def(directory: 'str | os.PathLike', target: 'LlamaTarget', *, "
        "dtype: 'str | None' = None, device: 'Any' = None, "
        "progress: 'Progress | None' = None) -> 'tuple[Eagle3Draft, Eagle3Params]'",
        "load_llama": "def(directory: 'str | os.PathLike', *, dtype: 'str | None' = None, "
        "device: 'Any' = None, progress: 'Progress | None' = None) -> 'tuple[LlamaTarget, "
        "LlamaParams]'",
        "load_llama_config": "def(directory: 'str | os.PathLike', *, dtype: 'str | None' = None) -> 'LlamaConfig'",
        "matched_eagle3": "def(target: 'LlamaTarget', target_params: 'LlamaParams', *, num_heads: 'int' = 4, "
        "intermediate_size: 'int | None' = None, draft_vocab_size: 'int | None' = None, "
        "capture_layers: 'tuple[int, ...] | None' = None, seed: 'int' = 0, "
        "gain: 'float' = 4.0, focus: 'float' = 3.0) -> 'tuple[Eagle3Draft, Eagle3Params]'",
        "parse_eagle3_config": "def(raw: 'dict[str, Any]', *, dtype: 'str | None' = None) -> 'Eagle3Config'",
        "parse_llama_config": "def(raw: 'dict[str, Any]', *, dtype: 'str | None' = None, "
        "allow_eagle1: 'bool' = False) -> 'LlamaConfig'",
        "read_eos_token_ids": "def(directory: 'str | os.PathLike') -> 'tuple[int, ...] | None'",
        "random_eagle3_params": "def(draft: 'Eagle3Draft', seed: 'int' = 0, *, "
        "target_vocab_size: 'int | None' = None) -> 'Eagle3Params'",
        "random_llama_params": "def(target: 'LlamaTarget', seed: 'int' = 0, *, "
        "scale: 'float' = 1.0) -> 'LlamaParams'",
        "save_eagle3": "def(directory: 'str | os.PathLike', draft: 'Eagle3Draft', params: 'Eagle3Params', "
        "*, num_target_layers: 'int | None' = None) -> 'None'",
        "save_llama": "def(directory: 'str | os.PathLike', target: 'LlamaTarget', params: 'LlamaParams', "
        "*, max_shard_bytes: 'int | None' = None) -> 'None'",
        "toy_eagle1": "def(target: 'LlamaTarget', target_params: 'LlamaParams', seed: 'int' = 1, *, "
        "hidden_mix: 'float' = 0.1) -> 'tuple[Eagle1Draft, Eagle1Params]'",
        "toy_llama_params": "def(target: 'LlamaTarget', seed: 'int' = 0, *, "
        "residual_scale: 'float' = 0.5) -> 'LlamaParams'",
    },
}


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_public_names(module_name):
    module = importlib.import_module(module_name)
    assert sorted(module.__all__) == sorted(RECORDED[module_name])
    assert len(set(module.__all__)) == len(module.__all__), "duplicate names in __all__"
    for name in module.__all__:
        assert hasattr(module, name), f"{module_name}.__all__ lists missing {name!r}"


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_public_signatures(module_name):
    got = _surface(module_name)
    changed = {
        name: (RECORDED[module_name].get(name), sig)
        for name, sig in got.items()
        if RECORDED[module_name].get(name) != sig
    }
    assert not changed, f"{module_name}: signatures changed (recorded, now): {changed}"


def test_one_name_per_op():
    """No public object is exported under two names across the concept namespaces."""
    seen: dict[int, str] = {}
    dup = []
    for module_name in ("jspec.kv", "jspec.tree", "jspec.attention_meta"):
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if id(obj) in seen and seen[id(obj)] != f"{module_name}.{name}":
                dup.append((seen[id(obj)], f"{module_name}.{name}"))
            seen.setdefault(id(obj), f"{module_name}.{name}")
    assert not dup, dup


def test_top_level_namespaces_are_lazy_and_reachable():
    import jspec

    for name in ("kv", "tree", "attention_meta", "probes", "sentinels"):
        assert getattr(jspec, name).__name__ == f"jspec.{name}"
    with pytest.raises(AttributeError):
        jspec.kernels_public_api_does_not_exist  # noqa: B018


def _render() -> str:
    lines = []
    for module_name in PUBLIC_MODULES:
        lines.append(f"    {module_name!r}: {{")
        for name, desc in _surface(module_name).items():
            entry = f"        {name!r}: {desc!r},"
            if len(entry) <= 100:
                lines.append(entry)
                continue
            lines.append(f"        {name!r}:")
            chunks, rest = [], desc
            while rest:
                cut = rest[:84]
                if len(rest) > 84 and cut.rfind(", ") > 20:
                    cut = rest[: cut.rfind(", ") + 2]
                chunks.append(cut)
                rest = rest[len(cut) :]
            lines += [f"            {c!r}" for c in chunks[:-1]] + [f"            {chunks[-1]!r},"]
        lines.append("    },")
    return "\n".join(lines)


if __name__ == "__main__":
    source = open(__file__).read()
    start = source.index("RECORDED: dict[str, dict[str, str]] = {\n") + len(
        "RECORDED: dict[str, dict[str, str]] = {\n"
    )
    end = source.index("\n}\n", start)
    table = _render()  # before the file is opened: a failure must not truncate it
    with open(__file__, "w") as f:
        f.write(source[:start] + table + source[end:])
    sys.exit(0)
