"""The probe switch through every path a user sets it on (issue 11 §1): the quick start under
``JSPEC_ENABLE_ASYNC_ASSERT=1``, a planted fault named through plain ``jax.jit`` and through
:func:`probes.checked`, and nothing added to jspec's programs when the switch is off.

The drop-in path is in ``tests/interop/test_dropin_probes.py``, the engine's checkified step in
``tests/engine/test_engine_demo.py``, the demo CLI under the env switch there too.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import pytest

from jspec import TreeGeometry, kv, probes, tree

ROOT = pathlib.Path(__file__).resolve().parents[1]
DYNAMIC_PROBES = (
    "detect_nan",
    "detect_inf",
    "detect_oob",
    "detect_in_closed_range",
    "detect_page_aligned",
    "assert_async",
)


def _i32(xs):
    return jnp.asarray(xs, jnp.int32)


def _allocated():
    """A 4-page allocator (page 4) with pages 1 and 2 handed out."""
    return kv.alloc(kv.init_allocator(4, 4), 8, max_slots=8)[0]


def _rows():
    """req_to_token i32[2, 32]: row 1 maps positions to slots 4.. (pages 1..8)."""
    return jnp.zeros((2, 32), jnp.int32).at[1].set(jnp.arange(4, 36, dtype=jnp.int32))


# One call per probed concept: the allocator, the req_to_token table, the draft layout.
OPS = {
    "kv.free": lambda: (kv.free, (_allocated(), _i32([4, 8])), {}),
    "kv.alloc": lambda: (kv.alloc, (_allocated(), jnp.int32(4)), {"max_slots": 8}),
    "tree.draft_out_cache_loc": lambda: (
        tree.draft_out_cache_loc,
        (_rows(), _i32([1]), _i32([5])),
        {"geometry": TreeGeometry(topk=2, num_steps=2, num_draft_tokens=1, page_size=4)},
    ),
}


def test_quickstart_with_the_probe_switch_env() -> None:
    """The README quick start runs with every probe on and prints the same result."""
    env = {**os.environ, "JSPEC_ENABLE_ASYNC_ASSERT": "1", "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    code = (
        "import runpy\nfrom jspec import probes\nassert probes.probes_on()\n"
        f"ns = runpy.run_path({str(ROOT / 'examples' / 'quickstart.py')!r})\n"
        "print('OK', bool(ns['ok']), ns['reqs'].allocated_lens.tolist())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "OK True [40]" in proc.stdout, proc.stdout


@pytest.mark.parametrize("name", sorted(OPS))
def test_off_adds_no_equations_to_jspec_ops(name, monkeypatch) -> None:
    """Probes off: the op's program equals the one traced with every probe stubbed out."""
    fn, args, kw = OPS[name]()
    assert not probes.probes_on()
    off = str(jax.make_jaxpr(lambda *a: fn(*a, **kw))(*args))
    with probes.probes_enabled():
        on = str(jax.make_jaxpr(lambda *a: fn(*a, **kw))(*args))
    assert "check" not in off and "check" in on
    for probe in DYNAMIC_PROBES:
        monkeypatch.setattr(probes, probe, lambda *a, **k: None)
    jax.clear_caches()  # retrace the jitted op with the stubs
    try:
        stubbed = str(jax.make_jaxpr(lambda *a: fn(*a, **kw))(*args))
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert off == stubbed


def test_planted_double_free_through_plain_jit() -> None:
    """Plain ``jax.jit`` with the switch on: the error surfaces at sync, naming probe and page."""
    a = _allocated()
    free = jax.jit(kv.free)
    with probes.probes_enabled():
        jax.block_until_ready(free(a, _i32([4])))  # page 1: fine
        with pytest.raises(Exception, match=r"free: double free of page 3 \(already free\)"):
            jax.block_until_ready(free(a, _i32([12])))
    a2 = free(a, _i32([12]))  # off: rejected whole by the ok flag, state unchanged
    assert int(kv.available_size(a2)) == int(kv.available_size(a))


def test_planted_layout_overflow_through_checked() -> None:
    """``checked``: a draft footprint past the row width is an AssertionError naming the value."""
    fn, (rows, rpi, _), kw = OPS["tree.draft_out_cache_loc"]()
    with pytest.raises(AssertionError, match=r"draft_cache_loc: seq_lens: max value 40 > high"):
        probes.checked(fn)(rows, rpi, _i32([40]), **kw)
    out = probes.checked(fn)(rows, rpi, _i32([5]), **kw)
    chex.assert_shape(out, (1, 2, 2))
