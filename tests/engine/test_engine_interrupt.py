"""A fired probe or an interrupted run loses nothing (issue 22): after a ``ProbeError`` the engine's
state is the (undonated) state the failing call started from, and a ``generate`` ended by an
exception (Ctrl-C, a raising progress callback) is followed by a clean run.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from engine_helpers import TINY, tiny_engine, tiny_prompts

from jspec import probes
from jspec.engine.state import make_engine_config

ECFG = make_engine_config(
    TINY,
    page_size=4,
    topk=1,
    num_steps=1,
    num_draft_tokens=2,
    context_len=32,
    max_running_requests=2,
    max_prompt_len=8,
    batch_buckets=(2,),
)
PROMPTS = tiny_prompts((5, 3))
MAX_NEW = 4


def _interrupt(done: int, total: int) -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize("exc", [KeyboardInterrupt, ValueError], ids=["ctrl_c", "callback"])
def test_interrupted_generate_is_followed_by_a_clean_run(exc) -> None:
    """Was: the interrupted requests stayed live forever and the next generate failed with a
    misleading "KV pool ... too small"."""
    engine = tiny_engine(ECFG, spec=False)
    want, _ = engine.generate(PROMPTS, MAX_NEW)

    def boom(done: int, total: int) -> None:
        raise exc("stop")

    with pytest.raises(exc):
        engine.generate(PROMPTS, MAX_NEW, progress=boom)
    assert np.asarray(engine.state.kv.live).any()  # left as it was, for inspection
    out, stats = engine.generate(PROMPTS, MAX_NEW)
    assert out == want and stats.leak_check.startswith("ok")


def test_probe_error_keeps_the_state_and_reset_frees_it() -> None:
    """Was: after a ProbeError the donated state was gone ("Array has been deleted")."""
    engine = tiny_engine(ECFG, spec=False, checkify=True)
    ids = np.zeros((1, 1, ECFG.max_prompt_len), np.int32)
    ids[0, 0, :5] = PROMPTS[0]
    with probes.probes_enabled():
        _, ok = engine._call_prefill(np.array([[0]], np.int32), ids, np.array([[5]], np.int32))
        assert ok.all()
        before = jax.tree.map(np.array, engine.state)
        with pytest.raises(probes.ProbeError, match=r"greedy_step: entry 1: slot 5 outside"):
            engine._call_step(np.array([[0, 5]], np.int32), np.array([[True, True]]))
    after = jax.tree.map(np.asarray, engine.state)  # readable: not donated
    jax.tree.map(np.testing.assert_array_equal, after, before)
    with pytest.raises(AssertionError, match="leak"):
        engine.check_leaks()  # the admitted request still holds its pages
    engine.reset()
    assert engine.check_leaks().startswith("ok")


def test_a_reset_that_failed_can_be_retried(monkeypatch) -> None:
    """A reset that fails building the new state (e.g. out of memory) has already dropped the
    old one; the next reset (the next generate's) must build it, not fail on the missing state."""
    from jspec.engine import sharding

    engine = tiny_engine(ECFG, spec=False)
    real = sharding.init_states

    def oom(*args, **kwargs):
        raise MemoryError("no room for the pools")

    monkeypatch.setattr(sharding, "init_states", oom)
    with pytest.raises(MemoryError):
        engine.reset()
    monkeypatch.setattr(sharding, "init_states", real)
    engine.reset()
    out, stats = engine.generate(PROMPTS, MAX_NEW)
    assert len(out) == len(PROMPTS) and stats.leak_check.startswith("ok")
