"""set_kv_buffer's one-launch Triton kernel (``jspec.kernels.kv_write_triton``).

On CPU the kernel runs in Triton's interpreter on torch tensors (``triton_interpret``, imported
first); with ``JSPEC_TEST_GPU=1`` it runs compiled through ``jax_triton`` as
``set_kv_buffer(..., impl="triton")``. Oracle: a numpy loop over the tokens (an in-range slot
gets the row, an out-of-range one nothing, or with one token the padding slot), and the XLA
path must give the same pools; every slot the write does not touch keeps its random value.
"""

from __future__ import annotations

# isort: off
from triton_interpret import in_process, rerun_here, rerun_in_fresh_process
# isort: on

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import env
from jspec.kernels import kv_write_triton as kwt
from jspec.kv.pool import KVPool, set_kv_buffer
from jspec.sentinels import PAD_SLOT_ID

torch = pytest.importorskip("torch")

NUM_LAYERS, NUM_SLOTS, HEADS, HEAD_DIM = 3, 512, 2, 24  # rows of 48 values: not a power of 2
# (tokens, [(token, bad slot)]): one row (routed to the padding slot when out of range), a few
# rows with out-of-range slots (dropped), more rows than one program holds.
CASES = [
    pytest.param(1, [], id="one-row"),
    pytest.param(1, [(0, -3)], id="one-row-negative"),
    pytest.param(1, [(0, NUM_SLOTS)], id="one-row-past-end"),
    pytest.param(7, [], id="rows"),
    pytest.param(7, [(2, -1), (5, NUM_SLOTS + 9)], id="rows-out-of-range"),
    pytest.param(300, [(299, -7)], id="many-rows"),
]


def _case(num_tokens: int, bad: list, dtype=np.float32):
    rng = np.random.default_rng(num_tokens + 10 * len(bad))
    shape = (NUM_LAYERS, NUM_SLOTS, HEADS, HEAD_DIM)
    k_pool = rng.standard_normal(shape).astype(dtype)
    v_pool = rng.standard_normal(shape).astype(dtype)
    slots = rng.choice(np.arange(8, NUM_SLOTS), num_tokens, replace=False).astype(np.int32)
    for i, slot in bad:
        slots[i] = slot
    k = rng.standard_normal((num_tokens, HEADS, HEAD_DIM)).astype(dtype)
    v = rng.standard_normal((num_tokens, HEADS, HEAD_DIM)).astype(dtype)
    return k_pool, v_pool, slots, k, v


def _want(k_pool, v_pool, layer, slots, k, v):
    k_pool, v_pool = k_pool.copy(), v_pool.copy()
    for t, slot in enumerate(slots):
        if not 0 <= slot < NUM_SLOTS:
            if len(slots) > 1:
                continue
            slot = PAD_SLOT_ID
        k_pool[layer, slot], v_pool[layer, slot] = k[t], v[t]
    return k_pool, v_pool


def _interpreted(k_pool, v_pool, layer, slots, k, v, *, route_pad):
    num_tokens = len(slots)
    grid, meta = kwt.launch_plan(
        num_tokens, HEADS * HEAD_DIM, NUM_SLOTS, PAD_SLOT_ID, route_pad=route_pad
    )
    tk, tv = torch.tensor(k_pool), torch.tensor(v_pool)
    kwt.get_kernel()[grid](
        torch.tensor(np.stack([k, v]).reshape(2, num_tokens, -1)),
        torch.tensor(slots),
        torch.tensor([layer], dtype=torch.int32),
        tk,
        tv,
        tk,
        tv,
        num_warps=4,
        num_stages=1,
        **meta,
    )
    return tk.numpy(), tv.numpy()


def _xla(k_pool, v_pool, layer, slots, k, v, impl="xla"):
    pool = KVPool(k=jnp.asarray(k_pool), v=jnp.asarray(v_pool), page_size=16)
    out = set_kv_buffer(pool, layer, jnp.asarray(slots), jnp.asarray(k), jnp.asarray(v), impl=impl)
    return np.asarray(out.k), np.asarray(out.v)


@rerun_here
def test_rerun_in_fresh_process():
    rerun_in_fresh_process(__file__, timeout=600)


@in_process
@pytest.mark.parametrize("num_tokens,bad", CASES)
def test_interpreted_kernel_vs_numpy_and_xla(num_tokens, bad):
    k_pool, v_pool, slots, k, v = _case(num_tokens, bad)
    want = _want(k_pool, v_pool, 1, slots, k, v)
    got = _interpreted(k_pool, v_pool, 1, slots, k, v, route_pad=num_tokens == 1)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    for x, w in zip(_xla(k_pool, v_pool, 1, slots, k, v), want, strict=True):
        np.testing.assert_array_equal(x, w)  # the XLA path writes the same pools


@in_process
def test_interpreted_one_row_without_route_pad_misses_the_padding_slot():
    """The mutant the one-row cases must catch: an out-of-range row dropped, not routed."""
    k_pool, v_pool, slots, k, v = _case(1, [(0, -3)])
    want = _want(k_pool, v_pool, 2, slots, k, v)
    got = _interpreted(k_pool, v_pool, 2, slots, k, v, route_pad=False)
    assert not np.array_equal(got[0], want[0])


def test_launch_plan():
    grid, meta = kwt.launch_plan(1, 1024, 4096, 0, True)
    assert grid == (1, 1) and meta["BLOCK_C"] == 1024 and meta["ROUTE_PAD"]
    grid, meta = kwt.launch_plan(512, 1024, 4096, 0, False)  # 4 rows of 1024 per program
    assert grid == (128, 1) and meta["BLOCK_T"] == 4
    grid, meta = kwt.launch_plan(3, 3 * kwt.TILE, 64, 0, False)  # a row wider than a tile
    assert grid == (3, 3) and meta["BLOCK_C"] == kwt.TILE and meta["BLOCK_T"] == 1


def test_bad_impl_is_a_value_error():
    k_pool, v_pool, slots, k, v = _case(1, [])
    with pytest.raises(ValueError, match="impl"):
        _xla(k_pool, v_pool, 0, slots, k, v, impl="pallas")
    if not env.TEST_GPU:
        with pytest.raises(ValueError, match="GPU"):
            _xla(k_pool, v_pool, 0, slots, k, v, impl="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not env.TEST_GPU, reason="needs JSPEC_TEST_GPU=1 and a GPU")
@pytest.mark.parametrize("num_tokens,bad", CASES)
def test_compiled_kernel_vs_xla_on_gpu(num_tokens, bad):
    k_pool, v_pool, slots, k, v = _case(num_tokens, bad, dtype=jnp.bfloat16)
    want = _xla(k_pool, v_pool, 2, slots, k, v)
    got = _xla(k_pool, v_pool, 2, slots, k, v, impl="triton")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.gpu
@pytest.mark.skipif(not env.TEST_GPU, reason="needs JSPEC_TEST_GPU=1 and a GPU")
def test_compiled_kernel_writes_in_place_on_gpu():
    k_pool, v_pool, slots, k, v = _case(8, [], dtype=jnp.bfloat16)
    pool = KVPool(k=jnp.asarray(k_pool), v=jnp.asarray(v_pool), page_size=16)
    ptrs = pool.k.unsafe_buffer_pointer(), pool.v.unsafe_buffer_pointer()
    out = set_kv_buffer(pool, 0, jnp.asarray(slots), jnp.asarray(k), jnp.asarray(v), impl="triton")
    jax.block_until_ready(out.k)
    assert (out.k.unsafe_buffer_pointer(), out.v.unsafe_buffer_pointer()) == ptrs
