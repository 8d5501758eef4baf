"""jspec behind sglang's signatures: req_to_token, KV pool moves, draft layout, accepted-KV move.

See :mod:`interop.torch_api` for the conventions. jspec's ``move_kv_cache`` donates its pool, so
torch's per-layer buffers are stacked into an XLA-owned ``KVPool`` (one copy: never a donated
alias of torch memory) and the result is copied back layer by layer. Pool objects are
sglang-like: ``k_buffer``/``v_buffer`` lists of ``[slots, H, D]`` tensors and a ``page_size``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch

from interop._adapt import jspec_module as _mod
from interop._adapt import to_jax_default as _j
from interop._adapt import to_torch_as as _t
from interop.dlpack import to_jax, to_torch


# ---- req_to_token / KV pool ----------------------------------------------------------------------
def assign_req_to_token_pool(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    batch_size: int,
    *,
    impl: str = "xla",
    interpret: bool | None = None,
) -> None:
    """In place into ``req_to_token`` (i32[rows, W]); see the torch reference."""
    n = int(batch_size)
    table = _mod("jspec.kv.req_to_token").assign_req_to_token_pool(
        _j(req_to_token, "req_to_token"),
        _j(req_pool_indices[:n], "req_pool_indices"),
        _j(start_offset[:n], "start_offset"),
        _j(end_offset[:n], "end_offset"),
        _j(out_cache_loc, "out_cache_loc"),
        impl=impl,
        interpret=interpret,
    )
    req_to_token.copy_(to_torch(table))


def _stack(buffers: Any) -> jax.Array:
    if isinstance(buffers, torch.Tensor):  # already [layers, slots, H, D]
        return to_jax(buffers, safe_for_donation=True, what="kv buffers", device="default")
    return jnp.stack([_j(b, "kv buffer") for b in buffers])  # XLA-owned copy


def _write_back(buffers: Any, stacked: jax.Array) -> None:
    out = to_torch(stacked)
    if isinstance(buffers, torch.Tensor):
        buffers.copy_(out)
        return
    for layer, buf in enumerate(buffers):
        buf.copy_(out[layer])


def _kv_pool(k_buffers: Any, v_buffers: Any, page_size: int) -> Any:
    return _mod("jspec.kv.pool").KVPool(
        k=_stack(k_buffers), v=_stack(v_buffers), page_size=page_size
    )


def _page_size_of(pool_obj: Any) -> int:
    return int(getattr(pool_obj, "page_size", 1))


def move_kv_cache(
    k_buffers: Any,
    v_buffers: Any,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
    *,
    impl: str = "auto",
    interpret: bool | None = None,
) -> None:
    """In place over every layer's K and V buffer: ``buf[tgt] = buf[src]`` (gather, then scatter).

    ``k_buffers``/``v_buffers``: lists of ``[slots, H, D]`` tensors (sglang) or one stacked
    ``[layers, slots, H, D]`` tensor each.
    """
    if tgt_loc.numel() == 0 or len(k_buffers) == 0:
        return
    pool = _kv_pool(k_buffers, v_buffers, 1)
    pool = _mod("jspec.kv.pool").move_kv_cache(
        pool, _j(tgt_loc, "tgt_loc"), _j(src_loc, "src_loc"), impl=impl, interpret=interpret
    )
    _write_back(k_buffers, pool.k)
    _write_back(v_buffers, pool.v)


def _move_on_pool_obj(token_to_kv_pool: Any, fn: Any) -> None:
    """Run ``fn(KVPool) -> KVPool`` on an sglang-like pool object (k_buffer/v_buffer lists)."""
    pool = _kv_pool(
        token_to_kv_pool.k_buffer, token_to_kv_pool.v_buffer, _page_size_of(token_to_kv_pool)
    )
    pool = fn(pool)
    _write_back(token_to_kv_pool.k_buffer, pool.k)
    _write_back(token_to_kv_pool.v_buffer, pool.v)


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
        "topk": topk,
        "num_steps": num_steps,
        "page_size": page_size,
        "impl": impl,
        "interpret": interpret,
    }
    out = layout.draft_out_cache_loc(*args, **kw)
    if draft_token_to_kv_pool is not None and topk > 1 and page_size > 1:
        _move_on_pool_obj(
            draft_token_to_kv_pool,
            lambda pool: layout.duplicate_prefix_tail_to_draft_branches(pool, *args, **kw),
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
    base, lp, nnp = (x.tolist() for x in (prefix_base, last_page, num_new_pages))
    steps = _steps_for(base, lp, nnp, page_size)
    bs = rows.shape[0]
    table = _j(rows, "rows")
    seq = _j(prefix_base + last_page, "seq_lens")
    layout = _mod("jspec.tree.layout")
    _move_on_pool_obj(
        token_to_kv_pool,
        lambda pool: layout.duplicate_prefix_tail_to_draft_branches(
            pool,
            table,
            jnp.arange(bs, dtype=jnp.int32),
            seq,
            topk=topk,
            num_steps=steps,
            page_size=page_size,
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
    impl: str = "auto",
    interpret: bool | None = None,
):
    """Moves the accepted target KV in place; returns the ``(tgt, src)`` i64 pairs."""
    accept = _mod("jspec.tree.accept")
    tgt, src, _ = accept.accept_kv_move_pairs(
        _j(req_to_token, "req_to_token"),
        _j(req_pool_indices, "req_pool_indices"),
        _j(seq_lens, "seq_lens"),
        _j(out_cache_loc, "out_cache_loc"),
        _j(accept_index, "accept_index"),
        _j(accept_lens, "accept_lens"),
    )
    _move_on_pool_obj(
        token_to_kv_pool,
        lambda pool: _mod("jspec.kv.pool").move_kv_cache(
            pool, tgt, src, impl=impl, interpret=interpret
        ),
    )
    return _t(tgt, seq_lens), _t(src, seq_lens)
