"""What a step is given: one hashable :class:`Runner` (static) and one :class:`Weights` pytree.

Every public step takes ``(runner, weights, state, ...)``::

    runner  = Runner(ecfg, target, draft)   # static jit argument: config, models, KV backend
    weights = Weights(target_params, draft_params)
    state   = init_engine_state(runner)     # EngineState(kv, carry), donated by each step

The runner's constructor checks once that the models follow ``jspec.engine.protocol`` and fit
the config (:func:`check_engine_models`); the steps trust it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Generic, ParamSpec, TypeVar

import jax

from jspec._pytree import pytree_dataclass
from jspec.engine.kv_backend import KVBackend
from jspec.engine.paged_kv import PagedKVBackend
from jspec.engine.protocol import DraftModel, TargetModel, check_models
from jspec.engine.state import EngineConfig, EngineState, init_spec_carry
from jspec.kernels.policy import with_kernel_policy


def check_engine_models(
    ecfg: EngineConfig, target: TargetModel, draft: DraftModel | None = None
) -> None:
    """Static checks: the models follow the protocol, fit each other and ``ecfg``.

    Raises:
      ValueError naming the field (TypeError for a missing protocol member).
    """
    check_models(target, draft)
    s = ecfg.spec
    for field in ("num_layers", "num_kv_heads", "head_dim", "dtype"):
        if getattr(s, field) != getattr(target, field):
            raise ValueError(
                f"target.{field}={getattr(target, field)!r} does not match the "
                f"engine config's spec.{field}={getattr(s, field)!r} (build the "
                "config with make_engine_config(target, ...))"
            )
    tp = ecfg.tensor_parallel
    for name, model in (("target", target), ("draft", draft)):
        if model is None or tp == 1:
            continue
        if not hasattr(model, "param_specs"):
            raise ValueError(
                f"tensor_parallel={tp}: the {name} model {type(model).__name__} "
                "defines no param_specs (jspec.engine.protocol)"
            )
        if model.num_kv_heads % tp:
            raise ValueError(
                f"tensor_parallel={tp} must divide {name}.num_kv_heads={model.num_kv_heads}"
            )
        if hasattr(model, "check_tensor_parallel"):
            model.check_tensor_parallel(tp)


@dataclasses.dataclass(frozen=True, init=False)
class Runner:
    """The static half of every step (hashable: a static jit argument).

    Attributes:
      ecfg: the engine config (``make_engine_config(target, ...)``).
      target: the target model (``jspec.engine.protocol.TargetModel``); a model with a
        ``rms_norm_impl`` dataclass field gets the engine's ``ecfg.kernels.rms_norm`` there.
      draft: the draft head (``DraftModel``), or None for a plain greedy engine (the same).
      kv: the KV backend (``jspec.engine.kv_backend.KVBackend``); None given: jspec's paged
        allocator over ``ecfg.spec`` (:class:`jspec.engine.paged_kv.PagedKVBackend`), so the
        attribute is never None.
      max_kv_len: a launch hint for the decode passes: no request of a call reads more than
        this many prefix keys (``AttentionMetadata.max_kv_len``: the attention kernels plan
        their key splits for it, not for ``context_len``, so short batches in a long-context
        engine do not pay for its capacity). Not a bound: a longer request is still read whole,
        only slower. None: ``context_len``. The Engine picks it per dispatch from
        ``ecfg.kv_len_buckets``.
      max_prefix_len: a bound for prefill calls: no entry's chunk starts past this many
        prompt tokens (0: every entry is a first chunk). The prefill's attention passes carry
        it (``AttentionMetadata.max_prefix_len``: cuDNN's prefill then gathers the prefix only
        that wide, and skips it at 0); a call with an entry past it fails whole (``ok`` False,
        state unchanged). None: no bound. The Engine sets 0 for calls of first chunks when
        the kernel policy reads the bound (``KernelPolicy.reads_prefix_bound``).
    """

    ecfg: EngineConfig
    target: TargetModel
    draft: DraftModel | None
    kv: KVBackend
    max_kv_len: int | None
    max_prefix_len: int | None

    # NOTE: written out (not the dataclass's) so that ``kv`` is None only as an argument: the
    # attribute is always a backend. dataclasses.replace passes every field back in here.
    def __init__(
        self,
        ecfg: EngineConfig,
        target: TargetModel,
        draft: DraftModel | None = None,
        kv: KVBackend | None = None,
        max_kv_len: int | None = None,
        max_prefix_len: int | None = None,
    ) -> None:
        # the kernel policy reaches the models here, once
        target = with_kernel_policy(target, ecfg.kernels)
        draft = with_kernel_policy(draft, ecfg.kernels)
        check_engine_models(ecfg, target, draft)
        hint = max_kv_len
        if hint is not None and (not isinstance(hint, int) or isinstance(hint, bool) or hint < 1):
            raise ValueError(f"max_kv_len={hint!r} must be None or an int >= 1")
        bound = max_prefix_len
        if bound is not None and (
            not isinstance(bound, int) or isinstance(bound, bool) or bound < 0
        ):
            raise ValueError(f"max_prefix_len={bound!r} must be None or an int >= 0")
        fields = {
            "ecfg": ecfg,
            "target": target,
            "draft": draft,
            "kv": PagedKVBackend(ecfg) if kv is None else kv,
            "max_kv_len": max_kv_len,
            "max_prefix_len": max_prefix_len,
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)


@pytree_dataclass
class Weights:
    """The runner's weights: the target's params pytree and the draft's (None without one)."""

    target: Any
    draft: Any = None


def init_engine_state(runner: Runner, kv: Any = None) -> EngineState:
    """Empty state: every batch slot free (the KV backend's ``init_state`` unless ``kv`` is
    given), the carry zero (``draft_hidden`` is ``[M, 0]`` without a draft)."""
    if kv is None:
        kv = runner.kv.init_state(runner.target, runner.draft)
    return EngineState(kv=kv, carry=init_spec_carry(runner.ecfg, runner.draft))


_P = ParamSpec("_P")
_R = TypeVar("_R")

# XLA's rematerialization pass (HloRematerialization) recomputes values to keep a program under a
# memory limit of 80% of the device's memory *minus the program's arguments and outputs*. The KV
# pools fill the device by design (``mem_fraction_static``), so beside them that limit is below
# zero and the pass recomputes whatever it can, on every step: measured on the H100 (2026-11-27,
# ``bench.step_kernels``, 8B spec bs 1 at a 2k context), with a 22 000-page pool every layer's
# QKV projection ran twice (XLA's ``*.remat`` instructions), 8.42 ms a step against 7.56 with a
# small pool. The pools are donated (updated in place) and the step's workspace is reserved
# (:mod:`jspec.engine.memory`), so the engine's compiles turn the pass off. Set on every backend
# (XLA:CPU has no such pass; the option is accepted and changes nothing there): choosing by
# backend would query it when ``jit_step`` runs at import, initializing JAX's backends then.
ENGINE_COMPILER_OPTIONS = (("xla_disable_hlo_passes", "rematerialization"),)


def compiler_options(extra: tuple[tuple[str, Any], ...] = ()) -> dict[str, Any]:
    """The XLA options of a jitted engine call (``jax.jit(compiler_options=...)``):
    :data:`ENGINE_COMPILER_OPTIONS`, then the ``(name, value)`` pairs ``extra`` (later wins)."""
    return dict(ENGINE_COMPILER_OPTIONS + tuple(extra))


class _JitStep(Generic[_P, _R]):
    """A step body jitted as :func:`jit_step` says: called at top level (concrete arguments),
    ``jax.jit(body, compiler_options=compiler_options())``; called while tracing (inside the
    caller's own ``jit``, ``checkify``, ``eval_shape``, a loop), the same jit without options:
    JAX accepts ``compiler_options`` on top-level jits only (a nested one raises). Typed as
    ``body`` is: a caller's type checker reads the step's signature."""

    def __init__(self, body: Callable[_P, _R]) -> None:
        functools.update_wrapper(self, body)
        kw: dict[str, Any] = {"static_argnames": ("runner",), "donate_argnames": ("state",)}
        self._top = jax.jit(body, compiler_options=compiler_options(), **kw)
        self._nested = jax.jit(body, **kw)

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        leaves = jax.tree.leaves((args, kwargs))
        traced = any(isinstance(x, jax.core.Tracer) for x in leaves)
        return (self._nested if traced else self._top)(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """The top-level jit's ``lower`` (abstract arguments allowed)."""
        return self._top.lower(*args, **kwargs)


def jit_step(body: Callable[_P, _R]) -> _JitStep[_P, _R]:
    """The public jitted form of a step body ``body(runner, weights, state, ...)``: one compile
    per runner (static) and shapes, the state donated (updated in place); called at top level
    it compiles with the engine's :func:`compiler_options` (beside a pool that fills the
    device XLA otherwise recomputes parts of every step), inside another trace as a plain
    nested jit: an engine that jits its own loop around the steps passes
    ``compiler_options=compiler_options()`` to that top-level jit."""
    return _JitStep(body)
