"""FA3 draft-decode metadata: expand page table (pass B) and normal metadata (pass A).

Golden vectors: SPEC.md §13.4 (sglang's TestUpdateDraftDecodeSetExpandMetadata) and the §14
worked example. Oracles: the loops in ``_attn_meta_cases`` (independent of jspec).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attn_meta_cases import ceil_div, expand_loop, make_draft_batch, normal_loop
from hypothesis import given, settings
from hypothesis import strategies as st

from jspec import probes
from jspec.attention_meta.page_table import (
    draft_decode_metadata,
    draft_decode_normal_metadata,
    draft_decode_set_expand_metadata,
)
from jspec.kernels.expand_page_table import expand_page_table, expand_page_table_reference
from tree_geometry import geom

I32 = np.int32

# sglang TestUpdateDraftDecodeSetExpandMetadata (B=1, K=2, P=4, lp=3 unless noted). sglang's
# function uses every column it is given; expected widths are the test's page_table widths.
GOLDEN = [
    pytest.param([3], 1, [[23, 24], [31, 32]], 2, [4, 4], [[5, 6], [7, 8]], id="d1"),
    pytest.param(
        [3],
        5,
        [list(range(27, 33)), list(range(35, 41))],
        6,
        [8, 8],
        [[6, 7, 8, 0, 0, 0], [8, 9, 10, 0, 0, 0]],
        id="d5",
    ),
    pytest.param(
        [3], 2, [[23, 28], [31, 36]], 3, [5, 5], [[5, 7, 0], [7, 9, 0]], id="page_crossing_27360"
    ),
    pytest.param(
        [1, 3, 0],
        3,
        [[1, 2, 3, 4], [6, 7, 8, 9], [3, 8, 9, 10], [14, 15, 16, 17], [0, 1, 2, 3], [4, 5, 6, 7]],
        4,
        [4, 4, 6, 6, 3, 3],
        [[0, 1, 0, 0], [1, 2, 0, 0], [0, 2, 0, 0], [3, 4, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]],
        id="multi_batch",
    ),
]


def _impls(interpret: bool) -> list[tuple[str, bool]]:
    return [("xla", interpret), ("pallas", interpret)]


@pytest.mark.parametrize("lp,d,cache_loc,width,seqlens,table", GOLDEN)
def test_expand_golden_sglang(interpret, lp, d, cache_loc, width, seqlens, table):
    for impl, interp in _impls(interpret):
        out_seqlens, out_table = expand_page_table(
            jnp.asarray(lp, I32),
            jnp.asarray(cache_loc, I32),
            decode_length=d,
            geometry=geom(topk=2, page_size=4),
            page_table_width=width,
            impl=impl,
            interpret=interp,
        )
        np.testing.assert_array_equal(out_seqlens, seqlens, err_msg=impl)
        np.testing.assert_array_equal(out_table, table, err_msg=impl)


@pytest.mark.parametrize("lp,d,cache_loc,width,seqlens,table", GOLDEN)
def test_expand_api_slices_to_decode_length(lp, d, cache_loc, width, seqlens, table):
    """The API reads only the d live columns (PR #27360) and defaults to width d + 1."""
    del width, table
    cache_loc = np.asarray(cache_loc, I32)
    out_seqlens, out_table = draft_decode_set_expand_metadata(
        jnp.asarray(lp, I32), d, jnp.asarray(cache_loc), geometry=geom(topk=2, page_size=4)
    )
    want_seqlens, want_table = expand_loop(
        lp, cache_loc, decode_length=d, topk=2, page_size=4, width=d + 1, num_cols=d
    )
    np.testing.assert_array_equal(out_seqlens, seqlens)
    np.testing.assert_array_equal(out_seqlens, want_seqlens)
    np.testing.assert_array_equal(out_table, want_table)


def test_expand_regression_27360_wide_cache_loc():
    """S-wide cache_loc whose later columns cross many pages: unsliced it overflows d + 1."""
    cache_loc = jnp.asarray([[4, 8, 12, 16, 20], [40, 44, 48, 52, 56]], I32)  # 5 pages each
    lp = jnp.asarray([0], I32)
    seqlens, table = draft_decode_set_expand_metadata(
        lp, 2, cache_loc, geometry=geom(topk=2, page_size=4)
    )
    np.testing.assert_array_equal(table, [[1, 2, 0], [10, 11, 0]])
    np.testing.assert_array_equal(seqlens, [2, 2])
    # sglang's function on the unsliced S-wide rows needs 5 columns: a trace-time error here.
    with pytest.raises(ValueError, match="draft expand page_table too narrow"):
        expand_page_table(
            lp, cache_loc, decode_length=2, geometry=geom(topk=2, page_size=4), page_table_width=3
        )


def test_expand_too_narrow_width_is_trace_time_error():
    lp = jnp.zeros((2,), I32)
    cache_loc = jnp.zeros((4, 5), I32)
    with pytest.raises(ValueError, match=r"too narrow: cache_loc width 3 .*page_table_width=2"):
        jax.eval_shape(
            functools.partial(
                draft_decode_set_expand_metadata,
                decode_length=3,
                geometry=geom(topk=2, page_size=16),
                page_table_width=2,
            ),
            lp,
            cache_loc=cache_loc,
        )
    with pytest.raises(ValueError, match="W >= decode_length"):
        draft_decode_set_expand_metadata(lp, 6, cache_loc, geometry=geom(topk=2, page_size=16))
    with pytest.raises(ValueError, match="page_size"):
        draft_decode_set_expand_metadata(lp, 2, cache_loc, geometry=geom(topk=2, page_size=3))
    with pytest.raises(ValueError, match=r"cache_loc.shape\[0\]=4 must be"):
        draft_decode_set_expand_metadata(lp, 2, cache_loc, geometry=geom(topk=3, page_size=16))
    with pytest.raises(ValueError, match="cache_loc.dtype"):
        draft_decode_set_expand_metadata(
            lp, 2, cache_loc.astype(jnp.float32), geometry=geom(topk=2, page_size=16)
        )
    # Exactly d columns is enough (d slots have at most d distinct pages).
    draft_decode_set_expand_metadata(
        lp, 3, cache_loc, geometry=geom(topk=2, page_size=16), page_table_width=3
    )


def test_expand_empty_batch(interpret):
    for impl, interp in _impls(interpret):
        seqlens, table = draft_decode_set_expand_metadata(
            jnp.zeros((0,), I32),
            2,
            jnp.zeros((0, 4), I32),
            geometry=geom(topk=4, page_size=16),
            impl=impl,
            interpret=interp,
        )
        assert seqlens.shape == (0,) and table.shape == (0, 3)
        assert seqlens.dtype == jnp.int32 and table.dtype == jnp.int32


@pytest.mark.parametrize(
    "page_size,topk,num_steps", [(1, 4, 3), (4, 2, 5), (16, 8, 5), (64, 3, 4), (2, 1, 4)]
)
def test_expand_layout_random_vs_loop(interpret, page_size, topk, num_steps):
    rng = np.random.default_rng(page_size * 100 + topk * 10 + num_steps)
    seq_lens = rng.integers(1, 3 * page_size + 9, size=5)
    batch = make_draft_batch(rng, seq_lens, topk=topk, num_steps=num_steps, page_size=page_size)
    cache_loc = batch["out_cache_loc"].reshape(-1, num_steps)
    lp = batch["seq_lens"] % page_size
    for d in range(1, num_steps):
        want = expand_loop(
            lp, cache_loc, decode_length=d, topk=topk, page_size=page_size, width=d + 1, num_cols=d
        )
        # Layout property: the live slots span exactly ceil((lp + d) / P) pages.
        distinct = (want[1] != 0).sum(axis=1) if page_size > 1 else None
        if page_size > 1 and topk > 1:
            need = np.array(
                [ceil_div(int(lp[r // topk]) + d, page_size) for r in range(cache_loc.shape[0])]
            )
            np.testing.assert_array_equal(distinct, need)
        # Pallas (slow in interpret mode) on the widest step only.
        impls = _impls(interpret) if d == num_steps - 1 else [("xla", interpret)]
        for impl, interp in impls:
            got = draft_decode_set_expand_metadata(
                jnp.asarray(lp),
                d,
                jnp.asarray(cache_loc),
                geometry=geom(topk=topk, page_size=page_size),
                impl=impl,
                interpret=interp,
            )
            np.testing.assert_array_equal(got[0], want[0], err_msg=f"{impl} d={d}")
            np.testing.assert_array_equal(got[1], want[1], err_msg=f"{impl} d={d}")


def test_expand_pallas_random_slots_vs_reference(interpret):
    """Arbitrary (non-layout) slots, many rows (several programs), odd widths."""
    rng = np.random.default_rng(7)
    num_seqs, topk, ncols = 45, 3, 6
    cache_loc = rng.integers(0, 64, size=(num_seqs * topk, ncols)).astype(I32)
    cache_loc[::4] = np.sort(cache_loc[::4], axis=1)  # runs of equal pages
    lp = rng.integers(0, 8, size=num_seqs).astype(I32)
    for d, width in [(1, 1), (5, 11)]:
        want = expand_page_table_reference(
            jnp.asarray(lp),
            jnp.asarray(cache_loc),
            decode_length=d,
            geometry=geom(topk=topk, page_size=8),
            page_table_width=width,
            num_cols=d,
        )
        loop = expand_loop(
            lp, cache_loc, decode_length=d, topk=topk, page_size=8, width=width, num_cols=d
        )
        got = draft_decode_set_expand_metadata(
            jnp.asarray(lp),
            d,
            jnp.asarray(cache_loc),
            geometry=geom(topk=topk, page_size=8),
            page_table_width=width,
            impl="pallas" if d > 1 else "xla",
            interpret=interpret,
        )
        for a, b, c in zip(want, loop, got):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(c, b)


@settings(max_examples=15)
@given(
    data=st.data(),
    page_size=st.sampled_from([1, 2, 4, 16, 64]),
    topk=st.integers(1, 4),
    num_steps=st.integers(1, 6),
)
def test_expand_hypothesis(data, page_size, topk, num_steps):
    seq_lens = data.draw(st.lists(st.integers(0, 3 * page_size + 7), min_size=1, max_size=4))
    rng = np.random.default_rng(sum(seq_lens) + page_size + topk)
    batch = make_draft_batch(rng, seq_lens, topk=topk, num_steps=num_steps, page_size=page_size)
    cache_loc = batch["out_cache_loc"].reshape(-1, num_steps)
    lp = batch["seq_lens"] % page_size
    d = data.draw(st.integers(1, num_steps))
    width = data.draw(st.integers(d, d + 2))
    got = draft_decode_set_expand_metadata(
        jnp.asarray(lp),
        d,
        jnp.asarray(cache_loc),
        geometry=geom(topk=topk, page_size=page_size),
        page_table_width=width,
    )
    want = expand_loop(
        lp, cache_loc, decode_length=d, topk=topk, page_size=page_size, width=width, num_cols=d
    )
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_expand_probes():
    lp = jnp.asarray([5], I32)  # >= page_size 4
    cache_loc = jnp.asarray([[3, 9], [-2, 7]], I32)
    fn = functools.partial(
        draft_decode_set_expand_metadata, decode_length=2, geometry=geom(topk=2, page_size=4)
    )
    with pytest.raises(probes.ProbeError, match=r"last_page_lens.*max value 5 > high bound 3"):
        probes.checked(fn)(lp, cache_loc=cache_loc)
    with pytest.raises(probes.ProbeError, match=r"cache_loc \(live columns\).*min value -2"):
        probes.checked(fn)(jnp.asarray([1], I32), cache_loc=cache_loc)
    # Probes off: nothing fires, and the jaxpr has no check.
    fn(lp, cache_loc=cache_loc)
    assert "check" not in str(jax.make_jaxpr(fn)(lp, cache_loc=cache_loc))


# ---- pass A ----------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_normal_metadata_vs_loop(page_size):
    rng = np.random.default_rng(page_size)
    seq_lens = rng.integers(1, 5 * page_size + 3, size=6)
    batch = make_draft_batch(rng, seq_lens, topk=3, num_steps=3, page_size=page_size)
    row_width = batch["req_to_token"].shape[1]
    max_pages = ceil_div(row_width, page_size)
    got = draft_decode_normal_metadata(
        jnp.asarray(batch["req_to_token"]),
        jnp.asarray(batch["req_pool_indices"]),
        jnp.asarray(batch["seq_lens"]),
        geometry=geom(page_size=page_size, topk=3),
        max_pages=max_pages,
    )
    want = normal_loop(
        batch["req_to_token"],
        batch["req_pool_indices"],
        batch["seq_lens"],
        page_size=page_size,
        topk=3,
        max_pages=max_pages,
    )
    for name, value in zip(("cache_seqlens", "cu_seqlens_q", "cu_seqlens_k", "page_table"), want):
        np.testing.assert_array_equal(getattr(got, name), value, err_msg=name)


def test_normal_metadata_checks():
    rtt = jnp.zeros((3, 40), I32)
    rpi = jnp.asarray([1, 2], I32)
    fn = functools.partial(draft_decode_normal_metadata, geometry=geom(page_size=4, topk=2))
    with pytest.raises(ValueError, match=r"max_pages=11 must be an int in \[1, ceil"):
        fn(rtt, rpi, jnp.asarray([5, 9], I32), max_pages=11)
    with pytest.raises(probes.ProbeError, match="full prefix pages vs max_pages=1"):
        probes.checked(functools.partial(fn, max_pages=1))(rtt, rpi, jnp.asarray([5, 9], I32))
    # Rows and lengths of two batch sizes (both 1-D): a ValueError naming both shapes.
    with pytest.raises(
        ValueError, match=r"req_pool_indices.shape=\(2,\) and seq_lens.shape=\(3,\)"
    ):
        fn(rtt, rpi, jnp.asarray([5, 9, 1], I32), max_pages=2)
    with pytest.raises(probes.ProbeError, match="req_pool_indices"):
        probes.checked(functools.partial(fn, max_pages=4))(
            rtt, jnp.asarray([1, 3], I32), jnp.asarray([5, 9], I32)
        )


# ---- §14 worked example, FA3 at step 1 ---------------------------------------------------------
def _worked_example():
    """P=4, K=2, S=3, one request, L=7, row allocated to 40 positions (SPEC.md §14)."""
    rng = np.random.default_rng(14)
    row = np.zeros(48, I32)
    pages = rng.permutation(np.arange(1, 11))
    for k in range(10):
        row[4 * k : 4 * k + 4] = pages[k] * 4 + np.arange(4)
    req_to_token = np.stack([np.zeros(48, I32), row])
    out_cache_loc = row[[7, 8, 9, 15, 16, 17]].reshape(1, 2, 3)
    return req_to_token, row, out_cache_loc


def test_worked_example_fa3_step1():
    req_to_token, row, out_cache_loc = _worked_example()
    meta = draft_decode_metadata(
        jnp.asarray(req_to_token),
        jnp.asarray([1], I32),
        jnp.asarray([7], I32),
        jnp.asarray(out_cache_loc),
        geometry=geom(topk=2, num_steps=3, page_size=4),
        max_pages=3,
    )
    np.testing.assert_array_equal(meta.normal.cache_seqlens, [4])
    np.testing.assert_array_equal(meta.normal.cu_seqlens_q, [0, 2])
    np.testing.assert_array_equal(meta.normal.page_table, [[row[0] // 4, 0, 0]])
    step1 = 1
    np.testing.assert_array_equal(meta.expand.cache_seqlens[step1], [5, 5])
    np.testing.assert_array_equal(
        meta.expand.page_table[step1],
        [[row[7] // 4, row[8] // 4, 0], [row[15] // 4, row[16] // 4, 0]],
    )
    np.testing.assert_array_equal(meta.expand.cu_seqlens_q, [0, 1, 2])
    np.testing.assert_array_equal(meta.expand.cu_seqlens_k[step1], [0, 5, 10])


@pytest.mark.parametrize("page_size,topk,num_steps", [(1, 4, 3), (16, 8, 5), (4, 1, 4), (8, 3, 1)])
def test_draft_decode_metadata_vs_loops(interpret, page_size, topk, num_steps):
    rng = np.random.default_rng(3)
    seq_lens = rng.integers(1, 4 * page_size + 5, size=4)
    batch = make_draft_batch(rng, seq_lens, topk=topk, num_steps=num_steps, page_size=page_size)
    max_pages = ceil_div(batch["req_to_token"].shape[1], page_size)
    args = [
        jnp.asarray(batch[k])
        for k in ("req_to_token", "req_pool_indices", "seq_lens", "out_cache_loc")
    ]
    cache_loc = batch["out_cache_loc"].reshape(-1, num_steps)
    lp = batch["seq_lens"] % page_size
    for impl in ("xla", "pallas"):
        meta = draft_decode_metadata(
            *args,
            geometry=geom(topk=topk, num_steps=num_steps, page_size=page_size),
            max_pages=max_pages,
            impl=impl,
            interpret=interpret,
        )
        assert meta.expand.page_table.shape == (num_steps - 1, len(seq_lens) * topk, num_steps)
        for step in range(num_steps - 1):
            d = step + 1
            if page_size > 1:
                want_seqlens, want_table = expand_loop(
                    lp,
                    cache_loc,
                    decode_length=d,
                    topk=topk,
                    page_size=page_size,
                    width=num_steps,
                    num_cols=d,
                )
            else:  # sglang's P == 1 branch: the slots copied
                want_seqlens = np.full(cache_loc.shape[0], d)
                want_table = np.where(np.arange(num_steps) < d, cache_loc, 0)
            np.testing.assert_array_equal(meta.expand.cache_seqlens[step], want_seqlens)
            np.testing.assert_array_equal(meta.expand.page_table[step], want_table)
            np.testing.assert_array_equal(
                meta.expand.cu_seqlens_k[step], np.concatenate([[0], np.cumsum(want_seqlens)])
            )


def test_pallas_expand_lowers_for_cuda():
    """The Pallas kernel lowers to Triton IR for the GPU (cross-lowering from CPU)."""
    lp = jax.ShapeDtypeStruct((256,), jnp.int32)
    cache_loc = jax.ShapeDtypeStruct((2048, 5), jnp.int32)
    fn = functools.partial(
        draft_decode_set_expand_metadata,
        decode_length=4,
        geometry=geom(topk=8, page_size=16),
        impl="pallas",
        interpret=False,
    )
    text = jax.jit(fn).trace(lp, cache_loc=cache_loc).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
