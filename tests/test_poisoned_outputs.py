"""The test helper ``poisoned_outputs``: unwritten output elements read back as the poison."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from poisoned_outputs import POISON, poisoned_outputs


def _half_writer(x_ref, init_ref, out_ref, inplace_ref):
    del init_ref  # aliased to inplace_ref
    out_ref[pl.ds(0, 4)] = x_ref[pl.ds(0, 4)]  # elements 4..7 of both outputs stay unwritten
    inplace_ref[pl.ds(0, 4)] = x_ref[pl.ds(0, 4)] + 1


def _launch(x):
    shape = jax.ShapeDtypeStruct((8,), jnp.int32)
    return pl.pallas_call(
        _half_writer, out_shape=(shape, shape), input_output_aliases={1: 1}, interpret=True
    )(x, jnp.zeros((8,), jnp.int32))


def test_unwritten_elements_keep_the_poison():
    x = jnp.arange(8, dtype=jnp.int32)
    with poisoned_outputs():
        out, inplace = _launch(x)
    np.testing.assert_array_equal(out, [0, 1, 2, 3] + [POISON] * 4)
    np.testing.assert_array_equal(inplace, [1, 2, 3, 4] + [POISON] * 4)  # the init replaced
    out, inplace = _launch(x)  # outside: pallas_call is the real one again
    np.testing.assert_array_equal(inplace, [1, 2, 3, 4, 0, 0, 0, 0])
