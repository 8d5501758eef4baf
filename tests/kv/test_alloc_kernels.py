"""Pallas kernels vs their ``_reference`` and vs numpy loops: alloc_extend, alloc_decode, assign.

Outputs are poisoned (-7) so that every slot the op must write is checked, and every slot it must
not write keeps the poison. Kernel indices are validated outside the kernel (interpret mode clamps).
"""

from __future__ import annotations

import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.kernels import alloc_decode as D
from jspec.kernels import alloc_extend as E
from jspec.kernels import assign_req_to_token_pool as R

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _alloc_model import ModelAllocator

POISON = -7
PAGE_SIZES = [1, 4, 16, 64]


FREE_LEN = 40  # fixed free-list length (>= 5 requests * 4 new pages): one compile per P


def _extend_case(rng: np.random.Generator, page_size: int, batch: int = 5):
    """Random prefix/seq (straddling pages, padding rows) and a permuted free list."""
    p = page_size
    pre = rng.integers(0, 3 * p + 2, batch)
    ext = rng.choice([0, 1, p - 1, p, p + 1, 2 * p + 3], batch)
    ext[rng.integers(0, batch)] = 0  # at least one padding-like row
    seq = pre + ext
    # last_loc consistent with the page layout: (last_loc + 1) % P == pre % P.
    last = np.where(pre > 0, rng.integers(1, 50, batch) * p + (pre - 1) % p, -1)
    free = rng.permutation(np.arange(1, FREE_LEN + 1)).astype(np.int32)
    return pre.astype(np.int32), seq.astype(np.int32), last.astype(np.int32), free


def _model_extend(pre, seq, last, free, page_size):
    model = ModelAllocator(len(free), page_size)
    model.free_pages = [int(x) for x in free]
    return model.alloc_extend(pre, seq, last)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_extend_kernel_matches_reference(page_size: int, interpret: bool) -> None:
    rng = np.random.default_rng(page_size)
    max_new = 4 * page_size + 4  # static: one compile per impl
    for fits in (True, False):  # spare room, then truncated
        while True:
            pre, seq, last, free = _extend_case(rng, page_size)
            total = int((seq - pre).sum())
            if (total <= max_new) == fits and total > 0:
                break
        want = _model_extend(pre, seq, last, free, page_size)
        args = (jnp.asarray(pre), jnp.asarray(seq), jnp.asarray(last), jnp.asarray(free))
        kw = {
            "page_size": page_size,
            "max_new_slots": max_new,
            "out": jnp.full((max_new,), POISON, jnp.int32),
        }
        ref = np.asarray(E.alloc_extend_slots(*args, **kw, impl="xla"))
        got = np.asarray(E.alloc_extend_slots(*args, **kw, impl="pallas", interpret=interpret))
        n = min(total, max_new)
        np.testing.assert_array_equal(ref[:n], want[:n], err_msg=f"fits={fits}")
        assert (ref[n:] == POISON).all()
        np.testing.assert_array_equal(got, ref, err_msg=f"fits={fits}")
    eager = E.alloc_extend_slots_reference(*args, page_size=page_size, max_new_slots=max_new)
    np.testing.assert_array_equal(eager[:n], ref[:n])
    assert not np.asarray(eager[n:]).any()  # default fill is 0


def _decode_case(rng: np.random.Generator, page_size: int, batch: int):
    seq = rng.integers(1, 4 * page_size + 3, batch).astype(np.int32)
    last = (rng.integers(1, 50, batch) * page_size + (seq - 2) % page_size).astype(np.int32)
    valid = rng.random(batch) < 0.8
    free = rng.permutation(np.arange(1, batch + 4)).astype(np.int32)
    return seq, last, valid, free


@pytest.mark.parametrize("batch", [3, 300])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_decode_kernel_matches_reference(page_size: int, batch: int, interpret: bool) -> None:
    rng = np.random.default_rng(100 * page_size + batch)
    seq, last, valid, free = _decode_case(rng, page_size, batch)
    model = ModelAllocator(len(free), page_size)
    model.free_pages = [int(x) for x in free]
    want = np.asarray(model.alloc_decode(list(seq), list(last), list(valid)))
    want = np.where(valid, want, POISON)
    args = (jnp.asarray(seq), jnp.asarray(last), jnp.asarray(free))
    kw = {
        "page_size": page_size,
        "valid": jnp.asarray(valid),
        "out": jnp.full((batch,), POISON, jnp.int32),
    }
    ref = np.asarray(D.alloc_decode_slots(*args, **kw, impl="xla"))
    got = np.asarray(D.alloc_decode_slots(*args, **kw, impl="pallas", interpret=interpret))
    np.testing.assert_array_equal(ref, want)
    np.testing.assert_array_equal(got, ref)


def _numpy_assign(table, rows, start, end, locs):
    table = table.copy()
    k = 0
    for r, s, e in zip(rows, start, end):
        n = max(e - s, 0)
        table[r, s:e] = locs[k : k + n]
        k += n
    return table


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_assign_req_to_token_pool_kernel_matches_reference(page_size: int, interpret: bool) -> None:
    rng = np.random.default_rng(7 + page_size)
    num_rows, width, batch = 6, 3 * page_size + 5, 4
    rows = rng.permutation(np.arange(1, num_rows))[:batch].astype(np.int32)
    start = rng.integers(0, width, batch).astype(np.int32)
    end = np.minimum(start + rng.integers(0, 2 * page_size + 2, batch), width).astype(np.int32)
    end[1] = start[1]  # a padding row: writes nothing
    rows[1] = 0
    total = int((end - start).sum())
    locs = rng.integers(0, 10_000, total + 3).astype(np.int32)  # 3 spare entries, unused
    table = np.full((num_rows, width), POISON, np.int32)
    want = _numpy_assign(table, rows, start, end, locs)
    args = [jnp.asarray(x) for x in (table, rows, start, end, locs)]
    ref = np.asarray(R.assign_req_to_token_pool_reference(*args))
    got = np.asarray(R.assign_req_to_token_pool_pallas(*args, interpret=interpret))
    np.testing.assert_array_equal(ref, want)
    np.testing.assert_array_equal(got, ref)
    assert (want[0] == POISON).all()  # padding row untouched


def test_kernel_wrappers_reject_bad_static_args() -> None:
    z = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="impl='cuda' is not available for alloc_extend_slots"):
        E.alloc_extend_slots(z, z, z, z, page_size=4, max_new_slots=4, impl="cuda")
    with pytest.raises(ValueError, match="page_size=3 must be a power of 2"):
        E.alloc_extend_slots(z, z, z, z, page_size=3, max_new_slots=4)
    with pytest.raises(ValueError, match=r"out.shape=\(2,\) must be \(4,\)"):
        E.alloc_extend_slots(z, z, z, z, page_size=4, max_new_slots=4, out=z)
    with pytest.raises(ValueError, match=r"last_loc.shape=\(3,\) must be \(2,\)"):
        D.alloc_decode_slots(z, jnp.zeros(3, jnp.int32), z, page_size=4)
    with pytest.raises(ValueError, match="req_to_token.ndim=1 must be 2"):
        R.validate_assign_args(z, z, z, z, z)
    with pytest.raises(ValueError, match=r"end_offset.shape=\(3,\) must be \(2,\)"):
        R.validate_assign_args(jnp.zeros((2, 4), jnp.int32), z, z, jnp.zeros(3, jnp.int32), z)
    with pytest.raises(
        ValueError, match="impl='cuda' is not available for assign_req_to_token_pool"
    ):
        R.resolve_impl("cuda")


def test_empty_batches_return_fill() -> None:
    e = jnp.zeros((0,), jnp.int32)
    fill = jnp.full((4,), POISON, jnp.int32)
    for impl in ("xla", "pallas"):
        out = E.alloc_extend_slots(
            e, e, e, jnp.ones(3, jnp.int32), page_size=4, max_new_slots=4, out=fill, impl=impl
        )
        np.testing.assert_array_equal(out, fill)
        assert D.alloc_decode_slots(e, e, jnp.ones(3, jnp.int32), page_size=4, impl=impl).shape == (
            0,
        )
