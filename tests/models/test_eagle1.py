"""EAGLE-1 heads from HF files (full and published layouts) vs an independent numpy layer."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from models_helpers import SMALL_CFG, dense_attn_fn

from jspec.models import Eagle1Draft, LlamaTarget, load_draft, toy_llama_params

CFG = SMALL_CFG


def _ids(num_tokens=11, seed=0):
    rng = np.random.default_rng(seed)
    return (
        jnp.asarray(rng.integers(0, CFG.vocab_size, num_tokens), jnp.int32),
        jnp.arange(num_tokens, dtype=jnp.int32) + 3,
    )


@pytest.mark.parametrize("published", [False, True], ids=["full", "no-input-norm-no-norm"])
def test_eagle1_head_from_hf_files(tmp_path, published):
    """An EAGLE-1 directory (``fc`` + ``layers.0.*``) loads; published heads lack the layer's
    input_layernorm and the final norm: identity, logits straight from hidden_out."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(5)
    hid, inter, qd, kvd = 32, 48, 32, 16
    shapes = {
        "fc.weight": (hid, 2 * hid),
        "fc.bias": (hid,),
        "norm.weight": (hid,),
        "layers.0.input_layernorm.weight": (hid,),
        "layers.0.self_attn.q_proj.weight": (qd, hid),
        "layers.0.self_attn.k_proj.weight": (kvd, hid),
        "layers.0.self_attn.v_proj.weight": (kvd, hid),
        "layers.0.self_attn.o_proj.weight": (hid, qd),
        "layers.0.post_attention_layernorm.weight": (hid,),
        "layers.0.mlp.gate_proj.weight": (inter, hid),
        "layers.0.mlp.up_proj.weight": (inter, hid),
        "layers.0.mlp.down_proj.weight": (hid, inter),
    }
    tensors = {
        k: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32) for k, s in shapes.items()
    }
    if published:
        del tensors["norm.weight"], tensors["layers.0.input_layernorm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hid,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 48,
        "rms_norm_eps": CFG.rms_norm_eps,
        "torch_dtype": "float16",  # published heads' files; the head runs in the target's
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    target = LlamaTarget(CFG)
    params = tp = toy_llama_params(target, 3)
    draft, head = load_draft(tmp_path, target)
    assert isinstance(draft, Eagle1Draft) and draft.capture_layers == ()
    assert draft.dtype == target.dtype == "float32" and head.fc.dtype == jnp.float32
    assert (head.final_norm is None) == published and (head.layer.attn_norm is None) == published
    np.testing.assert_array_equal(np.asarray(head.fc), tensors["fc.weight"].T)
    ids, pos = _ids(seed=6)
    hidden_in = jnp.asarray(rng.standard_normal((11, hid)), jnp.float32)
    _, hidden = draft.forward(head, params, None, ids, hidden_in, pos, dense_attn_fn)
    # Oracle: numpy, f64, the input norm written out (identity when absent).
    x = np.concatenate([np.asarray(tp.embed)[np.asarray(ids)], np.asarray(hidden_in)], -1)
    x = x @ tensors["fc.weight"].T + tensors["fc.bias"]
    want = _np_layer(x, tensors, np.asarray(pos))
    np.testing.assert_allclose(np.asarray(hidden), want, rtol=1e-5, atol=1e-5)
    logits = np.asarray(draft.logits(head, params, hidden))
    normed = want if published else _np_rms(want, tensors["norm.weight"])
    np.testing.assert_allclose(logits, normed @ np.asarray(tp.lm_head), rtol=1e-5, atol=1e-5)


def _np_rms(x, w, eps=CFG.rms_norm_eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _np_layer(x, t, pos, heads=4, kv_heads=2, head_dim=8):
    """One Llama layer, prefix ``layers.0.``; RoPE as complex rotation of (i, i + D/2)."""
    w = {k.removeprefix("layers.0."): v.astype(np.float64) for k, v in t.items()}
    num = len(x)
    norm = w.get("input_layernorm.weight")
    h = x if norm is None else _np_rms(x, norm)

    def rope(y):
        half = head_dim // 2
        freqs = 1.0 / CFG.rope_theta ** (np.arange(half) * 2.0 / head_dim)
        z = (y[..., :half] + 1j * y[..., half:]) * np.exp(1j * pos[:, None, None] * freqs)
        return np.concatenate([z.real, z.imag], -1)

    q = rope((h @ w["self_attn.q_proj.weight"].T).reshape(num, heads, head_dim))
    k = rope((h @ w["self_attn.k_proj.weight"].T).reshape(num, kv_heads, head_dim))
    v = (h @ w["self_attn.v_proj.weight"].T).reshape(num, kv_heads, head_dim)
    out = np.zeros_like(q)
    for head in range(heads):
        kv = head // (heads // kv_heads)
        s = np.where(np.tril(np.ones((num, num), bool)), q[:, head] @ k[:, kv].T, -np.inf)
        e = np.exp(s / np.sqrt(head_dim) - (s / np.sqrt(head_dim)).max(-1, keepdims=True))
        out[:, head] = (e / e.sum(-1, keepdims=True)) @ v[:, kv]
    x = x + out.reshape(num, -1) @ w["self_attn.o_proj.weight"].T
    h = _np_rms(x, w["post_attention_layernorm.weight"])
    gate = h @ w["mlp.gate_proj.weight"].T
    return x + (gate / (1 + np.exp(-gate)) * (h @ w["mlp.up_proj.weight"].T)) @ (
        w["mlp.down_proj.weight"].T
    )
