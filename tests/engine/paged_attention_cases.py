"""Shared by the paged attention tests: random passes, an f64 loop oracle, the interpreter launcher.

* :func:`make_case`: a random pass by the contract of ``jspec.kernels.paged_attention``:
  randomly permuted page tables (optionally pages shared between rows, as draft pass B's
  branches share their prefix's last page), lengths straddling pages, ragged causal queries,
  tails with tree / causal / random masks. Every pool position the pass does not read (every
  other layer, pages past ``kv_lens``, tail slots no query sees, causal rows' unseen keys) is
  NaN, and unread page-table entries point at a NaN page: a kernel that reads one position too
  many produces NaN.
* :func:`oracle`: per row, query and head, the visible keys collected by the contract with
  python loops (independent of ``paged_attention.visibility``), softmax in f64.
* :func:`launch_interpreted`: the raw Triton kernel on torch CPU tensors in Triton's
  interpreter (the test hook of ``paged_attention_triton``; outputs NaN-poisoned first).
* :func:`mutated_kernel`: the kernel with one source line changed (mutation checks).

Nothing here imports triton or the Triton module at import time: test_paged_attention.py
imports it in processes where Triton must stay un-imported (tests/triton_interpret.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import pathlib
import tempfile
from typing import Any

import jax.numpy as jnp
import numpy as np

POISON = np.nan

# Named passes (make_case keywords): decode / draft A (full pages) / draft B (a 3-page expand
# table, pages shared between branches, lengths <= P - 1 + 3) / FlashInfer-style token table
# (P = 1) / P = 64 / verify (tree tail) / extend (causal tail) / a random tail with D = 24 /
# causal prefill (ragged q_lens, padding queries, prefill-shaped rows) / causal offsets chosen
# so a full-block boundary falls one key off a query block's limit / causal + tail / D = 80 /
# a tail and no prefix column at all. MQA, GQA and MHA among them; kv_lens 0 rows in most.
CASES: dict[str, dict[str, Any]] = {
    "decode-gqa4-p16": dict(batch=6, qp=1, hq=8, hkv=2, dim=64, page_size=16, num_pages=5),
    "draftA-k4-mqa": dict(
        batch=3, qp=4, hq=4, hkv=1, dim=32, page_size=16, num_pages=4, kv_lens=[48, 64, 0]
    ),
    "draftB-expand-shared": dict(
        batch=8,
        qp=1,
        hq=4,
        hkv=2,
        dim=32,
        page_size=16,
        num_pages=3,
        kv_lens=[1, 15, 16, 17, 18, 5, 0, 18],
        share_pages=True,
    ),
    "tokens-p1": dict(batch=3, qp=2, hq=4, hkv=2, dim=32, page_size=1, num_pages=40),
    "mha-p64": dict(batch=2, qp=3, hq=2, hkv=2, dim=16, page_size=64, num_pages=3),
    "verify-tree-n8": dict(
        batch=3, qp=8, hq=8, hkv=2, dim=64, page_size=16, num_pages=3, tail_len=8, tail_kind="tree"
    ),
    "extend-causal-tail-n16": dict(
        batch=2,
        qp=16,
        hq=4,
        hkv=2,
        dim=32,
        page_size=16,
        num_pages=2,
        tail_len=16,
        tail_kind="causal",
    ),
    "tail-random-d24": dict(
        batch=3, qp=3, hq=4, hkv=2, dim=24, page_size=4, num_pages=6, tail_len=5
    ),
    # a tail past TAIL_TILE_MAX keys: read by a loop of its own after the prefix
    "tail-random-n24": dict(
        batch=2, qp=3, hq=4, hkv=2, dim=16, page_size=8, num_pages=3, tail_len=24
    ),
    "prefill-ragged-mqa": dict(
        batch=3, qp=40, hq=4, hkv=1, dim=32, page_size=16, num_pages=6, causal=True
    ),
    "causal-offsets-gqa2": dict(
        batch=6,
        qp=24,
        hq=4,
        hkv=2,
        dim=16,
        page_size=4,
        num_pages=14,
        causal=True,
        q_lens=[24, 24, 24, 24, 20, 0],
        kv_lens=[24, 30, 31, 38, 54, 9],
    ),
    "causal-small-p1": dict(
        batch=3, qp=5, hq=4, hkv=2, dim=32, page_size=1, num_pages=12, causal=True
    ),
    "causal-tail-ragged": dict(
        batch=3,
        qp=6,
        hq=2,
        hkv=1,
        dim=16,
        page_size=8,
        num_pages=4,
        causal=True,
        q_lens=[6, 3, 2],
        kv_lens=[32, 30, 20],
        tail_len=4,
    ),
    "d80-p16": dict(batch=2, qp=2, hq=4, hkv=2, dim=80, page_size=16, num_pages=3),
    "tail-only": dict(batch=2, qp=3, hq=4, hkv=2, dim=16, page_size=16, num_pages=0, tail_len=4),
}


@dataclasses.dataclass
class Case:
    """One pass as numpy arrays (values already rounded to ``dtype``, held as f32)."""

    q: np.ndarray  # f32[B, Qp, Hq, D]
    k_pool: np.ndarray  # f32[L, S, Hkv, D]
    v_pool: np.ndarray  # f32[L, S, Hkv, D]
    layer: int
    page_table: np.ndarray  # i32[B, C]
    kv_lens: np.ndarray  # i32[B]
    q_lens: np.ndarray | None  # i32[B]
    tail_slot_ids: np.ndarray | None  # i32[B, N]
    tail_mask: np.ndarray | None  # bool[B, Qp, N]
    page_size: int
    causal: bool
    dtype: str  # "float32" | "bfloat16"

    def jax_args(self) -> tuple:
        """``paged_attention``'s positional args as jax arrays (q and pools in ``dtype``)."""
        dt = jnp.dtype(self.dtype)
        opt = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
        return (
            jnp.asarray(self.q, dt),
            jnp.asarray(self.k_pool, dt),
            jnp.asarray(self.v_pool, dt),
            self.layer,
            jnp.asarray(self.page_table),
            jnp.asarray(self.kv_lens),
            opt(self.q_lens),
            opt(self.tail_slot_ids),
            opt(self.tail_mask),
        )

    @property
    def static(self) -> dict[str, Any]:
        return {"page_size": self.page_size, "causal": self.causal}


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return x.astype(np.float32)
    return np.asarray(jnp.asarray(x, jnp.dtype(dtype)).astype(jnp.float32))


def straddling_lens(rng, batch: int, page_size: int, width: int, low: int = 0) -> np.ndarray:
    """Lengths in ``[low, width]``: 0, 1, P-1, P, P+1, full first (those in range), then random."""
    picks = [0, 1, page_size - 1, page_size, page_size + 1, width]
    picks = [x for x in dict.fromkeys(picks) if low <= x <= width]
    rng.shuffle(picks)
    extra = rng.integers(low, width + 1, max(0, batch - len(picks)))
    return np.concatenate([picks, extra])[:batch].astype(np.int32)


def prefix_limit(case: Case, b: int, i: int) -> int:
    """Query (b, i) sees prefix row positions ``[0, limit)`` by the contract."""
    kv_len = int(case.kv_lens[b])
    if not case.causal:
        return kv_len
    q_len = case.q.shape[1] if case.q_lens is None else int(case.q_lens[b])
    return 0 if i >= q_len else max(0, min(kv_len, kv_len - q_len + i + 1))


def visible_slots(case: Case, b: int, i: int) -> np.ndarray:
    """Token slots query (b, i) sees: its prefix positions through the page table, then the tail."""
    p = case.page_size
    pos = np.arange(prefix_limit(case, b, i))
    slots = case.page_table[b, pos // p].astype(np.int64) * p + pos % p
    if case.tail_slot_ids is not None:
        slots = np.concatenate([slots, case.tail_slot_ids[b][case.tail_mask[b, i]]])
    return slots.astype(np.int64)


def make_case(
    rng,
    *,
    batch: int,
    qp: int,
    hq: int,
    hkv: int,
    dim: int,
    page_size: int,
    num_pages: int,
    kv_lens: Any = None,
    causal: bool = False,
    q_lens: Any = None,
    tail_len: int = 0,
    tail_kind: str = "random",
    share_pages: bool = False,
    dtype: str = "float32",
    num_layers: int = 3,
    layer: int = 1,
) -> Case:
    """A random pass (module docstring). ``kv_lens`` / ``q_lens``: arrays, or None for random
    (``q_lens`` is random only when ``causal``; ``kv_lens >= q_lens`` then)."""
    p, width = page_size, num_pages * page_size
    if causal:
        if q_lens is None:
            q_lens = rng.integers(0, qp + 1, batch)
            q_lens[0] = qp
        q_lens = np.asarray(q_lens, np.int32)
        if kv_lens is None:
            kv_lens = np.array(
                [rng.integers(ql, width + 1) if ql < width else width for ql in q_lens]
            )
            kv_lens[0] = max(width, int(q_lens[0]))  # keep a full row
    elif kv_lens is None:
        kv_lens = straddling_lens(rng, batch, p, width)
    kv_lens = np.asarray(kv_lens, np.int32)
    # Pool pages: 0 and the last ones stay NaN (poison); rows draw distinct pages from the rest.
    num_pool_pages = batch * num_pages + 4 + (tail_len * batch) // p + 2
    real = rng.permutation(np.arange(1, num_pool_pages - 1))
    poison_page = num_pool_pages - 1
    page_table = np.full((batch, max(num_pages, 0)), poison_page, np.int32)
    used = 0
    for b in range(batch):
        listed = -(-int(kv_lens[b]) // p)
        for c in range(listed):
            if share_pages and b > 0 and rng.random() < 0.4:
                page_table[b, c] = page_table[rng.integers(0, b), c]  # another row's page
            else:
                page_table[b, c] = real[used]
                used += 1
    num_slots = num_pool_pages * p
    tail_slot_ids = tail_mask = None
    if tail_len:
        free = np.concatenate([np.arange(x * p, (x + 1) * p) for x in real[used:]])
        tail_slot_ids = rng.permutation(free)[: batch * tail_len].reshape(batch, tail_len)
        tail_slot_ids = tail_slot_ids.astype(np.int32)
        if tail_kind == "tree":  # ancestors (random lower-triangular) + self; Qp == N
            tail_mask = np.tril(rng.random((batch, qp, tail_len)) < 0.4, k=-1)
            tail_mask |= np.eye(qp, tail_len, dtype=bool)[None]
        elif tail_kind == "causal":
            tail_mask = np.broadcast_to(
                np.tril(np.ones((qp, tail_len), bool)), (batch, qp, tail_len)
            )
        else:
            tail_mask = rng.random((batch, qp, tail_len)) < 0.4
        tail_mask = np.ascontiguousarray(tail_mask)
        unseen = ~tail_mask.any(axis=1)  # tail keys no query sees: a NaN slot
        tail_slot_ids[unseen] = poison_page * p + rng.integers(0, p, int(unseen.sum()))
    q = rng.standard_normal((batch, qp, hq, dim))
    k_pool = np.full((num_layers, num_slots, hkv, dim), POISON, np.float32)
    v_pool = np.full_like(k_pool, POISON)
    case = Case(
        q=_round(q, dtype),
        k_pool=k_pool,
        v_pool=v_pool,
        layer=layer,
        page_table=page_table,
        kv_lens=kv_lens,
        q_lens=q_lens if causal else None,
        tail_slot_ids=tail_slot_ids,
        tail_mask=tail_mask,
        page_size=p,
        causal=causal,
        dtype=dtype,
    )
    seen = [visible_slots(case, b, i) for b in range(batch) for i in range(qp)]
    read = np.unique(np.concatenate(seen)) if seen else np.zeros((0,), np.int64)
    if read.size:
        k_pool[layer, read] = _round(1.5 * rng.standard_normal((len(read), hkv, dim)), dtype)
        v_pool[layer, read] = _round(rng.standard_normal((len(read), hkv, dim)), dtype)
    return case


def oracle(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """``(out f64[B, Qp, Hq, D], lse f64[B, Qp, Hq])``, one query at a time over the slots it
    sees (nothing visible: 0, -inf)."""
    batch, qp, hq, dim = case.q.shape
    hkv = case.k_pool.shape[2]
    k_layer = case.k_pool[case.layer].astype(np.float64)
    v_layer = case.v_pool[case.layer].astype(np.float64)
    out = np.zeros((batch, qp, hq, dim))
    lse = np.full((batch, qp, hq), -np.inf)
    for b in range(batch):
        for i in range(qp):
            slots = visible_slots(case, b, i)
            if slots.size == 0:
                continue
            qg = case.q[b, i].astype(np.float64).reshape(hkv, hq // hkv, dim)
            s = np.einsum("hgd,nhd->hgn", qg, k_layer[slots]) / np.sqrt(dim)
            top = s.max(axis=-1, keepdims=True)
            e = np.exp(s - top)
            total = e.sum(axis=-1, keepdims=True)
            out[b, i] = (np.einsum("hgn,nhd->hgd", e, v_layer[slots]) / total).reshape(hq, dim)
            lse[b, i] = (top + np.log(total)).reshape(hq)
    return out, lse


def plant_nan(case: Case, where: str) -> tuple[int, int, np.ndarray]:
    """NaN into K or V (``where``) at the last slot the first query with a key sees, KV head 0.

    Returns ``(b, i, others)``: that query and the indices of the other batch rows.
    """
    batch, qp = case.q.shape[:2]
    b, i = next((b, i) for b in range(batch) for i in range(qp) if visible_slots(case, b, i).size)
    pool = case.k_pool if where == "k" else case.v_pool
    pool[case.layer, visible_slots(case, b, i)[-1], 0, 3] = np.nan
    return b, i, np.array([x for x in range(batch) if x != b])


def check(got_out, got_lse, want_out, want_lse, *, atol: float, lse_atol: float) -> None:
    """Nothing-visible queries exactly (0, -inf); the rest within tolerance; no NaN anywhere."""
    got_out, got_lse = np.asarray(got_out), np.asarray(got_lse)
    assert got_out.shape == want_out.shape and got_lse.shape == want_lse.shape
    assert not np.isnan(got_out).any() and not np.isnan(got_lse).any(), "NaN in the outputs"
    empty = np.isneginf(want_lse)
    np.testing.assert_array_equal(np.isneginf(got_lse), empty)
    assert (got_out[empty] == 0).all()
    np.testing.assert_allclose(got_out, want_out, atol=atol, rtol=0)
    np.testing.assert_allclose(got_lse[~empty], want_lse[~empty], atol=lse_atol, rtol=1e-5)


def _torch_dtype(name: str) -> Any:
    """The torch dtype of a case's dtype name ("float32" / "bfloat16")."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def launch_interpreted(
    case: Case, *, kernel: Any = None, out_dtype: str = "float32", **tuning: Any
):
    """The raw Triton kernel on torch CPU tensors (Triton's interpreter must be on).

    ``out_dtype``: as ``paged_attention_triton``'s: the kernel writes it when the plan has one
    split, the merge kernel otherwise (f32 partials between them).

    Returns ``(out, lse, part_lse)``: the merged numpy outputs (``out`` as f32 numbers of
    ``out_dtype``) and the raw per-split lse ``f32[B, NS, Qp, Hq]`` (outputs are NaN-poisoned
    before the launch).
    """
    import torch

    from jspec.kernels import paged_attention_triton as pat
    from triton_interpret import patch_interpreter_range

    patch_interpreter_range()
    tdtype = _torch_dtype(case.dtype)
    batch, qp, hq, dim = case.q.shape
    _, num_slots, hkv, _ = case.k_pool.shape
    tail_len = 0 if case.tail_slot_ids is None else case.tail_slot_ids.shape[1]
    tuning = dict(tuning)
    hint = tuning.pop("max_kv_len", None)  # as paged_attention_triton plans it
    grid, meta, opts = pat.launch_plan(
        batch,
        qp,
        hq,
        hkv,
        dim,
        pat.plan_pages(case.page_table.shape[1], case.page_size, hint),
        case.page_size,
        tail_len,
        jnp.dtype(case.dtype),
        causal=case.causal,
        **tuning,
    )
    ns = grid[1]
    i32 = lambda x: torch.from_numpy(np.ascontiguousarray(x, np.int32))  # noqa: E731
    kv_lens = i32(case.kv_lens)
    q_lens = i32(np.full(batch, qp) if case.q_lens is None else case.q_lens)
    out_tdtype = _torch_dtype(out_dtype) if ns == 1 else torch.float32
    out = torch.full((batch, ns, qp, hq, dim), float("nan"), dtype=out_tdtype)
    lse = torch.full((batch, ns, qp, hq), float("nan"))
    (kernel or pat.get_kernel())[grid](
        torch.from_numpy(np.array(case.q)).to(tdtype),
        torch.from_numpy(np.array(case.k_pool)).to(tdtype),
        torch.from_numpy(np.array(case.v_pool)).to(tdtype),
        torch.tensor([case.layer], dtype=torch.int32),
        i32(case.page_table if case.page_table.shape[1] else np.zeros((batch, 1))),
        kv_lens,
        q_lens,
        i32(case.tail_slot_ids) if tail_len else kv_lens,
        torch.from_numpy(np.ascontiguousarray(case.tail_mask, np.int8)) if tail_len else kv_lens,
        max(1, case.page_table.shape[1]),
        num_slots,
        out,
        lse,
        **meta,
        **opts,
    )
    if ns == 1:
        assert out.dtype == out_tdtype
        return out[:, 0].float().numpy(), lse[:, 0].numpy(), lse.numpy()
    merged = merge_interpreted(out.numpy(), lse.numpy(), out_dtype)
    return merged[0], merged[1], lse.numpy()


def merge_interpreted(
    out: np.ndarray, lse: np.ndarray, out_dtype: str = "float32"
) -> tuple[np.ndarray, np.ndarray]:
    """``merge_splits_triton``'s kernel on torch CPU tensors (Triton's interpreter must be on):
    ``f32[B, NS, Qp, Hq, D], f32[B, NS, Qp, Hq]`` -> merged numpy ``(out, lse)`` (``out`` in
    ``out_dtype``, returned as f32 numbers); one split: taken as it is (the wrapper launches
    nothing)."""
    import torch

    from jspec.kernels import paged_attention_triton as pat

    bsz, ns, qp, hq, dim = out.shape
    if ns == 1:
        return out[:, 0], lse[:, 0]
    grid, meta = pat.merge_plan(bsz, ns, qp * hq, dim)
    merged = torch.full((bsz, qp, hq, dim), float("nan"), dtype=_torch_dtype(out_dtype))
    merged_lse = torch.full((bsz, qp, hq), float("nan"))
    pat.get_merge_kernel()[grid](
        torch.from_numpy(np.ascontiguousarray(out, np.float32)),
        torch.from_numpy(np.ascontiguousarray(lse, np.float32)),
        merged,
        merged_lse,
        num_warps=4,
        num_stages=1,
        **meta,
    )
    return merged.float().numpy(), merged_lse.numpy()


def mutated_kernel(old: str, new: str) -> Any:
    """``triton.jit`` of the kernel's source with the one line containing ``old`` replaced by
    ``new`` (written to a temporary module: Triton reads a kernel's source from its file)."""
    import triton

    from jspec.kernels import paged_attention_triton as pat

    src = inspect.getsource(pat._paged_attention_kernel)
    assert src.count(old) == 1, f"{old!r} must occur once in the kernel"
    path = pathlib.Path(tempfile.mkdtemp()) / "mutated_paged_attention.py"
    path.write_text("import triton.language as tl\n\n\n" + src.replace(old, new))
    spec = importlib.util.spec_from_file_location("mutated_paged_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return triton.jit(module._paged_attention_kernel)
