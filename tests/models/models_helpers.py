"""Shared pieces of the jspec.models tests: a dense causal attn_fn, tiny HF checkpoints."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

# Tiny Llama geometry: GQA (4 query heads over 2 KV heads), head_dim != hidden / heads.
TINY = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "bos_token_id": 1,
        "eos_token_id": [2, 3]}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def dense_attn_fn(layer, pool, q, k, v):
    """Pool-free causal attention over the T tokens themselves (one sequence), f32 out."""
    del layer
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    kf = jnp.repeat(k.astype(jnp.float32), group, axis=1)
    vf = jnp.repeat(v.astype(jnp.float32), group, axis=1)
    hi = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), kf, precision=hi)
    scores = scores / np.sqrt(head_dim)
    mask = jnp.tril(jnp.ones((num_tokens, num_tokens), bool))
    probs = jax.nn.softmax(jnp.where(mask[None], scores, -jnp.inf), axis=-1)
    return pool, jnp.einsum("hqk,khd->qhd", probs, vf, precision=hi)


def save_hf_llama(directory, *, seed=0, max_shard_size=None, torch_dtype="float32", **overrides):
    """A random ``transformers.LlamaForCausalLM`` saved to ``directory``; returns the model.

    Weights are re-drawn larger than HF's init (std 0.02 would make every logit ~0).
    """
    import torch
    import transformers

    cfg = transformers.LlamaConfig(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[-1]))
    model = model.to(getattr(torch, torch_dtype))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return model


def rewrite_config(directory, fn):
    """Apply ``fn(dict) -> dict`` to ``directory/config.json``."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        raw = json.load(f)
    with open(path, "w") as f:
        json.dump(fn(raw), f)


def hf_logits(model, ids, positions):
    """f32[T, V] transformers logits of one sequence at the given positions."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids)[None], position_ids=torch.tensor(positions)[None])
    return out.logits[0].float().numpy()
