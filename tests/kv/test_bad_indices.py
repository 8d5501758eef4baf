"""Bad indices and loose types through the public kv API (issue 22): every reproduced input gives
``ok=False`` with the state bit-identical (a probe names it when on), or a ``ValueError`` naming
the field for a static mistake. Expected values are by hand.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
import pytest

from jspec import probes
from jspec.config import SpecConfig
from jspec.kv import allocator as A
from jspec.kv import decode_alloc as D

CFG = SpecConfig(
    page_size=4,
    topk=2,
    num_steps=3,
    num_draft_tokens=4,
    context_len=16,
    max_running_requests=2,
    num_pages=32,
    num_layers=1,
    num_kv_heads=1,
    head_dim=2,
    dtype="float32",
)


def _i32(xs):
    return jnp.asarray(xs, jnp.int32)


def _reqs(committed, allocated, rows, valid):
    return D.ReqKVState(
        committed_lens=_i32(committed),
        allocated_lens=_i32(allocated),
        req_pool_indices=_i32(rows),
        valid=jnp.asarray(valid, bool),
    )


def _one_request():
    """Row 1 owns positions 0..7 = slots 4..11 (pages 1, 2); 30 pages free."""
    a = A.init_allocator(CFG.num_pages, CFG.page_size)
    a, slots, ok = A.alloc(a, 8, max_slots=8)
    assert bool(ok)
    r2t = jnp.zeros((CFG.num_req_rows, CFG.req_to_token_width), jnp.int32)
    r2t = r2t.at[1, :8].set(slots)
    return a, r2t


# ---- prepare_for_decode: a row out of range / padding / repeated takes nothing ------------------
@pytest.mark.parametrize(
    "rows,valid,committed,allocated",
    [
        ([7, 0], [True, False], [0, 0], [0, 0]),  # row 7 of 3
        ([-1, 0], [True, False], [0, 0], [0, 0]),  # wraps to the last row
        ([0, 0], [True, False], [0, 0], [0, 0]),  # the padding row
        ([1, 1], [True, True], [5, 5], [8, 8]),  # one row twice
        ([1, 0], [True, False], [9, 0], [8, 0]),  # committed > allocated
        ([1, 0], [True, False], [-3, 0], [8, 0]),  # negative length
    ],
    ids=["row_past_end", "row_minus1", "padding_row", "row_twice", "committed_gt_alloc", "neg"],
)
def test_prepare_for_decode_bad_rows_take_nothing(rows, valid, committed, allocated) -> None:
    a, r2t = _one_request()
    reqs = _reqs(committed, allocated, rows, valid)
    a2, r2t2, reqs2, ok = D.prepare_for_decode(a, r2t, reqs, CFG)
    assert not bool(ok)
    chex.assert_trees_all_equal((a2, r2t2, reqs2), (a, r2t, reqs))


def test_prepare_for_decode_probe_names_the_row() -> None:
    a, r2t = _one_request()
    reqs = _reqs([0, 0], [0, 0], [7, 0], [True, False])
    with pytest.raises(probes.ProbeError, match=r"prepare_for_decode: .*row 7"):
        probes.checked(D.prepare_for_decode)(a, r2t, reqs, cfg=CFG)
