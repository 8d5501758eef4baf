"""Bring your own attention: the spec step driven through an attention backend written here.

A serving stack keeps page tables and lengths; jspec hands every attention pass to a backend in
exactly that form (``jspec.attention_meta.AttentionMetadata``: ``page_table i32[B, C]``,
``kv_lens i32[B]``, the causal flag / ``q_lens`` and, for the tree verify and the draft extend,
a tail of ``N`` slots with its mask). ``PageGatherBackend`` below is such a backend in plain
JAX, sharing no code with jspec's kernels: it views the pool page by page (``[pages, P, Hkv,
D]``), gathers each row's pages, and runs a masked softmax. Plugged in with
``make_engine_config(..., attention_backend=PageGatherBackend())``, the toy target and its
EAGLE-1 head decode speculatively and emit exactly the greedy tokens.

    PYTHONPATH=. python examples/foreign_attention.py
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jspec.attention_meta import AttentionMetadata
from jspec.engine import AttentionBackend, Engine, RunStats, make_engine_config
from jspec.kv import KVPool, set_kv_buffer
from jspec.models import LlamaConfig, LlamaTarget, toy_eagle1, toy_llama_params


@dataclasses.dataclass(frozen=True)
class PageGatherBackend:
    """Attention over the pool read page by page (any hashable object with these two methods
    is a backend: ``jspec.engine.AttentionBackend``)."""

    def write_kv(
        self, pool: KVPool, layer: int, slot_ids: jax.Array, k: jax.Array, v: jax.Array
    ) -> KVPool:
        # The pool is jspec's KVPool here; a stack with its own cache writes its own.
        return set_kv_buffer(pool, layer, slot_ids, k.astype(pool.k.dtype), v.astype(pool.v.dtype))

    def attend(
        self, pool: KVPool, layer: int, q: jax.Array, meta: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array]:
        p = meta.page_size
        bsz, qp, hq, dim = q.shape
        hkv = pool.k.shape[2]
        paged_k = pool.k[layer].reshape(-1, p, hkv, dim)  # [pages, P, Hkv, D]
        paged_v = pool.v[layer].reshape(-1, p, hkv, dim)
        keys = paged_k[meta.page_table].reshape(bsz, -1, hkv, dim)  # [B, C*P, Hkv, D]
        vals = paged_v[meta.page_table].reshape(bsz, -1, hkv, dim)
        pos = jnp.arange(keys.shape[1])
        seen = pos[None, None, :] < meta.kv_lens[:, None, None]  # [B, 1, W]
        if meta.causal:
            q_lens = meta.q_lens if meta.q_lens is not None else jnp.full((bsz,), qp)
            qpos = meta.kv_lens[:, None] - q_lens[:, None] + jnp.arange(qp)[None, :]
            seen = seen & (pos[None, None, :] <= qpos[:, :, None])
        seen = jnp.broadcast_to(seen, (bsz, qp, keys.shape[1]))
        tail_slot_ids, tail_mask = meta.tail_slot_ids, meta.tail_mask  # both or neither
        if tail_slot_ids is not None and tail_mask is not None:
            keys = jnp.concatenate([keys, pool.k[layer][tail_slot_ids]], axis=1)
            vals = jnp.concatenate([vals, pool.v[layer][tail_slot_ids]], axis=1)
            seen = jnp.concatenate([seen, tail_mask], axis=2)
        group = hq // hkv
        keys = jnp.repeat(keys.astype(jnp.float32), group, axis=2)  # [B, W, Hq, D]
        vals = jnp.repeat(vals.astype(jnp.float32), group, axis=2)
        hp = jax.lax.Precision.HIGHEST
        s = jnp.einsum("bqhd,bwhd->bqhw", q.astype(jnp.float32), keys, precision=hp) / dim**0.5
        s = jnp.where(seen[:, :, None, :], s, -jnp.inf)
        any_key = jnp.any(seen, axis=-1)[:, :, None]  # [B, Qp, 1]
        m = jnp.where(any_key, jnp.max(s, axis=-1), 0.0)
        e = jnp.where(seen[:, :, None, :], jnp.exp(s - m[..., None]), 0.0)
        total = jnp.sum(e, axis=-1)
        out = (
            jnp.einsum("bqhw,bwhd->bqhd", e, vals, precision=hp)
            / jnp.where(any_key, total, 1.0)[..., None]
        )
        lse = jnp.where(any_key, m + jnp.log(jnp.where(any_key, total, 1.0)), -jnp.inf)
        return jnp.where(any_key[..., None], out, 0.0), lse


def run(
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    backend: AttentionBackend | None = None,
    spec: bool = True,
) -> tuple[list[list[int]], RunStats]:
    """Tokens of ``prompts`` from the toy target (+ its EAGLE-1 head when ``spec``)."""
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    target = LlamaTarget(cfg)
    params = toy_llama_params(target, 0, residual_scale=1.5)
    draft, dparams = toy_eagle1(target, params, 1, hidden_mix=1.0)
    ecfg = make_engine_config(
        target,
        page_size=4,
        topk=2,
        num_steps=3,
        num_draft_tokens=6,
        context_len=64,
        max_running_requests=2,
        max_prompt_len=max(len(p) for p in prompts),
        attention_backend=backend,
    )
    if spec:
        engine = Engine(ecfg, target, params, draft, dparams)
    else:
        engine = Engine(ecfg, target, params)
    out, stats = engine.generate(prompts, max_new_tokens)
    return out, stats


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, n).tolist() for n in (5, 11)]
    greedy, _ = run(prompts, 12, spec=False)
    spec, stats = run(prompts, 12, backend=PageGatherBackend())
    print("greedy (jspec's attention):   ", greedy)
    print("spec (PageGatherBackend):     ", spec)
    print(f"lossless: {spec == greedy}; mean acceptance {stats.mean_accept_len:.2f}")
