"""Sentinel values of jspec's index arrays, each defined once (sglang's values).

Padding rows of a batch point at the reserved padding entries (page 0, its slots ``0..P-1`` and
req_to_token row 0), so a padded entry never touches live KV. Tree outputs mark missing nodes
and unaccepted positions with -1, as sglang does.
"""

from __future__ import annotations

__all__ = [
    "NOT_ACCEPTED",
    "NO_NODE",
    "PAD_PAGE_ID",
    "PAD_ROW",
    "PAD_SLOT_ID",
    "ROOT_PARENT",
    "SEQ_LEN_FILL_VALUE",
]

# Token slot of padding entries (out_cache_loc, unused move pairs ``0 -> 0``): slot 0 lies in
# the reserved padding page 0.
PAD_SLOT_ID = 0
# Page id of unused free-list / page-table entries: page 0, never allocated.
PAD_PAGE_ID = 0
# req_to_token row of padding requests (``req_pool_indices``): row 0, never allocated.
PAD_ROW = 0
# sglang's ``get_cuda_graph_seq_len_fill_value()`` (FA3, FlashInfer, Triton): seq_len of a
# padding request in a padded batch bucket.
SEQ_LEN_FILL_VALUE = 1
# Missing tree node (retrive_next_token / retrive_next_sibling, sglang -1).
NO_NODE = -1
# accept_index / predict filler for positions past the accepted path (sglang initialises
# accept_index with -1).
NOT_ACCEPTED = -1
# parent of the tree root in ``parents_list`` (sglang -1).
ROOT_PARENT = -1
