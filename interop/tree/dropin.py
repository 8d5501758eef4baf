"""Drop-ins for sglang's EAGLE tree ops, computed by jspec (``jspec.tree``).

Every function has the signature and in-place convention of sglang 0.5.23 (and of its torch
reference in :mod:`interop.tree.reference`): inputs go through the DLPack shim (zero-copy where
DLPack allows; sglang's int64 index tensors are range-checked and cast to int32), the jspec op
runs (``impl=`` picks its kernel; through :func:`interop._adapt.run_jspec`, so a fired probe is an
``AssertionError``), and results are written into the caller's tensors or returned with sglang's
dtypes (int64 indices).

* ``verify_tree_greedy`` / ``tree_speculative_sampling_target_only``: only the accepted nodes'
  ``predicts`` and the written ``accept_index`` entries change. ``draft_probs`` is not written
  (jspec's target-only sampler keeps the rejected mass internally).
* ``build_tree_kernel_efficient``: jspec builds the tree; where jspec's ``is_valid`` flag is False
  (a parent not selected earlier in node order: descending or cyclic selections, out-of-range
  indices) or a path is deeper than ``spec_steps``, the request set is rebuilt by
  :mod:`interop.tree.reference_build_tree`, sglang's kernel rules, so the drop-in matches sglang
  on every input sglang accepts. Wider ``top_scores_index`` / ``parent_list`` are read as sglang
  reads them (row prefix / flat offsets). With probes on, the invalid-tree probe follows
  sglang's definition (a parent token selected nowhere: the node sglang drops with "WARNING:
  invalid eagle tree"), not jspec's stricter one: a descending selection sglang builds
  normally passes.

jspec modules are looked up at call time (``jspec.tree.verify.verify_tree_greedy`` etc.), so a
test can monkeypatch an op and see the drop-in use the patched version.
"""

from __future__ import annotations

from typing import Any

import torch

from interop._adapt import jspec_module as _mod
from interop._adapt import run_jspec, tree_geometry
from interop._adapt import to_jax_default as _j
from interop._adapt import to_torch_as as _t
from interop.dlpack import to_torch
from interop.tree import reference_build_tree as _ref_build
from interop.tree.reference import write_accepted
from jspec.config import MAX_NUM_DRAFT_TOKENS, MAX_NUM_STEPS, next_power_of_2

__all__ = [
    "build_tree_kernel_efficient",
    "organize_draft_results",
    "select_top_k_tokens",
    "tree_speculative_sampling_target_only",
    "verify_tree_greedy",
]


# ---- tree ------------------------------------------------------------------------------------------
def select_top_k_tokens(
    i: int,
    topk_p: torch.Tensor,
    topk_index: torch.Tensor,
    hidden_states: torch.Tensor,
    scores: torch.Tensor | None,
    topk: int,
):
    """``(input_ids i64, hidden, scores, (score_entry, tokens i64, parents i64))``."""
    out = run_jspec(
        _mod("jspec.tree.select").select_top_k_tokens,
        i,
        _j(topk_p, "topk_p"),
        _j(topk_index, "topk_index"),
        _j(hidden_states, "hidden"),
        None if scores is None else _j(scores, "scores"),
        topk=topk,
    )
    ids, hidden, new_scores, (entry, tokens, parents) = out
    f = topk_p.dtype
    return (
        _t(ids, topk_p),
        _t(hidden, hidden_states, hidden_states.dtype),
        _t(new_scores, topk_p, f),
        (_t(entry, topk_p, f), _t(tokens, topk_p), _t(parents, topk_p)),
    )


def organize_draft_results(
    score_list: list[torch.Tensor],
    token_list: list[torch.Tensor],
    parents_list: list[torch.Tensor],
    num_draft_token: int,
):
    """``(parent_list i64, top_scores_index i64, draft_tokens i64)``."""
    parent_list, sel, draft = run_jspec(
        _mod("jspec.tree.select").organize_draft_results,
        [_j(s, "score") for s in score_list],
        [_j(t, "tokens") for t in token_list],
        [_j(p, "parents") for p in parents_list],
        num_draft_tokens=num_draft_token,
    )
    like = score_list[0]
    return _t(parent_list, like), _t(sel, like), _t(draft, like, token_list[0].dtype)


def _jspec_tree_cells(build, out, mode, seq_lens: torch.Tensor, n: int) -> torch.Tensor:
    """bool[B, N, N] tree cells of jspec's mask in any mode."""
    mask = to_torch(out.tree_mask).cpu()
    if mode == build.TreeMaskMode.QLEN_ONLY:
        return mask
    if mode == build.TreeMaskMode.QLEN_ONLY_BITPACKING:
        words = mask.to(torch.int64)
        return ((words[..., None] >> torch.arange(n)) & 1).bool()
    cols = seq_lens.cpu().to(torch.int64)[:, None] + torch.arange(n)  # FULL_MASK [B, N, W]
    return torch.gather(mask, 2, cols[:, None, :].expand(-1, n, -1))


def _jspec_build(
    args: tuple, *, topk: int, spec_steps: int, n: int, mode: Any, impl: str, interpret: bool | None
):
    """jspec's tree, or None where sglang's kernel rules must take over (see module docstring)."""
    bonus, parent_list, sel, draft_tokens, seq_lens = args
    build = _mod("jspec.tree.build")
    bs = seq_lens.numel()
    width = topk * (spec_steps - 1) + 1 if spec_steps > 1 else parent_list.shape[1]
    ss_width = topk + (spec_steps - 1) * topk * topk
    if (
        bs == 0
        or parent_list.shape[1] < width
        or n - 1 > ss_width
        or n > MAX_NUM_DRAFT_TOKENS
        or spec_steps > MAX_NUM_STEPS
    ):
        return None
    if draft_tokens.shape != sel.shape:  # sglang concatenates any width; jspec's is (B, N-1)
        draft_tokens = torch.zeros_like(sel)
    max_len = None
    if mode == build.TreeMaskMode.FULL_MASK:
        max_len = next_power_of_2(int(seq_lens.max()))
    out = run_jspec(
        build.build_tree_kernel_efficient,
        _j(bonus, "bonus_tokens"),
        _j(parent_list[:, :width].contiguous(), "parent_list"),
        _j(sel.contiguous(), "top_scores_index"),
        _j(draft_tokens.contiguous(), "draft_tokens"),
        _j(seq_lens, "seq_lens"),
        # page_size is not read by build_tree_kernel_efficient.
        geometry=tree_geometry(topk=topk, num_steps=spec_steps, num_draft_tokens=n, page_size=1),
        mode=mode,
        max_seq_len=max_len,
        impl=impl,
        interpret=interpret,
        probe_valid_tree=False,  # sglang's rule instead: _probe_sglang_tree
    )
    steps = to_torch(out.positions).cpu().to(torch.int64).reshape(bs, n) - seq_lens.cpu()[:, None]
    if not bool(to_torch(out.is_valid).all()) or int(steps.max()) > spec_steps:
        return None
    return out, _jspec_tree_cells(build, out, mode, seq_lens, n), steps


def _probe_sglang_tree(parent_list: torch.Tensor, sel: torch.Tensor, topk: int, n: int) -> None:
    """With jspec's probes on: AssertionError naming the first node sglang leaves unlinked."""
    if not _mod("jspec.probes").probes_on():
        return
    bad = _ref_build.unlinked_nodes(parent_list.cpu(), sel.cpu(), topk, n)
    if bad:
        b, node = bad[0]
        raise AssertionError(
            f"build_tree_kernel_efficient: invalid eagle tree: request {b} node {node} has no "
            "selected parent (sglang: 'Detected a token with no parent token selected')"
        )


def _check_tree_mask_buf(
    buf: torch.Tensor | None, mode: Any, seq_lens: torch.Tensor, n: int
) -> None:
    """A given ``tree_mask_buf`` holds every cell the kernel writes (ValueError before any work:
    it is filled first, so one found short while writing would be left half-written)."""
    if buf is None:
        return
    bs, total = seq_lens.numel(), int(seq_lens.sum())
    need = _ref_build.tree_mask_numel(mode, bs, n, total)
    if buf.numel() < need:
        raise ValueError(
            f"tree_mask_buf.numel()={buf.numel()} must be >= {need} for {mode.name} "
            f"(B={bs}, num_verify_tokens={n}, sum(seq_lens)={total})"
        )


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
    tree_mask_mode: int = _ref_build.TreeMaskMode.FULL_MASK,
    tree_mask_buf: torch.Tensor | None = None,
    fill_prefix_mask: bool = True,
    *,
    impl: str = "xla",
    interpret: bool | None = None,
):
    """sglang's 6-tuple ``(tree_mask, positions i64[B*N], retrive_index, retrive_next_token,
    retrive_next_sibling i64[B, N], draft_tokens)`` with sglang's mask layouts and buffer fills
    (FULL_MASK: the ragged flat ``ΣL·N + B·N²`` layout)."""
    n = num_verify_tokens
    mode = _ref_build.TreeMaskMode(int(tree_mask_mode))
    if topk < 1:
        raise ValueError(f"topk={topk} must be >= 1")
    _check_tree_mask_buf(tree_mask_buf, mode, seq_lens, n)
    if top_scores_index.dim() != 2 or top_scores_index.shape[1] < n - 1:
        raise ValueError(
            f"top_scores_index.shape={tuple(top_scores_index.shape)}: needs (B, >= "
            f"num_verify_tokens-1={n - 1})"
        )
    sel = top_scores_index[:, : n - 1]  # the prefix sglang's kernel reads
    _probe_sglang_tree(parent_list, sel, topk, n)
    built = _jspec_build(
        (bonus_tokens, parent_list, sel, draft_tokens, seq_lens),
        topk=topk,
        spec_steps=spec_steps,
        n=n,
        mode=_mod("jspec.tree.build").TreeMaskMode(int(mode)),
        impl=impl,
        interpret=interpret,
    )
    flat_tokens = torch.cat((bonus_tokens.unsqueeze(1), draft_tokens), dim=1).flatten()
    if built is None:  # sglang's kernel rules (malformed trees, shapes jspec does not take)
        ref = _ref_build.build_tree_kernel_efficient(
            bonus_tokens,
            parent_list,
            sel,
            draft_tokens,
            seq_lens,
            seq_lens_sum,
            topk,
            spec_steps,
            n,
            mode,
            tree_mask_buf,
            fill_prefix_mask,
        )
        return ref[:5] + (flat_tokens,)
    out, cells, _ = built
    lens = [int(x) for x in seq_lens]
    mask = _ref_build.assemble_tree_mask(
        cells, mode, lens, int(seq_lens_sum), tree_mask_buf, fill_prefix_mask, seq_lens.device
    )
    if draft_tokens.shape == sel.shape:
        flat_tokens = _t(out.draft_tokens, seq_lens, flat_tokens.dtype)
    return (
        mask,
        _t(out.positions, seq_lens),
        _t(out.retrive_index, seq_lens),
        _t(out.retrive_next_token, seq_lens),
        _t(out.retrive_next_sibling, seq_lens),
        flat_tokens,
    )


def _links(candidates, retrive_index, retrive_next_token, retrive_next_sibling) -> tuple:
    """The four [B, N] tree tensors both verify kernels take, as JAX arrays."""
    return (
        _j(candidates, "candidates"),
        _j(retrive_index, "retrive_index"),
        _j(retrive_next_token, "retrive_next_token"),
        _j(retrive_next_sibling, "retrive_next_sibling"),
    )


def _check_accept_outputs(predicts, accept_index, accept_token_num, candidates) -> None:
    """The three output tensors' ranks and batch sizes, before any work (ValueError naming the
    tensor): a mismatch found only at write-back would leave them half-written."""
    bs = candidates.shape[0] if candidates.dim() else 0
    if predicts.dim() != 1:
        raise ValueError(f"predicts.shape={tuple(predicts.shape)} must be 1-D (B*N,)")
    if accept_index.dim() != 2 or accept_index.shape[0] != bs:
        raise ValueError(
            f"accept_index.shape={tuple(accept_index.shape)} must be (B={bs}, num_spec_steps+1)"
        )
    if tuple(accept_token_num.shape) != (bs,):
        raise ValueError(f"accept_token_num.shape={tuple(accept_token_num.shape)} must be ({bs},)")


def _write_accept(predicts, accept_index, accept_token_num, out) -> None:
    """Write-back after checking every accepted node id indexes ``predicts``: an id from a bad
    ``retrive_index`` raises before any write (torch would wrap a negative id onto another node,
    and an id past the end would fail with ``accept_index`` already written)."""
    out = tuple(to_torch(x) for x in out)
    ids = out[1][out[1] != -1]
    bad = (ids < 0) | (ids >= predicts.numel())
    if bool(bad.any()):
        raise ValueError(
            f"retrive_index: accepted node id {int(ids[bad][0])} is outside predicts "
            f"[0, {predicts.numel()}) (predicts.shape={tuple(predicts.shape)})"
        )
    write_accepted(predicts, accept_index, accept_token_num, out)


def verify_tree_greedy(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
    *,
    impl: str = "xla",
    interpret: bool | None = None,
) -> None:
    """In place into ``predicts``, ``accept_index`` and ``accept_token_num`` (as sgl_kernel)."""
    _check_accept_outputs(predicts, accept_index, accept_token_num, candidates)
    out = run_jspec(
        _mod("jspec.tree.verify").verify_tree_greedy,
        *_links(candidates, retrive_index, retrive_next_token, retrive_next_sibling),
        _j(target_predict, "target_predict"),
        num_spec_steps=accept_index.shape[1],
        impl=impl,
        interpret=interpret,
    )
    _write_accept(predicts, accept_index, accept_token_num, out)


def tree_speculative_sampling_target_only(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """In place like :func:`verify_tree_greedy` (``draft_probs`` is not written)."""
    _check_accept_outputs(predicts, accept_index, accept_token_num, candidates)
    out = run_jspec(
        _mod("jspec.tree.sampling").tree_speculative_sampling_target_only,
        *_links(candidates, retrive_index, retrive_next_token, retrive_next_sibling),
        _j(uniform_samples, "coins"),
        _j(uniform_samples_for_final_sampling, "final coins"),
        _j(target_probs, "target_probs"),
        num_spec_steps=accept_index.shape[1],
        threshold_single=threshold_single,
        threshold_acc=threshold_acc,
        deterministic=deterministic,
    )
    _write_accept(predicts, accept_index, accept_token_num, out)
