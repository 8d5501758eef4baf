"""build_tree's Pallas kernel vs its pure-jnp reference on random and garbage inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tree_oracles import (
    gen_draft_tree,
    ref_build_tree,
)

from jspec.kernels.build_tree import _build_tree_pallas, build_tree, build_tree_reference
from poisoned_outputs import poisoned_outputs


def _i32(x):
    return jnp.asarray(x, jnp.int32)  # traced or host values


# ---- kernel vs reference -----------------------------------------------------------------------
KERNEL_CASES = [
    (8, 5, 32, 3, None),
    (8, 5, 32, 3, jnp.uint32),
    (4, 3, 13, 2, None),
    (2, 2, 5, 2, jnp.uint8),
]
OUT_NAMES = (
    "next_token",
    "next_sibling",
    "positions",
    "mask",
    "first_invalid",
    "retrive_index",
    "tokens",
    "is_valid",
)


def _core_args(rng, parent_list, sel):
    bs, nsel = sel.shape
    return (
        _i32(parent_list),
        _i32(sel),
        _i32(rng.integers(0, 100, bs)),
        _i32(rng.integers(0, 1000, bs)),
        _i32(rng.integers(0, 1000, (bs, nsel))),
    )


@pytest.mark.parametrize("topk,num_steps,n,bs,word_dtype", KERNEL_CASES)
def test_kernel_matches_reference(interpret, topk, num_steps, n, bs, word_dtype):
    rng = np.random.default_rng(7 * n)
    parent_list, sel = gen_draft_tree(rng, bs, topk, num_steps, n)
    # Corrupt one request (random parents) so the invalid-node path is compared too.
    parent_list[-1, 1:] = rng.integers(
        -3, topk + (num_steps - 1) * topk**2 + 3, parent_list.shape[1] - 1
    )
    args = _core_args(rng, parent_list, sel)
    ref = build_tree_reference(*args, topk=topk, word_dtype=word_dtype)
    with poisoned_outputs():  # an output element the kernel skips keeps the poison
        got = _build_tree_pallas(*args, topk=topk, word_dtype=word_dtype, interpret=interpret)
    for name, r, g in zip(OUT_NAMES, ref, got):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        np.testing.assert_array_equal(g, r, err_msg=name)
    assert int(got[4][-1]) >= 1 and not bool(got[7][-1])  # the corrupted request is invalid


def test_kernel_garbage_inputs_match_reference(interpret):
    rng = np.random.default_rng(3)
    bs, topk, n, width = 3, 4, 12, 9
    sel = rng.integers(-2, 40, (bs, n - 1))
    parent_list = rng.integers(-2, 40, (bs, width))
    args = _core_args(rng, parent_list, sel)
    ref = build_tree(*args, topk=topk, impl="xla")
    got = build_tree(*args, topk=topk, impl="pallas", interpret=interpret)
    for name, r, g in zip(OUT_NAMES, ref, got):
        np.testing.assert_array_equal(g, r, err_msg=name)
    _, nt, _, _, mask, valid = ref_build_tree(parent_list, sel, args[2], topk, n)
    np.testing.assert_array_equal(ref[0], nt)
    np.testing.assert_array_equal(ref[3], mask)
    np.testing.assert_array_equal(ref[7], valid)


@pytest.mark.parametrize("word_dtype", [None, jnp.uint32])
def test_kernel_lowers_to_triton_for_gpu(word_dtype):
    """The Pallas-Triton lowering (to TTIR) runs without a GPU: catches unsupported primitives."""
    from jax import export

    bs, topk, n = 4, 8, 32

    def z(*shape):
        return jnp.zeros(shape, jnp.int32)

    def fn(*a):
        return build_tree(*a, topk=topk, word_dtype=word_dtype, impl="pallas", interpret=False)

    exported = export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(z(bs, 33), z(bs, n - 1), z(bs), z(bs), z(bs, n - 1))
    assert "xla.gpu.triton" in exported.mlir_module()
