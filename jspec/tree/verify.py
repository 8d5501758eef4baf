"""Greedy verification and its post-processing (SPEC.md §8.1 and "§8 post-processing").

``eagle_sample_greedy`` = ``target_predict = argmax(logits)`` + :func:`verify_tree_greedy`
(``jspec.kernels.verify_tree_greedy``, re-exported here) with ``predict`` initialised to 0 and
``accept_index`` to -1. Then::

    accept_lens         = accept_token_num + 1                       (bonus included)
    accept_tokens[b, i] = predict[accept_index[b, i]]                (i < accept_lens[b])
    bonus_tokens[b]     = accept_tokens[b, accept_lens[b] - 1]       fill_bonus_tokens
    front block         predict/hidden[b*N + i] = x[max(accept_index[b, i], 0)], i <= S
                                                                     compact_accept_to_front
    accept_out_cache_loc = out_cache_loc[non -1 accept_index, row-major], zero tail
                                                                     fill_accept_out_cache_loc

The scheduler then reads ``next_token_ids[b*N : b*N + accept_lens[b]]``. Slot ids
(``out_cache_loc``) are int32 here (sglang: int64).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec import probes
from jspec._compact import compact
from jspec._jit import jit
from jspec.kernels.verify_tree_greedy import (
    verify_tree_greedy,
    verify_tree_greedy_reference,
)

__all__ = [
    "compact_accept_to_front",
    "eagle_sample_greedy",
    "fill_accept_out_cache_loc",
    "fill_bonus_tokens",
    "verify_tree_greedy",
    "verify_tree_greedy_reference",
]


@jit()
def fill_bonus_tokens(accept_tokens: jax.Array, accept_lens: jax.Array) -> jax.Array:
    """``bonus[b] = accept_tokens[b, accept_lens[b] - 1]`` (sgl_kernel ``fill_bonus_tokens``).

    Args:
      accept_tokens: i32[B, S+1] accepted tokens (row stride S+1).
      accept_lens: i32[B] in ``[1, S+1]``; padded rows (0) read column 0.

    Returns:
      i32[B] bonus tokens.
    """
    probes.static_check(
        accept_tokens.ndim == 2, f"accept_tokens.shape={accept_tokens.shape} must be (B, S+1)"
    )
    probes.static_check_shape(accept_lens, accept_tokens.shape[:1], "accept_lens")
    probes.detect_in_closed_range(
        accept_lens, 1, accept_tokens.shape[1], "fill_bonus_tokens: accept_lens vs [1, S+1]"
    )
    col = jnp.clip(accept_lens.astype(jnp.int32) - 1, 0, accept_tokens.shape[1] - 1)
    return jnp.take_along_axis(accept_tokens, col[:, None], axis=1)[:, 0]


@jit(static_argnames=("num_draft_tokens",))
def compact_accept_to_front(
    predict: jax.Array, hidden: jax.Array | None, accept_index: jax.Array, *, num_draft_tokens: int
) -> tuple[jax.Array, jax.Array | None]:
    """Gather the accepted path to the front of each request's block (``_compact_accept_to_front``).

    Args:
      predict: i32[B*N] node-indexed (global node id) predictions.
      hidden: dtype[B*N, H] node-indexed hidden states, or None.
      accept_index: i32[B, S+1] global node ids, -1 padded (clamped to node 0; those entries
        land past accept_lens and are never read).
      num_draft_tokens: static ``N``.

    Returns:
      ``(predict', hidden')``: copies where ``x'[b*N + i] = x[max(accept_index[b, i], 0)]``
      for ``i <= S``; entries ``b*N + S+1 ..`` are unchanged.
    """
    n = num_draft_tokens
    b, s1 = accept_index.shape
    probes.static_check(
        s1 <= n, f"accept_index.shape={accept_index.shape}: S+1 must be <= num_draft_tokens={n}"
    )
    safe = jnp.maximum(accept_index, 0).reshape(-1)

    def compact(x):
        probes.static_check(x.shape[0] == b * n, f"x.shape={x.shape} must have B*N={b * n} rows")
        gathered = x[safe].reshape(b, s1, *x.shape[1:])
        return x.reshape(b, n, *x.shape[1:]).at[:, :s1].set(gathered).reshape(x.shape)

    return compact(predict), (None if hidden is None else compact(hidden))


@jit()
def fill_accept_out_cache_loc(accept_index: jax.Array, out_cache_loc: jax.Array) -> jax.Array:
    """Packed gather of the accepted slots (sgl_kernel ``fill_accept_out_cache_loc``).

    Args:
      accept_index: i32[B, S+1] global node ids, -1 padded.
      out_cache_loc: i32[B*N] slot id of every tree node (int64 in sglang).

    Returns:
      i32[B*(S+1)]: ``out_cache_loc[i]`` for the non -1 entries of ``accept_index`` in
      row-major order, then zeros.
    """
    flat = accept_index.reshape(-1)
    probes.detect_oob(
        flat,
        -1,
        out_cache_loc.shape[0],
        "fill_accept_out_cache_loc: accept_index vs [-1, len(out_cache_loc))",
    )
    return compact(out_cache_loc[jnp.maximum(flat, 0)], flat >= 0)


@jit(static_argnames=("num_spec_steps", "impl", "interpret"))
def eagle_sample_greedy(
    logits: jax.Array,
    candidates: jax.Array,
    retrive_index: jax.Array,
    retrive_next_token: jax.Array,
    retrive_next_sibling: jax.Array,
    *,
    num_spec_steps: int,
    impl: str = "xla",
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy verify from target logits (sglang ``eagle_sample``, greedy branch).

    Args:
      logits: f32[B*N, V] target logits of every tree node (global node order).
      candidates, retrive_index, retrive_next_token, retrive_next_sibling: i32[B, N].
      num_spec_steps: static ``S + 1`` (``max_tree_depth``).

    Returns:
      ``(predict i32[B*N] (0 where not accepted), accept_lens i32[B] = correct drafts + 1,
      accept_index i32[B, S+1] (-1 padded))``.
    """
    probes.detect_nan(logits, "eagle_sample_greedy: target logits")
    probes.detect_inf(logits, "eagle_sample_greedy: target logits")
    target_predict = jnp.argmax(logits, axis=-1).astype(jnp.int32).reshape(candidates.shape)
    predict, accept_index, num_correct = verify_tree_greedy(
        candidates,
        retrive_index,
        retrive_next_token,
        retrive_next_sibling,
        target_predict,
        num_spec_steps=num_spec_steps,
        predicts_init=0,
        impl=impl,
        interpret=interpret,
    )
    return predict, num_correct + 1, accept_index
