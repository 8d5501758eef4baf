"""Adaptive speculation: the policy's decisions, and plain steps interleaved with spec steps in
a spec engine (the draft kept current) giving exactly the greedy tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
from engine_helpers import (
    CONTEXT_LEN,
    MAX_NEW,
    MAX_PROMPT,
    TINY,
    greedy_baseline,
    tiny_engine,
    tiny_prompts,
)

from jspec.engine.scheduler import SpecPolicy
from jspec.engine.state import make_engine_config


def _ecfg():
    return make_engine_config(
        TINY,
        page_size=16,
        topk=4,
        num_steps=3,
        num_draft_tokens=8,
        context_len=CONTEXT_LEN,
        max_running_requests=4,
        max_prompt_len=MAX_PROMPT,
        batch_buckets=(4,),
    )


def _feed(policy: SpecPolicy, kind: str, accept: float, per_round: float, n: int = 1) -> None:
    for _ in range(n):
        policy.observe(kind == "plain", 4, 4 * per_round, accept)


def test_policy_speculates_while_it_pays_and_probes_while_plain():
    p = SpecPolicy()
    assert p.choose() == "spec"  # warmup: measure first
    _feed(p, "spec", 3.5, 6e-3, n=3)
    assert p.choose() == "spec"  # acceptance high: never tries plain
    q = SpecPolicy()
    _feed(q, "spec", 1.1, 6e-3, n=3)  # a poor draft: try a plain dispatch (twice: 1st untimed)
    assert q.choose() == "plain"
    _feed(q, "plain", 1.0, 4e-3, n=2)
    assert q.gain is not None and q.gain < 1.0  # 1.1 * 4 / 6
    decisions = []
    for _ in range(2 * q.probe_every + 2):
        kind = q.choose()
        decisions.append(kind)
        _feed(q, kind, 1.0 if kind == "plain" else 1.1, 4e-3 if kind == "plain" else 6e-3)
    assert decisions.count("spec") == 2  # one probe per probe_every plain dispatches
    r = dataclasses.replace(q)
    _feed(r, "spec", 3.8, 6e-3, n=8)  # the draft starts matching: back to spec
    assert r.gain > 1.0 and r.choose() == "spec"


class _Alternate(SpecPolicy):
    """Plain and spec dispatches in turn (tests the interleaving, not the policy)."""

    def choose(self) -> str:
        return "plain" if (self.spec_dispatches + self.plain_dispatches) % 2 else "spec"


def test_plain_and_spec_steps_interleave_losslessly():
    engine = tiny_engine(_ecfg(), check_every_step=True, max_rounds=2)
    engine.policy = _Alternate()
    out, stats = engine.generate(tiny_prompts(), MAX_NEW)
    assert out == [list(o) for o in greedy_baseline()]
    assert stats.leak_check.startswith("ok")
    kinds = {k for k, _ in stats.policy}
    assert kinds == {"spec", "plain"}
    # The draft stayed current through the plain steps: spec rounds still accept multi-token.
    assert np.mean(stats.accept_lens) > 1.3, stats.accept_lens


def test_adaptive_is_opt_in_and_spec_only():
    assert tiny_engine(_ecfg()).policy is None  # default: every round speculates
    assert isinstance(tiny_engine(_ecfg(), adaptive=True).policy, SpecPolicy)
    assert tiny_engine(_ecfg(), spec=False, adaptive=True).policy is None
