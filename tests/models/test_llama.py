"""jspec's LlamaTarget loaded from tiny transformers checkpoints vs transformers itself (f32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_helpers import LLAMA3_ROPE, dense_attn_fn, hf_logits, rewrite_config, save_hf_llama

from jspec.models import LlamaParams, LlamaTarget, load_llama

pytest.importorskip("torch")
pytest.importorskip("transformers")


def _old_rope_keys(raw):
    """transformers 5 writes ``rope_parameters``; published Llama-3.1 files the older keys."""
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = params if params.get("rope_type") != "default" else None
    return raw


def _drop_head_dim(raw):
    del raw["head_dim"]
    return raw


CASES = [
    pytest.param(
        {"tie_word_embeddings": True, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}},
        "20KB",
        None,
        id="tied-llama3-rope_parameters-sharded",
    ),
    pytest.param(
        {"tie_word_embeddings": False, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 10000.0}},
        "30KB",
        _old_rope_keys,
        id="untied-llama3-rope_scaling-sharded",
    ),
    pytest.param(
        {"tie_word_embeddings": False, "head_dim": 8},
        None,
        _drop_head_dim,
        id="untied-default-rope-no-head_dim-single",
    ),
    pytest.param(
        {"tie_word_embeddings": False, "num_key_value_heads": 1},
        None,
        _old_rope_keys,
        id="mqa-old-keys-single",
    ),
]


@pytest.mark.parametrize("overrides,shard,edit", CASES)
def test_logits_match_transformers(tmp_path, overrides, shard, edit):
    model = save_hf_llama(tmp_path, seed=3, max_shard_size=shard, **overrides)
    if shard is not None:
        assert (tmp_path / "model.safetensors.index.json").exists()
    if edit is not None:
        rewrite_config(tmp_path, edit)
    target, params = load_llama(tmp_path)
    assert isinstance(target, LlamaTarget) and isinstance(params, LlamaParams)
    assert (params.lm_head is None) == overrides["tie_word_embeddings"]
    assert target.config.eos_token_ids == (2, 3) and target.config.bos_token_ids == (1,)
    if "rope_parameters" in overrides:
        assert target.config.rope_scaling is not None
    ids = np.random.default_rng(1).integers(0, target.vocab_size, 13)
    positions = np.arange(13) + 90  # past original_max_position_embeddings
    _, hidden, aux = target.forward(
        params, None, jnp.asarray(ids, jnp.int32), jnp.asarray(positions, jnp.int32), dense_attn_fn
    )
    assert aux is None
    got = np.asarray(target.logits(params, hidden))
    want = hf_logits(model, ids, positions)
    assert got.dtype == np.float32 and np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_capture_layers_are_the_residual_entering_each_layer(tmp_path):
    import torch

    model = save_hf_llama(tmp_path, seed=5, num_hidden_layers=5)
    target, params = load_llama(tmp_path)
    ids = np.random.default_rng(2).integers(0, target.vocab_size, 9)
    capture = (0, 2, 4)
    _, _, aux = jax.jit(target.forward, static_argnums=(4,), static_argnames=("capture_layers",))(
        params,
        None,
        jnp.asarray(ids, jnp.int32),
        jnp.arange(9, dtype=jnp.int32),
        dense_attn_fn,
        capture_layers=capture,
    )
    with torch.no_grad():
        states = model(input_ids=torch.tensor(ids)[None], output_hidden_states=True).hidden_states
    want = np.concatenate([states[i][0].numpy() for i in capture], -1)
    assert aux.shape == (9, 3 * target.hidden_size)
    np.testing.assert_allclose(np.asarray(aux), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("capture", [(5,), (-1,)])
def test_capture_layers_out_of_range(tmp_path, capture):
    save_hf_llama(tmp_path, num_hidden_layers=5)
    target, params = load_llama(tmp_path)
    with pytest.raises(ValueError, match="capture_layers"):
        target.forward(
            params,
            None,
            jnp.zeros(2, jnp.int32),
            jnp.arange(2, dtype=jnp.int32),
            dense_attn_fn,
            capture_layers=capture,
        )


def test_bf16_checkpoint_stays_bf16_and_tracks_f32(tmp_path):
    import torch
    import transformers

    save_hf_llama(tmp_path, seed=7, torch_dtype="bfloat16")
    # NOTE: a fresh f32 model: .float() of the bf16 one keeps a bf16-rounded RoPE inv_freq.
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    target, params = load_llama(tmp_path)  # dtype from the config: bfloat16
    assert target.dtype == "bfloat16"
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    up_target, up_params = load_llama(tmp_path, dtype="float32")
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(up_params))
    ids = jnp.asarray(np.random.default_rng(3).integers(0, target.vocab_size, 7), jnp.int32)
    pos = jnp.arange(7, dtype=jnp.int32)
    _, hidden, _ = target.forward(params, None, ids, pos, dense_attn_fn)
    _, up_hidden, _ = up_target.forward(up_params, None, ids, pos, dense_attn_fn)
    low, high = target.logits(params, hidden), up_target.logits(up_params, up_hidden)
    assert low.dtype == jnp.float32 and hidden.dtype == jnp.bfloat16
    # The f32 run of the bf16 weights is transformers' f32 run of them.
    np.testing.assert_allclose(
        np.asarray(high), hf_logits(model, np.asarray(ids), np.arange(7)), rtol=1e-4, atol=1e-4
    )
    assert np.abs(np.asarray(low) - np.asarray(high)).max() < 0.1 * np.abs(high).max()
