"""move_kv_cache: kernels vs the reference vs an independent numpy gather-then-scatter."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jspec import env, probes
from jspec.kernels import move_kv_cache as mkc
from jspec.kernels import move_kv_plan
from jspec.kv.pool import KVPool, move_kv_cache, move_kv_cache_reference

ON_GPU = env.TEST_GPU
KERNEL_IMPLS = ("pallas",) + (("triton",) if ON_GPU else ())
# Small tunings so that tiny shapes still span several row blocks (stash pass) and column
# tiles, or one row block for every pair.
SMALL = {"block_rows": 4, "block_elems": 64, "single_block_rows": 1}
TUNINGS = {
    "multi_block": SMALL,
    "single_block": {"block_rows": 4, "block_elems": 512, "single_block_rows": 64},
}
NUM_LAYERS, HEADS, HEAD_DIM = 2, 2, 8


def _pool(
    rng,
    num_slots,
    dtype=np.float32,
    page_size=4,
    num_layers=NUM_LAYERS,
    heads=HEADS,
    head_dim=HEAD_DIM,
) -> tuple[KVPool, np.ndarray, np.ndarray]:
    """A pool poisoned with distinct random values (every row distinguishable)."""
    shape = (num_layers, num_slots, heads, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32) + 100.0
    pool = KVPool(k=jnp.asarray(k, dtype), v=jnp.asarray(v, dtype), page_size=page_size)
    return pool, np.asarray(pool.k), np.asarray(pool.v)


def _numpy_move(k: np.ndarray, tgt, src) -> np.ndarray:
    """Independent oracle: gather every source row first, then scatter (a python loop)."""
    out = k.copy()
    rows = [k[:, s].copy() for s in src]
    for t, row in zip(tgt, rows):
        out[:, t] = row
    return out


def _run(pool, tgt, src, impl, interpret, **tuning):
    tgt = jnp.asarray(np.asarray(tgt, np.int32))
    src = jnp.asarray(np.asarray(src, np.int32))
    if impl == "xla":
        return move_kv_cache(pool, tgt, src, impl="xla")
    return move_kv_cache(
        pool, tgt, src, impl=impl, interpret=interpret if impl == "pallas" else None, **tuning
    )


def _assert_moved(out, k, v, tgt, src):
    np.testing.assert_array_equal(np.asarray(out.k), _numpy_move(k, tgt, src))
    np.testing.assert_array_equal(np.asarray(out.v), _numpy_move(v, tgt, src))


# ---- kernel vs reference on random distinct targets -----------------------------------------
@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
def test_random_pairs_match_reference(impl, page_size, interpret):
    rng = np.random.default_rng(page_size)
    num_slots = 8 * page_size + page_size
    n = min(13, num_slots - page_size)
    slots = rng.permutation(np.arange(page_size, num_slots))
    tgt, src = slots[:n], rng.integers(0, num_slots, size=n)
    pool, k, v = _pool(rng, num_slots, page_size=page_size)
    want = jax.jit(move_kv_cache_reference)(
        pool, jnp.asarray(tgt, jnp.int32), jnp.asarray(src, jnp.int32)
    )
    out = _run(pool, tgt, src, impl, interpret, **SMALL)
    np.testing.assert_array_equal(np.asarray(out.k), np.asarray(want.k))
    np.testing.assert_array_equal(np.asarray(out.v), np.asarray(want.v))
    _assert_moved(out, k, v, tgt, src)


def test_reference_matches_numpy():
    rng = np.random.default_rng(0)
    pool, k, v = _pool(rng, 40)
    tgt, src = [1, 2, 3, 4, 9], [0, 1, 2, 3, 9]
    out = move_kv_cache_reference(pool, jnp.asarray(tgt), jnp.asarray(src))
    _assert_moved(out, k, v, tgt, src)


# ---- overlap (gather-then-scatter), padding pairs -------------------------------------------
OVERLAP_CASES = {
    "reverse_shift": ([1, 2, 3, 4], [0, 1, 2, 3]),  # sglang's test
    "forward_shift": ([0, 1, 2, 3], [1, 2, 3, 4]),
    "self_copy": ([5, 6, 7], [5, 6, 7]),
    "swap": ([5, 9], [9, 5]),
    "cycle": ([5, 6, 7, 8], [6, 7, 8, 5]),
    "long_reverse_shift": (list(range(9, 40)), list(range(8, 39))),  # spans row blocks
    "long_forward_shift": (list(range(8, 39)), list(range(9, 40))),
    "chain_across_blocks": (
        [10, 20, 30, 11, 21, 31, 12, 22, 32],
        [20, 30, 40, 21, 31, 41, 22, 32, 42],
    ),
    "padding_pairs": ([0, 0, 7, 0, 8, 0, 0], [0, 0, 12, 0, 13, 0, 0]),
    "padding_mixed_overlap": ([0, 3, 4, 0, 5, 0], [0, 4, 5, 0, 6, 0]),
}


@pytest.mark.parametrize(
    "impl,tuning", [("xla", "-")] + [(i, t) for i in KERNEL_IMPLS for t in TUNINGS]
)
@pytest.mark.parametrize("case", list(OVERLAP_CASES))
def test_overlap_cases(impl, tuning, case, interpret):
    if impl == "xla" and not interpret:
        pytest.skip("xla has no compiled/interpret variants")
    tgt, src = OVERLAP_CASES[case]
    rng = np.random.default_rng(1)
    pool, k, v = _pool(rng, 48)
    out = _run(pool, tgt, src, impl, interpret, **TUNINGS.get(tuning, {}))
    _assert_moved(out, k, v, tgt, src)


@pytest.mark.parametrize("dense_max", [0, 4096])
def test_pair_modes_stash_only_cross_block_sources(dense_max):
    tgt = jnp.asarray([1, 2, 3, 4, 5, 6, 0, 0], jnp.int32)
    src = jnp.asarray([2, 3, 4, 5, 6, 7, 0, 0], jnp.int32)
    modes = np.asarray(move_kv_plan.pair_modes(tgt, src, 16, 4, dense_max=dense_max))
    # block 0 = pairs 0..3 writes 1..4; block 1 writes 5, 6. Pair 3 reads 5 (block 1): stash.
    np.testing.assert_array_equal(modes, [1, 1, 1, 2, 1, 1, 0, 0])


def _numpy_modes(tgt, src, block_rows):
    modes = []
    for j, (t, s) in enumerate(zip(tgt, src)):
        if t == s:
            modes.append(move_kv_plan.MODE_SKIP)
            continue
        cross = any(
            ti == s and ti != si and i // block_rows != j // block_rows
            for i, (ti, si) in enumerate(zip(tgt, src))
        )
        modes.append(move_kv_plan.MODE_STASH if cross else move_kv_plan.MODE_DIRECT)
    return modes


@settings(max_examples=12)
@given(data=st.data())
def test_property_pair_modes_dense_and_scatter_agree(data):
    n = data.draw(st.sampled_from([5, 16]))
    tgt = data.draw(st.lists(st.integers(0, 15), min_size=n, max_size=n))  # duplicates too
    src = data.draw(st.lists(st.integers(0, 15), min_size=n, max_size=n))
    block_rows = data.draw(st.sampled_from([2, 4]))
    want = _numpy_modes(tgt, src, block_rows)
    for dense_max in (0, 4096):
        got = move_kv_plan.pair_modes(
            jnp.asarray(tgt, jnp.int32),
            jnp.asarray(src, jnp.int32),
            16,
            block_rows,
            dense_max=dense_max,
        )
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_padding_page_untouched_by_padding_pairs(impl, interpret):
    rng = np.random.default_rng(2)
    pool, k, v = _pool(rng, 24, page_size=4)
    out = _run(pool, [0, 0, 9, 0], [0, 0, 11, 0], impl, interpret)
    np.testing.assert_array_equal(np.asarray(out.k)[:, :4], k[:, :4])
    _assert_moved(out, k, v, [9], [11])


# ---- edge shapes and dtypes ------------------------------------------------------------------
@pytest.mark.parametrize("impl", ("xla",) + KERNEL_IMPLS)
def test_empty_and_zero_layers_are_noops(impl, interpret):
    rng = np.random.default_rng(3)
    pool, k, _ = _pool(rng, 16)
    out = _run(pool, [], [], impl, interpret)
    np.testing.assert_array_equal(np.asarray(out.k), k)
    empty, _, _ = _pool(rng, 16, num_layers=0)
    out = _run(empty, [1, 2], [3, 4], impl, interpret)
    assert out.k.shape == (0, 16, HEADS, HEAD_DIM)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_dtypes(impl, dtype, interpret):
    rng = np.random.default_rng(4)
    pool, k, v = _pool(rng, 40, dtype=dtype)
    tgt, src = [3, 4, 5, 20, 21], [4, 5, 6, 30, 3]
    out = _run(pool, tgt, src, impl, interpret, **SMALL)
    assert out.k.dtype == dtype
    _assert_moved(out, k, v, tgt, src)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_ragged_row_width(impl, interpret):
    """H*D = 3*5 = 15 columns: column tiles have masked tails."""
    rng = np.random.default_rng(5)
    pool, k, v = _pool(rng, 32, heads=3, head_dim=5)
    tgt, src = [1, 2, 3, 4, 5, 6, 7], [2, 3, 4, 5, 6, 7, 8]
    out = _run(pool, tgt, src, impl, interpret, block_rows=2, block_elems=16, single_block_rows=1)
    _assert_moved(out, k, v, tgt, src)


def test_int_locs_and_default_impl():
    rng = np.random.default_rng(6)
    pool, k, v = _pool(rng, 20)
    tgt, src = np.array([5, 6], np.int32), np.array([7, 8], np.int32)
    out = move_kv_cache(pool, jnp.asarray(tgt), jnp.asarray(src))  # impl="xla" (the default)
    _assert_moved(out, k, v, tgt, src)


def test_pool_is_donated():
    rng = np.random.default_rng(7)
    pool, _, _ = _pool(rng, 20)
    out = move_kv_cache(pool, jnp.asarray([5]), jnp.asarray([6]), impl="xla")
    assert pool.k.is_deleted() and not out.k.is_deleted()


@pytest.mark.skipif(not ON_GPU, reason="in-place pallas update checked on the GPU")
@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_kernel_updates_in_place(impl):
    rng = np.random.default_rng(8)
    pool, _, _ = _pool(rng, 4096, dtype=jnp.bfloat16)
    ptr = pool.k.unsafe_buffer_pointer()
    out = move_kv_cache(pool, jnp.arange(1, 65), jnp.arange(100, 164), impl=impl)
    assert out.k.unsafe_buffer_pointer() == ptr


# ---- hypothesis: arbitrary overlap ------------------------------------------------------------
@settings(max_examples=8)
@given(data=st.data())
def test_property_arbitrary_pairs(data):
    # Real pairs never target the padding slot 0 (interpret mode writes masked-out tail rows
    # back to slot 0, racing a real write there; compiled masked stores write nothing).
    num_slots = 24
    n = data.draw(st.sampled_from([3, 9]))
    tgt = data.draw(st.lists(st.integers(1, num_slots - 1), min_size=n, max_size=n, unique=True))
    src = data.draw(st.lists(st.integers(0, num_slots - 1), min_size=n, max_size=n))
    pads = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    tgt = [0 if pad else t for t, pad in zip(tgt, pads)]
    src = [0 if pad else s for s, pad in zip(src, pads)]
    block_rows = data.draw(st.sampled_from([1, 2, 4]))
    rng = np.random.default_rng(9)
    pool, k, v = _pool(rng, num_slots)
    single = data.draw(st.sampled_from([1, 16]))
    out = _run(
        pool,
        tgt,
        src,
        "pallas",
        True,
        block_rows=block_rows,
        block_elems=32,
        single_block_rows=single,
    )
    _assert_moved(out, k, v, tgt, src)


# ---- static checks and probes -----------------------------------------------------------------
def test_static_checks():
    rng = np.random.default_rng(10)
    pool, _, _ = _pool(rng, 16)
    idx = jnp.asarray([1, 2], jnp.int32)
    with pytest.raises(ValueError, match="impl='nope'"):
        move_kv_cache(pool, idx, idx, impl="nope")
    with pytest.raises(ValueError, match="tgt_slot_ids.shape"):
        move_kv_cache(pool, idx[:1], idx, impl="xla")
    with pytest.raises(ValueError, match="src_slot_ids.dtype"):
        move_kv_cache(pool, idx, idx.astype(jnp.float32), impl="xla")
    with pytest.raises(ValueError, match="block_rows=3"):
        move_kv_cache(pool, idx, idx, impl="pallas", block_rows=3)


@pytest.mark.parametrize("which,bad", [("tgt", 16), ("src", -1)])
def test_probe_fires_on_out_of_range(which, bad):
    rng = np.random.default_rng(11)
    pool, _, _ = _pool(rng, 16)
    good = jnp.asarray([1, 2], jnp.int32)
    badv = jnp.asarray([3, bad], jnp.int32)
    tgt, src = (badv, good) if which == "tgt" else (good, badv)
    fn = probes.checked(move_kv_cache_traced)
    with pytest.raises(probes.ProbeError, match=rf"{which}_slot_ids out of range.*{bad}"):
        fn(pool, tgt, src)


def move_kv_cache_traced(pool, tgt, src):
    return move_kv_cache(pool, tgt, src, impl="xla")


def test_probes_off_add_nothing():
    rng = np.random.default_rng(12)
    pool, _, _ = _pool(rng, 16)
    tgt, src = jnp.asarray([3, 99], jnp.int32), jnp.asarray([1, 2], jnp.int32)
    assert not probes.probes_on()
    off = str(jax.make_jaxpr(move_kv_cache_traced)(pool, tgt, src))
    assert "check" not in off
    with probes.probes_enabled():
        on = str(jax.make_jaxpr(move_kv_cache_traced)(pool, tgt, src))
    assert "check" in on
    # Probes off: out-of-range input runs without raising (as sglang without async asserts).
    jax.block_until_ready(move_kv_cache(pool, tgt, src, impl="xla"))


# ---- the raw Triton source, interpreted on CPU torch tensors ---------------------------------
def test_triton_source_in_interpreter(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = pathlib.Path(mkc.__file__).with_name("move_kv_cache_triton.py")
    spec = importlib.util.spec_from_file_location("_move_kv_cache_triton_interp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    num_layers, num_slots, width = 2, 48, 12
    rng = np.random.default_rng(13)
    k = rng.standard_normal((num_layers, num_slots, width)).astype(np.float32)
    v = k + 1.0
    tgt = np.array(list(range(9, 30)) + [0, 0, 40], np.int32)
    src = np.array(list(range(8, 29)) + [0, 0, 41], np.int32)
    n = len(tgt)
    rows, cols, n_pad, num_col_tiles = move_kv_plan.plan_blocks(
        n, width, block_rows=4, block_elems=32, single_block_rows=1
    )
    mode = np.asarray(move_kv_plan.pair_modes(jnp.asarray(tgt), jnp.asarray(src), num_slots, rows))
    assert (mode == move_kv_plan.MODE_STASH).any()
    tk, tv = torch.tensor(k), torch.tensor(v)
    sk = torch.full((num_layers, n_pad, width), float("nan"))
    sv = sk.clone()
    grid = (num_layers, n_pad // rows, num_col_tiles)
    static = {
        "N": n,
        "NUM_SLOTS": num_slots,
        "N_PAD": n_pad,
        "ROW_WIDTH": width,
        "BLOCK_ROWS": rows,
        "BLOCK_COLS": cols,
    }
    t_t, s_t, m_t = (torch.tensor(a) for a in (tgt, src, mode))
    mod.stash_kv_rows_kernel[grid](s_t, m_t, tk, tv, sk, sv, **static)
    mod.move_kv_rows_kernel[grid](t_t, s_t, m_t, sk, sv, tk, tv, tk, tv, STASHED=True, **static)
    np.testing.assert_array_equal(tk.numpy(), _numpy_move(k, tgt, src))
    np.testing.assert_array_equal(tv.numpy(), _numpy_move(v, tgt, src))
    # One row block, no stash: the kernel derives skip/direct from tgt != src itself.
    tk, tv = torch.tensor(k), torch.tensor(v)
    rows, cols, n_pad, num_col_tiles = move_kv_plan.plan_blocks(
        n, width, block_rows=4, block_elems=128, single_block_rows=32
    )
    static.update(N_PAD=n_pad, BLOCK_ROWS=rows, BLOCK_COLS=cols)
    mod.move_kv_rows_kernel[(num_layers, 1, num_col_tiles)](
        t_t, s_t, s_t, sk, sv, tk, tv, tk, tv, STASHED=False, **static
    )
    np.testing.assert_array_equal(tk.numpy(), _numpy_move(k, tgt, src))
    np.testing.assert_array_equal(tv.numpy(), _numpy_move(v, tgt, src))
