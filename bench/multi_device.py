"""Data x tensor parallel on real devices: every (dp, tp) layout gives the one-device tokens.

    python -m bench.multi_device [--layouts 1x1,1x2,2x1] [--num-prompts 16]

The ``jspec demo`` model (vocab 512, 4 layers, f32), page 16, topk 4, steps 3, 8 draft tokens.
For each layout ``DPxTP`` (``DP * TP`` devices) it runs plain greedy and spec decode and
reports tokens/s, the acceptance length, the leak check and whether the tokens equal the
one-device greedy run (asserted). Needs ``DP * TP`` JAX devices (not part of run_all).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from bench._timing import format_table

COLUMNS = ("layout", "mode", "tokens/s", "accept len", "equal to 1 device", "leak check")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="1x1,1x2,2x1", help="DPxTP, comma-separated")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    from jspec.engine.scheduler import Engine
    from jspec.engine.state import make_engine_config
    from jspec.models import LlamaConfig, LlamaTarget, toy_eagle1, toy_llama_params

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
    )
    target = LlamaTarget(cfg)
    params = toy_llama_params(target, 0, residual_scale=2.0)
    draft_model, draft = toy_eagle1(target, params, 1)
    rng = np.random.default_rng(0)
    lens = rng.integers(4, 41, args.num_prompts)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in lens]
    layouts = [tuple(int(x) for x in item.split("x")) for item in args.layouts.split(",") if item]
    rows, reference = [], None
    print(
        "\n".join(format_table([dict.fromkeys(COLUMNS, "")], COLUMNS).splitlines()[:2]), flush=True
    )
    for dp, tp in [(1, 1)] + [lt for lt in layouts if lt != (1, 1)]:
        ecfg = make_engine_config(
            target,
            page_size=16,
            topk=4,
            num_steps=3,
            num_draft_tokens=8,
            context_len=128,
            max_running_requests=8,
            max_prompt_len=int(lens.max()),
            tensor_parallel=tp,
        )
        for mode, d in (("greedy", None), ("spec", draft)):
            engine = (
                Engine(ecfg, target, params, num_devices=dp)
                if d is None
                else Engine(ecfg, target, params, draft_model, d, num_devices=dp)
            )
            engine.warmup()
            out, stats = engine.generate(prompts, args.max_new_tokens)
            reference = out if reference is None else reference
            rows.append(
                {
                    "layout": f"dp{dp} x tp{tp}",
                    "mode": mode,
                    "tokens/s": stats.tokens_per_s,
                    "accept len": stats.mean_accept_len if mode == "spec" else 1.0,
                    "equal to 1 device": out == reference,
                    "leak check": stats.leak_check,
                }
            )
            print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
    assert all(r["equal to 1 device"] for r in rows), "a layout changed the tokens"
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
