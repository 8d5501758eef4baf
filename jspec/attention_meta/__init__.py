"""Attention metadata: the per-pass ``AttentionMetadata`` (page table + lengths + a small tail)
that attention backends consume, and sglang's draft-decode metadata for FA3 (page tables) and
FlashInfer (kv_indices).

sglang's ``draft_decode_set_expand_metadata`` (FA3 pass B), the pass-A page table and
``generate_draft_decode_kv_indices`` over the holey draft layout. Every op takes arrays plus
``geometry=`` (:class:`jspec.config.TreeGeometry`: topk, num_steps, page_size); ``impl=`` picks
the kernel.
``*_triton_launch`` hand the raw Triton kernels to callers that launch them on their own tensors
(PyTorch: ``interop.triton_meta``).
"""

from __future__ import annotations

from jspec.attention_meta.kv_indices import (
    draft_kv_indices_triton_launch,
    draft_kv_indices_used_len,
    generate_draft_decode_kv_indices,
)
from jspec.attention_meta.metadata import AttentionMetadata, causal_tail_mask, row_page_table
from jspec.attention_meta.page_table import (
    DraftDecodeMetadata,
    ExpandMetadata,
    NormalMetadata,
    draft_decode_metadata,
    draft_decode_normal_metadata,
    draft_decode_set_expand_metadata,
    expand_page_table_triton_launch,
)

__all__ = [
    "AttentionMetadata",
    "DraftDecodeMetadata",
    "ExpandMetadata",
    "NormalMetadata",
    "causal_tail_mask",
    "draft_decode_metadata",
    "draft_decode_normal_metadata",
    "draft_decode_set_expand_metadata",
    "draft_kv_indices_triton_launch",
    "draft_kv_indices_used_len",
    "expand_page_table_triton_launch",
    "generate_draft_decode_kv_indices",
    "row_page_table",
]
