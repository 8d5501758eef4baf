"""The MHA KV pool: per-layer K and V buffers indexed by token slot (SPEC.md §1, §9.2, §10).

sglang's ``MHATokenToKVPool`` keeps one ``[size + page_size, num_kv_heads, head_dim]`` buffer per
layer for K and one for V. jspec stacks the layers into one array each::

    k, v: dtype[num_layers, num_slots, num_kv_heads, head_dim],  num_slots = size + page_size

Slots ``0..page_size-1`` are the padding page (page 0, never allocated): padded tokens write
their KV there and padded ``move_kv_cache`` pairs are ``(0 -> 0)``.

All slot ids are int32 (sglang's ``out_cache_loc`` and move locations are int64). Writes are
pure (``new_pool = f(pool, ...)``); the jitted entry points donate the pool, so outside an outer
``jit`` the old pool's buffers are consumed and the update happens in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec import probes
from jspec._index import int32_ids
from jspec._jit import jit
from jspec._pytree import pytree_dataclass, replace, static_field
from jspec.config import SpecConfig
from jspec.kernels import move_kv_cache as _move
from jspec.sentinels import PAD_SLOT_ID

KV_WRITE_IMPLS = ("xla", "triton")  # set_kv_buffer's impl

__all__ = [
    "KVPool",
    "get_kv",
    "init_kv_pool",
    "move_kv_cache",
    "move_kv_cache_reference",
    "set_kv_buffer",
]


@pytree_dataclass
class KVPool:
    """K and V buffers of every layer, indexed by token slot id.

    Attributes:
      k: dtype[num_layers, num_slots, num_kv_heads, head_dim]; slots 0..page_size-1 are the
        padding page.
      v: dtype[num_layers, num_slots, num_kv_heads, head_dim]; same layout as ``k``.
      page_size: tokens per page (static).
    """

    # (num_layers, num_slots, num_kv_heads, head_dim)
    k: jax.Array
    # (num_layers, num_slots, num_kv_heads, head_dim)
    v: jax.Array
    page_size: int = static_field(default=1)

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_slots(self) -> int:
        """``size + page_size`` rows per layer (padding page included)."""
        return self.k.shape[1]

    @property
    def size(self) -> int:
        """Allocatable token slots (sglang ``size``): ``num_slots - page_size``."""
        return self.k.shape[1] - self.page_size

    @property
    def dtype(self):
        return self.k.dtype


def init_kv_pool(cfg: SpecConfig, *, fill: float = 0.0) -> KVPool:
    """A pool for ``cfg`` with every K and V element set to ``fill``.

    Args:
      cfg: static config; shapes are ``[cfg.num_layers, cfg.num_slots, cfg.num_kv_heads,
        cfg.head_dim]`` and the dtype is ``cfg.kv_dtype``.
      fill: initial value (tests poison the pool with NaN or a sentinel).

    Returns:
      A ``KVPool`` with ``page_size = cfg.page_size``.
    """
    shape = (cfg.num_layers, cfg.num_slots, cfg.num_kv_heads, cfg.head_dim)
    k = jnp.full(shape, fill, cfg.kv_dtype)
    v = jnp.full(shape, fill, cfg.kv_dtype)
    return KVPool(k=k, v=v, page_size=cfg.page_size)


def _check_layer(pool: KVPool, layer: int, op: str) -> None:
    probes.static_check(
        isinstance(layer, int) and 0 <= layer < pool.num_layers,
        f"{op}: layer={layer!r} must be an int in [0, {pool.num_layers})",
    )


@jit(static_argnames=("layer", "impl"), donate_argnames=("pool",))
def set_kv_buffer(
    pool: KVPool,
    layer: int,
    slot_ids: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    impl: str = "xla",
) -> KVPool:
    """Write the K and V of ``T`` tokens of one layer (sglang ``set_kv_buffer``).

    Args:
      pool: the pool (donated).
      layer: static layer index in ``[0, num_layers)``.
      slot_ids: i32[T] token slots to write (int32, sglang's ``out_cache_loc`` is int64);
        padded tokens use a padding-page slot (0..page_size-1). Probe: in ``[0, num_slots)``.
      k: dtype[T, num_kv_heads, head_dim], cast to the pool dtype.
      v: dtype[T, num_kv_heads, head_dim], cast to the pool dtype.
      impl: ``"xla"`` (a scatter per pool; one row: a dynamic-update-slice) or ``"triton"``
        (GPU: K and V in one launch, :mod:`jspec.kernels.kv_write_triton`); the same pools.

    Returns:
      The pool with ``k[layer, slot_ids] = k`` and ``v[layer, slot_ids] = v`` (duplicate slot
      ids: which write wins is undefined, as in sglang). A slot outside ``[0, num_slots)``
      (negative ones included: they do not wrap) writes no real slot: dropped when ``T > 1``,
      routed to the padding slot ``PAD_SLOT_ID`` (a write sink) when ``T == 1``.
    """
    _check_layer(pool, layer, "set_kv_buffer")
    slot_ids = int32_ids(slot_ids, "slot_ids")
    row = (slot_ids.shape[0],) + pool.k.shape[2:]
    probes.static_check_shape(k, row, "k")
    probes.static_check_shape(v, row, "v")
    probes.detect_oob(slot_ids, 0, pool.num_slots, "set_kv_buffer: slot_ids out of range")
    probes.static_check(
        impl in KV_WRITE_IMPLS, f"set_kv_buffer: impl={impl!r}; choose one of {KV_WRITE_IMPLS}"
    )
    if impl == "triton":
        # NOTE: imported here: the kernel module imports triton, which must not load with
        # jspec.kv (CPU tests set TRITON_INTERPRET before triton's first import).
        from jspec.kernels.kv_write_triton import set_kv_rows_triton

        new_k, new_v = set_kv_rows_triton(
            pool.k,
            pool.v,
            layer,
            slot_ids,
            k.astype(pool.dtype),
            v.astype(pool.dtype),
            pad_slot=PAD_SLOT_ID,
            route_pad=slot_ids.shape[0] == 1,
        )
        return replace(pool, k=new_k, v=new_v)
    if slot_ids.shape[0] == 1:
        # One row (a decode step): XLA rewrites a one-row scatter into a dynamic-update-slice
        # guarded by an index-range reduction and a select, two extra launches per layer and
        # pool (measured on the H200: an 8B decode layer 127.6 -> 123.5 us, bench/RESULTS.md).
        # The slot is first routed into range on the scalar (an out-of-range one to the padding
        # slot: dynamic_update_slice would clamp it onto the last real slot, another request's
        # KV), so the bare update stays one launch and never writes a real slot by mistake.
        slot = slot_ids[0]
        slot = jnp.where((slot >= 0) & (slot < pool.num_slots), slot, PAD_SLOT_ID)
        start = (jnp.int32(layer), slot, jnp.int32(0), jnp.int32(0))
        new_k = jax.lax.dynamic_update_slice(pool.k, k.astype(pool.dtype)[None], start)
        new_v = jax.lax.dynamic_update_slice(pool.v, v.astype(pool.dtype)[None], start)
        return replace(pool, k=new_k, v=new_v)
    # NOTE: negative ids are sent past the end first (jnp would wrap them onto real slots);
    # "drop" then skips every out-of-range row (the same XLA scatter as "promise_in_bounds").
    slot_ids = jnp.where(slot_ids < 0, pool.num_slots, slot_ids)
    new_k = pool.k.at[layer, slot_ids].set(k.astype(pool.dtype), mode="drop")
    new_v = pool.v.at[layer, slot_ids].set(v.astype(pool.dtype), mode="drop")
    return replace(pool, k=new_k, v=new_v)


def get_kv(pool: KVPool, layer: int, slot_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Gather the K and V rows of ``T`` token slots of one layer.

    Args:
      pool: the pool (not donated).
      layer: static layer index in ``[0, num_layers)``.
      slot_ids: i32[T] token slots. Probe: in ``[0, num_slots)``.

    Returns:
      ``(k, v)``, each dtype[T, num_kv_heads, head_dim]. A slot outside ``[0, num_slots)``
      (negative ones included) reads NaN (JAX's fill for inexact dtypes), never a real slot.
    """
    _check_layer(pool, layer, "get_kv")
    slot_ids = int32_ids(slot_ids, "slot_ids")
    probes.detect_oob(slot_ids, 0, pool.num_slots, "get_kv: slot_ids out of range")
    slot_ids = jnp.where(slot_ids < 0, pool.num_slots, slot_ids)  # never wrap
    return (
        pool.k.at[layer, slot_ids].get(mode="fill"),
        pool.v.at[layer, slot_ids].get(mode="fill"),
    )


@jit(static_argnames=_move.STATIC_ARGNAMES, donate_argnames=("pool",))
def move_kv_cache(
    pool: KVPool,
    tgt_slot_ids: jax.Array,
    src_slot_ids: jax.Array,
    *,
    impl: str = "xla",
    interpret: bool | None = None,
    block_rows: int = _move.BLOCK_ROWS,
    block_elems: int = _move.BLOCK_ELEMS,
    num_warps: int = _move.NUM_WARPS,
    single_block_rows: int = _move.SINGLE_BLOCK_ROWS,
) -> KVPool:
    """Copy K and V rows ``src -> tgt`` in every layer (sglang ``move_kv_cache``), in place.

    Gather-then-scatter for the whole call (sglang: within 256-pair chunks); self pairs,
    including the ``(0 -> 0)`` padding pairs, are no-ops; with duplicate targets which write
    wins is undefined (as in sglang). Kernels: :mod:`jspec.kernels.move_kv_cache`.

    Args:
      pool: the pool (donated: updated in place outside an outer ``jit``).
      tgt_slot_ids: i32[n] target token slots (int32; sglang's are int64). Probe: in
        ``[0, num_slots)``.
      src_slot_ids: i32[n] source token slots. Probe: in ``[0, num_slots)``.
      impl: static; ``"xla"`` (the reference), ``"pallas"`` or ``"triton"`` (GPU only).
      interpret: static; Pallas interpret mode (None: interpret unless on GPU).
      block_rows, block_elems, num_warps, single_block_rows: static kernel tuning (powers
        of 2), see :func:`jspec.kernels.move_kv_cache.move_kv_cache`.

    Returns:
      The pool with ``k[:, tgt] = k[:, src]`` and ``v[:, tgt] = v[:, src]``.
    """
    k, v = _move.move_kv_cache(
        pool.k,
        pool.v,
        tgt_slot_ids,
        src_slot_ids,
        impl=impl,
        interpret=interpret,
        block_rows=block_rows,
        block_elems=block_elems,
        num_warps=num_warps,
        single_block_rows=single_block_rows,
    )
    return replace(pool, k=k, v=v)


def move_kv_cache_reference(
    pool: KVPool, tgt_slot_ids: jax.Array, src_slot_ids: jax.Array
) -> KVPool:
    """XLA oracle of :func:`move_kv_cache`: ``pool.k.at[:, tgt].set(pool.k[:, src])``, same for v.

    Args:
      pool: the pool (not donated here).
      tgt_slot_ids: i32[n] target token slots.
      src_slot_ids: i32[n] source token slots.

    Returns:
      The updated pool.
    """
    k, v = _move.move_kv_cache_reference(pool.k, pool.v, tgt_slot_ids, src_slot_ids)
    return replace(pool, k=k, v=v)
