"""The KV seam's view (jspec.engine.kv_backend): a block-table batch seen as token slots, against
a loop reference written here."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.engine import view_from_page_table


def _slots_reference(page_table, valid, page_size):
    """slot of position w of entry b: page_table[b, w // P] * P + w % P (0 on invalid entries)."""
    batch, pages = page_table.shape
    out = np.zeros((batch, pages * page_size), np.int32)
    for b in range(batch):
        for w in range(pages * page_size):
            if valid[b]:
                out[b, w] = page_table[b, w // page_size] * page_size + w % page_size
    return out


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_view_from_page_table_matches_the_loop(page_size):
    rng = np.random.default_rng(page_size)
    batch, pages = 3, 5
    table = rng.permutation(np.arange(1, 1 + batch * pages)).reshape(batch, pages).astype(np.int32)
    valid = np.array([True, False, True])
    seq = np.array([7, 3, 0], np.int32)
    view = view_from_page_table(
        jnp.asarray(table), jnp.asarray(seq), jnp.asarray(valid), page_size=page_size
    )
    want = _slots_reference(table, valid, page_size)
    got = np.asarray(view.token_table)[np.asarray(view.rows)]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(view.token_table)[0], 0)  # the padding row
    assert np.asarray(view.rows).tolist() == [1, 0, 3]
    assert np.asarray(view.seq_lens).tolist() == [7, 0, 0]
    positions = jnp.asarray([[0, page_size, 2 * page_size + 1]] * batch, jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(view.slot_ids(positions)), np.take_along_axis(want, np.asarray(positions), 1)
    )
    np.testing.assert_array_equal(
        np.asarray(view.page_table(page_size, pages)), np.where(valid[:, None], table, 0)
    )
