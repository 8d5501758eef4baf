"""Internal: one Pallas (and raw Triton) kernel per op beside its pure-jnp ``*_reference``.

Not a public namespace (``__all__`` is empty). Kernels take and return arrays; every op is
called through its concept package, which validates the inputs and picks the kernel with
a concrete ``impl="xla" | "pallas" | "triton"``: :mod:`jspec.kv`, :mod:`jspec.tree`,
:mod:`jspec.attention_meta`, and :mod:`jspec.models` (RMSNorm, ``rms_norm.py``). ``policy.py``
is the one place ``"auto"`` becomes those names (``KernelPolicy``, public through
:mod:`jspec.engine`). Tests, benches and ``interop`` import the modules here directly for the
``*_reference`` oracles and the launch internals.
"""

from __future__ import annotations

__all__: list[str] = []
