"""Multi-device engine: data-parallel shards x tensor-parallel heads, run with ``shard_map``.

Every per-shard function here has the form ``body(runner, weights, state, *args) -> (state,
out)`` over *one* data-parallel shard's state (``jspec.engine.runner``: the runner static).
:func:`sharded` turns it into a jitted function over states stacked along a leading shard axis
``[D, ...]`` (state donated), on a 2-D mesh ``("dp", "tp")`` of ``D * ecfg.tensor_parallel``
devices:

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
Compiled wrappers are cached per ``(body, runner, D)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jspec._pytree import replace
from jspec.engine.runner import compiler_options as engine_compiler_options
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


def weight_specs(runner: Any, weights: Any) -> Any:
    """PartitionSpecs of a runner's :class:`jspec.engine.runner.Weights` (:func:`param_specs`
    of each model); replicated (``P()``) without tensor parallelism."""
    tp = runner.ecfg.tensor_parallel
    if tp == 1:
        return P()
    return replace(
        weights,
        target=param_specs(runner.target, weights.target, tp),
        draft=param_specs(runner.draft, weights.draft, tp),
    )


def state_specs(state: Any, tensor_parallel: int) -> Any:
    """PartitionSpecs of a stacked engine state ``[D, ...]``.

    Every leaf is split on ``dp``; with tensor parallelism the KV pools
    (``kv.target_pool`` / ``kv.draft_pool``, ``[D, layers, slots, kv_heads, head_dim]``) are
    also split on their head axis.
    """
    # NOTE: zero-element leaves (``draft_hidden: [M, 0]`` without a draft) are replicated: a
    # jitted function's zero-element outputs come out replicated whatever their spec, so any
    # other placement would change the state's input shardings after one call (a recompile).
    specs = jax.tree.map(lambda x: P() if _is_empty(x) else P(DP_AXIS), state)
    if tensor_parallel == 1:
        return specs
    heads = P(DP_AXIS, None, None, TP_AXIS)
    kv = specs.kv
    draft_pool = None if kv.draft_pool is None else replace(kv.draft_pool, k=heads, v=heads)
    kv = replace(kv, target_pool=replace(kv.target_pool, k=heads, v=heads), draft_pool=draft_pool)
    return replace(specs, kv=kv)


# ---- the jitted wrapper ------------------------------------------------------------------------
def _squeeze(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[0], tree)


def _unsqueeze(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[None], tree)


# NOTE: jax 0.11's Shardy partitioner (CPU and GPU alike) segfaults compiling a jitted
# ``shard_map`` over >= 2 devices with a zero-element operand beside any other operand (in
# ``sdy::ManualComputationUnusedInputsPattern``; jax 0.10 compiles it; minimal reproduction:
# bench/repro_shard_map_crash.py). The greedy engine's state carries ``draft_hidden: [M, 0]``, so
# its every prefill / step / release over 2+ devices died there. Hence no zero-element array
# crosses the shard_map boundary, in or out: :class:`_Holes` puts None (spec None) in their place
# and rebuilds them as zeros, inside at their per-shard shape, outside (the state's) at their
# global shape. They hold no data, so nothing is lost.
def _is_empty(x: Any) -> bool:
    return math.prod(x.shape) == 0


class _Holes:
    """The zero-element leaves of a pytree whose PartitionSpecs (a pytree prefix) are ``specs``.

    ``strip(tree)`` puts None in their place (``self.specs``: the specs likewise, one per leaf);
    ``fill(hollow)`` puts back zeros of their per-shard shape (inside the shard_map) or, with
    ``local=False``, of their global shape (outside it).
    """

    def __init__(self, tree: Any, specs: Any, mesh: Mesh) -> None:
        # NOTE: jaxlib ships no type stub for PyTreeDef: typed it has no methods for mypy.
        treedef: Any
        spec_def: Any
        leaves, treedef = jax.tree.flatten(tree)
        self.treedef = treedef
        spec_leaves, spec_def = jax.tree.flatten(specs, is_leaf=lambda s: isinstance(s, P))
        subtrees = spec_def.flatten_up_to(tree)
        per_leaf = [s for s, sub in zip(spec_leaves, subtrees) for _ in jax.tree.leaves(sub)]
        self.mesh = mesh
        self.holes = {
            i: (x.shape, x.dtype, spec)
            for i, (x, spec) in enumerate(zip(leaves, per_leaf, strict=True))
            if _is_empty(x)
        }
        self.specs = self.treedef.unflatten(
            [None if i in self.holes else s for i, s in enumerate(per_leaf)]
        )

    def strip(self, tree: Any) -> Any:
        leaves = self.treedef.flatten_up_to(tree)
        return self.treedef.unflatten(
            [None if i in self.holes else x for i, x in enumerate(leaves)]
        )

    def fill(self, hollow: Any, local: bool = True) -> Any:
        leaves = self.treedef.flatten_up_to(hollow)
        for i, (shape, dtype, spec) in self.holes.items():
            if local:
                shape = NamedSharding(self.mesh, spec).shard_shape(shape)
            leaves[i] = jnp.zeros(shape, dtype)
        return self.treedef.unflatten(leaves)


# Tensor parallel on the GPU compiles the per-layer all-reduces (a few KB to a few MB each)
# with XLA's one-shot all-reduce kernel (one launch reading the peers' buffers) instead of
# NCCL's: measured through XLA_FLAGS on 2 x H200 (28b49ec, bench/RESULTS.md): tp 2 spec bs 1
# 6.48 -> 5.23 ms a step, greedy bs 1 4.92 -> 4.79, bs 16 7.35 -> 6.97 / 4.56 -> 4.46; on 4 x H100
# (2fe8b0a) 1x2, 1x4 and 2x2 gave the one-GPU tokens with it. XLA names it "unsupported".
TENSOR_PARALLEL_GPU_OPTIONS = (("xla_gpu_unsupported_use_all_reduce_one_shot_kernel", True),)


@functools.cache
def sharded(
    body: Callable[..., Any],
    runner: Any,
    num_devices: int,
    with_checkify: bool = False,
    compiler_options: tuple[tuple[str, Any], ...] = (),
) -> Callable[..., Any]:
    """Jitted ``f(weights, stacked_state, *stacked_args) -> stacked (state, out)``.

    ``num_devices`` is the number of data-parallel shards; each uses ``ecfg.tensor_parallel``
    devices. With ``with_checkify`` the per-shard body runs under ``checkify.checkify`` (the
    probe error classes of :mod:`jspec.probes`) and ``f`` returns ``(outs, errors)`` where
    ``errors`` is the checkify error stacked per shard (see :func:`first_error`), and the
    state is not donated: after a fired probe the caller still holds the state the call
    started from (a debug run inspects it; without checkify the state is donated).
    ``compiler_options``: XLA options for this function's compiles, as hashable ``(name,
    value)`` pairs (``EngineConfig.kernels.gemm_compiler_options``), after the engine's own
    (``jspec.engine.runner.compiler_options``: no rematerialization); tensor parallel on the
    GPU adds :data:`TENSOR_PARALLEL_GPU_OPTIONS`.
    """
    tp = runner.ecfg.tensor_parallel
    if tp > 1 and jax.default_backend() == "gpu":
        compiler_options = TENSOR_PARALLEL_GPU_OPTIONS + tuple(compiler_options)
    options = engine_compiler_options(tuple(compiler_options))

    def per_shard(weights, state, *args):
        state, out = body(runner, weights, _squeeze(state), *_squeeze(args))
        return _unsqueeze(state), _unsqueeze(out)

    if with_checkify:
        from jax.experimental import checkify

        from jspec import probes

        plain = per_shard

        def per_shard(weights, state, *args):
            err, out = checkify.checkify(plain, errors=probes.PROBE_ERRORS)(weights, state, *args)
            return out, _unsqueeze(err)

    donate = () if with_checkify else (1,)  # see the docstring: keep the state on a probe
    if num_devices * tp == 1:
        return jax.jit(per_shard, donate_argnums=donate, compiler_options=options)
    mesh = make_mesh(num_devices, tp)

    def fn(weights, state, *args):
        st_specs = state_specs(state, tp)
        operands = (weights, state, *args)
        in_specs = (weight_specs(runner, weights), st_specs) + (P(DP_AXIS),) * len(args)
        # The new state has the input state's leaves, shapes and specs (the bodies' contract).
        ins, st = _Holes(operands, in_specs, mesh), _Holes(state, st_specs, mesh)

        def hollow_body(*hollow):
            outs = per_shard(*ins.fill(hollow))
            (new_state, out), err = outs if with_checkify else (outs, ())
            if any(_is_empty(x) for x in jax.tree.leaves((out, err))):
                raise ValueError(f"{body=}: a zero-element output can't leave the shard_map")
            return (st.strip(new_state), out), err

        mapped = jax.shard_map(
            hollow_body,
            mesh=mesh,
            in_specs=ins.specs,
            out_specs=((st.specs, P(DP_AXIS)), P(DP_AXIS)),
            check_vma=False,
        )
        (new_state, out), err = mapped(*ins.strip(operands))
        outs = (st.fill(new_state, local=False), out)
        return (outs, err) if with_checkify else outs

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
    """``device_put`` of ``tree`` by ``specs`` (PartitionSpecs, a pytree prefix of ``tree``); a
    tree of ``jax.ShapeDtypeStruct`` (weights not loaded yet) gets the shardings instead."""
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    leaves = jax.tree.leaves(tree)
    if leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        return jax.tree.map(
            lambda sharding, sub: jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), sub
            ),
            shardings,
            tree,
        )
    return jax.device_put(tree, shardings)


def init_states(make_state: Callable[[], Any], num_devices: int, tensor_parallel: int = 1) -> Any:
    """``num_devices`` fresh per-shard states (all alike: ``make_state()``, pure jnp) stacked on
    a leading axis, built inside one jit straight into their placement by :func:`state_specs`.

    NOTE: building the per-shard states first and stacking them (:func:`stack_states`) holds
    both copies at once: with pools sized to most of device memory
    (``mem_fraction_static``) that is twice the pool, and the allocator was left fragmented
    enough that the first step failed to allocate (H200, bench/RESULTS.md). Here each device
    writes its shard of the pools once.
    """

    def build() -> Any:
        one = make_state()
        return jax.tree.map(
            lambda x: jax.numpy.broadcast_to(x[None], (num_devices,) + x.shape), one
        )

    if num_devices * tensor_parallel == 1:
        return jax.jit(build)()
    mesh = make_mesh(num_devices, tensor_parallel)
    specs = state_specs(jax.eval_shape(build), tensor_parallel)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    return jax.jit(build, out_shardings=shardings)()


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
