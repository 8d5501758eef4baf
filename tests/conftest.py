"""Shared test setup: hypothesis CI profile, the interpret fixture, GPU gating, JAX's caches
dropped after every test module.

On CPU (the default and CI) Pallas kernels run in interpret mode. With ``JSPEC_TEST_GPU=1``
(``make test-gpu`` on the device machine) they are compiled for the GPU instead.
"""

from __future__ import annotations

import gc
import os

import jax
import pytest
from hypothesis import HealthCheck, settings

from jspec import env

settings.register_profile(
    "ci",
    max_examples=25,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("JSPEC_HYPOTHESIS_PROFILE", "ci"))

ON_GPU = env.TEST_GPU

# The suite never reads or writes the user's persistent compilation cache (jspec demo and jspec
# generate keep one by default): off in this process and in every subprocess a test starts. The
# cache's own tests give their own directory.
os.environ["JSPEC_COMPILATION_CACHE"] = "off"
env.COMPILATION_CACHE = "off"

# NOTE: no global jax_default_matmul_precision. f32 results are compared against numpy / f64
# oracles and the GPU's default f32 matmul is TF32 (~1e-3), so the library states its precision
# where it means it (models: protocol.matmul_precision; kernels' references: HIGHEST) and a test
# that computes an f32 reference in JAX passes precision= itself; a global flag would hide a
# library matmul that forgets.


@pytest.fixture(
    params=[
        pytest.param(False, id="compiled", marks=pytest.mark.gpu),
        pytest.param(True, id="interpret"),
    ]
)
def interpret(request: pytest.FixtureRequest) -> bool:
    """Pallas interpret flag: compiled kernels only with JSPEC_TEST_GPU=1."""
    if not request.param and not ON_GPU:
        pytest.skip("compiled Pallas kernels need JSPEC_TEST_GPU=1 and a GPU")
    return request.param


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if ON_GPU:
        return
    skip_gpu = pytest.mark.skip(reason="needs JSPEC_TEST_GPU=1 and a GPU")
    for item in items:
        if "gpu" in item.keywords and "interpret" not in getattr(item, "fixturenames", ()):
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_executables():
    """Drop JAX's caches (and with them the compiled executables) after every module.

    XLA:CPU maps each executable's code into its own memory regions, and JAX's caches keep every
    executable a worker ever compiled, engines long gone included (``gc`` alone frees none).
    Measured: ``tests/engine`` alone reached 25k of Linux's 65,530 maps (``vm.max_map_count``)
    in 3 minutes; a ``make test`` worker then crashed with a segfault inside XLA:CPU's compile
    at ~95% of the suite. Cleared per module, a worker stays at ~1.2k. (GPU executables map no
    host code: ``make test-gpu`` keeps its caches, and its time.)"""
    yield
    if not ON_GPU:
        jax.clear_caches()
        gc.collect()
