"""Multi-device engine: data-parallel shards x tensor-parallel heads, run with ``shard_map``.

Every per-shard function here has the form ``body(ecfg, target, params, draft, draft_params,
state, *args) -> (state, out)`` over *one* data-parallel shard's state (the models static,
``jspec.engine.protocol``). :func:`sharded` turns it into a jitted
function over states stacked along a leading shard axis ``[D, ...]`` (state donated), on a 2-D
mesh ``("dp", "tp")`` of ``D * ecfg.tensor_parallel`` devices:

* ``dp`` (data parallel): each shard owns its own requests, allocator, req_to_token and pools;
  no cross-shard traffic at all. Every state leaf and per-shard argument is split on its
  leading axis.
* ``tp`` (tensor parallel, Megatron layout): within a shard, device ``t`` holds the ``t``-th
  contiguous block of query / KV heads and of the KV pools' head axis, the params split as the
  model's ``param_specs(params, "tp")`` says (the toy model: ``wq/wk/wv`` columns, ``wo``
  rows, ``w_gate/w_up`` columns, ``w_down`` rows; ``model.decoder_layer`` sums the two
  row-parallel products per layer with ``psum`` over ``tp``). The rest of the params are
  replicated, and so is the whole
  bookkeeping: every tp device runs the same allocator / tree / verify ops on identical
  (all-reduced) values, as sglang's TP ranks do.

With one device in all, it is a plain ``jax.jit`` (the leading axis is squeezed inside).
Several hosts: after ``jax.distributed.initialize()`` in every process the mesh spans all
processes' devices; every process runs the same host loop (SPMD) and the scheduler gathers step
outputs with ``multihost_utils.process_allgather`` (tested: 2 CPU processes, dp across them).
Compiled wrappers are cached per ``(body, ecfg, target, draft, D)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jspec._pytree import replace
from jspec.engine.state import DP_AXIS, TP_AXIS


@functools.cache
def make_mesh(num_devices: int, tensor_parallel: int = 1) -> Mesh:
    """A ``("dp", "tp")`` mesh of shape ``(num_devices, tensor_parallel)`` (first devices).

    Consecutive devices form one shard's tp group (on a GPU host: the NVLink neighbours).
    """
    devices = jax.devices()
    need = num_devices * tensor_parallel
    if need > len(devices):
        raise ValueError(
            f"--devices {num_devices} x --tensor-parallel {tensor_parallel} = "
            f"{need} devices: only {len(devices)} JAX device(s) available "
            f"({devices[0].platform}); on CPU set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N"
        )
    grid = np.asarray(devices[:need]).reshape(num_devices, tensor_parallel)
    return Mesh(grid, (DP_AXIS, TP_AXIS))


def check_devices(num_devices: int, tensor_parallel: int = 1) -> None:
    """ValueError unless ``num_devices * tensor_parallel`` JAX devices exist (no compile)."""
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices} must be >= 1")
    if num_devices * tensor_parallel > 1:
        make_mesh(num_devices, tensor_parallel)


# ---- partition specs ---------------------------------------------------------------------------
def param_specs(model: Any, params: Any, tensor_parallel: int) -> Any:
    """PartitionSpecs of a model's params: ``model.param_specs(params, "tp")`` under tensor
    parallelism, else replicated (``P()``). No ``dp`` entry: params are replicated across
    data-parallel shards."""
    if params is None or tensor_parallel == 1:
        return P()
    if not hasattr(model, "param_specs"):
        raise ValueError(
            f"tensor_parallel={tensor_parallel}: {type(model).__name__} defines "
            "no param_specs (jspec.engine.protocol)"
        )
    return model.param_specs(params, TP_AXIS)


def state_specs(state: Any, tensor_parallel: int) -> Any:
    """PartitionSpecs of a stacked engine state ``[D, ...]``.

    Every leaf is split on ``dp``; with tensor parallelism the KV pools
    (``[D, layers, slots, kv_heads, head_dim]``) are also split on their head axis.
    """
    specs = jax.tree.map(lambda _: P(DP_AXIS), state)
    if tensor_parallel == 1:
        return specs
    heads = P(DP_AXIS, None, None, TP_AXIS)
    draft_pool = None if specs.draft_pool is None else replace(specs.draft_pool, k=heads, v=heads)
    return replace(
        specs, target_pool=replace(specs.target_pool, k=heads, v=heads), draft_pool=draft_pool
    )


# ---- the jitted wrapper ------------------------------------------------------------------------
def _squeeze(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[0], tree)


def _unsqueeze(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[None], tree)


@functools.cache
def sharded(
    body: Callable[..., Any],
    ecfg: Any,
    target: Any,
    draft: Any,
    num_devices: int,
    with_checkify: bool = False,
    compiler_options: tuple[tuple[str, Any], ...] = (),
) -> Callable[..., Any]:
    """Jitted ``f(params, draft_params, stacked_state, *stacked_args) -> stacked (state, out)``.

    ``num_devices`` is the number of data-parallel shards; each uses ``ecfg.tensor_parallel``
    devices. With ``with_checkify`` the per-shard body runs under ``checkify.checkify`` (the
    probe error classes of :mod:`jspec.probes`) and ``f`` returns ``(outs, errors)`` where
    ``errors`` is the checkify error stacked per shard (see :func:`first_error`), and the
    state is not donated: after a fired probe the caller still holds the state the call
    started from (a debug run inspects it; without checkify the state is donated).
    ``compiler_options``: XLA options for this function's compiles, as hashable ``(name,
    value)`` pairs (``EngineConfig.gemm_compiler_options``).
    """
    options = dict(compiler_options) or None
    tp = ecfg.tensor_parallel

    def per_shard(params, draft_params, state, *args):
        state, out = body(
            ecfg, target, params, draft, draft_params, _squeeze(state), *_squeeze(args)
        )
        return _unsqueeze(state), _unsqueeze(out)

    if with_checkify:
        from jax.experimental import checkify

        from jspec import probes

        plain = per_shard

        def per_shard(params, draft_params, state, *args):
            err, out = checkify.checkify(plain, errors=probes.PROBE_ERRORS)(
                params, draft_params, state, *args
            )
            return out, _unsqueeze(err)

    donate = () if with_checkify else (2,)  # see the docstring: keep the state on a probe
    if num_devices * tp == 1:
        return jax.jit(per_shard, donate_argnums=donate, compiler_options=options)
    mesh = make_mesh(num_devices, tp)

    def fn(params, draft_params, state, *args):
        st_specs = state_specs(state, tp)
        in_specs = (
            param_specs(target, params, tp),
            param_specs(draft, draft_params, tp),
            st_specs,
        ) + (P(DP_AXIS),) * len(args)
        out_specs = (st_specs, P(DP_AXIS))
        if with_checkify:
            out_specs = (out_specs, P(DP_AXIS))
        mapped = jax.shard_map(
            per_shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )
        return mapped(params, draft_params, state, *args)

    return jax.jit(fn, donate_argnums=donate, compiler_options=options)


def first_error(errors: Any, num_devices: int) -> str | None:
    """The first fired probe message among the per-shard checkify errors, or None."""
    for d in range(num_devices):
        msg = jax.tree.map(lambda x, d=d: x[d], errors).get()
        if msg is not None:
            return f"shard {d}: {msg}" if num_devices > 1 else msg
    return None


# ---- placement ---------------------------------------------------------------------------------
def _place(tree: Any, specs: Any, mesh: Mesh) -> Any:
    """``device_put`` of ``tree`` by ``specs`` (PartitionSpecs, a pytree prefix of ``tree``)."""
    return jax.device_put(tree, jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs))


def stack_states(states: list[Any], num_devices: int, tensor_parallel: int = 1) -> Any:
    """Stack per-shard states on a leading axis, placed by :func:`state_specs` on the mesh."""
    stacked = jax.tree.map(lambda *xs: jax.numpy.stack(xs), *states)
    if num_devices * tensor_parallel == 1:
        return stacked
    return _place(
        stacked, state_specs(stacked, tensor_parallel), make_mesh(num_devices, tensor_parallel)
    )


def replicate(model: Any, params: Any, num_devices: int, tensor_parallel: int = 1) -> Any:
    """Put params on the mesh: replicated over ``dp``, split over ``tp`` by
    :func:`param_specs`."""
    if params is None or num_devices * tensor_parallel == 1:
        return params
    return _place(
        params, param_specs(model, params, tensor_parallel), make_mesh(num_devices, tensor_parallel)
    )
