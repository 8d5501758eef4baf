"""One kernel policy: the concrete implementation of every op family, resolved once.

Every op takes a concrete ``impl=`` name and raises ``ValueError`` naming ``impl`` for one it
does not have; no op guesses. ``"auto"`` exists only as an input of
:func:`resolve_kernel_policy` (``make_engine_config``, the CLI), which picks per family from the
backend (``jax.default_backend()``) and the models' widths::

    family (keyword)              choices                "auto" on GPU          "auto" elsewhere
    bookkeeping (impl)            xla | pallas           pallas                 xla
    attention (attention_impl)    xla | triton | cudnn   cudnn for bf16 / f16   xla
                                                         models (a jax with the
                                                         cuDNN call), triton else
    gemm (gemm_impl)              xla | cublas           cublas for calls of    xla (no effect)
                                                         >= 64 target tokens
    rms_norm (rms_norm_impl)      xla | triton           xla                    xla (f32 exact)
    topk_probs (topk_probs_impl)  xla | pallas | triton  bookkeeping's; triton  bookkeeping's;
                                                         past one Pallas tile   xla past a tile

``bookkeeping`` covers the tree / attention_meta / kv ops (``jspec.tree``,
``jspec.attention_meta``, ``jspec.kv``; ``move_kv_cache`` included); ``attention`` the
paged attention passes and the layers' K/V writes (``set_kv_buffer``); ``gemm`` is how XLA
compiles the model's matmuls (``"cublas"``: XLA's Triton GEMM emitter off); ``rms_norm`` the
models' RMSNorm (each model's ``rms_norm_impl`` field); ``topk_probs`` the draft's top-k
proposal (Pallas takes rows of at most ``MAX_COLS`` padded columns).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jspec.config import next_power_of_2
from jspec.kernels import paged_prefill_cudnn as _cudnn
from jspec.kernels import rms_norm as _rms_norm
from jspec.kernels import topk_probs as _topk_probs

__all__ = [
    "CHOICES",
    "CUBLAS_MIN_TOKENS",
    "GPU_ONLY",
    "KEYWORDS",
    "KernelPolicy",
    "resolve_kernel_policy",
]

# The concrete implementations per family (an op family's kernels each support these).
CHOICES: dict[str, tuple[str, ...]] = {
    "bookkeeping": ("xla", "pallas"),
    "attention": ("xla", "triton", "cudnn"),
    "gemm": ("xla", "cublas"),
    "rms_norm": ("xla", "triton"),
    "topk_probs": ("xla", "pallas", "triton"),
}
# The choices that run only on a GPU backend (jax-triton's launches, cuDNN): off the GPU their ops
# raise when traced, so KernelPolicy.check_backend refuses them where an engine is built.
GPU_ONLY = ("triton", "cudnn")
# Each family's keyword in resolve_kernel_policy / make_engine_config (what errors name).
KEYWORDS: dict[str, str] = {
    "bookkeeping": "impl",
    "attention": "attention_impl",
    "gemm": "gemm_impl",
    "rms_norm": "rms_norm_impl",
    "topk_probs": "topk_probs_impl",
}
# gemm "auto" turns XLA's Triton GEMM emitter off (cuBLAS) on GPU for calls whose target forward
# holds >= CUBLAS_MIN_TOKENS tokens. Measured on the H200 (bench/skinny_matmul.py --layers,
# bench/RESULTS.md, 2026-11-24, 8B layers, bf16): at 64 rows cuBLAS streams the fused layer in
# 127 us vs 143 (XLA's autotuned Triton GEMMs), at 1 and 8 rows it is slower (124 vs 121, 129
# vs 120 us); whole steps (bench/real_size.py): greedy bs64 5.86 -> 5.50 ms, spec bs16 (128
# verify tokens) 7.11 -> 6.97, greedy bs1 4.40 -> 4.67.
CUBLAS_MIN_TOKENS = 64
# rms_norm "auto" is XLA's fusion on every backend. The one-launch Triton residual add + RMSNorm
# (rms_norm_impl="triton") does not pay in the engine: through the typed FFI launch, on the H200
# (bench/launch_gaps.py --rms-norm-impl, 8B, bs 1 / 16 / 64, 2026-11-28, bench/RESULTS.md,
# nineteenth session) its rounds' busy time is -1.3% to +1.1% of XLA's and their wall level
# (greedy 4.44 / 4.65 / 5.37 ms vs 4.46 / 4.67 / 5.32, spec 5.56 / 7.12 / 17.2 vs 5.65 / 7.14 /
# 17.2). (Through the legacy custom call, before the typed FFI launch, it cost up to 0.5 ms of
# wall a round: ninth session.)


@dataclasses.dataclass(frozen=True, slots=True)
class KernelPolicy:
    """The concrete kernel of every op family (hashable: part of a static jit argument).

    The defaults are the pure-jnp references everywhere (exact on CPU). Build one for a model
    with :func:`resolve_kernel_policy`.

    Attributes:
      bookkeeping: ``impl`` of the tree / attention_meta / kv ops: ``"xla"`` | ``"pallas"``.
      attention: the paged attention of every model forward: ``"xla"`` | ``"triton"`` |
        ``"cudnn"`` (the Triton passes, but causal prefill chunks through cuDNN's flash
        attention: :mod:`jspec.kernels.paged_prefill_cudnn`; bf16 / f16 pools).
      gemm: how XLA compiles the model matmuls on GPU: ``"xla"`` | ``"cublas"``.
      cublas_min_tokens: with ``gemm="cublas"``, the calls it applies to: those whose target
        forward holds at least this many tokens (0: all).
      rms_norm: the models' RMSNorm: ``"xla"`` | ``"triton"``.
      topk_probs: the draft's top-k proposal: ``"xla"`` | ``"pallas"`` | ``"triton"``.
    """

    bookkeeping: str = "xla"
    attention: str = "xla"
    gemm: str = "xla"
    cublas_min_tokens: int = 0
    rms_norm: str = "xla"
    topk_probs: str = "xla"

    def __post_init__(self) -> None:
        for family, choices in CHOICES.items():
            value = getattr(self, family)
            if value not in choices:
                raise ValueError(f"{family}={value!r} must be one of {choices}")
        n = self.cublas_min_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"cublas_min_tokens={n!r} must be an int >= 0")

    def check_backend(self, backend: str | None = None, *, skip: tuple[str, ...] = ()) -> None:
        """``ValueError`` naming the keyword of the first family whose kernel needs a GPU
        (:data:`GPU_ONLY`) when ``backend`` (default ``jax.default_backend()``) is not one: what
        an engine checks before it compiles anything (its ops would raise only when traced).
        ``skip``: families the caller does not run. A policy itself may name GPU kernels
        anywhere (built for a GPU, inspected on CPU)."""
        backend = jax.default_backend() if backend is None else backend
        if backend == "gpu":
            return
        for family, keyword in KEYWORDS.items():
            value = getattr(self, family)
            if value in GPU_ONLY and family not in skip:
                anywhere = tuple(c for c in CHOICES[family] if c not in GPU_ONLY)
                raise ValueError(
                    f"{keyword}={value!r} needs a GPU; jax's backend here is {backend!r}: "
                    f"choose 'auto' or one of {anywhere}"
                )

    def gemm_compiler_options(self, num_tokens: int) -> tuple[tuple[str, bool], ...]:
        """XLA compile options (``(name, value)`` pairs, hashable) for a jitted call whose target
        forward holds ``num_tokens`` tokens; ``()`` = XLA's defaults (always off the GPU)."""
        if jax.default_backend() != "gpu":
            return ()
        if self.gemm == "cublas" and num_tokens >= self.cublas_min_tokens:
            return (("xla_gpu_enable_triton_gemm", False),)
        return ()

    def reads_prefix_bound(self, chunk_queries: int) -> bool:
        """Whether causal chunks of ``chunk_queries`` queries a row read a prefix bound
        (``AttentionMetadata.max_prefix_len``): cuDNN's prefill, which takes chunks of at least
        ``CUDNN_MIN_QUERIES``, gathers the prefix only that wide (and skips it for first
        chunks); the other kernels read by length, so a bound would only compile the same
        program twice."""
        return self.attention == "cudnn" and chunk_queries >= _cudnn.CUDNN_MIN_QUERIES


def _pick(family: str, choice: str, auto: str) -> str:
    """``choice`` checked (``ValueError`` naming the family's keyword, :data:`KEYWORDS`), or
    ``auto`` for ``"auto"``."""
    if choice == "auto":
        return auto
    if choice not in CHOICES[family]:
        choices = ("auto",) + CHOICES[family]
        raise ValueError(f"{KEYWORDS[family]}={choice!r} must be one of {choices}")
    return choice


def resolve_kernel_policy(
    *,
    impl: str = "auto",
    attention_impl: str = "auto",
    gemm_impl: str = "auto",
    rms_norm_impl: str = "auto",
    topk_probs_impl: str = "auto",
    hidden_size: int = 0,
    vocab_size: int = 0,
    dtype: Any = None,
    backend: str | None = None,
) -> KernelPolicy:
    """The :class:`KernelPolicy` of one engine: each family's ``"auto"`` resolved (the table in
    the module docstring), explicit choices checked.

    Args:
      impl: bookkeeping (``"auto"`` | ``"xla"`` | ``"pallas"``).
      attention_impl, gemm_impl, rms_norm_impl, topk_probs_impl: ``"auto"`` or one of the
        family's :data:`CHOICES`. A GPU-only kernel (:data:`GPU_ONLY`) may be named on any
        backend (a policy built for a GPU); an ``Engine`` refuses it off the GPU when it is
        built (:meth:`KernelPolicy.check_backend`), the op itself when it is traced.
      hidden_size: the widest RMSNorm row (target and draft): ``rms_norm_impl="triton"``
        takes rows of at most :data:`jspec.kernels.rms_norm.MAX_HIDDEN` columns.
      vocab_size: the widest row ``topk_probs`` sees (the draft's vocabulary); Pallas takes
        rows up to :data:`jspec.kernels.topk_probs.MAX_COLS` (padded to a power of 2).
      dtype: the models' KV dtype: attention "auto" on GPU is ``"cudnn"`` for bf16 / f16
        (cuDNN takes no f32) where this jax has the cuDNN function the kernel calls
        (:func:`jspec.kernels.paged_prefill_cudnn.unavailable`), ``"triton"`` otherwise (None:
        ``"triton"``).
      backend: default ``jax.default_backend()``.

    Raises:
      ValueError: an unknown choice (naming its keyword), ``attention_impl="cudnn"`` for an f32
        ``dtype`` or on a jax without the cuDNN function, ``topk_probs_impl="pallas"`` for
        rows wider than Pallas takes, or ``rms_norm_impl="triton"`` for rows wider than the
        kernel takes.
    """
    backend = jax.default_backend() if backend is None else backend
    gpu = backend == "gpu"
    books = _pick("bookkeeping", impl, "pallas" if gpu else "xla")
    half = dtype is not None and _cudnn.takes_dtype(dtype)
    no_cudnn = _cudnn.unavailable()  # why this jax cannot run the cuDNN kernel (None: it can)
    attn_auto = ("cudnn" if half and no_cudnn is None else "triton") if gpu else "xla"
    attn = _pick("attention", attention_impl, attn_auto)
    if attn == "cudnn" and dtype is not None and not half:
        raise ValueError(
            f"attention_impl='cudnn' takes bf16 / f16 models; dtype={jnp.dtype(dtype).name}: "
            "choose 'triton'"
        )
    if attn == "cudnn" and no_cudnn is not None:
        raise ValueError(f"attention_impl='cudnn': {no_cudnn}: choose 'triton'")
    gemm = _pick("gemm", gemm_impl, "cublas" if gpu else "xla")
    min_tokens = CUBLAS_MIN_TOKENS if gemm_impl == "auto" and gemm == "cublas" else 0
    norm = _pick("rms_norm", rms_norm_impl, "xla")
    if norm == "triton" and hidden_size > _rms_norm.MAX_HIDDEN:
        raise ValueError(
            f"rms_norm_impl='triton' takes rows of at most {_rms_norm.MAX_HIDDEN} columns; "
            f"hidden_size={hidden_size}: choose 'xla'"
        )
    wide = next_power_of_2(vocab_size) > _topk_probs.MAX_COLS
    topk_auto = books
    if books == "pallas" and wide:
        topk_auto = "triton" if gpu else "xla"  # Pallas takes one tile of <= MAX_COLS columns
    topk = _pick("topk_probs", topk_probs_impl, topk_auto)
    if topk == "pallas" and wide:
        raise ValueError(
            f"topk_probs_impl='pallas' takes rows of at most {_topk_probs.MAX_COLS} columns "
            f"(padded to a power of 2); vocab_size={vocab_size}: choose 'triton' (GPU) or 'xla'"
        )
    return KernelPolicy(
        bookkeeping=books,
        attention=attn,
        gemm=gemm,
        cublas_min_tokens=min_tokens,
        rms_norm=norm,
        topk_probs=topk,
    )


def _has_field(model: Any, name: str) -> bool:
    # NOTE: a helper keeps ``model`` Any at the caller (is_dataclass narrows it to a protocol).
    return dataclasses.is_dataclass(model) and any(
        f.name == name for f in dataclasses.fields(model)
    )


def with_kernel_policy(model: Any, kernels: KernelPolicy) -> Any:
    """``model`` with its ``rms_norm_impl`` set to ``kernels.rms_norm``: jspec's models
    (``LlamaTarget``, ``Eagle3Draft``, ``Eagle1Draft``) read their RMSNorm kernel from that
    field. ``None``, models without the field and models already set are returned as they are.
    ``jspec.engine.runner.Runner`` applies it to its models; ``jspec.models`` re-exports it."""
    if not _has_field(model, "rms_norm_impl"):
        return model
    if model.rms_norm_impl == kernels.rms_norm:
        return model
    return dataclasses.replace(model, rms_norm_impl=kernels.rms_norm)
