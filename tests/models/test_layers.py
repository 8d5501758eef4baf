"""jspec.models.layers.matmul: one-row products in XLA's strength-reduction band run as GEMMs.

On the GPU, XLA rewrites a dot with a one-row operand whose operands hold under 10M elements
into multiply + reduce, writing the whole [K, N] product (a tensor-parallel o_proj shard at
batch 1: ~21 us against a ~5 us GEMV). ``matmul`` appends a zero row there; these tests check
the product is unchanged and the dot the compiler sees has two rows (CPU), and that the
compiled GPU program holds no [K, N] multiply while a plain ``jnp.matmul`` does (the control).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.models.layers import (
    GEMV_PAD_MIN_ELEMENTS,
    STRENGTH_REDUCE_MAX_ELEMENTS,
    lm_logits,
    matmul,
)


def _dot_lhs_rows(fn, a, b) -> list[int]:
    """Rows of every dot_general's lhs in ``fn``'s jaxpr."""
    jaxpr = jax.make_jaxpr(fn)(a, b)
    return [e.invars[0].aval.shape[0] for e in jaxpr.eqns if e.primitive.name == "dot_general"]


@pytest.mark.parametrize(
    "rows, k, n, padded",
    [
        (1, 512, 4096, True),  # 2.1M elements: in the band
        (1, 2048, 4096, True),  # the 8B o_proj shard at tp 2
        (1, 256, 256, False),  # 65k: too small to matter
        (1, 4096, 4096, False),  # 16.8M: XLA keeps it a GEMM already
        (1, 1024, 1023, True),  # exactly GEMV_PAD_MIN_ELEMENTS: the band's first size
        (1, 2000, 4999, False),  # exactly STRENGTH_REDUCE_MAX_ELEMENTS: past the band
        (2, 2048, 4096, False),  # not a one-row product
    ],
)
def test_one_row_products_in_the_band_run_with_two_rows(rows, k, n, padded):
    rng = np.random.default_rng(k + n + rows)
    a = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
    in_band = GEMV_PAD_MIN_ELEMENTS <= a.size + b.size < STRENGTH_REDUCE_MAX_ELEMENTS
    assert padded == (rows == 1 and in_band)
    assert _dot_lhs_rows(matmul, a, b) == [2 if padded else rows]
    got = np.asarray(jax.jit(matmul)(a, b))
    want = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    assert got.shape == (rows, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_one_row_product_matches_the_plain_one():
    rng = np.random.default_rng(7)
    a = jnp.asarray(rng.standard_normal((1, 2048)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((2048, 4096)) / 45.0, jnp.bfloat16)
    got = np.asarray(jax.jit(matmul)(a, b), np.float32)
    want = np.asarray(jax.jit(jnp.matmul)(a, b), np.float32)
    assert got.dtype == np.float32 and np.abs(want).max() > 0.1  # not a product of zeros
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_logits_are_rounded_to_the_model_dtype(dtype):
    """A bf16 / f16 model's LM head is its dtype's product upcast (what the checkpoint's own
    framework computes), not an f32-accumulated one: every logit is a value of ``dtype``,
    and it tracks the f64 product to the dtype's rounding."""
    rng = np.random.default_rng(11)
    hidden = jnp.asarray(rng.standard_normal((5, 64)), dtype)
    lm_head = jnp.asarray(rng.standard_normal((64, 48)) / 8.0, dtype)
    want = np.asarray(hidden, np.float64) @ np.asarray(lm_head, np.float64)
    assert np.abs(want).max() > 1.0
    # untied [H, V], and tied: the embedding [V, H] read transposed
    for got in (lm_logits(hidden, lm_head), lm_logits(hidden, lm_head.T, transposed=True)):
        got = np.asarray(got)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, np.asarray(jnp.asarray(got).astype(dtype), np.float32))
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def _product_multiplies(hlo: str, k: int, n: int) -> int:
    """Instructions of the compiled HLO that write a [k, n] multiply (the strength reduction)."""
    return sum(
        1
        for line in hlo.splitlines()
        if re.search(rf"= bf16\[{k},{n}\]\S* (multiply|fusion)\(", line) and "multiply" in line
    )


@pytest.mark.gpu
def test_gpu_compiles_the_band_as_a_gemm_not_a_multiply_and_reduce():
    k, n = 2048, 4096
    a = jax.ShapeDtypeStruct((1, k), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    plain = jax.jit(jnp.matmul).lower(a, b).compile().as_text()
    ours = jax.jit(matmul).lower(a, b).compile().as_text()
    # The control: XLA strength-reduces the plain one-row product (the test has power).
    assert _product_multiplies(plain, k, n) >= 1, "XLA no longer strength-reduces this dot"
    assert _product_multiplies(ours, k, n) == 0
