"""Continuous batching: the host loop around the jitted prefill / decode step / release.

NOTE: over ~400 lines on purpose: one concept (the Engine's host loop: admission, bucketing,
sharded step calls, token bookkeeping, leak checks) whose methods share the Engine's host-side
state; a split would scatter that state across modules while the loop is being reworked
(host-loop overlap).

Each iteration of the host loop

1. admits waiting requests (arrival step reached, FIFO) into free batch slots of the
   least-loaded shard while pages last. ``admission="reserve"`` (default) counts the pages
   promised to the shard's requests (each one's lifetime maximum,
   :meth:`Engine.lifetime_pages`), so a decode step never runs out of pages;
   ``"optimistic"`` counts only the pages requests hold now plus one decode step's reserve each,
   so more requests run at once, and a decode step that finds the pages short *preempts* the
   newest request (its pages and row are released, it goes back to the head of the queue with
   its prompt + the tokens it emitted, and is prefilled again later: no token is lost);
2. runs one prefill call: up to ``prefill_batch`` admitted prompts per shard advance by one
   chunk (``ecfg.max_chunk_len`` tokens at most, padded to a prefill bucket), so long prompts
   interleave with running decodes; a prompt's last chunk emits its first token and makes it
   live;
3. runs one decode step (plain greedy or speculative) over the smallest batch bucket that holds
   every shard's live requests (padding entries are invalid rows: row 0, slot 0);
4. appends the emitted tokens (spec: ``accept_tokens[:accept_len]``), truncates at
   ``max_new_tokens`` / EOS, and releases finished requests (pages, row, batch slot).

After every run the allocator must be back to all pages free and all rows free (leak check,
``check_integrity``); ``check_every_step`` also checks ``free + owned == total`` after every step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec import probes
from jspec._pytree import replace
from jspec.engine import sharding
from jspec.engine.greedy import greedy_step_body, target_only_step_body
from jspec.engine.inputs import validate_requests
from jspec.engine.lifecycle import prefill_chunk_body, release_body
from jspec.engine.paged_kv import PagedKVState
from jspec.engine.protocol import DraftModel, TargetModel
from jspec.engine.rounds import DEFAULT_MAX_ROUNDS, rounds_body
from jspec.engine.runner import Runner, Weights, init_engine_state
from jspec.engine.sampling_params import (
    GREEDY,
    SamplingParams,
    normalize_sampling,
    pack_sampling,
)
from jspec.engine.spec_step import spec_step_body
from jspec.engine.state import EngineConfig, EngineState
from jspec.kv.allocator import available_size
from jspec.kv.integrity import check_integrity, owned_page_mask
from jspec.tree.sampling import LossyThresholds

ADMISSIONS = ("reserve", "optimistic")
# Rounds per dispatch while a queued request waits for a slot or pages and a stop id may end a
# running request (free its slot) sooner than its budget: the most rounds the queue's head may
# wait past such an end, against a dispatch's host cost paid once per round at 1.
WAITING_ROUNDS = 4


@dataclasses.dataclass
class Request:
    """One generation request (host side)."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int = 0
    sampling: SamplingParams = GREEDY  # resolved (a sampled request has its seed)
    output: list[int] = dataclasses.field(default_factory=list)
    accept_lens: list[int] = dataclasses.field(default_factory=list)
    shard: int = -1
    slot: int = -1
    # ids being prefilled (the prompt; after a preemption the prompt + the tokens emitted) and
    # how many of them are in the KV pool so far
    prefill_ids: list[int] = dataclasses.field(default_factory=list)
    prefilled: int = 0
    admitted_at: int = -1  # admission order (preemption picks the newest)
    ttft_s: float = -1.0  # seconds from the run's start to the first token
    num_preemptions: int = 0
    stop_scanned: int = 0  # output tokens already searched for a stop id (Engine._finished)


@dataclasses.dataclass
class RunStats:
    """What one :meth:`Engine.generate` run did."""

    mode: str
    num_requests: int = 0
    num_tokens: int = 0
    num_decode_steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    wall_s: float = 0.0
    accept_lens: list[int] = dataclasses.field(default_factory=list)
    batch_sizes: list[int] = dataclasses.field(default_factory=list)
    step_s: list[float] = dataclasses.field(default_factory=list)  # each decode step's wall
    request_accept_lens: list[list[int]] = dataclasses.field(default_factory=list)
    ttft_s: list[float] = dataclasses.field(default_factory=list)  # per request
    num_prefill_calls: int = 0
    num_preemptions: int = 0
    leak_check: str = ""
    # each request's sampling parameters as used (seeds drawn for those that had none)
    sampling: list[SamplingParams] = dataclasses.field(default_factory=list)
    # adaptive speculation: (SpecPolicy kind, rounds) of each decode dispatch
    policy: list[tuple[str, int]] = dataclasses.field(default_factory=list)

    @property
    def mean_accept_len(self) -> float:
        """Mean tokens emitted per request per decode step (sglang accept length)."""
        return float(np.mean(self.accept_lens)) if self.accept_lens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s > 0 else 0.0


# Python's GIL switch interval while a background compile runs (Engine._compile_ahead).
_COMPILE_SWITCH_INTERVAL_S = 2e-4
_switch_lock = threading.Lock()
_switch_users = [0, 0.0]  # background compiles running, the interval before the first


@contextlib.contextmanager
def _short_switch_interval() -> Iterator[None]:
    """The GIL switch interval at ``_COMPILE_SWITCH_INTERVAL_S`` while any background compile
    runs (restored when the last one ends). NOTE: tracing holds the GIL for long stretches; at
    Python's default 5 ms the decode loop's host steps waited for it (measured on the 8B start:
    spec decode -22..27%, TTFT 10 -> 150 ms while these compiles ran)."""
    with _switch_lock:
        if _switch_users[0] == 0:
            _switch_users[1] = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch_users[1], _COMPILE_SWITCH_INTERVAL_S))
        _switch_users[0] += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users[0] -= 1
            if _switch_users[0] == 0:
                sys.setswitchinterval(_switch_users[1])


@dataclasses.dataclass
class SpecPolicy:
    """What a spec engine's next decode dispatch runs (``Engine(adaptive=True)``)::

        gain = accept_len * t_plain / t_spec      (tokens per second, spec over plain)

    ``accept_len``: mean tokens per request per spec round; ``t_spec`` / ``t_plain``: wall
    time per round of each kind (exponential averages, weight ``alpha`` for the newest; the
    first dispatch of each kind is not timed: it may have compiled). Kinds (:meth:`choose`):

    * ``"spec"``: speculative rounds, while they pay (or while measuring: ``warmup``).
    * ``"plain"``: the target alone emits each token, the draft kept current
      (:mod:`jspec.engine.greedy`), when ``gain < 1`` or nothing was accepted at all
      (``accept_len == 1``: no gain whatever the times, a spec round costs more than a plain
      one). A plain dispatch is tried once when the acceptance is below ``try_plain_below`` (to
      learn ``t_plain``).
    * ``"probe"``: one spec round after ``probe_every`` plain dispatches in a row, to notice a
      draft that starts matching; each probe that finds no gain doubles the interval (up to
      ``max_probe_every``), one that finds a gain goes back to ``"spec"``.
    * ``"greedy"``: after ``retire_after`` probes in a row found no gain, the draft is retired
      for the rest of the engine's life: the target alone, without the draft forward (a plain
      greedy step's cost; the draft's state goes stale, so no more probes). A draft that has
      never had a token accepted (every spec round and probe emitted exactly one token per
      request: a head that does not match the target at all) is retired by its first failed
      probe: each plain dispatch before that costs the draft's forward for nothing.

    Host-side only; tokens are the target's whatever the kind (lossless).
    """

    alpha: float = 0.3
    warmup: int = 2
    try_plain_below: float = 2.0
    probe_every: int = 4
    max_probe_every: int = 64
    retire_after: int = 2
    accept_len: float | None = None
    t_spec: float | None = None
    t_plain: float | None = None
    spec_dispatches: int = 0
    plain_dispatches: int = 0
    plain_streak: int = 0
    failed_probes: int = 0
    probe_interval: int | None = None  # plain dispatches before the next probe (None: probe_every)
    accepted_any: bool = False  # some spec round or probe had a draft token accepted
    retired: bool = False

    KINDS = ("spec", "plain", "probe", "greedy")

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    @property
    def gain(self) -> float | None:
        """Tokens per second of speculating over not (None until both kinds were timed)."""
        if self.accept_len is None or self.t_spec is None or self.t_plain is None:
            return None
        return self.accept_len * self.t_plain / self.t_spec

    @property
    def _interval(self) -> int:
        return self.probe_every if self.probe_interval is None else self.probe_interval

    @property
    def pays(self) -> bool | None:
        """Whether speculating pays (None: not known yet)."""
        if self.accept_len is not None and self.accept_len <= 1.0 + 1e-6:
            return False  # nothing accepted: a spec round only costs more than a plain one
        gain = self.gain
        return None if gain is None else gain >= 1.0

    def choose(self) -> str:
        """The next dispatch's kind: ``"spec"``, ``"plain"``, ``"probe"`` or ``"greedy"``."""
        if self.retired:
            return "greedy"
        if self.accept_len is None:
            return "spec"
        pays = self.pays
        if pays is None:
            if self.spec_dispatches < self.warmup:
                return "spec"
            if self.t_plain is None and self.plain_dispatches < 2:
                return "plain" if self.accept_len < self.try_plain_below else "spec"
            return "spec"  # timed twice and still unknown: never learns
        if pays:
            return "spec"
        return "probe" if self.plain_streak >= self._interval else "plain"

    def observe(self, kind: str, rounds: int, wall: float, accept_len: float) -> None:
        """One dispatch's outcome: ``rounds`` rounds of ``kind`` in ``wall`` seconds,
        ``accept_len`` tokens per request per round."""
        if kind not in self.KINDS:
            raise ValueError(f"kind={kind!r} must be one of {self.KINDS}")
        if rounds <= 0 or kind == "greedy":
            return
        per_round = wall / rounds
        if kind == "plain":
            if self.plain_dispatches:  # NOTE: the first may have compiled the plain step
                self.t_plain = self._avg(self.t_plain, per_round)
            self.plain_dispatches += 1
            self.plain_streak += 1
            return
        if kind == "spec" and self.spec_dispatches:  # a probe's one round is not timed
            self.t_spec = self._avg(self.t_spec, per_round)
        self.accept_len = self._avg(self.accept_len, accept_len)
        self.accepted_any = self.accepted_any or accept_len > 1.0 + 1e-6
        self.spec_dispatches += 1
        self.plain_streak = 0
        if kind != "probe":
            return
        if self.pays is False:
            self.failed_probes += 1
            self.probe_interval = min(2 * self._interval, self.max_probe_every)
            self.retired = self.failed_probes >= self.retire_after or not self.accepted_any
        else:  # back to the configured interval
            self.failed_probes = 0
            self.probe_interval = None


@dataclasses.dataclass
class _Loop:
    """The host loop's bookkeeping of one :meth:`Engine.generate` run (per shard lists)."""

    pending: collections.deque  # Requests not admitted yet (FIFO by arrival)
    prefilling: list[list[Request]]  # admitted, KV being prefilled chunk by chunk
    running: list[dict[int, Request]]  # live (decoding) requests by batch slot
    free_slots: list[list[int]]
    t_start: float
    next_admission: int = 0
    step: int = 0  # the host loop's iteration (arrivals are counted in them)

    @property
    def busy(self) -> bool:
        return any(self.running) or any(self.prefilling)


class Engine:
    """A speculative (``draft`` given) or plain greedy (``draft=None``) engine over any models
    following :mod:`jspec.engine.protocol`.

    Args:
      ecfg: static engine config (``make_engine_config(target, ...)``).
      target, target_params: the target model (static, hashable) and its weights.
      draft, draft_params: the draft head and its weights, or None (plain greedy).
      num_devices: data-parallel shards (requests are spread over them); each shard uses
        ``ecfg.tensor_parallel`` devices (``num_devices * tensor_parallel`` in all).
      eos_token_id: optional stop token, or several (kept in the output).
      check_every_step: run the allocator integrity check after every decode step.
      checkify: run every jitted call under ``checkify`` with all probes on (trace inside
        ``jspec.probes.probes_enabled()``); a fired probe raises ``jspec.probes.ProbeError``.
        Also on, whatever this flag says, whenever probes are on at call time
        (``JSPEC_ENABLE_ASYNC_ASSERT=1`` or inside ``probes_enabled()``): probes are always
        functionalized, never left as bare ``checkify.check`` under ``jit``. Checkified calls
        do not donate the state, so after a ``ProbeError`` :attr:`state` is the state the
        failing call started from, intact for inspection.
      max_rounds: decode rounds one dispatch may run on the device
        (:mod:`jspec.engine.rounds`: EOS and max_new_tokens checked there): this many while no
        request waits for admission or prefill; 1 while a prompt is prefilled; while a queued
        request waits for a slot or pages, until a running request can first end (at most
        :data:`WAITING_ROUNDS` with stop ids).
        Default :data:`DEFAULT_MAX_ROUNDS`; fewer rounds stream tokens in smaller bursts and pay
        a dispatch's host cost more often.
      admission: ``"reserve"`` (admit while the requests' lifetime pages fit: never preempts)
        or ``"optimistic"`` (admit while the pages held now fit; preempt the newest request and
        prefill it again later when a decode step finds the pages short). See the module doc.
      adaptive: a spec engine decodes with plain steps (the target alone; the draft keeps its
        KV and proposals current: :mod:`jspec.engine.greedy`) whenever speculation does not
        pay: the measured acceptance length times the plain round's wall time, over the spec
        round's, below 1, with one-round probes backing off, and retires the draft (the target
        alone) after probes keep failing (:class:`SpecPolicy`). Tokens are the target's either way (lossless);
        the decisions are in ``RunStats.policy``. Off (default, deterministic step kinds):
        every round speculates. ``jspec generate`` turns it on (``--no-adaptive`` off).
      lossy_thresholds: sglang's ``threshold_single`` / ``threshold_acc`` for sampled
        requests (``jspec.tree.sampling.LossyThresholds``): CHANGES THE OUTPUT DISTRIBUTION
        (accepts more drafts than exact sampling). None (default): exact.

    A :meth:`generate` that ends by an exception (a fired probe, Ctrl-C, a ``progress``
    callback raising) leaves :attr:`state` as it was (its requests still live, for inspection);
    the next :meth:`generate` starts with :meth:`reset`, which frees everything.
    """

    def __init__(
        self,
        ecfg: EngineConfig,
        target: TargetModel,
        target_params: Any,
        draft: DraftModel | None = None,
        draft_params: Any = None,
        *,
        num_devices: int = 1,
        eos_token_id: int | Sequence[int] | None = None,
        check_every_step: bool = False,
        checkify: bool = False,
        admission: str = "reserve",
        max_rounds: int = DEFAULT_MAX_ROUNDS,
        adaptive: bool = False,
        lossy_thresholds: LossyThresholds | None = None,
    ) -> None:
        from jspec.engine.inputs import check_count

        if admission not in ADMISSIONS:
            raise ValueError(f"admission={admission!r} must be one of {ADMISSIONS}")
        self.admission = admission
        self.max_rounds = check_count("max_rounds", max_rounds)

        num_devices = check_count("num_devices", num_devices)
        if (draft is None) != (draft_params is None):
            raise ValueError("draft and draft_params: give both (spec) or neither (greedy)")
        ecfg.check_backend()  # a GPU-only kernel off the GPU: before any compile
        self.runner = Runner(ecfg, target, draft)  # checks the models against the config
        sharding.check_devices(num_devices, ecfg.tensor_parallel)
        self.ecfg, self.target, self.draft_model = ecfg, self.runner.target, self.runner.draft
        self.mode = "greedy" if draft is None else "spec"
        self.num_devices = num_devices
        self.eos_token_id = eos_token_id
        self.check_every_step = check_every_step
        tp = ecfg.tensor_parallel
        self.weights = Weights(
            target=sharding.replicate(target, target_params, num_devices, tp),
            draft=sharding.replicate(draft, draft_params, num_devices, tp),
        )
        self.state: EngineState = sharding.init_states(
            lambda: init_engine_state(self.runner), num_devices, tp
        )
        self.checkify = checkify
        self.lossy_thresholds = lossy_thresholds
        self.policy = SpecPolicy() if adaptive and draft is not None else None
        self._step_body = spec_step_body if self.mode == "spec" else greedy_step_body
        self._fns: dict[tuple, Any] = {}
        # ahead-of-time compiles running in the background (warmup(background=True)):
        # (function key, argument shapes) -> Future of a jax.stages.Compiled
        self._ahead: dict[tuple, concurrent.futures.Future] = {}
        # warmup(background=True)'s fallback rounds, submitted when speculation looks poor
        self._deferred: list[Callable[[], None]] = []
        self._compiler: concurrent.futures.ThreadPoolExecutor | None = None
        self._needs_reset = False  # a generate() ended by an exception

    def reset(self) -> None:
        """Free every page, row and batch slot: a fresh state (the KV pools zeroed).

        What :meth:`generate` runs first after a run that ended by an exception. The old state
        is dropped before the new one is built (no second copy of the pools)."""
        # the old pools freed before the new are built (idempotent: a reset that failed, e.g.
        # out of memory, left no state to drop)
        vars(self).pop("state", None)
        self.state = sharding.init_states(
            lambda: init_engine_state(self.runner),
            self.num_devices,
            self.ecfg.tensor_parallel,
        )
        self._needs_reset = False

    # ---- jitted calls ----------------------------------------------------------------------------
    @property
    def _checked(self) -> bool:
        """Run checkified: asked for, or probes on now (they would be traced into the step)."""
        return self.checkify or probes.probes_on()

    def _fn(
        self, body, num_tokens: int = 0, kv_len: int | None = None, prefix_len: int | None = None
    ):
        """The jitted ``body`` for calls whose target forward holds ``num_tokens`` tokens (the
        GEMM compile options depend on it: ``KernelPolicy.gemm_compiler_options``), whose
        requests read at most ``kv_len`` prefix keys (``Runner.max_kv_len``; None: any) and
        whose prefill chunks start at most ``prefix_len`` tokens in (``Runner.max_prefix_len``;
        None: anywhere)."""
        key = (body, self._checked, num_tokens, kv_len, prefix_len)
        if key not in self._fns:  # NOTE: cached here: hashing ecfg per host step costs
            options = self.ecfg.kernels.gemm_compiler_options(num_tokens)
            runner = self.runner
            if kv_len is not None or prefix_len is not None:
                runner = dataclasses.replace(runner, max_kv_len=kv_len, max_prefix_len=prefix_len)
            self._fns[key] = sharding.sharded(body, runner, self.num_devices, key[1], options)
        return self._fns[key]

    def _step_tokens(self, bucket: int) -> int:
        """Target-forward tokens of one decode step of ``bucket`` requests."""
        per_request = self.ecfg.spec.num_draft_tokens if self.mode == "spec" else 1
        return bucket * per_request

    def _step_for(self, bucket: int, max_len: int | None = None):
        """The jitted decode step ``f(weights, state, slot_idx, live)`` of a
        ``bucket``-request batch whose requests hold at most ``max_len`` tokens (its launch
        hint, ``ecfg.kv_len_bucket_for``; None: planned for the width)."""
        hint = None if max_len is None else self.ecfg.kv_len_bucket_for(max_len)
        return self._fn(self._step_body, self._step_tokens(bucket), hint)

    def _call(
        self, body, num_tokens: int, *args, kv_len: int | None = None, prefix_len: int | None = None
    ):
        # NOTE: device_put, not jnp.asarray: jnp.asarray dispatches an eager convert op per
        # argument (~0.3 ms each on the GPU host, measured), which the host loop paid every step.
        # One device_put of the host arguments (one batched transfer, not one per argument).
        checked = self._checked
        host = [jax.tree.map(np.asarray, a) for a in args if a is not None]
        fn = self._fn(body, num_tokens, kv_len, prefix_len)
        if self._ahead:  # compiled in the background: wait for it rather than compile again
            ahead = self._ahead.get(self._ahead_key(body, num_tokens, (kv_len, prefix_len), host))
            if ahead is not None:
                try:
                    fn = ahead.result()
                except concurrent.futures.CancelledError:  # cancel_compiles: jit compiles it
                    pass
        out = fn(self.weights, self.state, *jax.device_put(host))
        if checked:
            out, errors = out
            msg = sharding.first_error(errors, self.num_devices)
            if msg is not None:  # NOTE: self.state is the (undonated) state the call started from
                raise probes.ProbeError(msg)
        self.state, result = out
        return _tree_to_host(result)

    def _ahead_key(self, body, num_tokens: int, hints: tuple, host: list) -> tuple:
        shapes = tuple((x.shape, x.dtype.str) for x in jax.tree.leaves(host))
        return (body, self._checked, num_tokens, hints, shapes)

    def _compile_ahead(
        self, body, num_tokens: int, *args, kv_len: int | None = None, prefix_len: int | None = None
    ) -> None:
        """Compile what ``_call(body, num_tokens, *args, kv_len=..., prefix_len=...)`` runs on a
        background thread (the weights and state as shapes and shardings, the host arguments
        placed as ``_call`` places them); ``_call`` waits for it instead of compiling again."""
        host = [jax.tree.map(np.asarray, a) for a in args if a is not None]
        key = self._ahead_key(body, num_tokens, (kv_len, prefix_len), host)
        fn = self._fn(body, num_tokens, kv_len, prefix_len)
        abstract = functools.partial(
            jax.tree.map, lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        )
        operands = (abstract(self.weights), abstract(self.state), *jax.device_put(host))
        probes_on = probes.probes_on()  # JAX's config contexts are per thread: carry it over

        def compile_it():
            with _short_switch_interval(), probes.probes_enabled(probes_on, runtime_errors=False):
                return fn.lower(*operands).compile()

        if self._compiler is None:
            self._compiler = concurrent.futures.ThreadPoolExecutor(1, "jspec-compile")
        self._ahead[key] = self._compiler.submit(compile_it)

    def _submit_deferred(self) -> None:
        """Start the background compiles of the fallback rounds warmup deferred (once)."""
        deferred, self._deferred = self._deferred, []
        for call in deferred:
            call()

    def cancel_compiles(self) -> None:
        """Drop the background compiles that have not started (a later call that needs one
        compiles it then); one already running finishes."""
        self._deferred.clear()
        for future in self._ahead.values():
            future.cancel()

    def wait_compiles(self) -> None:
        """Block until every background compile of :meth:`warmup` finished (re-raising its
        error, if one failed)."""
        for future in list(self._ahead.values()):
            if not future.cancelled():
                future.result()

    def _call_prefill(
        self,
        slot_idx,
        token_ids,
        chunk_lens,
        starts=None,
        is_last=None,
        next_ids=None,
        sampling=None,
        ahead: bool = False,
    ):
        """One prefill call (``[D, Bp]`` entries of ``[D, Bp, Cq]`` tokens); by default every
        entry is a whole prompt (start 0, last chunk); ``sampling``: a SamplingBatch or None;
        ``ahead``: compile it in the background instead (:meth:`_compile_ahead`).

        A call whose entries (padding included) all start at 0 runs with ``max_prefix_len=0``
        where the kernel policy reads that bound (``KernelPolicy.reads_prefix_bound``: cuDNN's
        prefill then skips the prefix pass); other calls with none."""
        starts = np.zeros_like(chunk_lens) if starts is None else starts
        is_last = (chunk_lens > 0) if is_last is None else is_last
        next_ids = np.zeros_like(chunk_lens) if next_ids is None else next_ids
        num_tokens = token_ids.shape[-2] * token_ids.shape[-1]
        first_only = not np.any(starts)
        bound = (
            0 if first_only and self.ecfg.kernels.reads_prefix_bound(token_ids.shape[-1]) else None
        )
        args = (slot_idx, token_ids, chunk_lens, starts, is_last, next_ids, sampling)
        if ahead:
            self._compile_ahead(prefill_chunk_body, num_tokens, *args, prefix_len=bound)
            return None
        out = self._call(prefill_chunk_body, num_tokens, *args, prefix_len=bound)
        return out.first_tokens, out.ok

    def _call_step(self, slot_idx, live, sampling=None):
        num_tokens = self._step_tokens(slot_idx.shape[-1])
        return self._call(self._step_body, num_tokens, slot_idx, live, sampling)

    def _sampling_batch(self, requests: list[list[Request]], width: int):
        """The :class:`jspec.engine.sampling.SamplingBatch` of ``requests[shard][entry]``
        padded to ``width`` entries, or None when none of them samples (the greedy path)."""
        if all(r.sampling.is_greedy for shard in requests for r in shard):
            return None
        padded = [[r.sampling for r in shard] + [None] * (width - len(shard)) for shard in requests]
        return pack_sampling(padded, self.lossy_thresholds)

    def _call_rounds(
        self,
        slot_idx,
        live,
        budget,
        num_rounds: int,
        sampling=None,
        kind: str = "spec",
        kv_len: int | None = None,
        ahead: bool = False,
    ):
        """Up to ``num_rounds`` decode rounds in one dispatch (:mod:`jspec.engine.rounds`);
        ``kind`` (a spec engine's, :class:`SpecPolicy`): ``"plain"`` the greedy step with the
        draft kept current (:mod:`jspec.engine.greedy`), ``"greedy"`` its target-only variant,
        else the engine's step; ``kv_len``: the launch hint (:meth:`_kv_len_for`); ``ahead``:
        compile it in the background instead (:meth:`_compile_ahead`; returns None)."""
        d = self.num_devices
        eos = self._eos_array()
        step = {"plain": greedy_step_body, "greedy": target_only_step_body}.get(kind)
        body = rounds_body(step or self._step_body, self.max_rounds)
        tokens = slot_idx.shape[-1] if step else self._step_tokens(slot_idx.shape[-1])
        return (self._compile_ahead if ahead else self._call)(
            body,
            tokens,
            slot_idx,
            live,
            budget,
            np.broadcast_to(eos, (d, eos.size)),
            np.full((d,), num_rounds, np.int32),
            sampling,
            kv_len=kv_len,
        )

    def _kv_len_for(self, running: list[dict], num_rounds: int) -> int | None:
        """The launch hint of a dispatch (``EngineConfig.kv_len_bucket_for``): the longest
        request's prompt + output, grown by ``num_rounds`` rounds of at most ``num_steps + 1``
        tokens, plus a page."""
        if not self.ecfg.kv_len_buckets:
            return None
        longest = max(
            (len(r.prompt) + len(r.output) for shard in running for r in shard.values()), default=0
        )
        grow = self.ecfg.spec.num_steps + 1 if self.mode == "spec" else 1
        need = longest + num_rounds * grow + self.ecfg.spec.page_size
        return self.ecfg.kv_len_bucket_for(need)

    def _eos_array(self) -> np.ndarray:
        """The stop ids as i32[E] (-1 pads; E >= 1)."""
        eos = self.eos_token_id
        ids = [] if eos is None else [int(eos)] if isinstance(eos, (int, np.integer)) else eos
        return np.asarray(list(ids) or [-1], np.int32)

    def _call_release(self, slot_idx, finished, ahead: bool = False):
        """Release the ``finished`` entries (``RuntimeError`` if refused); ``ahead``: compile it
        in the background instead (:meth:`_compile_ahead`)."""
        if ahead:
            return self._compile_ahead(release_body, 0, slot_idx, finished)
        ok = self._call(release_body, 0, slot_idx, finished)
        if not np.all(ok):
            raise RuntimeError(
                f"release refused on shard(s) {np.flatnonzero(~np.asarray(ok)).tolist()} "
                f"(slots {np.asarray(slot_idx)[np.asarray(finished)].tolist()}): a slot not "
                "live, given twice, or pages / rows not the allocator's (state unchanged)"
            )

    def _warmup_plan(self, sampling: SamplingParams | None) -> tuple[list, list]:
        """What :meth:`warmup` compiles and runs, in order, as calls taking ``ahead`` (False:
        run it; True: compile it in the background): ``(calls, fallbacks)``, the fallbacks
        being adaptive speculation's rounds."""
        d, m = self.num_devices, self.ecfg.spec.max_running_requests
        bp = self.ecfg.prefill_batch
        calls: list[Callable[..., Any]] = []
        fallbacks: list[Callable[..., Any]] = []
        variants: list[SamplingParams | None] = [None]
        if sampling is not None and not sampling.is_greedy:
            variants.append(dataclasses.replace(sampling, seed=0))
        for params in variants:

            def batch(width, params=params):
                if params is None:
                    return None
                return pack_sampling([[params] * width] * d, self.lossy_thresholds)

            chunked = self.ecfg.spec.context_len > self.ecfg.max_chunk_len
            for cq in self.ecfg.prefill_chunk_buckets:
                args = (
                    np.full((d, bp), m, np.int32),
                    np.zeros((d, bp, cq), np.int32),
                    np.zeros((d, bp), np.int32),
                )
                calls.append(functools.partial(self._call_prefill, *args, sampling=batch(bp)))
                if chunked and self.ecfg.kernels.reads_prefix_bound(cq):
                    # later chunks' compile too (first chunks' has max_prefix_len=0); the
                    # padding entries' starts pick it, nothing reads them
                    later = np.ones((d, bp), np.int32)
                    calls.append(
                        functools.partial(
                            self._call_prefill, *args, starts=later, sampling=batch(bp)
                        )
                    )
            hints = (*self.ecfg.kv_len_buckets, None)
            for bucket, hint in itertools.product(self.ecfg.batch_buckets, hints):
                idx = np.full((d, bucket), m, np.int32)
                none = np.zeros((d, bucket), bool)
                # -1: one all-padding round that runs the loop body (rounds_body)
                rounds_args = (idx, none, np.zeros((d, bucket), np.int32), -1, batch(bucket))
                for kind in ("spec", "plain", "greedy") if self.policy else ("spec",):
                    call = functools.partial(
                        self._call_rounds, *rounds_args, kind=kind, kv_len=hint
                    )
                    (calls if kind == "spec" else fallbacks).append(call)
                if params is None and hint is None:
                    calls.append(functools.partial(self._call_release, idx, none))
        return calls, fallbacks

    def precompile(self, sampling: SamplingParams | None = None) -> None:
        """Start compiling what :meth:`warmup` compiles (prefill, the decode rounds, release;
        not adaptive speculation's rounds) on a background thread; the weights may still be
        shapes (``jax.ShapeDtypeStruct`` leaves: an Engine built before they load, then
        :meth:`set_weights`). :meth:`warmup` then runs those executables instead of compiling
        them again."""
        calls, _ = self._warmup_plan(sampling)
        for call in calls:
            call(ahead=True)

    def set_weights(self, target_params: Any, draft_params: Any = None) -> None:
        """Replace the weights with ``target_params`` / ``draft_params`` of the same structure,
        shapes and dtypes (``ValueError`` naming the first that differs): the loaded weights of
        an Engine built on their shapes (:meth:`precompile`)."""
        tp = self.ecfg.tensor_parallel
        new = Weights(
            target=sharding.replicate(self.target, target_params, self.num_devices, tp),
            draft=sharding.replicate(self.draft_model, draft_params, self.num_devices, tp),
        )
        old_tree: Any  # NOTE: jaxlib ships no type stub for PyTreeDef (no __ne__ for mypy)
        old_leaves, old_tree = jax.tree.flatten_with_path(self.weights)
        new_leaves, new_tree = jax.tree.flatten_with_path(new)
        if old_tree != new_tree:
            raise ValueError(f"set_weights: the params' structure differs ({new_tree})")
        for (path, a), (_, b) in zip(old_leaves, new_leaves, strict=True):
            if (a.shape, a.dtype) != (b.shape, b.dtype):
                raise ValueError(
                    f"set_weights: {jax.tree_util.keystr(path)} is {b.dtype}{list(b.shape)}, "
                    f"the engine was built for {a.dtype}{list(a.shape)}"
                )
        self.weights = new

    def warmup(self, sampling: SamplingParams | None = None, *, background: bool = False) -> None:
        """Compile prefill (every chunk bucket), release and the decode rounds of every batch
        bucket and launch hint (``kv_len_buckets``; all-padding inputs: no state changes); with
        a sampled ``sampling``, also the sampled prefill and rounds its filters need; with
        adaptive speculation, the plain and target-only rounds it may switch to.

        ``background``: adaptive speculation's rounds (which only a draft that does not pay
        runs) compile on a background thread, once a dispatch's acceptance falls below
        ``SpecPolicy.try_plain_below`` or the policy first picks one (with a draft that pays
        they never compile), not here. A dispatch that needs one before it is ready waits for
        it; the decode loop's host work shares the interpreter with that thread meanwhile
        (measured: -25% decode tokens/s at the 5 ms GIL switch interval, within 5% at 0.2 ms);
        :meth:`wait_compiles` blocks until the submitted ones are done. (Release, compiled in
        the background too at first, cost a 256-request batched run 3x its tokens/s: every
        batch bucket's first release waited for its compile.)
        """
        calls, fallbacks = self._warmup_plan(sampling)
        for call in calls if background else calls + fallbacks:
            call()
        self._deferred = [functools.partial(c, ahead=True) for c in fallbacks] if background else []
        self.check_leaks()  # compiles the end-of-run check (its first run compiled mid-run)

    # ---- the loop -------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        *,
        arrivals: Sequence[int] | None = None,
        progress: Callable[[int, int], None] | None = None,
        sampling: SamplingParams | Sequence[SamplingParams | None] | None = None,
        on_tokens: Callable[[int, list[int]], None] | None = None,
    ) -> tuple[list[list[int]], RunStats]:
        """Generate for every prompt (greedy, or sampled per request) with continuous batching.

        Every input is checked on the host first (``jspec.engine.inputs.validate_requests``:
        ``InputError`` naming the prompt and field), before anything compiles.

        Args:
          prompts: token id lists (1 <= len <= max_prompt_len, ids in [0, vocab_size)).
          max_new_tokens: per request (or one int for all), >= 1; ``len(prompt) +
            max_new_tokens`` must be <= context_len.
          arrivals: loop iteration at which each request arrives (default all 0).
          progress: ``progress(tokens_done, tokens_total)`` after every iteration.
          on_tokens: ``on_tokens(i, new_ids)`` after every iteration, for each request ``i``
            with tokens since its last call (already cut at EOS / max_new_tokens: request
            ``i`` is done once its tokens reach its max_new_tokens or end with an EOS id).
          sampling: None (all greedy), one :class:`SamplingParams` for all, or one per
            request (None entries greedy). A request's tokens depend only on its prompt and
            its parameters (seed included), not on the batch it shares, its slot or the device
            layout (a request preempted under ``"optimistic"`` admission keeps its law, not
            necessarily its tokens); a seed left None is drawn at random (``stats.sampling``).

        Returns:
          (outputs, stats): outputs[i] = generated tokens of prompt i (truncated at
          max_new_tokens, or after the EOS token).

        If the run ends by an exception (a fired probe, Ctrl-C, ``progress`` raising), the
        state is left as it was for inspection and the next call starts with :meth:`reset`.
        """
        if self._needs_reset:
            self.reset()
        ecfg, spec = self.ecfg, self.ecfg.spec
        prompts, max_new, arrivals = validate_requests(
            prompts,
            max_new_tokens,
            vocab_size=self.target.vocab_size,
            max_prompt_len=ecfg.max_prompt_len,
            context_len=spec.context_len,
            arrivals=arrivals,
        )
        n = len(prompts)
        params = normalize_sampling(sampling, n)
        reqs = []
        for i, prompt in enumerate(prompts):
            reqs.append(
                Request(i, prompt, max_new[i], arrivals[i], params[i], prefill_ids=list(prompt))
            )
            if self.lifetime_pages(reqs[-1]) > spec.num_pages:
                raise ValueError(
                    f"prompt {i}: needs up to {self.lifetime_pages(reqs[-1])} "
                    f"pages, the pool has num_pages={spec.num_pages}"
                )
        self._needs_reset = True  # until the run ends normally (an exception leaves it set)
        stats = RunStats(mode=self.mode, num_requests=n, sampling=params)
        total_tokens = sum(max_new)
        d, m = self.num_devices, spec.max_running_requests
        loop = _Loop(
            pending=collections.deque(sorted(reqs, key=lambda r: (r.arrival_step, r.rid))),
            prefilling=[[] for _ in range(d)],
            running=[{} for _ in range(d)],
            free_slots=[list(range(m)) for _ in range(d)],
            t_start=time.perf_counter(),
        )
        step, sent = 0, [0] * n  # sent: tokens of each request given to on_tokens
        while loop.pending or loop.busy:
            loop.step = step
            self._admit(step, loop)
            if any(loop.prefilling):
                t0 = time.perf_counter()
                self._prefill_round(loop, stats)
                stats.prefill_s += time.perf_counter() - t0
            self._retire(loop)
            if any(loop.running):
                t0 = time.perf_counter()
                self._decode_step(loop, stats)  # appends one step_s entry per round
                stats.decode_s += time.perf_counter() - t0
                self._retire(loop)
                if self.check_every_step:
                    self.check_integrity(what=f"after decode step {stats.num_decode_steps}")
            elif not any(loop.prefilling) and loop.pending:
                step = max(step + 1, loop.pending[0].arrival_step)
                continue
            if on_tokens is not None:
                for r in reqs:
                    if len(r.output) > sent[r.rid]:
                        new, sent[r.rid] = r.output[sent[r.rid] :], len(r.output)
                        on_tokens(r.rid, new)
            if progress is not None:
                progress(sum(len(r.output) for r in reqs), total_tokens)
            step += 1
        stats.wall_s = time.perf_counter() - loop.t_start
        stats.num_tokens = sum(len(r.output) for r in reqs)
        stats.request_accept_lens = [r.accept_lens for r in reqs]
        stats.ttft_s = [r.ttft_s for r in reqs]
        stats.num_preemptions = sum(r.num_preemptions for r in reqs)
        stats.leak_check = self.check_leaks()
        self._needs_reset = False
        return [r.output for r in reqs], stats

    # ---- admission and prefill -------------------------------------------------------------------
    def _admit(self, step: int, loop: _Loop) -> None:
        """Give arrived requests (FIFO) a free batch slot of the least-loaded shard while its
        pages last (module doc); the prefill rounds then fill their KV."""
        num_pages = self.ecfg.spec.num_pages
        while loop.pending and loop.pending[0].arrival_step <= step:
            req = loop.pending[0]
            need = self._admit_pages(req)
            room = [
                len(loop.free_slots[s])
                if self._held_pages(loop, s) + need <= num_pages and loop.free_slots[s]
                else 0
                for s in range(self.num_devices)
            ]
            shard = int(np.argmax(room))
            if room[shard] <= 0:
                return  # FIFO: the head of the queue waits for pages / slots
            loop.pending.popleft()
            req.shard, req.slot = shard, loop.free_slots[shard].pop(0)
            req.prefilled, req.admitted_at = 0, loop.next_admission
            loop.next_admission += 1
            loop.prefilling[shard].append(req)

    def _admit_pages(self, req: Request) -> int:
        """Pages admission counts for ``req`` (its lifetime under ``"reserve"``; under
        ``"optimistic"`` its prompt plus one decode step's reserve)."""
        if self.admission == "reserve":
            return self.lifetime_pages(req)
        return self._pages_for(len(req.prefill_ids) + self._decode_reserve())

    def _held_pages(self, loop: _Loop, shard: int) -> int:
        """Pages admission sees as taken on ``shard`` (what :meth:`_admit_pages` counted for
        each admitted request; under ``"optimistic"`` what they hold now)."""
        reqs = list(loop.running[shard].values()) + loop.prefilling[shard]
        if self.admission == "reserve":
            return sum(self.lifetime_pages(r) for r in reqs)
        return sum(
            self._pages_for(len(r.prefill_ids) + len(r.output) + self._decode_reserve())
            for r in reqs
        )

    def _decode_reserve(self) -> int:
        spec = self.ecfg.spec
        return spec.alloc_reserve_per_decode if self.mode == "spec" else 1

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.ecfg.spec.page_size)

    def lifetime_pages(self, req: Request) -> int:
        """Most pages ``req`` can hold at once (``"reserve"`` admission: never exhaust
        mid-decode).

        Spec: rows grow to ``ceil_P(committed + alloc_reserve_per_decode)`` with committed below
        ``prompt + max_new``; greedy: ``ceil(prompt + max_new, P)`` pages.
        """
        spec = self.ecfg.spec
        total = len(req.prompt) + req.max_new_tokens
        if self.mode == "spec":
            total += spec.alloc_reserve_per_decode
        return -(-total // spec.page_size)

    def _prefill_round(self, loop: _Loop, stats: RunStats) -> None:
        """One prefill call: the first ``prefill_batch`` prefilling requests of every shard
        advance by one chunk; a last chunk emits the first token and makes the request live."""
        d, m, bp = self.num_devices, self.ecfg.spec.max_running_requests, self.ecfg.prefill_batch
        max_chunk = self.ecfg.max_chunk_len
        batch = [loop.prefilling[s][:bp] for s in range(d)]
        chunk = [
            [min(len(r.prefill_ids) - r.prefilled, max_chunk) for r in batch[s]] for s in range(d)
        ]
        empty = [r.rid for s in range(d) for r, c in zip(batch[s], chunk[s]) if c <= 0]
        if empty:  # a prefill round that cannot advance them would be repeated forever
            raise RuntimeError(
                f"prefill: request(s) {empty} are prefilling with nothing left to prefill "
                "(internal error: a last chunk was not taken as last)"
            )
        cq = self.ecfg.prefill_bucket_for(max(max(c, default=1) for c in chunk))
        slot_idx = np.full((d, bp), m, np.int32)
        token_ids = np.zeros((d, bp, cq), np.int32)
        lens, starts = np.zeros((d, bp), np.int32), np.zeros((d, bp), np.int32)
        is_last, next_ids = np.zeros((d, bp), bool), np.zeros((d, bp), np.int32)
        for s in range(d):
            for i, (req, c) in enumerate(zip(batch[s], chunk[s], strict=True)):
                a, ids = req.prefilled, req.prefill_ids
                slot_idx[s, i], lens[s, i], starts[s, i] = req.slot, c, a
                token_ids[s, i, :c] = ids[a : a + c]
                is_last[s, i] = a + c == len(ids)
                next_ids[s, i] = ids[a + c] if a + c < len(ids) else 0
        sampling = self._sampling_batch(batch, bp)
        first, ok = self._call_prefill(
            slot_idx, token_ids, lens, starts, is_last, next_ids, sampling
        )
        stats.num_prefill_calls += 1
        for s in range(d):
            if not batch[s]:
                continue
            if not ok[s]:
                # Pages or rows short: nothing changed; wait for running requests to free
                # some, or give up when nothing else holds any (the pool is too small).
                if not loop.running[s] and len(loop.prefilling[s]) <= len(batch[s]):
                    if not any(r.prefilled for r in batch[s]):
                        raise RuntimeError(
                            f"shard {s}: cannot prefill {len(batch[s])} prompt(s) into an idle "
                            f"engine: KV pool ({self.ecfg.spec.num_pages} pages) or request "
                            "rows too small"
                        )
                    self._preempt(loop, s, batch[s][-1])
                continue
            for i, req in enumerate(batch[s]):
                req.prefilled += int(lens[s, i])
                if not is_last[s, i]:
                    continue
                loop.prefilling[s].remove(req)
                req.output.append(int(first[s, i]))
                if req.ttft_s < 0:
                    req.ttft_s = time.perf_counter() - loop.t_start
                loop.running[s][req.slot] = req

    def _preempt(self, loop: _Loop, shard: int, req: Request) -> None:
        """Release ``req``'s pages and row and queue it again (head of the queue) to be
        prefilled from scratch with its prompt + every token it emitted (no token is lost)."""
        d = self.num_devices
        slot_idx = np.full((d, 1), self.ecfg.spec.max_running_requests, np.int32)
        finished = np.zeros((d, 1), bool)
        slot_idx[shard, 0], finished[shard, 0] = req.slot, True
        self._call_release(self._pad_bucket(slot_idx), self._pad_bucket(finished))
        loop.running[shard].pop(req.slot, None)
        if req in loop.prefilling[shard]:
            loop.prefilling[shard].remove(req)
        loop.free_slots[shard].append(req.slot)
        loop.free_slots[shard].sort()
        req.prefill_ids = list(req.prompt) + list(req.output)
        req.prefilled, req.slot, req.num_preemptions = 0, -1, req.num_preemptions + 1
        loop.pending.appendleft(req)

    def _pad_bucket(self, x: np.ndarray) -> np.ndarray:
        """``[D, n]`` host array padded to the smallest batch bucket (release / step calls)."""
        bucket = self.ecfg.bucket_for(x.shape[1])
        fill = self.ecfg.spec.max_running_requests if x.dtype != bool else False
        out = np.full((x.shape[0], bucket), fill, x.dtype)
        out[:, : x.shape[1]] = x
        return out

    # ---- decode ------------------------------------------------------------------------------
    def _bucket_arrays(self, running: list[dict]) -> tuple[np.ndarray, np.ndarray, list]:
        d, m = self.num_devices, self.ecfg.spec.max_running_requests
        bucket = self.ecfg.bucket_for(max(len(r) for r in running))
        slot_idx = np.full((d, bucket), m, np.int32)
        live = np.zeros((d, bucket), bool)
        order = []
        for s in range(d):
            slots = sorted(running[s])
            slot_idx[s, : len(slots)] = slots
            live[s, : len(slots)] = True
            order.append(slots)
        return slot_idx, live, order

    def _rounds_for(self, loop: _Loop) -> int:
        """Rounds of the next decode dispatch: ``max_rounds`` while nobody waits; one while a
        prompt is being prefilled (a chunk per engine step) or the queue's head arrives at a
        later iteration; while the head waits for a slot or pages (only a finished request
        frees them), the rounds until the first running request can end by its budget (at
        most ``num_steps + 1`` tokens a round), and with stop ids at most
        :data:`WAITING_ROUNDS` (a stop id may end one sooner)."""
        if any(loop.prefilling):
            return 1
        if not loop.pending:
            return self.max_rounds
        if loop.pending[0].arrival_step > loop.step:
            return 1
        per_round = self.ecfg.spec.num_steps + 1 if self.mode == "spec" else 1
        left = [r.max_new_tokens - len(r.output) for shard in loop.running for r in shard.values()]
        soonest = -(-min(left, default=1) // per_round)
        if bool(np.any(self._eos_array() >= 0)):
            soonest = min(soonest, WAITING_ROUNDS)
        return max(1, min(soonest, self.max_rounds))

    def _decode_step(self, loop: _Loop, stats: RunStats, max_rounds: int | None = None) -> None:
        """One dispatch of :meth:`_rounds_for` decode rounds (at most ``max_rounds`` when
        given) over every live request. A shard whose first round finds the pages short
        preempts its newest request (``"optimistic"``) and the dispatch is retried."""
        running = loop.running
        rounds = self._rounds_for(loop)
        rounds = rounds if max_rounds is None else max(1, min(rounds, max_rounds))
        while True:
            slot_idx, live, order = self._bucket_arrays(running)
            budget = np.zeros(live.shape, np.int32)
            for s, slots in enumerate(order):
                for i, slot in enumerate(slots):
                    req = running[s][slot]
                    budget[s, i] = max(req.max_new_tokens - len(req.output), 1)
            requests = [[running[s][slot] for slot in slots] for s, slots in enumerate(order)]
            sampling = self._sampling_batch(requests, slot_idx.shape[-1])
            kind = "spec" if self.policy is None else self.policy.choose()
            if kind != "spec":
                self._submit_deferred()  # (a dispatch of these kinds waits for its compile)
            if kind == "probe":  # one spec round
                rounds = 1
            hint = self._kv_len_for(running, rounds)
            t0 = time.perf_counter()
            out = self._call_rounds(slot_idx, live, budget, rounds, sampling, kind, hint)
            wall = time.perf_counter() - t0
            num = np.asarray(out.num_rounds).reshape(-1)
            stuck = [s for s in range(self.num_devices) if num[s] == 0 and not out.ok[s]]
            for s in stuck:  # pages short before any round: preempt and retry that shard
                victims = list(running[s].values()) + loop.prefilling[s]
                if self.admission == "reserve" or len(victims) <= 1 or not running[s]:
                    raise RuntimeError(
                        f"decode step {stats.num_decode_steps}: KV pool exhausted on shard {s} "
                        f"(num_pages={self.ecfg.spec.num_pages})"
                    )
                self._preempt(loop, s, max(victims, key=lambda r: r.admitted_at))
            if num.max() > 0 or not any(running):
                break
            if not stuck:  # no round, no shortage: retrying would spin forever
                raise RuntimeError(
                    f"decode step {stats.num_decode_steps}: a dispatch ran no round for "
                    f"{sum(map(len, running))} running request(s) and found no page short "
                    "(internal error: the host's batch and the device state disagree)"
                )
        plain = kind in ("plain", "greedy")
        emitted = self._take_rounds(out, order, running, stats, wall, plain)
        if self.policy is not None:
            num_rounds = int(np.asarray(out.num_rounds).max())
            self.policy.observe(kind, num_rounds, wall, emitted)
            accept_len = self.policy.accept_len
            if accept_len is not None and accept_len < self.policy.try_plain_below:
                self._submit_deferred()  # speculation may stop paying: compile its fallbacks
            stats.policy.append((kind, num_rounds))

    def _take_rounds(
        self, out, order, running, stats: RunStats, wall: float, plain: bool = False
    ) -> float:
        """Append every round's tokens to its requests (one host pass per dispatch); returns
        the mean tokens per request per round (the dispatch's acceptance length).

        ``out.tokens: i32[D, R, Bb, W]``, ``out.lens: i32[D, R, Bb]`` (0: no token that round),
        ``out.num_rounds: i32[D]``; entry ``i`` of shard ``s`` is ``order[s][i]``'s slot."""
        # NOTE: one vectorized pass and one .tolist() per array, then list slices: the loop over
        # rounds x requests in Python cost 2-3 ms a dispatch at bs 64 x 32 rounds (this CPU).
        num = np.asarray(out.num_rounds).reshape(-1)
        rmax = int(num.max())
        if rmax == 0:
            return 0.0
        raw = np.asarray(out.lens)[:, :rmax]  # [D, R, Bb]
        tokens = np.asarray(out.tokens)[:, :rmax]  # [D, R, Bb, W]
        _, _, bb, w = tokens.shape
        entry = np.arange(bb)[None, :] < np.asarray([len(slots) for slots in order])[:, None]
        ran = np.arange(rmax)[None, :] < num[:, None]  # [D, R]
        lens = np.where(ran[:, :, None] & entry[:, None, :], raw, 0)
        stats.num_decode_steps += rmax
        stats.step_s.extend([wall / rmax] * rmax)
        stats.batch_sizes.extend((raw > 0).sum(axis=(0, 2)).tolist())
        # Per entry (shard-major, then entry): its rounds' accepted tokens, in round order.
        by_entry = lens.transpose(0, 2, 1)  # [D, Bb, R]
        keep = np.arange(w) < by_entry[..., None]  # [D, Bb, R, W]
        flat = tokens.transpose(0, 2, 1, 3)[keep].tolist()
        counts = by_entry.sum(axis=2).tolist()  # [D][Bb]
        accepted = by_entry.tolist() if self.mode == "spec" and not plain else None
        at = 0
        for s, slots in enumerate(order):
            for i, slot in enumerate(slots):
                n = counts[s][i]
                if n == 0:
                    continue  # stopped in an earlier dispatch (EOS / budget)
                req = running[s][slot]
                req.output.extend(flat[at : at + n])
                at += n
                if accepted is not None:
                    req.accept_lens.extend(x for x in accepted[s][i] if x)
        by_round = lens.transpose(1, 0, 2)  # [R, D, Bb]
        emitted = by_round[by_round > 0]  # round-major
        if accepted is not None:
            stats.accept_lens.extend(emitted.tolist())
        return float(emitted.mean()) if emitted.size else 0.0

    def _finished(self, req: Request) -> bool:
        """Whether ``req`` is done: a stop id in its output (cut after the first) or its budget
        reached (cut there). Only the tokens since the last call are searched for a stop id
        (``req.stop_scanned``): the host pass stays linear in the tokens, not in output x
        calls (64 requests of 4000 tokens: 8.3 ms a call before, on this CPU)."""
        eos = self.eos_token_id
        stop_ids = (
            set() if eos is None else {int(eos)} if isinstance(eos, (int, np.integer)) else set(eos)
        )
        if stop_ids:
            for i in range(req.stop_scanned, len(req.output)):
                if req.output[i] in stop_ids:
                    del req.output[i + 1 :]
                    req.stop_scanned = len(req.output)
                    return True
            req.stop_scanned = len(req.output)
        if len(req.output) >= req.max_new_tokens:
            del req.output[req.max_new_tokens :]
            return True
        return False

    def _retire(self, loop: _Loop) -> None:
        running, free_slots = loop.running, loop.free_slots
        done = [
            [slot for slot, req in running[s].items() if self._finished(req)]
            for s in range(self.num_devices)
        ]
        if not any(done):
            return
        d, m = self.num_devices, self.ecfg.spec.max_running_requests
        bucket = self.ecfg.bucket_for(max(len(x) for x in done))
        slot_idx = np.full((d, bucket), m, np.int32)
        finished = np.zeros((d, bucket), bool)
        for s in range(d):
            slot_idx[s, : len(done[s])] = done[s]
            finished[s, : len(done[s])] = True
            for slot in done[s]:
                del running[s][slot]
                free_slots[s].append(slot)
            free_slots[s].sort()
        self._call_release(slot_idx, finished)

    # ---- checks ----------------------------------------------------------------------------------
    def _host_bookkeeping(self) -> PagedKVState:
        """The stacked KV state without its pools, on the host (gathered from every process on
        a multi-host mesh): what the checks read."""
        kv = replace(self.state.kv, target_pool=None, draft_pool=None)
        return jax.tree.map(_to_host, kv)

    def _shard_state(self, s: int) -> EngineState:
        """Shard ``s``'s state: the KV bookkeeping on the host, the pools and the carry sliced
        on the device (never copied to the host)."""
        st, one = self.state, lambda tree: jax.tree.map(lambda x: x[s], tree)
        kv = replace(
            one(self._host_bookkeeping()),
            target_pool=one(st.kv.target_pool),
            draft_pool=one(st.kv.draft_pool),
        )
        return EngineState(kv=kv, carry=one(st.carry))

    def _host_shards(self) -> list[PagedKVState]:
        """Every shard's bookkeeping on the host (pools None), fetched once."""
        host = self._host_bookkeeping()
        return [jax.tree.map(lambda x, s=s: x[s], host) for s in range(self.num_devices)]

    def check_integrity(self, what: str = "") -> None:
        """``check_integrity`` on every shard with the pages owned by its live requests."""
        self._check_shards(self._host_shards(), what)

    def _check_shards(self, shards: list[PagedKVState], what: str) -> None:
        spec = self.ecfg.spec
        for s, st in enumerate(shards):
            owned = owned_page_mask(
                st.req_to_token,
                st.req_pool_indices,
                st.allocated_lens,
                num_pages=spec.num_pages,
                page_size=spec.page_size,
                valid=jnp.asarray(st.req_pool_indices) > 0,  # live + prefilling requests
            )
            check_integrity(st.allocator, owned, what=f"shard {s} {what}".strip())

    def check_leaks(self) -> str:
        """After a run: every page and every req_to_token row is free again (else raises)."""
        spec = self.ecfg.spec
        shards = self._host_shards()
        self._check_shards(shards, "after run")
        for s, st in enumerate(shards):
            avail = int(available_size(st.allocator))
            rows = int(st.req_rows.num_free)
            live = int(np.sum(np.asarray(st.live)))
            if avail != spec.pool_size or rows != spec.max_running_requests or live:
                raise AssertionError(
                    f"shard {s}: memory leak detected! available={avail} slots of "
                    f"{spec.pool_size}, free rows={rows} of {spec.max_running_requests}, "
                    f"live slots={live}"
                )
        return (
            f"ok: {self.num_devices} x {spec.num_pages} pages and "
            f"{spec.max_running_requests} rows free"
        )


def _tree_to_host(tree: Any) -> Any:
    """``tree``'s arrays on the host; when every leaf is addressable here, through one
    ``jax.device_get`` (all copies started, then one wait: one sync per step, not one per leaf).
    """
    if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree)):
        return jax.device_get(tree)
    return jax.tree.map(_to_host, tree)


def _to_host(x: jax.Array) -> np.ndarray:
    """A (possibly multi-host) array as one numpy array: on a mesh spanning several processes
    (``jax.distributed``) every process gathers the whole array."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
