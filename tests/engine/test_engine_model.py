"""Model pieces vs independent numpy code; weight files; config validation."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.engine.model import (
    ModelConfig,
    ToyTarget,
    apply_rope,
    draft_forward,
    init_draft_params,
    init_target_params,
    rms_norm,
    target_forward,
    target_logits,
)
from jspec.engine.reference import _dense_attn_fn, dense_greedy_generate
from jspec.engine.weights import load_draft, load_target, read_tensors, save_weights

CFG = ModelConfig(
    vocab_size=48,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


# ---- independent numpy model -----------------------------------------------------------------
def _np_rms(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _np_rope(x, pos, theta=10000.0):
    # Complex-number form of RoPE on (i, i + D/2) pairs: independent of the rotate_half code.
    half = x.shape[-1] // 2
    freqs = 1.0 / theta ** (np.arange(half) * 2.0 / x.shape[-1])
    z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * pos[:, None, None] * freqs)
    return np.concatenate([z.real, z.imag], -1)


def _np_forward(cfg, params, tokens):
    p = {
        k: np.asarray(v, np.float64)
        for k, v in {"embed": params.embed, "lm": params.lm_head, "fn": params.final_norm}.items()
    }
    t = len(tokens)
    pos = np.arange(t, dtype=np.float64)
    x = p["embed"][tokens]
    g = cfg.num_heads // cfg.num_kv_heads
    for lp in params.layers:
        w = {
            k: np.asarray(getattr(lp, k), np.float64)
            for k in ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
        }
        h = _np_rms(x, w["attn_norm"])
        q = _np_rope((h @ w["wq"]).reshape(t, cfg.num_heads, -1), pos)
        k = _np_rope((h @ w["wk"]).reshape(t, cfg.num_kv_heads, -1), pos)
        v = (h @ w["wv"]).reshape(t, cfg.num_kv_heads, -1)
        out = np.zeros_like(q)
        for head in range(cfg.num_heads):
            kv = head // g
            s = q[:, head] @ k[:, kv].T / np.sqrt(cfg.head_dim)
            s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
            e = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (e / e.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + out.reshape(t, -1) @ w["wo"]
        h = _np_rms(x, w["mlp_norm"])
        gate = h @ w["w_gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w["w_up"])) @ w["w_down"]
    return _np_rms(x, p["fn"]) @ p["lm"]


def test_target_forward_matches_numpy():
    params = init_target_params(CFG, 3, residual_scale=1.0)
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, 11)
    width = 16
    ids = np.zeros(width, np.int32)
    ids[:11] = tokens
    _, hidden = target_forward(
        CFG, params, None, jnp.asarray(ids), jnp.arange(width, dtype=jnp.int32), _dense_attn_fn(11)
    )
    got = np.asarray(target_logits(params, hidden))[:11]
    np.testing.assert_allclose(got, _np_forward(CFG, params, tokens), rtol=2e-4, atol=2e-4)


def test_rope_relative_and_matches_complex_form():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 3, 8)).astype(np.float32)
    pos = np.array([0, 3, 7, 100, 4095])
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos, jnp.int32), 10000.0))
    np.testing.assert_allclose(
        got, _np_rope(x.astype(np.float64), pos.astype(np.float64)), rtol=1e-4, atol=1e-4
    )
    # q.k depends only on the position difference.
    q, k = rng.standard_normal((2, 1, 1, 8)).astype(np.float32)

    def dot(pq, pk):
        rq = apply_rope(jnp.asarray(q), jnp.asarray([pq], jnp.int32), 10000.0)
        rk = apply_rope(jnp.asarray(k), jnp.asarray([pk], jnp.int32), 10000.0)
        return float(jnp.sum(rq * rk))

    assert dot(5, 2) == pytest.approx(dot(45, 42), rel=1e-4, abs=1e-5)


def test_rms_norm():
    x = np.random.default_rng(2).standard_normal((3, 16)).astype(np.float32)
    w = np.linspace(0.5, 1.5, 16).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6)),
        _np_rms(x, w),
        rtol=1e-5,
        atol=1e-6,
    )


def test_default_draft_predicts_the_dominant_transition():
    params = init_target_params(CFG, 0)
    draft = init_draft_params(CFG, params)
    tokens = jnp.arange(CFG.vocab_size, dtype=jnp.int32)
    # Target's context-free transition vs the draft's prediction from the same token.
    _, th = target_forward(
        CFG,
        params,
        None,
        tokens,
        jnp.zeros_like(tokens),
        lambda layer, pool, q, k, v: (pool, jnp.repeat(v, 2, axis=1)),
    )
    _, dh = draft_forward(
        CFG,
        draft,
        params,
        None,
        tokens,
        th,
        jnp.zeros_like(tokens),
        lambda layer, pool, q, k, v: (pool, jnp.repeat(v, 2, axis=1)),
    )
    from jspec.engine.model import draft_logits

    trans = np.argmax(np.asarray(target_logits(params, params.embed)), -1)
    pred = np.argmax(np.asarray(draft_logits(CFG, draft, params, dh)), -1)
    assert np.mean(pred == trans) > 0.8


def test_model_config_validation():
    with pytest.raises(ValueError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
        ModelConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="head_dim=7 must be even"):
        ModelConfig(head_dim=7)
    with pytest.raises(ValueError, match="dtype='int8'"):
        ModelConfig(dtype="int8")
    with pytest.raises(ValueError, match="vocab_size=0"):
        ModelConfig(vocab_size=0)


# ---- weights ---------------------------------------------------------------------------------
def _assert_tree_equal(a, b):
    import jax

    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_npz_roundtrip(tmp_path):
    params = init_target_params(CFG, 5)
    draft = init_draft_params(CFG, params, 6)
    path = tmp_path / "w.npz"
    save_weights(path, params, draft)
    _assert_tree_equal(load_target(path, CFG), params)
    _assert_tree_equal(load_draft(path, CFG), draft)
    # Same greedy tokens after the round trip.
    prompt = [1, 2, 3]
    assert dense_greedy_generate(
        ToyTarget(CFG), load_target(path, CFG), prompt, 4
    ) == dense_greedy_generate(ToyTarget(CFG), params, prompt, 4)


def test_hf_names_are_transposed(tmp_path):
    params = init_target_params(CFG, 7)
    names = {
        "wq": "self_attn.q_proj",
        "wk": "self_attn.k_proj",
        "wv": "self_attn.v_proj",
        "wo": "self_attn.o_proj",
        "w_gate": "mlp.gate_proj",
        "w_up": "mlp.up_proj",
        "w_down": "mlp.down_proj",
    }
    hf = {
        "model.embed_tokens.weight": np.asarray(params.embed),
        "model.norm.weight": np.asarray(params.final_norm),
        "lm_head.weight": np.asarray(params.lm_head).T,
    }
    for i, lp in enumerate(params.layers):
        hf[f"model.layers.{i}.input_layernorm.weight"] = np.asarray(lp.attn_norm)
        hf[f"model.layers.{i}.post_attention_layernorm.weight"] = np.asarray(lp.mlp_norm)
        for field, name in names.items():
            hf[f"model.layers.{i}.{name}.weight"] = np.asarray(getattr(lp, field)).T
    path = tmp_path / "hf.npz"
    np.savez(path, **hf)
    _assert_tree_equal(load_target(path, CFG), params)
    # Tied LM head: no lm_head.weight means embed^T.
    del hf["lm_head.weight"]
    np.savez(path, **hf)
    np.testing.assert_array_equal(
        np.asarray(load_target(path, CFG).lm_head), np.asarray(params.embed).T
    )


def test_weight_errors(tmp_path):
    params = init_target_params(CFG, 5)
    path = tmp_path / "w.npz"
    save_weights(path, params)
    with pytest.raises(ValueError, match="shape"):
        load_target(path, dataclasses.replace(CFG, hidden_size=16))
    with pytest.raises(KeyError, match="draft.fc"):
        load_draft(path, CFG)
    with pytest.raises(ValueError, match="expected a .npz or .safetensors"):
        read_tensors(tmp_path / "w.bin")


def test_safetensors_needs_package(tmp_path):
    try:
        import safetensors  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="safetensors"):
            read_tensors(tmp_path / "w.safetensors")
    else:
        from safetensors.numpy import save_file

        save_file({"embed": np.ones((2, 2), np.float32)}, str(tmp_path / "w.safetensors"))
        assert read_tensors(tmp_path / "w.safetensors")["embed"].shape == (2, 2)
