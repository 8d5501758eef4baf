"""bench/serving_size.py's floors on CPU (shapes only, no weights made): the per-phase floor
is a lower bound at least the single max() floor, equal to it where every phase is bound by the
same resource, and above it where one phase is compute-bound and another memory-bound."""

from __future__ import annotations

import jax
import pytest

from bench.real_size import GEOMETRIES, make_params, make_target
from bench.serving_size import decode_floor

BW_TBS, TFLOPS = 3.93, 725.0


@pytest.fixture(scope="module")
def shapes_8b():
    g = GEOMETRIES["8b"]
    target = make_target(g)
    params, dparams = jax.eval_shape(lambda: (lambda t: (t[0], t[2]))(make_params(g, target)))
    return g, params, dparams


@pytest.mark.parametrize(
    "mode,bs,ctx", [("greedy", 1, 2048), ("greedy", 64, 8192), ("spec", 1, 2048)]
)
def test_phase_floor_equals_floor_where_every_phase_is_memory_bound(shapes_8b, mode, bs, ctx):
    g, params, dparams = shapes_8b
    f = decode_floor(g, params, dparams, mode, bs, ctx, BW_TBS, TFLOPS)
    assert f["floor kind"] == "memory"
    assert f["phase floor ms"] == pytest.approx(f["floor ms"], rel=1e-9)


def test_phase_floor_sums_a_compute_phase_and_a_memory_phase(shapes_8b):
    # spec at 64 x 8k: 512 verify tokens make the linear layers compute-bound (~10.6 ms at 725
    # TFLOP/s) while the target KV (68.7 GB) is a memory-bound 17.5 ms: the max() floor (one
    # sum of bytes, 28.5 ms) counts them as overlapped, the phase floor adds them.
    g, params, dparams = shapes_8b
    f = decode_floor(g, params, dparams, "spec", 64, 8192, BW_TBS, TFLOPS)
    assert f["floor ms"] == pytest.approx(28.5, rel=0.02)
    assert f["phase floor ms"] == pytest.approx(35.8, rel=0.02)
