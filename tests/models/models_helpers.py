"""Shared pieces of the jspec.models tests: a dense causal attn_fn, tiny HF checkpoints."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models import LlamaConfig, LlamaTarget

# Tiny Llama geometry: GQA (4 query heads over 2 KV heads), head_dim != hidden / heads.
TINY = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 12,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
}
# A smaller jspec-side config (no checkpoint): GQA 4 over 2 heads x 8, 2 layers.
SMALL_CFG = LlamaConfig(
    vocab_size=48,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


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


# ---- EAGLE-3 heads written by hand (safetensors, HF names) ----------------------------------
TARGET = LlamaTarget(
    LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_layers=8,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
    )
)
DRAFT_VOCAB = 40


def eagle3_config(**overrides):
    raw = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 40,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": 96,
        "draft_vocab_size": DRAFT_VOCAB,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": dict(LLAMA3_ROPE),
        "torch_dtype": "bfloat16",
    }
    raw.update(overrides)
    return raw


def eagle3_tensors(
    seed=0,
    *,
    hid=32,
    inter=40,
    heads=4,
    kv_heads=2,
    head_dim=8,
    draft_vocab=DRAFT_VOCAB,
    vocab=96,
    fc_bias=False,
):
    """Random head weights by HF name, ``nn.Linear`` layout, d2t int64 / t2d bool."""
    rng = np.random.default_rng(seed)

    def lin(out, fan_in):
        return (rng.standard_normal((out, fan_in)) / np.sqrt(fan_in)).astype(np.float32)

    def norm():
        return (1.0 + 0.1 * rng.standard_normal(hid)).astype(np.float32)

    hot = np.sort(rng.choice(vocab, draft_vocab, replace=False))
    t2d = np.zeros(vocab, bool)
    t2d[hot] = True
    out = {
        "fc.weight": lin(hid, 3 * hid),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": lin(heads * head_dim, 2 * hid),
        "midlayer.self_attn.k_proj.weight": lin(kv_heads * head_dim, 2 * hid),
        "midlayer.self_attn.v_proj.weight": lin(kv_heads * head_dim, 2 * hid),
        "midlayer.self_attn.o_proj.weight": lin(hid, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": lin(inter, hid),
        "midlayer.mlp.up_proj.weight": lin(inter, hid),
        "midlayer.mlp.down_proj.weight": lin(hid, inter),
        "norm.weight": norm(),
        "lm_head.weight": lin(draft_vocab, hid),
        "d2t": (hot - np.arange(draft_vocab)).astype(np.int64),
        "t2d": t2d,
    }
    if fc_bias:
        out["fc.bias"] = (0.1 * rng.standard_normal(hid)).astype(np.float32)
    return out


def write_head(directory, tensors, config):
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory
