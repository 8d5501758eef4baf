"""examples/custom_model.py: a model defined outside jspec (plain JAX) behind the protocol, with
an EAGLE-3-style draft (captured aux feature, smaller draft vocab + d2t), is lossless through
the public step functions."""

from __future__ import annotations

import pathlib
import runpy

import numpy as np


def test_custom_model_example_is_lossless(capsys):
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "custom_model.py"
    ns = runpy.run_path(str(path))
    target, draft = ns["MyTarget"](), ns["MyDraft"]()
    assert draft.vocab_size < target.vocab_size and len(draft.capture_layers) == 2
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, target.vocab_size, n).tolist() for n in (4, 9)]
    greedy, _ = ns["run"](prompts, 12, spec=False)
    spec, accept_lens = ns["run"](prompts, 12, spec=True)
    assert spec == greedy
    # The draft is right often enough that multi-token accepts happen, wrong often enough
    # that some path is cut short (steps 3: at most 4 tokens per step).
    assert max(accept_lens) > 1 and min(accept_lens) < 4, accept_lens
    # Spec tokens outside the draft vocabulary can only come from the target (bonus tokens).
    hot = set((np.arange(draft.vocab_size) + np.asarray(ns["init_models"]()[3]["d2t"])).tolist())
    assert len(hot) == draft.vocab_size and max(hot) < target.vocab_size
