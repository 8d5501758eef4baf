"""Issue 22: every bad input of ``jspec generate`` / ``jspec demo`` is one line on stderr naming
the file and the field (or the flag), exit status 2, before a weight is read or anything
compiles; resource flags are bounded; both CLIs accept every attention impl the README names."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_helpers import DRAFT, TARGET, tiny_model
from models_helpers import TARGET as E3_TARGET
from models_helpers import eagle3_config, eagle3_tensors, write_head
from test_checkpoint_errors import RAW, llama_tensors, write_llama

from jspec.apps import demo, generate
from jspec.apps import memory as memory_mod
from jspec.apps._cli import KERNEL_FLAGS, MAX_HOST_DEVICES, kernel_choices
from jspec.engine import KERNEL_CHOICES
from jspec.models import _load

ARGS = ["--prompt-ids", "1 2 3", "--max-new-tokens", "4", "--no-progress"]


@pytest.fixture
def no_weight_read_no_compile(monkeypatch):
    """Fail loudly (a traceback, not exit 2) if a weight is read or an engine is built."""

    def read(*args, **kwargs):
        raise AssertionError("a weight was read")

    def engine(*args, **kwargs):
        raise AssertionError("an engine was built")

    monkeypatch.setattr(_load.Plan, "read", read)
    monkeypatch.setattr("jspec.engine.scheduler.Engine", engine)


def _one_line(code, err, prog, *patterns):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"jspec {prog}: error: "), err
    for pattern in patterns:
        assert re.search(pattern, lines[0]), (pattern, lines[0])


def _model(tmp_path, raw=RAW, shards=1):
    directory = tmp_path / "model"
    directory.mkdir(exist_ok=True)
    return write_llama(directory, llama_tensors(), raw, shards=shards)


def _gen(capsys, model, *flags):
    code = generate.main(["--model", str(model), *flags])
    return code, capsys.readouterr().err


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# (how to break a good directory, patterns the error line must show)
BAD_TARGETS = {
    "zero-byte": (
        lambda d: (d / "model.safetensors").write_bytes(b""),
        [r"model\.safetensors: not a readable safetensors file"],
    ),
    "truncated": (
        lambda d: _truncate(d / "model.safetensors"),
        [r"model\.safetensors: not a readable safetensors file"],
    ),
    "bad-header": (
        lambda d: (d / "model.safetensors").write_bytes(b'\x08\0\0\0\0\0\0\0{"a":1}'),
        [r"model\.safetensors: not a readable safetensors file"],
    ),
    "config-list": (
        lambda d: (d / "config.json").write_text("[]"),
        [r"config\.json: expected a JSON object"],
    ),
    "config-json": (
        lambda d: (d / "config.json").write_text("{,"),
        [r"config\.json: not valid JSON \(.*line 1 column 2\)"],
    ),
    "rope-scaling-list": (
        lambda d: (d / "config.json").write_text(json.dumps({**RAW, "rope_scaling": [8]})),
        [r"config\.json: rope_scaling=\[8\] must be a JSON object"],
    ),
    "heads-0": (
        lambda d: (d / "config.json").write_text(json.dumps({**RAW, "num_attention_heads": 0})),
        [r"config\.json: num_attention_heads=0"],
    ),
    "hidden-null": (
        lambda d: (d / "config.json").write_text(json.dumps({**RAW, "hidden_size": None})),
        [r"config\.json: hidden_size is missing \(or null\)"],
    ),
    "hidden-float": (
        lambda d: (d / "config.json").write_text(json.dumps({**RAW, "hidden_size": 16.9})),
        [r"config\.json: hidden_size=16\.9 must be an integer"],
    ),
    "theta-inf": (
        lambda d: (d / "config.json").write_text(json.dumps({**RAW, "rope_theta": "inf"})),
        [r"config\.json: rope_theta='inf' must be a finite number"],
    ),
    "eos-oov": (
        lambda d: (d / "config.json").write_text(json.dumps({**RAW, "eos_token_id": 50})),
        [r"config\.json: eos_token_id=50: id 50 is outside the vocabulary"],
    ),
    "generation-config-json": (
        lambda d: (d / "generation_config.json").write_text("{,"),
        [r"generation_config\.json: not valid JSON"],
    ),
    "tokenizer": (
        lambda d: (d / "tokenizer.json").write_text("{not json"),
        [r"tokenizer\.json: not a readable tokenizers file"],
    ),
    "extra-layer": (
        lambda d: write_llama(
            d, {**llama_tensors(), "model.layers.2.input_layernorm.weight": np.ones(16, "f4")}
        ),
        [r"'model\.layers\.2\.input_layernorm\.weight' in model\.safetensors is for layer 2"],
    ),
}
BAD_INDEXES = {
    "index-list": ("[]", [r"model\.safetensors\.index\.json: expected a JSON object"]),
    "index-no-weight-map": ("{}", [r"index\.json: weight_map must be an object.*got nothing"]),
    "index-traversal": (
        json.dumps({"weight_map": {"model.norm.weight": "../../elsewhere/x.safetensors"}}),
        [r"index\.json: weight_map\['model\.norm\.weight'\]='\.\./\.\./elsewhere/x\.safetensors'"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_TARGETS))
def test_generate_bad_target_directory(tmp_path, capsys, case, no_weight_read_no_compile):
    model = _model(tmp_path)
    breaker, patterns = BAD_TARGETS[case]
    breaker(model)
    code, err = _gen(capsys, model, *ARGS)
    _one_line(code, err, "generate", *patterns)


def test_generate_prompt_id_outside_the_vocab_before_the_weights(
    tmp_path, capsys, no_weight_read_no_compile
):
    code, err = _gen(capsys, _model(tmp_path), "--prompt-ids", "1 2 50", "--max-new-tokens", "2")
    _one_line(code, err, "generate", r"prompt 0\[2\]=50 is outside the vocabulary")


@pytest.mark.parametrize("flag", ["--model", "--draft"])
def test_generate_missing_directory_is_named_first(
    tmp_path, capsys, flag, no_weight_read_no_compile
):
    """A path that is no directory is named as such, not as a missing tokenizer.json."""
    model = _model(tmp_path) if flag == "--draft" else tmp_path / "nowhere"
    extra = ["--draft", str(tmp_path / "nowhere")] if flag == "--draft" else []
    code, err = _gen(capsys, model, *extra, "--prompt", "hi", "--max-new-tokens", "2")
    _one_line(code, err, "generate", rf"{flag} \S*nowhere: no such directory")


@pytest.mark.parametrize("case", sorted(BAD_INDEXES))
def test_generate_bad_index(tmp_path, capsys, case, no_weight_read_no_compile):
    model = _model(tmp_path, shards=2)
    text, patterns = BAD_INDEXES[case]
    (model / "model.safetensors.index.json").write_text(text)
    code, err = _gen(capsys, model, *ARGS)
    _one_line(code, err, "generate", *patterns)


@pytest.mark.parametrize("case", ["eagle-config-list", "malicious-bin"])
def test_generate_bad_draft_directory(tmp_path, capsys, case, no_weight_read_no_compile):
    raw = {**RAW, "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 8, "head_dim": 12}
    tensors = llama_tensors(hid=32, vocab=96, layers=8, qd=48, kvd=24)
    model = _model(tmp_path, raw)
    write_llama(model, tensors, raw)  # E3_TARGET's geometry, for models_helpers' EAGLE-3 head
    head = tmp_path / "head"
    if case == "eagle-config-list":
        write_head(head, eagle3_tensors(), eagle3_config(eagle_config=[1, 2, 3]))
        patterns = [r"head/config\.json: eagle_config=\[1, 2, 3\] must be a JSON object"]
    else:
        torch = pytest.importorskip("torch")
        marker = tmp_path / "pwned"

        class Evil:
            def __reduce__(self):
                return (open, (str(marker), "w"))

        head.mkdir()
        (head / "config.json").write_text(json.dumps(eagle3_config()))
        torch.save({"fc.weight": Evil()}, head / "pytorch_model.bin")
        patterns = [r"pytorch_model\.bin: refused by torch\.load\(weights_only=True\)"]
    assert E3_TARGET.num_layers == 8 and E3_TARGET.head_dim == 12
    code, err = _gen(capsys, model, "--draft", str(head), *ARGS)
    _one_line(code, err, "generate", *patterns)
    assert not (tmp_path / "pwned").exists()


def test_generate_nan_weight_is_one_line_before_the_engine_runs(tmp_path, capsys, monkeypatch):
    # The engine may already compile against the weights' shapes (in the background, while
    # they load), but nothing runs on them: warmup, which runs the first executable, is never
    # reached.
    def never(*args, **kwargs):
        raise AssertionError("the engine ran with weights that hold NaN")

    monkeypatch.setattr("jspec.engine.scheduler.Engine.warmup", never)
    monkeypatch.setattr("jspec.engine.scheduler.Engine.set_weights", never)
    tensors = llama_tensors()
    tensors["model.layers.0.self_attn.o_proj.weight"][1, 2] = np.nan
    model = tmp_path / "model"
    model.mkdir()
    write_llama(model, tensors)
    code, err = _gen(capsys, model, *ARGS)
    _one_line(code, err, "generate", r"'model\.layers\.0\.self_attn\.o_proj\.weight' in "
              r"model\.safetensors holds NaN or Inf")  # fmt: skip


def test_generate_prompt_not_utf8_before_the_weights(tmp_path, capsys, no_weight_read_no_compile):
    from test_tokenizer import _write

    model = _write(_model(tmp_path))
    bad = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")  # latin-1 bytes in argv
    code, err = _gen(capsys, model, "--prompt", bad, "--max-new-tokens", "2")
    _one_line(code, err, "generate", r"--prompt is not valid UTF-8 \(at character 3")


@pytest.mark.parametrize(
    "flags,pattern",
    [
        pytest.param(["--prompt-ids", "1_0"], r"'1_0' is not an integer", id="underscore"),
        pytest.param(["--prompt-ids", "١"], r"'١' is not an integer", id="arabic-digit"),
        pytest.param(["--prompt-ids", "+1"], r"'\+1' is not an integer", id="plus"),
        pytest.param(["--steps", "100000"], r"--steps=100000 must be <= 16", id="steps"),
        pytest.param(["--page-size", "1048576"], r"--page-size=1048576 must be <= 256", id="page"),
        pytest.param(["--draft-tokens", "2000"], r"--draft-tokens=2000 must be <= 1024", id="ndt"),
        pytest.param(
            ["--max-new-tokens", "100000000"],
            r"3 \+ 100000000 exceeds the model's max_position_embeddings=2048",
            id="max-new",
        ),
        pytest.param(
            ["--devices", str(MAX_HOST_DEVICES + 1)],
            rf"= {MAX_HOST_DEVICES + 1} CPU host devices: at most {MAX_HOST_DEVICES}"
            if jax.default_backend() == "cpu"
            else rf"= {MAX_HOST_DEVICES + 1} devices: only \d+ JAX device",  # the GPUs there are
            id="devices",
        ),
        pytest.param(
            ["--topk", "65"], r"--topk=65 must be <= the draft's vocab_size=64", id="topk"
        ),
        pytest.param(["--max-rounds", "0"], r"--max-rounds=0 must be >= 1", id="max-rounds"),
    ],
)
def test_generate_bad_flags_fail_fast(capsys, flags, pattern):
    t0 = time.perf_counter()
    argv = ["--model", "toy", "--draft", "toy", "--prompt-ids", "1 2 3", "--max-new-tokens", "4"]
    code = generate.main([*argv, "--no-progress", *flags], loader=_toy_loader)
    _one_line(code, capsys.readouterr().err, "generate", pattern)
    assert time.perf_counter() - t0 < 10.0


def _toy_loader(model_dir, draft_dir, dtype, say):
    del model_dir, dtype, say
    params, draft = tiny_model()
    return (TARGET, params, DRAFT, draft) if draft_dir else (TARGET, params, None, None)


def test_memory_estimate_refuses_with_the_numbers(tmp_path, capsys, monkeypatch):
    """A context sized for 10**7 new tokens (the model allows it): refused before the weights
    load, with the estimate against the free memory."""
    monkeypatch.setattr(memory_mod, "available_memory", lambda: (2 << 30, "the test host", True))
    model = _model(tmp_path, {**RAW, "max_position_embeddings": 1 << 30})
    monkeypatch.setattr(_load.Plan, "read", lambda *a: pytest.fail("a weight was read"))
    code, err = _gen(capsys, model, "--prompt-ids", "1 2 3", "--max-new-tokens", "10000000")
    _one_line(
        code,
        err,
        "generate",
        r"this run needs about [0-9.]+ GiB \(weights .* \+ KV pools [0-9.]+ GiB \+ bookkeeping "
        r".* \+ workspace .*\), more than the 2\.00 GiB free on the test host",
    )


def test_memory_estimate_counts_pools_and_weights():
    from jspec.engine.state import make_engine_config

    ecfg = make_engine_config(TARGET, page_size=16, context_len=256, max_running_requests=4)
    est = memory_mod.estimate_memory(ecfg, TARGET, DRAFT, weight_bytes=1000)
    s = ecfg.spec
    per_slot = 2 * TARGET.num_kv_heads * TARGET.head_dim * 4  # K and V, f32
    assert est.kv_pools == s.num_slots * per_slot * (TARGET.num_layers + DRAFT.num_layers)
    assert est.weights == 1000 and est.workspace > 0 and est.total > est.kv_pools
    memory_mod.check_memory(est, num_devices=1, limit=(est.total, "x", False))
    with pytest.raises(ValueError, match="more than the"):
        memory_mod.check_memory(est, num_devices=2, limit=(est.total, "x", True))


def test_demo_bad_weights_and_context(tmp_path, capsys, no_weight_read_no_compile):
    model = _model(tmp_path)
    (model / "model.safetensors").write_bytes(b"")
    assert demo.main(["--weights", str(model), "--no-progress"]) == 2
    _one_line(2, capsys.readouterr().err, "demo", r"model\.safetensors: not a readable")
    assert demo.main(["--max-new-tokens", str(10**7), "--no-progress"]) == 2
    _one_line(2, capsys.readouterr().err, "demo", r"exceeds the model's max_position_embeddings")
    assert demo.main(["--steps", "100000"]) == 2
    _one_line(2, capsys.readouterr().err, "demo", r"--steps=100000 must be <= 16")


def test_both_clis_accept_every_kernel_impl_the_engine_has():
    """One flag per kernel family of the policy; each accepts "auto" and every impl the policy
    (and the README) names for it."""
    assert {family for _dest, family, _text in KERNEL_FLAGS.values()} == set(KERNEL_CHOICES)
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for flag, (dest, family, _text) in KERNEL_FLAGS.items():
        assert kernel_choices(flag) == ("auto",) + KERNEL_CHOICES[family]
        named = re.search(rf"`{flag}\s+([a-z|]+)`", readme).group(1).split("|")
        assert set(named) == set(kernel_choices(flag)), flag
        for impl in kernel_choices(flag):
            args = demo._parser().parse_args([flag, impl])
            assert getattr(args, dest) == impl
            args = generate._parser().parse_args(
                ["--model", "m", "--prompt-ids", "1", "--max-new-tokens", "1", flag, impl]
            )
            assert getattr(args, dest) == impl


def test_every_kernel_flag_reaches_make_engine_config_as_its_dest(monkeypatch):
    """engine_config_from_args passes each KERNEL_FLAGS value by the keyword its dest names."""
    import jspec.engine.state as state
    from jspec.apps._cli import engine_config_from_args

    seen = {}

    class Stop(Exception):
        pass

    def make_engine_config(target, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(state, "make_engine_config", make_engine_config)
    argv = ["--model", "x", "--prompt-ids", "1"]
    for flag, (dest, _family, _text) in KERNEL_FLAGS.items():
        argv += [flag, f"value-of-{dest}"]
    args = generate._parser().parse_args(argv)
    with pytest.raises(Stop):
        engine_config_from_args(
            args, TARGET, None, context_len=64, max_running_requests=1, max_prompt_len=8
        )
    for dest, _family, _text in KERNEL_FLAGS.values():
        assert seen[dest] == f"value-of-{dest}", dest


@pytest.mark.parametrize("flag", list(KERNEL_FLAGS))
def test_bad_kernel_impl_is_one_line(flag, capsys, no_weight_read_no_compile):
    assert demo.main([flag, "cuda"]) == 2
    _one_line(2, capsys.readouterr().err, "demo", rf"{flag}='cuda' must be one of auto\|")
    code, err = _gen(capsys, "m", "--prompt-ids", "1", "--max-new-tokens", "1", flag, "cuda")
    _one_line(code, err, "generate", rf"{flag}='cuda' must be one of auto\|")


GPU_ONLY_FLAGS = [
    (flag, impl)
    for flag, (_dest, family, _text) in KERNEL_FLAGS.items()
    for impl in KERNEL_CHOICES[family]
    if impl in ("triton", "cudnn")
]


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the GPU runs these kernels")
@pytest.mark.parametrize("flag,impl", GPU_ONLY_FLAGS)
def test_gpu_only_kernel_off_the_gpu_is_one_line_before_the_weights(
    tmp_path, capsys, flag, impl, no_weight_read_no_compile
):
    """A kernel flag naming a GPU-only kernel (jax-triton's launches, cuDNN) on a CPU backend:
    one line naming the keyword, exit 2, before any weight is read or engine built (it was a
    traceback from the first trace: the op's own ValueError, rc 1)."""
    keyword = KERNEL_FLAGS[flag][0]
    code, err = _gen(capsys, _model(tmp_path), *ARGS, flag, impl)
    _one_line(code, err, "generate", rf"{keyword}='{impl}'")
    assert demo.main([flag, impl, "--no-progress"]) == 2
    _one_line(2, capsys.readouterr().err, "demo", rf"{keyword}='{impl}'")


def test_launch_hints_shorter_than_the_prompts_are_dropped(monkeypatch):
    """Decode launch hints no dispatch of these prompts could use are not compiled (the config
    of a GPU run: the backend check that refuses "triton" on CPU is off here)."""
    from jspec.apps._cli import engine_config_from_args
    from jspec.engine import EngineConfig

    monkeypatch.setattr(EngineConfig, "check_backend", lambda self: None)

    argv = ["--model", "x", "--prompt-ids", "1", "--attention-impl", "triton"]
    args = generate._parser().parse_args(argv)

    def hints(shortest: int) -> tuple[int, ...]:
        return engine_config_from_args(
            args,
            TARGET,
            None,
            context_len=10_000,
            max_running_requests=1,
            max_prompt_len=9_000,
            shortest_prompt=shortest,
        ).kv_len_buckets

    assert [hints(n) for n in (0, 600, 5000, 9000)] == [
        (512, 2048, 8192),
        (2048, 8192),
        (8192,),
        (),
    ]
