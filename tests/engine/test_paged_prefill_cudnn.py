"""Causal prefill chunks through cuDNN (``paged_attention(impl="cudnn")``,
``jspec.kernels.paged_prefill_cudnn``).

GPU only (``JSPEC_TEST_GPU=1``): cuDNN's flash attention has no CPU form. Oracle: the pure-jnp
reference (``impl="xla"``, f32 HIGHEST) compiled on the same GPU, itself checked against
paged_attention_cases' f64 loop on CPU (tests/engine/test_paged_attention.py); every pool
position a pass does not read is NaN, so a gather that reads one position too many fails. The cases cover chunks
with and without a prefix (start 0, inside a page, on a page boundary), queries past
``q_lens`` and rows with no query, bf16 and f16; a mutant (the diagonal's keys one position
late) must fail the same check. On CPU: the impl is refused with a clear error.
"""

from __future__ import annotations

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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(CASES))
def test_cudnn_prefill_vs_oracle_on_gpu(name, dtype):
    case = _case(name, dtype)
    pc.check(*_run(case), **TOL)


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
    with pytest.raises(ValueError, match="bf16 / f16 pool"):
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
