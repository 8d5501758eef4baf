"""Bench: alloc_extend / alloc_decode / assign_req_to_token_pool, xla vs pallas vs torch.

    python -m bench.alloc [--quick] [--bs 1,8,64,256] [--page-size 16]

Workload (the spec-decode step of SPEC §4.1): every request grows from a random committed length
``pre`` (page-unaligned) to ``ceil_P(pre + reserve)`` with ``reserve = alloc_reserve_per_decode``
of ``SpecConfig(page_size=P, topk=4, num_steps=3, num_draft_tokens=8)`` (256 slots at P=16), so
``alloc_extend`` hands out ~bs*256 slots. ``alloc_decode`` gives one slot per request;
``assign_req_to_token_pool`` writes the extend slots into the rows.

Columns: device us (``time_device``: R distinct inputs in one jitted scan, plus one checksum read
of the outputs per call), wall us (one jitted call incl. dispatch), torch us (a vectorised torch
version with sglang's semantics on CUDA when available: host-known totals as sglang's ``*_cpu``
args give it; no Triton), GB/s (assign only: slot ids read + written).
"""

from __future__ import annotations

import argparse
import functools
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench._timing import format_table, time_device, time_torch, time_wall
from jspec.config import SpecConfig
from jspec.kv import allocator as A
from jspec.kv import req_to_token as T

COLUMNS = ("op", "bs", "page", "impl", "device us", "wall us", "torch us", "GB/s", "note")
NUM_INPUT_SETS = 8


def _workload(bs: int, page_size: int, seed: int) -> dict[str, Any]:
    """Host-side inputs of one spec-decode allocation step (numpy int32)."""
    cfg = SpecConfig(page_size=page_size, topk=4, num_steps=3, num_draft_tokens=8)
    p, reserve = page_size, cfg.alloc_reserve_per_decode
    rng = np.random.default_rng(seed)
    pre = rng.integers(1, 2048, bs).astype(np.int32)
    seq = ((pre + reserve + p - 1) // p * p).astype(np.int32)
    last = (rng.integers(1, 10_000, bs) * p + (pre - 1) % p).astype(np.int32)
    dec_seq = rng.integers(1, 2048, bs).astype(np.int32)
    dec_last = (rng.integers(1, 10_000, bs) * p + (dec_seq - 2) % p).astype(np.int32)
    max_new = bs * (reserve + p)
    num_pages = 2 * bs * (reserve // p + 2) + 64
    width = 2048 + reserve + 2 * p
    return {
        "pre": pre,
        "seq": seq,
        "last": last,
        "dec_seq": dec_seq,
        "dec_last": dec_last,
        "max_new": max_new,
        "num_pages": num_pages,
        "width": width,
        "free": (rng.permutation(num_pages) + 1).astype(np.int32),
    }


def _allocator(w: dict[str, Any], page_size: int) -> A.PagedAllocator:
    a = A.init_allocator(w["num_pages"], page_size)
    return A.PagedAllocator(
        free_pages=jnp.asarray(w["free"]),
        num_free=a.num_free,
        staged_pages=a.staged_pages,
        num_staged=a.num_staged,
        page_size=page_size,
        num_pages=w["num_pages"],
    )


def _jax_case(op: str, impl: str, bs: int, page_size: int):
    """(fn, arg_sets, bytes moved or 0) for one op/impl/bs."""
    sets, ws = [], [_workload(bs, page_size, seed) for seed in range(NUM_INPUT_SETS)]
    w0 = ws[0]
    if op == "alloc_extend":
        fn = functools.partial(A.alloc_extend, max_new_slots=w0["max_new"], impl=impl)
        for w in ws:
            sets.append(
                (
                    _allocator(w, page_size),
                    jnp.asarray(w["pre"]),
                    jnp.asarray(w["seq"]),
                    jnp.asarray(w["last"]),
                )
            )
        return fn, sets, 0
    if op == "alloc_decode":
        fn = functools.partial(A.alloc_decode, impl=impl)
        for w in ws:
            sets.append(
                (_allocator(w, page_size), jnp.asarray(w["dec_seq"]), jnp.asarray(w["dec_last"]))
            )
        return fn, sets, 0
    fn = functools.partial(T.assign_req_to_token_pool, impl=impl)
    for w in ws:
        table = jnp.zeros((bs + 1, w0["width"]), jnp.int32)
        rows = jnp.arange(1, bs + 1, dtype=jnp.int32)
        locs = jnp.arange(w0["max_new"], dtype=jnp.int32) + 64
        sets.append((table, rows, jnp.asarray(w["pre"]), jnp.asarray(w["seq"]), locs))
    total = int((w0["seq"] - w0["pre"]).sum())
    return fn, sets, 2 * 4 * total


# ---- torch versions (sglang semantics, vectorised; host-known totals like sglang's *_cpu) -------
def _torch_case(op: str, bs: int, page_size: int):
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = _workload(bs, page_size, 0)
    p = page_size
    t = {k: torch.as_tensor(v, device=dev) for k, v in w.items() if isinstance(v, np.ndarray)}
    if op == "alloc_extend":
        pre, seq, last, free = t["pre"], t["seq"], t["last"], t["free"]
        ext = seq - pre
        host_total = int(ext.sum())
        host_pages = int(((seq + p - 1) // p - (pre + p - 1) // p).sum())

        def run():
            ext = seq - pre
            cu_end = torch.cumsum(ext, 0)
            new_pages = (seq + p - 1) // p - (pre + p - 1) // p
            page_start = torch.cumsum(new_pages, 0) - new_pages
            j = torch.arange(host_total, device=dev, dtype=torch.int32)
            b = torch.searchsorted(cu_end, j, right=True)
            tt = j - (cu_end - ext)[b]
            pos = pre[b] + tt
            ceil_pre = (pre[b] + p - 1) // p * p
            idx = page_start[b] + torch.clamp(pos - ceil_pre, min=0) // p
            slots = torch.where(pos < ceil_pre, last[b] + 1 + tt, free[idx] * p + pos % p)
            return slots, free[host_pages:]

        return run
    if op == "alloc_decode":
        seq, last, free = t["dec_seq"], t["dec_last"], t["free"]
        host_pages = int(((w["dec_seq"] + p - 1) // p > (w["dec_seq"] + p - 2) // p).sum())

        def run():
            need = ((seq + p - 1) // p > (seq + p - 2) // p).to(torch.int32)
            rank = torch.cumsum(need, 0) - need
            slots = torch.where(need > 0, free[rank] * p, last + 1)
            return slots, free[host_pages:]

        return run
    table = torch.zeros((bs + 1, w["width"]), dtype=torch.int32, device=dev)
    rows = torch.arange(1, bs + 1, device=dev)
    pre, seq = t["pre"].long(), t["seq"].long()
    lens = seq - pre
    host_total = int(lens.sum())
    locs = torch.arange(host_total, dtype=torch.int32, device=dev) + 64

    def run():
        r = torch.repeat_interleave(rows, lens, output_size=host_total)
        start = torch.repeat_interleave(
            pre - (torch.cumsum(lens, 0) - lens), lens, output_size=host_total
        )
        cols = start + torch.arange(host_total, device=dev)
        table[r, cols] = locs
        return table

    return run


def _bench_one(op: str, impl: str, bs: int, page_size: int, quick: bool) -> dict[str, Any]:
    # Every column present in every row: a value an impl does not have prints as an empty cell.
    row: dict[str, Any] = dict.fromkeys(COLUMNS, "")
    row.update(op=op, bs=bs, page=page_size, impl=impl)
    try:
        if impl == "torch":
            row["torch us"] = time_torch(
                _torch_case(op, bs, page_size), iters=5 if quick else 50, warmup=2 if quick else 5
            )
            return row
        fn, sets, nbytes = _jax_case(op, impl, bs, page_size)
        row["device us"] = time_device(fn, sets[:2] if quick else sets, repeats=1 if quick else 3)
        row["wall us"] = time_wall(
            jax.jit(fn), *sets[0], iters=3 if quick else 30, warmup=1 if quick else 3
        )
        if nbytes:
            row["GB/s"] = nbytes / (row["device us"] * 1e-6) / 1e9
    except Exception as exc:  # noqa: BLE001 - report the failure in the row, keep going
        row["note"] = f"FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        traceback.print_exc()
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    parser.add_argument("--bs", default="", help="comma-separated batch sizes")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--impls", default="xla,pallas,torch")
    parser.add_argument("--ops", default="alloc_extend,alloc_decode,assign_req_to_token_pool")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.bs.split(",") if x] or ([1, 8] if args.quick else [1, 8, 64, 256])
    rows = []
    for op in args.ops.split(","):
        for bs in sizes:
            for impl in args.impls.split(","):
                rows.append(_bench_one(op, impl, bs, args.page_size, args.quick))
    print(format_table(rows, COLUMNS), flush=True)
    return rows


if __name__ == "__main__":
    main()
