"""Drop-ins for the req_to_token pool, the KV pool and the decode sizing (jspec behind sglang).

* ``assign_req_to_token_pool_func``: sglang 0.5.23 ``srt/mem_cache/allocation.py`` (the Python
  launcher of the ``assign_req_to_token_pool`` Triton kernel; reads the first ``batch_size``
  entries of the per-request tensors and a packed prefix of ``out_cache_loc``).
* ``page_aligned_decode_alloc_lens``: ``srt/mem_cache/allocation_sizing.py`` (``reserve`` and
  ``page_size`` keyword-only, as sglang).
* ``get_alloc_len_per_decode``: sglang reads ``server_args``; here they are keyword arguments
  (a documented signature difference).
* ``move_kv_cache``: sglang's is a method of its KV pools (``pool.move_kv_cache(tgt, src)``);
  this function takes the pool's per-layer buffers. Pool objects in :mod:`interop.kv.reference`
  and :mod:`interop.tree.dropin_layout` call it.

jspec's ``move_kv_cache`` donates its pool, so torch's per-layer buffers are stacked into an
XLA-owned ``KVPool`` (one copy: never a donated alias of torch memory) and copied back.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch

from interop._adapt import jspec_module as _mod
from interop._adapt import run_jspec
from interop._adapt import to_jax_default as _j
from interop._adapt import to_torch_as as _t
from interop.dlpack import to_jax, to_torch
from interop.kv.dropin_allocator import PagedTokenToKVPoolAllocator, get_last_loc

__all__ = [
    "PagedTokenToKVPoolAllocator",
    "assign_req_to_token_pool_func",
    "get_alloc_len_per_decode",
    "get_last_loc",
    "move_kv_cache",
    "page_aligned_decode_alloc_lens",
]


def assign_req_to_token_pool_func(
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
    """In place into ``req_to_token`` (i32[rows, W]); see :mod:`interop.kv.reference`."""
    n = int(batch_size)
    table = run_jspec(
        _mod("jspec.kv.req_to_token").assign_req_to_token_pool,
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
    # NOTE: under no_grad, as sglang's Triton copy writes: a buffer with requires_grad would
    # otherwise raise at its copy_, after the layers (or the K buffers) before it were written.
    out = to_torch(stacked)
    with torch.no_grad():
        if isinstance(buffers, torch.Tensor):
            buffers.copy_(out)
            return
        for layer, buf in enumerate(buffers):
            buf.copy_(out[layer])


def kv_pool_of(k_buffers: Any, v_buffers: Any, page_size: int) -> Any:
    """A jspec ``KVPool`` (XLA-owned copy) of per-layer torch buffers."""
    return _mod("jspec.kv.pool").KVPool(
        k=_stack(k_buffers), v=_stack(v_buffers), page_size=page_size
    )


def move_on_pool_obj(token_to_kv_pool: Any, fn: Any) -> None:
    """Run ``fn(KVPool) -> KVPool`` on an sglang-like pool object (k_buffer/v_buffer lists)."""
    k, v = token_to_kv_pool.k_buffer, token_to_kv_pool.v_buffer
    pool = fn(kv_pool_of(k, v, int(getattr(token_to_kv_pool, "page_size", 1))))
    _write_back(k, pool.k)
    _write_back(v, pool.v)


def move_kv_cache(
    k_buffers: Any,
    v_buffers: Any,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
    *,
    impl: str = "xla",
    interpret: bool | None = None,
) -> None:
    """In place over every layer's K and V buffer: ``buf[tgt] = buf[src]`` (gather, then scatter).

    ``k_buffers``/``v_buffers``: lists of ``[slots, H, D]`` tensors (sglang) or one stacked
    ``[layers, slots, H, D]`` tensor each.
    """
    if tgt_loc.numel() == 0 or len(k_buffers) == 0:
        return
    pool = run_jspec(
        _mod("jspec.kv.pool").move_kv_cache,
        kv_pool_of(k_buffers, v_buffers, 1),
        _j(tgt_loc, "tgt_loc"),
        _j(src_loc, "src_loc"),
        impl=impl,
        interpret=interpret,
    )
    _write_back(k_buffers, pool.k)
    _write_back(v_buffers, pool.v)


def get_alloc_len_per_decode(
    *,
    page_size: int,
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
    max_num_draft_tokens: int = 0,
) -> int:
    """jspec's ``SpecConfig.alloc_len_per_decode`` (EAGLE, no DCP)."""
    cfg = _mod("jspec.config").SpecConfig(
        page_size=page_size,
        topk=topk,
        num_steps=num_steps,
        num_draft_tokens=num_draft_tokens,
        max_num_draft_tokens=max_num_draft_tokens,
    )
    return cfg.alloc_len_per_decode


def page_aligned_decode_alloc_lens(reqs: list[Any], *, reserve: int, page_size: int):
    """``(cur i64[B], nxt i64[B], need)`` through jspec's decode sizing."""
    committed = torch.tensor([int(r.kv_committed_len) for r in reqs], dtype=torch.int32)
    allocated = torch.tensor(
        [int(getattr(r, "kv", r).kv_allocated_len) for r in reqs], dtype=torch.int32
    )
    cur, nxt, need = run_jspec(
        _mod("jspec.kv.decode_alloc").page_aligned_decode_alloc_lens,
        _j(committed, "committed"),
        _j(allocated, "allocated"),
        reserve=reserve,
        page_size=page_size,
    )
    return _t(cur, device="cpu"), _t(nxt, device="cpu"), int(need)
