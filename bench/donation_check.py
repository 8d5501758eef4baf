"""Do the engine state's KV pools own distinct device buffers, and are they donated in place?

    python -m bench.donation_check [--gib 4]

Prints the device buffer pointers and ``bytes_in_use`` after each stage of building an engine
state (``init_kv_pool``, ``init_engine_state``, ``stack_states``), then runs one donated update
of every pool leaf and reports the memory it took: an in-place update adds nothing, a pool
whose buffer is shared with another leaf (or not donated) needs a new pool-sized buffer.
"""

from __future__ import annotations

import argparse
import sys

import jax


def _mem() -> str:
    stats = jax.local_devices()[0].memory_stats() or {}
    return f"in use {stats.get('bytes_in_use', 0) / 2**30:.2f} GiB"


def _ptrs(tree) -> list[int]:
    return [x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) if x.size > 1 << 20]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="bytes of each K / V array")
    args = parser.parse_args(argv)
    from jspec.engine import Runner, init_engine_state, make_engine_config, sharding
    from jspec.models import Eagle3Config, Eagle3Draft, LlamaConfig, LlamaTarget

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=4096,
        intermediate_size=128,
        num_layers=4,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
    )
    target = LlamaTarget(cfg)
    draft = Eagle3Draft(
        Eagle3Config(
            hidden_size=4096,
            intermediate_size=128,
            num_heads=32,
            num_kv_heads=32,
            head_dim=128,
            vocab_size=256,
            draft_vocab_size=128,
            dtype="bfloat16",
        ),
        (0, 1, 2),
    )
    per_slot = 4 * 8 * 128 * 2  # one K array's bytes per slot (target; the draft's equal)
    pages = int(args.gib * 2**30 // (per_slot * 16))
    ecfg = make_engine_config(target, max_running_requests=4, num_pages=pages, context_len=512)
    print("start:", _mem(), flush=True)
    st = init_engine_state(Runner(ecfg, target, draft))
    jax.block_until_ready(st)
    print("init_engine_state:", _mem(), "pointers", _ptrs(st), flush=True)
    stacked = sharding.stack_states([st], 1)
    del st
    jax.block_until_ready(stacked)
    print("stack_states:", _mem(), "pointers", _ptrs(stacked), flush=True)

    @jax.jit
    def touch(s):
        def one(x):
            return x.at[(0,) * x.ndim].set(1) if x.size > 1 << 20 else x

        return jax.tree.map(one, s)

    donate = jax.jit(
        touch.__wrapped__ if hasattr(touch, "__wrapped__") else touch, donate_argnums=0
    )
    before = _ptrs(stacked)
    try:
        out = donate(stacked)
        jax.block_until_ready(out)
        print("donated update:", _mem(), "same buffers", _ptrs(out) == before, flush=True)
    except Exception as e:  # noqa: BLE001
        print("donated update FAILED:", type(e).__name__, str(e)[:300], flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
