"""Data-parallel shards: one engine state per device, run with ``shard_map``.

Every per-shard function here has the form ``body(ecfg, params, draft, state, *args) ->
(state, *outs)`` over *one* shard's state. :func:`sharded` turns it into a jitted function
over states stacked along a leading shard axis ``[D, ...]`` (state donated):

* ``D == 1``: plain ``jax.jit`` (the leading axis is squeezed inside);
* ``D > 1``: ``jax.shard_map`` over a 1-D mesh ``("dp",)`` of the first ``D`` devices; params
  are replicated, every state leaf and per-shard argument is split on its leading axis. Each
  shard owns its own allocator, req_to_token and pools: no cross-device traffic at all.

Compiled wrappers are cached per ``(body, ecfg, D)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "dp"


@functools.cache
def make_mesh(num_devices: int) -> Mesh:
    """A 1-D ``("dp",)`` mesh over the first ``num_devices`` devices."""
    devices = jax.devices()
    if num_devices > len(devices):
        raise ValueError(f"--devices {num_devices}: only {len(devices)} JAX device(s) available "
                         f"({devices[0].platform}); on CPU set "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=N")
    return Mesh(np.asarray(devices[:num_devices]), (AXIS,))


def _squeeze(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[0], tree)


def _unsqueeze(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[None], tree)


@functools.cache
def sharded(body: Callable[..., Any], ecfg: Any, num_devices: int,
            with_checkify: bool = False) -> Callable[..., Any]:
    """Jitted ``f(params, draft, stacked_state, *stacked_args) -> stacked (state, *outs)``.

    With ``with_checkify`` the per-shard body runs under ``checkify.checkify`` (the probe error
    classes of :mod:`jspec.probes`) and ``f`` returns ``(outs, errors)`` where ``errors`` is the
    checkify error stacked per shard (see :func:`first_error`).
    """

    def per_shard(params, draft, state, *args):
        out = body(ecfg, params, draft, _squeeze(state), *_squeeze(args))
        return _unsqueeze(out)

    if with_checkify:
        from jax.experimental import checkify

        from jspec import probes

        plain = per_shard

        def per_shard(params, draft, state, *args):
            err, out = checkify.checkify(plain, errors=probes.PROBE_ERRORS)(
                params, draft, state, *args)
            return out, _unsqueeze(err)

    if num_devices == 1:
        return jax.jit(per_shard, donate_argnums=(2,))
    mesh = make_mesh(num_devices)

    def fn(params, draft, state, *args):
        in_specs = (P(), P(), P(AXIS)) + (P(AXIS),) * len(args)
        mapped = jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs, out_specs=P(AXIS),
                               check_vma=False)
        return mapped(params, draft, state, *args)

    return jax.jit(fn, donate_argnums=(2,))


def first_error(errors: Any, num_devices: int) -> str | None:
    """The first fired probe message among the per-shard checkify errors, or None."""
    for d in range(num_devices):
        msg = jax.tree.map(lambda x, d=d: x[d], errors).get()
        if msg is not None:
            return f"shard {d}: {msg}" if num_devices > 1 else msg
    return None


def stack_states(states: list[Any], num_devices: int) -> Any:
    """Stack per-shard states on a leading axis (placed one shard per device when D > 1)."""
    stacked = jax.tree.map(lambda *xs: jax.numpy.stack(xs), *states)
    if num_devices == 1:
        return stacked
    sharding = NamedSharding(make_mesh(num_devices), P(AXIS))
    return jax.tree.map(lambda x: jax.device_put(x, sharding), stacked)


def replicate(tree: Any, num_devices: int) -> Any:
    """Put params on every device of the mesh (no-op for one device)."""
    if num_devices == 1:
        return tree
    sharding = NamedSharding(make_mesh(num_devices), P())
    return jax.tree.map(lambda x: jax.device_put(x, sharding), tree)
