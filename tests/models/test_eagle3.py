"""jspec's Eagle3Draft loaded from a safetensors head vs the PyTorch reference (interop)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_helpers import (
    DRAFT_VOCAB,
    TARGET,
    dense_attn_fn,
    eagle3_config,
    eagle3_tensors,
    write_head,
)

from jspec.models import Eagle3Draft, load_draft, load_eagle3, random_llama_params

torch = pytest.importorskip("torch")
from interop.models.eagle3_reference import Eagle3Reference


@pytest.fixture(scope="module")
def target_params():
    return random_llama_params(TARGET, seed=11)


@pytest.mark.parametrize("fc_bias", [False, True], ids=["no-bias", "fc-bias"])
def test_eagle3_matches_torch_reference(tmp_path, target_params, fc_bias):
    tensors = eagle3_tensors(seed=4, fc_bias=fc_bias)
    config = eagle3_config()
    draft, params = load_eagle3(write_head(tmp_path / "head", tensors, config), TARGET)
    assert isinstance(draft, Eagle3Draft) and draft.dtype == "float32"  # the target's dtype
    assert draft.capture_layers == (2, 4, 5)  # sglang's default (2, N//2, N-3), N=8
    assert draft.vocab_size == DRAFT_VOCAB and draft.num_layers == 1
    ref = Eagle3Reference(
        config,
        {k: torch.from_numpy(v) for k, v in tensors.items()},
        torch.from_numpy(np.asarray(target_params.embed)),
    )

    rng = np.random.default_rng(5)
    num_tokens = 9
    ids = rng.integers(0, TARGET.vocab_size, num_tokens)
    positions = np.arange(num_tokens) + 70
    aux = rng.standard_normal((num_tokens, 3 * TARGET.hidden_size)).astype(np.float32)
    fwd = jax.jit(
        lambda p, tok, hid, pos: draft.forward(
            p, target_params, None, tok, hid, pos, dense_attn_fn
        )[1]
    )
    ids_j, pos_j = jnp.asarray(ids, jnp.int32), jnp.asarray(positions, jnp.int32)
    # First draft forward after verify: hidden_in is the target's aux [T, 3H] fused by
    # combine_hidden_states (fc); then the head's own hidden_out [T, H] (no fc).
    hidden_in_j = draft.combine_hidden_states(params, jnp.asarray(aux))
    hidden_in_t = torch.from_numpy(aux)
    for _ in range(2):
        got_hidden = fwd(params, ids_j, hidden_in_j, pos_j)
        got_logits = np.asarray(draft.logits(params, target_params, got_hidden))
        to_logits, want_hidden = ref.forward(
            torch.from_numpy(ids), hidden_in_t, torch.from_numpy(positions)
        )
        want_logits = ref.logits(to_logits).numpy()
        assert np.abs(want_logits).max() > 0.5
        np.testing.assert_allclose(
            np.asarray(got_hidden), want_hidden.numpy(), rtol=1e-4, atol=1e-4
        )
        np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4)
        draft_ids = np.argmax(got_logits, -1)
        np.testing.assert_array_equal(
            np.asarray(draft.to_target_ids(params, jnp.asarray(draft_ids, jnp.int32))),
            ref.to_target_ids(torch.from_numpy(draft_ids)).numpy(),
        )
        hidden_in_j, hidden_in_t = got_hidden, want_hidden


def test_d2t_maps_every_draft_id_to_its_hot_token(tmp_path):
    tensors = eagle3_tensors(seed=6)
    draft, params = load_eagle3(write_head(tmp_path, tensors, eagle3_config()), TARGET)
    hot = np.arange(DRAFT_VOCAB) + tensors["d2t"]
    got = np.asarray(draft.to_target_ids(params, jnp.arange(DRAFT_VOCAB, dtype=jnp.int32)))
    np.testing.assert_array_equal(got, hot)
    assert params.d2t.dtype == jnp.int32 and np.all(np.diff(got) > 0)


@pytest.mark.parametrize("ids,want", [([1, 3, 5], (2, 4, 6)), ([-1, 0, 6], (0, 1, 7))])
def test_named_aux_layers_capture_at_id_plus_one(tmp_path, ids, want):
    config = eagle3_config(eagle_config={"eagle_aux_hidden_state_layer_ids": ids})
    draft, _ = load_eagle3(write_head(tmp_path, eagle3_tensors(), config), TARGET)
    assert draft.capture_layers == want


def test_load_draft_dispatches_and_bf16_head(tmp_path):
    tensors = {
        k: (v.astype(jnp.bfloat16) if v.dtype == np.float32 else v)
        for k, v in eagle3_tensors(seed=8).items()
    }
    path = write_head(tmp_path, tensors, eagle3_config(rope_scaling=None))
    draft, params = load_draft(path, TARGET, dtype="bfloat16")
    assert isinstance(draft, Eagle3Draft) and draft.dtype == "bfloat16"
    assert params.fc.dtype == jnp.bfloat16 and params.d2t.dtype == jnp.int32
    assert hash(draft) == hash(load_draft(path, TARGET, dtype="bfloat16")[0])


def test_pytorch_bin_head_loads_through_torch(tmp_path, target_params):
    tensors = eagle3_tensors(seed=9)
    (tmp_path / "st").mkdir()
    write_head(tmp_path / "st", tensors, eagle3_config())
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text(json.dumps(eagle3_config()))
    torch.save(
        {k: torch.from_numpy(v) for k, v in tensors.items()}, tmp_path / "bin" / "pytorch_model.bin"
    )
    _, from_st = load_eagle3(tmp_path / "st", TARGET)
    _, from_bin = load_eagle3(tmp_path / "bin", TARGET)
    for a, b in zip(jax.tree.leaves(from_st), jax.tree.leaves(from_bin), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- issue 22: the fusion is an explicit method, not a test of the input width ------------------
@pytest.mark.parametrize("num_aux", [1, 3])
def test_combine_hidden_states_fuses_the_target_feature_only(target_params, num_aux):
    """With one captured layer the aux feature and the head's own hidden are both [T, H]: only
    combine_hidden_states applies fc; forward never does (the old width test applied fc to the
    head's own hidden too)."""
    from jspec.models import Eagle3Config, random_eagle3_params
    from jspec.models.eagle3 import Eagle3Draft

    cfg = Eagle3Config(
        hidden_size=32,
        intermediate_size=40,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=96,
        draft_vocab_size=40,
        num_aux=num_aux,
    )
    draft = Eagle3Draft(cfg, (2, 4, 5)[:num_aux])
    params = random_eagle3_params(draft, seed=3)
    rng = np.random.default_rng(7)
    aux = jnp.asarray(rng.standard_normal((5, num_aux * 32)), jnp.float32)
    fused = draft.combine_hidden_states(params, aux)
    np.testing.assert_allclose(
        np.asarray(fused), np.asarray(aux) @ np.asarray(params.fc), rtol=1e-5, atol=1e-5
    )
    ids, pos = jnp.arange(5, dtype=jnp.int32), jnp.arange(5, dtype=jnp.int32)
    _, out = draft.forward(params, target_params, None, ids, fused, pos, dense_attn_fn)
    # The next step feeds out back: forward must use it as it is, fc or no fc width match.
    _, again = draft.forward(params, target_params, None, ids, out, pos, dense_attn_fn)
    identity = dataclasses.replace(params, fc=params.fc * 0)  # fc must not matter any more
    _, same = draft.forward(identity, target_params, None, ids, out, pos, dense_attn_fn)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(same))
    if num_aux == 3:
        with pytest.raises(ValueError, match="hidden_size=32 .*combine_hidden_states"):
            draft.forward(params, target_params, None, ids, aux, pos, dense_attn_fn)
    with pytest.raises(ValueError, match=f"num_aux \\* hidden_size = {num_aux} \\* 32"):
        draft.combine_hidden_states(params, aux[:, :-1])


def test_eagle1_combine_is_identity(target_params):
    from jspec.models import Eagle1Draft

    hidden = jnp.ones((3, 32), jnp.float32)
    assert Eagle1Draft(TARGET.config).combine_hidden_states(None, hidden) is hidden


def _small_head(draft_vocab_size: int) -> Eagle3Draft:
    """A 32-wide EAGLE-3 head over a 96-token target vocabulary, capturing layers 2, 4, 5."""
    from jspec.models import Eagle3Config

    cfg = Eagle3Config(
        hidden_size=32,
        intermediate_size=40,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=96,
        draft_vocab_size=draft_vocab_size,
        num_aux=3,
    )
    return Eagle3Draft(cfg, (2, 4, 5))


def test_forward_without_the_midlayer_input_norm_names_the_field(target_params):
    """An EAGLE-3 midlayer normalizes the embedding (``input_layernorm``): a hand-built
    ``Eagle3Params`` whose layer has ``attn_norm=None`` (EAGLE-1's identity) is a ValueError
    naming the field, not an error from inside rms_norm."""
    from jspec.models import random_eagle3_params

    draft = _small_head(draft_vocab_size=40)
    params = random_eagle3_params(draft, seed=3)
    params = dataclasses.replace(params, layer=dataclasses.replace(params.layer, attn_norm=None))
    ids = jnp.arange(5, dtype=jnp.int32)
    hidden = jnp.ones((5, 32), jnp.float32)
    with pytest.raises(ValueError, match="params.layer.attn_norm"):
        draft.forward(params, target_params, None, ids, hidden, ids, dense_attn_fn)


def test_random_head_maps_draft_ids_to_distinct_target_ids():
    """``random_eagle3_params``' d2t is injective, as a trained head's hot-token map is: the
    draft ids map to distinct target ids, in order, inside the target vocabulary (here 90 of
    96, where ids drawn with replacement would repeat)."""
    from jspec.models import random_eagle3_params

    draft = _small_head(draft_vocab_size=90)
    for seed in range(3):
        params = random_eagle3_params(draft, seed=seed)
        ids = np.asarray(draft.to_target_ids(params, jnp.arange(90, dtype=jnp.int32)))
        assert (np.diff(ids) > 0).all() and ids[0] >= 0 and ids[-1] < 96, ids
