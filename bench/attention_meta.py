# Over 400 lines: one bench over both metadata families (FA3 page tables, FlashInfer kv_indices)
# with their shared input builders and the sglang-anchor columns.
"""Bench: draft-decode attention metadata (FA3 expand page table, FlashInfer kv_indices).

    python -m bench.attention_meta [--quick] [--bs 1,8,64,256] [--pages 1,16,64]
                                   [--ops expand,kv_indices] [--torch-compile]

Shapes (shared/ANCHORS.md): bs {1, 8, 64, 256}, K=8, S=5, context 8k, seq lens ~U[1k, 2k],
page {1, 16, 64} (expand: {16, 64}, it only runs for page_size > 1). Page 16 runs every
impl and mode; pages 1 and 64 run the in-place kv_indices rows only (``--full`` for all), to
stay near a minute on the H200. Rows per impl:

* ``xla`` / ``pallas`` / ``triton`` (jax_triton, GPU only): ``device us`` = R calls inside one
  jitted ``lax.scan`` over R distinct input sets, divided by R; ``wall us`` = one standalone
  jitted call (dispatch included).
* kv_indices ``mode``: ``fresh`` returns a new ``(S, W)`` array with zeros past the used length
  (W = bs*K*context: the zero fill is most of the bytes); ``inplace`` updates a carried (donated)
  buffer, like sglang's persistent cuda-graph buffer (no zero fill).
* ``torch``: a torch-ops port of sglang's code (the expand: sglang's own torch function; the
  kv_indices: a vectorized gather with sglang's host ``seq_lens_sum``), CUDA events.
* ``torch+triton``: jspec's raw Triton kernel launched on torch CUDA tensors (in place).

``GB/s`` (kv_indices) counts 4 bytes read + 4 written per used entry, summed over the S step rows
(ANCHORS.md's "effective" bandwidth of sglang's kernel: ~3.7 TB/s at bs=256).
Every impl is guarded: a failure prints in its row and the bench continues; a time budget skips
the remaining rows instead of overrunning.
"""

from __future__ import annotations

import argparse
import functools
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench._timing import format_table, profile_kernel_us, time_device, time_torch, time_wall
from jspec.attention_meta.kv_indices import (
    draft_kv_indices_used_len,
    generate_draft_decode_kv_indices,
)
from jspec.attention_meta.page_table import draft_decode_set_expand_metadata
from jspec.config import TreeGeometry
from jspec.kernels import _common

COLUMNS = ("op", "bs", "page", "impl", "mode", "device us", "wall us", "GB/s", "note")
TOPK, STEPS = 8, 5


def _geometry(page: int) -> TreeGeometry:
    return TreeGeometry(topk=TOPK, num_steps=STEPS, num_draft_tokens=1, page_size=page)


# ---- torch ports of sglang -----------------------------------------------------------------------
def _torch_expand(
    cache_seqlens, page_table, last_page_lens, decode_length, cache_loc, topk, page_size
):
    """sglang ``draft_decode_set_expand_metadata`` (torch ops, SPEC.md §5.1), caller-sliced."""
    import torch

    cache_seqlens[: cache_loc.shape[0]] = decode_length + torch.repeat_interleave(
        last_page_lens, topk
    )
    pages = (cache_loc // page_size).to(torch.int32)
    is_new = torch.ones_like(pages, dtype=torch.bool)
    is_new[:, 1:] = pages[:, 1:] != pages[:, :-1]
    col = is_new.cumsum(dim=1) - 1
    page_table[: pages.shape[0], :].scatter_(1, col, pages)


def _torch_kv_indices(
    kv_indices,
    kv_indptr,
    req_pool_indices,
    req_to_token,
    seq_lens,
    seq_lens_sum: int,
    topk: int,
    num_steps: int,
    page_size: int,
):
    """SPEC.md §6.1 with torch ops: a gather per used entry, one step row at a time."""
    import torch

    lens = seq_lens.long()
    num_seqs = lens.numel()
    z = torch.arange(num_seqs * topk, device=lens.device)
    seq, branch = z // topk, z % topk
    cum = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0))
    own = lens[seq]
    if page_size == 1 or topk == 1:
        ext = own + branch * num_steps
    else:
        lp = own % page_size
        nnp = (lp + num_steps + page_size - 1) // page_size
        ext = own - lp + branch * nnp * page_size + lp
    rows = req_to_token[req_pool_indices.long()]
    for i in range(num_steps):
        it = i + 1
        starts = topk * cum[seq] + branch * own + z * it
        used = seq_lens_sum * topk + num_seqs * topk * it
        kv_indptr[i, : num_seqs * topk] = starts.int()
        kv_indptr[i, num_seqs * topk] = used
        pos = torch.arange(used, device=lens.device)
        seg = torch.searchsorted(starts, pos, right=True) - 1
        local = pos - starts[seg]
        src = torch.where(local < own[seg], local, ext[seg] + local - own[seg])
        kv_indices[i, :used] = rows[seq[seg], src]


# ---- inputs --------------------------------------------------------------------------------------
def _kv_inputs(rng, bs: int, *, context: int, num_sets: int, lo: int, hi: int):
    row_width = context + 512
    req_to_token = rng.integers(1, 1 << 24, size=(bs + 1, row_width)).astype(np.int32)
    sets = []
    for _ in range(num_sets):
        rpi = (rng.permutation(bs) + 1).astype(np.int32)
        seq_lens = rng.integers(lo, hi, size=bs).astype(np.int32)
        sets.append((rpi, seq_lens))
    return req_to_token, sets


def _expand_inputs(rng, bs: int, page: int, num_sets: int):
    sets = []
    for _ in range(num_sets):
        lp = rng.integers(0, page, size=bs).astype(np.int32)
        start = rng.integers(1, 1 << 18, size=bs * TOPK) * page + np.repeat(lp, TOPK)
        cache_loc = (start[:, None] + np.arange(STEPS)[None, :]).astype(np.int32)
        sets.append((lp, cache_loc))
    return sets


# ---- timing helpers ------------------------------------------------------------------------------
def _scan_carry_us(body: Callable, init: Any, xs: Any, shared: tuple, repeats: int = 3) -> float:
    """us per iteration of ``carry = body(carry, x, *shared)`` in one jitted, donated scan."""
    num = jax.tree.leaves(xs)[0].shape[0]

    @functools.partial(jax.jit, donate_argnums=0)
    def run(carry, xs, shared):
        return jax.lax.scan(lambda c, x: (body(c, x, *shared), None), carry, xs, unroll=True)[0]

    if jax.default_backend() == "gpu":  # summed kernel time of one unrolled run (bench._timing)
        jax.block_until_ready(run(init(), xs, shared))
        carry = jax.block_until_ready(init())
        us = profile_kernel_us(lambda: run(carry, xs, shared), num)
        if us is not None:
            return us
    best = float("inf")
    for attempt in range(repeats + 1):
        carry = jax.block_until_ready(init())
        t0 = time.perf_counter()
        jax.block_until_ready(run(carry, xs, shared))
        if attempt:  # the first run compiles
            best = min(best, time.perf_counter() - t0)
    return best / num * 1e6


def _wall_chain_us(fn: Callable, buffer: Any, args: tuple, iters: int = 20) -> float:
    """Median us of ``buffer = fn(buffer, *args)`` (donated buffer fed back)."""
    for _ in range(3):
        buffer = jax.block_until_ready(fn(buffer, *args))
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        buffer = jax.block_until_ready(fn(buffer, *args))
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples)) * 1e6


def _guard(rows: list[dict], row: dict, fn: Callable[[], dict], deadline: float) -> None:
    if time.perf_counter() > deadline:
        row["note"] = "skipped: time budget"
    else:
        try:
            row.update(fn())
        except Exception as exc:  # noqa: BLE001 - one broken impl must not stop the bench
            row["note"] = f"FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            if row.get("verbose"):
                traceback.print_exc()
    row.pop("verbose", None)
    rows.append(row)
    print(format_table([row], COLUMNS).splitlines()[-1], flush=True)


# ---- benches -------------------------------------------------------------------------------------
def _bench_expand(
    rows, rng, bs: int, page: int, *, num_sets: int, impls, torch_compile: bool, deadline: float
) -> None:
    sets = _expand_inputs(rng, bs, page, num_sets)
    arg_sets = [(jnp.asarray(lp), jnp.asarray(cl)) for lp, cl in sets]
    decode_length = STEPS
    base = {"op": "expand", "bs": bs, "page": page, "mode": f"d={decode_length}"}
    for impl in impls:

        def run(impl=impl):
            op = functools.partial(
                draft_decode_set_expand_metadata,
                decode_length=decode_length,
                geometry=_geometry(page),
                impl=impl,
            )
            return {
                "device us": time_device(lambda lp, cl: op(lp, cache_loc=cl), arg_sets),
                "wall us": time_wall(jax.jit(lambda lp, cl: op(lp, cache_loc=cl)), *arg_sets[0]),
            }

        _guard(rows, {**base, "impl": impl}, run, deadline)
    for compiled in (False, True) if torch_compile else (False,):

        def run_torch(compiled=compiled):
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
            lp = torch.from_numpy(sets[0][0]).to(device)
            cache_loc = torch.from_numpy(sets[0][1]).to(device)[:, :decode_length]
            seqlens = torch.zeros(bs * TOPK, dtype=torch.int32, device=device)
            table = torch.zeros(bs * TOPK, decode_length + 1, dtype=torch.int32, device=device)
            fn = torch.compile(_torch_expand, dynamic=True) if compiled else _torch_expand
            return {
                "device us": time_torch(
                    lambda: fn(seqlens, table, lp, decode_length, cache_loc, TOPK, page)
                ),
                "note": device,
            }

        _guard(
            rows, {**base, "impl": "torch.compile" if compiled else "torch"}, run_torch, deadline
        )


def _bench_kv(
    rows,
    rng,
    bs: int,
    page: int,
    *,
    context: int,
    lens: tuple[int, int],
    num_sets: int,
    impls,
    deadline: float,
    reduced: bool = False,
) -> None:
    req_to_token, sets = _kv_inputs(
        rng, bs, context=context, num_sets=num_sets, lo=lens[0], hi=lens[1]
    )
    width = bs * TOPK * context  # SpecConfig.kv_indices_width(bs)
    used = [
        draft_kv_indices_used_len(int(s.sum()), TOPK, bs * TOPK, i + 1)
        for _, s in sets
        for i in range(STEPS)
    ]
    nbytes = 8 * float(np.mean(used)) * STEPS
    shared = (jnp.asarray(req_to_token),)
    xs = (jnp.asarray(np.stack([r for r, _ in sets])), jnp.asarray(np.stack([s for _, s in sets])))
    kw = {"geometry": _geometry(page), "kv_indices_width": width}
    base = {"op": "kv_indices", "bs": bs, "page": page}

    def zeros():
        return jnp.zeros((STEPS, width), jnp.int32)

    for impl in impls:
        modes = ("fresh", "inplace") if impl != "xla" else ("fresh",)
        if reduced:
            modes = tuple(m for m in modes if m == "inplace")
        for mode in modes:

            def run(impl=impl, mode=mode):
                op = functools.partial(generate_draft_decode_kv_indices, **kw, impl=impl)

                def body(carry, x, rtt):
                    buffer = carry if mode == "inplace" else None
                    return op(x[0], rtt, x[1], kv_indices_buffer=buffer)[0]

                device_us = _scan_carry_us(body, zeros, xs, shared)
                if mode == "fresh":
                    wall = time_wall(
                        jax.jit(lambda r, t, s: op(r, t, s)),
                        xs[0][0],
                        shared[0],
                        xs[1][0],
                        iters=10,
                    )
                else:
                    step = jax.jit(
                        lambda b, r, t, s: op(r, t, s, kv_indices_buffer=b)[0], donate_argnums=0
                    )
                    wall = _wall_chain_us(step, zeros(), (xs[0][0], shared[0], xs[1][0]), iters=10)
                return {
                    "device us": device_us,
                    "wall us": wall,
                    "GB/s": nbytes / (device_us * 1e-6) / 1e9,
                }

            _guard(rows, {**base, "impl": impl, "mode": mode}, run, deadline)
    for impl in ("torch+triton",) if reduced else ("torch", "torch+triton"):

        def run_torch(impl=impl):
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
            if impl == "torch+triton" and device != "cuda":
                return {"note": "skipped: needs CUDA (CPU: see tests, Triton interpreter)"}
            rpi = torch.from_numpy(sets[0][0]).to(device)
            seq_lens = torch.from_numpy(sets[0][1]).to(device)
            rtt = torch.from_numpy(req_to_token).to(device)
            buffer = torch.zeros((STEPS, width), dtype=torch.int32, device=device)
            indptr = torch.zeros((STEPS, bs * TOPK + 1), dtype=torch.int32, device=device)
            seq_lens_sum = int(sets[0][1].sum())
            if impl == "torch":

                def fn():
                    return _torch_kv_indices(
                        buffer, indptr, rpi, rtt, seq_lens, seq_lens_sum, TOPK, STEPS, page
                    )
            else:
                from interop import triton_meta

                def fn():
                    return triton_meta.draft_kv_indices_torch(
                        rpi,
                        rtt,
                        seq_lens,
                        topk=TOPK,
                        num_steps=STEPS,
                        page_size=page,
                        kv_indices_width=width,
                        kv_indices_buffer=buffer,
                        kv_indptr_out=indptr,
                    )

            us = time_torch(fn, iters=20, warmup=3)
            bytes_set0 = 8.0 * sum(used[:STEPS])
            return {
                "device us": us,
                "GB/s": bytes_set0 / (us * 1e-6) / 1e9,
                "mode": "inplace",
                "note": device,
            }

        _guard(rows, {**base, "impl": impl}, run_torch, deadline)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--bs", default="", help="comma-separated batch sizes")
    parser.add_argument("--pages", default="", help="comma-separated page sizes")
    parser.add_argument("--ops", default="expand,kv_indices")
    parser.add_argument(
        "--torch-compile",
        action="store_true",
        help="also time torch.compile of sglang's expand function",
    )
    parser.add_argument(
        "--full", action="store_true", help="every kv_indices impl/mode at every page size"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="skip rows after this many seconds (default 45 quick, 120 full)",
    )
    args = parser.parse_args(argv)
    on_gpu = _common.on_gpu()
    if args.quick:
        batch_sizes, pages, context, lens, num_sets = [2], [16], 256, (40, 120), 2
    else:
        batch_sizes, pages, context, lens, num_sets = (
            [1, 8, 64, 256],
            [1, 16, 64],
            8192,
            (1000, 2000),
            8,
        )
    if args.bs:
        batch_sizes = [int(x) for x in args.bs.split(",")]
    if args.pages:
        pages = [int(x) for x in args.pages.split(",")]
    ops = [x for x in args.ops.split(",") if x]
    impls = ("xla", "pallas", "triton") if on_gpu else ("xla", "pallas")
    budget = args.budget_s or (45.0 if args.quick else 120.0)
    deadline = time.perf_counter() + budget
    rng = np.random.default_rng(0)
    rows: list[dict] = []
    print(
        "\n".join(format_table([dict.fromkeys(COLUMNS, "")], COLUMNS).splitlines()[:2]), flush=True
    )
    # Page 16 first (the most important rows survive the time budget); other pages run the
    # reduced kv_indices matrix (page size only moves the draft-slot start) unless --full.
    pages = sorted(pages, key=lambda p: (p != 16, p))
    for page in pages:
        for bs in batch_sizes:
            if "expand" in ops and page > 1:
                _bench_expand(
                    rows,
                    rng,
                    bs,
                    page,
                    num_sets=num_sets,
                    impls=impls,
                    torch_compile=args.torch_compile,
                    deadline=deadline,
                )
            if "kv_indices" in ops:
                _bench_kv(
                    rows,
                    rng,
                    bs,
                    page,
                    context=context,
                    lens=lens,
                    num_sets=num_sets,
                    impls=impls,
                    deadline=deadline,
                    reduced=not (args.full or page == 16 or args.quick),
                )
    return rows  # the header and every row are printed as they come: one table


if __name__ == "__main__":
    main()
