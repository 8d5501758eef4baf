"""Poisoned Pallas outputs: a test-only wrapper of ``pl.pallas_call`` (no hook in the kernels).

Inside :func:`poisoned_outputs` every ``pallas_call`` launch starts each output from a poison
value instead of whatever the buffer held::

    output aliased to an input (an init buffer)  ->  that input replaced by the poison
    any other output                             ->  a poisoned input aliased to it
                                                     (the kernel never sees the extra refs)

An element the kernel leaves unwritten then reads back as the poison on every backend (interpret
mode included), so a test tells "written" from "left alone". Use it only with kernels whose
aliased inputs are pure initial values (the pair buffers of ``draft_cache_loc``), not with ones
that read an aliased buffer's contents.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import jax.numpy as jnp
from jax.experimental import pallas as pl

POISON = -7  # signed ints (unsigned: +7, bool: True, floats: NaN)


def poison_like(shape: tuple[int, ...], dtype: Any) -> Any:
    """An array of ``shape`` holding the poison value of ``dtype``."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        value = True
    elif jnp.issubdtype(dtype, jnp.floating):
        value = jnp.nan
    elif jnp.issubdtype(dtype, jnp.unsignedinteger):
        value = -POISON
    else:
        value = POISON
    return jnp.full(shape, value, dtype)


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Every ``pl.pallas_call`` launched inside starts its outputs from the poison."""
    real = pl.pallas_call

    def pallas_call(kernel: Any, *, out_shape: Any, input_output_aliases=None, **kwargs: Any):
        outs = tuple(out_shape) if isinstance(out_shape, (tuple, list)) else (out_shape,)
        aliases = dict(input_output_aliases or {})

        def launch(*args: Any) -> Any:
            args = list(args)
            for i, o in aliases.items():
                args[i] = poison_like(outs[o].shape, outs[o].dtype)
            fresh = [o for o in range(len(outs)) if o not in aliases.values()]
            inits = [poison_like(outs[o].shape, outs[o].dtype) for o in fresh]
            num_in = len(args)

            def body(*refs: Any) -> Any:  # drop the refs of the extra init inputs
                return kernel(*refs[:num_in], *refs[num_in + len(inits) :])

            call = real(
                body,
                out_shape=out_shape,
                input_output_aliases={**aliases, **{num_in + j: o for j, o in enumerate(fresh)}},
                **kwargs,
            )
            return call(*args, *inits)

        return launch

    with mock.patch.object(pl, "pallas_call", pallas_call):
        yield
