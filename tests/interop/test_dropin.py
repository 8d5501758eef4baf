"""Drop-ins (jspec behind sglang's signatures): in-place write-back semantics vs the references."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from interop import torch_api as api
from interop.attention_meta import reference as attention
from interop.kv import reference as memory
from interop.kv.reference_allocator import PagedTokenToKVPoolAllocator as _Ref
from interop.tree import reference as tree
from interop.tree import reference_layout as spec


def Ref(size, page_size, need_sort=False):
    return _Ref(size, page_size, torch.float32, "cpu", None, need_sort)


I64, I32 = torch.int64, torch.int32


def _t(x, dtype=I64):
    return torch.tensor(x, dtype=dtype)


def test_verify_golden_and_untouched_predicts():
    candidates = _t([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
    ridx = _t([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])
    nxt = _t([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]])
    sib = _t([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]])
    target = torch.full((2, 6), 18, dtype=I64)
    for (b, j), tok in {(0, 0): 3, (0, 3): 4, (0, 4): 5, (1, 0): 11, (1, 4): 12}.items():
        target[b, j] = tok
    predicts = torch.full((12,), -1, dtype=I32)
    accept = torch.full((2, 4), -1, dtype=I32)
    num = torch.zeros(2, dtype=I32)
    api.verify_tree_greedy(predicts, accept, num, candidates, ridx, nxt, sib, target)
    assert predicts.tolist() == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
    assert accept.tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]] and num.tolist() == [3, 2]
    # accept_index entries the kernel does not write keep the caller's values
    accept2 = torch.full((2, 4), -9, dtype=I32)
    api.verify_tree_greedy(predicts.clone(), accept2, num, candidates, ridx, nxt, sib, target)
    assert accept2.tolist() == [[0, 3, 4, 5], [6, 10, 11, -9]]


def test_expand_metadata_keeps_stale_columns():
    for fn in (attention.draft_decode_set_expand_metadata, api.draft_decode_set_expand_metadata):
        table = torch.full((2, 4), -7, dtype=I32)
        seqlens = torch.zeros(2, dtype=I32)
        fn(seqlens, table, _t([3], I32), 2, _t([[23, 28], [31, 36]]), 2, 4)
        assert table.tolist() == [[5, 7, -7, -7], [7, 9, -7, -7]] and seqlens.tolist() == [5, 5]
    # the unsliced (eager) form: all cache_loc columns, as sglang's function
    for fn in (attention.draft_decode_set_expand_metadata, api.draft_decode_set_expand_metadata):
        table = torch.zeros(2, 2, dtype=I32)
        fn(torch.zeros(2, dtype=I32), table, _t([3], I32), 1, _t([[23, 24], [31, 32]]), 2, 4)
        assert table.tolist() == [[5, 6], [7, 8]]


def test_kv_indices_tail_and_indptr_head_untouched():
    row = torch.arange(100, 148, dtype=I32)
    req_to_token = torch.stack([torch.zeros_like(row), row])
    outs = []
    for fn in (attention.generate_draft_decode_kv_indices, api.generate_draft_decode_kv_indices):
        kv_indices = torch.full((3, 40), -7, dtype=I32)
        kv_indptr = torch.full((3, 4), -7, dtype=I32)
        fn(_t([1]), req_to_token, _t([7]), kv_indices, kv_indptr, _t([7, 7]), 48, 40, 4, 1, 4, 2, 4)
        assert (kv_indptr[:, 0] == -7).all() and (kv_indptr[:, 3] == -7).all()
        assert (kv_indices[0, 16:] == -7).all()
        outs.append((kv_indices, kv_indptr))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    with pytest.raises(ValueError, match="bs_upper=0 must be >= the number of sequences 1"):
        api.generate_draft_decode_kv_indices(
            _t([1]),
            req_to_token,
            _t([7]),
            outs[0][0],
            outs[0][1],
            _t([7, 7]),
            48,
            40,
            4,
            0,
            4,
            2,
            4,
        )


def test_move_kv_cache_lists_and_stacked():
    torch.manual_seed(0)
    k = [torch.randn(16, 2, 3) for _ in range(2)]
    v = [torch.randn(16, 2, 3) for _ in range(2)]
    tgt, src = _t([1, 2, 3, 4, 9, 0]), _t([0, 1, 2, 3, 15, 0])
    rk, rv = [x.clone() for x in k], [x.clone() for x in v]
    memory.move_kv_cache(rk, rv, tgt, src)
    api.move_kv_cache(k, v, tgt, src)
    assert all(torch.equal(a, b) for a, b in zip(rk + rv, k + v))
    ks, vs = torch.stack([x.clone() for x in k]), torch.stack([x.clone() for x in v])
    memory.move_kv_cache(rk, rv, tgt, src)
    api.move_kv_cache(ks, vs, tgt, src)
    assert torch.equal(ks, torch.stack(rk)) and torch.equal(vs, torch.stack(rv))


def test_int64_index_out_of_range_names_the_value():
    table = torch.zeros(2, 8, dtype=I32)
    with pytest.raises(ValueError, match=r"out_cache_loc .*1099511627776 at flat index 1"):
        api.assign_req_to_token_pool_func(_t([1]), table, _t([0]), _t([2]), _t([5, 2**40]), 1)


def test_assign_req_to_token_pool_batch_size_prefix():
    for fn in (memory.assign_req_to_token_pool_func, api.assign_req_to_token_pool_func):
        table = torch.full((3, 6), -7, dtype=I32)
        fn(_t([2, 1]), table, _t([1, 0]), _t([3, 4]), _t([10, 11, 12, 13]), 1)
        assert table[2].tolist() == [-7, 10, 11, -7, -7, -7] and (table[:2] == -7).all()


def test_duplicate_prefix_tail_infers_steps_and_rejects_inconsistent_pages():
    p = 4
    row = torch.arange(4, 4 + 64, dtype=I32)
    rows = torch.stack([row, row + 64])
    seq = _t([7, 13])
    lp, base = seq % p, seq - seq % p
    nnp = (lp + 3 + p - 1) // p
    pools = []
    for fn in (
        spec.duplicate_prefix_tail_to_draft_branches,
        api.duplicate_prefix_tail_to_draft_branches,
    ):
        pool = memory.MHATokenToKVPool(200, p, torch.float32, 1, 2, 1)
        pool.k_buffer[0].copy_(torch.arange(204 * 2, dtype=torch.float32).reshape(204, 1, 2))
        fn(pool, rows, base, lp, nnp, 2, p)
        pools.append(pool.k_buffer[0])
    assert torch.equal(pools[0], pools[1])
    with pytest.raises(ValueError, match="inconsistent"):
        api.duplicate_prefix_tail_to_draft_branches(pool, rows, base, _t([3, 0]), _t([1, 3]), 2, p)


def test_allocator_adapter_matches_reference_sequence():
    p = 4
    for need_sort in (False, True):
        ref, jsp = (
            Ref(24 * p, p, need_sort=need_sort),
            api.PagedTokenToKVPoolAllocator(24 * p, p, torch.float32, "cpu", None, need_sort),
        )
        for a in (ref, jsp):
            a.first = a.alloc_extend(
                _t([0, 0, 0]), _t([0, 0, 0]), _t([5, 9, 1]), _t([5, 9, 1]), _t([-1, -1, -1]), 15
            )
        assert ref.first.tolist() == jsp.first.tolist() and jsp.first.dtype == I64
        last = _t([int(ref.first[4]), int(ref.first[13]), int(ref.first[14])])
        dec = [a.alloc_decode(_t([6, 10, 2]), _t([6, 10, 2]), last) for a in (ref, jsp)]
        assert dec[0].tolist() == dec[1].tolist()
        for a in (ref, jsp):
            a.free(a.first[:5])
            a.free_group_begin()
            a.free(a.first[5:14])
            a.free_page_ids(_t([int(a.first[14]) // p]))
            a.free_group_end()
            a.free_segment(a.first[:0], start_pos=0)
        assert ref.free_pages.tolist() == jsp.free_pages.tolist()
        assert ref.release_pages.tolist() == jsp.release_pages.tolist()
        assert ref.available_size() == jsp.available_size()
        assert ref.alloc(8).tolist() == jsp.alloc(8).tolist()
        assert ref.alloc(10**4) is None and jsp.alloc(10**4) is None
        with pytest.raises(AssertionError, match="nested"):
            jsp.free_group_begin()
            jsp.free_group_begin()


def test_tree_adapters_on_the_golden_build():
    pl = _t(
        [
            [-1, 0, 1, 2, 3, 4, 8, 9, 10, 20, 24, 21, 28],
            [-1, 0, 1, 2, 3, 4, 5, 6, 7, 24, 28, 20, 21],
        ]
    )
    sel = _t([[0, 1, 4, 8, 20, 24, 36], [0, 4, 5, 6, 7, 24, 36]])
    draft = _t(
        [
            [29896, 29906, 29889, 29974, 29946, 29896, 29946],
            [13, 22550, 4136, 16492, 8439, 29871, 29941],
        ]
    )
    args = (_t([29974, 13]), pl, sel, draft, _t([5, 10]), 15, 4, 4, 8)
    buf = torch.zeros(400, dtype=torch.bool)
    want = tree.build_tree_kernel_efficient(*args)
    got = api.build_tree_kernel_efficient(*args, tree_mask_buf=buf)
    # sglang fills the whole buffer with True (fill_prefix_mask) before the kernel runs
    assert got[0] is buf and torch.equal(buf[:248], want[0]) and buf[248:].all()
    for a, b in zip(want[1:], got[1:]):
        assert torch.equal(a, b) and a.dtype == b.dtype


def test_per_request_tensors_longer_than_the_batch_are_read_as_prefixes():
    """sglang's launches read the first num_seqs / batch_size entries; the rest is not looked at."""
    row = torch.arange(100, 148, dtype=I32)
    req_to_token = torch.stack([torch.zeros_like(row), row])
    outs = []
    for lens in (_t([7]), _t([7, 99, -5])):
        kv_indices = torch.full((3, 40), -7, dtype=I32)
        kv_indptr = torch.full((3, 4), -7, dtype=I32)
        api.generate_draft_decode_kv_indices(
            _t([1]), req_to_token, lens, kv_indices, kv_indptr, _t([7, 7]), 48, 40, 4, 1, 4, 2, 4
        )
        outs.append((kv_indices, kv_indptr))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert outs[0][0][0, :9].tolist() == [*range(100, 108), 100]  # (b0, t0) then (b0, t1)
    with pytest.raises(NotImplementedError, match="window_size=8"):
        api.generate_draft_decode_kv_indices(
            _t([1]), req_to_token, _t([7]), kv_indices, kv_indptr, _t([7, 7]), 48, 40, 4, 1, 4, 2,
            4, 8,
        )  # fmt: skip
