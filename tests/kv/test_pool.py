"""KVPool: init, set_kv_buffer, get_kv, pytree structure, static checks and probes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import probes
from jspec.config import SpecConfig
from jspec.kv.pool import KVPool, get_kv, init_kv_pool, set_kv_buffer

POISON = -7.0
CFG = SpecConfig(
    page_size=4,
    num_pages=8,
    num_layers=3,
    num_kv_heads=2,
    head_dim=8,
    dtype="float32",
    context_len=64,
)


def _rows(rng, t, cfg=CFG):
    shape = (t, cfg.num_kv_heads, cfg.head_dim)
    return (
        rng.standard_normal(shape).astype(np.float32),
        rng.standard_normal(shape).astype(np.float32),
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_init_shapes_and_fill(dtype):
    cfg = SpecConfig(
        page_size=16,
        num_pages=4,
        num_layers=2,
        num_kv_heads=2,
        head_dim=4,
        dtype=dtype,
        context_len=64,
    )
    pool = init_kv_pool(cfg, fill=POISON)
    assert pool.k.shape == pool.v.shape == (2, 4 * 16 + 16, 2, 4)
    assert pool.k.dtype == pool.v.dtype == jnp.dtype(dtype)
    assert pool.page_size == 16 and pool.num_slots == cfg.num_slots and pool.size == 64
    assert pool.num_layers == 2
    assert np.all(np.asarray(pool.k, np.float32) == POISON)
    assert np.all(np.asarray(pool.v, np.float32) == POISON)


def test_pytree_structure():
    pool = init_kv_pool(CFG)
    leaves, treedef = jax.tree.flatten(pool)
    assert len(leaves) == 2
    assert jax.tree.unflatten(treedef, leaves).page_size == CFG.page_size
    # page_size is static: a jitted identity keeps it as a Python int.
    out = jax.jit(lambda p: p)(pool)
    assert isinstance(out, KVPool) and out.page_size == CFG.page_size


def test_set_kv_buffer_writes_only_given_slots():
    rng = np.random.default_rng(0)
    pool = init_kv_pool(CFG, fill=POISON)
    slots = np.array([5, 17, 4, 30], np.int32)
    k, v = _rows(rng, len(slots))
    out = set_kv_buffer(pool, 1, jnp.asarray(slots), jnp.asarray(k), jnp.asarray(v))
    want_k = np.full(out.k.shape, POISON, np.float32)
    want_v = want_k.copy()
    want_k[1, slots], want_v[1, slots] = k, v
    np.testing.assert_array_equal(np.asarray(out.k), want_k)
    np.testing.assert_array_equal(np.asarray(out.v), want_v)


@pytest.mark.parametrize("slot", [5, CFG.num_slots - 1, 0], ids=["mid", "last", "pad"])
def test_set_kv_buffer_one_row_is_the_scatter(slot):
    """A decode row takes a bare dynamic-update-slice; it writes what the scatter writes
    (the last slot, the padding page)."""
    rng = np.random.default_rng(7)
    k, v = _rows(rng, 1)
    one = set_kv_buffer(
        init_kv_pool(CFG, fill=POISON), 2, jnp.asarray([slot]), jnp.asarray(k), jnp.asarray(v)
    )
    pool = init_kv_pool(CFG, fill=POISON)
    want_k = pool.k.at[2, jnp.asarray([slot])].set(jnp.asarray(k))
    want_v = pool.v.at[2, jnp.asarray([slot])].set(jnp.asarray(v))
    np.testing.assert_array_equal(np.asarray(one.k), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(one.v), np.asarray(want_v))
    assert np.asarray(one.k)[2, slot].tolist() == k[0].tolist()


@pytest.mark.parametrize("num_rows", [1, 3], ids=["one_row", "rows"])
@pytest.mark.parametrize(
    "slot", [CFG.num_slots, CFG.num_slots + 3, -1, -3], ids=["end", "past", "minus1", "neg"]
)
def test_set_kv_buffer_out_of_range_writes_no_real_slot(slot, num_rows):
    """Issue 22: an out-of-range (or negative) slot wrote the last real slot (another request's
    KV; the one-row dynamic-update-slice clamps) or wrapped; now it writes no real slot (rows:
    dropped; one row: routed to the padding page, a write sink), the other rows as given."""
    rng = np.random.default_rng(3)
    k, v = _rows(rng, num_rows)
    slots = np.array([slot, 9, 5][:num_rows], np.int32)
    pool = init_kv_pool(CFG, fill=POISON)
    out = set_kv_buffer(pool, 1, jnp.asarray(slots), jnp.asarray(k), jnp.asarray(v))
    want_k = np.full(out.k.shape, POISON, np.float32)
    want_v = want_k.copy()
    want_k[1, slots[1:]], want_v[1, slots[1:]] = k[1:], v[1:]
    real = slice(CFG.page_size, None)  # every slot but the padding page
    np.testing.assert_array_equal(np.asarray(out.k)[:, real], want_k[:, real])
    np.testing.assert_array_equal(np.asarray(out.v)[:, real], want_v[:, real])


def test_set_kv_buffer_one_row_stays_a_bare_update():
    """The range routing is scalar work: the one-row write is still a dynamic-update-slice per
    buffer, no scatter (pool.py's NOTE)."""
    rows = jnp.zeros((1, CFG.num_kv_heads, CFG.head_dim))
    fn = jax.jit(lambda p, s: set_kv_buffer(p, 1, s, rows, rows))
    hlo = fn.lower(init_kv_pool(CFG), jnp.asarray([3], jnp.int32)).compile().as_text()
    assert "scatter" not in hlo and hlo.count("dynamic-update-slice(") == 2


def test_get_kv_out_of_range_reads_no_real_slot():
    """Issue 22: get_kv clamped an out-of-range slot onto the last real slot; now NaN."""
    rng = np.random.default_rng(4)
    k, v = _rows(rng, 2)
    pool = set_kv_buffer(
        init_kv_pool(CFG), 0, jnp.asarray([CFG.num_slots - 1, 5]), jnp.asarray(k), jnp.asarray(v)
    )
    gk, gv = get_kv(pool, 0, jnp.asarray([CFG.num_slots, -1, 5], jnp.int32))
    assert np.isnan(np.asarray(gk)[:2]).all() and np.isnan(np.asarray(gv)[:2]).all()
    np.testing.assert_array_equal(np.asarray(gk)[2], k[1])


def test_set_kv_buffer_casts_and_get_kv_roundtrip():
    rng = np.random.default_rng(1)
    cfg = SpecConfig(
        page_size=4,
        num_pages=8,
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        dtype="bfloat16",
        context_len=64,
    )
    pool = init_kv_pool(cfg, fill=POISON)
    slots = jnp.asarray([6, 7, 8], jnp.int32)
    k, v = _rows(rng, 3, cfg)
    out = set_kv_buffer(pool, 0, slots, jnp.asarray(k), jnp.asarray(v))
    assert out.k.dtype == jnp.bfloat16
    gk, gv = get_kv(out, 0, slots)
    np.testing.assert_array_equal(np.asarray(gk), np.asarray(jnp.asarray(k, jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(gv), np.asarray(jnp.asarray(v, jnp.bfloat16)))
    # The other layer keeps the poison.
    ok, ov = get_kv(out, 1, slots)
    assert np.all(np.asarray(ok, np.float32) == POISON)
    assert np.all(np.asarray(ov, np.float32) == POISON)


def test_set_kv_buffer_inside_jit_and_donation():
    rng = np.random.default_rng(2)
    pool = init_kv_pool(CFG, fill=POISON)
    k, v = _rows(rng, 2)

    @jax.jit
    def step(p):
        return set_kv_buffer(p, 2, jnp.asarray([9, 10]), jnp.asarray(k), jnp.asarray(v))

    out = step(pool)
    np.testing.assert_array_equal(np.asarray(out.k[2, 9:11]), k)
    out2 = set_kv_buffer(out, 0, jnp.asarray([1]), jnp.asarray(k[:1]), jnp.asarray(v[:1]))
    assert out.k.is_deleted() and not out2.k.is_deleted()


def test_static_checks():
    pool = init_kv_pool(CFG)
    rows = jnp.zeros((2, CFG.num_kv_heads, CFG.head_dim))
    slots = jnp.asarray([1, 2])
    with pytest.raises(ValueError, match="layer=3"):
        set_kv_buffer(pool, 3, slots, rows, rows)
    with pytest.raises(ValueError, match="k.shape"):
        set_kv_buffer(pool, 0, slots, rows[:1], rows)
    with pytest.raises(ValueError, match="slot_ids.dtype"):
        set_kv_buffer(pool, 0, slots.astype(jnp.float32), rows, rows)
    with pytest.raises(ValueError, match="layer=-1"):
        get_kv(pool, -1, slots)


def test_set_kv_buffer_probe_fires():
    pool = init_kv_pool(CFG)
    rows = jnp.zeros((2, CFG.num_kv_heads, CFG.head_dim))
    bad = jnp.asarray([1, CFG.num_slots], jnp.int32)
    fn = probes.checked(lambda p, s: set_kv_buffer(p, 0, s, rows, rows))
    with pytest.raises(
        probes.ProbeError, match=rf"set_kv_buffer: slot_ids out of range.*{CFG.num_slots}"
    ):
        fn(pool, bad)


def test_get_kv_probe_fires():
    pool = init_kv_pool(CFG)
    fn = probes.checked(lambda p, s: get_kv(p, 0, s))
    with pytest.raises(probes.ProbeError, match=r"get_kv: slot_ids out of range.*-3"):
        fn(pool, jnp.asarray([-3, 1], jnp.int32))


def test_probes_off_add_nothing():
    pool = init_kv_pool(CFG)
    rows = jnp.zeros((2, CFG.num_kv_heads, CFG.head_dim))
    slots = jnp.asarray([1, 2], jnp.int32)
    assert not probes.probes_on()
    off = str(jax.make_jaxpr(lambda p, s: set_kv_buffer(p, 0, s, rows, rows))(pool, slots))
    assert "check" not in off
    with probes.probes_enabled():
        on = str(jax.make_jaxpr(lambda p, s: set_kv_buffer(p, 0, s, rows, rows))(pool, slots))
    assert "check" in on
