"""Triton kernels under Triton's interpreter in CPU test runs (import before triton).

``TRITON_INTERPRET=1`` must be set before triton is first imported (``tl.sum`` and friends are
``@jit`` functions decorated at import time): importing this module sets it, unless the run is a
GPU run (``JSPEC_TEST_GPU=1``: the process keeps compiled Triton for the ``jax_triton`` tests).
If triton was already imported compiled when this module was first imported (an earlier test
module of the same pytest process), the in-process interpreter tests are skipped
(:data:`in_process`) and the test file re-runs itself in a fresh subprocess
(:func:`rerun_in_fresh_process`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ON_GPU_RUN = os.environ.get("JSPEC_TEST_GPU", "") == "1"
PREIMPORTED_COMPILED = ON_GPU_RUN or (
    "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "") not in ("1", "true")
)
if not ON_GPU_RUN:
    os.environ["TRITON_INTERPRET"] = "1"

in_process = pytest.mark.skipif(
    PREIMPORTED_COMPILED,
    reason="triton already imported without TRITON_INTERPRET; "
    "covered by test_rerun_in_fresh_process",
)

# The file's test_rerun_in_fresh_process: runs only when the in-process tests were skipped on a CPU
# run (a GPU run runs the compiled tests instead).
rerun_here = pytest.mark.skipif(
    not PREIMPORTED_COMPILED or ON_GPU_RUN, reason="tests run in this process"
)


def rerun_in_fresh_process(test_file: str, timeout: int) -> None:
    """Run ``pytest test_file`` in a CPU-only subprocess with the interpreter on; assert it
    passes (its output tail in the message)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "JAX_PLATFORMS": "cpu", "JSPEC_TEST_GPU": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def patch_interpreter_range() -> None:
    """Let kernels run ``range()`` over runtime scalars in Triton's interpreter (idempotent).

    NOTE: triton 3.6's interpreter holds a scalar as a 1-element array and gives ``tl.tensor``
    an ``__index__`` of ``int(array)``, which numpy 2 rejects for a 1-D array ("only
    0-dimensional arrays can be converted"): a loop ``for start in range(lo, hi, BLOCK)`` over
    loaded lengths then fails in the interpreter while it compiles fine. This wraps the
    interpreter's per-launch patch of ``tl.tensor`` to take the one element instead.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "jspec_patched", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.jspec_patched = True
    interpreter._patch_lang_tensor = patched
