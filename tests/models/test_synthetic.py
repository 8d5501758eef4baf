"""Synthetic checkpoints: HF writers round-trip (and load in transformers); the constructed
EAGLE-3 head drafts the toy target's greedy chain well on its first and later draft steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_helpers import dense_attn_fn, hf_logits

from jspec.models import LlamaConfig, LlamaTarget, load_eagle3, load_llama, random_llama_params
from jspec.models.export import save_eagle3, save_llama
from jspec.models.hf_config import RopeScaling
from jspec.models.synthetic import matched_eagle3, toy_llama_params

TOY = LlamaTarget(
    LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        eos_token_ids=(5,),
        bos_token_ids=(1,),
    )
)


def _assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("tied,dtype", [(False, "float32"), (True, "bfloat16")])
def test_save_llama_round_trips(tmp_path, tied, dtype):
    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=6,
        tie_word_embeddings=tied,
        rope_scaling=RopeScaling(4.0, 1.0, 4.0, 32),
        rope_theta=5e5,
        dtype=dtype,
        eos_token_ids=(2, 7),
    )
    target = LlamaTarget(cfg)
    params = random_llama_params(target, seed=2)
    save_llama(tmp_path, target, params, max_shard_bytes=4000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    loaded_target, loaded = load_llama(tmp_path)
    assert loaded_target == target
    _assert_same(loaded, params)


def test_saved_toy_target_loads_in_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    params = toy_llama_params(TOY, seed=3, residual_scale=1.0)
    save_llama(tmp_path, TOY, params)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = np.random.default_rng(0).integers(0, 64, 12)
    _, hidden, _ = TOY.forward(
        params, None, jnp.asarray(ids, jnp.int32), jnp.arange(12, dtype=jnp.int32), dense_attn_fn
    )
    np.testing.assert_allclose(
        np.asarray(TOY.logits(params, hidden)),
        hf_logits(model, ids, np.arange(12)),
        rtol=1e-4,
        atol=1e-4,
    )


def _greedy_chain(target, params, prompt, length):
    """Target greedy continuation, recomputed over a fixed buffer (causal: padding is inert)."""
    buf = np.zeros(length, np.int32)
    buf[: len(prompt)] = prompt

    @jax.jit
    def next_ids(ids):
        _, hidden, aux = target.forward(
            params,
            None,
            ids,
            jnp.arange(length, dtype=jnp.int32),
            dense_attn_fn,
            capture_layers=(0, 1, 2),
        )
        return jnp.argmax(target.logits(params, hidden), -1), aux

    for p in range(len(prompt), length):
        buf[p] = int(next_ids(jnp.asarray(buf))[0][p - 1])
    return buf, next_ids(jnp.asarray(buf))


def test_matched_eagle3_drafts_the_toy_chain(tmp_path):
    params = toy_llama_params(TOY, seed=4)
    draft, head = matched_eagle3(TOY, params, draft_vocab_size=48, seed=1)
    save_eagle3(tmp_path, draft, head, num_target_layers=TOY.num_layers)
    loaded_draft, loaded_head = load_eagle3(tmp_path, TOY)
    assert loaded_draft == draft
    _assert_same(loaded_head, head)

    length, prompt = 40, np.random.default_rng(5).integers(0, 64, 6)
    chain, (target_next, aux) = _greedy_chain(TOY, params, prompt, length)
    hot = set(np.asarray(draft.to_target_ids(head, jnp.arange(48, dtype=jnp.int32))).tolist())
    step = jax.jit(
        lambda tok, hid, pos: draft.forward(head, params, None, tok, hid, pos, dense_attn_fn)[1]
    )

    def drafted(hidden):
        return np.asarray(
            draft.to_target_ids(
                head, jnp.argmax(draft.logits(head, params, hidden), -1).astype(jnp.int32)
            )
        )

    # A draft forward at position q (token x[q]) guesses the target's next token at q.
    # Step 1: x[q] with the target's aux at q - 1.
    pos = jnp.arange(1, length, dtype=jnp.int32)
    hidden1 = step(jnp.asarray(chain[1:]), draft.combine_hidden_states(head, aux[:-1]), pos)
    # Step 2: x[q] with the head's own hidden_out at q - 1 (the draft loop's feed).
    hidden2 = step(jnp.asarray(chain[2:]), hidden1[:-1], pos[1:])
    target_next = np.asarray(target_next)
    for hidden, offset in ((hidden1, 1), (hidden2, 2)):
        guess, want = drafted(hidden), target_next[offset:]
        reachable = np.array([w in hot for w in want])
        rate = np.mean(guess[reachable] == want[reachable])
        assert reachable.mean() > 0.5 and rate > 0.9, (offset, rate, reachable.mean())
