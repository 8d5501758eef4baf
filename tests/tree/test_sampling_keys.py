"""Counter-based coins: pinned values, range and grid, independence from the batch, streams."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jspec.tree.sampling_keys import (
    STREAM_BONUS,
    STREAM_NODE,
    STREAM_PLAIN,
    seed_words,
    uniform_coins,
)


def _seeds(*seeds):
    return jnp.asarray([seed_words(s) for s in seeds], jnp.uint32)


def test_pinned_values():
    """The derivation is part of the reproducibility contract: these never change."""
    node = uniform_coins(_seeds(42, 2**64 - 1), STREAM_NODE, jnp.asarray([7, 0]), 3)
    np.testing.assert_array_equal(np.asarray(node) * 2**24, PINNED_NODE)
    plain = uniform_coins(_seeds(0, 1), STREAM_PLAIN, jnp.asarray([5, 5]))
    np.testing.assert_array_equal(np.asarray(plain) * 2**24, PINNED_PLAIN)


# Coins in units of 2**-24 (recorded 2026-11, jax 0.10.2 CPU; threefry is bit-exact on GPU).
PINNED_NODE = [[14370319, 4706097, 16070745], [11938769, 15524883, 10211445]]
PINNED_PLAIN = [10403806, 1865226]


def test_range_grid_and_uniformity():
    seeds = _seeds(*range(50_000))
    coins = np.asarray(uniform_coins(seeds, STREAM_NODE, jnp.arange(50_000) % 97, 4)).ravel()
    assert coins.min() >= 0.0 and coins.max() < 1.0
    np.testing.assert_array_equal(coins * 2**24, np.floor(coins * 2**24))  # the 2**-24 grid
    counts = np.bincount((coins * 32).astype(int), minlength=32)
    assert stats.chisquare(counts).pvalue > 1e-6
    # Adjacent nodes and adjacent seeds are uncorrelated.
    grid = coins.reshape(-1, 4)
    assert abs(np.corrcoef(grid[:, 0], grid[:, 1])[0, 1]) < 0.02
    assert abs(np.corrcoef(grid[:-1, 0], grid[1:, 0])[0, 1]) < 0.02


def test_a_coin_does_not_depend_on_its_batch():
    seeds, pos = _seeds(3, 1 << 40, 12345), jnp.asarray([9, 100, 0])
    batch = np.asarray(uniform_coins(seeds, STREAM_NODE, pos, 5))
    for i in range(3):
        alone = np.asarray(uniform_coins(seeds[i : i + 1], STREAM_NODE, pos[i : i + 1], 5))
        np.testing.assert_array_equal(alone[0], batch[i])
    fewer = np.asarray(uniform_coins(seeds, STREAM_NODE, pos, 2))
    np.testing.assert_array_equal(fewer, batch[:, :2])  # node j's coin is node j's


def test_streams_positions_nodes_seeds_all_differ():
    seeds = _seeds(5)
    pos = jnp.asarray([8])
    plain = float(uniform_coins(seeds, STREAM_PLAIN, pos)[0])
    node0 = float(uniform_coins(seeds, STREAM_NODE, pos, 1)[0, 0])
    bonus = float(uniform_coins(seeds, STREAM_BONUS, pos)[0])
    later = float(uniform_coins(seeds, STREAM_NODE, pos + 1, 1)[0, 0])
    other = float(uniform_coins(_seeds(6), STREAM_NODE, pos, 1)[0, 0])
    values = [plain, node0, bonus, later, other]
    assert len(set(values)) == len(values), values


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, True, "3", None])
def test_seed_words_rejects(bad):
    with pytest.raises(ValueError, match="seed"):
        seed_words(bad)


def test_seed_words_split():
    assert seed_words(0) == (0, 0)
    assert seed_words((5 << 32) | 9) == (5, 9)
    assert seed_words(2**64 - 1) == (2**32 - 1, 2**32 - 1)
    assert seed_words(np.int64(7)) == (0, 7)
