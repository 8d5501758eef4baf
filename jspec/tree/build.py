"""``build_tree_kernel_efficient``: verify-tree metadata from the organized draft (SPEC.md §7.4).

Inputs come from :func:`jspec.tree.select.organize_draft_results`. Outputs, per request ``b``
with committed length ``L_b`` and nodes ``j = 0..N-1`` (node 0 = root = previous bonus token)::

    draft_tokens[b*N + j]          bonus_tokens[b] (j == 0) | draft_tokens[b, j-1]
    positions[b*N + j]             L_b + depth(j)
    retrive_index[b, j]            b*N + j                       (global node id)
    retrive_next_token[b, j]       first child of j, or -1       (children in increasing j)
    retrive_next_sibling[b, j]     next sibling of j, or -1
    tree_mask                      row i: i itself, its ancestors and the root are True

Tree-mask layouts (``mode``):

    FULL_MASK              bool[B, N, max_seq_len + N]   columns [0, L_b): fill_prefix_mask
                                                         columns L_b + j:  ancestor bits
                                                         columns >= L_b + N: False
    QLEN_ONLY              bool[B, N, N]
    QLEN_ONLY_BITPACKING   uint8 | uint16 | uint32 [B, N] for N <= 8 | 16 | 32
                           (bit j of row i = ancestor-or-self, bit 0 always set)

NOTE: sglang's FULL_MASK is a ragged flat ``ΣL·N + B·N²`` buffer; a static-shape JAX array
needs a static bound, hence the padded ``[B, N, max_seq_len + N]`` form. :func:`flatten_full_mask`
(host, numpy) produces sglang's exact flat layout. With ``fill_prefix_mask=False`` sglang leaves
the prefix columns as they were in its (possibly uninitialised) buffer; here they are False.

Invalid trees (a node's parent token is not among the selected nodes): sglang's CUDA kernel
prints "WARNING: invalid eagle tree" and leaves the node unlinked, and its mask/position walk
can then misbehave. Here the behaviour is defined: ``is_valid[b] = False``; the node is not
linked (nothing points to it; its own next_sibling is -1); its mask row is self + root and its
position is ``L_b + 1``; descendants hang below it normally. With probes on, an
``assert_async`` names the first bad request and node. See :mod:`jspec.kernels.build_tree`.

Index dtype is int32 (sglang: int64).
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np

from jspec import probes
from jspec._jit import jit
from jspec._pytree import pytree_dataclass
from jspec.config import TreeGeometry, check_geometry
from jspec.kernels.build_tree import build_tree


class TreeMaskMode(enum.IntEnum):
    """sglang ``TreeMaskMode`` (same integer values)."""

    FULL_MASK = 0
    QLEN_ONLY = 1
    QLEN_ONLY_BITPACKING = 2


@pytree_dataclass
class BuildTreeOutput:
    """Verify-tree metadata (all arrays; rows past the live batch are harmless)."""

    # bool[B, N, max_seq_len + N] | bool[B, N, N] | uint{8,16,32}[B, N]  (see module docstring)
    tree_mask: jax.Array
    # i32[B*N]: L_b + depth(j)
    positions: jax.Array
    # i32[B, N]: b*N + j
    retrive_index: jax.Array
    # i32[B, N]: first child node (local index) or -1
    retrive_next_token: jax.Array
    # i32[B, N]: next sibling node (local index) or -1
    retrive_next_sibling: jax.Array
    # i32[B*N]: bonus token then the N-1 drafts of each request
    draft_tokens: jax.Array
    # bool[B]: False when some node's parent was not selected (see module docstring)
    is_valid: jax.Array


_BITPACK_DTYPES = ((8, jnp.uint8), (16, jnp.uint16), (32, jnp.uint32))


def bitpack_dtype(num_draft_tokens: int):
    """Word dtype of QLEN_ONLY_BITPACKING rows; ValueError for N > 32."""
    for bits, dtype in _BITPACK_DTYPES:
        if num_draft_tokens <= bits:
            return dtype
    raise ValueError(
        f"num_draft_tokens={num_draft_tokens} must be <= 32 for mode=QLEN_ONLY_BITPACKING"
    )


def _validate(
    bonus_tokens,
    parent_list,
    top_scores_index,
    draft_tokens,
    seq_lens,
    *,
    geometry,
    mode,
    max_seq_len,
) -> None:
    k, s, n = geometry.topk, geometry.num_steps, geometry.num_draft_tokens
    b = seq_lens.shape[0]
    probes.static_check_shape(seq_lens, (b,), "seq_lens")
    probes.static_check_shape(bonus_tokens, (b,), "bonus_tokens")
    probes.static_check_shape(top_scores_index, (b, n - 1), "top_scores_index")
    probes.static_check_shape(draft_tokens, (b, n - 1), "draft_tokens")
    probes.static_check(
        parent_list.ndim == 2 and parent_list.shape[0] == b,
        f"parent_list.shape={parent_list.shape} must be (B={b}, width)",
    )
    if s > 1:  # JIT precondition: width K*(S-1)+1; any width when S == 1.
        probes.static_check(
            parent_list.shape[1] == k * (s - 1) + 1,
            f"parent_list.shape={parent_list.shape} must be (B, topk*(num_steps-1)"
            f"+1 = {k * (s - 1) + 1})",
        )
    for name, x in (
        ("bonus_tokens", bonus_tokens),
        ("parent_list", parent_list),
        ("top_scores_index", top_scores_index),
        ("draft_tokens", draft_tokens),
        ("seq_lens", seq_lens),
    ):
        probes.static_check_dtype(x, (jnp.int32, jnp.int64), name)
    probes.static_check(mode in tuple(TreeMaskMode), f"mode={mode!r} must be a TreeMaskMode")
    if mode == TreeMaskMode.FULL_MASK:
        probes.static_check(
            isinstance(max_seq_len, int) and max_seq_len >= 0,
            f"max_seq_len={max_seq_len!r} must be an int >= 0 for FULL_MASK",
        )
    if mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
        bitpack_dtype(n)


def _full_mask(
    anc: jax.Array, seq_lens: jax.Array, max_seq_len: int, fill_prefix_mask: bool
) -> jax.Array:
    """bool[B, N, N] ancestor mask -> padded FULL_MASK bool[B, N, max_seq_len + N]."""
    b, n, _ = anc.shape
    col = jnp.arange(max_seq_len + n, dtype=jnp.int32)[None, :]
    rel = col - seq_lens[:, None]  # tree column index (B, W)
    in_tree = (rel >= 0) & (rel < n)
    tree_bits = jnp.take_along_axis(
        anc, jnp.broadcast_to(jnp.clip(rel, 0, n - 1)[:, None, :], (b, n, col.shape[1])), axis=2
    )
    prefix = (rel < 0) & fill_prefix_mask
    return jnp.where(in_tree[:, None, :], tree_bits, prefix[:, None, :])


@jit(
    static_argnames=(
        "geometry",
        "mode",
        "max_seq_len",
        "fill_prefix_mask",
        "impl",
        "interpret",
        "probe_valid_tree",
    ),
)
def build_tree_kernel_efficient(
    bonus_tokens: jax.Array,
    parent_list: jax.Array,
    top_scores_index: jax.Array,
    draft_tokens: jax.Array,
    seq_lens: jax.Array,
    *,
    geometry: TreeGeometry,
    mode: TreeMaskMode = TreeMaskMode.FULL_MASK,
    max_seq_len: int | None = None,
    fill_prefix_mask: bool = True,
    impl: str = "xla",
    interpret: bool | None = None,
    probe_valid_tree: bool = True,
) -> BuildTreeOutput:
    """Build the verify tree of every request (sglang ``build_tree_kernel_efficient``).

    Args:
      bonus_tokens: i32[B] previous bonus token of each request (the tree root).
      parent_list: i32[B, K*(S-1)+1] from organize_draft_results (i32[B, 0] or any width
        when S == 1).
      top_scores_index: i32[B, N-1] ascending flat ss indices in ``[0, K + (S-1)K²)``.
      draft_tokens: i32[B, N-1] tokens at those indices.
      seq_lens: i32[B] committed (KV-ready) prefix lengths ``L_b``.
      geometry: static :class:`jspec.config.TreeGeometry` (reads ``K``, ``S``, ``N``).
      mode: static :class:`TreeMaskMode`.
      max_seq_len: static bound on ``L_b`` (FULL_MASK only; probed with probes on).
      fill_prefix_mask: static; FULL_MASK prefix columns True (sglang's ``fill_(True)``) or False.
      impl: ``"xla"`` or ``"pallas"`` (one program per request). interpret: Pallas interpret.
      probe_valid_tree: static; with probes on, probe jspec's valid tree (every node's parent
        selected earlier in node order: ``is_valid``). The sglang drop-in turns it off and
        probes sglang's own rule instead (``interop.tree.dropin``).

    Returns:
      :class:`BuildTreeOutput`. int64 in sglang, int32 here.
    """
    check_geometry(geometry, "build_tree_kernel_efficient")
    topk, num_draft_tokens = geometry.topk, geometry.num_draft_tokens
    mode = TreeMaskMode(mode)
    _validate(
        bonus_tokens,
        parent_list,
        top_scores_index,
        draft_tokens,
        seq_lens,
        geometry=geometry,
        mode=mode,
        max_seq_len=max_seq_len,
    )
    n = num_draft_tokens
    seq_lens = seq_lens.astype(jnp.int32)
    probes.detect_oob(
        top_scores_index,
        0,
        geometry.num_candidates,
        "build_tree_kernel_efficient: top_scores_index vs ss width",
    )
    if mode == TreeMaskMode.FULL_MASK:
        probes.detect_in_closed_range(
            seq_lens, 0, max_seq_len, "build_tree_kernel_efficient: seq_lens vs max_seq_len"
        )
    word_dtype = bitpack_dtype(n) if mode == TreeMaskMode.QLEN_ONLY_BITPACKING else None
    (
        next_token,
        next_sibling,
        positions,
        mask,
        first_invalid,
        retrive_index,
        flat_tokens,
        is_valid,
    ) = build_tree(
        parent_list,
        top_scores_index,
        seq_lens,
        bonus_tokens,
        draft_tokens,
        topk=topk,
        word_dtype=word_dtype,
        impl=impl,
        interpret=interpret,
    )
    if probe_valid_tree:
        probes.assert_async(
            lambda: jnp.all(is_valid),
            "build_tree_kernel_efficient: invalid eagle tree: request {request} node {node} has no "
            "selected parent",
            request=lambda: jnp.argmin(is_valid),
            node=lambda: first_invalid[jnp.argmin(is_valid)],
        )
    if mode == TreeMaskMode.FULL_MASK:
        assert max_seq_len is not None  # _validate raised ValueError for FULL_MASK without it
        tree_mask = _full_mask(mask, seq_lens, max_seq_len, fill_prefix_mask)
    else:
        tree_mask = mask
    return BuildTreeOutput(
        tree_mask=tree_mask,
        positions=positions,
        retrive_index=retrive_index,
        retrive_next_token=next_token,
        retrive_next_sibling=next_sibling,
        draft_tokens=flat_tokens,
        is_valid=is_valid,
    )


def flatten_full_mask(tree_mask, seq_lens) -> np.ndarray:
    """Host helper: padded FULL_MASK bool[B, N, max_seq_len + N] -> sglang's flat layout.

    Returns bool[ΣL·N + B·N²]: request blocks of shape ``N x (L_b + N)`` concatenated in batch
    order (exactly sglang's ``tree_mask`` buffer).
    """
    mask = np.asarray(tree_mask)
    lens = np.asarray(seq_lens).astype(np.int64)
    n = mask.shape[1]
    return np.concatenate(
        [mask[b, :, : lens[b] + n].reshape(-1) for b in range(mask.shape[0])]
        or [np.zeros((0,), bool)]
    )
