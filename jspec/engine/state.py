"""Engine configuration and the device-resident engine state (one data-parallel shard).

The state holds everything a step reads and writes, as one pytree, so a step is a pure jitted
function ``state' = step(runner, weights, state, ...)`` with the state donated. It has two
parts:

* ``kv``: the KV backend's state (``jspec.engine.kv_backend``): allocation, per-slot lengths
  and liveness, the target and draft pools. jspec's is ``jspec.engine.paged_kv.PagedKVState``
  (paged allocator, req_to_token rows, sglang's layout);
* ``carry``: the speculative carry per **batch slot** (:class:`SpecCarry`; capacity
  ``max_running_requests``, the host scheduler decides which slot a request occupies)::

    bonus_tokens     i32[M]   last generated token (the next tree root; no KV yet)
    topk_p           f32[M, K], topk_index i32[M, K] (TARGET ids), draft_hidden dtype[M, Hd]
                              the draft's proposal for the first tree level (from the
                              last draft extend / draft prefill); Hd = draft.hidden_size

The configuration is model-agnostic: the target pool's geometry comes from the target model
(:func:`make_engine_config`), the draft pool's from the draft model (:func:`draft_pool_spec`);
the models themselves (``jspec.engine.protocol``) are bundled with it in
``jspec.engine.runner.Runner``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jspec._compact import compact
from jspec._pytree import pytree_dataclass
from jspec.config import BatchBuckets, SpecConfig, ceil_div
from jspec.engine.attention import PagedAttentionBackend
from jspec.engine.protocol import DTYPES, DraftModel
from jspec.kernels.policy import KernelPolicy, resolve_kernel_policy

DRAFT_ATTENTION = ("cascade", "kv_indices")
# chunked_prefill_size: prompt tokens per prefill call (sglang --chunked-prefill-size; its
# default on large GPUs). Prefill chunk lengths are compiled per bucket (prefill_buckets):
# by default the largest chunk and its quarters down to MIN_PREFILL_BUCKET.
DEFAULT_CHUNKED_PREFILL_SIZE = 8192
MIN_PREFILL_BUCKET = 64
# Decode launch hints (EngineConfig.kv_len_buckets, Runner.max_kv_len) with the Triton
# attention: 512 keys and every 4x above it, below context_len. Measured on the H100
# (2026-11-26, bench.paged_attention --capacity): a 128-key pass in an 8k-key page table costs
# 2-3x the same pass planned for its length (decode bs 1: 12.2 vs 4.3 us; verify bs 16: 30.9
# vs 14.6 us), the key splits planned for the width being launched and merged empty.
KV_LEN_BUCKET_MIN, KV_LEN_BUCKET_RATIO = 512, 4
DP_AXIS, TP_AXIS = "dp", "tp"  # mesh axes: data-parallel shards, tensor-parallel heads


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine configuration (hashable: a static jit argument).

    Attributes:
      spec: bookkeeping config (page_size, topk, num_steps, num_draft_tokens, context_len,
        max_running_requests, num_pages) whose pool geometry (num_layers, num_kv_heads,
        head_dim, dtype) is the target model's (``jspec.engine.runner.check_engine_models``).
      max_prompt_len: static prompt padding for prefill.
      batch_buckets: decode batch sizes compiled (sglang cuda-graph ``capture_bs``).
      prefill_batch: prompts admitted per prefill call (per shard).
      draft_attention: ``"cascade"`` (FA3 prefix + expand passes merged by LSE) or
        ``"kv_indices"`` (FlashInfer-style token-level indices).
      kernels: the concrete kernel of every op family
        (:class:`jspec.kernels.policy.KernelPolicy`: bookkeeping ops, paged attention, GEMM
        compile options, the models' RMSNorm, the draft's top-k), resolved once by
        :func:`make_engine_config` from the backend, the model dtype and widths. The default is
        the pure-jnp references everywhere. Greedy and speculative runs of one config use the
        same kernels, so they stay token-identical.
      tensor_parallel: devices that share one data-parallel shard, each holding a contiguous
        block of the query / KV heads and of the MLP (sglang ``--tp-size``). Needs
        ``num_kv_heads`` divisible by it and models that define ``param_specs``
        (``jspec.engine.protocol``). Each of these devices keeps
        its own copy of the bookkeeping (allocator, req_to_token, per-slot arrays) and computes
        it identically, as sglang's TP ranks do; the KV pools hold its KV heads only. With
        ``tensor_parallel > 1`` the model bodies call ``psum`` over the mesh axis
        :attr:`tp_axis`, so they run only under ``jspec.engine.sharding.sharded``.
      attention_backend: an :class:`jspec.engine.attention.AttentionBackend` object (hashable)
        that replaces ``kernels.attention`` (a serving stack's own attention over the same
        pool).
      chunked_prefill_size: prompt tokens per prefill call over the whole prefill batch
        (sglang ``--chunked-prefill-size``): a call prefills ``[prefill_batch, Cq]`` tokens with
        ``Cq <= chunked_prefill_size // prefill_batch``, so activations are bounded by the
        chunk; longer prompts take several calls, interleaved with decode steps.
      prefill_buckets: chunk lengths ``Cq`` compiled (ascending); None: the largest chunk
        (``min(chunked_prefill_size // prefill_batch, max_prompt_len)`` and its quarters down
        to :data:`MIN_PREFILL_BUCKET` (:attr:`prefill_chunk_buckets`).
      mem_fraction_static: the fraction of device memory weights + KV pools may take (sglang
        ``--mem-fraction-static``) when the pool was sized from free memory
        (:func:`make_engine_config`); None: ``num_pages`` was given or sized for the worst
        case. Informational here.
      kv_len_buckets: the decode launch hints compiled (ascending ints in ``[1,
        context_len)``): a dispatch whose requests read at most ``b`` prefix keys runs the
        step compiled with ``Runner.max_kv_len = b``, the smallest such bucket (none: the
        whole width), like batch buckets for lengths. Only a plan: tokens are the same
        whatever the bucket. :func:`make_engine_config` gives the Triton attention 512 keys
        and every 4x above, below ``context_len``, and other attention none (the reference
        ignores the hint).
    """

    spec: SpecConfig
    max_prompt_len: int
    batch_buckets: tuple[int, ...]
    prefill_batch: int = 1
    draft_attention: str = "cascade"
    kernels: KernelPolicy = KernelPolicy()
    tensor_parallel: int = 1
    attention_backend: Any = None
    chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL_SIZE
    prefill_buckets: tuple[int, ...] | None = None
    mem_fraction_static: float | None = None
    kv_len_buckets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        s = self.spec
        tp = self.tensor_parallel
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel={tp!r} must be an int >= 1")
        if s.num_kv_heads % tp:
            raise ValueError(f"tensor_parallel={tp} must divide num_kv_heads={s.num_kv_heads}")
        if not 1 <= self.max_prompt_len <= s.context_len:
            raise ValueError(
                f"max_prompt_len={self.max_prompt_len} must be in [1, context_len={s.context_len}]"
            )
        buckets = BatchBuckets(tuple(int(b) for b in self.batch_buckets))  # validates
        if buckets.max_bs > s.max_running_requests:
            raise ValueError(
                f"batch_buckets={buckets.sizes}: largest bucket must be <= "
                f"max_running_requests={s.max_running_requests}"
            )
        if not 1 <= self.prefill_batch <= s.max_running_requests:
            raise ValueError(
                f"prefill_batch={self.prefill_batch} must be in "
                f"[1, max_running_requests={s.max_running_requests}]"
            )
        if not isinstance(self.kernels, KernelPolicy):
            raise TypeError(f"kernels={self.kernels!r} must be a KernelPolicy")
        cps = self.chunked_prefill_size
        if not isinstance(cps, int) or isinstance(cps, bool) or cps < self.prefill_batch:
            raise ValueError(
                f"chunked_prefill_size={cps!r} must be an int >= prefill_batch={self.prefill_batch}"
            )
        if self.prefill_buckets is not None:
            pb = tuple(self.prefill_buckets)
            if (
                not pb
                or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in pb)
                or list(pb) != sorted(set(pb))
                or pb[-1] * self.prefill_batch > cps
            ):
                raise ValueError(
                    f"prefill_buckets={pb!r} must be ascending distinct ints >= 1 with "
                    f"prefill_batch * largest <= chunked_prefill_size={cps}"
                )
        msf = self.mem_fraction_static
        if msf is not None and not (isinstance(msf, float) and 0.0 < msf < 1.0):
            raise ValueError(f"mem_fraction_static={msf!r} must be a float in (0, 1)")
        if self.attention_backend is not None and not all(
            callable(getattr(self.attention_backend, m, None)) for m in ("write_kv", "attend")
        ):
            raise ValueError(
                f"attention_backend={self.attention_backend!r} must define write_kv and attend "
                "(jspec.engine.attention.AttentionBackend)"
            )
        kb = self.kv_len_buckets
        if (
            not isinstance(kb, tuple)
            or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in kb)
            or list(kb) != sorted(set(kb))
            or (kb and kb[-1] >= s.context_len)
        ):
            raise ValueError(
                f"kv_len_buckets={kb!r} must be a tuple of ascending distinct ints in "
                f"[1, context_len={s.context_len})"
            )
        if self.draft_attention not in DRAFT_ATTENTION:
            raise ValueError(
                f"draft_attention={self.draft_attention!r} must be one of {DRAFT_ATTENTION}"
            )

    @property
    def attention(self) -> Any:
        """The attention backend every forward writes and reads K/V through:
        ``attention_backend`` if given, else jspec's paged kernels at ``kernels.attention``
        (:class:`jspec.engine.attention.PagedAttentionBackend`)."""
        if self.attention_backend is not None:
            return self.attention_backend
        return PagedAttentionBackend(self.kernels.attention)

    def check_backend(self) -> None:
        """``ValueError`` naming the keyword when a kernel this config runs needs a GPU and
        jax's backend is not one (:meth:`jspec.kernels.policy.KernelPolicy.check_backend`;
        with an ``attention_backend``, ``kernels.attention`` is not run). What an ``Engine``
        checks before it compiles anything."""
        foreign = self.attention_backend is not None
        self.kernels.check_backend(skip=("attention",) if foreign else ())

    @property
    def max_chunk_len(self) -> int:
        """Longest prefill chunk per request: ``chunked_prefill_size // prefill_batch``, at
        most ``max_prompt_len`` (a longer prompt, e.g. a preempted request's, takes
        several)."""
        if self.prefill_buckets is not None:
            return self.prefill_buckets[-1]
        return max(1, min(self.chunked_prefill_size // self.prefill_batch, self.max_prompt_len))

    @property
    def prefill_chunk_buckets(self) -> tuple[int, ...]:
        """Chunk lengths compiled for prefill, ascending (``prefill_buckets`` or the largest
        chunk and its quarters down to :data:`MIN_PREFILL_BUCKET`)."""
        if self.prefill_buckets is not None:
            return tuple(self.prefill_buckets)
        top = self.max_chunk_len
        buckets = [top]
        while buckets[-1] // 4 >= MIN_PREFILL_BUCKET:
            buckets.append(buckets[-1] // 4)
        return tuple(sorted(buckets))

    def prefill_bucket_for(self, chunk_len: int) -> int:
        """The smallest prefill bucket holding ``chunk_len`` tokens (<= :attr:`max_chunk_len`)."""
        for b in self.prefill_chunk_buckets:
            if b >= chunk_len:
                return b
        raise ValueError(f"chunk_len={chunk_len} exceeds max_chunk_len={self.max_chunk_len}")

    @property
    def tp_axis(self) -> str | None:
        """The mesh axis the model sums its row-parallel products over (None: no TP)."""
        return TP_AXIS if self.tensor_parallel > 1 else None

    def bucket_for(self, num_running: int) -> int:
        """Smallest batch bucket holding ``num_running`` requests (``BatchBuckets``)."""
        return BatchBuckets(tuple(self.batch_buckets)).bucket_for(num_running)

    def kv_len_bucket_for(self, num_keys: int) -> int | None:
        """The launch hint of a dispatch whose requests read at most ``num_keys`` prefix keys:
        the smallest of :attr:`kv_len_buckets` holding it, None (the whole width) if none."""
        return next((b for b in self.kv_len_buckets if b >= num_keys), None)


def default_num_pages(spec_like: dict, max_running_requests: int) -> int:
    """Pages so that ``max_running_requests`` requests at full context never exhaust the pool."""
    probe = SpecConfig(**spec_like, max_running_requests=max_running_requests, num_pages=1)
    per_req = ceil_div(probe.context_len + probe.alloc_reserve_per_decode, probe.page_size) + 1
    return max_running_requests * per_req


def make_engine_config(
    target: Any,
    *,
    page_size: int = 16,
    topk: int = 4,
    num_steps: int = 3,
    num_draft_tokens: int = 8,
    context_len: int = 256,
    max_running_requests: int = 8,
    max_prompt_len: int = 64,
    num_pages: int | None = None,
    batch_buckets: tuple[int, ...] | None = None,
    prefill_batch: int = 1,
    draft_attention: str = "cascade",
    impl: str = "auto",
    tensor_parallel: int = 1,
    attention_impl: str = "auto",
    gemm_impl: str = "auto",
    rms_norm_impl: str = "auto",
    topk_probs_impl: str = "auto",
    attention_backend: Any = None,
    chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL_SIZE,
    prefill_buckets: tuple[int, ...] | None = None,
    mem_fraction_static: float | None = None,
    draft: Any = None,
    kv_len_buckets: tuple[int, ...] | None = None,
) -> EngineConfig:
    """An :class:`EngineConfig` whose target pool matches ``target``.

    ``target``: a :class:`jspec.engine.protocol.TargetModel` (or anything with its
    ``num_layers``, ``num_kv_heads``, ``head_dim`` and ``dtype``, e.g. a ``LlamaConfig``).

    The pool: ``num_pages`` if given; else with ``mem_fraction_static`` what device memory
    leaves once the weights are placed (:func:`jspec.engine.memory.num_pages_for_memory`; give
    ``draft`` so its pool is counted; call it after the params are on the device); else enough
    for ``max_running_requests`` requests at full context (:func:`default_num_pages`).

    The kernels: ``impl`` (bookkeeping ops), ``attention_impl``, ``gemm_impl``,
    ``rms_norm_impl`` and ``topk_probs_impl`` are ``"auto"`` or a concrete name, resolved once
    here into :attr:`EngineConfig.kernels` by
    :func:`jspec.kernels.policy.resolve_kernel_policy` from the backend, the widest hidden
    size and vocabulary of ``target`` and ``draft`` (``ValueError`` naming the keyword for an
    unknown name, or a kernel those widths do not fit). The models read their RMSNorm impl
    from their own ``rms_norm_impl`` field, which :class:`jspec.engine.runner.Runner` sets from
    ``kernels.rms_norm`` (:func:`jspec.kernels.policy.with_kernel_policy`).

    ``kv_len_buckets``: None gives the Triton attention (``kernels.attention`` ``"triton"`` or
    ``"cudnn"``, no ``attention_backend``) :data:`KV_LEN_BUCKET_MIN` keys and every
    :data:`KV_LEN_BUCKET_RATIO` x above it below ``context_len``, any other attention none.
    """
    spec_like = {
        "page_size": page_size,
        "topk": topk,
        "num_steps": num_steps,
        "num_draft_tokens": num_draft_tokens,
        "context_len": context_len,
        "num_layers": target.num_layers,
        "num_kv_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "dtype": target.dtype,
    }
    if num_pages is None and mem_fraction_static is not None:
        from jspec.engine.memory import num_pages_for_memory

        num_pages = num_pages_for_memory(
            target,
            draft,
            page_size=page_size,
            mem_fraction_static=mem_fraction_static,
            tensor_parallel=tensor_parallel,
        )
    elif num_pages is None:
        num_pages = default_num_pages(spec_like, max_running_requests)
    spec = SpecConfig(**spec_like, max_running_requests=max_running_requests, num_pages=num_pages)
    if batch_buckets is None:
        powers = {1 << i for i in range(max_running_requests.bit_length())}
        batch_buckets = tuple(
            sorted({b for b in powers if b < max_running_requests} | {max_running_requests})
        )
    kernels = resolve_kernel_policy(
        impl=impl,
        attention_impl=attention_impl,
        gemm_impl=gemm_impl,
        rms_norm_impl=rms_norm_impl,
        topk_probs_impl=topk_probs_impl,
        hidden_size=max(getattr(m, "hidden_size", 0) for m in (target, draft)),
        # topk_probs reads the draft's logits (the target's vocabulary bounds them).
        vocab_size=getattr(draft if draft is not None else target, "vocab_size", 0),
        dtype=target.dtype,
    )
    if kv_len_buckets is None:
        picked: list[int] = []
        if kernels.attention in ("triton", "cudnn") and attention_backend is None:
            b = KV_LEN_BUCKET_MIN
            while b < context_len:
                picked.append(b)
                b *= KV_LEN_BUCKET_RATIO
        kv_len_buckets = tuple(picked)
    return EngineConfig(
        spec=spec,
        max_prompt_len=max_prompt_len,
        batch_buckets=tuple(batch_buckets),
        prefill_batch=prefill_batch,
        draft_attention=draft_attention,
        kernels=kernels,
        tensor_parallel=tensor_parallel,
        attention_backend=attention_backend,
        chunked_prefill_size=chunked_prefill_size,
        prefill_buckets=None if prefill_buckets is None else tuple(prefill_buckets),
        mem_fraction_static=mem_fraction_static,
        kv_len_buckets=tuple(kv_len_buckets),
    )


@pytree_dataclass
class SpecCarry:
    """The speculative carry of every batch slot: what the next step starts its tree from
    (written by prefill's last chunk, by every spec / plain step; ``M`` batch slots)."""

    # i32[M]: last generated token (the next tree root; no KV yet)
    bonus_tokens: jax.Array
    # f32[M, K] / i32[M, K] (TARGET ids): the draft's proposal for the first tree level (from
    # the last draft extend / draft prefill)
    topk_p: jax.Array
    topk_index: jax.Array
    # dtype[M, Hd] (Hd = draft.hidden_size; [M, 0] without a draft): the draft hidden state
    # that produced them
    draft_hidden: jax.Array


@pytree_dataclass
class EngineState:
    """Device state of one shard: the KV backend's state and the speculative carry."""

    # the KV backend's state (jspec.engine.paged_kv.PagedKVState for jspec's): allocation,
    # lengths, liveness and the two pools
    kv: Any
    carry: SpecCarry


def draft_pool_spec(ecfg: EngineConfig, draft: DraftModel) -> SpecConfig:
    """The draft pool's config: the draft's geometry, the target pool's slots."""
    return dataclasses.replace(
        ecfg.spec,
        num_layers=draft.num_layers,
        num_kv_heads=draft.num_kv_heads,
        head_dim=draft.head_dim,
        dtype=draft.dtype,
    )


def init_spec_carry(ecfg: EngineConfig, draft: DraftModel | None = None) -> SpecCarry:
    """Zeros for every batch slot (``draft`` None: ``draft_hidden`` is ``[M, 0]``)."""
    s = ecfg.spec
    cap, k = s.max_running_requests, s.topk
    hidden = (0, s.dtype) if draft is None else (draft.hidden_size, draft.dtype)
    return SpecCarry(
        bonus_tokens=jnp.zeros((cap,), jnp.int32),
        topk_p=jnp.zeros((cap, k), jnp.float32),
        topk_index=jnp.zeros((cap, k), jnp.int32),
        draft_hidden=jnp.zeros((cap, hidden[0]), DTYPES[hidden[1]]),
    )


def gather_slots(x: jax.Array, slot_idx: jax.Array, live: jax.Array, fill=0) -> jax.Array:
    """Rows ``x[slot_idx]`` of a per-slot array; non-live entries get ``fill``.

    ``slot_idx: i32[Bb]`` may hold ``M`` (one past the end) for padding entries.
    """
    rows = x[jnp.minimum(slot_idx, x.shape[0] - 1)]
    mask = live.reshape(live.shape + (1,) * (rows.ndim - 1))
    return jnp.where(mask, rows, jnp.asarray(fill, x.dtype))


def scatter_slots(
    x: jax.Array, slot_idx: jax.Array, live: jax.Array, values: jax.Array
) -> jax.Array:
    """``x[slot_idx[i]] = values[i]`` for live ``i`` (padding entries are dropped)."""
    idx = jnp.where(live, slot_idx, x.shape[0])
    return x.at[idx].set(values.astype(x.dtype), mode="drop")


def pack_valid(values: jax.Array, valid: jax.Array) -> jax.Array:
    """Stable compaction of ``values[valid]`` to the front of an i32 buffer (0 tail)."""
    return compact(values, valid, dtype=jnp.int32)


def commit_carry(
    carry: SpecCarry,
    slot_idx: jax.Array,
    live: jax.Array,
    bonus: jax.Array,
    topk_p: jax.Array,
    topk_index: jax.Array,
    hidden: jax.Array,
) -> SpecCarry:
    """The live entries' next tree roots and first tree levels into their batch slots."""
    return SpecCarry(
        bonus_tokens=scatter_slots(carry.bonus_tokens, slot_idx, live, bonus),
        topk_p=scatter_slots(carry.topk_p, slot_idx, live, topk_p),
        topk_index=scatter_slots(carry.topk_index, slot_idx, live, topk_index),
        draft_hidden=scatter_slots(carry.draft_hidden, slot_idx, live, hidden),
    )
