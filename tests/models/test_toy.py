"""The toy target and head (``LlamaTarget`` + :func:`toy_llama_params`, :func:`toy_eagle1`) vs
independent numpy code; the dense oracle over a saved and reloaded toy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from models_helpers import SMALL_CFG

from jspec.engine.reference import _dense_attn_fn, dense_greedy_generate
from jspec.models import (
    LlamaConfig,
    LlamaTarget,
    load_llama,
    save_llama,
    toy_eagle1,
    toy_llama_params,
)
from jspec.models.layers import apply_rope, rms_norm, rope_inv_freq

CFG = SMALL_CFG
TARGET = LlamaTarget(CFG)


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
    params = toy_llama_params(TARGET, 3, residual_scale=1.0)
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, 11)
    width = 16
    ids = np.zeros(width, np.int32)
    ids[:11] = tokens
    _, hidden, _ = TARGET.forward(
        params, None, jnp.asarray(ids), jnp.arange(width, dtype=jnp.int32), _dense_attn_fn(11)
    )
    got = np.asarray(TARGET.logits(params, hidden))[:11]
    np.testing.assert_allclose(got, _np_forward(CFG, params, tokens), rtol=2e-4, atol=2e-4)


def test_rope_relative_and_matches_complex_form():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 3, 8)).astype(np.float32)
    pos = np.array([0, 3, 7, 100, 4095])
    inv_freq = rope_inv_freq(8, 10000.0, None)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos, jnp.int32), inv_freq))
    np.testing.assert_allclose(
        got, _np_rope(x.astype(np.float64), pos.astype(np.float64)), rtol=1e-4, atol=1e-4
    )
    # q.k depends only on the position difference.
    q, k = rng.standard_normal((2, 1, 1, 8)).astype(np.float32)

    def dot(pq, pk):
        rq = apply_rope(jnp.asarray(q), jnp.asarray([pq], jnp.int32), inv_freq)
        rk = apply_rope(jnp.asarray(k), jnp.asarray([pk], jnp.int32), inv_freq)
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
    params = toy_llama_params(TARGET, 0)
    draft, head = toy_eagle1(TARGET, params)
    tokens = jnp.arange(CFG.vocab_size, dtype=jnp.int32)

    def attn_fn(layer, pool, q, k, v):
        return pool, jnp.repeat(v, 2, axis=1)

    # Target's context-free transition vs the draft's prediction from the same token.
    _, th, _ = TARGET.forward(params, None, tokens, jnp.zeros_like(tokens), attn_fn)
    _, dh = draft.forward(head, params, None, tokens, th, jnp.zeros_like(tokens), attn_fn)
    trans = np.argmax(np.asarray(TARGET.logits(params, params.embed)), -1)
    pred = np.argmax(np.asarray(draft.logits(head, params, dh)), -1)
    assert np.mean(pred == trans) > 0.8


def test_toy_needs_its_own_lm_head():
    tied = LlamaTarget(LlamaConfig(**{**_fields(CFG), "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        toy_llama_params(tied)


def _fields(cfg):
    import dataclasses

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def test_saved_toy_reloads_and_decodes_the_same(tmp_path):
    """The toy through jspec.models' one writer and loader: same tensors, same greedy tokens."""
    import jax

    params = toy_llama_params(TARGET, 5)
    save_llama(tmp_path, TARGET, params)
    target, loaded = load_llama(tmp_path)
    assert target == TARGET
    for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    prompt = [1, 2, 3]
    assert dense_greedy_generate(target, loaded, prompt, 4) == dense_greedy_generate(
        TARGET, params, prompt, 4
    )
