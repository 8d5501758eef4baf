"""Verify window and the accepted-KV move (SPEC.md §2 step 5, §9).

The target model verifies the N tree nodes of request b at ``row_b[L_b : L_b + N]`` (the verify
window, sglang ``assign_extend_cache_locs_uniform``). After ``verify_tree_greedy`` /
sampling, the accepted nodes (``accept_index[b, k] != -1``; a flat index into the B*N verify
tokens) are in tree order, not at the window's front. V2 moves their **target** KV so the
accepted path sits at ``row_b[L_b : L_b + accept_len_b]``::

    verify window (N=4, L=7)    row[7]  row[8]  row[9]  row[10]
    accept_index = [0, 2, -1, -1]  ->  src = [row[7], row[9]]  tgt = [row[7], row[8]]   L' = 9

Nothing is freed per step in V2 (the window and draft regions stay allocated to the request;
``prepare_for_decode`` only grows rows). The removed V1 path (:func:`get_src_tgt_cache_loc`)
also computed the window tail to free.

All slot ids are int32 (sglang int64). Packed buffers are static-size with a ``0`` tail: a
``(0 -> 0)`` move stays inside the reserved padding page.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec import probes
from jspec._compact import compact, pack_to
from jspec._index import valid_mask
from jspec._jit import jit
from jspec.kv.pool import KVPool, move_kv_cache
from jspec.sentinels import NOT_ACCEPTED, PAD_SLOT_ID

__all__ = [
    "accept_kv_move_pairs",
    "get_src_tgt_cache_loc",
    "move_accept_tokens_to_target_kvcache",
    "verify_out_cache_loc",
]


def _row_gather(
    req_to_token: jax.Array, req_pool_indices: jax.Array, pos: jax.Array, live: jax.Array
) -> jax.Array:
    """``req_to_token[rpi[b], pos[b, j]]`` where live, else 0. pos, live: [B, J]."""
    width = req_to_token.shape[1]
    idx = req_pool_indices[:, None] * width + pos
    val = req_to_token.reshape(-1).at[jnp.where(live, idx, 0)].get(mode="clip")
    return jnp.where(live, val, PAD_SLOT_ID)


def _accepted_src(
    out_cache_loc: jax.Array, accept_index: jax.Array, accepted: jax.Array
) -> jax.Array:
    """i32[B*(S+1)]: ``out_cache_loc[accept_index]`` over the ``accepted`` entries
    (bool[B, S+1]), packed in (b, k) order (stream compaction), tail 0."""
    flat_acc = accepted.reshape(-1)
    src_val = out_cache_loc.at[jnp.where(flat_acc, accept_index.reshape(-1), 0)].get(mode="clip")
    return compact(src_val, flat_acc, flat_acc.shape[0], fill=PAD_SLOT_ID, dtype=jnp.int32)


@jit(static_argnames=("num_draft_tokens",))
def verify_out_cache_loc(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    seq_lens: jax.Array,
    *,
    num_draft_tokens: int,
    valid: jax.Array | None = None,
) -> jax.Array:
    """The verify window ``row_b[L_b : L_b + N]`` (``assign_extend_cache_locs_uniform``).

    Args:
      req_to_token: i32[rows, R]; req_pool_indices: i32[B]; seq_lens: i32[B] (``L``).
      num_draft_tokens: static ``N`` (tree nodes incl. the root).
      valid: bool[B] (None = all).

    Returns:
      i32[B*N] target KV write slots, request-major; padding rows 0.
    """
    batch = req_pool_indices.shape[0]
    valid = valid_mask(valid, (batch,))
    probes.detect_in_closed_range(
        seq_lens + num_draft_tokens,
        0,
        req_to_token.shape[1],
        "verify_out_cache_loc: L + N vs row width",
        where=valid,
    )
    pos = seq_lens[:, None] + jnp.arange(num_draft_tokens, dtype=jnp.int32)[None, :]
    live = jnp.broadcast_to(valid[:, None], pos.shape)
    return _row_gather(req_to_token, req_pool_indices, pos, live).reshape(-1)


@jit()
def accept_kv_move_pairs(
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    seq_lens: jax.Array,
    out_cache_loc: jax.Array,
    accept_index: jax.Array,
    accept_lens: jax.Array,
    valid: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The packed ``(tgt, src)`` pairs of ``move_accept_tokens_to_target_kvcache`` (§9.1).

    Args:
      req_to_token: i32[rows, R]; req_pool_indices: i32[B]; seq_lens: i32[B] (``L``).
      out_cache_loc: i32[B*N] verify-window slots (:func:`verify_out_cache_loc`).
      accept_index: i32[B, S+1] flat indices into the B*N verify tokens, -1 = not accepted.
      accept_lens: i32[B] accepted tokens incl. the bonus (``num_correct_drafts + 1``).
      valid: bool[B] (None = all); padding rows contribute no pairs.

    Returns:
      tgt_slot_ids: i32[B*(S+1)] packed ``row_b[L_b : L_b + accept_len_b]``, tail 0.
      src_slot_ids: i32[B*(S+1)] packed ``out_cache_loc[accept_index[b, k]]`` over
        ``accept_index != -1`` in (b, k) order, tail 0.
      num_pairs: i32[] = sum of accept_lens over valid rows.
    """
    batch, width = accept_index.shape
    size = batch * width
    valid = valid_mask(valid, (batch,))
    accepted = (accept_index != NOT_ACCEPTED) & valid[:, None]  # bool[B, S+1]
    accept_lens = jnp.where(valid, accept_lens, 0)
    probes.detect_oob(
        accept_index,
        NOT_ACCEPTED,
        out_cache_loc.shape[0],
        "move_accept_tokens_to_target_kvcache: accept_index",
        where=valid[:, None],
    )
    probes.detect_in_closed_range(
        accept_lens, 0, width, "move_accept_tokens_to_target_kvcache: accept_lens"
    )
    probes.assert_async(
        lambda: jnp.all(jnp.sum(accepted, axis=1) == accept_lens),
        "move_accept_tokens_to_target_kvcache: accept_lens != count(accept_index != -1) "
        "(first bad row {row})",
        row=lambda: jnp.argmax(jnp.sum(accepted, axis=1) != accept_lens),
    )
    src = _accepted_src(out_cache_loc, accept_index, accepted)
    # tgt: the front of each request's verify window, packed by accept_lens.
    r = jnp.arange(width, dtype=jnp.int32)[None, :]
    front = valid[:, None] & (r < accept_lens[:, None])  # bool[B, S+1]
    cu = jnp.cumsum(accept_lens) - accept_lens
    tgt_val = _row_gather(req_to_token, req_pool_indices, seq_lens[:, None] + r, front)
    tgt = pack_to(cu[:, None] + r, tgt_val, front, size, fill=PAD_SLOT_ID)
    return tgt, src, jnp.sum(accept_lens).astype(jnp.int32)


def move_accept_tokens_to_target_kvcache(
    target_pool: KVPool,
    req_to_token: jax.Array,
    req_pool_indices: jax.Array,
    seq_lens: jax.Array,
    out_cache_loc: jax.Array,
    accept_index: jax.Array,
    accept_lens: jax.Array,
    *,
    valid: jax.Array | None = None,
    impl: str = "xla",
    interpret: bool | None = None,
) -> KVPool:
    """Move the accepted nodes' target KV to ``row_b[L_b : L_b + accept_len_b]`` (V2, §9.1).

    sglang runs this only for K > 1 (``finalize_tree_path``); for K == 1 the accepted chain is
    already at the window's front (every pair is then a self move).

    Args:
      target_pool: the **target** model's KV pool.
      impl: ``move_kv_cache``'s impl; interpret: its Pallas interpret flag.
      Others: as :func:`accept_kv_move_pairs` (``accept_lens`` counts the bonus token).

    Returns:
      The target pool after the gather-then-scatter move (unused pairs are ``0 -> 0``).
      NOTE: ``move_kv_cache`` donates ``target_pool`` (consumed outside an outer ``jit``).
    """
    tgt, src, _ = accept_kv_move_pairs(
        req_to_token, req_pool_indices, seq_lens, out_cache_loc, accept_index, accept_lens, valid
    )
    return move_kv_cache(target_pool, tgt, src, impl=impl, interpret=interpret)


@jit(static_argnames=("num_draft_tokens", "page_size"))
def get_src_tgt_cache_loc(
    seq_lens: jax.Array,
    out_cache_loc: jax.Array,
    accept_index: jax.Array,
    accept_length: jax.Array,
    *,
    num_draft_tokens: int,
    page_size: int,
    valid: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Removed V1 verify bookkeeping (§9.3): move pairs plus the window tail to free.

    Args:
      seq_lens: i32[B] ``L``; out_cache_loc: i32[B*N] the verify windows.
      accept_index: i32[B, S+1], -1 = not accepted (filtered here; sglang passed it filtered).
      accept_length: i32[B] ``num_correct_drafts`` (= accept_len - 1).
      num_draft_tokens, page_size: static ``N``, ``P``.
      valid: bool[B] (None = all).

    Returns:
      src: i32[B*(S+1)] packed ``out_cache_loc[accept_index]`` over entries != -1, tail 0.
      tgt: i32[B*(S+1)] zeros filled with the first ``ncd+1`` window slots per request, packed.
      to_free_slots: i32[B*N] packed last ``to_free_num_b`` window slots per request, tail 0,
        with ``to_free_num = (L + N) - min(ceil_P(L + ncd + 1), L + N)``.
      num_to_free: i32[] total of to_free_num.
    """
    batch, width = accept_index.shape
    n, p = num_draft_tokens, page_size
    valid = valid_mask(valid, (batch,))
    probes.static_check_shape(out_cache_loc, (batch * n,), "out_cache_loc")
    size = batch * width
    accepted = (accept_index != NOT_ACCEPTED) & valid[:, None]
    src = _accepted_src(out_cache_loc, accept_index, accepted)

    window = out_cache_loc.reshape(batch, n)
    keep_front = jnp.where(valid, accept_length + 1, 0)  # ncd + 1
    r = jnp.arange(n, dtype=jnp.int32)[None, :]
    front = (r < keep_front[:, None]) & (r < width)
    cu = jnp.cumsum(keep_front) - keep_front
    tgt = pack_to(cu[:, None] + r, window, front, size, fill=PAD_SLOT_ID)

    extended = seq_lens + n
    keep = jnp.minimum((seq_lens + accept_length + 1 + p - 1) // p * p, extended)
    to_free_num = jnp.where(valid, extended - keep, 0)
    tail = valid[:, None] & (r >= n - to_free_num[:, None])
    cu_free = jnp.cumsum(to_free_num) - to_free_num
    to_free = pack_to(
        cu_free[:, None] + r - (n - to_free_num[:, None]), window, tail, batch * n, fill=PAD_SLOT_ID
    )
    return src, tgt, to_free, jnp.sum(to_free_num).astype(jnp.int32)
