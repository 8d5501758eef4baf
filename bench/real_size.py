# Over 400 lines: one report (geometry, on-device weights, floors, runs, device split, picture)
# for issue 13; each part feeds the one table.
"""Real-size speed (issue 13): an 8B (and 1B) Llama geometry, greedy vs spec, against floors.

    python -m bench.real_size [--quick] [--geometry 8b,1b] [--batches 1,16,64]
                              [--modes greedy,spec,spec-t1] [--attention-impl auto|triton|xla]
                              [--png step_vs_batch.png] [--out real_size.md]

Modes: ``greedy`` / ``spec`` (temperature 0), and sampled runs of either engine named
``<engine>-t<T>[-p<top_p>][-k<top_k>]``, e.g. ``spec-t1``, ``greedy-t1``, ``spec-t0.6-p0.9``
(request i seeded i). For a sampled mode, ``sampling ms`` is the device time of the ops under
``jspec.engine.sampling.SAMPLING_SCOPE`` (processing, coins, the walk / draw), ``sampling %``
its share of the step's device time, and ``vs T0 device %`` the step's device time against the
same engine's temperature-0 row at that batch size (the budget: <= 5% at bs 1 and 64).

The target is a ``jspec.models.LlamaTarget`` with random bf16 weights made on the device
(``jax.random``; :func:`make_params`: ``toy_llama_params``'s permutation LM head, so greedy
follows a known chain) and the draft an EAGLE-3 head built like ``matched_eagle3`` (hot vocab
of 32000 ids, closed under the permutation), so acceptance is high. Matmul precision follows
the dtype (bf16: default precision, bf16 LM-head result upcast after). Prompts of 128 tokens
from the hot ids, 64 new tokens, page 16, topk 4, steps 3, 8 draft tokens. Per (mode, batch):

* ``step ms (wall)``: the engine's decode-step wall time in ``Engine.generate`` (host loop
  included, XLA's default command buffers), median over the run's steps (``wall mean``: the
  mean, which a slow first step weighs on: 16 spec steps per run); ``step ms (device)``: the summed GPU kernel time
  of one steady-state step from a profiler trace (``bench._timing.profile_split_us``) of the
  same step compiled with command buffers OFF (``split cmd buffers``: "off"), so every kernel
  is attributed: target / draft / attention (ops under ``paged_attention``, inside either) /
  bookkeeping / unattributed.
* ``step ms (jit)``: the jitted step alone on that steady state (median wall, blocked each
  call, a fresh copy of the state each call): wall - jit = the host loop's share, jit - device
  = dispatch and launch gaps. ``step ms (jit chained)``: the same step fed its own donated
  output state (the loop a caller of the single-step API writes: the state's buffers keep their
  addresses, which a command buffer holding the Triton launches can replay without updating).
* floors measured in the same run: weight bytes read per step / the measured copy bandwidth
  (greedy: target layers + LM head; spec: that + ``steps`` draft forwards of midlayer + hot
  LM head, + fc once) plus the KV bytes at the mean context; FLOPs / the measured bf16 matmul
  rate; ``floor`` = the larger; ``x floor`` = device (and wall) / floor.
* tokens/s (decode), acceptance, and for spec how many requests' tokens equal greedy's.

Engine API used: ``jspec.engine.state.make_engine_config``, ``jspec.engine.scheduler.Engine``
(``generate``, ``_step_for``, and bench.e2e's ``_steady_state`` / ``admit_all``: ``_admit``,
``_prefill_round``, ``_decode_step``, ``_bucket_arrays``, ``_shard_state``), ``RunStats`` fields.
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
    matmul_tflops,
    profile_split_us,
    write_with_json,
)
from jspec.engine.scheduler import DEFAULT_MAX_ROUNDS

COLUMNS = (
    "geometry",
    "mode",
    "bs",
    "sampling",
    "attn",
    "precision",
    "step ms (wall)",
    "step ms (wall mean)",
    "step ms (jit)",
    "step ms (jit chained)",
    "step ms (device)",
    "floor ms",
    "floor kind",
    "x floor (device)",
    "x floor (wall)",
    "tok/s",
    "accept len",
    "plain rounds %",
    "same as greedy",
    "target ms",
    "draft ms",
    "attention ms",
    "bookkeeping ms",
    "unattributed ms",
    "bookkeeping %",
    "sampling ms",
    "sampling %",
    "vs T0 device %",
    "split cmd buffers",
    "note",
)
PAGE, TOPK, STEPS, DRAFT_TOKENS, PROMPT, NEW = 16, 4, 3, 8, 128, 64
CAPACITY = (256, None)  # the engine's (context_len, num_pages): --context, --num-pages
KV_LEN_BUCKETS = None  # --no-kv-len-hints: () (every step planned for the width)
RMS_NORM_IMPL = "auto"  # --rms-norm-impl: the engine's RMSNorm kernel (make_engine_config)
PROFILE_COPY_BYTES = 12 << 30  # state copies made ahead of a profiled run (_device_split)


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
    draft_vocab: int  # the EAGLE-3 head's hot vocabulary (ids [0, draft_vocab))
    draft_heads: int  # the head's attention heads (no GQA: the matched head needs v = e - h)


GEOMETRIES = {
    "8b": Geometry("8b", 128256, 4096, 32, 32, 8, 128, 14336, 32000, 32),
    "1b": Geometry("1b", 128256, 2048, 16, 32, 8, 64, 8192, 32000, 32),
    "quick": Geometry("quick", 512, 64, 8, 4, 2, 16, 128, 128, 4),
}


def make_target(g: Geometry):
    """The geometry as a ``jspec.models.LlamaTarget`` (bf16, Llama-3 RoPE base)."""
    from jspec.models import LlamaConfig, LlamaTarget

    return LlamaTarget(
        LlamaConfig(
            vocab_size=g.vocab,
            hidden_size=g.hidden,
            intermediate_size=g.inter,
            num_layers=g.layers,
            num_heads=g.heads,
            num_kv_heads=g.kv_heads,
            head_dim=g.head_dim,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            dtype="bfloat16",
        )
    )


def make_params(g: Geometry, target, seed: int = 0, residual_scale: float = 0.5):
    """Target and EAGLE-3 draft params made on the device (bf16), accepting well.

    Target: ``jspec.models.synthetic.toy_llama_params``'s structure (the permutation LM head
    ``lm_head[:, sigma(x)] = embed[x] / sqrt(H)``, residuals scaled by ``residual_scale``) with
    ``sigma`` mapping the hot ids ``[0, draft_vocab)`` onto themselves, so a chain started there
    stays in the head's vocabulary. Draft: ``matched_eagle3``'s construction (q = k = focus * e,
    v = e - h_hat, o = gain * I, fc = 0, no MLP output), ``draft_heads`` heads, the target's
    MLP width, ``lm_head`` = the target's on the hot ids, ``d2t = 0``.

    Returns:
      (target_params, draft_model, draft_params), ready on the device.
    """
    from jspec.models import Eagle3Config, Eagle3Draft, Eagle3Params, LayerParams, LlamaParams

    dt = jnp.bfloat16
    hid, inter, vocab, hot = g.hidden, g.inter, g.vocab, g.draft_vocab
    qd, kvd = g.heads * g.head_dim, g.kv_heads * g.head_dim

    def dense(k, fan_in, fan_out, scale=1.0):
        w = jax.random.normal(k, (fan_in, fan_out), jnp.float32) * (scale / np.sqrt(fan_in))
        return w.astype(dt)

    @jax.jit
    def layer(key):
        ks = jax.random.split(key, 7)
        return LayerParams.from_projections(
            attn_norm=jnp.ones(hid, dt),
            wq=dense(ks[0], hid, qd),
            wk=dense(ks[1], hid, kvd),
            wv=dense(ks[2], hid, kvd),
            wo=dense(ks[3], qd, hid, residual_scale),
            mlp_norm=jnp.ones(hid, dt),
            w_gate=dense(ks[4], hid, inter),
            w_up=dense(ks[5], hid, inter),
            w_down=dense(ks[6], inter, hid, residual_scale),
            head_dim=g.head_dim,
        )

    @jax.jit
    def head(key):
        k1, k2, k3 = jax.random.split(key, 3)
        embed = jax.random.normal(k1, (vocab, hid), jnp.float32)
        sigma = jnp.concatenate(
            [jax.random.permutation(k2, hot), hot + jax.random.permutation(k3, vocab - hot)]
        )
        lm_head = jnp.zeros((hid, vocab), dt).at[:, sigma].set((embed.T / np.sqrt(hid)).astype(dt))
        return embed.astype(dt), lm_head

    @jax.jit
    def draft_params(key, lm_head):
        eye, zero = jnp.eye(hid, dtype=dt), jnp.zeros((hid, hid), dt)
        k1, k2 = jax.random.split(key)
        focus, gain = 3.0, 4.0
        mid = LayerParams.from_projections(
            attn_norm=jnp.ones(hid, dt),
            wq=(focus * jnp.concatenate([eye, zero])).astype(dt),
            wk=(focus * jnp.concatenate([eye, zero])).astype(dt),
            wv=jnp.concatenate([eye, -eye]),
            wo=(gain * eye).astype(dt),
            mlp_norm=jnp.ones(hid, dt),
            w_gate=dense(k1, hid, inter),
            w_up=dense(k2, hid, inter),
            w_down=jnp.zeros((inter, hid), dt),
            head_dim=hid // g.draft_heads,
        )
        return Eagle3Params(
            fc=jnp.zeros((3 * hid, hid), dt),
            fc_bias=None,
            hidden_norm=jnp.ones(hid, dt),
            layer=mid,
            final_norm=jnp.ones(hid, dt),
            lm_head=lm_head[:, :hot],
            d2t=jnp.zeros(hot, jnp.int32),
        )

    keys = jax.random.split(jax.random.PRNGKey(seed), g.layers + 2)
    embed, lm_head = head(keys[0])
    layers = tuple(layer(k) for k in keys[2:])
    params = LlamaParams(embed=embed, layers=layers, final_norm=jnp.ones(hid, dt), lm_head=lm_head)
    n = g.layers
    draft = Eagle3Draft(
        Eagle3Config(
            hidden_size=hid,
            intermediate_size=inter,
            num_heads=g.draft_heads,
            num_kv_heads=g.draft_heads,
            head_dim=hid // g.draft_heads,
            vocab_size=vocab,
            draft_vocab_size=hot,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            dtype="bfloat16",
        ),
        (2, n // 2, n - 3),
    )
    dparams = draft_params(keys[1], lm_head)
    return jax.block_until_ready((params, draft, dparams))


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _matmul_params(layer) -> int:
    return sum(getattr(layer, k).size for k in ("wqkv", "wo", "w_gate_up", "w_down"))


def floors(g: Geometry, params, dparams, mode: str, bs: int, bw_tbs: float, tflops: float) -> dict:
    """Floor ms of one decode step: bytes / copy bandwidth vs FLOPs / matmul rate.

    Greedy reads the target layers + LM head once; spec reads them once (verify of N tokens)
    plus ``STEPS`` draft forwards (``STEPS - 1`` in the draft loop, 1 draft extend) of the
    midlayer + the head's LM head, and ``fc`` once; both read the KV at the mean context.
    """
    layers_b = _nbytes(params.layers) + _nbytes(params.final_norm)
    head_b = _nbytes(params.lm_head)
    ctx = PROMPT + NEW // 2  # mean context over the run
    kv_b = bs * ctx * g.layers * 2 * g.kv_heads * g.head_dim * 2
    target_mm = sum(_matmul_params(lp) for lp in params.layers) + params.lm_head.size
    if mode == "greedy":
        num_bytes = layers_b + head_b + kv_b
        flops = 2 * target_mm * bs
    else:
        dlayer_mm = _matmul_params(dparams.layer) + dparams.lm_head.size
        draft_b = _nbytes(dparams.layer) + _nbytes(dparams.lm_head)
        num_bytes = layers_b + head_b + kv_b + STEPS * draft_b + _nbytes(dparams.fc)
        flops = 2 * target_mm * bs * DRAFT_TOKENS
        flops += 2 * dlayer_mm * bs * (TOPK * (STEPS - 1) + DRAFT_TOKENS)
        flops += 2 * dparams.fc.size * bs * DRAFT_TOKENS
    mem_ms = num_bytes / (bw_tbs * 1e12) * 1e3
    compute_ms = flops / (tflops * 1e12) * 1e3
    return {
        "floor ms": max(mem_ms, compute_ms),
        "floor kind": "memory" if mem_ms >= compute_ms else "compute",
        "_mem_ms": mem_ms,
        "_compute_ms": compute_ms,
    }


def _classify(op_name: str) -> str:
    from jspec.engine.sampling import SAMPLING_SCOPE

    if SAMPLING_SCOPE in op_name.split("/"):
        return "sampling"
    if "paged_attention" in op_name:
        return "attention"
    if op_name.startswith("@gemm_fusion"):
        # NOTE (H200, 8B greedy bs=1): XLA's one-row Triton GEMM fusions carry no op_name
        # (``@gemm_fusion_dot.N``, ~29 us each = an MLP matrix at ~4 TB/s); the bookkeeping has
        # no such matmuls, so they are the model's (the target's in a greedy step).
        return "target"
    from bench.e2e import _classify as e2e_classify

    return e2e_classify(op_name)


# The device split is compiled with XLA's command buffers off (kernels inside a CUDA graph are
# not attributed to their HLO ops by the profiler); the engine's own timed run keeps them on.
SPLIT_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": ""}


def _sampled_steady_state(engine, prompts, sampling):
    """bench.e2e's ``_steady_state`` with sampled requests: (state, slot_idx, live, the
    bucket's SamplingBatch with its shard axis) of shard 0."""
    from bench.e2e import admit_all
    from jspec.engine.scheduler import RunStats

    loop = admit_all(engine, prompts, NEW, sampling=sampling)
    stats = RunStats(mode=engine.mode)
    for _ in range(2):
        engine._decode_step(loop, stats)
    running = loop.running
    slot_idx, live, order = engine._bucket_arrays(running)
    batch = engine._sampling_batch([[running[0][s] for s in order[0]]], slot_idx.shape[-1])
    batch = jax.tree.map(jnp.asarray, batch)
    return engine._shard_state(0), jnp.asarray(slot_idx[0]), jnp.asarray(live[0]), batch


# Steps a chained timing runs from the steady state: steady_max_len leaves one dispatch of
# STEADY_ROUNDS rounds of room in the step's launch hint.
CHAIN_STEPS = 8


def _chained_median_ms(fn, make_args, steps: int = CHAIN_STEPS) -> float:
    """Median wall ms of ``fn`` fed its own donated output state, blocked each call (the first
    call, which may update a command buffer for new addresses, left out)."""
    weights, state, *rest = make_args()
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, out = fn(weights, state, *rest)
        jax.block_until_ready((state, out))
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples[1:])) * 1e3


def _device_split(
    engine, prompts, sampling=None
) -> tuple[dict[str, float] | None, str, float, float]:
    """(device split of one steady-state step, its command-buffer setting, the jitted step's
    median wall ms alone: dispatch + launch gaps, no host loop, fresh state copies / chained);
    ``sampling``: one ``SamplingParams`` per prompt (a sampled step) or None."""
    from bench.e2e import _copy, _median_ms, _op_key, _steady_state, steady_max_len

    extra = ()
    if sampling is None:
        state, slot_idx, live = _steady_state(engine, prompts, NEW)
    else:
        state, slot_idx, live, batch = _sampled_steady_state(engine, prompts, sampling)
        extra = (batch,)
    stacked = jax.tree.map(lambda x: x[None], state)
    step = engine._step_for(int(slot_idx.shape[-1]), steady_max_len(engine, prompts))

    def make_args():
        return (engine.weights, _copy(stacked), slot_idx[None], live[None]) + extra

    jit_ms = _median_ms(step, make_args, 10)
    chained_ms = _chained_median_ms(step, make_args)
    # The profiled calls' state copies are all made before the trace: as many as fit in
    # PROFILE_COPY_BYTES (a long-context engine's pools are tens of GiB).
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(stacked))
    num_calls = int(max(1, min(5, PROFILE_COPY_BYTES // max(state_bytes, 1))))
    try:
        split = profile_split_us(
            step,
            make_args,
            _classify,
            num_calls=num_calls,
            warmup=1,
            compiler_options=SPLIT_COMPILER_OPTIONS,
            breakdown=_op_key,
        )
        if split is not None:  # the largest non-model ops, in the log
            ops = sorted(
                ((v, k[3:]) for k, v in split.items() if k.startswith("by:") and "model:" not in k),
                reverse=True,
            )
            print("  top non-model ops (us):", [(k, round(v, 1)) for v, k in ops[:5]], flush=True)
        return split, "off", jit_ms, chained_ms
    except Exception as e:  # noqa: BLE001 - an XLA that rejects the option: split as compiled
        print(f"split with command buffers off failed ({type(e).__name__}: {e})", flush=True)
        return (
            profile_split_us(step, make_args, _classify, num_calls=num_calls, warmup=1),
            "default",
            jit_ms,
            chained_ms,
        )


def parse_mode(mode: str):
    """``"spec-t1-p0.9"`` -> ``("spec", SamplingParams(temperature=1, top_p=0.9))``;
    ``"greedy"`` / ``"spec"`` -> (mode, None)."""
    from jspec.engine.sampling_params import SamplingParams

    base, *knobs = mode.split("-")
    if base not in ("greedy", "spec"):
        raise ValueError(f"mode {mode!r}: the engine must be greedy or spec")
    if not knobs:
        return base, None
    names = {"t": "temperature", "p": "top_p", "k": "top_k", "m": "min_p"}
    values = {names[k[0]]: (int if k[0] == "k" else float)(k[1:]) for k in knobs}
    return base, SamplingParams(**values)


def sampling_label(sampling) -> str:
    if sampling is None:
        return "T0"
    from jspec.apps._cli import describe_sampling

    return describe_sampling(sampling).rsplit(", seed", 1)[0].replace(" ", "")


def make_engine(
    g: Geometry,
    target,
    params,
    draft,
    dparams,
    mode: str,
    batches,
    attn: str,
    *,
    num_devices: int = 1,
    tensor_parallel: int = 1,
    adaptive: bool = False,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
):
    """One engine per mode over every batch bucket (one prefill compile, steps per bucket);
    ``batches`` are per data-parallel shard, each of ``tensor_parallel`` devices;
    ``max_rounds``: decode rounds per dispatch (``Engine``'s)."""
    from jspec.engine.scheduler import Engine
    from jspec.engine.state import make_engine_config

    top = max(batches)
    ecfg = make_engine_config(
        target,
        page_size=PAGE,
        topk=TOPK,
        num_steps=STEPS,
        num_draft_tokens=DRAFT_TOKENS,
        context_len=max(CAPACITY[0], PROMPT + NEW + 2 * PAGE),  # --context, --new
        num_pages=CAPACITY[1],
        max_running_requests=top,
        max_prompt_len=min(PROMPT, g.vocab),
        batch_buckets=tuple(sorted(set(batches))),
        prefill_batch=min(top, 16),
        attention_impl=attn,
        tensor_parallel=tensor_parallel,
        kv_len_buckets=KV_LEN_BUCKETS,
        rms_norm_impl=RMS_NORM_IMPL,
    )
    if mode == "spec":
        return Engine(
            ecfg,
            target,
            params,
            draft,
            dparams,
            num_devices=num_devices,
            adaptive=adaptive,
            max_rounds=max_rounds,
        )
    return Engine(ecfg, target, params, num_devices=num_devices, max_rounds=max_rounds)


def _reset(engine) -> None:
    """A fresh engine state (all pages and rows free): ``_steady_state`` admits without
    releasing."""
    engine.reset()


def run_config(g: Geometry, engine, mode: str, bs: int, outputs: dict, sampling=None) -> dict:
    rng = np.random.default_rng(bs)
    prompt_len = min(PROMPT, g.vocab)
    # Prompts from the draft's hot ids: the permutation keeps the chain there.
    prompts = [rng.integers(0, g.draft_vocab, prompt_len).tolist() for _ in range(bs)]
    per_request = None
    if sampling is not None:  # request i seeded i: the same tokens on every run
        per_request = [dataclasses.replace(sampling, seed=i) for i in range(bs)]
    # Compile this bucket's step / release (prefill: first call).
    engine.generate(prompts, 2, sampling=per_request)
    out, stats = engine.generate(prompts, NEW, sampling=per_request)
    steps = max(stats.num_decode_steps, 1)
    tokens = stats.num_tokens - stats.num_requests  # decoded (the first token is prefill's)
    row = {
        "step ms (wall)": float(np.median(stats.step_s)) * 1e3,
        "step ms (wall mean)": stats.decode_s / steps * 1e3,
        "tok/s": tokens / stats.decode_s,
        "accept len": stats.mean_accept_len if mode == "spec" else 1.0,
    }
    if stats.policy:  # adaptive speculation: the share of rounds decoded plainly (draft or not)
        total = sum(n for _, n in stats.policy)
        plain = sum(n for k, n in stats.policy if k in ("plain", "greedy"))
        row["plain rounds %"] = 100.0 * plain / total
    outputs[(g.name, mode if sampling is None else f"{mode}~{sampling}", bs)] = out
    if mode == "spec" and sampling is None and (g.name, "greedy", bs) in outputs:
        greedy = outputs[(g.name, "greedy", bs)]
        row["same as greedy"] = f"{sum(a == b for a, b in zip(out, greedy))}/{len(out)}"
    split, cmd, row["step ms (jit)"], row["step ms (jit chained)"] = _device_split(
        engine, prompts, per_request
    )
    _reset(engine)  # the split's steady state left this batch's requests admitted
    if split is not None:
        total = split["total"]
        row["step ms (device)"] = total / 1e3
        for cls in ("target", "draft", "attention", "bookkeeping"):
            row[f"{cls} ms"] = sum(v for k, v in split.items() if k.startswith(cls)) / 1e3
        row["unattributed ms"] = split.get(UNATTRIBUTED, 0.0) / 1e3
        row["bookkeeping %"] = 100.0 * row["bookkeeping ms"] * 1e3 / total
        if sampling is not None:
            row["sampling ms"] = split.get("sampling", 0.0) / 1e3
            row["sampling %"] = 100.0 * split.get("sampling", 0.0) / total
        row["split cmd buffers"] = cmd
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


def _write(path: str, header: str, rows: list[dict], text: str = "") -> None:
    """The table (and rows as JSON beside it, for drawing elsewhere: ``draw(rows, png)``)."""
    text = text or f"{header}\n\n{format_table(rows, COLUMNS)}\n"
    write_with_json(path, text, {"header": header, "rows": rows})


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny geometry (CPU smoke)")
    parser.add_argument("--geometry", default="8b,1b")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument(
        "--modes",
        default="greedy,spec,spec-t1",
        help="greedy, spec, and sampled <engine>-t<T>[-p<top_p>][-k<top_k>] (e.g. spec-t1)",
    )
    parser.add_argument("--attention-impl", default="auto")
    parser.add_argument(
        "--rms-norm-impl", default="auto", help="the engine's RMSNorm kernel: auto | xla | triton"
    )
    parser.add_argument(
        "--draft",
        choices=("matched", "shuffled"),
        default="matched",
        help="shuffled: the head's LM-head columns permuted, a head that does not match the "
        "target (acceptance ~1: adaptive speculation decodes plainly)",
    )
    parser.add_argument("--new", type=int, default=64, help="new tokens per request")
    parser.add_argument(
        "--adaptive", action="store_true", help="spec engines with Engine(adaptive=True)"
    )
    parser.add_argument(
        "--context", type=int, default=256, help="the engine's context_len (capacity)"
    )
    parser.add_argument(
        "--num-pages", type=int, default=None, help="KV pool pages (default: the worst case)"
    )
    parser.add_argument(
        "--no-kv-len-hints",
        action="store_true",
        help="kv_len_buckets=(): every step's attention planned for the engine's context",
    )
    parser.add_argument(
        "--max-rounds",
        type=int,
        default=DEFAULT_MAX_ROUNDS,
        help="decode rounds per dispatch (Engine's)",
    )
    parser.add_argument("--png", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    globals()["NEW"] = args.new  # the module's NEW is read by its helpers
    globals()["CAPACITY"] = (args.context, args.num_pages)
    globals()["KV_LEN_BUCKETS"] = () if args.no_kv_len_hints else None
    globals()["RMS_NORM_IMPL"] = args.rms_norm_impl
    geos = ["quick"] if args.quick else [x for x in args.geometry.split(",") if x]
    batches = [1, 2] if args.quick else [int(b) for b in args.batches.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    parsed = {m: parse_mode(m) for m in modes}  # a bad mode fails before anything runs
    bw, tflops = copy_bandwidth_tbs(), matmul_tflops()
    header = (
        f"real_size on {device_name()}: copy {bw:.2f} TB/s, bf16 matmul {tflops:.0f} "
        f"TFLOP/s; page {PAGE}, topk {TOPK}, steps {STEPS}, {DRAFT_TOKENS} draft tokens, "
        f"prompts {PROMPT}, {NEW} new tokens; engine context {CAPACITY[0]}, pages {CAPACITY[1]}, "
        f"launch hints {'off' if args.no_kv_len_hints else 'auto'}; "
        f"{args.max_rounds} rounds per dispatch; "
        f"attention {args.attention_impl}; rms_norm {args.rms_norm_impl}; "
        f"draft head {args.draft}; "
        "LlamaTarget + matched EAGLE-3 head, bf16 (precision by dtype)"
    )
    print(header, flush=True)
    rows: list[dict] = []
    outputs: dict = {}
    for name in geos:
        g = GEOMETRIES[name]
        target = make_target(g)
        t0 = time.perf_counter()
        params, draft, dparams = make_params(g, target)
        if args.draft == "shuffled":  # a head that does not match: its LM head permuted
            perm = jax.random.permutation(jax.random.PRNGKey(7), dparams.lm_head.shape[1])
            dparams = dataclasses.replace(dparams, lm_head=dparams.lm_head[:, perm])
        print(
            f"{name}: target {_nbytes(params) / 1e9:.2f} GB, draft {_nbytes(dparams) / 1e9:.2f}"
            f" GB made in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        engines = {
            base: make_engine(
                g,
                target,
                params,
                draft,
                dparams,
                base,
                batches,
                args.attention_impl,
                adaptive=args.adaptive,
                max_rounds=args.max_rounds,
            )
            for base in sorted({base for base, _ in parsed.values()})
        }
        for engine in engines.values():  # every bucket's prefill / rounds (plain too) / release
            engine.warmup()
        for bs in batches:
            for mode in modes:
                base, sampling = parsed[mode]
                row = {
                    "geometry": name,
                    "mode": mode,
                    "bs": bs,
                    "sampling": sampling_label(sampling),
                    "attn": args.attention_impl,
                    "precision": "by dtype",
                }
                row.update(floors(g, params, dparams, base, bs, bw, tflops))
                t0 = time.perf_counter()
                try:
                    row.update(run_config(g, engines[base], base, bs, outputs, sampling))
                    t0_row = next(
                        (
                            r
                            for r in rows
                            if (r["geometry"], r["mode"], r["bs"]) == (name, base, bs)
                        ),
                        None,
                    )
                    if sampling is not None and t0_row and "step ms (device)" in t0_row:
                        if "step ms (device)" in row:
                            ratio = row["step ms (device)"] / t0_row["step ms (device)"]
                            row["vs T0 device %"] = 100.0 * (ratio - 1.0)
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
                    _write(args.out, header, rows)
        del engines, params, dparams
        gc.collect()
    text = f"{header}\n\n{format_table(rows, COLUMNS)}\n"
    if args.png:
        text += "\n" + draw(rows, args.png) + "\n"
    print(text, flush=True)
    if args.out:
        _write(args.out, header, rows, text)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
