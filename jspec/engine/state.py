"""Engine configuration and the device-resident engine state (one data-parallel shard).

The state holds everything a decode step reads and writes, as one pytree, so a step is a pure
jitted function ``state' = step(state, ...)`` with the state donated:

* the bookkeeping: paged allocator, req_to_token rows and their row allocator (``jspec.kv``);
* the target and draft KV pools (``jspec.kv.pool.KVPool``; they share slot ids, allocator and
  req_to_token, as in sglang where the draft worker reuses the target's pools' indexing);
* per **batch slot** (capacity ``max_running_requests``, host scheduler decides which slot a
  request occupies) the request's KV lengths, row and speculative carry.

Per-slot arrays (``M`` = max_running_requests)::

    committed_lens   i32[M]   sglang kv_committed_len = L (KV-ready prefix)
    allocated_lens   i32[M]   sglang kv_allocated_len (row positions backed by pages)
    req_pool_indices i32[M]   req_to_token row (0 = padding row, free batch slot)
    live             bool[M]
    bonus_tokens     i32[M]   last generated token (the next tree root; no KV yet)
    topk_p           f32[M, K], topk_index i32[M, K] (TARGET ids), draft_hidden dtype[M, Hd]
                              the draft's proposal for the first tree level (from the
                              last draft extend / draft prefill); Hd = draft.hidden_size

The configuration is model-agnostic: the target pool's geometry comes from the target model
(:func:`make_engine_config`), the draft pool's from the draft model (:func:`draft_pool_spec`);
the models themselves (``jspec.engine.protocol``) are passed beside the config.
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
from jspec.engine.protocol import DTYPES, check_models
from jspec.kernels.policy import KernelPolicy, resolve_kernel_policy
from jspec.kv.allocator import PagedAllocator, init_allocator
from jspec.kv.decode_alloc import ReqKVState
from jspec.kv.pool import KVPool, init_kv_pool
from jspec.kv.req_to_token import ReqRowAllocator, init_req_rows, init_req_to_token

DRAFT_ATTENTION = ("cascade", "kv_indices")
# chunked_prefill_size: prompt tokens per prefill call (sglang --chunked-prefill-size; its
# default on large GPUs). Prefill chunk lengths are compiled per bucket (prefill_buckets):
# by default the largest chunk and its quarters down to MIN_PREFILL_BUCKET.
DEFAULT_CHUNKED_PREFILL_SIZE = 8192
MIN_PREFILL_BUCKET = 64
DP_AXIS, TP_AXIS = "dp", "tp"  # mesh axes: data-parallel shards, tensor-parallel heads


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine configuration (hashable: a static jit argument).

    Attributes:
      spec: bookkeeping config (page_size, topk, num_steps, num_draft_tokens, context_len,
        max_running_requests, num_pages) whose pool geometry (num_layers, num_kv_heads,
        head_dim, dtype) is the target model's (:func:`check_engine_models`).
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
    :func:`jspec.kernels.policy.resolve_kernel_policy` from the backend, ``target.dtype``, the
    widest hidden size and vocabulary of ``target`` and ``draft`` (``ValueError`` naming the
    keyword for an unknown name). The models read their RMSNorm impl from their own
    ``rms_norm_impl`` field: set it from ``kernels.rms_norm``
    (:func:`jspec.models.with_kernel_policy`).
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
    return EngineConfig(
        spec=spec,
        max_prompt_len=max_prompt_len,
        batch_buckets=tuple(batch_buckets),
        prefill_batch=prefill_batch,
        draft_attention=draft_attention,
        kernels=resolve_kernel_policy(
            impl=impl,
            attention_impl=attention_impl,
            gemm_impl=gemm_impl,
            rms_norm_impl=rms_norm_impl,
            topk_probs_impl=topk_probs_impl,
            dtype=target.dtype,
            hidden_size=max(getattr(m, "hidden_size", 0) for m in (target, draft)),
            # topk_probs reads the draft's logits (the target's vocabulary bounds them).
            vocab_size=getattr(draft if draft is not None else target, "vocab_size", 0),
        ),
        tensor_parallel=tensor_parallel,
        attention_backend=attention_backend,
        chunked_prefill_size=chunked_prefill_size,
        prefill_buckets=None if prefill_buckets is None else tuple(prefill_buckets),
        mem_fraction_static=mem_fraction_static,
    )


@pytree_dataclass
class EngineState:
    """Device state of one shard (see the module docstring for the per-slot arrays)."""

    allocator: PagedAllocator
    req_rows: ReqRowAllocator
    req_to_token: jax.Array  # i32[M+1, R]
    target_pool: KVPool
    draft_pool: KVPool | None  # None in a plain greedy engine
    committed_lens: jax.Array  # i32[M]
    allocated_lens: jax.Array  # i32[M]
    req_pool_indices: jax.Array  # i32[M]
    live: jax.Array  # bool[M]
    bonus_tokens: jax.Array  # i32[M]
    topk_p: jax.Array  # f32[M, K]
    topk_index: jax.Array  # i32[M, K]
    draft_hidden: jax.Array  # dtype[M, Hd] (Hd = draft.hidden_size; [M, 0] without a draft)


def draft_pool_spec(ecfg: EngineConfig, draft: Any) -> SpecConfig:
    """The draft pool's config: the draft's geometry, the target pool's slots."""
    return dataclasses.replace(
        ecfg.spec,
        num_layers=draft.num_layers,
        num_kv_heads=draft.num_kv_heads,
        head_dim=draft.head_dim,
        dtype=draft.dtype,
    )


def check_engine_models(ecfg: EngineConfig, target: Any, draft: Any = None) -> None:
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


def init_engine_state(ecfg: EngineConfig, draft: Any = None) -> EngineState:
    """Empty state: every page and row free, every batch slot free.

    Args:
      draft: the draft model (its pool geometry and hidden size), or None for a plain greedy
        engine (no draft pool: ``draft_pool`` is None, ``draft_hidden`` is ``[M, 0]``).
    """
    s = ecfg.spec
    cap, k = s.max_running_requests, s.topk
    hidden = (0, s.dtype) if draft is None else (draft.hidden_size, draft.dtype)
    return EngineState(
        allocator=init_allocator(s.num_pages, s.page_size),
        req_rows=init_req_rows(s),
        req_to_token=init_req_to_token(s),
        target_pool=init_kv_pool(s),
        draft_pool=None if draft is None else init_kv_pool(draft_pool_spec(ecfg, draft)),
        committed_lens=jnp.zeros((cap,), jnp.int32),
        allocated_lens=jnp.zeros((cap,), jnp.int32),
        req_pool_indices=jnp.zeros((cap,), jnp.int32),
        live=jnp.zeros((cap,), bool),
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


def gather_req_kv_state(state: EngineState, slot_idx: jax.Array, live: jax.Array) -> ReqKVState:
    """The bucket's rows as a :class:`jspec.kv.decode_alloc.ReqKVState` (non-live rows: 0,
    invalid). ``slot_idx: i32[Bb]``, ``live: bool[Bb]`` as :func:`gather_slots`."""
    return ReqKVState(
        committed_lens=gather_slots(state.committed_lens, slot_idx, live),
        allocated_lens=gather_slots(state.allocated_lens, slot_idx, live),
        req_pool_indices=gather_slots(state.req_pool_indices, slot_idx, live),
        valid=live,
    )


def scatter_slots(
    x: jax.Array, slot_idx: jax.Array, live: jax.Array, values: jax.Array
) -> jax.Array:
    """``x[slot_idx[i]] = values[i]`` for live ``i`` (padding entries are dropped)."""
    idx = jnp.where(live, slot_idx, x.shape[0])
    return x.at[idx].set(values.astype(x.dtype), mode="drop")


def pack_valid(values: jax.Array, valid: jax.Array) -> jax.Array:
    """Stable compaction of ``values[valid]`` to the front of an i32 buffer (0 tail)."""
    return compact(values, valid, dtype=jnp.int32)
