"""``jspec demo`` from checkpoint directories: ``--weights DIR`` (a HF Llama directory, its
config.json replacing the model flags) and ``--draft-weights DIR`` (an EAGLE-3 head), both read
by jspec.models' one loader; the toy path is covered by tests/engine/test_engine_demo.py."""

from __future__ import annotations

from jspec.apps.demo import main
from jspec.models import LlamaConfig, LlamaTarget, save_eagle3, save_llama
from jspec.models.synthetic import matched_eagle3, toy_llama_params

RUN_ARGS = [
    "--num-prompts",
    "2",
    "--max-new-tokens",
    "8",
    "--max-running",
    "1",
    "--page-size",
    "4",
    "--topk",
    "2",
    "--steps",
    "2",
    "--draft-tokens",
    "3",
    "--no-progress",
]


def test_demo_from_checkpoint_directories(tmp_path, capsys):
    target = LlamaTarget(
        LlamaConfig(
            vocab_size=48,
            hidden_size=32,
            intermediate_size=48,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
        )
    )
    params = toy_llama_params(target, 3, residual_scale=1.0)
    draft, head = matched_eagle3(target, params)
    save_llama(tmp_path / "target", target, params)
    save_eagle3(tmp_path / "draft", draft, head, num_target_layers=target.num_layers)
    argv = ["--weights", str(tmp_path / "target"), "--draft-weights", str(tmp_path / "draft")]
    # The model flags disagree with the checkpoint: its config.json wins.
    assert main(argv + ["--vocab-size", "512", *RUN_ARGS]) == 0
    out = capsys.readouterr().out
    assert "model: vocab 48, hidden 32, 4 layers" in out, out
    assert "Eagle3Draft draft head" in out, out
    assert "lossless check: PASS" in out, out
    assert "allocator balance: spec ok" in out, out


def test_demo_missing_checkpoint_is_one_error_line(tmp_path, capsys):
    assert main(["--weights", str(tmp_path / "nowhere"), *RUN_ARGS]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jspec demo: error:") and "nowhere" in err, err
