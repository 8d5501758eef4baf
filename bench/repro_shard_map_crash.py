"""jax 0.11.2 segfaults compiling a jitted shard_map with a zero-element operand (pure jax).

    python -m bench.repro_shard_map_crash               # the crash: dies with SIGSEGV on 0.11.2
    python -m bench.repro_shard_map_crash --workaround  # the same values without it: "OK"
    python -m bench.repro_shard_map_crash --gspmd       # GSPMD instead of Shardy: "OK"

What crashes. Compiling (not tracing, not lowering) ``jax.jit(jax.shard_map(f, ...))`` over a mesh
of >= 2 devices, where ``f`` takes a zero-element array (any shape with a 0 dimension) beside at
least one other operand. The smallest case, two devices::

    f = jax.jit(jax.shard_map(lambda a, z: (a, z), mesh=Mesh(devices[:2], ("x",)),
                              in_specs=P(), out_specs=P()))
    f(jnp.ones(3), jnp.zeros(0))  # Segmentation fault

Python's faulthandler shows ``jax/_src/compiler.py backend_compile_and_load``; gdb shows the
fault in ``mlir::sdy::ManualComputationUnusedInputsPattern::matchAndRewrite`` (Shardy's
canonicalizer, run by ``xla::sdy::ShardyXLA`` from ``CpuCompiler::RunHloPasses``), i.e. the
``sdy.manual_computation`` that shard_map lowers to. Observed on the default (Shardy) partitioner:

* jax/jaxlib 0.11.2, XLA:CPU with ``--xla_force_host_platform_device_count=2``: SIGSEGV.
* jax/jaxlib 0.11.2 on 2 x H200: jspec's greedy engine (its state carries a ``[M, 0]`` array)
  died at its first multi-device compile with the same Python stack. This script and the
  workaround are not yet run there (Shardy is not backend code: the same fault is expected).
* jax/jaxlib 0.10.2 (CPU): compiles and runs (and lowers to the same ``sdy.manual_computation``).

Not enough alone (these compile): the zero-element array as the only operand (``lambda z: z``),
one device, no outer ``jax.jit`` (eager shard_map), a zero-element array made inside the body and
returned, an int32 operand used only as ``b * 0``. Donation, ``lax.cond``, scatters, argmax /
top-k, psum, custom calls and compiler options play no part: the engine's greedy prefill, which
has them all, compiles once its zero-element state leaf is kept out of the shard_map.

Workaround (jspec/engine/sharding.py ``_Holes``): never pass a zero-element array across the
shard_map boundary. Drop such operands and results (None in their place and spec), rebuild them
inside as zeros of their per-shard shape and outside as zeros of their global shape: they hold no
data. ``jax.config.update("jax_use_shardy_partitioner", False)`` (GSPMD, deprecated) also avoids it.
"""

from __future__ import annotations

import argparse
import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Two CPU devices where there is no accelerator (ignored by GPU backends).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    ).strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workaround", action="store_true", help="keep z out of the shard_map")
    parser.add_argument("--gspmd", action="store_true", help="jax_use_shardy_partitioner=False")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    if args.gspmd:
        jax.config.update("jax_use_shardy_partitioner", False)
    devices = jax.devices()
    print(
        f"jax {jax.__version__}, jaxlib {jax.lib.__version__}, {len(devices)} x "
        f"{devices[0].device_kind}",
        flush=True,
    )
    if len(devices) < 2:
        print("needs >= 2 devices")
        return 2
    mesh = Mesh(np.asarray(devices[:2]), ("x",))
    a, z = jnp.ones(3), jnp.zeros(0)
    if args.workaround:
        inner = jax.shard_map(lambda a: a, mesh=mesh, in_specs=P(), out_specs=P())
        f = jax.jit(lambda a, z: (inner(a), jnp.zeros(z.shape, z.dtype)))
    else:
        f = jax.jit(jax.shard_map(lambda a, z: (a, z), mesh=mesh, in_specs=P(), out_specs=P()))
    print("compiling ...", flush=True)
    out_a, out_z = f(a, z)  # the segfault happens here, in the compile
    assert out_a.tolist() == [1.0, 1.0, 1.0] and out_z.shape == (0,)
    print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
