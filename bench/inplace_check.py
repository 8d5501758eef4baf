"""Which KV-write pattern keeps a donated pool in place on the GPU (peak device memory).

    python -m bench.inplace_check [--gib 24] [--variants scatter,deferred,triton,dus]

One pool array ``bf16[L, S, 8, 128]`` of ``--gib`` GiB is donated to a jitted function that,
per layer ``l``, writes 2048 rows (token slots) and reads 4096 rows back (a gather, as an
attention pass over the pool does). Each variant runs in its own process; it prints the peak
device memory the call added beyond the pool (0 = in place, ~the pool = a copy):

* ``scatter``: ``pool.at[l, slots].set(x)`` then the read, layer by layer (the engine's order:
  write a layer's new K/V, then attend over the pool);
* ``deferred``: every layer reads the pool as it came in, and all writes happen after the
  reads (the new tokens' own K/V reach attention beside the pool, not through it);
* ``triton``: the write is a Triton kernel with the pool aliased in place
  (``input_output_aliases``), then the read;
* ``dus``: one-row ``dynamic_update_slice`` writes (decode), then the read.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

LAYERS, HEADS, DIM, WRITE, READ = 8, 8, 128, 2048, 4096


def _peak() -> int:
    return int((jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0))


def _triton_write(pool, layer, slots, rows):
    """``pool[layer, slots] = rows`` by a Triton kernel, the pool aliased in place."""
    import triton
    import triton.language as tl

    from jspec.kernels._common import import_jax_triton

    jt = import_jax_triton()

    @triton.jit
    def kernel(
        slot_ptr,
        val_ptr,
        layer_ptr,
        pool_ptr,
        out_ptr,
        NUM_SLOTS: tl.constexpr,
        ROW: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < ROW
        slot = tl.load(slot_ptr + t).to(tl.int64)
        lay = tl.load(layer_ptr).to(tl.int64)
        val = tl.load(val_ptr + t.to(tl.int64) * ROW + cols, mask=ok)
        tl.store(out_ptr + (lay * NUM_SLOTS + slot) * ROW + cols, val, mask=ok)

    num_layers, num_slots = pool.shape[:2]
    row = int(np.prod(pool.shape[2:]))
    flat = pool.reshape(num_layers, num_slots, row)
    out = jt.triton_call(
        slots,
        rows.reshape(rows.shape[0], row),
        jnp.full((1,), layer, jnp.int32),
        flat,
        kernel=kernel,
        out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        grid=(rows.shape[0], row // 256),
        input_output_aliases={3: 0},
        NUM_SLOTS=num_slots,
        ROW=row,
        BLOCK=256,
    )
    return out.reshape(pool.shape)


def step(pool, x, variant: str):
    s = pool.shape[1]
    acc = jnp.float32(0)
    reads = []
    for layer in range(LAYERS):
        w_slots = (jnp.arange(WRITE, dtype=jnp.int32) * 7 + layer) % s
        r_slots = (jnp.arange(READ, dtype=jnp.int32) * 13 + layer) % s
        rows = (x + layer).astype(pool.dtype)
        if variant == "deferred":
            reads.append(pool[layer, r_slots].astype(jnp.float32).sum() + acc)
            acc = reads[-1] * 1e-3
            continue
        if variant == "scatter":
            pool = pool.at[layer, w_slots].set(rows)
        elif variant == "triton":
            pool = _triton_write(pool, layer, w_slots, rows)
        elif variant == "dus":
            pool = jax.lax.dynamic_update_slice(pool, rows[:1][None], (layer, w_slots[0], 0, 0))
        acc = pool[layer, r_slots].astype(jnp.float32).sum() * 1e-3 + acc
    if variant == "deferred":
        for layer in range(LAYERS):
            w_slots = (jnp.arange(WRITE, dtype=jnp.int32) * 7 + layer) % s
            pool = pool.at[layer, w_slots].set((x + layer + acc).astype(pool.dtype))
    return pool, acc


def run_one(variant: str, gib: float) -> None:
    s = int(gib * 2**30 // (LAYERS * HEADS * DIM * 2))
    x = jnp.ones((WRITE, HEADS, DIM), jnp.bfloat16)
    if variant == "squeeze":  # the single-device engine: state stacked [1, ...], x[0] / x[None]
        pool = jnp.zeros((1, LAYERS, s, HEADS, DIM), jnp.bfloat16)

        def body(p, y):
            p, acc = step(p[0], y, "scatter")
            return p[None], acc

        fn = jax.jit(body, donate_argnums=0)
    else:
        pool = jnp.zeros((LAYERS, s, HEADS, DIM), jnp.bfloat16)
        fn = jax.jit(lambda p, y: step(p, y, variant), donate_argnums=0)
    jax.block_until_ready(pool)
    base = _peak()
    try:
        pool, acc = fn(pool, x)
        jax.block_until_ready(acc)
        extra = (_peak() - base) / 2**30
        print(f"{variant}: pool {pool.nbytes / 2**30:.1f} GiB, extra peak {extra:.2f} GiB")
    except Exception as e:  # noqa: BLE001
        print(f"{variant}: FAILED {type(e).__name__}: {str(e)[:200]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=24.0)
    parser.add_argument("--variants", default="scatter,deferred,triton,dus,squeeze")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        run_one(args.one, args.gib)
        return
    for variant in args.variants.split(","):
        cmd = [
            sys.executable,
            "-m",
            "bench.inplace_check",
            "--one",
            variant,
            "--gib",
            str(args.gib),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, env=os.environ, timeout=300)
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith(variant)]
        print(lines[-1] if lines else f"{variant}: rc={res.returncode} {res.stderr[-300:]}")


if __name__ == "__main__":
    main(sys.argv[1:])
