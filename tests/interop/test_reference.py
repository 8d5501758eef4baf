"""PyTorch references vs SPEC.md golden vectors: §13.4 expand metadata, the §14 worked example and
the allocator / memory ops (tree goldens: ``test_reference_tree.py``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from interop.attention_meta import reference as attention
from interop.kv import reference as memory
from interop.kv.reference_allocator import PagedTokenToKVPoolAllocator as _Allocator
from interop.kv.reference_allocator import get_last_loc
from interop.tree import reference_layout as spec

sizing = memory


def PagedTokenToKVPoolAllocator(size, page_size, need_sort=False):
    """The reference allocator in debug mode (sglang's constructor has no defaults)."""
    return _Allocator(size, page_size, torch.float32, "cpu", None, need_sort, debug_mode=True)


I64 = torch.int64


def _t(x, dtype=I64):
    return torch.tensor(x, dtype=dtype)


# ---- §13.4 expand metadata -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "lp,d,cache_loc,width,want_table,want_lens",
    [
        ([3], 1, [[23, 24], [31, 32]], 2, [[5, 6], [7, 8]], [4, 4]),
        (
            [3],
            5,
            [[27, 28, 29, 30, 31, 32], [35, 36, 37, 38, 39, 40]],
            6,
            [[6, 7, 8, 0, 0, 0], [8, 9, 10, 0, 0, 0]],
            [8, 8],
        ),
        ([3], 2, [[23, 28], [31, 36]], 3, [[5, 7, 0], [7, 9, 0]], [5, 5]),
        (
            [1, 3, 0],
            3,
            [
                [1, 2, 3, 4],
                [6, 7, 8, 9],
                [3, 8, 9, 10],
                [14, 15, 16, 17],
                [0, 1, 2, 3],
                [4, 5, 6, 7],
            ],
            4,
            [[0, 1, 0, 0], [1, 2, 0, 0], [0, 2, 0, 0], [3, 4, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]],
            [4, 4, 6, 6, 3, 3],
        ),
    ],
    ids=["d1", "d5", "page_crossing", "multi_batch"],
)
def test_expand_metadata_golden(lp, d, cache_loc, width, want_table, want_lens):
    rows = len(cache_loc)
    seqlens = torch.full((rows,), -7, dtype=torch.int32)
    table = torch.zeros(rows, width, dtype=torch.int32)
    attention.draft_decode_set_expand_metadata(
        seqlens, table, _t(lp, torch.int32), d, _t(cache_loc), 2, 4
    )
    assert table.tolist() == want_table and seqlens.tolist() == want_lens


def test_expand_metadata_leaves_stale_columns():
    table = torch.full((2, 4), -7, dtype=torch.int32)
    seqlens = torch.zeros(2, dtype=torch.int32)
    attention.draft_decode_set_expand_metadata(
        seqlens, table, _t([3], torch.int32), 2, _t([[23, 28], [31, 36]]), 2, 4
    )
    assert table.tolist() == [[5, 7, -7, -7], [7, 9, -7, -7]]


# ---- §14 worked example ------------------------------------------------------------------------------
P, K, S, N, L = 4, 2, 3, 4, 7
PAGE_PERM = [9, 3, 14, 6, 11, 2, 8, 13, 5, 12, 4, 10]  # physical page of row page k


def _row(width: int = 48) -> torch.Tensor:
    return _t([PAGE_PERM[pos // P] * P + pos % P for pos in range(width)], torch.int32)


def test_worked_example_sizing():
    kw = {"page_size": P, "topk": K, "num_steps": S, "num_draft_tokens": N}
    assert sizing.get_alloc_len_per_decode(**kw) == 16
    assert sizing.get_alloc_reserve_per_decode(**kw) == 32
    assert (
        sizing.get_alloc_len_per_decode(page_size=64, topk=8, num_steps=5, num_draft_tokens=32)
        == 1024
    )
    assert (
        sizing.get_alloc_len_per_decode(page_size=1, topk=4, num_steps=3, num_draft_tokens=8) == 12
    )
    assert (
        sizing.get_alloc_len_per_decode(
            algorithm=None, page_size=4, topk=2, num_steps=3, num_draft_tokens=4
        )
        == 1
    )

    class Req:
        def __init__(self, committed, allocated):
            self.kv_committed_len, self.kv_allocated_len = committed, allocated

    cur, nxt, need = sizing.page_aligned_decode_alloc_lens([Req(7, 7)], reserve=32, page_size=P)
    assert (cur.tolist(), nxt.tolist(), need) == ([7], [40], 33)
    cur, nxt, need = sizing.page_aligned_decode_alloc_lens(
        [Req(9, 40), Req(3, 50)], reserve=32, page_size=P
    )
    assert (nxt.tolist(), need) == ([44, 50], 4)


def test_worked_example_alloc_extend():
    alloc = PagedTokenToKVPoolAllocator(size=64 * P, page_size=P)
    first = alloc.alloc_extend(_t([0]), _t([0]), _t([7]), _t([7]), _t([-1]), 7)
    assert first.tolist() == [4, 5, 6, 7, 8, 9, 10]  # pages 1, 2
    req_to_token = torch.zeros(2, 64, dtype=torch.int32)
    req_to_token[1, :7] = first.to(torch.int32)
    last = get_last_loc(req_to_token, _t([1]), _t([7]))
    assert last.tolist() == [10]
    slots = alloc.alloc_extend(_t([7]), _t([7]), _t([40]), _t([40]), last, 33)
    assert slots[:1].tolist() == [11]  # continues page 2
    assert slots[1:].tolist() == [p * P + o for p in range(3, 11) for o in range(P)]
    assert alloc.available_size() == (64 - 10) * P


def test_worked_example_layout_and_duplication():
    row = _row()
    req_to_token = torch.stack([torch.zeros_like(row), row])
    out = spec.prepare_for_draft(req_to_token, _t([1]), _t([L]), K, S, P)
    assert out.tolist() == row[[7, 8, 9, 15, 16, 17]].tolist() and out.dtype == I64
    pool = memory.MHATokenToKVPool(64 * P, P, torch.float32, 1, 2, 2)
    for layer in range(2):
        pool.k_buffer[layer].copy_(torch.randn_like(pool.k_buffer[layer]))
        pool.v_buffer[layer].copy_(torch.randn_like(pool.v_buffer[layer]))
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    spec.prepare_for_draft(req_to_token, _t([1]), _t([L]), K, S, P, pool)
    tgt, src = row[[12, 13, 14]].long(), row[[4, 5, 6]].long()
    for buf, old in zip(pool.k_buffer + pool.v_buffer, before):
        assert torch.equal(buf[tgt], old[src])
        mask = torch.ones(buf.shape[0], dtype=torch.bool)
        mask[tgt] = False
        assert torch.equal(buf[mask], old[mask])
    # K == 1 / P == 1: contiguous layout row[L + t*S + s]
    assert (
        spec.prepare_for_draft(req_to_token, _t([1]), _t([L]), 1, S, P).tolist()
        == row[7:10].tolist()
    )
    assert (
        spec.prepare_for_draft(req_to_token, _t([1]), _t([L]), K, S, 1).tolist()
        == row[7:13].tolist()
    )


def test_worked_example_flashinfer_and_fa3_step1():
    row = _row()
    req_to_token = torch.stack([torch.zeros_like(row), row])
    width = 2 * (L + S)
    kv_indices = torch.full((S, 64), -7, dtype=torch.int32)
    kv_indptr = torch.zeros(S, 4, dtype=torch.int32)
    positions = _t([L, L])
    attention.generate_draft_decode_kv_indices(
        _t([1]), req_to_token, _t([L]), kv_indices, kv_indptr, positions, 48, 64, 4, 1, 4, 2, P
    )
    step1 = kv_indices[1]
    assert step1[:9].tolist() == row[:7].tolist() + row[[7, 8]].tolist()
    assert step1[9:18].tolist() == row[:7].tolist() + row[[15, 16]].tolist()
    assert kv_indptr[1, :3].tolist() == [0, 9, 18]
    assert kv_indptr[0, :3].tolist() == [0, 8, 16] and kv_indptr[2, :3].tolist() == [0, 10, 20]
    assert bool((kv_indices[0, 16:] == -7).all()) and bool((kv_indices[2, width:] == -7).all())
    # FA3 expand pass at step 1 (d = 2) over the live slice of out_cache_loc
    out = spec.prepare_for_draft(req_to_token, _t([1]), _t([L]), K, S, P).view(K, S)
    seqlens = torch.zeros(K, dtype=torch.int32)
    table = torch.zeros(K, 3, dtype=torch.int32)
    attention.draft_decode_set_expand_metadata(
        seqlens, table, _t([L % P], torch.int32), 2, out[:, :2], K, P
    )
    assert seqlens.tolist() == [5, 5]
    assert table[:, :2].tolist() == [
        [int(row[7]) // P, int(row[8]) // P],
        [int(row[15]) // P, int(row[16]) // P],
    ]


def test_worked_example_accept_move():
    row = _row()
    req_to_token = torch.stack([torch.zeros_like(row), row])
    verify_locs = row[7:11].long()
    pool = memory.MHATokenToKVPool(64 * P, P, torch.float32, 1, 2, 1)
    pool.k_buffer[0].copy_(torch.randn_like(pool.k_buffer[0]))
    old = pool.k_buffer[0].clone()
    tgt, src = spec.move_accept_tokens_to_target_kvcache(
        pool, req_to_token, _t([1]), _t([L]), verify_locs, _t([[0, 2, -1, -1]]), _t([2])
    )
    assert tgt.tolist() == [int(row[7]), int(row[8]), 0, 0]
    assert src.tolist() == [int(row[7]), int(row[9]), 0, 0]
    assert torch.equal(pool.k_buffer[0][row[8].long()], old[row[9].long()])


def test_v1_src_tgt_cache_loc_comment_example():
    out = torch.arange(9, dtype=I64)
    accept = _t([[0, -1, 2], [3, 4, -1], [6, -1, -1]])
    flat = accept.reshape(-1)
    flat = flat[flat != -1]
    ncd = _t([1, 1, 0])
    src, tgt, nfree = spec.get_src_tgt_cache_loc(_t([0, 0, 0]), out, flat, ncd, 3, 1)
    assert src.tolist() == [0, 2, 3, 4, 6] and nfree.tolist() == [1, 1, 2]
    to_free = torch.zeros(int(nfree.sum()), dtype=I64)
    spec.get_target_cache_loc(tgt, to_free, ncd, nfree, out, 3)
    assert tgt.tolist() == [0, 1, 3, 4, 6] and to_free.tolist() == [2, 5, 7, 8]


# ---- allocator / memory ------------------------------------------------------------------------------
def test_allocator_order_free_and_need_sort():
    alloc = PagedTokenToKVPoolAllocator(size=8 * 4, page_size=4)
    assert alloc.alloc(8).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert alloc.alloc(12).tolist()[::4] == [12, 16, 20]
    alloc.free(_t([21, 9, 22, 8]))
    assert alloc.free_pages[:3].tolist() == [2, 5, 6]  # unique, prepended
    assert alloc.alloc(64) is None and alloc.available_size() == 5 * 4
    decode = alloc.alloc_decode(_t([6, 5]), _t([6, 5]), _t([8, 19]))
    assert decode.tolist() == [9, 2 * 4]  # page 2 for seq%4==1
    sorted_alloc = PagedTokenToKVPoolAllocator(size=6 * 2, page_size=2, need_sort=True)
    sorted_alloc.alloc(10)
    sorted_alloc.free(_t([8, 2]))
    assert sorted_alloc.release_pages.tolist() == [1, 4]
    assert sorted_alloc.alloc(4).tolist() == [2, 3, 8, 9]  # merged and sorted


def test_free_segment_and_groups():
    P4 = 4
    alloc = PagedTokenToKVPoolAllocator(size=64 * P4, page_size=P4)
    row = alloc.alloc(40)
    for start in range(0, 40, P4):
        for end in range(start, 41):
            a = PagedTokenToKVPoolAllocator(size=64 * P4, page_size=P4)
            a.free_pages = alloc.free_pages.clone()
            a.free_segment(row[start:end], start_pos=start)
            freed = a.free_pages[: len(a.free_pages) - len(alloc.free_pages)]
            assert sorted(freed.tolist()) == torch.unique(row[start:end] // P4).tolist()
    with pytest.raises(AssertionError, match="not page-aligned"):
        alloc.free_segment(row[1:5], start_pos=1)
    alloc.free_group_begin()
    with pytest.raises(AssertionError, match="nested"):
        alloc.free_group_begin()
    alloc.free(row[:4])
    alloc.free_page_ids(_t([5]))
    assert alloc.available_size() == 54 * P4
    alloc.free_group_end()
    # 0.5.23 order: the deferred token frees first (page 1), then the page-id frees (page 5)
    assert alloc.free_pages[:2].tolist() == [5, 1] and alloc.available_size() == 56 * P4
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(row[:1])


def test_assign_req_to_token_pool_and_move_kv_cache():
    req_to_token = torch.full((4, 8), -7, dtype=torch.int32)
    memory.assign_req_to_token_pool_func(
        _t([2, 0, 3]), req_to_token, _t([1, 0, 4]), _t([3, 0, 7]), _t([10, 11, 12, 13, 14]), 3
    )
    assert req_to_token[2].tolist() == [-7, 10, 11, -7, -7, -7, -7, -7]
    assert req_to_token[3].tolist() == [-7] * 4 + [12, 13, 14, -7]
    assert (req_to_token[[0, 1]] == -7).all()
    buf = [torch.arange(6.0).reshape(6, 1, 1)]
    memory.move_kv_cache(buf, [buf[0] * 10], _t([1, 2, 3, 4]), _t([0, 1, 2, 3]))
    assert buf[0].flatten().tolist() == [0, 0, 1, 2, 3, 5]  # reverse shift safe
