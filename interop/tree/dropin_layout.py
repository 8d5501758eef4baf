"""Drop-ins for the draft slot layout and the accepted-KV move (``jspec.tree.layout``/``accept``).

See :mod:`interop.tree.dropin` for the conventions. Pool objects are sglang-like: ``k_buffer``/
``v_buffer`` lists of ``[slots, H, D]`` tensors and a ``page_size``
(:class:`interop.kv.reference.MHATokenToKVPool`).

Signature differences from sglang 0.5.23 (recorded in tests/interop/sglang_0_5_23_signatures.py):
sglang's ``prepare_for_draft(draft_input, req_to_token_pool, batch, cuda_graph_runner,
draft_model_runner, topk, num_steps, *, ...)`` and ``move_accept_tokens_to_target_kvcache(batch,
accept_index, num_correct_drafts, token_to_kv_pool_allocator)`` take scheduler objects; these
take the tensors those functions read. ``duplicate_prefix_tail_to_draft_branches`` matches.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import torch

from interop._adapt import jspec_module as _mod
from interop._adapt import run_jspec, tree_geometry
from interop._adapt import to_jax_default as _j
from interop._adapt import to_torch_as as _t
from interop.kv.dropin import move_on_pool_obj as _move_on_pool_obj

__all__ = [
    "duplicate_prefix_tail_to_draft_branches",
    "move_accept_tokens_to_target_kvcache",
    "prepare_for_draft",
]


# ---- draft layout / accept ---------------------------------------------------------------------------
def prepare_for_draft(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    page_size: int,
    draft_token_to_kv_pool: Any = None,
    *,
    impl: str = "xla",
    interpret: bool | None = None,
) -> torch.Tensor:
    """``out_cache_loc`` i64[B*K*S]; duplicates the prefix tails into ``draft_token_to_kv_pool``."""
    layout = _mod("jspec.tree.layout")
    args = (
        _j(req_to_token, "req_to_token"),
        _j(req_pool_indices, "req_pool_indices"),
        _j(seq_lens, "seq_lens"),
    )
    kw = {
        "geometry": tree_geometry(topk=topk, num_steps=num_steps, page_size=page_size),
        "impl": impl,
        "interpret": interpret,
    }
    out = run_jspec(layout.draft_out_cache_loc, *args, **kw)
    if draft_token_to_kv_pool is not None and topk > 1 and page_size > 1:
        _move_on_pool_obj(
            draft_token_to_kv_pool,
            lambda pool: run_jspec(
                layout.duplicate_prefix_tail_to_draft_branches, pool, *args, **kw
            ),
        )
    return _t(out, seq_lens).reshape(-1)


def _steps_for(
    prefix_base: list[int], last_page: list[int], num_new_pages: list[int], page_size: int
) -> int:
    """A ``num_steps`` with ``ceil((lp + S) / P) == nnp`` for every request (jspec derives nnp)."""
    lo = max([(n - 1) * page_size - lp + 1 for lp, n in zip(last_page, num_new_pages)] + [1])
    hi = min([n * page_size - lp for lp, n in zip(last_page, num_new_pages)] + [lo])
    if lo > hi:
        raise ValueError(
            f"num_new_pages={num_new_pages} is inconsistent with last_page="
            f"{last_page}: no single num_steps gives ceil((lp+S)/P) == nnp"
        )
    return lo


def duplicate_prefix_tail_to_draft_branches(
    token_to_kv_pool: Any,
    rows: torch.Tensor,
    prefix_base: torch.Tensor,
    last_page: torch.Tensor,
    num_new_pages: torch.Tensor,
    topk: int,
    page_size: int,
    *,
    impl: str = "xla",
    interpret: bool | None = None,
) -> None:
    """In place into the draft pool object (``k_buffer``/``v_buffer`` lists), as sglang."""
    if topk <= 1 or page_size <= 1 or rows.shape[0] == 0:
        return
    bs = rows.shape[0]
    per_request = {
        "prefix_base": prefix_base,
        "last_page": last_page,
        "num_new_pages": num_new_pages,
    }
    for name, t in per_request.items():
        # NOTE: a shorter one would broadcast in prefix_base + last_page: wrong slots, no error.
        if tuple(t.shape) != (bs,):
            raise ValueError(f"{name}.shape={tuple(t.shape)} must be ({bs},), one per rows row")
    base, lp, nnp = (x.tolist() for x in (prefix_base, last_page, num_new_pages))
    steps = _steps_for(base, lp, nnp, page_size)
    table = _j(rows, "rows")
    seq = _j(prefix_base + last_page, "seq_lens")
    layout = _mod("jspec.tree.layout")
    _move_on_pool_obj(
        token_to_kv_pool,
        lambda pool: run_jspec(
            layout.duplicate_prefix_tail_to_draft_branches,
            pool,
            table,
            jnp.arange(bs, dtype=jnp.int32),
            seq,
            geometry=tree_geometry(topk=topk, num_steps=steps, page_size=page_size),
            impl=impl,
            interpret=interpret,
        ),
    )


def move_accept_tokens_to_target_kvcache(
    token_to_kv_pool: Any,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_index: torch.Tensor,
    accept_lens: torch.Tensor,
    *,
    impl: str = "xla",
    interpret: bool | None = None,
):
    """Moves the accepted target KV in place; returns the ``(tgt, src)`` i64 pairs."""
    accept = _mod("jspec.tree.accept")
    tgt, src, _ = run_jspec(
        accept.accept_kv_move_pairs,
        _j(req_to_token, "req_to_token"),
        _j(req_pool_indices, "req_pool_indices"),
        _j(seq_lens, "seq_lens"),
        _j(out_cache_loc, "out_cache_loc"),
        _j(accept_index, "accept_index"),
        _j(accept_lens, "accept_lens"),
    )
    _move_on_pool_obj(
        token_to_kv_pool,
        lambda pool: run_jspec(
            _mod("jspec.kv.pool").move_kv_cache, pool, tgt, src, impl=impl, interpret=interpret
        ),
    )
    return _t(tgt, seq_lens), _t(src, seq_lens)
