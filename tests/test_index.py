"""jspec._index: the shared index checks, both duplicate-count paths against a loop."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jspec import _index


@pytest.mark.parametrize("batch", [5, _index.PAIRWISE_MAX + 3], ids=["pairwise", "histogram"])
def test_repeated_and_out_of_range_match_a_loop(batch) -> None:
    rng = np.random.default_rng(batch)
    size = 8
    idx = rng.integers(-3, size + 3, batch).astype(np.int32)
    valid = rng.random(batch) > 0.3
    rep = np.asarray(_index.repeated(jnp.asarray(idx), jnp.asarray(valid), size))
    oob = np.asarray(_index.out_of_range(jnp.asarray(idx), jnp.asarray(valid), 0, size))
    live = valid & (idx >= 0) & (idx < size)
    for i in range(batch):
        others = [j for j in range(batch) if j != i and live[j] and idx[j] == idx[i]]
        assert rep[i] == (live[i] and bool(others)), i
        assert oob[i] == (valid[i] and not 0 <= idx[i] < size), i
    at, value = _index.first_bad(jnp.asarray(rep), jnp.asarray(idx))
    if rep.any():
        assert int(at) == int(np.argmax(rep)) and int(value) == idx[int(at)]


def test_repeated_small_case_by_hand() -> None:
    idx = jnp.asarray([3, 9, 3, -1, 0], jnp.int32)
    valid = jnp.asarray([1, 1, 1, 1, 0], bool)
    assert np.asarray(_index.repeated(idx, valid, 8)).tolist() == [1, 0, 1, 0, 0]
    assert np.asarray(_index.out_of_range(idx, valid, 0, 8)).tolist() == [0, 1, 0, 1, 0]
