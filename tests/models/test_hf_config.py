"""config.json parsing: both RoPE layouts, defaults, token ids, dtype, unsupported inputs."""

from __future__ import annotations

import dataclasses
import json

import pytest

from jspec.models import (
    Eagle3Config,
    LlamaConfig,
    RopeScaling,
    load_llama_config,
    parse_eagle3_config,
    read_eos_token_ids,
)
from jspec.models import parse_llama_config as parse
from jspec.models.layers import rope_inv_freq

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "bos_token_id": 0,
    "eos_token_id": [1, 5],
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
}
SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}


def test_old_and_new_rope_keys_give_the_same_config():
    old = parse({**BASE, "rope_theta": 500000.0, "rope_scaling": SCALING})
    new = parse({**BASE, "rope_parameters": {**SCALING, "rope_theta": 500000.0}})
    assert old == new and hash(old) == hash(new)
    assert old.rope_theta == 500000.0
    assert old.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert old.head_dim == 8 and old.num_kv_heads == 2 and old.num_layers == 3
    assert old.bos_token_ids == (0,) and old.eos_token_ids == (1, 5)
    assert old.dtype == "bfloat16" and old.tie_word_embeddings
    assert old.max_position_embeddings == 4096


@pytest.mark.parametrize(
    "rope",
    [
        pytest.param({}, id="absent"),
        pytest.param({"rope_theta": 10000.0, "rope_scaling": None}, id="old-none"),
        pytest.param(
            {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, id="new-default"
        ),
        pytest.param({"rope_parameters": {"rope_theta": 10000.0}}, id="new-theta-only"),
    ],
)
def test_default_rope(rope):
    cfg = parse({**BASE, **rope})
    assert cfg.rope_scaling is None and cfg.rope_theta == 10000.0


def test_llama3_inv_freq_bands():
    """High frequencies unchanged, low ones divided by factor, the band between smoothed."""
    scaling = RopeScaling(8.0, 1.0, 4.0, 64)
    plain, scaled = rope_inv_freq(16, 10000.0, None), rope_inv_freq(16, 10000.0, scaling)
    wavelen = 2 * 3.141592653589793 / plain
    high, low = wavelen < 16, wavelen > 64
    assert high.any() and low.any() and (~high & ~low).any()
    assert (scaled[high] == plain[high]).all()
    assert abs(scaled[low] / plain[low] - 1 / 8).max() < 1e-6
    mid = ~high & ~low
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8)).all()


def test_head_dim_dtype_and_token_ids():
    assert parse({**BASE, "head_dim": 16}).head_dim == 16
    assert parse(BASE, dtype="float32").dtype == "float32"
    new_key = {k: v for k, v in BASE.items() if k != "torch_dtype"} | {"dtype": "float16"}
    assert parse(new_key).dtype == "float16"
    assert parse({**BASE, "eos_token_id": 7, "bos_token_id": None}).eos_token_ids == (7,)
    assert parse({**BASE, "bos_token_id": None}).bos_token_ids == ()
    assert parse({**BASE, "torch_dtype": None}).dtype == "float32"


@pytest.mark.parametrize(
    "raw,match",
    [
        pytest.param(
            {**BASE, "architectures": ["MistralForCausalLM"]},
            "MistralForCausalLM",
            id="architecture",
        ),
        pytest.param(
            {**BASE, "architectures": ["LlamaForCausalLMEagle3"]},
            "LlamaForCausalLMEagle3",
            id="eagle3-as-target",
        ),
        pytest.param(
            {**BASE, "architectures": ["LlamaForCausalLMEagle"]},
            "LlamaForCausalLMEagle",
            id="eagle1-as-target",
        ),
        pytest.param(
            {**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn", id="rope-yarn"
        ),
        pytest.param(
            {**BASE, "rope_parameters": {"full_attention": {"rope_type": "default"}}},
            "per-layer-type",
            id="rope-per-layer-type",
        ),
        pytest.param(
            {**BASE, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1.0}},
            "dynamic",
            id="rope-dynamic",
        ),
        pytest.param(
            {**BASE, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "low_freq_factor",
            id="llama3-missing-key",
        ),
        pytest.param({**BASE, "torch_dtype": "int8"}, "dtype='int8'", id="dtype"),
        pytest.param({**BASE, "hidden_act": "gelu"}, "hidden_act", id="activation"),
        pytest.param({**BASE, "attention_bias": True}, "attention_bias", id="bias"),
        pytest.param(
            {k: v for k, v in BASE.items() if k != "vocab_size"}, "vocab_size", id="missing-key"
        ),
        pytest.param({**BASE, "num_key_value_heads": 3}, "num_kv_heads", id="gqa"),
    ],
)
def test_unsupported_configs_raise(raw, match):
    with pytest.raises(ValueError, match=match):
        parse(raw)


def test_config_validation():
    cfg = parse(BASE)
    with pytest.raises(ValueError, match="head_dim"):
        dataclasses.replace(cfg, head_dim=7)
    with pytest.raises(ValueError, match="hidden_size"):
        dataclasses.replace(cfg, hidden_size=0)
    with pytest.raises(ValueError, match="dtype"):
        LlamaConfig(8, 8, 8, 1, 1, 1, 8, dtype="f32")


def test_config_without_architectures_reads_model_type():
    """No ``architectures``: ``model_type`` decides (llama, the default, is read; any other
    family is refused by name)."""
    bare = {k: v for k, v in BASE.items() if k != "architectures"}
    assert parse(bare) == parse(BASE)
    assert parse({k: v for k, v in bare.items() if k != "model_type"}) == parse(BASE)
    with pytest.raises(ValueError, match="model_type='mistral'"):
        parse({**bare, "model_type": "mistral"})


def test_tie_word_embeddings_defaults_to_false():
    """transformers' LlamaConfig default: a config.json without the key has its own LM head."""
    untied = {k: v for k, v in BASE.items() if k != "tie_word_embeddings"}
    assert parse(untied).tie_word_embeddings is False


SMALL = dict(
    vocab_size=16,
    hidden_size=8,
    intermediate_size=8,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
)


@pytest.mark.parametrize(
    "field,inside,outside,match",
    [
        pytest.param("num_layers", 1, True, "num_layers=True must be an int", id="bool"),
        pytest.param("rms_norm_eps", 1e-30, 0.0, "rms_norm_eps=0.0 must be", id="eps-0"),
        pytest.param("rope_theta", 1e30, float("inf"), "rope_theta=inf must be", id="theta-inf"),
        pytest.param("rope_theta", 1e30, float("nan"), "rope_theta=nan must be", id="theta-nan"),
        pytest.param("eos_token_ids", (0, 15), (3, 16), "eos_token_ids=", id="eos-at-vocab"),
    ],
)
def test_direct_config_boundaries(field, inside, outside, match):
    """A config built in code (not parsed) is checked at the boundary: the last value inside
    is accepted, the first outside is a ValueError naming the field."""
    assert getattr(LlamaConfig(**{**SMALL, field: inside}), field) == inside
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**{**SMALL, field: outside})


def test_rope_scaling_bounds():
    """factor > 0 and high_freq_factor > low_freq_factor > 0 (the smoothing divides by both
    ``high - low`` and ``low``)."""
    assert RopeScaling(1e-3, 1e-3, 1.001e-3, 64).factor == 1e-3
    with pytest.raises(ValueError, match="factor=0.0 must be > 0"):
        RopeScaling(0.0, 1.0, 4.0, 64)
    with pytest.raises(ValueError, match="high_freq_factor=4.0 must be > low_freq_factor=4.0"):
        RopeScaling(8.0, 4.0, 4.0, 64)
    with pytest.raises(ValueError, match="low_freq_factor=0.0 > 0"):
        RopeScaling(8.0, 0.0, 4.0, 64)


def _eagle3(**extra):
    raw = {
        **BASE,
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "draft_vocab_size": 32,
        "rope_theta": 500000.0,
        "rope_scaling": SCALING,
        **extra,
    }
    return parse_eagle3_config(raw)


def test_eagle3_config():
    cfg = _eagle3()
    assert isinstance(cfg, Eagle3Config) and cfg.draft_vocab_size == 32 and cfg.vocab_size == 128
    assert cfg.rope_scaling is not None and cfg.aux_layer_ids is None
    assert cfg.capture_layers(32) == (2, 16, 29)  # Llama-3.1-8B: sglang's default
    named = _eagle3(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 15, 28]})
    assert named.capture_layers(32) == (2, 16, 29)
    with pytest.raises(ValueError, match="capture_layers"):
        cfg.capture_layers(4)  # (2, 2, 1): not strictly increasing
    with pytest.raises(ValueError, match="capture_layers"):
        named.capture_layers(20)  # layer 29 >= 20
    with pytest.raises(ValueError, match="EAGLE-3"):
        parse_eagle3_config(BASE)
    assert _eagle3(draft_vocab_size=128).draft_vocab_size == 128  # the whole vocabulary
    with pytest.raises(ValueError, match="draft_vocab_size"):
        _eagle3(draft_vocab_size=129)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        _eagle3(num_hidden_layers=2)


def test_eagle3_target_hidden_size_must_equal_hidden_size():
    assert _eagle3(target_hidden_size=64) == _eagle3()
    with pytest.raises(ValueError, match="target_hidden_size=128 != hidden_size=64"):
        _eagle3(target_hidden_size=128)


def test_capture_layers_are_distinct_layers_below_the_depth():
    """Strictly increasing inside ``[0, N)``: layer N - 1 is the last one allowed, N is
    refused, and so is a layer named twice (sglang captures each layer once)."""
    named = _eagle3(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 15, 28]})
    assert named.capture_layers(30) == (2, 16, 29)
    with pytest.raises(ValueError, match="capture_layers"):
        named.capture_layers(29)  # layer 29 of a 29-layer target
    with pytest.raises(ValueError, match=r"capture_layers=\(2, 2, 2\)"):
        _eagle3().capture_layers(5)  # sglang's default (2, N // 2, N - 3) at N = 5


def test_generation_config_eos_takes_precedence(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 1}))
    assert load_llama_config(tmp_path).eos_token_ids == (1,)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": [1, 9], "do_sample": True})
    )
    cfg = load_llama_config(tmp_path, dtype="float32")
    assert cfg.eos_token_ids == (1, 9) and cfg.bos_token_ids == (0,) and cfg.dtype == "float32"
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    assert load_llama_config(tmp_path).eos_token_ids == (1,)


def test_read_eos_token_ids(tmp_path):
    """A directory's EOS ids without a parsed config (a foreign target's, in ``jspec generate``):
    generation_config.json first, else config.json, None where neither names one."""
    assert read_eos_token_ids(tmp_path) is None  # no file at all
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert read_eos_token_ids(tmp_path) == (5,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    assert read_eos_token_ids(tmp_path) == (5,)  # generation_config names none: config's
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert read_eos_token_ids(tmp_path) == (7, 8)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": None}))
    (tmp_path / "generation_config.json").write_text("{}")
    assert read_eos_token_ids(tmp_path) is None
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(ValueError, match=r"generation_config\.json.*eos_token_id='2'"):
        read_eos_token_ids(tmp_path)


def test_check_tensor_parallel():
    from jspec.models import LlamaTarget

    target = LlamaTarget(parse(BASE))  # 8 heads, 2 KV heads, MLP 96
    target.check_tensor_parallel(1)
    target.check_tensor_parallel(2)
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        target.check_tensor_parallel(4)
    with pytest.raises(ValueError, match="tensor_parallel=0"):
        target.check_tensor_parallel(0)
    with pytest.raises(ValueError, match="intermediate_size=99"):
        LlamaTarget(parse({**BASE, "intermediate_size": 99})).check_tensor_parallel(2)


# ---- issue 22: malformed config files name the file and the field ------------------------------
@pytest.mark.parametrize(
    "raw,match",
    [
        pytest.param(
            {**BASE, "hidden_size": None}, r"hidden_size is missing \(or null\)", id="null"
        ),
        pytest.param(
            {**BASE, "hidden_size": 16.9}, r"hidden_size=16\.9 must be an integer", id="float"
        ),
        pytest.param(
            {**BASE, "hidden_size": "64"}, r"hidden_size='64' must be an integer", id="str"
        ),
        pytest.param(
            {**BASE, "num_attention_heads": 0}, "num_attention_heads=0 must be", id="heads0"
        ),
        pytest.param({**BASE, "num_key_value_heads": 0}, "num_key_value_heads=0", id="kv0"),
        pytest.param(
            {**BASE, "hidden_size": 60}, "not a multiple of num_attention_heads", id="split"
        ),
        pytest.param(
            {**BASE, "rope_theta": "inf"}, "rope_theta='inf' must be a finite", id="theta-str"
        ),
        pytest.param(
            {**BASE, "rope_theta": float("inf")}, "rope_theta=inf must be a finite", id="inf"
        ),
        pytest.param({**BASE, "rms_norm_eps": float("nan")}, "rms_norm_eps=nan", id="eps-nan"),
        pytest.param(
            {**BASE, "rope_scaling": [1]},
            r"rope_scaling=\[1\] must be a JSON object",
            id="rope-list",
        ),
        pytest.param(
            {**BASE, "rope_scaling": {**SCALING, "factor": "8"}},
            r"rope_scaling\.factor='8' must be a finite number",
            id="rope-factor-str",
        ),
        pytest.param(
            {**BASE, "tie_word_embeddings": "false"}, "tie_word_embeddings='false'", id="bool"
        ),
        pytest.param(
            {**BASE, "architectures": "LlamaForCausalLM"},
            "architectures=.* must be a list of strings",
            id="arch-str",
        ),
        pytest.param(
            {**BASE, "architectures": ["LlamaForCausalLM", 3]},
            "architectures=.* must be a list of strings",
            id="arch-list-int",
        ),
        pytest.param(
            {**BASE, "eos_token_id": 128}, r"eos_token_id=128: id 128 is outside", id="eos-oov"
        ),
        pytest.param({**BASE, "bos_token_id": [0, -1]}, "bos_token_id=", id="bos-negative"),
        pytest.param({**BASE, "eos_token_id": 1.5}, "eos_token_id=", id="eos-float"),
    ],
)
def test_malformed_fields_name_the_field(raw, match):
    with pytest.raises(ValueError, match=match):
        parse(raw)


@pytest.mark.parametrize(
    "extra,match",
    [
        pytest.param({"eagle_config": [1, 2]}, "eagle_config=", id="eagle-config-list"),
        pytest.param(
            {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, "x", 3]}},
            r"eagle_config\.eagle_aux_hidden_state_layer_ids=",
            id="aux-ids",
        ),
        pytest.param({"draft_vocab_size": 0}, "draft_vocab_size=0", id="draft-vocab-0"),
        pytest.param({"target_hidden_size": 64.5}, "target_hidden_size=64.5", id="target-hidden"),
    ],
)
def test_malformed_eagle3_fields(extra, match):
    with pytest.raises(ValueError, match=match):
        _eagle3(**extra)


@pytest.mark.parametrize(
    "file,text,match",
    [
        pytest.param("config.json", "[]", "expected a JSON object.*got a list", id="config-list"),
        pytest.param(
            "config.json", "{,", r"not valid JSON \(.* line 1 column 2\)", id="config-json"
        ),
        pytest.param("config.json", b"\xff{}", "not UTF-8", id="config-bytes"),
        pytest.param(
            "config.json",
            '{"vocab_size": 1, "vocab_size": 2}',
            "duplicate key 'vocab_size'",
            id="duplicate-key",
        ),
        pytest.param("generation_config.json", "{,", "not valid JSON", id="generation-json"),
        pytest.param(
            "generation_config.json", '{"eos_token_id": 999}', "eos_token_id=999", id="gen-eos"
        ),
        pytest.param("generation_config.json", "[1]", "got a list", id="generation-list"),
    ],
)
def test_bad_files_name_the_file(tmp_path, file, text, match):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    path = tmp_path / file
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=match) as info:
        load_llama_config(tmp_path)
    assert str(info.value).startswith(str(path) + ": "), info.value
