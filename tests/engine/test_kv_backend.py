"""The KV seam's view (jspec.engine.kv_backend): a block-table batch seen as token slots, against
a loop reference written here."""

from __future__ import annotations

import chex
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


# ---- PagedKVBackend.prepare_prefill: a refused call takes nothing ------------------------------
def _paged(num_pages: int, max_running: int = 2):
    from engine_helpers import TARGET, TINY

    from jspec.engine import PagedKVBackend, make_engine_config

    ecfg = make_engine_config(
        TINY, page_size=4, topk=2, num_steps=2, num_draft_tokens=4, context_len=32,
        max_running_requests=max_running, max_prompt_len=16, num_pages=num_pages,
        batch_buckets=(max_running,), prefill_batch=max_running,
    )  # fmt: skip
    backend = PagedKVBackend(ecfg)
    return backend, backend.init_state(TARGET, None)


def _prefill(backend, kv, slots, starts, ends, valid):
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return backend.prepare_prefill(
        kv, i32(slots), i32(starts), i32(ends), jnp.asarray(valid), chunk_width=16
    )


@pytest.mark.parametrize(
    "num_pages,slots,starts,ends,valid",
    [
        (3, [0, 1], [0, 0], [8, 8], [True, True]),  # 4 pages wanted, 3 in the pool (rows free)
        (16, [0, 1], [4, 0], [8, 4], [True, True]),  # slot 0 continues a chunk it never had
        (16, [0, 1], [0, 4], [4, 8], [True, True]),  # slot 1: the same, beside a good first chunk
    ],
    ids=["pages_short", "continuation_without_row", "good_first_beside_bad_continuation"],
)
def test_prepare_prefill_refused_takes_nothing(num_pages, slots, starts, ends, valid) -> None:
    """Pages short, or a later chunk for a slot with no row: ``ok=False``, the allocators, rows
    and per-slot arrays unchanged, every view entry padding (the pools' padding page aside)."""
    backend, kv = _paged(num_pages)
    kv2, view, ok = _prefill(backend, kv, slots, starts, ends, valid)
    assert not bool(ok) and not np.asarray(view.valid).any()
    chex.assert_trees_all_equal(
        (kv2.allocator, kv2.req_rows, kv2.req_to_token[1:], kv2.committed_lens),
        (kv.allocator, kv.req_rows, kv.req_to_token[1:], kv.committed_lens),
    )
    chex.assert_trees_all_equal(
        (kv2.allocated_lens, kv2.req_pool_indices, kv2.live),
        (kv.allocated_lens, kv.req_pool_indices, kv.live),
    )


def test_prepare_prefill_rows_run_out_takes_nothing() -> None:
    """Both request rows held: a further first chunk (pages to spare) is refused whole, rows,
    pages and slots untouched."""
    backend, kv = _paged(16)
    kv, _, ok = _prefill(backend, kv, [0, 1], [0, 0], [4, 4], [True, True])
    assert bool(ok) and int(kv.req_rows.num_free) == 0
    kv2, view, ok = _prefill(backend, kv, [0, 1], [0, 0], [4, 4], [True, False])
    assert not bool(ok) and not np.asarray(view.valid).any()
    chex.assert_trees_all_equal(
        (kv2.allocator, kv2.req_rows, kv2.req_to_token[1:], kv2.allocated_lens),
        (kv.allocator, kv.req_rows, kv.req_to_token[1:], kv.allocated_lens),
    )
    chex.assert_trees_all_equal(kv2.req_pool_indices, kv.req_pool_indices)
