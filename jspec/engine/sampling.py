"""Sampling in the engine: the per-entry parameters of a batch and the steps' sampled branches.

A step samples when it is given a :class:`SamplingBatch` (one row per batch entry, the same
padding as ``slot_idx``); without one it is today's greedy step, bit for bit. The host
(:class:`jspec.engine.scheduler.Engine`) passes one only when a request of the batch samples,
so a greedy-only batch never compiles or runs any of this. In a sampled batch, greedy entries
(``temperature == 0``) get a one-hot distribution at the argmax, on which the sampled tree
verification accepts exactly what ``verify_tree_greedy`` accepts and emits the same tokens.

Three places sample, all from :func:`jspec.tree.sampling_probs.target_probs_from_logits`
(temperature, top-k, min-p, top-p in one function) with the counter-based coins of
:mod:`jspec.tree.sampling_keys`, keyed by (request seed, position, node) only:

=================  ============================  ==========================================
where              distribution                  coin
=================  ============================  ==========================================
prefill            the prompt's last row         (seed, PLAIN, prompt_len)
plain decode step  the bonus token's row         (seed, PLAIN, L + 1)
spec step accept   every tree node's row         (seed, NODE, L, j), bonus (seed, BONUS, L)
=================  ============================  ==========================================

(``L`` the committed length when the step starts.) So a request's tokens depend on its seed
and its own tokens only: not on its batch, slot, bucket, shard or tensor-parallel rank. Under
tensor parallelism every rank computes the same values; the sampled outputs are still taken
from tp rank 0 (a ``psum`` of rank 0's copy, as sglang broadcasts from rank 0), so the ranks'
bookkeeping can never diverge through a rounding difference.

Every op here runs under ``jax.named_scope(SAMPLING_SCOPE)``: bench/real_size.py reports their
device time as the sampling share of the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec._pytree import pytree_dataclass, static_field
from jspec.tree.build import BuildTreeOutput
from jspec.tree.sampling import LossyThresholds, sample_from_probs, tree_sampling_verify
from jspec.tree.sampling_keys import STREAM_BONUS, STREAM_NODE, STREAM_PLAIN, uniform_coins
from jspec.tree.sampling_probs import target_probs_from_logits

SAMPLING_SCOPE = "jspec_sampling"


@pytree_dataclass
class SamplingBatch:
    """Per-entry sampling parameters of a padded batch (``B`` = the batch's entries).

    Padding entries: any values (greedy is simplest). A filter field left None is static: no
    entry of the batch uses that filter, and its work is not compiled.
    """

    # f32[B]: temperature; <= 0 is greedy (argmax)
    temperature: jax.Array
    # u32[B, 2]: the 64-bit seed as (hi, lo) words (jspec.tree.sampling_keys.seed_words)
    seed: jax.Array
    # i32[B] or None: top-k (0 = off)
    top_k: jax.Array | None = None
    # f32[B] or None: top-p in (0, 1] (1 = off)
    top_p: jax.Array | None = None
    # f32[B] or None: min-p in [0, 1] (0 = off)
    min_p: jax.Array | None = None
    # static: sglang's lossy acceptance thresholds (None = exact; see LossyThresholds)
    lossy: LossyThresholds | None = static_field(default=None)


def _processed(logits: jax.Array, sampling: SamplingBatch) -> jax.Array:
    """f32[B, R, V]: the processed distribution of ``R`` rows per entry."""
    return target_probs_from_logits(
        logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p
    )


def _from_tp_rank0(x: jax.Array, tp_axis: str | None) -> jax.Array:
    """``x`` as tp rank 0 has it, on every rank (integers: exact)."""
    if tp_axis is None:
        return x
    rank0 = jax.lax.axis_index(tp_axis) == 0
    return jax.lax.psum(jnp.where(rank0, x, jnp.zeros_like(x)), tp_axis)


def sample_plain(
    logits: jax.Array,
    sampling: SamplingBatch,
    positions: jax.Array,
    *,
    tp_axis: str | None = None,
) -> jax.Array:
    """One sampled token per entry (prefill's first token, the plain decode step).

    Args:
      logits: f32[B, V] the target logits before the token to sample.
      sampling: the entries' parameters.
      positions: i32[B] the position of the token being sampled (its index in the sequence).
      tp_axis: the tensor-parallel mesh axis (inside ``shard_map``) or None.

    Returns:
      i32[B] tokens; greedy entries get ``argmax(logits)``.
    """
    with jax.named_scope(SAMPLING_SCOPE):
        probs = _processed(logits, sampling)[:, 0]
        coins = uniform_coins(sampling.seed, STREAM_PLAIN, positions)
        return _from_tp_rank0(sample_from_probs(probs, coins), tp_axis)


def next_tokens(
    logits: jax.Array,
    sampling: SamplingBatch | None,
    positions: jax.Array,
    *,
    tp_axis: str | None = None,
) -> jax.Array:
    """i32[B]: the argmax of ``logits: f32[B, V]`` (``sampling`` None), else
    :func:`sample_plain` at ``positions: i32[B]`` (the sampled tokens' positions)."""
    if sampling is None:
        return jnp.argmax(logits, -1).astype(jnp.int32)
    return sample_plain(logits, sampling, positions, tp_axis=tp_axis)


def sample_tree(
    logits: jax.Array,
    tree: BuildTreeOutput,
    committed_lens: jax.Array,
    sampling: SamplingBatch,
    *,
    num_spec_steps: int,
    tp_axis: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The spec step's sampled tree verification (``eagle_sample_greedy``'s sampled twin).

    Args:
      logits: f32[B*N, V] the target over the tree nodes (request-major, local node order).
      tree: the verify tree (``draft_tokens`` i32[B*N], ``retrive_*`` i32[B, N]).
      committed_lens: i32[B] ``L`` at the step's start (the coins' position).
      sampling: the entries' parameters.
      num_spec_steps: static ``accept_index`` width (max depth + 1).
      tp_axis: the tensor-parallel mesh axis (inside ``shard_map``) or None.

    Returns:
      ``(predict i32[B*N], accept_lens i32[B], accept_index i32[B, S+1])`` as
      :func:`jspec.tree.verify.eagle_sample_greedy` (``accept_lens`` = accepted drafts + 1,
      unwritten ``predict`` entries 0).
    """
    batch, n = tree.retrive_index.shape
    with jax.named_scope(SAMPLING_SCOPE):
        probs = _processed(logits, sampling)  # f32[B, N, V]
        coins = uniform_coins(sampling.seed, STREAM_NODE, committed_lens, n)
        final = uniform_coins(sampling.seed, STREAM_BONUS, committed_lens)
        predict, accept_index, num = tree_sampling_verify(
            tree.draft_tokens.reshape(batch, n),
            tree.retrive_index,
            tree.retrive_next_token,
            tree.retrive_next_sibling,
            coins,
            final,
            probs,
            num_spec_steps=num_spec_steps,
            lossy=sampling.lossy,
        )
        if tp_axis is not None:  # one all-reduce for the three outputs
            sizes = (predict.size, accept_index.size)
            flat = _from_tp_rank0(
                jnp.concatenate([predict, accept_index.reshape(-1), num]), tp_axis
            )
            predict = flat[: sizes[0]]
            accept_index = flat[sizes[0] : sizes[0] + sizes[1]].reshape(accept_index.shape)
            num = flat[sizes[0] + sizes[1] :]
    return predict, (num + 1).astype(jnp.int32), accept_index
