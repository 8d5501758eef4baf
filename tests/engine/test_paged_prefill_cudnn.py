"""Causal prefill chunks through cuDNN (``paged_attention(impl="cudnn")``,
``jspec.kernels.paged_prefill_cudnn``).

On CPU the module's own work (the gathers from pages, the split into a diagonal and a prefix
call, the log-sum-exp merge, padding rows) runs around a stand-in for cuDNN: a dense jnp
attention with cuDNN's contract (top-left causal mask, query / key lengths, output in the input
dtype, f32 statistics ``[B, H, T]``), against paged_attention_cases' f64 loop oracle. On the GPU
(``JSPEC_TEST_GPU=1``) cuDNN itself, against the pure-jnp reference (``impl="xla"``, f32
HIGHEST) compiled on the same GPU. Every pool position a pass does not read is NaN, so a gather
that reads one position too many fails. The cases cover chunks
with and without a prefix (start 0, inside a page, on a page boundary), queries past
``q_lens`` and rows with no query, bf16 and f16; a mutant (the diagonal's keys one position
late) must fail the same check. On CPU: the impl is refused with a clear error.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import paged_attention_cases as pc
import pytest

from jspec.kernels import paged_prefill_cudnn as ppc
from jspec.kernels.paged_attention import paged_attention

# 8B heads (32 / 8 x 128), page 16.
CASES = {
    "fresh-ragged": dict(batch=2, qp=256, num_pages=32, q_lens=[256, 131], kv_lens=[256, 131]),
    "prefix-ragged": dict(batch=2, qp=256, num_pages=32, q_lens=[256, 131], kv_lens=[256, 200]),
    "chunk-1k-of-8k": dict(batch=1, qp=1024, num_pages=512, q_lens=[1024], kv_lens=[8192]),
    "offsets-and-padding": dict(
        batch=5, qp=100, num_pages=40, q_lens=[100, 77, 0, 1, 100], kv_lens=[100, 300, 50, 17, 640]
    ),
    "random": dict(batch=6, qp=48, num_pages=9),
}
# out: cuDNN's bf16 output (one rounding, 2^-8 relative of |out| <~ 1.5) and the merge; lse: f32.
TOL = {"atol": 3e-2, "lse_atol": 2e-3}


def _case(name: str, dtype: str):
    spec = {"hq": 32, "hkv": 8, "dim": 128, "page_size": 16, "num_layers": 2, "causal": True}
    return pc.make_case(np.random.default_rng(len(name)), dtype=dtype, **spec, **CASES[name])


def _run(case, public: bool = True):
    """The pass compiled, layer traced: through the public op, or (``public=False``) the
    module's function traced afresh (the public op's jit cache would keep a patched helper
    out)."""
    args = case.jax_args()
    if public:
        fn = lambda *a: paged_attention(*a, **case.static, impl="cudnn")  # noqa: E731
    else:
        fn = lambda *a: ppc.paged_prefill_cudnn(*a[:7], page_size=case.page_size)  # noqa: E731
    got = jax.jit(fn)(*args[:3], jnp.int32(case.layer), *args[4:])
    want = jax.jit(lambda *a: paged_attention(*a, **case.static, impl="xla"))(*args)
    return [np.asarray(x, np.float64) for x in (*got, *want)]


class _Mask(enum.Enum):
    PADDING = 1
    PADDING_CAUSAL = 3


def _dense_attention(q, k, v, *, q_seqlen, kv_seqlen, scale, mask_type, return_residual):
    """cuDNN's contract in jnp (f32): ``q: [B, T, Hq, D]``, ``k, v: [B, S, Hkv, D]``; query ``t``
    sees key ``s`` iff ``t < q_seqlen``, ``s < kv_seqlen`` and (causal) ``s <= t``."""
    assert return_residual
    bsz, tq, hq, dim = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qg = q.astype(jnp.float32).reshape(bsz, tq, hkv, hq // hkv, dim)
    hp = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bthgd,bshd->bhgts", qg, k.astype(jnp.float32), precision=hp) * scale
    t_idx, s_idx = jnp.arange(tq)[:, None], jnp.arange(sk)[None, :]
    ok = (t_idx[None] < q_seqlen[:, None, None]) & (s_idx[None] < kv_seqlen[:, None, None])
    if mask_type == _Mask.PADDING_CAUSAL:
        ok = ok & (s_idx <= t_idx)[None]
    ok = ok[:, None, None]  # [B, 1, 1, T, S]
    s = jnp.where(ok, s, -jnp.inf)
    top = jnp.max(s, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.where(ok, jnp.exp(s - top), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    out = jnp.einsum("bhgts,bshd->bthgd", e / jnp.maximum(total, 1e-30), v.astype(jnp.float32))
    lse = (top + jnp.log(total))[..., 0].reshape(bsz, hq, tq)
    return out.reshape(bsz, tq, hq, dim).astype(q.dtype), lse


# Small heads on CPU: the named causal passes of paged_attention_cases (ragged lengths, offsets
# around page and block boundaries, a row with no query, page size 1) and a random one.
CPU_CASES = ["causal-offsets-gqa2", "prefill-ragged-mqa", "causal-small-p1"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", CPU_CASES)
def test_decomposition_vs_oracle_on_cpu(name, dtype, monkeypatch):
    monkeypatch.setattr(ppc, "_cudnn_attention", lambda: (_dense_attention, _Mask))
    case = pc.make_case(np.random.default_rng(len(name)), dtype=dtype, **pc.CASES[name])
    args = case.jax_args()
    got = ppc.paged_prefill_cudnn(*args[:7], page_size=case.page_size)
    pc.check(*[np.asarray(x, np.float64) for x in got], *pc.oracle(case), **TOL)


def test_decomposition_mutant_fails_on_cpu(monkeypatch):
    """The diagonal's keys one position late, around the stand-in: the check must catch it."""
    monkeypatch.setattr(ppc, "_cudnn_attention", lambda: (_dense_attention, _Mask))
    real = ppc._gather
    monkeypatch.setattr(
        ppc,
        "_gather",
        lambda kp, vp, layer, table, pos, ok, p: real(
            kp, vp, layer, table, pos + (pos.shape[1] == 24), ok, p
        ),
    )
    case = pc.make_case(
        np.random.default_rng(3), dtype="bfloat16", **pc.CASES["causal-offsets-gqa2"]
    )
    args = case.jax_args()
    got = ppc.paged_prefill_cudnn(*args[:7], page_size=case.page_size)
    with pytest.raises(AssertionError):
        pc.check(*[np.asarray(x, np.float64) for x in got], *pc.oracle(case), **TOL)


def _bounded(case, bound: int, monkeypatch):
    """The module around the stand-in with ``max_prefix_len=bound``: its outputs (f64) and the
    key widths of the stand-in's calls (the diagonal's first, then the prefix's, if any)."""
    widths = []

    def counted(q, k, v, **kw):
        widths.append(k.shape[1])
        return _dense_attention(q, k, v, **kw)

    monkeypatch.setattr(ppc, "_cudnn_attention", lambda: (counted, _Mask))
    args = case.jax_args()
    got = ppc.paged_prefill_cudnn(*args[:7], page_size=case.page_size, max_prefix_len=bound)
    return [np.asarray(x, np.float64) for x in got], widths


@pytest.mark.parametrize("name", CPU_CASES)
def test_prefix_bound_on_cpu(name, monkeypatch):
    """``max_prefix_len`` at the rows' largest start: the oracle's result, the prefix gathered
    only that wide; one less: the rows at that start NaN, every other row the oracle's."""
    case = pc.make_case(np.random.default_rng(len(name)), dtype="bfloat16", **pc.CASES[name])
    starts = case.kv_lens - case.q_lens
    top = int(starts.max())
    assert top > 0 and (starts < top).any()  # a case with prefixes, and rows below the top
    want = pc.oracle(case)
    got, widths = _bounded(case, top, monkeypatch)
    pc.check(*got, *want, **TOL)
    assert widths == [case.q.shape[1], top]
    got, _ = _bounded(case, top - 1, monkeypatch)
    past = starts > top - 1
    assert np.isnan(got[0][past]).all() and np.isnan(got[1][past]).all()
    pc.check(*(x[~past] for x in got), *(x[~past] for x in want), **TOL)


def test_first_chunks_skip_the_prefix_on_cpu(monkeypatch):
    """``max_prefix_len=0`` on first chunks (every start 0): one call (the diagonal), the
    oracle's result; a row that does have a prefix gets NaN under it (the bound's check has
    power: ignoring it would give that row a wrong number, not NaN)."""
    spec = dict(pc.CASES["causal-offsets-gqa2"])
    spec["kv_lens"] = spec["q_lens"]  # every chunk at position 0
    case = pc.make_case(np.random.default_rng(5), dtype="bfloat16", **spec)
    got, widths = _bounded(case, 0, monkeypatch)
    pc.check(*got, *pc.oracle(case), **TOL)
    assert widths == [case.q.shape[1]]
    case = pc.make_case(
        np.random.default_rng(5), dtype="bfloat16", **pc.CASES["causal-offsets-gqa2"]
    )
    got, widths = _bounded(case, 0, monkeypatch)
    past = case.kv_lens > case.q_lens
    assert past.any() and np.isnan(got[0][past]).all() and not np.isnan(got[0][~past]).any()


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"max_prefix_len": -1, "causal": True}, "max_prefix_len=-1 must be None or an int >= 0"),
        ({"max_prefix_len": True, "causal": True}, "max_prefix_len=True must be None"),
        ({"max_prefix_len": 8, "causal": False}, "max_prefix_len bounds causal passes only"),
    ],
)
def test_prefix_bound_is_validated(kw, match):
    case = pc.make_case(np.random.default_rng(0), dtype="float32", **pc.CASES["causal-small-p1"])
    args = case.jax_args()
    q_lens = args[6] if kw["causal"] else None
    with pytest.raises(ValueError, match=match):
        paged_attention(*args[:6], q_lens, page_size=case.page_size, impl="xla", **kw)


def test_prefix_bound_probe_names_the_row():
    """Probes on: a row with more keys before its queries than ``max_prefix_len`` is named
    (every impl; the reference here), one within it passes."""
    from jspec import probes

    case = pc.make_case(
        np.random.default_rng(1), dtype="float32", **pc.CASES["causal-offsets-gqa2"]
    )
    args = case.jax_args()
    top = int((case.kv_lens - case.q_lens).max())

    def run(bound):
        fn = lambda *a: paged_attention(  # noqa: E731
            *a, page_size=case.page_size, causal=True, impl="xla", max_prefix_len=bound
        )
        return probes.checked(fn)(*args[:7])

    run(top)
    with pytest.raises(probes.ProbeError, match=r"kv_lens - q_lens vs max_prefix_len.*value"):
        run(top - 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(CASES))
def test_cudnn_prefill_vs_oracle_on_gpu(name, dtype):
    case = _case(name, dtype)
    pc.check(*_run(case), **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fresh-ragged", "prefix-ragged", "chunk-1k-of-8k"])
def test_cudnn_prefix_bound_on_gpu(name):
    """cuDNN with ``max_prefix_len`` at the rows' largest start (0 for first chunks: the prefix
    call skipped) against the reference; one less (where a row has a prefix): that row NaN."""
    case = _case(name, "bfloat16")
    args = case.jax_args()
    top = int((case.kv_lens - case.q_lens).max())
    want = jax.jit(lambda *a: paged_attention(*a, **case.static, impl="xla"))(*args)
    want = [np.asarray(x, np.float64) for x in want]
    for bound in (top, top - 1) if top else (0,):
        fn = jax.jit(
            lambda *a, b=bound: paged_attention(*a, **case.static, impl="cudnn", max_prefix_len=b)
        )
        got = [np.asarray(x, np.float64) for x in fn(*args[:3], jnp.int32(case.layer), *args[4:])]
        past = (case.kv_lens - case.q_lens) > bound
        assert np.isnan(got[0][past]).all()
        pc.check(*(x[~past] for x in got), *(x[~past] for x in want), **TOL)


@pytest.mark.gpu
def test_cudnn_prefill_mutant_fails_on_gpu(monkeypatch):
    """The diagonal's keys read one position late: the check must catch it."""
    real = ppc._gather

    def late(k_pool, v_pool, layer, page_table, pos, ok, page_size):
        if pos.shape[1] == 100:  # the diagonal (Qp = 100; the prefix is C * P = 640 wide)
            pos = pos + 1
        return real(k_pool, v_pool, layer, page_table, pos, ok, page_size)

    monkeypatch.setattr(ppc, "_gather", late)
    case = _case("offsets-and-padding", "bfloat16")
    with pytest.raises(AssertionError):
        pc.check(*_run(case, public=False), **TOL)


@pytest.mark.gpu
def test_cudnn_rejects_an_f32_pool_on_gpu():
    case = _case("random", "float32")
    with pytest.raises(ValueError, match="bf16 / f16 pool and a head dim"):
        _run(case)


def test_cudnn_needs_a_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("CPU behaviour")
    q = jnp.zeros((1, 4, 4, 16), jnp.bfloat16)
    pool = jnp.zeros((1, 32, 2, 16), jnp.bfloat16)
    table, lens = jnp.zeros((1, 2), jnp.int32), jnp.full((1,), 4, jnp.int32)
    with pytest.raises(ValueError, match="impl='cudnn'.*needs a GPU"):
        paged_attention(
            q, pool, pool, 0, table, lens, lens, page_size=16, causal=True, impl="cudnn"
        )


@pytest.mark.parametrize(
    "qp,causal,dtype,dim,want",
    [
        (ppc.CUDNN_MIN_QUERIES, True, "bfloat16", 128, "cudnn"),
        (ppc.CUDNN_MIN_QUERIES - 1, True, "bfloat16", 128, "triton"),  # short chunk
        (ppc.CUDNN_MIN_QUERIES, False, "bfloat16", 128, "triton"),  # not a prefill chunk
        (ppc.CUDNN_MIN_QUERIES, True, "float32", 128, "triton"),  # cuDNN takes no f32
        (ppc.CUDNN_MIN_QUERIES, True, "float16", 256, "triton"),  # head dim past MAX_HEAD_DIM
        (ppc.CUDNN_MIN_QUERIES, True, "float16", 20, "triton"),  # not a multiple of 8
    ],
)
def test_backend_routes_long_chunks_to_cudnn(qp, causal, dtype, dim, want, monkeypatch):
    """``PagedAttentionBackend("cudnn")``: cuDNN for long causal chunks it can take, Triton for
    every other pass (the op is stubbed: only the routing is under test)."""
    from jspec.attention_meta.metadata import AttentionMetadata
    from jspec.engine import attention as engine_attention
    from jspec.kv.pool import KVPool

    seen = {}

    def stub(q, *args, impl, **kw):
        seen["impl"] = impl
        return q, q[..., 0]

    monkeypatch.setattr(engine_attention, "paged_attention", stub)
    pool = jax.ShapeDtypeStruct((1, 16, 1, dim), jnp.dtype(dtype))
    meta = AttentionMetadata(
        page_table=jnp.zeros((1, 1), jnp.int32),
        kv_lens=jnp.zeros((1,), jnp.int32),
        page_size=16,
        causal=causal,
    )
    q = jax.ShapeDtypeStruct((1, qp, 1, dim), jnp.dtype(dtype))
    backend = engine_attention.PagedAttentionBackend("cudnn")
    jax.eval_shape(lambda q, k: backend.attend(KVPool(k=k, v=k, page_size=16), 0, q, meta), q, pool)
    assert seen["impl"] == want


# The engine path: prompts past CUDNN_MIN_QUERIES in chunks of CUDNN_MIN_QUERIES, so the first
# chunk of each goes through cuDNN and the second (a short tail after a prefix) through Triton.
LONG_LENS = (ppc.CUDNN_MIN_QUERIES + 300, ppc.CUDNN_MIN_QUERIES + 7)
LONG_NEW = 12
# The target pool after the run, cuDNN against Triton: layer 1's K / V are projections of the
# residual stream after layer 0's attention, so they carry its error (bf16 rounding of both
# attentions); measured on 2 x H100 (2026-11-28): 0.031 (one bf16 step at |x| ~ 4) with tp 1 and
# tp 2 alike, while the diagonal's keys one position late (the mutant of
# test_cudnn_prefill_mutant_fails_on_gpu) moves 941 values past POOL_ATOL, up to 3.65; the
# greedy tokens of this toy did not change under that mutant, so the pool is the test's teeth.
POOL_ATOL = 0.125


class LongRun(NamedTuple):
    tokens: list[list[int]]
    leak_check: str
    cudnn_traces: int  # how often the cuDNN pass was traced
    pool: np.ndarray  # f32[2, ...]: the target pool's K and V after the run


def long_prompt_run(attention_impl: str, tensor_parallel: int = 1) -> LongRun:
    """The tiny engine's target in bf16 (``residual_scale=1.5``) on :data:`LONG_LENS` prompts,
    greedy, dp 1 x ``tensor_parallel``. Shared with the two-GPU test."""
    import dataclasses

    import engine_helpers as eh

    from jspec.engine.scheduler import Engine
    from jspec.engine.state import make_engine_config
    from jspec.models import LlamaTarget, toy_llama_params

    cfg = dataclasses.replace(eh.TINY, dtype="bfloat16")
    target = LlamaTarget(cfg)
    params = toy_llama_params(target, 0, residual_scale=1.5)
    ecfg = make_engine_config(
        target,
        page_size=16,
        topk=4,
        num_steps=3,
        num_draft_tokens=8,
        context_len=max(LONG_LENS) + 2 * LONG_NEW + 16,
        max_running_requests=2,
        max_prompt_len=max(LONG_LENS),
        chunked_prefill_size=ppc.CUDNN_MIN_QUERIES,
        attention_impl=attention_impl,
        tensor_parallel=tensor_parallel,
    )
    traces = []
    real = ppc.paged_prefill_cudnn

    def counted(*args, **kw):
        traces.append(args[0].shape)
        return real(*args, **kw)

    jax.clear_caches()  # trace afresh: a cached trace would count nothing
    ppc.paged_prefill_cudnn = counted
    try:
        prompts = [
            np.random.default_rng(n).integers(0, cfg.vocab_size, n).tolist() for n in LONG_LENS
        ]
        engine = Engine(ecfg, target, params, num_devices=1)
        out, stats = engine.generate(prompts, LONG_NEW)
    finally:
        ppc.paged_prefill_cudnn = real
    pool = engine.state.kv.target_pool
    kv = np.stack([np.asarray(pool.k, np.float32), np.asarray(pool.v, np.float32)])
    return LongRun(out, stats.leak_check, len(traces), kv)


def check_long_runs(got: LongRun, want: LongRun) -> None:
    """Same tokens, allocators balanced, target pools within :data:`POOL_ATOL`."""
    assert got.tokens == want.tokens
    assert all(len(t) == LONG_NEW for t in got.tokens)
    assert got.leak_check.startswith("ok") and want.leak_check.startswith("ok")
    assert np.isfinite(got.pool).all() and np.abs(want.pool).max() > 0.5
    np.testing.assert_allclose(got.pool, want.pool, rtol=0, atol=POOL_ATOL)


@pytest.mark.gpu
def test_engine_long_prompts_through_cudnn_give_the_triton_results():
    """The default GPU path for bf16 models: prompt chunks of >= CUDNN_MIN_QUERIES tokens reach
    cuDNN inside the engine's jitted prefill, and give the Triton prefill's greedy tokens and
    (within bf16 rounding) its KV pool; allocators balanced."""
    got, want = long_prompt_run("cudnn"), long_prompt_run("triton")
    assert got.cudnn_traces >= 1 and want.cudnn_traces == 0, (got.cudnn_traces, want.cudnn_traces)
    check_long_runs(got, want)
