"""Continuous batching: the host loop around the jitted prefill / decode step / release.

NOTE: over ~400 lines on purpose: one concept (the Engine's host loop: admission, bucketing,
sharded step calls, token bookkeeping, leak checks) whose methods share the Engine's host-side
state; a split would scatter that state across modules while the loop is being reworked
(host-loop overlap).

Between two decode steps the scheduler

1. admits waiting requests (arrival step reached, FIFO) into free batch slots of the
   least-loaded shard, ``prefill_batch`` prompts per prefill call, as long as the pages
   promised to the shard's requests (each one's lifetime maximum, :meth:`Engine.lifetime_pages`)
   fit the pool, so a decode step never runs out of pages; a prefill that still finds the pages
   or rows short (``ok`` False) puts its prompts back in the queue;
2. runs one decode step (plain greedy or speculative) over the smallest batch bucket that holds
   every shard's running requests (padding entries are invalid rows: row 0, slot 0);
3. appends the emitted tokens (spec: ``accept_tokens[:accept_len]``), truncates at
   ``max_new_tokens`` / EOS, and releases finished requests (pages, row, batch slot).

After every run the allocator must be back to all pages free and all rows free (leak check,
``check_integrity``); ``check_every_step`` also checks ``free + owned == total`` after every step.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jspec import probes
from jspec._pytree import replace
from jspec.engine import sharding
from jspec.engine.greedy import greedy_step_body
from jspec.engine.inputs import validate_requests
from jspec.engine.lifecycle import prefill_body, release_body
from jspec.engine.sampling_params import (
    GREEDY,
    SamplingParams,
    normalize_sampling,
    pack_sampling,
)
from jspec.engine.state import (
    EngineConfig,
    EngineState,
    check_engine_models,
    init_engine_state,
)
from jspec.kv.allocator import available_size
from jspec.kv.integrity import check_integrity, owned_page_mask
from jspec.tree.sampling import LossyThresholds


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
    leak_check: str = ""
    # each request's sampling parameters as used (seeds drawn for those that had none)
    sampling: list[SamplingParams] = dataclasses.field(default_factory=list)

    @property
    def mean_accept_len(self) -> float:
        """Mean tokens emitted per request per decode step (sglang accept length)."""
        return float(np.mean(self.accept_lens)) if self.accept_lens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s > 0 else 0.0


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
        functionalized, never left as bare ``checkify.check`` under ``jit``.
      lossy_thresholds: sglang's ``threshold_single`` / ``threshold_acc`` for sampled
        requests (``jspec.tree.sampling.LossyThresholds``): CHANGES THE OUTPUT DISTRIBUTION
        (accepts more drafts than exact sampling). None (default): exact.
    """

    def __init__(
        self,
        ecfg: EngineConfig,
        target: Any,
        target_params: Any,
        draft: Any = None,
        draft_params: Any = None,
        *,
        num_devices: int = 1,
        eos_token_id: int | Sequence[int] | None = None,
        check_every_step: bool = False,
        checkify: bool = False,
        lossy_thresholds: LossyThresholds | None = None,
    ) -> None:
        from jspec.engine.inputs import check_count

        num_devices = check_count("num_devices", num_devices)
        if (draft is None) != (draft_params is None):
            raise ValueError("draft and draft_params: give both (spec) or neither (greedy)")
        check_engine_models(ecfg, target, draft)
        sharding.check_devices(num_devices, ecfg.tensor_parallel)
        self.ecfg, self.target, self.draft_model = ecfg, target, draft
        self.mode = "greedy" if draft is None else "spec"
        self.num_devices = num_devices
        self.eos_token_id = eos_token_id
        self.check_every_step = check_every_step
        tp = ecfg.tensor_parallel
        self.params = sharding.replicate(target, target_params, num_devices, tp)
        self.draft = sharding.replicate(draft, draft_params, num_devices, tp)
        self.state: EngineState = sharding.stack_states(
            [init_engine_state(ecfg, draft) for _ in range(num_devices)], num_devices, tp
        )
        self.checkify = checkify
        self.lossy_thresholds = lossy_thresholds
        self._step_body = _spec_body if self.mode == "spec" else greedy_step_body
        self._fns: dict[tuple, Any] = {}

    # ---- jitted calls ----------------------------------------------------------------------------
    @property
    def _checked(self) -> bool:
        """Run checkified: asked for, or probes on now (they would be traced into the step)."""
        return self.checkify or probes.probes_on()

    def _fn(self, body, num_tokens: int = 0):
        """The jitted ``body`` for calls whose target forward holds ``num_tokens`` tokens (the
        GEMM compile options depend on it: ``EngineConfig.gemm_compiler_options``)."""
        key = (body, self._checked, num_tokens)
        if key not in self._fns:  # NOTE: cached here: hashing ecfg per host step costs
            options = self.ecfg.gemm_compiler_options(num_tokens)
            self._fns[key] = sharding.sharded(
                body, self.ecfg, self.target, self.draft_model, self.num_devices, key[1], options
            )
        return self._fns[key]

    def _step_tokens(self, bucket: int) -> int:
        """Target-forward tokens of one decode step of ``bucket`` requests."""
        per_request = self.ecfg.spec.num_draft_tokens if self.mode == "spec" else 1
        return bucket * per_request

    def _step_for(self, bucket: int):
        """The jitted decode step ``f(params, draft_params, state, slot_idx, live)`` of a
        ``bucket``-request batch."""
        return self._fn(self._step_body, self._step_tokens(bucket))

    def _call(self, body, num_tokens: int, *args):
        # NOTE: device_put, not jnp.asarray: jnp.asarray dispatches an eager convert op per
        # argument (~0.3 ms each on the GPU host, measured), which the host loop paid every step.
        # One device_put of the host arguments (one batched transfer, not one per argument).
        checked = self._checked
        host = [jax.tree.map(np.asarray, a) for a in args if a is not None]
        out = self._fn(body, num_tokens)(self.params, self.draft, self.state, *jax.device_put(host))
        if checked:
            out, errors = out
            msg = sharding.first_error(errors, self.num_devices)
            if msg is not None:
                raise probes.ProbeError(msg)
        self.state, result = out
        return _tree_to_host(result)

    def _call_prefill(self, slot_idx, prompt_ids, prompt_lens, sampling=None):
        num_tokens = prompt_ids.shape[-2] * prompt_ids.shape[-1]
        out = self._call(prefill_body, num_tokens, slot_idx, prompt_ids, prompt_lens, sampling)
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

    def _call_release(self, slot_idx, finished):
        self._call(release_body, 0, slot_idx, finished)

    def warmup(self, sampling: SamplingParams | None = None) -> None:
        """Compile prefill, release and the decode step of every bucket (all-padding inputs);
        with a sampled ``sampling``, also the sampled prefill and steps its filters need."""
        d, m = self.num_devices, self.ecfg.spec.max_running_requests
        bp, lp = self.ecfg.prefill_batch, self.ecfg.max_prompt_len
        variants = [None]
        if sampling is not None and not sampling.is_greedy:
            variants.append(dataclasses.replace(sampling, seed=0))
        for params in variants:

            def batch(width, params=params):
                if params is None:
                    return None
                return pack_sampling([[params] * width] * d, self.lossy_thresholds)

            self._call_prefill(
                np.full((d, bp), m, np.int32),
                np.zeros((d, bp, lp), np.int32),
                np.zeros((d, bp), np.int32),
                batch(bp),
            )
            for bucket in self.ecfg.batch_buckets:
                idx = np.full((d, bucket), m, np.int32)
                self._call_step(idx, np.zeros((d, bucket), bool), batch(bucket))
                if params is None:
                    self._call_release(idx, np.zeros((d, bucket), bool))

    # ---- the loop -------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        *,
        arrivals: Sequence[int] | None = None,
        progress: Callable[[int, int], None] | None = None,
        sampling: SamplingParams | Sequence[SamplingParams | None] | None = None,
    ) -> tuple[list[list[int]], RunStats]:
        """Generate for every prompt (greedy, or sampled per request) with continuous batching.

        Every input is checked on the host first (``jspec.engine.inputs.validate_requests``:
        ``InputError`` naming the prompt and field), before anything compiles.

        Args:
          prompts: token id lists (1 <= len <= max_prompt_len, ids in [0, vocab_size)).
          max_new_tokens: per request (or one int for all), >= 1; ``len(prompt) +
            max_new_tokens`` must be <= context_len.
          arrivals: decode-step index at which each request arrives (default all 0).
          progress: ``progress(tokens_done, tokens_total)`` after every step.
          sampling: None (all greedy), one :class:`SamplingParams` for all, or one per
            request (None entries greedy). A request's tokens depend only on its prompt and
            its parameters (seed included), not on the batch it shares, its slot or the device
            layout; a seed left None is drawn at random (``stats.sampling`` has it).

        Returns:
          (outputs, stats): outputs[i] = generated tokens of prompt i (truncated at
          max_new_tokens, or after the EOS token).
        """
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
            reqs.append(Request(i, prompt, max_new[i], arrivals[i], params[i]))
            if self.lifetime_pages(reqs[-1]) > spec.num_pages:
                raise ValueError(
                    f"prompt {i}: needs up to {self.lifetime_pages(reqs[-1])} "
                    f"pages, the pool has num_pages={spec.num_pages}"
                )
        stats = RunStats(mode=self.mode, num_requests=n, sampling=params)
        total_tokens = sum(max_new)
        d, m = self.num_devices, spec.max_running_requests
        pending = collections.deque(sorted(reqs, key=lambda r: (r.arrival_step, r.rid)))
        running: list[dict[int, Request]] = [{} for _ in range(d)]
        free_slots: list[list[int]] = [list(range(m)) for _ in range(d)]
        t_start = time.perf_counter()
        step = 0
        while pending or any(running):
            t0 = time.perf_counter()
            self._admit(step, pending, running, free_slots)
            stats.prefill_s += time.perf_counter() - t0
            self._retire(running, free_slots)
            if not any(running):
                if pending:
                    step = max(step + 1, pending[0].arrival_step)
                continue
            t0 = time.perf_counter()
            self._decode_step(running, stats)
            stats.step_s.append(time.perf_counter() - t0)
            stats.decode_s += stats.step_s[-1]
            self._retire(running, free_slots)
            if self.check_every_step:
                self.check_integrity(what=f"after decode step {stats.num_decode_steps}")
            if progress is not None:
                progress(sum(len(r.output) for r in reqs), total_tokens)
            step += 1
        stats.wall_s = time.perf_counter() - t_start
        stats.num_tokens = sum(len(r.output) for r in reqs)
        stats.request_accept_lens = [r.accept_lens for r in reqs]
        stats.leak_check = self.check_leaks()
        return [r.output for r in reqs], stats

    def _admit(
        self,
        step: int,
        pending: collections.deque,
        running: list[dict],
        free_slots: list[list[int]],
    ) -> None:
        d, bp = self.num_devices, self.ecfg.prefill_batch
        m, lp = self.ecfg.spec.max_running_requests, self.ecfg.max_prompt_len
        num_pages = self.ecfg.spec.num_pages
        blocked = [False] * d
        while pending and pending[0].arrival_step <= step:
            batch: list[list[Request]] = [[] for _ in range(d)]
            # Pages promised to running requests (their lifetime maximum) and to this batch.
            promised = [sum(self.lifetime_pages(r) for r in running[s].values()) for s in range(d)]
            while pending and pending[0].arrival_step <= step:
                need = self.lifetime_pages(pending[0])
                room = [
                    len(free_slots[s]) - len(batch[s])
                    if not blocked[s] and len(batch[s]) < bp and promised[s] + need <= num_pages
                    else 0
                    for s in range(d)
                ]
                shard = int(np.argmax(room))
                if room[shard] <= 0:
                    break  # FIFO: the head of the queue waits for pages / slots
                batch[shard].append(pending.popleft())
                promised[shard] += need
            if not any(batch):
                return
            slot_idx = np.full((d, bp), m, np.int32)
            prompt_ids = np.zeros((d, bp, lp), np.int32)
            prompt_lens = np.zeros((d, bp), np.int32)
            for s in range(d):
                for i, req in enumerate(batch[s]):
                    slot_idx[s, i] = free_slots[s][i]
                    prompt_ids[s, i, : len(req.prompt)] = req.prompt
                    prompt_lens[s, i] = len(req.prompt)
            sampling = self._sampling_batch(batch, bp)
            first, ok = self._call_prefill(slot_idx, prompt_ids, prompt_lens, sampling)
            for s in range(d):
                if not batch[s]:
                    continue
                if not ok[s]:
                    if not running[s]:
                        raise RuntimeError(
                            f"shard {s}: cannot admit {len(batch[s])} prompt(s) into an idle "
                            f"engine: KV pool ({self.ecfg.spec.num_pages} pages) or request "
                            "rows too small"
                        )
                    blocked[s] = True
                    pending.extendleft(reversed(batch[s]))
                    continue
                for i, req in enumerate(batch[s]):
                    req.shard, req.slot = s, free_slots[s].pop(0)
                    assert req.slot == slot_idx[s, i]
                    req.output.append(int(first[s, i]))
                    running[s][req.slot] = req
            if all(blocked[s] or not free_slots[s] for s in range(d)):
                return

    def lifetime_pages(self, req: Request) -> int:
        """Most pages ``req`` can hold at once (admission control: never exhaust mid-decode).

        Spec: rows grow to ``ceil_P(committed + alloc_reserve_per_decode)`` with committed below
        ``prompt + max_new``; greedy: ``ceil(prompt + max_new, P)`` pages.
        """
        spec = self.ecfg.spec
        total = len(req.prompt) + req.max_new_tokens
        if self.mode == "spec":
            total += spec.alloc_reserve_per_decode
        return -(-total // spec.page_size)

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

    def _decode_step(self, running: list[dict], stats: RunStats) -> None:
        slot_idx, live, order = self._bucket_arrays(running)
        requests = [[running[s][slot] for slot in slots] for s, slots in enumerate(order)]
        out = self._call_step(slot_idx, live, self._sampling_batch(requests, slot_idx.shape[-1]))
        ok = out.ok
        if not np.all(ok):
            raise RuntimeError(
                f"decode step {stats.num_decode_steps}: KV pool exhausted on "
                f"shard(s) {np.flatnonzero(~ok).tolist()} (num_pages="
                f"{self.ecfg.spec.num_pages})"
            )
        stats.num_decode_steps += 1
        stats.batch_sizes.append(int(live.sum()))
        # NOTE: .tolist() once, not int() per element (per-step host time at bs 64).
        if self.mode == "greedy":
            next_tokens = out.next_tokens.tolist()
            for s, slots in enumerate(order):
                for i, slot in enumerate(slots):
                    running[s][slot].output.append(next_tokens[s][i])
            return
        accept_lens, accept_tokens = out.accept_lens.tolist(), out.accept_tokens.tolist()
        for s, slots in enumerate(order):
            for i, slot in enumerate(slots):
                req, n_acc = running[s][slot], accept_lens[s][i]
                req.output.extend(accept_tokens[s][i][:n_acc])
                req.accept_lens.append(n_acc)
                stats.accept_lens.append(n_acc)

    def _finished(self, req: Request) -> bool:
        eos = self.eos_token_id
        eos = () if eos is None else {int(eos)} if isinstance(eos, (int, np.integer)) else set(eos)
        hit = [i for i, t in enumerate(req.output) if t in eos] if eos else []
        if hit:
            del req.output[hit[0] + 1 :]
            return True
        if len(req.output) >= req.max_new_tokens:
            del req.output[req.max_new_tokens :]
            return True
        return False

    def _retire(self, running: list[dict], free_slots: list[list[int]]) -> None:
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
    def _host_bookkeeping(self) -> EngineState:
        """The stacked state without its KV pools, on the host (gathered from every process on
        a multi-host mesh): what the checks read."""
        return jax.tree.map(_to_host, replace(self.state, target_pool=None, draft_pool=None))

    def _shard_state(self, s: int) -> EngineState:
        """Shard ``s``'s state: the bookkeeping on the host, the KV pools sliced on the device
        (never copied to the host)."""
        st = self.state
        host = jax.tree.map(lambda x: x[s], self._host_bookkeeping())
        return replace(
            host,
            target_pool=jax.tree.map(lambda x: x[s], st.target_pool),
            draft_pool=jax.tree.map(lambda x: x[s], st.draft_pool),
        )

    def _host_shards(self) -> list[EngineState]:
        """Every shard's bookkeeping on the host (pools None), fetched once."""
        host = self._host_bookkeeping()
        return [jax.tree.map(lambda x, s=s: x[s], host) for s in range(self.num_devices)]

    def check_integrity(self, what: str = "") -> None:
        """``check_integrity`` on every shard with the pages owned by its live requests."""
        self._check_shards(self._host_shards(), what)

    def _check_shards(self, shards: list[EngineState], what: str) -> None:
        spec = self.ecfg.spec
        for s, st in enumerate(shards):
            owned = owned_page_mask(
                st.req_to_token,
                st.req_pool_indices,
                st.allocated_lens,
                num_pages=spec.num_pages,
                page_size=spec.page_size,
                valid=st.live,
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
            if (
                avail != spec.pool_size
                or rows != spec.max_running_requests
                or bool(np.any(np.asarray(st.live)))
            ):
                raise AssertionError(
                    f"shard {s}: memory leak detected! available={avail} slots of "
                    f"{spec.pool_size}, free rows={rows} of {spec.max_running_requests}"
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


def _spec_body(*args: Any) -> Any:
    from jspec.engine.spec_step import spec_step_body

    return spec_step_body(*args)
