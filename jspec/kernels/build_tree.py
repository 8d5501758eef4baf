"""Tree links, depths and ancestor masks for ``build_tree_kernel_efficient`` (SPEC.md §7.4).

The core of sglang's build-tree kernel, on static shapes. Per request ``b`` with tree nodes
``j = 0..N-1`` (node 0 = root = the previous bonus token, node ``j >= 1`` = selected ss index
``sel[b, j-1]``)::

    parent(j)        0                              if sel[j-1] // K == 0
                     1 + (first m: sel[m] == p)     p = parent_list[b, sel[j-1] // K]
    next_token[p]    smallest linked child of p     (= sglang's head insertion from N-1 down)
    next_sibling[j]  smallest linked j' > j with parent(j') == parent(j)
    anc[i, j]        j is i, an ancestor of i, or the root
    depth[i]         sum_j anc[i, j] - 1            positions = seq_len + depth

Invalid nodes (defined here; sglang prints "WARNING: invalid eagle tree" and skips the link):
a node whose parent token is not among the selected indices (or whose selected index is
negative, whose parent_list entry is out of range, or whose parent would not come earlier
in the node order) is **not linked** (no next_token / next_sibling entry points to it, its own
next_sibling is -1). For the mask and positions it counts as a child of the root (row = self +
root, position ``seq_len + 1``); its descendants hang below it normally. ``first_invalid[b]``
is the smallest invalid node of request b, or -1.

Two implementations:

* ``impl="xla"``: :func:`build_tree_reference`, vectorised jnp over the batch. Parent search
  compares against the selected-index row; the ancestor mask is built by pointer jumping
  (``A |= A[jump]; jump = jump[jump]``, ``ceil(log2(N-1))`` rounds).
* ``impl="pallas"``: one program per request (``grid=(B,)``), nodes padded to
  ``NP = max(16, next_pow2(N))`` lanes (masked). Parent search and links are
  ``(NP, NP)`` compare + min-reductions; the ancestor mask is a transitive closure by
  repeated squaring (``A = A @ A > 0``, on the tensor cores; 0/1 values are exact in TF32).

Both give bit-identical outputs, including ``retrive_index``, the flat draft tokens and the
validity flag (the kernel writes every output the public op returns). The FULL_MASK layout is
assembled by :mod:`jspec.tree.build`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jspec._jit import jit
from jspec.config import next_power_of_2
from jspec.kernels._common import pallas_call, resolve_impl
from jspec.sentinels import NO_NODE

IMPLS = ("xla", "pallas")
# Largest N the Pallas kernel takes (one (NP, NP) tile per program); use impl="xla" above.
MAX_PALLAS_NODES = 256
# Smallest tile edge: tl.dot needs M, N, K >= 16.
_MIN_BLOCK = 16


def num_closure_rounds(num_draft_tokens: int) -> int:
    """Doubling rounds that cover every path length <= N-1: ``ceil(log2(N-1))`` (0 if N <= 2)."""
    return max(0, (num_draft_tokens - 2).bit_length())


def _parent_search(sel_node, parent_tok, tb, nodes, live, *, parent_width):
    """Shared parent rule: returns (parent node, ok) for every node lane (any leading batch dims).

    ``sel_node[..., j]`` is node j's selected index, ``parent_tok`` the parent_list entry at
    ``tb = sel // K``; the parent is the first node m >= 1 with ``sel_node[m] == parent_tok``.
    """
    eq = (sel_node[..., None, :] == parent_tok[..., :, None]) & live[..., None, :]
    big = nodes.shape[-1]
    pos = jnp.min(jnp.where(eq, nodes[..., None, :], big), axis=-1)
    need = live & (tb >= 1)
    in_range = tb < parent_width
    ok = live & (sel_node >= 0) & ((tb == 0) | (need & in_range & (pos < nodes)))
    parent = jnp.where(tb == 0, 0, pos)
    return parent, ok


def _links(parent, ok, rows, cols, big):
    """next_token / next_sibling from the parent rule (2-D compare + min-reduce)."""
    child = ok[..., None, :] & (parent[..., None, :] == rows)
    next_token = jnp.min(jnp.where(child, cols, big), axis=-1)
    sib = (
        ok[..., :, None]
        & ok[..., None, :]
        & (parent[..., None, :] == parent[..., :, None])
        & (cols > rows)
    )
    next_sibling = jnp.min(jnp.where(sib, cols, big), axis=-1)
    next_token = jnp.where(next_token == big, NO_NODE, next_token)
    next_sibling = jnp.where(next_sibling == big, NO_NODE, next_sibling)
    return next_token, next_sibling


# ---- Pallas kernel ------------------------------------------------------------------------------
def _build_tree_kernel(
    parent_list_ref,  # i32[B * PW]      flattened parent_list (PW >= 1; padded with -1 if empty)
    sel_ref,  # i32[B * (N-1)]   flattened top_scores_index
    seq_lens_ref,  # i32[B]
    bonus_ref,  # i32[B]           bonus tokens (tree roots)
    drafts_ref,  # i32[B * (N-1)]   flattened draft tokens
    next_token_ref,  # i32[B * N]       out
    next_sibling_ref,  # i32[B * N]      out
    positions_ref,  # i32[B * N]       out
    mask_ref,  # bool[B * N * N]  out (qlen mask) | word_dtype[B * N] (bitpacked rows)
    invalid_ref,  # i32[B]           out: first invalid node or -1
    retrive_index_ref,  # i32[B * N]     out: b*N + j
    tokens_ref,  # i32[B * N]       out: bonus token, then the drafts
    valid_ref,  # bool[B]          out
    *,
    topk: int,
    num_nodes: int,
    parent_width: int,
    parent_stride: int,
    block: int,
    rounds: int,
    word_dtype,
):
    b = pl.program_id(0)
    n, np_ = num_nodes, block
    nsel = n - 1
    rows = jax.lax.broadcasted_iota(jnp.int32, (np_, np_), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (np_, np_), 1)
    nodes = jax.lax.iota(jnp.int32, np_)
    live = (nodes >= 1) & (nodes < n)
    # Node j's selected ss index sel[b, j-1] (lane 0 = root: masked).
    sel_node = _load(sel_ref, b * nsel + jnp.maximum(nodes - 1, 0), live, 0)
    tb = jnp.where(sel_node >= 0, jax.lax.div(jnp.maximum(sel_node, 0), topk), -1)
    need = live & (tb >= 1) & (tb < parent_width)
    parent_tok = _load(
        parent_list_ref, b * parent_stride + jnp.clip(tb, 0, parent_stride - 1), need, -1
    )
    parent, ok = _parent_search(sel_node, parent_tok, tb, nodes, live, parent_width=parent_width)
    next_token, next_sibling = _links(parent, ok, rows, cols, np_)
    # Ancestor-or-self closure: start from {self, parent} (invalid -> root), square `rounds` times.
    up = jnp.where(ok, parent, 0)
    adj = ((cols == rows) | (cols == up[:, None])).astype(jnp.float32)

    def square(_, a):
        return (jnp.dot(a, a, preferred_element_type=jnp.float32) > 0.5).astype(jnp.float32)

    anc = jax.lax.fori_loop(0, rounds, square, adj) > 0.5
    depth = jnp.sum(anc.astype(jnp.int32), axis=1) - 1
    seq_len = seq_lens_ref[b]
    out_idx = b * n + nodes
    out_live = nodes < n
    _store(next_token_ref, out_idx, next_token, out_live)
    _store(next_sibling_ref, out_idx, next_sibling, out_live)
    _store(positions_ref, out_idx, seq_len + depth, out_live)
    in_tree = (rows < n) & (cols < n)
    if word_dtype is not None:
        words = jnp.sum(jnp.where(anc & in_tree, jnp.left_shift(1, cols), 0), axis=1)
        _store(mask_ref, out_idx, _to_word(words, word_dtype), out_live)
    else:
        _store(mask_ref, b * n * n + rows * n + cols, anc, in_tree)
    _store(retrive_index_ref, out_idx, out_idx, out_live)
    draft = _load(drafts_ref, b * nsel + jnp.maximum(nodes - 1, 0), live, 0)
    _store(tokens_ref, out_idx, jnp.where(nodes == 0, bonus_ref[b], draft), out_live)
    bad = jnp.where(live & ~ok, nodes, np_)
    first_bad = jnp.min(bad)
    invalid_ref[b] = jnp.where(first_bad == np_, NO_NODE, first_bad)
    valid_ref[b] = first_bad == np_


def _to_word(words, word_dtype):
    """int32 bit pattern -> the packed word dtype (uint32: bit-identical reinterpretation)."""
    if jnp.dtype(word_dtype).itemsize == 4:
        return jax.lax.bitcast_convert_type(words, word_dtype)
    return words.astype(word_dtype)


def _load(ref, idx, mask, other):
    from jax.experimental.pallas import triton as pltriton

    return pltriton.load(ref.at[idx], mask=mask, other=other)


def _store(ref, idx, value, mask):
    from jax.experimental.pallas import triton as pltriton

    pltriton.store(ref.at[idx], value, mask=mask)


def _build_tree_pallas(parent_list, sel, seq_lens, bonus, drafts, *, topk, word_dtype, interpret):
    """Launch the kernel (one program per request)."""
    bsz, nsel = sel.shape
    n = nsel + 1
    width = parent_list.shape[1]
    stride = max(width, 1)
    if width == 0:  # S == 1: no non-root parents; keep a dummy column for the flat ref.
        parent_list = jnp.full((bsz, 1), -1, jnp.int32)
    block = max(_MIN_BLOCK, next_power_of_2(n))
    flat = jax.ShapeDtypeStruct((bsz * n,), jnp.int32)
    mask_shape = (
        jax.ShapeDtypeStruct((bsz * n,), word_dtype)
        if word_dtype is not None
        else jax.ShapeDtypeStruct((bsz * n * n,), jnp.bool_)
    )
    out_shape = (
        flat,
        flat,
        flat,
        mask_shape,
        jax.ShapeDtypeStruct((bsz,), jnp.int32),
        flat,
        flat,
        jax.ShapeDtypeStruct((bsz,), jnp.bool_),
    )
    kernel = functools.partial(
        _build_tree_kernel,
        topk=topk,
        num_nodes=n,
        parent_width=width,
        parent_stride=stride,
        block=block,
        rounds=num_closure_rounds(n),
        word_dtype=word_dtype,
    )
    outs = pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(bsz,),
        interpret=interpret,
        num_warps=4 if block <= 64 else 8,
        name="build_tree_kernel_efficient",
    )(parent_list.reshape(-1), sel.reshape(-1), seq_lens, bonus, drafts.reshape(-1))
    next_token, next_sibling, positions, mask, first_invalid, ridx, tokens, is_valid = outs
    mask = mask.reshape(bsz, n) if word_dtype is not None else mask.reshape(bsz, n, n)
    return (
        next_token.reshape(bsz, n),
        next_sibling.reshape(bsz, n),
        positions,
        mask,
        first_invalid,
        ridx.reshape(bsz, n),
        tokens,
        is_valid,
    )


# ---- pure-jnp reference -------------------------------------------------------------------------
def build_tree_reference(
    parent_list: jax.Array,
    sel: jax.Array,
    seq_lens: jax.Array,
    bonus: jax.Array,
    drafts: jax.Array,
    *,
    topk: int,
    word_dtype=None,
):
    """Pure-jnp oracle; same arguments and outputs as :func:`build_tree` (no impl)."""
    bsz, nsel = sel.shape
    n = nsel + 1
    width = parent_list.shape[1]
    nodes = jnp.arange(n, dtype=jnp.int32)
    live = nodes >= 1
    sel_node = jnp.concatenate([jnp.zeros((bsz, 1), jnp.int32), sel], axis=1)
    tb = jnp.where(sel_node >= 0, jnp.maximum(sel_node, 0) // topk, -1)
    need = live & (tb >= 1) & (tb < width)
    if width:
        gathered = jnp.take_along_axis(parent_list, jnp.clip(tb, 0, width - 1), axis=1)
    else:
        gathered = jnp.full((bsz, n), -1, jnp.int32)
    parent_tok = jnp.where(need, gathered, -1)
    parent, ok = _parent_search(sel_node, parent_tok, tb, nodes, live, parent_width=width)
    next_token, next_sibling = _links(parent, ok, nodes[:, None], nodes[None, :], n)
    # Pointer jumping: anc = ancestors within 2^k hops (self included); jump = 2^k-th ancestor.
    jump = jnp.where(ok, parent, 0)
    anc = (nodes[None, None, :] == nodes[None, :, None]) | (
        nodes[None, None, :] == jump[:, :, None]
    )
    for _ in range(num_closure_rounds(n)):
        anc = anc | jnp.take_along_axis(anc, jump[:, :, None], axis=1)
        jump = jnp.take_along_axis(jump, jump, axis=1)
    depth = jnp.sum(anc, axis=2, dtype=jnp.int32) - 1
    positions = (seq_lens[:, None] + depth).reshape(-1)
    if word_dtype is not None:
        words = jnp.sum(
            jnp.where(anc, jnp.left_shift(1, nodes)[None, None, :], 0), axis=2, dtype=jnp.int32
        )
        mask = _to_word(words, word_dtype)
    else:
        mask = anc
    bad = jnp.where(live & ~ok, nodes, n)
    first_bad = jnp.min(bad, axis=1)
    first_invalid = jnp.where(first_bad == n, NO_NODE, first_bad).astype(jnp.int32)
    retrive_index = jnp.arange(bsz, dtype=jnp.int32)[:, None] * n + nodes[None, :]
    tokens = jnp.concatenate([bonus[:, None], drafts], axis=1).reshape(-1)
    return (
        next_token,
        next_sibling,
        positions.astype(jnp.int32),
        mask,
        first_invalid,
        retrive_index,
        tokens,
        first_invalid == NO_NODE,
    )


# ---- dispatch -----------------------------------------------------------------------------------
@jit(static_argnames=("topk", "word_dtype", "impl", "interpret"))
def build_tree(
    parent_list: jax.Array,
    sel: jax.Array,
    seq_lens: jax.Array,
    bonus: jax.Array,
    drafts: jax.Array,
    *,
    topk: int,
    word_dtype=None,
    impl: str = "xla",
    interpret: bool | None = None,
):
    """Links, positions, ancestor mask and flat tokens of every request's draft tree.

    Args:
      parent_list: i32[B, P] (``P = K*(S-1)+1``, or 0 when S == 1).
      sel: i32[B, N-1] ``top_scores_index`` (ascending flat ss indices).
      seq_lens: i32[B] committed prefix lengths ``L_b``.
      bonus: i32[B] bonus tokens (roots). drafts: i32[B, N-1] draft tokens.
      topk: static ``K``.
      word_dtype: static; None for the bool[B, N, N] mask, else uint8/uint16/uint32 bitpacked
        rows (bit j of row i).
      impl: ``"xla"`` (reference) or ``"pallas"``. interpret: Pallas interpret mode
        (None: interpret unless on GPU).

    Returns:
      ``(next_token i32[B, N], next_sibling i32[B, N], positions i32[B*N],
      mask bool[B, N, N] | word_dtype[B, N], first_invalid i32[B] (-1 when valid),
      retrive_index i32[B, N], tokens i32[B*N], is_valid bool[B])``. Everything the public
      op returns comes out of the one kernel (no extra XLA kernels on the fast path).
    """
    impl = resolve_impl(impl, IMPLS, "build_tree_kernel_efficient")
    parent_list, sel, seq_lens, bonus, drafts = (
        x.astype(jnp.int32) for x in (parent_list, sel, seq_lens, bonus, drafts)
    )
    if impl == "pallas" and sel.shape[0] > 0:
        if sel.shape[1] + 1 > MAX_PALLAS_NODES:
            raise ValueError(
                f"num_draft_tokens={sel.shape[1] + 1} exceeds the Pallas tile limit "
                f"{MAX_PALLAS_NODES}; use impl='xla'"
            )
        return _build_tree_pallas(
            parent_list,
            sel,
            seq_lens,
            bonus,
            drafts,
            topk=topk,
            word_dtype=word_dtype,
            interpret=interpret,
        )
    return build_tree_reference(
        parent_list, sel, seq_lens, bonus, drafts, topk=topk, word_dtype=word_dtype
    )
