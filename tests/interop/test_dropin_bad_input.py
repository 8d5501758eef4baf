"""Drop-ins on mistaken input: a ValueError naming the argument, raised before any caller tensor
is written (the caller's tensors compare equal to their copies taken before the call)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from interop import torch_api as api
from interop.kv import reference as memory

I64, I32 = torch.int64, torch.int32


def _t(x, dtype=I64):
    return torch.tensor(x, dtype=dtype)


def _assert_untouched(tensors, copies):
    for t, c in zip(tensors, copies):
        assert torch.equal(t, c)


# ---- verify_tree_greedy / tree_speculative_sampling_target_only ---------------------------------
CANDIDATES = _t([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
RIDX = _t([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])
NXT = _t([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]])
SIB = _t([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]])


def _target():
    target = torch.full((2, 6), 18, dtype=I64)
    for (b, j), tok in {(0, 0): 3, (0, 3): 4, (0, 4): 5, (1, 0): 11, (1, 4): 12}.items():
        target[b, j] = tok
    return target


def _verify(predicts, accept, num, ridx):
    api.verify_tree_greedy(predicts, accept, num, CANDIDATES, ridx, NXT, SIB, _target())


def _sample(predicts, accept, num, ridx):
    probs = torch.softmax(torch.arange(2 * 6 * 16, dtype=torch.float32).reshape(2, 6, 16), -1)
    coins = torch.full((2, 6), 0.5)
    api.tree_speculative_sampling_target_only(
        predicts, accept, num, CANDIDATES, ridx, NXT, SIB, coins, coins[:, 0], probs, probs * 0
    )


@pytest.mark.parametrize("fn", [_verify, _sample], ids=["greedy", "sampling"])
@pytest.mark.parametrize(
    "predicts_len, accept_shape, num_shape, root_id, match",
    [
        pytest.param(6, (2, 4), (2,), 0, "accepted node id 6 is outside predicts", id="short"),
        pytest.param(12, (2, 4), (3,), 0, r"accept_token_num.shape=\(3,\)", id="num_len"),
        pytest.param(12, (2, 4), (), 0, r"accept_token_num.shape=\(\)", id="num_0d"),
        pytest.param(12, (3, 4), (2,), 0, r"accept_index.shape=\(3, 4\)", id="accept_rows"),
        pytest.param(12, (8,), (2,), 0, r"accept_index.shape=\(8,\)", id="accept_1d"),
        pytest.param(12, (2, 4), (2,), 99, "node id 99 is outside predicts", id="ridx_past"),
        pytest.param(12, (2, 4), (2,), -5, "node id -5 is outside predicts", id="ridx_neg"),
    ],
)
def test_verify_bad_outputs_raise_before_writing(
    fn, predicts_len, accept_shape, num_shape, root_id, match
):
    """Before: IndexError / RuntimeError with accept_index (and predicts) already written, and a
    negative retrive_index silently wrapped onto another node's predicts entry."""
    predicts = torch.full((predicts_len,), -1, dtype=I32)
    accept = torch.full(accept_shape, -1, dtype=I32)
    num = torch.zeros(num_shape, dtype=I32)
    ridx = RIDX.clone()
    ridx[0, 0] = root_id  # request 0's root: always accepted, so always written
    copies = [x.clone() for x in (predicts, accept, num)]
    with pytest.raises(ValueError, match=match):
        fn(predicts, accept, num, ridx)
    _assert_untouched((predicts, accept, num), copies)


# ---- draft_decode_set_expand_metadata / generate_draft_decode_kv_indices ------------------------
@pytest.mark.parametrize(
    "seqlens_shape, table_shape, match",
    [
        pytest.param((2,), (1, 4), r"page_table.shape=\(1, 4\)", id="table_rows"),
        pytest.param((2,), (4,), r"page_table.shape=\(4,\)", id="table_1d"),
        pytest.param((3,), (2, 4), r"cache_seqlens_int32.shape=\(3,\)", id="seqlens_len"),
    ],
)
def test_expand_metadata_bad_outputs_raise_before_writing(seqlens_shape, table_shape, match):
    """Before: cache_seqlens_int32 written, then a RuntimeError / IndexError on page_table."""
    seqlens = torch.zeros(seqlens_shape, dtype=I32)
    table = torch.full(table_shape, -7, dtype=I32)
    copies = [seqlens.clone(), table.clone()]
    with pytest.raises(ValueError, match=match):
        api.draft_decode_set_expand_metadata(
            seqlens, table, _t([3], I32), 2, _t([[23, 28], [31, 36]]), 2, 4
        )
    _assert_untouched((seqlens, table), copies)


def _kv_indices_call(req_pool_indices, lens, kv_indices, kv_indptr, positions):
    row = torch.arange(100, 148, dtype=I32)
    req_to_token = torch.stack([torch.zeros_like(row), row])
    api.generate_draft_decode_kv_indices(
        req_pool_indices, req_to_token, lens, kv_indices, kv_indptr, positions, 48, 40, 4, 1, 4,
        2, 4,
    )  # fmt: skip


@pytest.mark.parametrize(
    "indices_shape, indptr_shape, match",
    [
        pytest.param((3, 40), (3, 2), r"kv_indptr.shape=\(3, 2\)", id="indptr_narrow"),
        pytest.param((3, 40), (2, 4), r"kv_indptr.shape=\(2, 4\)", id="indptr_rows"),
        pytest.param((40,), (3, 4), r"kv_indices.shape=\(40,\)", id="indices_1d"),
    ],
)
def test_kv_indices_bad_buffers_raise_before_writing(indices_shape, indptr_shape, match):
    """Before: kv_indices written, then a RuntimeError on kv_indptr (or a bare IndexError)."""
    kv_indices = torch.full(indices_shape, -7, dtype=I32)
    kv_indptr = torch.full(indptr_shape, -7, dtype=I32)
    copies = [kv_indices.clone(), kv_indptr.clone()]
    with pytest.raises(ValueError, match=match):
        _kv_indices_call(_t([1]), _t([7]), kv_indices, kv_indptr, _t([7, 7]))
    _assert_untouched((kv_indices, kv_indptr), copies)


def test_kv_indices_empty_batch_writes_nothing():
    """sglang launches an empty grid; before: ValueError 'topk=0' (inferred, never passed)."""
    kv_indices = torch.full((3, 40), -7, dtype=I32)
    kv_indptr = torch.full((3, 4), -7, dtype=I32)
    _kv_indices_call(_t([]), _t([]), kv_indices, kv_indptr, _t([]))
    assert (kv_indices == -7).all() and (kv_indptr == -7).all()


# ---- PagedTokenToKVPoolAllocator -------------------------------------------------------------------
def _alloc(need_sort=False):
    return api.PagedTokenToKVPoolAllocator(32, 4, torch.float32, "cpu", None, need_sort)


def _state(a):
    return a.available_size(), a.free_pages.tolist(), a.release_pages.tolist()


@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize(
    "need_size, error, match",
    [
        pytest.param(8.0, TypeError, "need_size=8.0 must be an int", id="float"),
        pytest.param(-4, ValueError, "need_size=-4 must be >= 0", id="negative"),
    ],
)
def test_alloc_bad_need_size_keeps_the_pages(need_sort, need_size, error, match):
    """Before: a float took two pages and then failed slicing its result (pages lost); a
    negative size returned None, the out-of-memory answer."""
    a = _alloc(need_sort)
    before = _state(a)
    with pytest.raises(error, match=match):
        a.alloc(need_size)
    assert _state(a) == before
    assert a.alloc(torch.tensor(8)).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]  # 0-d int: accepted


@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize(
    "prefix, seq, last, num_tokens, match",
    [
        pytest.param([0, 3], [5, 6], [-1, 14], 4, "extend_num_tokens=4 must equal", id="short"),
        pytest.param([0, 3], [5, 6], [-1, 14], 12, "extend_num_tokens=12 must equal", id="long"),
        pytest.param([0, 3], [5], [-1, 14], 5, "one length", id="seq_len"),
        pytest.param([6, 3], [5, 6], [-1, 14], 2, r"must be >= 0", id="prefix_gt_seq"),
    ],
)
def test_alloc_extend_inconsistent_batch_is_refused(
    need_sort, prefix, seq, last, num_tokens, match
):
    """Before: a short extend_num_tokens or a negative extend length returned None (read as out
    of memory); a long one returned slot 0 (the padding slot) for the extra entries; a shorter
    seq_lens was padded and slot 0 handed out with the state changed."""
    a = _alloc(need_sort)
    before = _state(a)
    with pytest.raises(ValueError, match=match):
        a.alloc_extend(_t(prefix), _t(prefix), _t(seq), _t(seq), _t(last), num_tokens)
    assert _state(a) == before


def test_alloc_decode_length_mismatch_is_refused():
    """Before: None (the out-of-memory answer)."""
    a = _alloc()
    with pytest.raises(ValueError, match="one length"):
        a.alloc_decode(_t([5, 2]), _t([5, 2]), _t([3]))
    assert a.available_size() == 32


# ---- build_tree_kernel_efficient ----------------------------------------------------------------
def _build(topk=2, mode=0, buf=None):
    return api.build_tree_kernel_efficient(
        _t([7]), _t([[-1, 0, 1, 2, 3]]), _t([[0, 1, 3]]), _t([[1, 2, 3]]), _t([5]), 5, topk, 3, 4,
        mode, buf,
    )  # fmt: skip


@pytest.mark.parametrize(
    "mode, size, dtype",
    [
        pytest.param(0, 35, torch.bool, id="full_mask"),  # needs 5*4 + 4*4 = 36
        pytest.param(1, 15, torch.bool, id="qlen_only"),  # needs 16
        pytest.param(2, 3, torch.uint8, id="bitpacking"),  # needs 4
    ],
)
def test_build_tree_short_mask_buffer_raises_before_filling(mode, size, dtype):
    """Before: the buffer filled (and partly written) and then an IndexError / RuntimeError."""
    buf = (
        torch.full((size,), 2, dtype=dtype)
        if dtype != torch.bool
        else torch.zeros(size, dtype=dtype)
    )
    copy = buf.clone()
    with pytest.raises(ValueError, match=rf"tree_mask_buf.numel\(\)={size} must be >= {size + 1}"):
        _build(mode=mode, buf=buf)
    assert torch.equal(buf, copy)
    _build(mode=mode, buf=torch.zeros(size + 1, dtype=dtype))  # exactly the size needed: fine


@pytest.mark.parametrize("topk", [0, -1])
def test_build_tree_nonpositive_topk_names_topk(topk):
    """Before: ZeroDivisionError (topk=0) or a silently built tree (topk=-1)."""
    with pytest.raises(ValueError, match=f"topk={topk} must be >= 1"):
        _build(topk=topk)


# ---- duplicate_prefix_tail_to_draft_branches / move_kv_cache ---------------------------------------
def test_duplicate_prefix_tail_short_per_request_tensor_is_refused():
    """Before: prefix_base of one entry broadcast against two requests' last_page; request 1's
    prefix-tail copies went to the wrong slots with no error."""
    p = 4
    row = torch.arange(4, 4 + 64, dtype=I32)
    rows = torch.stack([row, row + 64])
    seq = _t([7, 13])
    last_page, base = seq % p, seq - seq % p
    num_new_pages = (last_page + 3 + p - 1) // p
    pool = memory.MHATokenToKVPool(200, p, torch.float32, 1, 2, 1)
    pool.k_buffer[0].copy_(torch.arange(204 * 2, dtype=torch.float32).reshape(204, 1, 2))
    copy = pool.k_buffer[0].clone()
    with pytest.raises(ValueError, match=r"prefix_base.shape=\(1,\) must be \(2,\)"):
        api.duplicate_prefix_tail_to_draft_branches(
            pool, rows, base[:1], last_page, num_new_pages, 2, p
        )
    assert torch.equal(pool.k_buffer[0], copy)


def test_move_kv_cache_writes_buffers_that_require_grad():
    """Before: the K buffers were moved, then a RuntimeError on the first V buffer (half done).
    Now both move, as sglang's Triton copy writes them."""
    k = [torch.arange(16.0).reshape(8, 1, 2) for _ in range(2)]
    v = [(torch.arange(16.0).reshape(8, 1, 2) + 100).requires_grad_() for _ in range(2)]
    api.move_kv_cache(k, v, _t([1, 2]), _t([3, 4]))
    for layer in range(2):
        assert k[layer][:3, 0, 0].tolist() == [0.0, 6.0, 8.0]
        assert v[layer][:3, 0, 0].tolist() == [100.0, 106.0, 108.0]
