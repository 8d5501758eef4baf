"""Static configuration and sizing: ``TreeGeometry``, ``SpecConfig`` (SPEC.md §3, §4, §6.2, §10).

Frozen, hashable dataclasses, so they can be static ``jax.jit`` arguments. Every field is
validated once, in ``__post_init__``; a bad value raises ``ValueError`` naming the field.
:class:`TreeGeometry` is the draft tree's shape (``topk``, ``num_steps``, ``num_draft_tokens``,
``page_size``) that the tree / attention_meta / kernel ops take as ``geometry=``; they trust it
and do not check its values again. ``SpecConfig.geometry`` is built from SpecConfig's fields.

Sizing (``P`` = page_size, ``K`` = topk, ``S`` = num_steps, ``N`` = num_draft_tokens)::

    alloc_len_per_decode      P == 1 or K == 1 : max(S*K, N)
                              else             : max(ceil((P-1+S)/P) * P * K, N)
    alloc_reserve_per_decode  2 * alloc_len_per_decode          (overlap double buffer)
    req_to_token_extra_len    max(4 + N, alloc_reserve_per_decode + P - 1)
    req_to_token_width        context_len + req_to_token_extra_len
    kv_indices_width(bs)      bs * K * context_len              (< 2**31, PR #27338)

NOTE: deliberate deviation. sglang widens the req_to_token row to ``max(4+N, 2*alloc_len)``
only when P > 1 and K > 1 (PR #26972), and its row-width assert is active only there. jspec's
row-width check in ``prepare_for_decode`` is always on, so the row is always wide enough for the
page-rounded decode reserve: ``nxt = ceil_P(committed + reserve) <= context_len + reserve + P-1``
(SPEC.md §14: P=4, S=3, K=2, N=4 gives ``ctx + 35``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jspec._layout import holey_geometry

__all__ = [
    "INT32_LIMIT",
    "MAX_NUM_DRAFT_TOKENS",
    "MAX_NUM_STEPS",
    "BatchBuckets",
    "SpecConfig",
    "TreeGeometry",
    "ceil_div",
    "check_geometry",
    "ceil_to_multiple",
    "next_power_of_2",
]

_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
INT32_LIMIT = 2**31
# sglang's build-tree kernel precondition (SPEC.md §7.4).
MAX_NUM_DRAFT_TOKENS = 1024
# Draft depth bound: twice the deepest tree of sglang's published EAGLE recipes (8 steps). The
# engine's draft loop is unrolled at trace time, so compile time grows with the depth (CPU: 8 /
# 32 / 128 steps compiled in 27 / 74 / 345 s) and --steps 100000 would never finish tracing.
MAX_NUM_STEPS = 16


def _is_power_of_2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


# an int, or an integer array (element-wise)
_IntOrArray = TypeVar("_IntOrArray", int, jax.Array)


def ceil_div(a: _IntOrArray, b: int) -> _IntOrArray:
    return -(-a // b)


def ceil_to_multiple(a: int, b: int) -> int:
    return ceil_div(a, b) * b


def next_power_of_2(x: int) -> int:
    """The smallest power of 2 >= ``x`` (1 for ``x <= 1``): kernel blocks and padded buckets."""
    x = int(x)
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _need_int(value: Any, name: str) -> None:
    _need(
        isinstance(value, (int, np.integer)) and not isinstance(value, bool) and bool(value >= 1),
        f"{name}={value!r} must be an int >= 1",
    )


@dataclasses.dataclass(frozen=True, slots=True)
class TreeGeometry:
    """The static shape of one EAGLE draft tree over a paged KV layout.

    Validated once here; ops taking ``geometry=`` only check that it is a ``TreeGeometry``.

    Attributes:
      topk: ``K``, branches per draft step (``speculative_eagle_topk``).
      num_steps: ``S``, draft depth (``speculative_num_steps``), at most :data:`MAX_NUM_STEPS`.
      num_draft_tokens: ``N``, verify-tree nodes including the root
        (``speculative_num_draft_tokens``): ``N - 1 <= K + (S-1)*K^2`` and
        ``N <= MAX_NUM_DRAFT_TOKENS``.
      page_size: ``P``, tokens per KV page (power of 2).
    """

    topk: int
    num_steps: int
    num_draft_tokens: int
    page_size: int

    def __post_init__(self) -> None:
        for name in ("topk", "num_steps", "num_draft_tokens", "page_size"):
            _need_int(getattr(self, name), name)
        # Plain ints: np.int64 fields would hash and compare alike but print differently.
        for name in ("topk", "num_steps", "num_draft_tokens", "page_size"):
            object.__setattr__(self, name, int(getattr(self, name)))
        _need(_is_power_of_2(self.page_size), f"page_size={self.page_size} must be a power of 2")
        _need(
            self.num_draft_tokens - 1 <= self.num_candidates,
            f"num_draft_tokens={self.num_draft_tokens}: num_draft_tokens - 1 must be <= "
            f"topk + (num_steps-1)*topk^2 = {self.num_candidates} (topk={self.topk}, "
            f"num_steps={self.num_steps})",
        )
        _need(
            self.num_draft_tokens <= MAX_NUM_DRAFT_TOKENS,
            f"num_draft_tokens={self.num_draft_tokens} must be <= {MAX_NUM_DRAFT_TOKENS}",
        )
        _need(
            self.num_steps <= MAX_NUM_STEPS,
            f"num_steps={self.num_steps} must be <= MAX_NUM_STEPS={MAX_NUM_STEPS} (the draft "
            "loop is unrolled at trace time)",
        )

    @property
    def num_candidates(self) -> int:
        """Width of the flat draft score/token arrays: ``K + (S-1)*K*K`` (sglang ``ss``)."""
        return self.topk + (self.num_steps - 1) * self.topk * self.topk

    @property
    def is_holey(self) -> bool:
        """True when the draft layout has per-branch page regions (P > 1 and K > 1)."""
        return self.page_size > 1 and self.topk > 1

    @property
    def max_region_len(self) -> int:
        """Row positions of the widest branch region (prefix tail ``lp = P - 1``): the holey
        ``ceil((P-1+S)/P) * P``; ``S`` when the layout is contiguous (P == 1 or K == 1)."""
        if not self.is_holey:
            return self.num_steps
        _, _, region = holey_geometry(
            self.page_size - 1, num_steps=self.num_steps, page_size=self.page_size
        )
        return region

    @property
    def draft_alloc_len(self) -> int:
        """Worst-case draft footprint ``K * max_region_len`` (token slots per request)."""
        return self.topk * self.max_region_len

    @property
    def alloc_len_per_decode(self) -> int:
        """sglang ``get_alloc_len_per_decode``: ``max(draft_alloc_len, N)`` (SPEC.md §3)."""
        return max(self.draft_alloc_len, self.num_draft_tokens)

    def max_prefix_tail_pairs(self, batch_size: int) -> int:
        """Static worst-case hole-copy pair count ``B * (K-1) * (P-1)`` (every ``lp = P-1``)."""
        return batch_size * (self.topk - 1) * (self.page_size - 1)

    def with_num_draft_tokens(self, num_draft_tokens: int) -> TreeGeometry:
        """The same tree with ``N`` nodes (adaptive speculation), validated."""
        return dataclasses.replace(self, num_draft_tokens=num_draft_tokens)


def check_geometry(geometry: Any, where: str) -> TreeGeometry:
    """``geometry`` itself, or ``TypeError`` naming it if it is not a :class:`TreeGeometry`."""
    if not isinstance(geometry, TreeGeometry):
        raise TypeError(f"{where}: geometry={geometry!r} must be a jspec.config.TreeGeometry")
    return geometry


@dataclasses.dataclass(frozen=True, slots=True)
class SpecConfig:
    """Static speculative-decoding and KV-pool configuration.

    Attributes:
      page_size: tokens per KV page (power of 2). Page 0 is reserved for padding.
      topk: branches per draft step (``speculative_eagle_topk``).
      num_steps: draft depth (``speculative_num_steps``), at most :data:`MAX_NUM_STEPS`.
      num_draft_tokens: verify-tree nodes including the root (``speculative_num_draft_tokens``).
      context_len: model context length (tokens per request).
      max_running_requests: req_to_token rows in use; row 0 is an extra padding row.
      num_pages: allocatable pages (page ids 1..num_pages); pool size = num_pages * page_size.
      num_layers, num_kv_heads, head_dim, dtype: KV pool geometry (dtype by name).
      max_num_draft_tokens: adaptive-spec upper bound (``ndt_max``); 0 means num_draft_tokens.
      spec_enabled: False models "no spec algorithm" (alloc_len_per_decode == 1).
      geometry: the :class:`TreeGeometry` of (topk, num_steps, num_draft_tokens, page_size),
        built once (not an init argument); the tree / attention_meta ops take it.
    """

    page_size: int = 16
    topk: int = 4
    num_steps: int = 3
    num_draft_tokens: int = 8
    context_len: int = 1024
    max_running_requests: int = 8
    num_pages: int = 1024
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "bfloat16"
    max_num_draft_tokens: int = 0
    spec_enabled: bool = True
    # The tree geometry of (topk, num_steps, num_draft_tokens, page_size), built and validated
    # once in __post_init__ (not an init argument; not part of eq/hash: derived).
    geometry: TreeGeometry = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        need = _need
        object.__setattr__(
            self,
            "geometry",
            TreeGeometry(
                topk=self.topk,
                num_steps=self.num_steps,
                num_draft_tokens=self.num_draft_tokens,
                page_size=self.page_size,
            ),
        )
        for name in (
            "context_len",
            "max_running_requests",
            "num_pages",
            "num_kv_heads",
            "head_dim",
        ):
            _need_int(getattr(self, name), name)
        need(
            isinstance(self.num_layers, int) and self.num_layers >= 0,
            f"num_layers={self.num_layers!r} must be an int >= 0",
        )
        need(self.dtype in _DTYPES, f"dtype={self.dtype!r} must be one of {sorted(_DTYPES)}")
        need(
            self.max_num_draft_tokens >= 0,
            f"max_num_draft_tokens={self.max_num_draft_tokens} must be >= 0",
        )
        need(
            self.ndt_max <= MAX_NUM_DRAFT_TOKENS,
            f"num_draft_tokens={self.ndt_max} must be <= {MAX_NUM_DRAFT_TOKENS}",
        )
        need(
            self.pool_size + self.page_size < INT32_LIMIT,
            f"num_pages={self.num_pages}: pool slots {self.num_slots} must be < 2**31",
        )
        need(
            self.kv_indices_width(self.max_running_requests) < INT32_LIMIT,
            f"max_running_requests={self.max_running_requests}: kv_indices_width = "
            f"{self.kv_indices_width(self.max_running_requests)} must be < 2**31 "
            f"(topk={self.topk}, context_len={self.context_len})",
        )

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def kv_dtype(self) -> Any:
        return _DTYPES[self.dtype]

    @property
    def ndt_max(self) -> int:
        return max(self.num_draft_tokens, self.max_num_draft_tokens)

    @property
    def pool_size(self) -> int:
        """Allocatable token slots (``size`` in sglang), excluding the padding page 0."""
        return self.num_pages * self.page_size

    @property
    def num_slots(self) -> int:
        """KV buffer rows: ``size + page_size`` (slots 0..P-1 are the padding page)."""
        return self.pool_size + self.page_size

    @property
    def num_req_rows(self) -> int:
        """req_to_token rows: ``max_running_requests + 1`` (row 0 is padding)."""
        return self.max_running_requests + 1

    @property
    def is_holey(self) -> bool:
        """True when the draft layout has per-branch page regions (P > 1 and K > 1)."""
        return self.geometry.is_holey

    @property
    def alloc_len_per_decode(self) -> int:
        """sglang ``get_alloc_len_per_decode`` (EAGLE branches; SPEC.md §3), over ``ndt_max``."""
        if not self.spec_enabled:
            return 1
        return max(self.geometry.draft_alloc_len, self.ndt_max)

    @property
    def alloc_reserve_per_decode(self) -> int:
        """sglang ``get_alloc_reserve_per_decode`` = 2 * alloc_len_per_decode."""
        return 2 * self.alloc_len_per_decode

    @property
    def req_to_token_extra_len(self) -> int:
        """Row headroom past context_len (see the module docstring for the deviation)."""
        return max(4 + self.ndt_max, self.alloc_reserve_per_decode + self.page_size - 1)

    @property
    def req_to_token_width(self) -> int:
        """Width ``R`` of a req_to_token row (token positions)."""
        return self.context_len + self.req_to_token_extra_len

    def kv_indices_width(self, max_bs: int) -> int:
        """FlashInfer draft kv_indices row width ``num_seqs * topk * context_len`` (#27338)."""
        return max_bs * self.topk * self.context_len


@dataclasses.dataclass(frozen=True)
class BatchBuckets:
    """Sorted, distinct batch buckets (sglang ``capture_bs``), each ``>= 1``.

    One jit compile per bucket: a raw batch runs padded to :meth:`bucket_for` its size.
    """

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        sizes = tuple(self.sizes)
        if not sizes:
            raise ValueError("sizes=() must hold at least one bucket")
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
            raise ValueError(f"sizes={sizes} must be ints >= 1")
        if list(sizes) != sorted(set(sizes)):
            raise ValueError(f"sizes={sizes} must be sorted ascending without duplicates")
        object.__setattr__(self, "sizes", sizes)

    @property
    def max_bs(self) -> int:
        return self.sizes[-1]

    def bucket_for(self, raw_bs: int) -> int:
        """The smallest bucket ``>= raw_bs``; ``ValueError`` if ``raw_bs`` exceeds them all."""
        if raw_bs < 0:
            raise ValueError(f"raw_bs={raw_bs} must be >= 0")
        for size in self.sizes:
            if size >= raw_bs:
                return size
        raise ValueError(
            f"raw_bs={raw_bs} exceeds the largest bucket {self.max_bs} (sizes={self.sizes})"
        )
