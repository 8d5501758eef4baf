"""Bad checkpoints: clear ValueErrors naming the tensor / field, raised before any weight read."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from models_helpers import TARGET, eagle3_config, eagle3_tensors, write_head
from safetensors.numpy import save_file

from jspec.models import load_draft, load_eagle3, load_llama
from jspec.models.checkpoint import LAYER_TABLE

RAW = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 50,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
}


def llama_tensors(seed=0, *, hid=16, inter=24, vocab=50, layers=2, qd=16, kvd=8):
    rng = np.random.default_rng(seed)
    shapes = {
        "input_layernorm.weight": (hid,),
        "self_attn.q_proj.weight": (qd, hid),
        "self_attn.k_proj.weight": (kvd, hid),
        "self_attn.v_proj.weight": (kvd, hid),
        "self_attn.o_proj.weight": (hid, qd),
        "post_attention_layernorm.weight": (hid,),
        "mlp.gate_proj.weight": (inter, hid),
        "mlp.up_proj.weight": (inter, hid),
        "mlp.down_proj.weight": (hid, inter),
    }
    assert {name for name, _ in LAYER_TABLE.values()} == set(shapes)
    out = {
        "model.embed_tokens.weight": (vocab, hid),
        "model.norm.weight": (hid,),
        "lm_head.weight": (vocab, hid),
    }
    out.update({f"model.layers.{i}.{k}": s for i in range(layers) for k, s in shapes.items()})
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in out.items()}


def write_llama(directory, tensors, raw=RAW, shards=1):
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s::shards]}
            save_file(part, str(directory / file))
            weight_map.update(dict.fromkeys(part, file))
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


def test_hand_written_checkpoint_loads(tmp_path):
    tensors = llama_tensors()
    calls = []
    target, params = load_llama(
        write_llama(tmp_path, tensors, shards=3),
        progress=lambda done, total: calls.append((done, total)),
    )
    assert calls == [(i + 1, len(tensors)) for i in range(len(tensors))]
    np.testing.assert_array_equal(
        np.asarray(params.layers[1].wq), tensors["model.layers.1.self_attn.q_proj.weight"].T
    )
    np.testing.assert_array_equal(np.asarray(params.lm_head), tensors["lm_head.weight"].T)
    assert target.num_layers == 2 and target.head_dim == 4


@pytest.mark.parametrize("shards", [1, 3])
def test_missing_tensor_names_it_and_the_files(tmp_path, shards):
    tensors = llama_tensors()
    del tensors["model.layers.1.mlp.up_proj.weight"]
    write_llama(tmp_path, tensors, shards=shards)
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing "
        r"from .*model(-00001-of-00003)?\.safetensors",
    ):
        load_llama(tmp_path)


@pytest.mark.parametrize("model", ["llama", "eagle3"])
def test_input_layernorm_is_required_outside_eagle1(tmp_path, model):
    """Only an EAGLE-1 head may omit its layer's input_layernorm (an identity norm there); a
    target layer or an EAGLE-3 midlayer without it is a missing tensor."""
    if model == "llama":
        tensors = llama_tensors()
        del tensors["model.layers.1.input_layernorm.weight"]
        with pytest.raises(
            ValueError, match=r"'model\.layers\.1\.input_layernorm\.weight' is missing"
        ):
            load_llama(write_llama(tmp_path, tensors))
    else:
        tensors = eagle3_tensors()
        del tensors["midlayer.input_layernorm.weight"]
        with pytest.raises(ValueError, match=r"'midlayer\.input_layernorm\.weight' is missing"):
            load_eagle3(write_head(tmp_path, tensors, eagle3_config()), TARGET)


def test_untied_model_without_lm_head(tmp_path):
    tensors = llama_tensors()
    del tensors["lm_head.weight"]
    with pytest.raises(ValueError, match="'lm_head.weight' is missing"):
        load_llama(write_llama(tmp_path, tensors))
    # ... loads once the config says the head is tied
    _, params = load_llama(write_llama(tmp_path, tensors, {**RAW, "tie_word_embeddings": True}))
    assert params.lm_head is None


def test_misshaped_tensor_names_both_shapes(tmp_path):
    tensors = llama_tensors()
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 16), np.float32)
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' in "
        r"model\.safetensors has shape \(16, 16\), expected "
        r"\(8, 16\)",
    ):
        load_llama(write_llama(tmp_path, tensors))


def test_wrong_dtype(tmp_path):
    tensors = llama_tensors()
    tensors["model.norm.weight"] = np.ones(16, np.int32)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight'.*dtype I32"):
        load_llama(write_llama(tmp_path, tensors))


def test_missing_shard_and_no_weights(tmp_path):
    write_llama(tmp_path, llama_tensors(), shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        load_llama(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_llama(empty)
    (empty / "config.json").write_text(json.dumps(RAW))
    with pytest.raises(ValueError, match="no weights"):
        load_llama(empty)


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ValueError, match="Qwen2ForCausalLM"):
        load_llama(
            write_llama(tmp_path, llama_tensors(), {**RAW, "architectures": ["Qwen2ForCausalLM"]})
        )


@pytest.mark.parametrize("field,value", [("hidden_size", 16), ("vocab_size", 97)])
def test_draft_that_does_not_fit_the_target(tmp_path, field, value):
    path = write_head(tmp_path, eagle3_tensors(), eagle3_config(**{field: value}))
    with pytest.raises(
        ValueError, match=f"draft {field}={value} does not fit the target's {field}="
    ):
        load_draft(path, TARGET)


def test_draft_missing_and_misshaped_tensors(tmp_path):
    tensors = eagle3_tensors()
    del tensors["midlayer.hidden_norm.weight"]
    with pytest.raises(ValueError, match="'midlayer.hidden_norm.weight' is missing"):
        load_eagle3(write_head(tmp_path / "a", tensors, eagle3_config()), TARGET)
    tensors = eagle3_tensors()
    tensors["fc.weight"] = tensors["fc.weight"][:, :64]  # an EAGLE-1-width fc [H, 2H]
    with pytest.raises(ValueError, match=r"'fc\.weight'.*shape \(32, 64\), expected \(32, 96\)"):
        load_eagle3(write_head(tmp_path / "b", tensors, eagle3_config()), TARGET)


def test_unsupported_draft_architecture(tmp_path):
    path = write_head(
        tmp_path, eagle3_tensors(), eagle3_config(architectures=["Qwen2ForCausalLMEagle3"])
    )
    with pytest.raises(ValueError, match=r"Qwen2ForCausalLMEagle3.*LlamaForCausalLMEagle3"):
        load_draft(path, TARGET)


@pytest.mark.parametrize(
    "row,target_id,match",
    [(-1, 1000, r"to \[\d+, 1000\]"), (0, -1, r"to \[-1, \d+\]")],
    ids=["above", "below"],
)
def test_d2t_outside_the_target_vocab(tmp_path, row, target_id, match):
    tensors = eagle3_tensors()
    draft_id = np.arange(len(tensors["d2t"]))[row]
    tensors["d2t"][row] = target_id - draft_id  # target id = draft id + d2t[draft id]
    with pytest.raises(ValueError, match="d2t maps draft ids " + match):
        load_eagle3(write_head(tmp_path, tensors, eagle3_config()), TARGET)


def test_pytorch_bin_without_torch_says_convert(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(eagle3_config()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(ValueError, match="Convert it once"):
        load_eagle3(tmp_path, TARGET)


# ---- issue 22: NaN / Inf, path traversal, bad files, ambiguous checkpoints -----------------------
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_nonfinite_weight_names_the_tensor(tmp_path, bad, dtype):
    tensors = llama_tensors()
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = bad  # transposed on load
    tensors["model.norm.weight"][0] = bad  # not transposed
    with pytest.raises(
        ValueError,
        match=r"'model\.(norm|layers\.1\.mlp\.down_proj)\.weight' in model-0000\d-of-00002\."
        r"safetensors holds NaN or Inf values as (float32|bfloat16) \(and 1 more\)",
    ):
        load_llama(write_llama(tmp_path, tensors, shards=2), dtype=dtype)


def test_overflow_in_the_load_dtype_is_named(tmp_path):
    tensors = llama_tensors()
    tensors["model.embed_tokens.weight"][0, 0] = 1e6  # finite in f32, inf in f16
    path = write_llama(tmp_path, tensors)
    load_llama(path)
    with pytest.raises(ValueError, match=r"'model\.embed_tokens\.weight'.*Inf values as float16"):
        load_llama(path, dtype="float16")


@pytest.mark.parametrize(
    "shard",
    ["../elsewhere/x.safetensors", "/abs/x.safetensors", "sub/x.safetensors", "..", "a\\x"],
)
def test_index_shard_outside_the_directory_is_refused(tmp_path, shard):
    model = tmp_path / "model"
    model.mkdir()
    write_llama(model, llama_tensors(), shards=2)
    index = model / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    raw["weight_map"]["model.norm.weight"] = shard
    index.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"weight_map\['model\.norm\.weight'\]=.* is not a file"):
        load_llama(model)


def test_hf_cache_symlinks_into_blobs_still_load(tmp_path):
    """A Hugging Face cache snapshot: every file a symlink into ../../blobs (names are checked,
    not resolved targets)."""
    src = write_llama(tmp_path, llama_tensors(), shards=2)
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(p for p in src.iterdir() if p.is_file())):
        (blobs / f"blob{i}").write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(f"../../blobs/blob{i}")
    target, _ = load_llama(snap)
    assert target.num_layers == 2


@pytest.mark.parametrize(
    "content,match",
    [
        pytest.param(b"", "header too small", id="zero-byte"),
        pytest.param(None, "not fully covered|incomplete", id="truncated"),
        pytest.param(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}xxxxxx", "header", id="header"),
        pytest.param(b"\xff" * 64, "", id="garbage"),
    ],
)
def test_bad_safetensors_file_names_it(tmp_path, content, match):
    write_llama(tmp_path, llama_tensors())
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if content is None else content)
    with pytest.raises(
        ValueError, match=f"model.safetensors: not a readable safetensors file.*{match}"
    ):
        load_llama(tmp_path)


@pytest.mark.parametrize(
    "text,match",
    [
        pytest.param("[]", "expected a JSON object", id="list"),
        pytest.param("{}", "weight_map must be an object.*got nothing", id="no-weight-map"),
        pytest.param('{"weight_map": [1]}', "weight_map must be an object.*got list", id="wm-list"),
        pytest.param('{"weight_map": {"x": 3}}', r"weight_map\['x'\]=3", id="wm-int"),
        pytest.param("{,", r"not valid JSON \(.*line 1 column 2\)", id="json"),
    ],
)
def test_bad_index_names_the_file_and_field(tmp_path, text, match):
    write_llama(tmp_path, llama_tensors(), shards=2)
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: " + match):
        load_llama(tmp_path)


def test_index_mapping_a_tensor_to_a_shard_without_it(tmp_path):
    write_llama(tmp_path, llama_tensors(), shards=2)
    index = tmp_path / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    name = "model.norm.weight"
    raw["weight_map"][name] = next(
        f for f in set(raw["weight_map"].values()) if f != raw["weight_map"][name]
    )
    index.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"maps 'model\.norm\.weight' to .*which does not hold it"):
        load_llama(tmp_path)


def test_malicious_pytorch_bin_is_refused_in_one_line(tmp_path):
    torch = pytest.importorskip("torch")

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (tmp_path / "config.json").write_text(json.dumps(eagle3_config()))
    torch.save({"fc.weight": Evil()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin: refused by torch\.load") as info:
        load_eagle3(tmp_path, TARGET)
    assert "\n" not in str(info.value) and not marker.exists()
    torch.save([torch.zeros(2)], tmp_path / "pytorch_model.bin")  # allowed, but not a state dict
    with pytest.raises(ValueError, match="expected a flat dict of tensor name -> tensor"):
        load_eagle3(tmp_path, TARGET)
    torch.save(
        {"fc.weight": torch.zeros(2, dtype=torch.float8_e4m3fn)}, tmp_path / "pytorch_model.bin"
    )
    with pytest.raises(ValueError, match=r"'fc\.weight' has dtype torch\.float8_e4m3fn"):
        load_eagle3(tmp_path, TARGET)


@pytest.mark.parametrize(
    "extra,match",
    [
        pytest.param(
            "model.layers.2.mlp.up_proj.weight",
            r"'model\.layers\.2\.mlp\.up_proj\.weight' in model\.safetensors is for layer 2, but "
            r"config\.json says num_hidden_layers=2",
            id="layer-past-the-config",
        ),
        pytest.param(
            "model.layers.0.self_attn.q_proj.bias",
            r"'model\.layers\.0\.self_attn\.q_proj\.bias' in model\.safetensors is not a "
            r"LlamaForCausalLM weight",
            id="bias",
        ),
        pytest.param("model.layers.0.self_attn.rotary_emb.inv_freq", None, id="rotary-ignored"),
    ],
)
def test_tensors_jspec_would_drop_are_errors(tmp_path, extra, match):
    tensors = llama_tensors()
    tensors[extra] = np.ones(4, np.float32)
    write_llama(tmp_path, tensors)
    if match is None:
        load_llama(tmp_path)
        return
    with pytest.raises(ValueError, match=match):
        load_llama(tmp_path)


def test_tied_checkpoint_may_keep_its_lm_head_copy(tmp_path):
    _, params = load_llama(
        write_llama(tmp_path, llama_tensors(), {**RAW, "tie_word_embeddings": True})
    )
    assert params.lm_head is None


def test_same_tensor_in_two_unindexed_files(tmp_path):
    tensors = llama_tensors()
    write_llama(tmp_path, tensors)
    save_file({"model.norm.weight": np.zeros(16, np.float32)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"'model\.norm\.weight' is in both extra\.safetensors and model\.safetensors .*"
        r"no model\.safetensors\.index\.json names the one to load",
    ):
        load_llama(tmp_path)


def test_eagle3_head_with_its_own_embedding_copy_and_unknown_tensor(tmp_path):
    tensors = eagle3_tensors()
    tensors["embed_tokens.weight"] = np.zeros((96, 32), np.float32)  # sglang uses the target's
    load_eagle3(write_head(tmp_path / "a", tensors, eagle3_config()), TARGET)
    tensors["midlayer.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
    with pytest.raises(
        ValueError, match=r"'midlayer\.self_attn\.q_proj\.bias'.*LlamaForCausalLMEagle3"
    ):
        load_eagle3(write_head(tmp_path / "b", tensors, eagle3_config()), TARGET)


def test_inspect_reads_no_weight_and_sizes_the_model(tmp_path, monkeypatch):
    from jspec.models import checkpoint

    tensors = llama_tensors()
    write_llama(tmp_path, tensors, shards=2)
    monkeypatch.setattr(checkpoint.Plan, "read", lambda *a: pytest.fail("read a weight"))
    target, nbytes = checkpoint.inspect_llama(tmp_path)
    assert nbytes == sum(t.nbytes for t in tensors.values())
    assert checkpoint.weight_bytes(target) == nbytes
    _, nbytes = checkpoint.inspect_llama(tmp_path, dtype="bfloat16")
    assert nbytes == sum(t.nbytes for t in tensors.values()) // 2
    head = write_head(tmp_path / "head", eagle3_tensors(), eagle3_config())
    draft, head_bytes = checkpoint.inspect_draft(head, TARGET, dtype="float32")
    want = sum(t.nbytes for k, t in eagle3_tensors().items() if k not in ("t2d", "d2t")) + 4 * 40
    assert head_bytes == want and checkpoint.weight_bytes(draft) == want + 4 * 32  # + fc.bias


def _aligned_safetensors(path, name, array):
    """A one-tensor safetensors file whose data starts 64-byte aligned (header padded with
    spaces, as the format allows): the alignment at which XLA:CPU may alias a host array."""
    header = {name: {"dtype": "F32", "shape": list(array.shape), "data_offsets": [0, array.nbytes]}}
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 64)
    path.write_bytes(len(text).to_bytes(8, "little") + text + array.astype("<f4").tobytes())


def test_loaded_weights_are_copies_not_the_mapped_file(tmp_path):
    """Tensors are read as views of the file mapped into memory; the device arrays must not
    alias them (a later rewrite of the checkpoint would change the weights)."""
    tensors = llama_tensors(3)
    write_llama(tmp_path, tensors)
    name = "model.norm.weight"  # loaded untransposed: the host array goes to device_put as is
    _aligned_safetensors(tmp_path / "norm.safetensors", name, tensors.pop(name))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _, params = load_llama(tmp_path)
    before = np.asarray(params.final_norm).copy()
    data = bytearray((tmp_path / "norm.safetensors").read_bytes())
    data[-before.nbytes :] = np.full_like(before, -7.0).tobytes()
    with open(tmp_path / "norm.safetensors", "r+b") as f:  # in place: the same pages
        f.write(bytes(data))
    np.testing.assert_array_equal(np.asarray(params.final_norm), before)


def test_file_truncated_after_the_header_check_names_the_tensor(tmp_path):
    from jspec.models.checkpoint import _plan_llama

    write_llama(tmp_path, llama_tensors())
    plan = _plan_llama(tmp_path, None)  # headers checked
    path = tmp_path / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 4)
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor '.+' spans bytes"):
        plan.read(None, None)


def _avals(tree):
    import jax

    return jax.tree.structure(tree), [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("tied", [False, True])
def test_abstract_params_are_what_the_load_returns(tmp_path, monkeypatch, tied):
    """abstract_llama / abstract_draft give the loaded pytrees' structure, shapes and dtypes
    without reading a weight (what jspec generate compiles against while the weights load)."""
    from jspec.models import checkpoint

    tensors = llama_tensors()
    raw = RAW
    if tied:
        tensors.pop("lm_head.weight")
        raw = {**RAW, "tie_word_embeddings": True}
    write_llama(tmp_path, tensors, raw)
    heads = [write_head(tmp_path / "head", eagle3_tensors(), eagle3_config())]
    with monkeypatch.context() as m:
        m.setattr(checkpoint.Plan, "read", lambda *a: pytest.fail("read a weight"))
        target, abstract = checkpoint.abstract_llama(tmp_path, dtype="bfloat16")
        drafts = [checkpoint.abstract_draft(h, TARGET) for h in heads]
    assert target.config.tie_word_embeddings == tied
    assert _avals(abstract) == _avals(load_llama(tmp_path, dtype="bfloat16")[1])
    for head, (draft, abstract_head) in zip(heads, drafts, strict=True):
        loaded = load_draft(head, TARGET)
        assert type(draft) is type(loaded[0])
        assert _avals(abstract_head) == _avals(loaded[1])
