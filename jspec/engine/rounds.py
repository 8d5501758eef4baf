"""Several decode rounds per dispatch: a device-resident loop over spec (or greedy) steps.

The host loop around one jitted step costs a dispatch, a device-to-host read and a Python pass
per step (1-2 ms on the 8B engine, bench/RESULTS.md). :func:`rounds_body` runs up to
``num_rounds`` steps in one ``lax.while_loop`` without returning to the host, with the stop
conditions on the device::

    round r:  state, out = step(state, slot_idx, live)          (spec or greedy step body)
              emitted[b]   = out.accept_lens (spec) | live (greedy)
              budget[b]   -= emitted[b]
              done[b]      = an EOS id among the emitted tokens | budget[b] <= 0
              live        &= ~done                               (the request stops stepping)
    stop:     r == num_rounds | no entry live | a step found the pages short (out.ok False:
              that step changed nothing; the rounds before it stand)

A finished entry stays in its batch slot (the host retires it after reading the rounds), so
every round is exactly the single step's transition: tokens and state are those of ``r``
single steps (tests/engine/test_engine_rounds.py). Pages are taken round by round by the steps
themselves; when they run short the loop returns early and the host preempts or waits.

:func:`decode_rounds` is the public call (a loop of your own around the public steps, over any
KV backend): ``decode_rounds(spec_decode_step, runner, weights, state, slot_idx, live, budget,
eos_ids, num_rounds)``; the :class:`jspec.engine.Engine` maps the same body over its shards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jspec._pytree import pytree_dataclass
from jspec.engine.greedy import greedy_step, greedy_step_body, target_only_step_body
from jspec.engine.inputs import check_count
from jspec.engine.runner import Runner, Weights, jit_step
from jspec.engine.sampling import SamplingBatch
from jspec.engine.spec_step import spec_decode_step, spec_step_body
from jspec.engine.state import EngineConfig, EngineState

# Decode rounds per dispatch (Engine(max_rounds=...), decode_rounds(max_rounds=...)). Each
# dispatch costs the host ~2-3 ms outside the device's work (argument transfer and launch, the
# while loop's exit and the results' read, the token pass; bench/launch_gaps.py, H200,
# 2026-11-26): at 8 rounds that was 0.3-0.4 ms of every 8B round (wall 1.11-1.20x device), at 32
# rounds ~0.1 ms (1.06-1.16x).
DEFAULT_MAX_ROUNDS = 32


@pytree_dataclass
class RoundsOutput:
    """What one multi-round dispatch emitted (``R`` = max rounds, ``W`` = tokens per step)."""

    # i32[R, Bb, W]: round r's emitted tokens of each entry, [:lens[r, b]] valid (0 after)
    tokens: jax.Array
    # i32[R, Bb]: tokens emitted per round per entry (0 after the entry stopped, on padding)
    lens: jax.Array
    # i32[]: rounds that ran and changed state (<= R)
    num_rounds: jax.Array
    # bool[]: False when round ``num_rounds`` found the pages short (it changed nothing)
    ok: jax.Array


def _emitted(out: Any, live: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(tokens i32[Bb, W], lens i32[Bb]) of one step's output (spec or greedy)."""
    if hasattr(out, "accept_tokens"):
        return out.accept_tokens, jnp.where(live, out.accept_lens, 0)
    return out.next_tokens[:, None], live.astype(jnp.int32)


def _tokens_per_step(ecfg: EngineConfig, step_body: Callable[..., Any]) -> int:
    """Tokens one step can emit per entry: 1 (greedy), else the deepest accepted path + 1."""
    if step_body in (greedy_step_body, target_only_step_body):
        return 1
    spec = ecfg.spec
    return min(spec.num_steps, spec.num_draft_tokens - 1) + 1


@functools.cache
def rounds_body(step_body: Callable[..., Any], max_rounds: int) -> Callable[..., Any]:
    """The multi-round body over ``step_body`` (the engines' body signature, cached so that
    ``jspec.engine.sharding.sharded`` keys on it)::

        body(runner, weights, state, slot_idx, live, budget, eos_ids, num_rounds,
             sampling=None) -> (state, RoundsOutput)

    Args (of the returned body):
      slot_idx: i32[Bb]; live: bool[Bb] (as the step's).
      budget: i32[Bb] tokens each entry may still emit (its max_new_tokens left).
      eos_ids: i32[E] stop tokens (-1 pads).
      num_rounds: an int or i32[] rounds to run at most (``<= max_rounds``, the static
        capacity); a negative ``-k``: a warm-up dispatch, ``k`` rounds even with no entry live
        (all-padding inputs change nothing, but the step's kernels run once: the first-use
        costs of the loop body, kernel loading and CUDA-graph capture, are paid then, not by
        the first request; measured on CPU, the first dispatch after a warm-up that skipped
        the body cost 2.3 ms a round against 0.3).
      sampling: None or the entries' ``jspec.engine.sampling.SamplingBatch`` (each round's
        coins come from the request's seed and positions, so rounds need no fresh key).
    """
    if not isinstance(max_rounds, int) or max_rounds < 1:
        raise ValueError(f"max_rounds={max_rounds!r} must be an int >= 1")

    def body(
        runner: Runner,
        weights: Weights,
        state: EngineState,
        slot_idx: jax.Array,
        live: jax.Array,
        budget: jax.Array,
        eos_ids: jax.Array,
        n: int | jax.Array,
        sampling: SamplingBatch | None = None,
    ) -> tuple[EngineState, RoundsOutput]:
        width = _tokens_per_step(runner.ecfg, step_body)
        bb = slot_idx.shape[0]
        tokens0 = jnp.zeros((max_rounds, bb, width), jnp.int32)
        lens0 = jnp.zeros((max_rounds, bb), jnp.int32)
        n = jnp.asarray(n, jnp.int32)
        warm = n < 0
        n = jnp.minimum(jnp.abs(n), max_rounds)

        def cond(carry):
            _, r, alive, _, _, _, ok = carry
            return (r < n) & (jnp.any(alive) | warm) & ok

        def step(carry):
            st, r, alive, left, tokens, lens, _ = carry
            st, out = step_body(runner, weights, st, slot_idx, alive, sampling)
            ok = jnp.asarray(out.ok)
            toks, emitted = _emitted(out, alive)
            emitted = jnp.where(ok, emitted, 0)
            col = jnp.arange(width, dtype=jnp.int32)[None, :]
            hit = (toks[:, :, None] == eos_ids[None, None, :]) & (col < emitted[:, None])[..., None]
            left = left - emitted
            done = jnp.any(hit, axis=(1, 2)) | (left <= 0)
            tokens = tokens.at[r].set(jnp.where(ok, toks, 0))
            lens = lens.at[r].set(emitted)
            return st, r + ok.astype(jnp.int32), alive & ~done, left, tokens, lens, ok

        left0 = budget.astype(jnp.int32)
        carry = (state, jnp.int32(0), live, left0, tokens0, lens0, jnp.asarray(True))
        state, r, _, _, tokens, lens, ok = jax.lax.while_loop(cond, step, carry)
        return state, RoundsOutput(tokens=tokens, lens=lens, num_rounds=r, ok=ok)

    body.__name__ = f"rounds_{getattr(step_body, '__name__', 'step')}_{max_rounds}"
    return body


# The public steps a caller may loop, and the bodies they jit.
_STEP_BODIES = ((spec_decode_step, spec_step_body), (greedy_step, greedy_step_body))


@functools.cache
def _jitted_rounds(step_body: Callable[..., Any], max_rounds: int) -> Callable[..., Any]:
    return jit_step(rounds_body(step_body, max_rounds))


def decode_rounds(
    step: Callable[..., Any],
    runner: Runner,
    weights: Weights,
    state: EngineState,
    slot_idx: jax.Array,
    live: jax.Array,
    budget: jax.Array,
    eos_ids: jax.Array,
    num_rounds: int | jax.Array,
    sampling: SamplingBatch | None = None,
    *,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
) -> tuple[EngineState, RoundsOutput]:
    """Up to ``num_rounds`` calls of ``step`` in one device dispatch, stopping each entry on
    the device at a stop id or at its budget (module docstring): the loop a serving engine
    runs around the public step, without a host round trip a step.

    Every round is the single step's transition (the same tokens and state as that many
    calls of ``step``, each with the entries still running as ``live``); a stopped entry
    stays in its slot, live in ``state``, for the caller to read its tokens and ``release``.
    Jitted like the steps (``runner`` static, ``state`` donated; one compile per step,
    ``max_rounds`` and shapes).

    Args:
      step: :func:`jspec.engine.spec_decode_step` or :func:`jspec.engine.greedy_step`.
      runner, weights, state, slot_idx, live, sampling: as ``step`` takes them
        (``slot_idx: i32[Bb]``, ``live: bool[Bb]``).
      budget: i32[Bb] tokens each entry may still emit (its max_new_tokens left, >= 1 on live
        entries); an entry stops once its round's tokens reach it (the last round may emit
        past it: cut the surplus on the host, as the Engine does).
      eos_ids: i32[E] stop ids (``E >= 0``; -1 pads): an entry stops after a round that
        emitted one (the tokens after it in that round are emitted too: cut at the first).
      num_rounds: rounds to run at most, an int or i32[] (clamped to ``max_rounds``; a
        negative ``-k``: a warm-up, ``k`` rounds even with no entry live).
      max_rounds: static capacity of the output (``RoundsOutput.tokens: i32[max_rounds, Bb,
        W]``, ``W`` = tokens one step can emit); an int >= 1.

    Returns:
      ``(state, RoundsOutput)``; ``out.num_rounds`` rounds ran and changed ``state``; ``out.ok``
      False: the next round found the pages short (or a bad slot) and changed nothing, as
      ``step`` returning ok=False.

    Raises:
      ValueError: naming the argument: ``step`` not one of the two public steps, a bad
      ``max_rounds``, or shapes that disagree with ``slot_idx``.
    """
    body = next((b for s, b in _STEP_BODIES if step is s), None)
    if body is None:
        names = [getattr(s, "__name__", str(s)) for s, _ in _STEP_BODIES]
        raise ValueError(f"step={step!r} must be one of jspec.engine's {names}")
    check_count("max_rounds", max_rounds)
    if jnp.ndim(slot_idx) != 1:
        raise ValueError(f"slot_idx.shape={jnp.shape(slot_idx)} must be [Bb]")
    for name, x in (("live", live), ("budget", budget)):
        if jnp.shape(x) != jnp.shape(slot_idx):
            raise ValueError(f"{name}.shape={jnp.shape(x)} must be {jnp.shape(slot_idx)}")
    if jnp.ndim(eos_ids) != 1:
        raise ValueError(f"eos_ids.shape={jnp.shape(eos_ids)} must be [E]")
    if jnp.ndim(num_rounds) != 0:
        raise ValueError(f"num_rounds.shape={jnp.shape(num_rounds)} must be []")
    call = _jitted_rounds(body, int(max_rounds))
    args = (slot_idx, live, budget, jnp.asarray(eos_ids, jnp.int32), num_rounds)
    return call(runner, weights, state, *args, sampling)
