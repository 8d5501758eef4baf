"""Launch overhead of raw Triton kernels: jax-triton's legacy custom call against jaxlib's
typed-FFI target (which XLA's command buffers capture; :mod:`jspec.kernels.triton_ffi`).

    python -m bench.triton_ffi_probe [--kernels 64] [--iters 100]
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python -m bench.triton_ffi_probe   # graphs off

One jitted function chains ``--kernels`` launches of a one-block add-one kernel on 4096 floats
(so each kernel's own time is ~1-2 us and the chain measures the launches); per target, the
median wall of a blocked call and a check of the result (= the number of kernels). GPU only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp


def main(argv: list[str] | None = None) -> dict[str, float]:
    import triton
    import triton.language as tl

    from jspec.kernels import _common, triton_ffi

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", type=int, default=64)
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args(argv)
    jt = _common.import_jax_triton()  # installs the typed-FFI rewrite

    @triton.jit
    def add_one(x_ptr, n, o_ptr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(o_ptr + i, tl.load(x_ptr + i, mask=m) + 1.0, mask=m)

    def chain(x, target):
        for _ in range(args.kernels):
            out = jax.ShapeDtypeStruct(x.shape, x.dtype)
            grid = ((x.size + 1023) // 1024,)
            x = jt.triton_call(
                x, x.size, kernel=add_one, out_shape=out, grid=grid, BLOCK=1024,
                custom_call_target_name=target,
            )  # fmt: skip
        return x

    print(f"FFI target registered: {triton_ffi.ffi_target_registered()}")
    x = jnp.zeros((4096,), jnp.float32)
    medians = {}
    for target in (triton_ffi.LEGACY_TARGET, triton_ffi.FFI_TARGET):
        f = jax.jit(lambda x, target=target: chain(x, target))
        y = f(x).block_until_ready()
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            f(x).block_until_ready()
            times.append(time.perf_counter() - t0)
        medians[target] = statistics.median(times) * 1e6
        print(
            f"{target}: {args.kernels} kernels, median {medians[target]:.0f} us "
            f"(result {float(y[0]):g}, expected {args.kernels})",
            flush=True,
        )
    return medians


if __name__ == "__main__":
    main()
