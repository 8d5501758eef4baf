"""PyTorch reference of sglang 0.5.23's ``build_tree_kernel_efficient`` (SPEC.md §7.4).

``build_tree_kernel_efficient`` is ``srt/speculative/eagle_utils.py``'s wrapper (buffers, fills,
the flat draft tokens) around a port of the build-tree kernel, defined on every input the kernel
accepts, malformed trees included. The port follows 0.5.23's Triton kernel
(``kernels/ops/speculative/spec_tree.py::sgl_build_tree_kernel_efficient_triton``), whose rules
are those of the CUDA JIT kernel (``eagle.cuh::build_tree_efficient``) wherever that one is
defined. Per request ``b`` (``sel = top_scores_index[b, :N-1]``, the prefix sglang reads;
``tb(s) = s / K`` truncated toward zero; ``parent_list`` read at flat offset ``b*stride + tb``)::

    links   for i = N-1 .. 1:  tb == 0 -> parent 0 (root)
                               else parent = 1 + first c in [0, N-2] with sel[c] == parent_list[b, tb]
                               no such c -> node i left unlinked ("invalid eagle tree" warning)
                               head-insert i into its parent's child list, in any node order
    walk    node x >= 1: cur = x-1; up to `depth` (= spec_steps) steps: mark column cur+1,
            position += 1; stop at tb(sel[cur]) == 0 or when the parent is not selected;
            else cur = that parent's c.   positions[x] = L_b + steps; row x: root + marked

What this makes well defined that jspec's ``build_tree_kernel_efficient`` treats as invalid: a
parent selected *later* in node order (descending selections) is linked; a cycle is walked
``depth`` steps (mask row = the cycle members met, position = ``L + depth``); a self-parent links
``next_token[x] = x``. A ``parent_list`` read past the tensor's end (``tb`` out of range) counts
as "parent not selected" (sglang reads unrelated memory there).
"""

from __future__ import annotations

import enum
import math

import torch


class TreeMaskMode(enum.IntEnum):
    FULL_MASK = 0
    QLEN_ONLY = 1
    QLEN_ONLY_BITPACKING = 2


def packed_dtype(n: int) -> torch.dtype:
    """Word dtype of QLEN_ONLY_BITPACKING (sglang's ``packed_dtypes`` rule)."""
    return [torch.uint8, torch.uint16, torch.uint32][math.ceil(math.log2((n + 7) // 8))]


def tree_mask_numel(mode: TreeMaskMode, bs: int, n: int, prefix_tokens: int) -> int:
    """Cells of a ``tree_mask`` buffer: QLEN_ONLY ``B*N*N`` bools, QLEN_ONLY_BITPACKING ``B*N``
    words, FULL_MASK ``prefix_tokens*N + B*N*N`` bools (each query's prefix, then its tree)."""
    if mode == TreeMaskMode.QLEN_ONLY:
        return bs * n * n
    if mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
        return bs * n
    return prefix_tokens * n + bs * n * n


def _tdiv(a: int, b: int) -> int:
    """C / Triton integer division (truncation toward zero)."""
    q = abs(a) // b
    return q if a >= 0 else -q


def _parent_of(
    sel: list[int], c: int, flat: list[int], row_offset: int, topk: int, n: int
) -> tuple[bool, int | None]:
    """(is_root, selected column of the parent or None) of the node at column ``c``."""
    tb = _tdiv(sel[c], topk)
    if tb == 0:
        return True, None
    offset = row_offset + tb
    if not 0 <= offset < len(flat):
        return False, None
    token = flat[offset]
    return False, next((cp for cp in range(n - 1) if sel[cp] == token), None)


def unlinked_nodes(
    parent_list: torch.Tensor, selected_index: torch.Tensor, topk: int, n: int
) -> list[tuple[int, int]]:
    """``(request, node)`` of every node sglang's kernel leaves unlinked, printing "WARNING:
    invalid eagle tree" (its parent token is not selected anywhere in the row): sglang's
    definition of an invalid tree. Descending, cyclic and self-parent selections are linked."""
    flat = parent_list.contiguous().reshape(-1).tolist()
    stride = parent_list.shape[1] if parent_list.dim() > 1 else parent_list.shape[0]
    out = []
    for b in range(selected_index.shape[0]):
        sel = [int(x) for x in selected_index[b, : n - 1]]
        for i in range(1, n):
            is_root, cp = _parent_of(sel, i - 1, flat, b * stride, topk, n)
            if not is_root and cp is None:
                out.append((b, i))
    return out


def sglang_tree(
    parent_list: torch.Tensor, selected_index: torch.Tensor, topk: int, depth: int, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's links and walk for every request (see the module docstring).

    Args:
      parent_list: int[B, W] (any W: read by flat offset ``b*W + tb``).
      selected_index: int[B, >= N-1] (only the first N-1 columns are read).
      topk, depth, n: ``K``, ``spec_steps``, ``N``.

    Returns:
      ``(next_token i64[B, N], next_sibling i64[B, N], anc bool[B, N, N], steps i64[B, N])``;
      ``anc[b, x, j]`` is the tree-mask cell (row x, tree column j), ``steps`` the positions
      minus ``L_b``.
    """
    bs = selected_index.shape[0]
    flat = parent_list.contiguous().reshape(-1).tolist()
    stride = parent_list.shape[1] if parent_list.dim() > 1 else parent_list.shape[0]
    next_token = torch.full((bs, n), -1, dtype=torch.int64)
    next_sibling = torch.full((bs, n), -1, dtype=torch.int64)
    anc = torch.zeros((bs, n, n), dtype=torch.bool)
    steps = torch.zeros((bs, n), dtype=torch.int64)
    for b in range(bs):
        sel = [int(x) for x in selected_index[b, : n - 1]]

        def parent_of(c: int, b: int = b, sel: list[int] = sel) -> tuple[bool, int | None]:
            return _parent_of(sel, c, flat, b * stride, topk, n)

        for i in range(n - 1, 0, -1):
            is_root, cp = parent_of(i - 1)
            if is_root:
                parent = 0
            elif cp is None:
                continue  # sglang: "WARNING: invalid eagle tree", node left unlinked
            else:
                parent = cp + 1
            if next_token[b, parent] != -1:
                next_sibling[b, i] = next_token[b, parent]
            next_token[b, parent] = i
        anc[b, :, 0] = True
        for x in range(1, n):
            cur, count = x - 1, 0
            for _ in range(depth):
                count += 1
                anc[b, x, cur + 1] = True
                is_root, cp = parent_of(cur)
                if is_root or cp is None:
                    break
                cur = cp
            steps[b, x] = count
    return next_token, next_sibling, anc, steps


def assemble_tree_mask(
    anc: torch.Tensor,
    mode: TreeMaskMode,
    seq_lens: list[int],
    seq_lens_sum: int,
    tree_mask_buf: torch.Tensor | None,
    fill_prefix_mask: bool,
    device: torch.device,
) -> torch.Tensor:
    """sglang's tree_mask from the tree cells ``anc`` bool[B, N, N] (the kernel writes every cell).

    Fresh buffers: QLEN_ONLY ``bool[B*N*N]``, QLEN_ONLY_BITPACKING ``uint{8,16,32}[B*N]``,
    FULL_MASK ``bool[seq_lens_sum*N + B*N*N]`` filled with ``fill_prefix_mask`` (sglang: uninitialised
    memory when False; False here). A given ``tree_mask_buf`` is filled as sglang fills it (all
    True / all 0 / all True only if ``fill_prefix_mask``) and returned.
    """
    bs, n = anc.shape[0], anc.shape[1]
    if mode == TreeMaskMode.FULL_MASK and seq_lens_sum < sum(seq_lens):
        raise ValueError(f"seq_lens_sum={seq_lens_sum} must be >= sum(seq_lens)={sum(seq_lens)}")
    if tree_mask_buf is not None:
        mask = tree_mask_buf
        if mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
            mask.fill_(0)
        elif mode == TreeMaskMode.QLEN_ONLY or fill_prefix_mask:
            mask.fill_(True)
    else:
        size = tree_mask_numel(mode, bs, n, seq_lens_sum)
        if mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
            mask = torch.zeros((size,), dtype=packed_dtype(n), device=device)
        else:
            fill = mode == TreeMaskMode.QLEN_ONLY or bool(fill_prefix_mask)
            mask = torch.full((size,), fill, dtype=torch.bool, device=device)
    flat = mask.view(-1)
    if mode == TreeMaskMode.QLEN_ONLY:
        flat[: bs * n * n] = anc.reshape(-1).to(flat.device, flat.dtype)
    elif mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
        bits = torch.tensor([1 << j for j in range(n)], dtype=torch.int64)
        words = (anc.to(torch.int64) * bits).sum(-1).reshape(-1)
        flat[: bs * n] = words.to(flat.dtype).to(flat.device)
    elif bs:
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        starts = torch.cumsum(lens * n + n * n, 0) - (lens * n + n * n)
        rows = torch.arange(n)[None, :, None]
        cols = torch.arange(n)[None, None, :]
        idx = starts[:, None, None] + rows * (lens + n)[:, None, None] + lens[:, None, None] + cols
        flat[idx.reshape(-1).to(flat.device)] = anc.reshape(-1).to(flat.device, flat.dtype)
    return mask


def build_tree_kernel_efficient(
    bonus_tokens: torch.Tensor,
    parent_list: torch.Tensor,
    top_scores_index: torch.Tensor,
    draft_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_sum: int,
    topk: int,
    spec_steps: int,
    num_verify_tokens: int,
    tree_mask_mode: int = TreeMaskMode.FULL_MASK,
    tree_mask_buf: torch.Tensor | None = None,
    fill_prefix_mask: bool = True,
):
    """sglang's 6-tuple ``(tree_mask, positions i64[B*N], retrive_index, retrive_next_token,
    retrive_next_sibling i64[B, N], draft_tokens[B*(1+W)])``; see the module docstring."""
    n = num_verify_tokens
    bs = seq_lens.numel()
    device = seq_lens.device
    draft_tokens_flat = torch.cat((bonus_tokens.unsqueeze(1), draft_tokens), dim=1).flatten()
    if top_scores_index.shape[-1] < n - 1:
        raise ValueError(
            f"top_scores_index.shape={tuple(top_scores_index.shape)}: needs >= "
            f"num_verify_tokens-1={n - 1} columns"
        )
    next_token, next_sibling, anc, steps = sglang_tree(
        parent_list.cpu(), top_scores_index.cpu(), topk, spec_steps, n
    )
    lens = [int(x) for x in seq_lens]
    mask = assemble_tree_mask(
        anc,
        TreeMaskMode(int(tree_mask_mode)),
        lens,
        int(seq_lens_sum),
        tree_mask_buf,
        fill_prefix_mask,
        device,
    )
    positions = (torch.tensor(lens, dtype=torch.int64)[:, None] + steps).reshape(-1)
    retrive_index = torch.arange(bs * n, dtype=torch.int64).reshape(bs, n)
    return (
        mask,
        positions.to(device),
        retrive_index.to(device),
        next_token.to(device),
        next_sibling.to(device),
        draft_tokens_flat,
    )
