"""``verify_tree_greedy``: walk each draft tree along the target's argmax (SPEC.md §8.1).

Per request ``b`` (``S = num_spec_steps - 1`` is the maximum tree depth)::

    last = 0; accept_index[b, 0] = retrive_index[b, 0]; n = 0; cur = 0
    for depth in 1..S:
        cur = next_token[b, cur]
        while cur != -1:                                  # siblings in link order
            if candidates[b, cur] == target_predict_flat[retrive_index[b, last]]:
                predicts[retrive_index[b, last]] = that target; n += 1
                accept_index[b, n] = retrive_index[b, cur]; last = cur; break
            cur = next_sibling[b, cur]
        if cur == -1: break
    accept_token_num[b] = n                               # correct drafts, root excluded
    predicts[retrive_index[b, last]] = target_predict_flat[retrive_index[b, last]]   # bonus

Both implementations run this as a state machine of at most ``N`` node visits (each visit
examines one node: accept and descend, or move to the next sibling, or stop). A valid tree
never needs more, and malformed links (cycles) stop after ``N`` visits instead of hanging.
Node indices outside ``[0, N)`` end the walk like -1.

* ``impl="xla"``: :func:`verify_tree_greedy_reference`, vectorised over the batch with a
  static-trip ``fori_loop`` (no host round trips); predicts are scattered by
  ``retrive_index`` (global node ids), so any id layout works.
* ``impl="pallas"``: one program per request (``grid=(B,)``); the request's rows live in
  registers (``NP = next_pow2(N)`` lanes, masked) and the walk is a ``while_loop`` that exits
  early. NOTE: it writes ``predicts`` at ``b*N + j``, i.e. it assumes
  ``retrive_index[b, j] == b*N + j`` (what build_tree produces; sglang's only producer).

Index dtype is int32 (sglang: candidates/retrive_* int64, outputs int32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jspec import probes
from jspec._jit import jit
from jspec._tree_walk import TreeWalk, at_node, finish_predicts, start_walk, step_walk
from jspec.config import next_power_of_2
from jspec.kernels._common import pallas_call, resolve_impl
from jspec.sentinels import NO_NODE, NOT_ACCEPTED

IMPLS = ("xla", "pallas")


def _validate(
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target_predict,
    num_spec_steps,
) -> None:
    probes.static_check(candidates.ndim == 2, f"candidates.shape={candidates.shape} must be (B, N)")
    for name, x in (
        ("retrive_index", retrive_index),
        ("retrive_next_token", retrive_next_token),
        ("retrive_next_sibling", retrive_next_sibling),
    ):
        probes.static_check_shape(x, candidates.shape, name)
    probes.static_check(
        target_predict.size == candidates.size,
        f"target_predict.shape={target_predict.shape} must hold B*N={candidates.size} entries",
    )
    probes.static_check(
        isinstance(num_spec_steps, int) and num_spec_steps >= 1,
        f"num_spec_steps={num_spec_steps!r} must be an int >= 1 (S+1)",
    )


def _probe_inputs(retrive_index, retrive_next_token, retrive_next_sibling) -> None:
    b, n = retrive_index.shape
    probes.detect_oob(retrive_index, 0, b * n, "verify_tree_greedy: retrive_index vs B*N")
    probes.detect_oob(retrive_next_token, -1, n, "verify_tree_greedy: retrive_next_token vs N")
    probes.detect_oob(retrive_next_sibling, -1, n, "verify_tree_greedy: retrive_next_sibling vs N")


def _probe_outputs(accept_index, total) -> None:
    probes.detect_oob(accept_index, -1, total, "verify_tree_greedy: accept_index vs [-1, B*N)")


# ---- Pallas kernel ------------------------------------------------------------------------------
def _verify_tree_greedy_kernel(
    candidates_ref,  # i32[B * N]
    retrive_index_ref,  # i32[B * N]    global node ids (b*N + j)
    next_token_ref,  # i32[B * N]
    next_sibling_ref,  # i32[B * N]
    target_ref,  # i32[B * N]     target_predict, flat, indexed by global node id
    predicts_ref,  # i32[B * N]     out
    accept_index_ref,  # i32[B * (S+1)] out
    accept_num_ref,  # i32[B]         out
    *,
    num_nodes: int,
    block: int,
    max_depth: int,
    accept_block: int,
    predicts_init: int,
):
    from jax.experimental.pallas import triton as pltriton

    b = pl.program_id(0)
    n = num_nodes
    lanes = jax.lax.iota(jnp.int32, block)
    live = lanes < n
    idx = b * n + lanes
    cand = pltriton.load(candidates_ref.at[idx], mask=live, other=-1)
    ridx = pltriton.load(retrive_index_ref.at[idx], mask=live, other=0)
    nxt_tok = pltriton.load(next_token_ref.at[idx], mask=live, other=NO_NODE)
    nxt_sib = pltriton.load(next_sibling_ref.at[idx], mask=live, other=NO_NODE)
    total = target_ref.shape[0]
    # Target token following each node: target_predict_flat[retrive_index[b, j]].
    tgt = pltriton.load(target_ref.at[jnp.clip(ridx, 0, total - 1)], mask=live, other=-1)
    acc_lanes = jax.lax.iota(jnp.int32, accept_block)

    def pick(vec, i):  # vec[i] for a scalar lane index (register select + reduce)
        return jnp.sum(jnp.where(lanes == i, vec, 0))

    def cond(state):
        it, _, _, _, _, done, _, _ = state
        return jnp.logical_and(jnp.logical_not(done), it < n)

    def body(state):
        it, cur, last, depth, num, _, pred, acc = state
        cur_ok = (cur >= 0) & (cur < n)
        target = pick(tgt, last)
        match = cur_ok & (pick(cand, cur) == target)
        pred = jnp.where(match & (lanes == last), target, pred)
        num = num + match.astype(jnp.int32)
        acc = jnp.where(match & (acc_lanes == num), pick(ridx, cur), acc)
        last = jnp.where(match, cur, last)
        depth = depth + match.astype(jnp.int32)
        cur = jnp.where(match, pick(nxt_tok, cur), pick(nxt_sib, cur))
        done = jnp.logical_not(cur_ok) | (match & (depth > max_depth))
        return it + 1, cur, last, depth, num, done, pred, acc

    zero = jnp.int32(0)
    state = (
        zero,
        pick(nxt_tok, 0),
        zero,
        jnp.int32(1),
        zero,
        jnp.bool_(max_depth == 0),
        jnp.full((block,), predicts_init, jnp.int32),
        jnp.where(acc_lanes == 0, pick(ridx, 0), NOT_ACCEPTED),
    )
    _, _, last, _, num, _, pred, acc = jax.lax.while_loop(cond, body, state)
    pred = jnp.where(lanes == last, pick(tgt, last), pred)  # bonus token
    pltriton.store(predicts_ref.at[idx], pred, mask=live)
    pltriton.store(
        accept_index_ref.at[b * (max_depth + 1) + acc_lanes], acc, mask=acc_lanes < max_depth + 1
    )
    accept_num_ref[b] = num


def _verify_tree_greedy_pallas(
    candidates,
    retrive_index,
    next_token,
    next_sibling,
    target_flat,
    *,
    num_spec_steps,
    predicts_init,
    interpret,
):
    """Launch the kernel (one program per request)."""
    bsz, n = candidates.shape
    block = next_power_of_2(n)
    out_shape = (
        jax.ShapeDtypeStruct((bsz * n,), jnp.int32),
        jax.ShapeDtypeStruct((bsz * num_spec_steps,), jnp.int32),
        jax.ShapeDtypeStruct((bsz,), jnp.int32),
    )
    kernel = functools.partial(
        _verify_tree_greedy_kernel,
        num_nodes=n,
        block=block,
        max_depth=num_spec_steps - 1,
        accept_block=max(2, next_power_of_2(num_spec_steps)),
        predicts_init=predicts_init,
    )
    predicts, accept_index, accept_num = pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(bsz,),
        interpret=interpret,
        num_warps=1 if block <= 32 else 2,
        name="verify_tree_greedy",
    )(*(x.reshape(-1) for x in (candidates, retrive_index, next_token, next_sibling)), target_flat)
    return predicts, accept_index.reshape(bsz, num_spec_steps), accept_num


# ---- pure-jnp reference -------------------------------------------------------------------------
def verify_tree_greedy_reference(
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target_predict,
    *,
    num_spec_steps: int,
    predicts_init: int = 0,
):
    """Pure-jnp oracle with the same arguments and outputs as :func:`verify_tree_greedy`."""
    bsz, n = candidates.shape
    total = bsz * n
    max_depth = num_spec_steps - 1
    target_flat = target_predict.reshape(-1).astype(jnp.int32)
    tgt = target_flat[jnp.clip(retrive_index, 0, total - 1)]  # (B, N) target after each node

    def body(_, walk: TreeWalk) -> TreeWalk:
        target = at_node(tgt, walk.last)
        match = walk.cur_ok(n) & (at_node(candidates, walk.cur) == target)
        return step_walk(
            walk,
            match,
            target,
            retrive_index,
            retrive_next_token,
            retrive_next_sibling,
            max_depth=max_depth,
        )

    walk = start_walk(retrive_next_token, retrive_index, num_spec_steps=num_spec_steps)
    walk = jax.lax.fori_loop(0, n, body, walk)
    bonus = at_node(tgt, walk.last)
    predicts = finish_predicts(walk, bonus, retrive_index, predicts_init=predicts_init)
    return predicts, walk.acc, walk.num.astype(jnp.int32)


# ---- public wrapper -----------------------------------------------------------------------------
@jit(static_argnames=("num_spec_steps", "predicts_init", "impl", "interpret"))
def verify_tree_greedy(
    candidates: jax.Array,
    retrive_index: jax.Array,
    retrive_next_token: jax.Array,
    retrive_next_sibling: jax.Array,
    target_predict: jax.Array,
    *,
    num_spec_steps: int,
    predicts_init: int = 0,
    impl: str = "xla",
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy tree verification (sgl_kernel ``verify_tree_greedy``).

    Args:
      candidates: i32[B, N] draft token of every node (``draft_tokens.reshape(B, N)``).
      retrive_index: i32[B, N] global node ids (``b*N + j``).
      retrive_next_token, retrive_next_sibling: i32[B, N] local node links, -1 = none.
      target_predict: i32[B, N] (or [B*N]) target argmax after each node, by global node id.
      num_spec_steps: static ``S + 1`` = columns of ``accept_index`` (max tree depth + 1).
      predicts_init: static value of never-written ``predicts`` entries (0 like eagle_sample;
        the kernel tests use -1).
      impl: ``"xla"`` or ``"pallas"``. interpret: Pallas interpret (None: unless on GPU).

    Returns:
      ``predicts`` i32[B*N] (for each accepted node, the token following it; the last
      accepted node holds the bonus token), ``accept_index`` i32[B, S+1] (global node ids,
      -1 padded), ``accept_token_num`` i32[B] (correct drafts, root excluded).
    """
    tree = (candidates, retrive_index, retrive_next_token, retrive_next_sibling)
    _validate(*tree, target_predict, num_spec_steps)
    impl = resolve_impl(impl, IMPLS, "verify_tree_greedy")
    candidates, retrive_index, retrive_next_token, retrive_next_sibling = (
        x.astype(jnp.int32) for x in tree
    )
    tree = (candidates, retrive_index, retrive_next_token, retrive_next_sibling)
    target_predict = target_predict.astype(jnp.int32)
    _probe_inputs(retrive_index, retrive_next_token, retrive_next_sibling)
    if impl == "pallas" and candidates.shape[0] > 0:
        out = _verify_tree_greedy_pallas(
            *tree,
            target_predict.reshape(-1),
            num_spec_steps=num_spec_steps,
            predicts_init=predicts_init,
            interpret=interpret,
        )
    else:
        out = verify_tree_greedy_reference(
            *tree, target_predict, num_spec_steps=num_spec_steps, predicts_init=predicts_init
        )
    _probe_outputs(out[1], candidates.size)
    return out
