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
    gen = out[0, len(PROMPT):].tolist()
    stops = [i for i, t in enumerate(gen) if t in (2, 3)]  # TINY's eos_token_id = [2, 3]
    return gen[:stops[0] + 1] if stops else gen


def _generate(capsys, *flags) -> dict:
    code = main(["--prompt-ids", " ".join(map(str, PROMPT)), "--max-new-tokens", str(MAX_NEW),
                 "--page-size", "4", "--topk", "2", "--steps", "3", "--draft-tokens", "6",
                 "--json", "--no-progress", *flags])
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
    config = eagle3_config(torch_dtype="float32",
                           eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    head = write_head(tmp_path / "head", eagle3_tensors(3), config)
    spec = _generate(capsys, "--model", str(tmp_path / "target"), "--draft", str(head))
    assert spec["mode"] == "spec" and spec["token_ids"] == want
    assert spec["mean_accept_len"] >= 1.0 and np.isfinite(spec["tokens_per_s"])
