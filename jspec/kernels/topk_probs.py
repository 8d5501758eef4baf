"""``topk_probs``: the draft's top-k proposal, ``top-k(softmax(logits))`` in one pass.

sglang: ``fast_topk(softmax(logits), K)``. jspec never writes the full-vocab softmax: the top-k of
the logits has the same order, and ``p = exp(top - logsumexp(row))``.

* ``impl="xla"``: :func:`topk_probs_reference` (``lax.top_k`` + ``logsumexp``; two passes over
  the logits, ~10 us per call on the H200 at R=512, V=512, K=8).
* ``impl="pallas"``: one program per block of ``block_rows`` rows. The program loads its
  ``[block_rows, V_pad]`` tile once (``V_pad = next_pow2(V)``, tail columns read as -inf),
  computes the row's log-sum-exp, then selects the K maxima by K rounds of
  "max, lowest index attaining it, mark taken" in registers::

      m = max(x); lse = m + log(sum(exp(x - m)))            # m = 0 if not finite (as jax.nn)
      for j in 0..K-1:
          cur = max(x)                                       # over the not-yet-taken entries
          idx = min(where(x == cur, col, V_pad))              # lowest index, as lax.top_k
          top[:, j] = cur; index[:, j] = idx                 # register tiles [block_rows, K_pad]
          x = where(col == idx, -inf, x); col = where(col == idx, V_pad, col)   # taken
      p = exp(top - lse)                                     # one masked store per output

  NOTE: taken entries are marked twice (value -inf *and* column ``V_pad``): a row whose
  remaining entries are all -inf would otherwise pick an already-taken -inf entry again.
  Tail columns (``>= V``) keep their true column, so they can only be picked after all V real
  columns, which never happens since ``K <= V``.

  No sort/top_k in the Triton lowering (shared/PLATFORM.md §3): only max/min reductions,
  compare, ``where`` and a 1-D iota broadcast are used. Logits wider than :data:`MAX_COLS`
  (one tile would not fit in registers) take the chunked Triton kernel on GPU (the reference
  in interpret mode).
* ``impl="triton"`` (GPU only): :mod:`jspec.kernels.topk_probs_triton`, a raw Triton kernel
  through ``jax_triton`` for any width: one program per (row, chunk of columns) and a merge of
  the chunks' top-K and log-sum-exp. It is what ``"pallas"`` runs for rows wider than
  :data:`MAX_COLS` (the EAGLE-3 hot vocabulary of 32000: XLA's ``lax.top_k`` there is a
  ``__gpu$TopK`` call of ~21 us even for one row, measured on the H200).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jspec import probes
from jspec._jit import jit
from jspec.config import next_power_of_2
from jspec.kernels import _common

IMPLS = ("xla", "pallas", "triton")
# Widest padded row the Pallas kernel takes in one tile; wider logits need impl="triton" (the
# chunked kernel) or "xla" (the kernel policy picks one of them for wide vocabularies).
MAX_COLS = 16384
# Default launch: one row per program, one warp per COLS_PER_WARP padded columns (16 f32 per
# lane). The selection is a chain of 2K+2 dependent row reductions, so latency dominates and a
# warp should reduce as few rows as possible; rows narrower than a warp are packed (V_pad < 32).
# NOTE: measured on sm_90 code from Triton 3.6 (ptxas, no GPU run) at V=512, K=8: block_rows=1,
# 1 warp: 72 registers, ~1240 SASS per thread, no bar.sync; block_rows=4, 4 warps: 126
# registers, ~2120 SASS and 54 bar.sync (Triton splits the columns across warps). No spills up
# to V=16384 (16 warps, 121 registers).
WARP_SIZE = 32
COLS_PER_WARP = 512
MAX_NUM_WARPS = 16
# Up to this many picks the selection loop is unrolled in Python; beyond it, a fori_loop.
MAX_UNROLL = 16


def _validate(
    logits: jax.Array,
    topk: int,
    block_rows: int | None,
    num_warps: int | None,
    block_cols: int | None,
) -> None:
    probes.static_check(
        logits.ndim == 2, f"logits.shape={tuple(logits.shape)} must be 2-D (f32[R, V])"
    )
    probes.static_check(
        jnp.issubdtype(logits.dtype, jnp.floating),
        f"logits.dtype={logits.dtype} must be floating (f32[R, V])",
    )
    vocab = logits.shape[1]
    probes.static_check(
        isinstance(topk, int) and 1 <= topk <= vocab,
        f"topk={topk!r} must be an int in [1, V={vocab}]",
    )
    _common.validate_tuning(block_rows=block_rows, num_warps=num_warps, block_cols=block_cols)


# ---- reference ------------------------------------------------------------------------------
def topk_probs_reference(logits: jax.Array, topk: int) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp oracle: ``lax.top_k`` of the f32 logits, ``p = exp(top - logsumexp(row))``.

    Args:
      logits: float[R, V] (cast to f32).
      topk: static K.

    Returns:
      ``(topk_p f32[R, K], topk_index i32[R, K])``; ties go to the lower index first.
    """
    logits = logits.astype(jnp.float32)
    top, index = jax.lax.top_k(logits, topk)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    return jnp.exp(top - lse), index.astype(jnp.int32)


# ---- Pallas kernel ---------------------------------------------------------------------------
def _topk_probs_kernel(
    logits_ref,  # float[R, V]
    topk_p_ref,  # f32[R, K] (out)
    topk_index_ref,  # i32[R, K] (out)
    *,
    num_rows: int,
    vocab: int,
    topk: int,
    block_rows: int,
    block_cols: int,
    block_k: int,
):
    from jax.experimental.pallas import triton as pltriton

    row0 = pl.program_id(0) * block_rows
    rows = row0 + jnp.arange(block_rows, dtype=jnp.int32)  # [BR]
    row_ok = rows < num_rows
    col = jnp.arange(block_cols, dtype=jnp.int32)[None, :]  # [1, V_pad]
    # Rows past R and columns past V read as -inf (never written back / never picked).
    x = pltriton.load(
        logits_ref.at[pl.ds(row0, block_rows), pl.ds(0, block_cols)],
        mask=row_ok[:, None] & (col < vocab),
        other=-jnp.inf,
    )
    x = x.astype(jnp.float32)  # [BR, V_pad]

    # Log-sum-exp as jax.nn.logsumexp: a non-finite max is replaced by 0 (all -inf -> -inf,
    # +inf -> +inf), so p matches the reference on such rows too.
    m = jnp.max(x, axis=1)  # [BR]
    m = jnp.where(jnp.abs(m) < jnp.inf, m, 0.0)
    lse = m + jnp.log(jnp.sum(jnp.exp(x - m[:, None]), axis=1))  # [BR]

    kcol = jnp.arange(block_k, dtype=jnp.int32)[None, :]  # [1, K_pad]
    cols = jnp.broadcast_to(col, x.shape)  # [BR, V_pad]; taken entries -> block_cols

    def pick(j, carry):
        xm, colm, top, index = carry
        cur = jnp.max(xm, axis=1)  # [BR]
        idx = jnp.min(jnp.where(xm == cur[:, None], colm, block_cols), axis=1)  # [BR]
        # NOTE: only a NaN row finds no match (idx = V_pad); clamp to keep indices in range.
        idx = jnp.minimum(idx, vocab - 1)
        top = jnp.where(kcol == j, cur[:, None], top)
        index = jnp.where(kcol == j, idx[:, None], index)
        taken = colm == idx[:, None]
        return (jnp.where(taken, -jnp.inf, xm), jnp.where(taken, block_cols, colm), top, index)

    carry = (
        x,
        cols,
        jnp.full((block_rows, block_k), -jnp.inf, jnp.float32),
        jnp.zeros((block_rows, block_k), jnp.int32),
    )
    if topk <= MAX_UNROLL:
        for j in range(topk):
            carry = pick(j, carry)
    else:
        carry = jax.lax.fori_loop(0, topk, pick, carry)
    _, _, top, index = carry
    probs = jnp.exp(top - lse[:, None])  # [BR, K_pad]

    out_mask = row_ok[:, None] & (kcol < topk)
    pltriton.store(topk_p_ref.at[pl.ds(row0, block_rows), pl.ds(0, block_k)], probs, mask=out_mask)
    pltriton.store(
        topk_index_ref.at[pl.ds(row0, block_rows), pl.ds(0, block_k)], index, mask=out_mask
    )


def _launch_shape(
    num_rows: int, vocab: int, block_rows: int | None, num_warps: int | None
) -> tuple[int, int]:
    """Static ``(block_rows, num_warps)``; see :data:`COLS_PER_WARP` for the defaults."""
    block_cols = next_power_of_2(vocab)
    if block_rows is None:
        block_rows = max(1, WARP_SIZE // block_cols)
        # No point in a block taller than the (padded) batch.
        block_rows = min(block_rows, next_power_of_2(num_rows))
    if num_warps is None:
        num_warps = min(MAX_NUM_WARPS, max(1, block_rows * block_cols // COLS_PER_WARP))
    return block_rows, num_warps


def _topk_probs_pallas(
    logits: jax.Array,
    topk: int,
    *,
    interpret: bool | None,
    block_rows: int | None,
    num_warps: int | None,
) -> tuple[jax.Array, jax.Array]:
    num_rows, vocab = logits.shape
    block_rows, num_warps = _launch_shape(num_rows, vocab, block_rows, num_warps)
    kernel = functools.partial(
        _topk_probs_kernel,
        num_rows=num_rows,
        vocab=vocab,
        topk=topk,
        block_rows=block_rows,
        block_cols=next_power_of_2(vocab),
        block_k=next_power_of_2(topk),
    )
    return _common.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_rows, topk), jnp.float32),
            jax.ShapeDtypeStruct((num_rows, topk), jnp.int32),
        ),
        grid=(pl.cdiv(num_rows, block_rows),),
        interpret=interpret,
        num_warps=num_warps,
        name="jspec_topk_probs",
    )(logits)


# ---- public wrapper --------------------------------------------------------------------------
@jit(
    static_argnames=("topk", "impl", "interpret", "block_rows", "num_warps", "block_cols"),
)
def topk_probs(
    logits: jax.Array,
    topk: int,
    *,
    impl: str = "xla",
    interpret: bool | None = None,
    block_rows: int | None = None,
    num_warps: int | None = None,
    block_cols: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Top-k of each logits row with its softmax probability.

    Args:
      logits: f32[R, V] (any float dtype; computed in f32). Entries may be -inf (masked
        tokens): they rank last (ties by index) and get p = 0; a row that is all -inf gets
        p = NaN (``exp(-inf - -inf)``), like the reference. +inf entries get p = NaN and the
        rest of their row p = 0 (``jax.nn.logsumexp`` semantics).
      topk: static K, ``1 <= K <= V``.
      impl: ``"xla"`` (:func:`topk_probs_reference`), ``"pallas"`` (rows of at most
        :data:`MAX_COLS` columns after padding V to a power of 2; ``ValueError`` for wider
        ones) or ``"triton"`` (GPU only; any width, in column chunks).
      interpret: Pallas interpret mode; ``None`` means interpret off the GPU.
      block_rows: static rows per Pallas program (power of 2); default 1 (rows narrower than
        32 columns are packed).
      num_warps: static Triton warps per program (power of 2); default one per 512 padded
        columns of the block, at most 16 (``"triton"``: per program of one chunk).
      block_cols: static columns per program of the ``"triton"`` kernel (power of 2);
        default: :func:`jspec.kernels.topk_probs_triton.launch_plan`'s.

    Returns:
      ``(topk_p f32[R, K], topk_index i32[R, K])``, per row in descending logit order, ties
      to the lower index first (as ``lax.top_k``).

    NaN: no check inside the kernel (shared/PLATFORM.md §6; check with a probe outside if
    needed). A row containing NaN gets p = NaN in all K columns with every impl. Its indices
    differ between impls: ``"xla"`` ranks NaN above +inf (``lax.top_k``); ``"pallas"`` gives
    indices in ``[0, V)`` but otherwise unspecified (the GPU's float max ignores NaN, interpret
    mode's propagates it).
    """
    _validate(logits, topk, block_rows, num_warps, block_cols)
    impl = _common.resolve_impl(impl, IMPLS, "topk_probs")
    num_rows, vocab = logits.shape
    probes.static_check(
        impl != "pallas" or next_power_of_2(vocab) <= MAX_COLS,
        f"impl='pallas' takes rows of at most MAX_COLS={MAX_COLS} columns (V padded to a power "
        f"of 2); logits.shape={tuple(logits.shape)}: use impl='triton' (GPU) or 'xla'",
    )
    if impl == "xla" or num_rows == 0:
        return topk_probs_reference(logits, topk)
    if impl == "triton":
        from jspec.kernels.topk_probs_triton import topk_probs_triton

        return topk_probs_triton(logits, topk, block_cols=block_cols, num_warps=num_warps)
    return _topk_probs_pallas(
        logits, topk, interpret=interpret, block_rows=block_rows, num_warps=num_warps
    )
