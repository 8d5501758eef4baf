"""Draft-tree expansion: ``select_top_k_tokens`` and ``organize_draft_results`` (SPEC.md §7.1-§7.3).

One EAGLE draft step keeps the ``K`` best *paths* of each request. Step 0 takes the draft
model's top-k directly; step ``i >= 1`` expands every branch by its own top-k (``K*K`` paths)
and keeps the best ``K`` by cumulative probability. Every step records a tree-info triple
``(score_entry, tokens, parents)``; :func:`organize_draft_results` flattens them into the
"ss" arrays (width ``K + (S-1)*K*K``) and keeps the ``N-1`` best nodes::

    flat ss index s    step   meaning
    [0, K)             0      token t of the root's top-k                  parent: root
    K + (i-1)K² + rK + c  i   child c of branch r chosen at step i-1       parent: parent_list[s // K]

``parent_list[s // K]`` is the flat ss index of the parent token (or -1 for the root, entry 0).

Ties: ``jax.lax.top_k`` returns the **lower index** among equal values and ``jnp.sort`` is
stable. ``torch.topk`` leaves tie order implementation-defined (CUDA usually, not always,
also picks the lower index), so exactly tied scores are a possible divergence from sglang
(SPEC.md §7.3, §16). Indices are int32 (sglang: int64).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec import probes
from jspec._jit import jit
from jspec.sentinels import ROOT_PARENT


def _probe_draft(
    topk_p: jax.Array, topk_index: jax.Array, vocab_size: int | None, where: str
) -> None:
    """NaN probe on the draft probabilities and an OOB probe on the draft tokens (SPEC §11)."""
    probes.detect_nan(topk_p, f"{where}: draft topk_p")
    if vocab_size is not None:
        probes.detect_oob(topk_index, 0, vocab_size, f"{where}: draft topk_index vs vocab")


@jit(static_argnames=("step", "topk", "vocab_size"))
def select_top_k_tokens(
    step: int,
    topk_p: jax.Array,
    topk_index: jax.Array,
    hidden: jax.Array,
    scores: jax.Array | None,
    *,
    topk: int,
    vocab_size: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """One draft step's branch selection (sglang ``select_top_k_tokens``).

    Args:
      step: static draft step ``i`` (0-based).
      topk_p: f32[B, K] at step 0 (the draft-extend top-k probs), else f32[B*K, K]
        (row ``b*K + r`` = branch r of request b).
      topk_index: i32[B, K] or i32[B*K, K], token ids matching ``topk_p``.
      hidden: dtype[B, H] at step 0, else dtype[B*K, H]: the draft hidden states.
      scores: f32[B, K] cumulative path probabilities of the current branches (None at step 0).
      topk: static ``K``.
      vocab_size: static; when given, probes ``topk_index`` against ``[0, vocab_size)``.

    Returns:
      ``(input_ids i32[B*K], hidden dtype[B*K, H], scores f32[B, K], tree_info)`` where
      ``tree_info = (score_entry, tokens, parents)``:

      * step 0: ``score_entry`` f32[B, 1, K] = topk_p, ``tokens`` i32[B, K],
        ``parents`` i32[B, K+1] = ``[-1, 0, 1, ..., K-1]``;
      * step i >= 1: ``score_entry`` f32[B, K, K] (cumulative), ``tokens`` i32[B, K*K],
        ``parents`` i32[B, K] = ``cs_idx + K*K*(i-1) + K`` (flat ss index of each chosen token).
    """
    k = topk
    probes.static_check_int(topk, "topk")
    probes.static_check_int(step, "step", low=0)
    topk_index = topk_index.astype(jnp.int32)
    if step == 0:
        probes.static_check(
            topk_p.ndim == 2 and topk_p.shape[1] == k,
            f"topk_p.shape={topk_p.shape} must be (B, topk={k}) at step 0",
        )
        probes.static_check_shape(topk_index, topk_p.shape, "topk_index")
        b = topk_p.shape[0]
        probes.static_check(
            hidden.shape[0] == b, f"hidden.shape={hidden.shape} must have {b} rows at step 0"
        )
        _probe_draft(topk_p, topk_index, vocab_size, "select_top_k_tokens(step=0)")
        input_ids = topk_index.reshape(-1)
        hidden = jnp.repeat(hidden, k, axis=0)
        root = jnp.full((1,), ROOT_PARENT, jnp.int32)
        parents = jnp.concatenate([root, jnp.arange(k, dtype=jnp.int32)])  # [-1, 0, ..., K-1]
        parents = jnp.broadcast_to(parents, (b, k + 1))
        tree_info = (topk_p[:, None, :], topk_index, parents)
        return input_ids, hidden, topk_p, tree_info

    if scores is None:
        raise ValueError(f"scores must be given at step={step}")
    probes.static_check(
        topk_p.ndim == 2 and topk_p.shape[1] == k and topk_p.shape[0] % k == 0,
        f"topk_p.shape={topk_p.shape} must be (B*topk, topk={k}) at step {step}",
    )
    b = topk_p.shape[0] // k
    probes.static_check_shape(topk_index, topk_p.shape, "topk_index")
    probes.static_check_shape(scores, (b, k), "scores")
    probes.static_check(
        hidden.shape[0] == b * k, f"hidden.shape={hidden.shape} must have B*topk={b * k} rows"
    )
    _probe_draft(topk_p, topk_index, vocab_size, f"select_top_k_tokens(step={step})")
    # expand[b, r, c] = path prob of child c of branch r.
    expand = scores[:, :, None] * topk_p.reshape(b, k, k)
    # NOTE: lax.top_k breaks ties by the lower flat index (torch.topk: implementation-defined).
    cs_p, cs_idx = jax.lax.top_k(expand.reshape(b, k * k), k)
    cs_idx = cs_idx.astype(jnp.int32)
    tokens = topk_index.reshape(b, k * k)
    input_ids = jnp.take_along_axis(tokens, cs_idx, axis=1).reshape(-1)
    # Parent row of every new branch: branch cs_idx // K of the same request.
    parent_rows = cs_idx // k + (jnp.arange(b, dtype=jnp.int32) * k)[:, None]
    hidden = hidden[parent_rows.reshape(-1)]
    parents = cs_idx + (k * k * (step - 1) + k)
    return input_ids, hidden, cs_p, (expand, tokens, parents)


def ss_width(topk: int, num_steps: int) -> int:
    """Width of the flat score/token arrays: ``K + (S-1)*K*K``."""
    return topk + (num_steps - 1) * topk * topk


@jit(static_argnames=("num_draft_tokens",))
def organize_draft_results(
    score_list: list[jax.Array] | tuple[jax.Array, ...],
    token_list: list[jax.Array] | tuple[jax.Array, ...],
    parents_list: list[jax.Array] | tuple[jax.Array, ...],
    *,
    num_draft_tokens: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Keep the ``N-1`` best draft nodes of each request (sglang ``organize_draft_results``).

    Args:
      score_list: S entries from :func:`select_top_k_tokens`: f32[B, 1, K], then f32[B, K, K].
      token_list: S entries: i32[B, K], then i32[B, K*K].
      parents_list: S entries: i32[B, K+1], then i32[B, K].
      num_draft_tokens: static ``N`` (tree nodes including the root); ``N-1`` must be at most
        the ss width ``K + (S-1)*K*K``.

    Returns:
      ``parent_list`` i32[B, K*(S-1)+1] (i32[B, 0] when S == 1), ``top_scores_index``
      i32[B, N-1] (ascending flat ss indices; ties: lower index first), ``draft_tokens``
      i32[B, N-1] (the tokens at those indices).
    """
    probes.static_check(
        len(score_list) == len(token_list) == len(parents_list) >= 1,
        "score_list, token_list and parents_list must have the same length >= 1",
    )
    flat_scores = jnp.concatenate([s.reshape(s.shape[0], -1) for s in score_list], axis=1)
    ss_tokens = jnp.concatenate([t.astype(jnp.int32) for t in token_list], axis=1)
    b, width = flat_scores.shape
    probes.static_check(
        ss_tokens.shape == (b, width),
        f"token_list concatenates to {ss_tokens.shape}, scores to {(b, width)}",
    )
    n = num_draft_tokens
    probes.static_check(
        isinstance(n, int) and 1 <= n and n - 1 <= width,
        f"num_draft_tokens={n}: num_draft_tokens - 1 must be in [0, {width}] "
        "(the flat score width K + (S-1)*K*K)",
    )
    _, top_idx = jax.lax.top_k(flat_scores, n - 1)
    top_scores_index = jnp.sort(top_idx.astype(jnp.int32), axis=-1)
    probes.detect_oob(
        top_scores_index, 0, width, "organize_draft_results: top_scores_index vs ss_token width"
    )
    draft_tokens = jnp.take_along_axis(ss_tokens, top_scores_index, axis=1)
    if len(parents_list) > 1:
        parent_list = jnp.concatenate([p.astype(jnp.int32) for p in parents_list[:-1]], axis=1)
    else:
        parent_list = jnp.zeros((b, 0), jnp.int32)
    return parent_list, top_scores_index, draft_tokens
