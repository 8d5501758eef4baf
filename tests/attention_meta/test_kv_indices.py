"""FlashInfer draft-decode kv_indices / kv_indptr (SPEC.md §6.1, §14).

Oracle: ``kv_indices_loop`` (a sequential loop with a running write cursor, written from the
SPEC pseudo-code), independent of the closed form used by jspec.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attn_meta_cases import kv_indices_loop, make_draft_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from jspec import probes
from jspec.attention_meta.kv_indices import (
    draft_kv_indices_used_len,
    generate_draft_decode_kv_indices,
)
from jspec.config import SpecConfig
from jspec.kernels.draft_kv_indices import draft_kv_indices_reference
from tree_geometry import geom, with_geometry

I32 = np.int32
POISON = -7


def _args(batch):
    return (
        jnp.asarray(batch["req_pool_indices"]),
        jnp.asarray(batch["req_to_token"]),
        jnp.asarray(batch["seq_lens"]),
    )


def _loop(batch, **kw):
    return kv_indices_loop(
        batch["req_to_token"], batch["req_pool_indices"], batch["seq_lens"], **kw
    )


def test_worked_example_step1():
    """SPEC.md §14: P=4, K=2, S=3, L=7; FlashInfer at step 1."""
    rng = np.random.default_rng(14)
    row = np.zeros(48, I32)
    pages = rng.permutation(np.arange(1, 11))
    for k in range(10):
        row[4 * k : 4 * k + 4] = pages[k] * 4 + np.arange(4)
    req_to_token = jnp.asarray(np.stack([np.zeros(48, I32), row]))
    kv_indices, kv_indptr = generate_draft_decode_kv_indices(
        jnp.asarray([1], I32),
        req_to_token,
        jnp.asarray([7], I32),
        geometry=geom(topk=2, num_steps=3, page_size=4),
        kv_indices_width=SpecConfig(
            page_size=4, topk=2, num_steps=3, num_draft_tokens=4, context_len=48
        ).kv_indices_width(1),
    )
    np.testing.assert_array_equal(kv_indptr[1], [0, 9, 18])
    np.testing.assert_array_equal(kv_indices[1, 0:9], np.concatenate([row[0:7], row[[7, 8]]]))
    np.testing.assert_array_equal(kv_indices[1, 9:18], np.concatenate([row[0:7], row[[15, 16]]]))
    assert not np.any(kv_indices[1, 18:])
    # Step 0 / step 2 rows: one / three draft slots per branch.
    np.testing.assert_array_equal(kv_indptr[0], [0, 8, 16])
    np.testing.assert_array_equal(kv_indptr[2], [0, 10, 20])
    np.testing.assert_array_equal(kv_indices[2, 17:20], row[[15, 16, 17]])


@pytest.mark.parametrize(
    "page_size,topk,num_steps", [(1, 1, 3), (1, 4, 3), (4, 1, 4), (4, 2, 3), (16, 8, 5), (64, 3, 2)]
)
def test_random_vs_loop_all_impls(interpret, page_size, topk, num_steps):
    rng = np.random.default_rng(page_size + 10 * topk + 100 * num_steps)
    seq_lens = rng.integers(0, 3 * page_size + 20, size=4)
    batch = make_draft_batch(rng, seq_lens, topk=topk, num_steps=num_steps, page_size=page_size)
    width = int(draft_kv_indices_used_len(seq_lens.sum(), topk, 4 * topk, num_steps)) + 13
    want = _loop(batch, topk=topk, num_steps=num_steps, page_size=page_size, width=width)
    for impl in ("xla", "pallas"):
        got = generate_draft_decode_kv_indices(
            *_args(batch),
            geometry=geom(topk=topk, num_steps=num_steps, page_size=page_size),
            kv_indices_width=width,
            impl=impl,
            interpret=interpret,
            block_tokens=16,
        )
        np.testing.assert_array_equal(got[1], want[1], err_msg=f"{impl} kv_indptr")
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"{impl} kv_indices")
        used = want[1][:, -1]
        np.testing.assert_array_equal(
            used,
            [
                draft_kv_indices_used_len(int(seq_lens.sum()), topk, 4 * topk, i + 1)
                for i in range(num_steps)
            ],
        )


def test_buffer_in_place_keeps_poison_past_used_len(interpret):
    rng = np.random.default_rng(5)
    topk, num_steps, page_size = 3, 4, 4
    batch = make_draft_batch(rng, [9, 1, 14], topk=topk, num_steps=num_steps, page_size=page_size)
    width = 200
    buffer = jnp.full((num_steps, width), POISON, jnp.int32)
    want = _loop(
        batch, topk=topk, num_steps=num_steps, page_size=page_size, width=width, fill=POISON
    )
    for impl in ("xla", "pallas"):
        got = generate_draft_decode_kv_indices(
            *_args(batch),
            geometry=geom(topk=topk, num_steps=num_steps, page_size=page_size),
            kv_indices_width=width,
            kv_indices_buffer=buffer,
            impl=impl,
            interpret=interpret,
            block_tokens=8,
        )
        np.testing.assert_array_equal(got[0], want[0], err_msg=impl)
        np.testing.assert_array_equal(got[1], want[1], err_msg=impl)
        used = want[1][:, -1]
        for i in range(num_steps):
            assert np.all(np.asarray(got[0][i, : used[i]]) != POISON)  # every live entry written
            assert np.all(np.asarray(got[0][i, used[i] :]) == POISON)  # nothing past it


@settings(max_examples=15)
@given(
    data=st.data(),
    page_size=st.sampled_from([1, 2, 4, 16, 64]),
    topk=st.integers(1, 4),
    num_steps=st.integers(1, 5),
)
def test_hypothesis_reference_vs_loop(data, page_size, topk, num_steps):
    seq_lens = data.draw(st.lists(st.integers(0, 3 * page_size + 9), min_size=1, max_size=5))
    rng = np.random.default_rng(sum(seq_lens) * 7 + topk)
    batch = make_draft_batch(rng, seq_lens, topk=topk, num_steps=num_steps, page_size=page_size)
    need = int(draft_kv_indices_used_len(sum(seq_lens), topk, len(seq_lens) * topk, num_steps))
    width = need + data.draw(st.integers(0, 5))
    got = generate_draft_decode_kv_indices(
        *_args(batch),
        geometry=geom(topk=topk, num_steps=num_steps, page_size=page_size),
        kv_indices_width=width,
    )
    want = _loop(batch, topk=topk, num_steps=num_steps, page_size=page_size, width=width)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_empty_batch(interpret):
    for impl in ("xla", "pallas"):
        kv_indices, kv_indptr = generate_draft_decode_kv_indices(
            jnp.zeros((0,), I32),
            jnp.zeros((2, 16), I32),
            jnp.zeros((0,), I32),
            geometry=geom(topk=4, num_steps=3, page_size=4),
            kv_indices_width=32,
            impl=impl,
            interpret=interpret,
        )
        assert kv_indices.shape == (3, 32) and kv_indptr.shape == (3, 1)
        assert not np.any(kv_indices) and not np.any(kv_indptr)


def test_static_width_checks():
    rpi = jnp.asarray([1, 2], I32)
    rtt = jnp.zeros((3, 64), I32)
    seq_lens = jnp.asarray([10, 20], I32)
    fn = functools.partial(
        generate_draft_decode_kv_indices, geometry=geom(topk=4, num_steps=5, page_size=16)
    )
    with pytest.raises(ValueError, match="kv_indices row too small \\(draft slots alone\\)"):
        jax.eval_shape(functools.partial(fn, kv_indices_width=39), rpi, rtt, seq_lens)
    with pytest.raises(
        ValueError, match="too small for max_seq_len.*needs 200 but buffer holds 199"
    ):
        fn(rpi, rtt, seq_lens, kv_indices_width=199, max_seq_len=20)
    fn(rpi, rtt, seq_lens, kv_indices_width=200, max_seq_len=20)
    with pytest.raises(ValueError, match="B=2 exceeds max_bs=1"):
        fn(rpi, rtt, seq_lens, kv_indices_width=1000, max_bs=1)
    with pytest.raises(ValueError, match="kv_indices_buffer.shape"):
        fn(rpi, rtt, seq_lens, kv_indices_width=100, kv_indices_buffer=jnp.zeros((5, 99), I32))
    with pytest.raises(ValueError, match="page_size=3 must be a power of 2"):
        generate_draft_decode_kv_indices(
            rpi,
            rtt,
            seq_lens,
            geometry=geom(topk=4, num_steps=5, page_size=3),
            kv_indices_width=1000,
        )
    with pytest.raises(ValueError, match="impl='cuda' is not available"):
        fn(rpi, rtt, seq_lens, kv_indices_width=1000, impl="cuda")


def test_overflow_probe_and_masked_writes(interpret):
    """Used length > W: the probe names it; with probes off nothing is written past W."""
    rng = np.random.default_rng(11)
    batch = make_draft_batch(rng, [30, 25], topk=2, num_steps=3, page_size=4)
    width = 100  # needs 2*55 + 4*3 = 122 at the last step
    kw = {"topk": 2, "num_steps": 3, "page_size": 4, "kv_indices_width": width}
    fn = functools.partial(generate_draft_decode_kv_indices, **with_geometry(kw))
    with pytest.raises(
        probes.ProbeError, match="kv_indices row too small: need 122 but row width is 100"
    ):
        probes.checked(fn)(*_args(batch))
    want = _loop(batch, topk=2, num_steps=3, page_size=4, width=width)
    for impl in ("xla", "pallas"):
        got = fn(*_args(batch), impl=impl, interpret=interpret, block_tokens=16)
        np.testing.assert_array_equal(got[0], want[0], err_msg=impl)  # truncated, no OOB
        np.testing.assert_array_equal(got[1], want[1], err_msg=impl)
    # Probes off: the jaxpr carries no check.
    assert "check" not in str(jax.make_jaxpr(fn)(*_args(batch)))


def test_index_probes():
    rng = np.random.default_rng(12)
    batch = make_draft_batch(rng, [5, 6], topk=2, num_steps=2, page_size=4)
    rpi, rtt, seq_lens = _args(batch)
    fn = probes.checked(
        functools.partial(
            generate_draft_decode_kv_indices,
            geometry=geom(topk=2, num_steps=2, page_size=4),
            kv_indices_width=500,
        )
    )
    with pytest.raises(probes.ProbeError, match="req_pool_indices.*max value 9"):
        fn(rpi.at[1].set(9), rtt, seq_lens)
    with pytest.raises(probes.ProbeError, match="seq_lens vs row width.*min value -1"):
        fn(rpi, rtt, seq_lens.at[0].set(-1))
    with pytest.raises(probes.ProbeError, match="draft slots end past the req_to_token row"):
        fn(rpi, rtt, seq_lens.at[0].set(rtt.shape[1] - 1))
    fn(rpi, rtt, seq_lens)  # valid inputs: nothing fires


def test_reference_matches_closed_form_indptr():
    seq_lens = np.array([3, 0, 5], I32)
    topk, num_steps = 2, 3
    batch = make_draft_batch(
        np.random.default_rng(0), seq_lens, topk=topk, num_steps=num_steps, page_size=1
    )
    _, kv_indptr = draft_kv_indices_reference(
        *_args(batch),
        geometry=geom(topk=topk, num_steps=num_steps, page_size=1),
        kv_indices_width=60,
    )
    for i in range(num_steps):
        for z in range(len(seq_lens) * topk + 1):
            closed = sum(int(seq_lens[zz // topk]) for zz in range(z)) + z * (i + 1)
            assert kv_indptr[i, z] == closed


def test_pallas_kv_indices_lowers_for_cuda():
    """The Pallas kernel lowers to Triton IR for the GPU (cross-lowering from CPU)."""
    shapes = (
        jax.ShapeDtypeStruct((256,), jnp.int32),
        jax.ShapeDtypeStruct((257, 8300), jnp.int32),
        jax.ShapeDtypeStruct((256,), jnp.int32),
    )
    fn = functools.partial(
        generate_draft_decode_kv_indices,
        geometry=geom(topk=8, num_steps=5, page_size=16),
        kv_indices_width=256 * 8 * 8192,
        impl="pallas",
        interpret=False,
    )
    text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
