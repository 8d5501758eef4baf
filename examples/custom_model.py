"""Bring your own model: a target and an EAGLE-3-style draft defined here, in plain JAX,
driven through jspec's public step functions, checked lossless (spec tokens == greedy tokens).

The engine sees a model only through ``jspec.engine.protocol``: a frozen (hashable) dataclass
with the pool geometry, ``forward`` over flat tokens calling the injected ``attn_fn`` once per
layer, and ``logits``. The draft here exercises both EAGLE-3 features: it consumes the target's
residual stream captured entering layers ``(0, 1)`` (an aux feature ``[T, 2H]``, fused to
``[T, H]`` by its ``combine_hidden_states``) after prefill and verify, its own hidden ``[T, H]``
inside the draft loop, and it predicts over a smaller draft vocabulary mapped to target ids
(``to_target_ids``: target id = draft id + d2t[id]).

    PYTHONPATH=. python examples/custom_model.py
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec.engine import (
    AttnFn,
    Runner,
    Weights,
    greedy_step,
    init_engine_state,
    make_engine_config,
    prefill,
    release,
    spec_decode_step,
)

HIGHEST = jax.lax.Precision.HIGHEST  # f32 model: exact matmuls keep verify == plain decode


Params = dict[str, Any]  # a model's weights: arrays (and lists / dicts of them)


def _mm(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, precision=HIGHEST)


def _norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


def _attention_layer(
    w: Params,
    layer: int,
    pool: Any,
    x: jax.Array,
    positions: jax.Array,
    attn_fn: AttnFn,
    num_heads: int,
    head_dim: int,
) -> tuple[Any, jax.Array]:
    """q/k/v projections (position added to q and k), jspec's attention, output projection."""
    t = x.shape[0]
    phase = jnp.sin(positions[:, None] * (1.0 + jnp.arange(head_dim)) / head_dim)[:, None, :]
    q = _mm(x, w["wq"]).reshape(t, num_heads, head_dim) + phase
    k = _mm(x, w["wk"]).reshape(t, 1, head_dim) + phase  # one KV head (MQA)
    v = _mm(x, w["wv"]).reshape(t, 1, head_dim)
    pool, out = attn_fn(layer, pool, q, k, v)  # f32[T, heads, D]
    return pool, _mm(out.reshape(t, -1), w["wo"])


@dataclasses.dataclass(frozen=True)
class MyTarget:
    """A 2-layer MQA target whose LM head favours a fixed transition ``sigma``."""

    vocab_size: int = 64
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 16
    dtype: str = "float32"

    def forward(
        self,
        params: Params,
        pool: Any,
        token_ids: jax.Array,
        positions: jax.Array,
        attn_fn: AttnFn,
        *,
        capture_layers: tuple[int, ...] = (),
        tp_axis: str | None = None,
    ) -> tuple[Any, jax.Array, jax.Array | None]:
        del tp_axis
        x = params["embed"][token_ids]
        captured = []
        for layer, w in enumerate(params["layers"]):
            if layer in capture_layers:
                captured.append(x)  # the residual stream ENTERING this layer
            pool, attn = _attention_layer(
                w, layer, pool, _norm(x), positions, attn_fn, self.num_heads, self.head_dim
            )
            x = x + attn
            x = x + _mm(jnp.tanh(_mm(_norm(x), w["w1"])), w["w2"])
        aux = jnp.concatenate(captured, -1) if capture_layers else None
        return pool, _norm(x), aux

    def logits(self, params: Params, hidden: jax.Array) -> jax.Array:
        return _mm(hidden, params["lm_head"]).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class MyDraft:
    """A 1-layer draft over ``draft_vocab`` hot target tokens, fed the target's layer inputs."""

    vocab_size: int = 48  # the draft vocabulary
    hidden_size: int = 32
    num_layers: int = 1
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 16
    dtype: str = "float32"
    capture_layers: tuple[int, ...] = (0, 1)

    def forward(
        self,
        params: Params,
        target_params: Params,
        pool: Any,
        token_ids: jax.Array,
        hidden_in: jax.Array,
        positions: jax.Array,
        attn_fn: AttnFn,
        *,
        tp_axis: str | None = None,
    ) -> tuple[Any, jax.Array]:
        del tp_axis  # hidden_in: [T, H], combined target feature or the previous hidden_out
        x = _mm(jnp.concatenate([target_params["embed"][token_ids], hidden_in], -1), params["w_in"])
        pool, attn = _attention_layer(
            params["layer"], 0, pool, _norm(x), positions, attn_fn, self.num_heads, self.head_dim
        )
        return pool, x + attn

    def combine_hidden_states(self, params: Params, feature: jax.Array) -> jax.Array:
        return _mm(feature, params["fc"])  # the target's aux feature [T, 2H] -> [T, H]

    def logits(self, params: Params, target_params: Params, hidden: jax.Array) -> jax.Array:
        del target_params
        return _mm(_norm(hidden), params["lm_head"]).astype(jnp.float32)

    def to_target_ids(self, params: Params, draft_ids: jax.Array) -> jax.Array:
        d2t: jax.Array = params["d2t"]
        return draft_ids + d2t[draft_ids]


def init_models(seed: int = 0) -> tuple[MyTarget, Params, MyDraft, Params]:
    """Random weights with a predictable transition, so the draft is often right."""
    target, draft = MyTarget(), MyDraft()
    rng = np.random.default_rng(seed)
    h, v, d = target.hidden_size, target.vocab_size, target.head_dim

    def dense(n_in: int, n_out: int, scale: float = 1.0) -> jax.Array:
        return jnp.asarray(rng.standard_normal((n_in, n_out)) * scale / np.sqrt(n_in), jnp.float32)

    def layer(scale: float) -> Params:
        return {
            "wq": dense(h, 2 * d),
            "wk": dense(h, d),
            "wv": dense(h, d),
            "wo": dense(2 * d, h, scale),
            "w1": dense(h, 2 * h),
            "w2": dense(2 * h, h, scale),
        }

    embed = rng.standard_normal((v, h))
    sigma = rng.permutation(v)
    lm_head = np.zeros((h, v))
    lm_head[:, sigma] = embed.T
    tparams = {
        "embed": jnp.asarray(embed, jnp.float32),
        "lm_head": jnp.asarray(lm_head, jnp.float32),
        "layers": [layer(0.3) for _ in range(target.num_layers)],
    }
    hot = np.sort(rng.choice(v, draft.vocab_size, replace=False))  # draft id -> target id
    dparams = {
        "fc": dense(2 * h, h),
        "w_in": jnp.asarray(np.eye(2 * h, h), jnp.float32),
        "layer": layer(0.1),
        "lm_head": jnp.asarray(lm_head[:, hot], jnp.float32),
        "d2t": jnp.asarray(hot - np.arange(draft.vocab_size), jnp.int32),
    }
    return target, tparams, draft, dparams


def run(
    prompts: list[list[int]], max_new_tokens: int, *, spec: bool, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """Generate with the public step functions, one shard, every prompt in its own batch slot.

    Returns:
      (tokens per prompt, accept lengths per spec step).
    """
    target, tparams, my_draft, my_dparams = init_models(seed)
    draft, dparams = (my_draft, my_dparams) if spec else (None, None)
    num = len(prompts)
    ecfg = make_engine_config(
        target,
        page_size=4,
        topk=2,
        num_steps=3,
        num_draft_tokens=6,
        context_len=128,
        max_running_requests=num,
        max_prompt_len=max(map(len, prompts)),
        batch_buckets=(num,),
        prefill_batch=num,
    )
    runner, weights = Runner(ecfg, target, draft), Weights(tparams, dparams)
    state = init_engine_state(runner)
    slots = jnp.arange(num, dtype=jnp.int32)
    ids = np.zeros((num, ecfg.max_prompt_len), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
    state, pre = prefill(runner, weights, state, slots, jnp.asarray(ids), lens)
    assert bool(pre.ok)
    out = [[int(t)] for t in pre.first_tokens]
    live = jnp.ones((num,), bool)
    accept_lens: list[int] = []
    while min(map(len, out)) < max_new_tokens:
        if spec:
            state, spec_out = spec_decode_step(runner, weights, state, slots, live)
            assert bool(spec_out.ok)
            for i in range(num):
                n = int(spec_out.accept_lens[i])
                out[i] += [int(t) for t in spec_out.accept_tokens[i, :n]]
                accept_lens.append(n)
        else:
            state, greedy_out = greedy_step(runner, weights, state, slots, live)
            assert bool(greedy_out.ok)
            for i in range(num):
                out[i].append(int(greedy_out.next_tokens[i]))
    state = release(runner, state, slots, live)
    return [o[:max_new_tokens] for o in out], accept_lens


def main() -> bool:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, MyTarget().vocab_size, n).tolist() for n in (5, 11)]
    greedy, _ = run(prompts, 16, spec=False)
    spec, accept_lens = run(prompts, 16, spec=True)
    print("greedy:", greedy)
    print("spec:  ", spec)
    print(f"mean acceptance length {np.mean(accept_lens):.2f} over {len(accept_lens)} steps")
    lossless = bool(spec == greedy)
    print("lossless:", "PASS" if lossless else "FAIL")
    return lossless


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
