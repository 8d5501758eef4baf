"""The accept walk over a draft tree, shared by greedy and sampling verification.

Both ``verify_tree_greedy_reference`` (jspec.kernels.verify_tree_greedy) and the sampling walk
(jspec.tree.sampling) walk each request's tree the same way; only the accept test differs::

    cur = first child of the root
    while cur is a node and depth <= max_depth:
        match (accept test on cur)  -> record cur, descend: cur = next_token[cur]
        no match                    -> try the next sibling: cur = next_sibling[cur]
    predicts[last accepted node] = the bonus token

Node ids are local (``0..N-1``, root 0); ``retrive_index`` maps them to global ids ``b*N + j``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jspec.sentinels import NOT_ACCEPTED

__all__ = ["TreeWalk", "at_node", "finish_predicts", "start_walk", "step_walk"]


class TreeWalk(NamedTuple):
    """The walk's state (a pytree: a ``fori_loop`` carry)."""

    # (B,) local node being tried; -1 or >= N: none left
    cur: jax.Array
    # (B,) last accepted node (0: the root)
    last: jax.Array
    # (B,) depth of ``cur``
    depth: jax.Array
    # (B,) accepted drafts so far
    num: jax.Array
    # (B,) bool: the walk has stopped
    done: jax.Array
    # (B, N) i32 token following each accepted node, by local node
    pred: jax.Array
    # (B, N) bool: which ``pred`` entries are set
    written: jax.Array
    # (B, S+1) i32 accept_index: global ids of the accepted nodes, NOT_ACCEPTED padded
    acc: jax.Array

    def cur_ok(self, n: int) -> jax.Array:
        """bool[B]: ``cur`` is a node still to visit (``n``: nodes per tree)."""
        return ~self.done & (self.cur >= 0) & (self.cur < n)


def at_node(x: jax.Array, node: jax.Array) -> jax.Array:
    """``x[b, node[b]]`` for ``x: [B, N, ...]``, ``node`` clipped into ``0..N-1`` (callers mask
    invalid nodes)."""
    return x[jnp.arange(x.shape[0]), jnp.clip(node, 0, x.shape[1] - 1)]


def start_walk(next_token: jax.Array, retrive_index: jax.Array, *, num_spec_steps: int) -> TreeWalk:
    """The state before the first visit: ``cur`` = the root's first child, the root accepted.

    Args:
      next_token: i32[B, N] first-child links; retrive_index: i32[B, N] global node ids.
      num_spec_steps: static ``S + 1`` (``max_depth = S``).
    """
    bsz, n = next_token.shape
    zeros = jnp.zeros((bsz,), jnp.int32)
    acc = jnp.full((bsz, num_spec_steps), NOT_ACCEPTED, jnp.int32)
    return TreeWalk(
        cur=next_token[:, 0],
        last=zeros,
        depth=zeros + 1,
        num=zeros,
        done=jnp.full((bsz,), num_spec_steps - 1 == 0),
        pred=jnp.zeros((bsz, n), jnp.int32),
        written=jnp.zeros((bsz, n), bool),
        acc=acc.at[:, 0].set(retrive_index[:, 0]),
    )


def step_walk(
    walk: TreeWalk,
    match: jax.Array,
    token: jax.Array,
    retrive_index: jax.Array,
    next_token: jax.Array,
    next_sibling: jax.Array,
    *,
    max_depth: int,
) -> TreeWalk:
    """One visit: accept ``cur`` where ``match`` (``predicts[last] = token``, descend), else
    move to its next sibling.

    Args:
      match: bool[B] accept test of ``cur`` (False where not :meth:`TreeWalk.cur_ok`).
      token: i32[B] the token recorded after ``last`` on a match.
      retrive_index, next_token, next_sibling: i32[B, N] the tree.
      max_depth: static ``S``: a match at a deeper ``depth`` ends the walk.
    """
    n = next_token.shape[1]
    ok = walk.cur_ok(n)
    cur = walk.cur
    put_last = match[:, None] & (jnp.arange(n)[None, :] == walk.last[:, None])
    num = walk.num + match
    steps = jnp.arange(walk.acc.shape[1])
    put_acc = match[:, None] & (steps[None, :] == num[:, None])
    depth = walk.depth + match
    return TreeWalk(
        cur=jnp.where(
            match,
            at_node(next_token, cur),
            jnp.where(ok, at_node(next_sibling, cur), cur),
        ),
        last=jnp.where(match, cur, walk.last),
        depth=depth,
        num=num,
        done=walk.done | ~ok | (match & (depth > max_depth)),
        pred=jnp.where(put_last, token[:, None], walk.pred),
        written=walk.written | put_last,
        acc=jnp.where(put_acc, at_node(retrive_index, cur)[:, None], walk.acc),
    )


def finish_predicts(
    walk: TreeWalk, bonus: jax.Array, retrive_index: jax.Array, *, predicts_init: int
) -> jax.Array:
    """i32[B*N] ``predicts`` by global node id: the walk's ``pred`` plus ``bonus`` (i32[B]) after
    the last accepted node; never-written entries hold ``predicts_init``."""
    bsz, n = walk.pred.shape
    onehot_last = jnp.arange(n)[None, :] == walk.last[:, None]
    pred = jnp.where(onehot_last, bonus[:, None], walk.pred)
    written = walk.written | onehot_last
    total = bsz * n
    dest = jnp.where(written, retrive_index, total)
    return (
        jnp.full((total,), predicts_init, jnp.int32)
        .at[dest.reshape(-1)]
        .set(pred.reshape(-1), mode="drop")
    )
