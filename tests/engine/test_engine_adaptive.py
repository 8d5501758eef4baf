"""Adaptive speculation: the policy's decisions, and plain steps interleaved with spec steps in
a spec engine (the draft kept current) giving exactly the greedy tokens."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
from engine_helpers import (
    CONTEXT_LEN,
    DRAFT,
    MAX_NEW,
    MAX_PROMPT,
    TARGET,
    TINY,
    greedy_baseline,
    tiny_engine,
    tiny_model,
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
        rounds = 1 if kind == "probe" else 4
        policy.observe(kind, rounds, rounds * per_round, accept)


def _run(policy: SpecPolicy, n: int, accept: float) -> list[str]:
    """``n`` decisions, each fed back with ``accept`` (spec / probe) or 1 (plain / greedy)."""
    decisions = []
    for _ in range(n):
        kind = policy.choose()
        decisions.append(kind)
        spec = kind in ("spec", "probe")
        _feed(policy, kind, accept if spec else 1.0, 6e-3 if spec else 4e-3)
    return decisions


def test_policy_speculates_while_it_pays():
    p = SpecPolicy()
    assert p.choose() == "spec"  # warmup: measure first
    _feed(p, "spec", 3.5, 6e-3, n=3)
    assert p.choose() == "spec" and p.pays is None  # acceptance high: never tries plain
    assert _run(p, 10, 3.5) == ["spec"] * 10


def test_policy_probes_with_backoff_then_retires_the_draft():
    q = SpecPolicy()
    _feed(q, "spec", 1.1, 6e-3, n=3)  # a poor draft: try a plain dispatch (twice: 1st untimed)
    assert q.choose() == "plain"
    _feed(q, "plain", 1.0, 4e-3, n=2)
    assert q.gain is not None and q.gain < 1.0 and q.pays is False  # 1.1 * 4 / 6
    decisions = _run(q, 2 + 4 + 1 + 8 + 1 + 3, 1.1)
    # plain until probe_every in a row, one probe round; the interval doubles; the second
    # failed probe retires the draft: target-only rounds from then on.
    assert decisions == ["plain"] * 2 + ["probe"] + ["plain"] * 8 + ["probe"] + ["greedy"] * 7
    assert q.retired and q.failed_probes == 2


def test_policy_goes_plain_at_once_when_nothing_is_accepted():
    p = SpecPolicy()
    _feed(p, "spec", 1.0, 6e-3)  # first dispatch: nothing accepted, no timing needed
    assert p.pays is False and p.choose() == "plain"


def test_policy_a_probe_that_pays_goes_back_to_spec():
    r = SpecPolicy()
    _feed(r, "spec", 1.1, 6e-3, n=3)
    _feed(r, "plain", 1.0, 4e-3, n=2 + r.probe_every)
    assert r.choose() == "probe"
    _feed(r, "probe", 3.8, 6e-3)  # the draft starts matching
    assert r.pays and r.choose() == "spec" and r.failed_probes == 0
    assert r.probe_interval is None  # the configured interval again
    with pytest.raises(ValueError, match="kind"):
        r.observe("bogus", 1, 1.0, 1.0)


def test_policy_backoff_starts_from_the_configured_interval():
    q = SpecPolicy(probe_every=3, retire_after=3)
    _feed(q, "spec", 1.05, 6e-3, n=3)
    _feed(q, "plain", 1.0, 4e-3, n=2)
    assert _run(q, 1 + 1 + 6 + 1, 1.05) == ["plain"] + ["probe"] + ["plain"] * 6 + ["probe"]
    assert q.probe_interval == 12 and q.probe_every == 3 and not q.retired


def test_policy_retires_a_draft_that_never_matched_at_its_first_failed_probe():
    never = SpecPolicy()
    _feed(never, "spec", 1.0, 6e-3)  # not one draft token accepted
    assert _run(never, 4 + 1 + 3, 1.0) == ["plain"] * 4 + ["probe"] + ["greedy"] * 3
    assert never.retired and never.failed_probes == 1 and not never.accepted_any
    once = SpecPolicy()  # one early round accepted a token, then nothing: backoff as usual
    _feed(once, "spec", 1.0 + 1 / 8, 6e-3)
    _feed(once, "spec", 1.0, 6e-3, n=2)
    _feed(once, "plain", 1.0, 4e-3, n=2)
    assert once.pays is False
    assert _run(once, 2 + 1 + 3, 1.0) == ["plain"] * 2 + ["probe"] + ["plain"] * 3
    assert once.accepted_any and not once.retired


class _Alternate(SpecPolicy):
    """Spec, plain and probe dispatches in turn, then target-only ones (tests the
    interleaving, not the policy)."""

    def choose(self) -> str:
        n = self.spec_dispatches + self.plain_dispatches
        return "greedy" if n >= 6 else ("spec", "plain", "probe")[n % 3]


def test_plain_and_spec_steps_interleave_losslessly():
    engine = tiny_engine(_ecfg(), check_every_step=True, max_rounds=2)
    engine.policy = _Alternate()
    out, stats = engine.generate(tiny_prompts(), MAX_NEW)
    assert out == [list(o) for o in greedy_baseline()]
    assert stats.leak_check.startswith("ok")
    kinds = {k for k, _ in stats.policy}
    assert kinds == {"spec", "plain", "probe", "greedy"}
    # The draft stayed current through the plain steps: spec rounds still accept multi-token.
    assert np.mean(stats.accept_lens) > 1.3, stats.accept_lens


def test_adaptive_is_opt_in_and_spec_only():
    assert tiny_engine(_ecfg()).policy is None  # default: every round speculates
    assert isinstance(tiny_engine(_ecfg(), adaptive=True).policy, SpecPolicy)
    assert tiny_engine(_ecfg(), spec=False, adaptive=True).policy is None


def _jit_calls(engine) -> collections.Counter:
    """Count the calls that reach each body's jitted function (the path that traces and
    compiles), not the ahead-of-time executables of Engine._compile_ahead."""
    calls: collections.Counter = collections.Counter()
    make = engine._fn

    def fn(body, *plan):
        jitted = make(body, *plan)

        def counted(*args):
            calls[body] += 1
            return jitted(*args)

        counted.lower = jitted.lower
        return counted

    engine._fn = fn
    return calls


def test_background_compiles_wait_for_poor_acceptance_then_serve_the_fallbacks():
    """warmup(background=True): a draft that pays never compiles the plain and target-only
    rounds; the first dispatch whose acceptance falls below try_plain_below submits them to the
    background thread, and the dispatches that need them run those executables (their jitted
    functions are never called, so nothing compiles twice), tokens greedy's. After
    cancel_compiles, a call whose compile never started compiles it through jit then."""
    import concurrent.futures

    from jspec.engine.greedy import greedy_step_body, target_only_step_body
    from jspec.engine.rounds import rounds_body

    class AlwaysSpec(SpecPolicy):  # observes acceptance, never switches
        def choose(self) -> str:
            return "spec"

    engine = tiny_engine(_ecfg(), max_rounds=2, adaptive=True)
    calls = _jit_calls(engine)
    engine.warmup(background=True)
    assert not engine._ahead and len(engine._deferred) == 2  # plain, target-only
    engine.policy = AlwaysSpec(try_plain_below=0.5)  # every dispatch emits >= 1 per request
    engine.generate(tiny_prompts(), MAX_NEW)
    assert len(engine._deferred) == 2 and not engine._ahead  # paid: nothing compiled
    engine.policy = AlwaysSpec(try_plain_below=10.0)  # "poor" from the first dispatch
    engine.generate(tiny_prompts(), MAX_NEW)
    assert not engine._deferred and len(engine._ahead) == 2  # submitted

    engine.policy = _Alternate()  # spec, plain, probe, ..., target-only rounds
    out, stats = engine.generate(tiny_prompts(), MAX_NEW)
    assert out == [list(o) for o in greedy_baseline()]
    assert {"plain", "greedy"} <= {k for k, _ in stats.policy}
    assert stats.leak_check.startswith("ok")  # every request released
    bodies = {rounds_body(b, 2) for b in (greedy_step_body, target_only_step_body)}
    assert not any(calls[b] for b in bodies) and len(bodies) == 2
    engine.wait_compiles()

    engine.cancel_compiles()  # all done: nothing to cancel; as if none had started:
    for key in list(engine._ahead):
        cancelled = concurrent.futures.Future()
        cancelled.cancel()
        engine._ahead[key] = cancelled
    engine.policy = _Alternate()
    out, stats = engine.generate(tiny_prompts(), MAX_NEW)
    assert out == [list(o) for o in greedy_baseline()] and stats.leak_check.startswith("ok")
    assert all(calls[b] for b in bodies)  # through jit this time
    engine.wait_compiles()  # cancelled ones are skipped, not raised


def test_an_engine_built_on_weight_shapes_precompiles_then_takes_the_weights():
    """Engine(... shapes ...).precompile() compiles prefill and the decode rounds in the
    background while the weights are not there yet (jspec generate loads them meanwhile);
    set_weights then warmup run those executables (their jitted functions never called) and
    the tokens are greedy's. set_weights refuses weights of other shapes, naming the leaf."""
    import jax

    from jspec.engine.lifecycle import prefill_chunk_body, release_body
    from jspec.engine.rounds import rounds_body
    from jspec.engine.scheduler import Engine
    from jspec.engine.spec_step import spec_step_body

    params, draft_params = tiny_model()
    shapes = jax.eval_shape(lambda: (params, draft_params))
    engine = Engine(_ecfg(), TARGET, shapes[0], DRAFT, shapes[1], max_rounds=2)
    engine.precompile()
    bad = jax.tree.map(lambda x: x, params)
    bad = dataclasses.replace(bad, final_norm=bad.final_norm[:-1])
    with pytest.raises(ValueError, match=r"set_weights: .*final_norm.* the engine was built for"):
        engine.set_weights(bad, draft_params)
    engine.set_weights(params, draft_params)
    calls = _jit_calls(engine)
    engine.warmup(background=True)
    out, stats = engine.generate(tiny_prompts(), MAX_NEW)
    assert out == [list(o) for o in greedy_baseline()] and stats.leak_check.startswith("ok")
    assert calls[prefill_chunk_body] == 0 and calls[rounds_body(spec_step_body, 2)] == 0
    assert calls[release_body] == 0 and len(engine._ahead) == 3
    engine.wait_compiles()
