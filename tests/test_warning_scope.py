"""Importing jspec changes no process-wide warning filter; the Pallas-Triton one is scoped."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

from jspec.cli import PALLAS_TRITON_DEPRECATION, quiet_pallas_triton

REPO = Path(__file__).resolve().parents[1]

_IMPORT_ALL = """
import importlib, pkgutil, warnings
import jax, jax.numpy, numpy, scipy  # third-party filters (numpy's own) are not jspec's
from jax.experimental import pallas
from jax.experimental.pallas import triton
before = list(warnings.filters)
import jspec
for mod in pkgutil.walk_packages(jspec.__path__, "jspec."):
    try:
        importlib.import_module(mod.name)
    except ImportError:  # optional stacks (torch, jax_triton)
        pass
added = [f for f in warnings.filters if f not in before]
print(repr(added))
"""


def test_importing_jspec_adds_no_warning_filter() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"JAX_PLATFORMS": "cpu", **_env_without_warning_flags()},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_quiet_pallas_triton_is_scoped() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_pallas_triton():
            warnings.warn(PALLAS_TRITON_DEPRECATION + " and will be removed", DeprecationWarning)
            warnings.warn("another deprecation", DeprecationWarning)
        warnings.warn(PALLAS_TRITON_DEPRECATION + " and will be removed", DeprecationWarning)
    assert [str(w.message)[:21] for w in seen] == [
        "another deprecation",
        PALLAS_TRITON_DEPRECATION[:21],
    ]


def _env_without_warning_flags() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
