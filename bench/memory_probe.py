"""Where a step's memory goes: XLA's buffer assignment of the compiled engine calls.

    python -m bench.memory_probe [--layers 4] [--pool-gib 4] [--attention-impl auto,xla]

Builds the 8B layer geometry with ``--layers`` layers (bf16, random weights, the matched EAGLE-3
head of bench/real_size.py), an engine whose pools take ``--pool-gib``, and compiles the
prefill chunk, the greedy step and the spec step. Per call it prints the argument / output /
alias / temp bytes of ``compiled.memory_analysis()`` and every ``copy`` in the optimized HLO
whose operand is at least 1/8 of a pool (a copy of the pool: what made serving sizes run out
of memory). A donated state is updated in place when ``alias`` covers the pools and no such
copy exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

import jax
import numpy as np

from bench.real_size import GEOMETRIES, make_params, make_target


def _big_copies(hlo: str, min_bytes: int, ops: str = "copy|copy-start") -> list[str]:
    sizes = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "pred": 1, "u8": 1, "s8": 1}
    out = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*(\w+)\[([\d,]*)\]\S*\s+(" + ops + r")\(", line)
        if not m or "parameter(" in line:
            continue
        dims = [int(d) for d in m.group(2).split(",") if d]
        nbytes = int(np.prod(dims or [1])) * sizes.get(m.group(1), 4)
        if nbytes >= min_bytes:
            out.append(f"{nbytes / 2**30:.2f} GiB: {line.strip()[:160]}")
    return out


def _mem() -> str:
    stats = jax.local_devices()[0].memory_stats() or {}
    return ", ".join(
        f"{k} {stats.get(k, 0) / 2**30:.2f} GiB" for k in ("bytes_in_use", "peak_bytes_in_use")
    )


def probe(engine, name: str, body, args, pool_bytes: int, run: bool = False) -> None:
    # The engine's own jitted call (its GEMM compile options included: cuBLAS at >= 64 tokens).
    tokens = args[1].size if name.startswith("prefill") else engine._step_tokens(args[0].size)
    fn = engine._fn(body, tokens)
    host = [np.asarray(a)[None] for a in args]
    if run:  # execute once: were the state's buffers donated (deleted), what did memory do?
        before = jax.tree.leaves(engine.state)
        print(f"  {name} run: before {_mem()}", flush=True)
        try:
            engine.state, out = fn(engine.weights, engine.state, *host)
            jax.block_until_ready(out)
            donated = sum(x.is_deleted() for x in before)
            print(f"  {name} run: after {_mem()}; donated {donated}/{len(before)}", flush=True)
        except Exception as e:  # noqa: BLE001 - report and keep going
            print(f"  {name} run FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return
    compiled = fn.lower(engine.weights, engine.state, *host).compile()
    ma = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes")
    fields += ("temp_size_in_bytes",)
    sizes = {f.split("_size")[0]: getattr(ma, f, 0) / 2**30 for f in fields}
    print(f"  {name}: " + ", ".join(f"{k} {v:.2f} GiB" for k, v in sizes.items()), flush=True)
    text = compiled.as_text()
    for line in _big_copies(text, pool_bytes // 8):
        print("    COPY", line, flush=True)
    for line in _big_copies(text, pool_bytes // 8, ops=r"[\w-]+")[:12]:
        print("    BIG", line, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pool-gib", type=float, default=4.0)
    parser.add_argument("--attention-impl", default="auto,xla")
    parser.add_argument("--geometry", default="8b")
    parser.add_argument("--mem-fraction", type=float, default=None, help="size as serving does")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument("--run", action="store_true", help="execute each call once instead")
    parser.add_argument("--greedy", action="store_true", help="a greedy engine (no draft)")
    args = parser.parse_args(argv)
    from jspec.engine.greedy import greedy_step_body
    from jspec.engine.lifecycle import prefill_chunk_body
    from jspec.engine.memory import kv_bytes_per_token
    from jspec.engine.scheduler import Engine
    from jspec.engine.spec_step import spec_step_body
    from jspec.engine.state import make_engine_config

    g = dataclasses.replace(GEOMETRIES[args.geometry], layers=args.layers)
    target = make_target(g)
    params, draft, dparams = make_params(g, target)
    per_page = kv_bytes_per_token(target, draft) * 16
    pages = None if args.mem_fraction else int(args.pool_gib * 2**30 // per_page)
    for attn in args.attention_impl.split(","):
        ecfg = make_engine_config(
            target,
            page_size=16,
            topk=4,
            num_steps=3,
            num_draft_tokens=8,
            context_len=args.context,
            max_running_requests=args.max_running,
            max_prompt_len=2048,
            batch_buckets=(args.max_running,),
            num_pages=pages,
            mem_fraction_static=args.mem_fraction,
            draft=None if args.greedy else draft,
            chunked_prefill_size=2048,
            prefill_buckets=(2048,),
            attention_impl=attn,
        )
        if args.greedy:
            engine = Engine(ecfg, target, params)
        else:
            engine = Engine(ecfg, target, params, draft, dparams)
        pool = sum(x.nbytes for x in jax.tree.leaves(engine.state.kv.target_pool))
        print(f"attention {attn} ({ecfg.kernels.attention}): pool {pool / 2**30:.2f} GiB")
        m = args.max_running
        chunk = (np.full(1, m, np.int32), np.zeros((1, 2048), np.int32), np.zeros(1, np.int32))
        chunk += (np.zeros(1, np.int32), np.zeros(1, bool), np.zeros(1, np.int32))
        step = (np.full(m, m, np.int32), np.zeros(m, bool))
        big = [x for x in jax.tree.leaves(engine.state) if x.nbytes > 1 << 28]
        ptrs = [x.unsafe_buffer_pointer() for x in big]
        print(
            f"  engine made: {_mem()}; pool leaves {[x.shape for x in big]} at {ptrs}"
            f" ({len(set(ptrs))} distinct)",
            flush=True,
        )
        probe(engine, "prefill_chunk", prefill_chunk_body, chunk, pool, args.run)
        if args.greedy:
            probe(engine, "greedy_step", greedy_step_body, step, pool, args.run)
            del engine
            continue
        probe(engine, "spec_step", spec_step_body, step, pool, args.run)
        del engine
        if args.run:
            break  # a greedy engine beside the spec one would not fit
        greedy = Engine(ecfg, target, params)
        probe(greedy, "greedy_step", greedy_step_body, step, pool)
        del greedy


if __name__ == "__main__":
    main(sys.argv[1:])
