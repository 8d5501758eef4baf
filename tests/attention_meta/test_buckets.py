"""Padded batch buckets (SPEC.md §12): padding values, live-row equivalence, compile counts."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attn_meta_cases import ceil_div, make_draft_batch
from _bucket_padding import BucketedFunction, DraftInputs, pad_draft_inputs, unpad

from jspec import probes
from jspec.attention_meta.kv_indices import generate_draft_decode_kv_indices
from jspec.attention_meta.page_table import draft_decode_metadata
from jspec.config import BatchBuckets
from tree_geometry import geom

I32 = np.int32
TOPK, STEPS, PAGE, HIDDEN, VOCAB = 2, 3, 4, 8, 100
MAX_BS = 4


def _pool(rng: np.random.Generator, max_bs: int = MAX_BS):
    """A req_to_token pool holding ``max_bs`` live requests (rows 1..max_bs; row 0 = padding)."""
    seq_lens = rng.integers(1, 4 * PAGE + 3, size=max_bs)
    batch = make_draft_batch(
        rng, seq_lens, topk=TOPK, num_steps=STEPS, page_size=PAGE, num_req_rows=max_bs + 1
    )
    assert not np.any(batch["req_to_token"][0])  # the padding row
    return batch


def _inputs(batch, raw_bs: int, rng: np.random.Generator) -> DraftInputs:
    seq_lens = batch["seq_lens"][:raw_bs]
    return DraftInputs(
        seq_lens=jnp.asarray(seq_lens),
        req_pool_indices=jnp.asarray(batch["req_pool_indices"][:raw_bs]),
        out_cache_loc=jnp.asarray(batch["out_cache_loc"][:raw_bs].reshape(-1)),
        positions=jnp.asarray(np.repeat(seq_lens, TOPK).astype(I32)),
        topk_p=jnp.asarray(rng.random((raw_bs, TOPK)).astype(np.float32)),
        topk_index=jnp.asarray(rng.integers(0, VOCAB, (raw_bs, TOPK)).astype(I32)),
        hidden=jnp.asarray(rng.standard_normal((raw_bs, HIDDEN)).astype(np.float32)),
    )


def _metadata(padded: DraftInputs, seq_lens_sum, req_to_token, *, width: int, max_pages: int):
    kv_indices, kv_indptr = generate_draft_decode_kv_indices(
        padded.req_pool_indices,
        req_to_token,
        padded.seq_lens,
        geometry=geom(topk=TOPK, num_steps=STEPS, page_size=PAGE),
        kv_indices_width=width,
    )
    fa3 = draft_decode_metadata(
        req_to_token,
        padded.req_pool_indices,
        padded.seq_lens,
        padded.out_cache_loc,
        geometry=geom(topk=TOPK, num_steps=STEPS, page_size=PAGE),
        max_pages=max_pages,
    )
    return {
        "kv_indices": kv_indices,
        "kv_indptr": kv_indptr,
        "fa3": fa3,
        "seq_lens_sum": seq_lens_sum,
    }


# ---- BatchBuckets ------------------------------------------------------------------------------
def test_batch_buckets_validation_and_lookup():
    buckets = BatchBuckets((1, 2, 4, 8))
    assert [buckets.bucket_for(n) for n in range(9)] == [1, 1, 2, 4, 4, 8, 8, 8, 8]
    assert buckets.max_bs == 8
    with pytest.raises(ValueError, match="raw_bs=9 exceeds the largest bucket 8"):
        buckets.bucket_for(9)
    for bad, msg in [
        ((), "at least one"),
        ((2, 1), "sorted"),
        ((1, 1), "sorted"),
        ((0, 2), ">= 1"),
        ((1.5,), ">= 1"),
    ]:
        with pytest.raises(ValueError, match=msg):
            BatchBuckets(bad)


# ---- padding -----------------------------------------------------------------------------------
def test_pad_values_and_seq_lens_sum():
    """SPEC.md §12 fill values; sglang's graph-runner test: raw [10, 11] -> 10+11+1+1."""
    rng = np.random.default_rng(0)
    raw = DraftInputs(
        seq_lens=jnp.asarray([10, 11], I32),
        req_pool_indices=jnp.asarray([3, 5], I32),
        out_cache_loc=jnp.arange(1, 2 * TOPK * STEPS + 1, dtype=jnp.int32),
        positions=jnp.asarray([10, 10, 11, 11], I32),
        topk_p=jnp.full((2, TOPK), 0.5, jnp.float32),
        topk_index=jnp.full((2, TOPK), 7, jnp.int32),
        hidden=jnp.asarray(rng.standard_normal((2, HIDDEN)), jnp.bfloat16),
    )
    padded, seq_lens_sum = pad_draft_inputs(raw, 4, vocab_size=VOCAB)
    assert int(seq_lens_sum) == 10 + 11 + 1 + 1
    assert int(seq_lens_sum) == int(jnp.sum(padded.seq_lens))
    np.testing.assert_array_equal(padded.seq_lens, [10, 11, 1, 1])
    np.testing.assert_array_equal(padded.req_pool_indices, [3, 5, 0, 0])
    np.testing.assert_array_equal(padded.out_cache_loc[:12], np.arange(1, 13))
    assert padded.out_cache_loc.shape == (4 * TOPK * STEPS,)
    assert not np.any(padded.out_cache_loc[12:])
    np.testing.assert_array_equal(padded.positions, [10, 10, 11, 11, 0, 0, 0, 0])
    assert not np.any(padded.topk_p[2:]) and not np.any(padded.topk_index[2:])
    assert padded.hidden.dtype == jnp.bfloat16 and not np.any(padded.hidden[2:])
    np.testing.assert_array_equal(padded.hidden[:2], raw.hidden)
    # bucket == raw: no padding at all.
    same, total = pad_draft_inputs(raw, 2)
    assert int(total) == 21 and same.seq_lens.shape == (2,)
    with pytest.raises(ValueError, match="bucket=1 must be an int >= max"):
        pad_draft_inputs(raw, 1)


def test_pad_empty_batch():
    empty = DraftInputs(
        seq_lens=jnp.zeros((0,), I32),
        req_pool_indices=jnp.zeros((0,), I32),
        out_cache_loc=jnp.zeros((0,), I32),
        positions=jnp.zeros((0,), I32),
        topk_p=jnp.zeros((0, TOPK), jnp.float32),
        topk_index=jnp.zeros((0, TOPK), I32),
        hidden=jnp.zeros((0, HIDDEN), jnp.float32),
    )
    with pytest.raises(ValueError, match="num_steps must be given"):
        pad_draft_inputs(empty, 2)
    padded, total = pad_draft_inputs(empty, 2, num_steps=STEPS)
    assert int(total) == 2 and padded.out_cache_loc.shape == (2 * TOPK * STEPS,)


def test_every_bucket_size_matches_unpadded_live_rows():
    """Every raw_bs in 1..max and every padded size raw_bs..max: live outputs unchanged and
    padding rows only reference request row 0 / slot 0."""
    rng = np.random.default_rng(1)
    batch = _pool(rng)
    req_to_token = jnp.asarray(batch["req_to_token"])
    context = batch["req_to_token"].shape[1]
    width = MAX_BS * TOPK * context  # SpecConfig.kv_indices_width(max_bs)
    max_pages = ceil_div(context, PAGE)
    run = jax.jit(functools.partial(_metadata, width=width, max_pages=max_pages))
    for raw_bs in range(1, MAX_BS + 1):
        raw = _inputs(batch, raw_bs, rng)
        raw_sum = int(jnp.sum(raw.seq_lens))
        want = run(raw, jnp.int32(raw_sum), req_to_token)
        for bucket in range(raw_bs, MAX_BS + 1):
            padded, seq_lens_sum = pad_draft_inputs(raw, bucket, vocab_size=VOCAB)
            # Padding rows reference only req_to_token row 0 and slot 0.
            assert not np.any(padded.req_pool_indices[raw_bs:])
            assert not np.any(padded.out_cache_loc[raw_bs * TOPK * STEPS :])
            got = run(padded, seq_lens_sum, req_to_token)
            assert int(got["seq_lens_sum"]) == raw_sum + (bucket - raw_bs)
            rows = raw_bs * TOPK
            np.testing.assert_array_equal(got["kv_indptr"][:, : rows + 1], want["kv_indptr"])
            used_raw = np.asarray(want["kv_indptr"][:, -1])
            used_pad = np.asarray(got["kv_indptr"][:, -1])
            for i in range(STEPS):
                np.testing.assert_array_equal(
                    got["kv_indices"][i, : used_raw[i]], want["kv_indices"][i, : used_raw[i]]
                )
                assert not np.any(got["kv_indices"][i, used_raw[i] : used_pad[i]])  # slot 0 only
            fa3, fa3_raw = got["fa3"], want["fa3"]
            np.testing.assert_array_equal(fa3.normal.page_table[:raw_bs], fa3_raw.normal.page_table)
            np.testing.assert_array_equal(
                fa3.normal.cache_seqlens[:raw_bs], fa3_raw.normal.cache_seqlens
            )
            assert not np.any(fa3.normal.page_table[raw_bs:])
            np.testing.assert_array_equal(
                fa3.expand.page_table[:, :rows], fa3_raw.expand.page_table
            )
            np.testing.assert_array_equal(
                fa3.expand.cache_seqlens[:, :rows], fa3_raw.expand.cache_seqlens
            )
            assert not np.any(fa3.expand.page_table[:, rows:])  # page 0 only


def test_bucketed_function_compiles_once_per_bucket():
    rng = np.random.default_rng(2)
    batch = _pool(rng, max_bs=8)
    req_to_token = jnp.asarray(batch["req_to_token"])

    def fn(padded: DraftInputs, seq_lens_sum, rtt):
        slots = rtt[padded.req_pool_indices, 0]  # i32[bucket]
        return {
            "first_slot": slots,
            "branch_pos": padded.positions + 1,
            "seq_lens_sum": seq_lens_sum,
        }

    bucketed = BucketedFunction(fn, BatchBuckets((1, 2, 4, 8)), vocab_size=VOCAB)
    for _ in range(2):
        for raw_bs in range(1, 9):
            raw = _inputs(batch, raw_bs, rng)
            out = bucketed(raw, req_to_token)
            np.testing.assert_array_equal(
                out["first_slot"], batch["req_to_token"][batch["req_pool_indices"][:raw_bs], 0]
            )
            assert out["branch_pos"].shape == (raw_bs * TOPK,)
            assert int(out["seq_lens_sum"]) == int(jnp.sum(raw.seq_lens)) + (
                bucketed.buckets.bucket_for(raw_bs) - raw_bs
            )
    assert bucketed.buckets_used == {1, 2, 4, 8}
    assert bucketed.compile_count == len(bucketed.buckets_used) == 4
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        bucketed(_inputs(_pool(rng, max_bs=9), 9, rng), req_to_token)


def test_unpad():
    out = {
        "per_seq": jnp.arange(8),
        "per_branch": jnp.arange(16).reshape(16, 1),
        "scalar": jnp.int32(3),
        "other": jnp.arange(5),
    }
    cut = unpad(out, 3, bucket=8)
    assert cut["per_seq"].shape == (3,) and cut["per_branch"].shape == (6, 1)
    assert cut["scalar"].shape == () and cut["other"].shape == (5,)
    assert unpad(out, 3)["other"].shape == (3,)


# ---- probes (seed fix: detect, do not clamp) ----------------------------------------------------
def test_pad_probes():
    rng = np.random.default_rng(3)
    raw = _inputs(_pool(rng), 3, rng)
    fn = functools.partial(pad_draft_inputs, bucket=4, vocab_size=VOCAB)
    nan_p = dataclasses.replace(raw, topk_p=raw.topk_p.at[1, 1].set(jnp.nan))
    with pytest.raises(
        probes.ProbeError,
        match=r"pad_draft_inputs: topk_p: 1 NaN value\(s\), first at flat index 3",
    ):
        probes.checked(fn)(nan_p)
    oob = dataclasses.replace(raw, topk_index=raw.topk_index.at[2, 0].set(VOCAB))
    with pytest.raises(
        probes.ProbeError, match="topk_index vs vocab_size=100: max value 100 >= high bound 100"
    ):
        probes.checked(fn)(oob)
    neg = dataclasses.replace(raw, topk_index=raw.topk_index.at[0, 0].set(-1))
    with pytest.raises(probes.ProbeError, match="min value -1 < low bound 0"):
        probes.checked(fn)(neg)
    probes.checked(fn)(raw)  # valid: nothing fires
    # Probes off: nothing fires and the jaxpr is the one without any probe.
    fn(nan_p)
    no_vocab = functools.partial(pad_draft_inputs, bucket=4)
    assert str(jax.make_jaxpr(fn)(oob)) == str(jax.make_jaxpr(no_vocab)(oob))
