"""Real-size speed (issue 13): an 8B (and 1B) Llama geometry, greedy vs spec, against floors.

    python -m bench.real_size [--quick] [--geometry 8b,1b] [--batches 1,16,64]
                              [--attention-impl triton] [--precision engine|default]
                              [--png step_vs_batch.png] [--out real_size.md]

Random bf16 weights made on the device (``jax.random``, the toy init's structure: the
permutation LM head ``lm_head[:, sigma(x)] = embed[x] / sqrt(H)`` and the EAGLE head
``fc = [I; 0.1 R]`` over a copy of the last layer, so acceptance is high). Prompts of 128
tokens, 64 new tokens, page 16, topk 4, steps 3, 8 draft tokens. Per (mode, batch):

* ``step ms (wall)``: the engine's decode-step wall time in ``Engine.generate`` (host loop
  included); ``step ms (device)``: the summed GPU kernel time of one steady-state step from a
  profiler trace (``bench._timing.profile_split_us``), split into target / draft / attention /
  bookkeeping / unattributed (attention = ops under ``paged_attention``; with XLA's command
  buffers on, cuBLAS / Triton kernels inside a graph are unattributed).
* floors measured in the same run: weight bytes read per step / the measured copy bandwidth
  (greedy: target layers + LM head; spec: that + ``steps`` draft forwards of fc + layer +
  LM head) plus the KV bytes at the mean context; FLOPs (2 x matmul params x tokens: bs for
  greedy, bs x draft tokens for verify, bs x topk per draft forward) / the measured bf16
  matmul rate; ``floor`` = the larger; ``x floor`` = device (and wall) / floor.
* tokens/s (decode), acceptance, and for spec how many requests' tokens equal greedy's.

``--precision default`` monkeypatches ``jspec.models.layers.precision_for`` to the default
(bf16 matmuls at full rate) to measure what HIGHEST costs (a no-op for bf16 models, whose
precision is already the default).
API used: ``jspec.models.{LlamaConfig, LlamaTarget, LlamaParams, LayerParams, Eagle1Draft,
Eagle1Params}``, ``jspec.engine.state.make_engine_config``, ``jspec.engine.scheduler.Engine``
(``generate``, ``_step``, and bench.e2e's ``_steady_state``: ``_admit``, ``_decode_step``,
``_bucket_arrays``, ``_shard_state``), ``RunStats`` fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench._timing import (
    UNATTRIBUTED,
    copy_bandwidth_tbs,
    device_name,
    format_table,
    profile_split_us,
)

COLUMNS = (
    "geometry",
    "mode",
    "bs",
    "attn",
    "precision",
    "step ms (wall)",
    "step ms (device)",
    "floor ms",
    "floor kind",
    "x floor (device)",
    "x floor (wall)",
    "tok/s",
    "accept len",
    "same as greedy",
    "target ms",
    "draft ms",
    "attention ms",
    "bookkeeping ms",
    "unattributed ms",
    "bookkeeping %",
    "note",
)
PAGE, TOPK, STEPS, DRAFT_TOKENS, PROMPT, NEW = 16, 4, 3, 8, 128, 64


@dataclasses.dataclass(frozen=True)
class Geometry:
    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int


GEOMETRIES = {
    "8b": Geometry("8b", 128256, 4096, 32, 32, 8, 128, 14336),
    "1b": Geometry("1b", 128256, 2048, 16, 32, 8, 64, 8192),
    "quick": Geometry("quick", 512, 64, 2, 4, 2, 16, 128),
}


def _model_config(g: Geometry):
    from jspec.models import LlamaConfig

    return LlamaConfig(
        vocab_size=g.vocab,
        hidden_size=g.hidden,
        intermediate_size=g.inter,
        num_layers=g.layers,
        num_heads=g.heads,
        num_kv_heads=g.kv_heads,
        head_dim=g.head_dim,
        rope_theta=500000.0,
        dtype="bfloat16",
    )


def make_params(cfg, seed: int = 0, residual_scale: float = 0.5):
    """Target and draft params made on the device (the toy init's structure, bf16)."""
    from jspec.models import Eagle1Params, LayerParams, LlamaParams

    dt = cfg.jnp_dtype
    hid, inter = cfg.hidden_size, cfg.intermediate_size
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    @jax.jit
    def layer(key):
        ks = jax.random.split(key, 7)

        def dense(k, fan_in, fan_out, scale=1.0):
            return (
                jax.random.normal(k, (fan_in, fan_out), jnp.float32) * (scale / np.sqrt(fan_in))
            ).astype(dt)

        return LayerParams(
            attn_norm=jnp.ones(hid, dt),
            wq=dense(ks[0], hid, qd),
            wk=dense(ks[1], hid, kvd),
            wv=dense(ks[2], hid, kvd),
            wo=dense(ks[3], qd, hid, residual_scale),
            mlp_norm=jnp.ones(hid, dt),
            w_gate=dense(ks[4], hid, inter),
            w_up=dense(ks[5], hid, inter),
            w_down=dense(ks[6], inter, hid, residual_scale),
        )

    @jax.jit
    def head(key):
        k1, k2, k3 = jax.random.split(key, 3)
        embed = jax.random.normal(k1, (cfg.vocab_size, hid), jnp.float32)
        sigma = jax.random.permutation(k2, cfg.vocab_size)
        # lm_head[:, sigma[x]] = embed[x] / sqrt(H)
        lm_head = (
            jnp.zeros((hid, cfg.vocab_size), dt)
            .at[:, sigma]
            .set((embed.T / np.sqrt(hid)).astype(dt))
        )
        fc = jnp.concatenate(
            [
                jnp.eye(hid, dtype=jnp.float32),
                0.1 * jax.random.normal(k3, (hid, hid), jnp.float32) / np.sqrt(hid),
            ]
        ).astype(dt)
        return embed.astype(dt), lm_head, fc

    keys = jax.random.split(jax.random.PRNGKey(seed), cfg.num_layers + 1)
    embed, lm_head, fc = head(keys[0])
    layers = tuple(layer(k) for k in keys[1:])
    target = LlamaParams(embed=embed, layers=layers, final_norm=jnp.ones(hid, dt), lm_head=lm_head)
    draft = Eagle1Params(fc=fc, fc_bias=None, layer=layers[-1], final_norm=jnp.ones(hid, dt))
    return jax.block_until_ready((target, draft))


def matmul_tflops(n: int = 8192) -> float:
    """Measured bf16 matmul rate (TFLOP/s) on random data, median of 10 after warm-up."""
    if jax.default_backend() != "gpu":
        n = 512
    a = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(2), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    jax.block_until_ready(f(a, b))
    samples = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a, b))
        samples.append(time.perf_counter() - t0)
    return 2 * n**3 / float(np.median(samples)) / 1e12


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _matmul_params(layer) -> int:
    return sum(getattr(layer, k).size for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))


def floors(cfg, target, draft, mode: str, bs: int, bw_tbs: float, tflops: float) -> dict:
    """Floor ms of one decode step: bytes / copy bandwidth vs FLOPs / matmul rate."""
    layers_b = _nbytes(target.layers) + _nbytes(target.final_norm)
    head_b = _nbytes(target.lm_head)
    ctx = PROMPT + NEW // 2  # mean context over the run
    kv_b = bs * ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    target_mm = sum(_matmul_params(lp) for lp in target.layers) + target.lm_head.size
    draft_mm = draft.fc.size + _matmul_params(draft.layer) + target.lm_head.size
    if mode == "greedy":
        num_bytes = layers_b + head_b + kv_b
        flops = 2 * target_mm * bs
    else:
        draft_b = _nbytes(draft.fc) + _nbytes(draft.layer) + head_b
        num_bytes = layers_b + head_b + kv_b + STEPS * draft_b
        flops = 2 * target_mm * bs * DRAFT_TOKENS + STEPS * 2 * draft_mm * bs * TOPK
    mem_ms = num_bytes / (bw_tbs * 1e12) * 1e3
    compute_ms = flops / (tflops * 1e12) * 1e3
    return {
        "floor ms": max(mem_ms, compute_ms),
        "floor kind": "memory" if mem_ms >= compute_ms else "compute",
        "_mem_ms": mem_ms,
        "_compute_ms": compute_ms,
    }


def _classify(op_name: str) -> str:
    if "paged_attention" in op_name:
        return "attention"
    from bench.e2e import _classify as e2e_classify

    return e2e_classify(op_name)


def _device_split(engine, prompts) -> dict[str, float] | None:
    from bench.e2e import _copy, _steady_state

    state, slot_idx, live = _steady_state(engine, prompts, NEW)
    stacked = jax.tree.map(lambda x: x[None], state)
    return profile_split_us(
        engine._step,
        lambda: (engine.params, engine.draft, _copy(stacked), slot_idx[None], live[None]),
        _classify,
    )


def run_config(
    g: Geometry, cfg, target, draft, mode: str, bs: int, attn: str, outputs: dict
) -> dict:
    from jspec.engine.scheduler import Engine
    from jspec.engine.state import make_engine_config

    rng = np.random.default_rng(bs)
    prompt_len = min(PROMPT, cfg.vocab_size)
    prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(bs)]
    ecfg = make_engine_config(
        cfg,
        page_size=PAGE,
        topk=TOPK,
        num_steps=STEPS,
        num_draft_tokens=DRAFT_TOKENS,
        context_len=256,
        max_running_requests=bs,
        max_prompt_len=prompt_len,
        batch_buckets=(bs,),
        prefill_batch=min(bs, 16),
        attention_impl=attn,
    )
    from jspec.models import Eagle1Draft, LlamaTarget

    models = (LlamaTarget(cfg), target) + ((Eagle1Draft(cfg), draft) if mode == "spec" else ())
    engine = Engine(ecfg, *models)
    engine.generate(prompts[:1], 2)  # compile prefill / step / release for the bucket
    out, stats = engine.generate(prompts, NEW)
    steps = max(stats.num_decode_steps, 1)
    tokens = sum(stats.accept_lens) if mode == "spec" else sum(stats.batch_sizes)
    row = {
        "step ms (wall)": stats.decode_s / steps * 1e3,
        "tok/s": tokens / stats.decode_s,
        "accept len": stats.mean_accept_len if mode == "spec" else 1.0,
    }
    outputs[(g.name, mode, bs)] = out
    if mode == "spec" and (g.name, "greedy", bs) in outputs:
        greedy = outputs[(g.name, "greedy", bs)]
        row["same as greedy"] = f"{sum(a == b for a, b in zip(out, greedy))}/{len(out)}"
    split = _device_split(engine, prompts)
    if split is not None:
        total = split["total"]
        row["step ms (device)"] = total / 1e3
        for cls in ("target", "draft", "attention", "bookkeeping"):
            row[f"{cls} ms"] = sum(v for k, v in split.items() if k.startswith(cls)) / 1e3
        row["unattributed ms"] = split.get(UNATTRIBUTED, 0.0) / 1e3
        row["bookkeeping %"] = 100.0 * row["bookkeeping ms"] * 1e3 / total
    del engine
    gc.collect()
    return row


def draw(rows: list[dict], path: str) -> str:
    """PNG of step time vs batch (greedy / spec, wall and device) beside the floors."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(matplotlib missing: no PNG)"
    geos = sorted({r["geometry"] for r in rows})
    fig, axes = plt.subplots(1, len(geos), figsize=(6 * len(geos), 4.5), squeeze=False)
    for ax, geo in zip(axes[0], geos):
        for mode, color in (("greedy", "tab:blue"), ("spec", "tab:orange")):
            sel = sorted(
                (
                    r
                    for r in rows
                    if r["geometry"] == geo and r["mode"] == mode and "step ms (wall)" in r
                ),
                key=lambda r: r["bs"],
            )
            if not sel:
                continue
            bs = [r["bs"] for r in sel]
            ax.plot(bs, [r["step ms (wall)"] for r in sel], "o-", color=color, label=f"{mode} wall")
            if all("step ms (device)" in r for r in sel):
                ax.plot(
                    bs,
                    [r["step ms (device)"] for r in sel],
                    "s--",
                    color=color,
                    label=f"{mode} device",
                )
            ax.plot(bs, [r["floor ms"] for r in sel], ":", color=color, label=f"{mode} floor")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"{geo} ({rows[0].get('precision', '')} precision)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"(PNG: {path})"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny geometry (CPU smoke)")
    parser.add_argument("--geometry", default="8b,1b")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--modes", default="greedy,spec")
    parser.add_argument("--attention-impl", default="auto")
    parser.add_argument("--precision", default="engine", choices=("engine", "default"))
    parser.add_argument("--png", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if args.precision == "default":
        from jspec.models import layers

        layers.precision_for = lambda dtype: None
    geos = ["quick"] if args.quick else [x for x in args.geometry.split(",") if x]
    batches = [1, 2] if args.quick else [int(b) for b in args.batches.split(",")]
    bw, tflops = copy_bandwidth_tbs(), matmul_tflops()
    header = (
        f"real_size on {device_name()}: copy {bw:.2f} TB/s, bf16 matmul {tflops:.0f} "
        f"TFLOP/s; page {PAGE}, topk {TOPK}, steps {STEPS}, {DRAFT_TOKENS} draft tokens, "
        f"prompts {PROMPT}, {NEW} new tokens; attention {args.attention_impl}, "
        f"precision {args.precision}"
    )
    print(header, flush=True)
    rows: list[dict] = []
    outputs: dict = {}
    for name in geos:
        g = GEOMETRIES[name]
        cfg = _model_config(g)
        t0 = time.perf_counter()
        target, draft = make_params(cfg)
        print(
            f"{name}: params {_nbytes(target) / 1e9:.2f} GB made in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        for bs in batches:
            for mode in [m for m in args.modes.split(",") if m]:
                row = {
                    "geometry": name,
                    "mode": mode,
                    "bs": bs,
                    "attn": args.attention_impl,
                    "precision": args.precision,
                }
                row.update(floors(cfg, target, draft, mode, bs, bw, tflops))
                t0 = time.perf_counter()
                try:
                    row.update(
                        run_config(g, cfg, target, draft, mode, bs, args.attention_impl, outputs)
                    )
                    for key in ("device", "wall"):
                        if f"step ms ({key})" in row:
                            row[f"x floor ({key})"] = row[f"step ms ({key})"] / row["floor ms"]
                except Exception as e:  # noqa: BLE001 - report and keep going
                    traceback.print_exc()
                    row["note"] = f"FAILED: {type(e).__name__}: {e}"[:160]
                row["note"] = row.get("note", "") + f" ({time.perf_counter() - t0:.0f} s)"
                rows.append(row)
                print(format_table([row], COLUMNS), flush=True)
                if args.out:  # partial results survive a timeout
                    with open(args.out, "w") as f:
                        f.write(f"{header}\n\n{format_table(rows, COLUMNS)}\n")
        del target, draft
        gc.collect()
    text = f"{header}\n\n{format_table(rows, COLUMNS)}\n"
    if args.png:
        text += "\n" + draw(rows, args.png) + "\n"
    print(text, flush=True)
    if args.out:
        import json

        with open(args.out, "w") as f:
            f.write(text)
        with open(args.out + ".json", "w") as f:  # for drawing elsewhere: draw(rows, path)
            json.dump(rows, f, default=str)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
