"""``jspec generate`` on tiny Hugging Face checkpoints (issue 12 §4): greedy ids equal
``transformers``' ``generate(do_sample=False)``; spec ids with an EAGLE-3 head equal them too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from models_helpers import eagle3_config, eagle3_tensors, save_hf_llama, write_head

from jspec.apps.generate import main

PROMPT = [1, 17, 40, 5, 88, 23, 9]
MAX_NEW = 10


def _hf_greedy(model) -> list[int]:
    import torch

    ids = torch.tensor([PROMPT])
    out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    gen = out[0, len(PROMPT) :].tolist()
    stops = [i for i, t in enumerate(gen) if t in (2, 3)]  # TINY's eos_token_id = [2, 3]
    return gen[: stops[0] + 1] if stops else gen


def _generate(capsys, *flags, prompt=PROMPT) -> dict:
    code = main(
        [
            "--prompt-ids",
            " ".join(map(str, prompt)),
            "--max-new-tokens",
            str(MAX_NEW),
            "--page-size",
            "4",
            "--topk",
            "2",
            "--steps",
            "3",
            "--draft-tokens",
            "6",
            "--json",
            "--no-progress",
            *flags,
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out.strip().splitlines()[-1])


@pytest.mark.parametrize("shards", [None, "2KB"], ids=["single", "sharded"])
def test_generate_greedy_and_eagle3_spec_equal_transformers(tmp_path, capsys, shards):
    model = save_hf_llama(tmp_path / "target", max_shard_size=shards)
    want = _hf_greedy(model)
    greedy = _generate(capsys, "--model", str(tmp_path / "target"))
    assert greedy["mode"] == "greedy" and greedy["token_ids"] == want
    # 4 target layers: sglang's default capture [2, N//2, N-3] collides; name the layers.
    config = eagle3_config(
        torch_dtype="float32", eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    )
    head = write_head(tmp_path / "head", eagle3_tensors(3), config)
    spec = _generate(capsys, "--model", str(tmp_path / "target"), "--draft", str(head))
    assert spec["mode"] == "spec" and spec["token_ids"] == want
    assert spec["mean_accept_len"] >= 1.0 and np.isfinite(spec["tokens_per_s"])


def test_generate_matched_eagle3_head_accepts_well(tmp_path, capsys):
    """The demo's acceptance story with EAGLE-3 (issue 12 §4): a head constructed to draft its
    target (jspec.models.synthetic.matched_eagle3) accepts > 1.5 tokens per step through
    ``jspec generate`` from saved HF directories, and stays lossless."""
    from jspec.models import LlamaConfig, LlamaTarget
    from jspec.models.export import save_eagle3, save_llama
    from jspec.models.synthetic import matched_eagle3, toy_llama_params

    target = LlamaTarget(
        LlamaConfig(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=96,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
        )
    )
    params = toy_llama_params(target, seed=4)
    draft, head = matched_eagle3(target, params, draft_vocab_size=48, seed=1)
    save_llama(tmp_path / "target", target, params)
    save_eagle3(tmp_path / "head", draft, head, num_target_layers=target.num_layers)
    flags = ("--model", str(tmp_path / "target"), "--ignore-eos")
    prompt = [3, 17, 40, 5, 28, 23, 9]
    greedy = _generate(capsys, *flags, prompt=prompt)
    spec = _generate(capsys, *flags, "--draft", str(tmp_path / "head"), prompt=prompt)
    assert spec["token_ids"] == greedy["token_ids"] and len(spec["token_ids"]) == MAX_NEW
    assert spec["mean_accept_len"] > 1.5, spec


def test_generate_tensor_parallel_2_compiles_on_sharded_shapes_and_matches(tmp_path, capsys):
    """--tensor-parallel 2 (two CPU host devices, a fresh process): the engine compiles on the
    weights' shapes with their shardings while they load, then decodes transformers' ids."""
    import subprocess

    model = save_hf_llama(tmp_path / "target")
    want = _hf_greedy(model)
    config = eagle3_config(
        torch_dtype="float32", eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    )
    head = write_head(tmp_path / "head", eagle3_tensors(3), config)
    flags = ["--prompt-ids", " ".join(map(str, PROMPT)), "--max-new-tokens", str(MAX_NEW)]
    flags += ["--page-size", "4", "--topk", "2", "--steps", "3", "--draft-tokens", "6"]
    flags += ["--model", str(tmp_path / "target"), "--draft", str(head), "--tensor-parallel", "2"]
    run = subprocess.run(
        [sys.executable, "-m", "jspec.cli", "generate", *flags, "--json", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu", "JSPEC_COMPILATION_CACHE": "0"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["mode"] == "spec" and result["token_ids"] == want
