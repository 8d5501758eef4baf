"""DLPack shim: bit-exact round trips, zero-copy where promised, and every hazard."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from interop.dlpack import shares_memory, to_jax, to_torch, tree_to_jax, tree_to_torch
from jspec._pytree import pytree_dataclass

ZERO_COPY_DTYPES = [
    torch.bool,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.float16,
    torch.bfloat16,
    torch.float32,
]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _sample(dtype: torch.dtype, n: int = 1024) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(n, generator=gen) > 0.5
    if dtype.is_floating_point:
        x = torch.randn(n, generator=gen).to(dtype)
        x[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]).to(dtype)
        return x
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern view (NaN payloads and -0.0 compared exactly)."""
    return t if t.dtype == torch.bool else t.view(_BITS[t.element_size()])


@pytest.mark.parametrize("dtype", ZERO_COPY_DTYPES, ids=str)
def test_round_trip_bit_exact_and_zero_copy(dtype):
    t = _sample(dtype)
    a = to_jax(t)
    assert shares_memory(t, a), "torch -> jax must be zero-copy"
    back = to_torch(a)
    assert back.dtype == dtype
    assert shares_memory(back, a), "jax -> torch must be zero-copy"
    assert torch.equal(_bits(back), _bits(t))
    # the JAX side sees the same bits
    expected = _bits(t).numpy()
    assert np.array_equal(np.asarray(a).view(expected.dtype), expected)


@pytest.mark.parametrize("dtype", ZERO_COPY_DTYPES, ids=str)
def test_jax_to_torch_round_trip_bit_exact(dtype):
    a = to_jax(_sample(dtype)) if dtype != torch.bool else jnp.arange(64) % 3 == 0
    a = jnp.array(a, copy=True)  # an XLA-owned buffer
    t = to_torch(a)
    assert shares_memory(t, a)
    a2 = to_jax(t)
    assert shares_memory(t, a2)
    assert np.array_equal(np.asarray(a2).view(np.uint8), np.asarray(a).view(np.uint8))


def test_permuted_and_row_sliced_views_are_zero_copy():
    m = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    for view in (m.t(), m[16:32], m.permute(1, 0)[:, :]):
        a = to_jax(view)
        assert shares_memory(view, a)
        np.testing.assert_array_equal(np.asarray(a), view.numpy())


def test_empty_and_scalar():
    for t in (torch.empty(0, dtype=torch.int32), torch.tensor(3.5)):
        a = to_jax(t)
        assert a.shape == tuple(t.shape)
        np.testing.assert_array_equal(np.asarray(a), t.numpy())


# ---- int64 ----------------------------------------------------------------------------------------
def test_int64_in_range_becomes_int32():
    t = torch.tensor([0, -5, 2**31 - 1, -(2**31)], dtype=torch.int64)
    a = to_jax(t)
    assert a.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_int64_out_of_range_names_value_and_index():
    t = torch.tensor([1, 2, 2**33 + 5, 7], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"value 8589934597 at flat index 2 does not fit int32"):
        to_jax(t, what="out_cache_loc")
    with pytest.raises(ValueError, match=r"out_cache_loc .* value -2147483649 at flat index 0"):
        to_jax(torch.tensor([-(2**31) - 1], dtype=torch.int64), what="out_cache_loc")


def test_int64_error_and_x64_modes():
    t = torch.tensor([1, 2**33 + 5], dtype=torch.int64)
    with pytest.raises(ValueError, match="int64='error'"):
        to_jax(t, int64="error")
    with pytest.raises(ValueError, match="jax_enable_x64 is off"):
        to_jax(t, int64="x64")
    with pytest.raises(ValueError, match="int64='bogus' must be one of"):
        to_jax(t, int64="bogus")
    with jax.enable_x64(True):
        a = to_jax(t, int64="x64")
        assert a.dtype == jnp.int64
        assert shares_memory(t, a)
        np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_float64_needs_x64():
    with pytest.raises(ValueError, match="float64 but jax_enable_x64 is off"):
        to_jax(torch.ones(3, dtype=torch.float64))


# ---- strided / grad / donation ---------------------------------------------------------------------
def test_strided_view_copied_or_refused():
    base = torch.arange(256, dtype=torch.float32)
    view = base[::2]
    a = to_jax(view)
    assert not shares_memory(view, a)
    np.testing.assert_array_equal(np.asarray(a), view.numpy())
    cols = base.reshape(16, 16)[:, :4]
    np.testing.assert_array_equal(np.asarray(to_jax(cols)), cols.numpy())
    with pytest.raises(ValueError, match=r"strided view .*stride=\(2,\)"):
        to_jax(view, strict=True)
    with pytest.raises(ValueError, match="strided view"):
        to_jax(torch.ones(1, 4).expand(3, 4), strict=True)


def test_requires_grad_is_detached_without_copy():
    t = torch.randn(64, requires_grad=True)
    a = to_jax(t)
    assert shares_memory(t, a)
    np.testing.assert_array_equal(np.asarray(a), t.detach().numpy())


def test_safe_for_donation_never_aliases_torch():
    t = torch.arange(1024, dtype=torch.float32)
    snapshot = t.clone()
    aliased = to_jax(t)
    assert shares_memory(t, aliased)  # the hazard's premise
    safe = to_jax(t, safe_for_donation=True)
    assert not shares_memory(t, safe)
    out = jax.jit(lambda x: x * 2 + 1, donate_argnums=0)(safe)
    assert safe.is_deleted()
    assert torch.equal(t, snapshot)
    np.testing.assert_array_equal(np.asarray(out), snapshot.numpy() * 2 + 1)
    assert not shares_memory(t, to_jax(t, copy=True))


def test_to_torch_copy_does_not_alias():
    a = jnp.arange(64, dtype=jnp.int32)
    t = to_torch(a, copy=True)
    assert not shares_memory(t, a)
    t[0] = 99
    assert int(a[0]) == 0


def test_imported_array_outlives_tensor():
    t = torch.arange(1 << 14, dtype=torch.float32)
    a = to_jax(t)
    del t
    torch.zeros(1 << 14)
    assert float(a[5]) == 5.0 and float(a.sum()) == float(sum(range(1 << 14)))


def test_rejects_non_tensor():
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        to_jax(np.zeros(3))


@pytest.mark.parametrize(
    "tensor, match",
    [
        (torch.empty(3, device="meta"), "out_cache_loc is on device meta"),
        (
            torch.zeros(4, dtype=torch.int32).to_sparse(),
            "out_cache_loc has layout torch.sparse_coo",
        ),
    ],
    ids=["meta", "sparse"],
)
def test_rejects_what_dlpack_cannot_share_naming_it(tensor, match):
    # Before: "Unknown device type meta for Dlpack" (no name) and a RuntimeError from torch.
    with pytest.raises(ValueError, match=match):
        to_jax(tensor, what="out_cache_loc")


# ---- pytrees -----------------------------------------------------------------------------------------
class Pair(NamedTuple):
    first: object
    second: object


@dataclasses.dataclass
class Meta:
    seq_lens: object
    name: str = "m"


@pytree_dataclass
class State:
    slots: jax.Array
    lens: jax.Array


def test_tree_round_trip():
    tree = {
        "a": [torch.arange(4, dtype=torch.int32), (torch.ones(2), 3)],
        "p": Pair(torch.tensor([True]), None),
        "m": Meta(torch.tensor([5, 6], dtype=torch.int64)),
    }
    j = tree_to_jax(tree)
    assert isinstance(j["a"][0], jax.Array) and isinstance(j["a"][1], tuple)
    assert j["a"][1][1] == 3 and j["p"].second is None and isinstance(j["p"], Pair)
    assert isinstance(j["m"], Meta) and j["m"].name == "m" and j["m"].seq_lens.dtype == jnp.int32
    back = tree_to_torch(j)
    assert torch.equal(back["a"][0], tree["a"][0])
    assert torch.equal(back["m"].seq_lens, torch.tensor([5, 6], dtype=torch.int32))


def test_tree_to_torch_on_jspec_pytree():
    s = State(slots=jnp.arange(8, dtype=jnp.int32), lens=jnp.ones(2, jnp.int32))
    t = tree_to_torch(s)
    assert isinstance(t, State) and isinstance(t.slots, torch.Tensor)
    back = tree_to_jax(t)
    np.testing.assert_array_equal(np.asarray(back.slots), np.arange(8))


# ---- GPU (skipped on CPU) -------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or jax.default_backend() != "gpu",
    reason="needs CUDA torch and a JAX GPU backend",
)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ZERO_COPY_DTYPES, ids=str)
def test_cuda_zero_copy(dtype):
    t = _sample(dtype).cuda()
    a = to_jax(t)
    assert shares_memory(t, a)
    assert torch.equal(_bits(to_torch(a)), _bits(t))


@pytest.mark.gpu
@needs_cuda
def test_cuda_producing_stream_is_waited_on():
    side = torch.cuda.Stream()
    for _ in range(5):
        with torch.cuda.stream(side):
            x = torch.randn(4096, 4096, device="cuda")
            for _ in range(8):
                x = x @ x.T / 4096.0
        a = to_jax(x, stream=side)  # exported inside the producing stream's context
        side.synchronize()
        expected_sum = float(x.double().sum())
        assert abs(float(jnp.sum(a.astype(jnp.float32))) - expected_sum) <= 1e-3 * (
            1 + abs(expected_sum)
        )
