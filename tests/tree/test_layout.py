"""Draft layout: out_cache_loc, prefix-tail pairs, positions (SPEC.md §4.2, §4.3, §14).

Oracles: the SPEC §14 worked example and an independent python loop written from SPEC §4
(two branches, contiguous and holey, exactly as sglang's code splits them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import probes
from jspec.kernels.draft_cache_loc import (
    _draft_cache_loc_pallas,
    draft_cache_loc,
    draft_cache_loc_reference,
    max_prefix_tail_pairs,
)
from jspec.tree.layout import (
    draft_out_cache_loc,
    draft_positions,
    prefix_tail_copy_pairs,
)
from poisoned_outputs import POISON, poisoned_outputs
from tree_geometry import geom, with_geometry


# ---- independent oracle ------------------------------------------------------------------------
def loop_layout(r2t, rpi, seq_lens, valid, *, topk, num_steps, page_size, max_pairs):
    """SPEC §4.2/§4.3 as plain python loops (no shared formula with jspec)."""
    batch = len(rpi)
    out = np.zeros((batch, topk, num_steps), np.int64)
    tgt, src = [], []
    for b in range(batch):
        if not valid[b]:
            continue
        row = r2t[rpi[b]]
        length = int(seq_lens[b])
        if page_size == 1 or topk == 1:
            for t in range(topk):
                for s in range(num_steps):
                    out[b, t, s] = row[length + t * num_steps + s]
            continue
        lp = length % page_size
        base = length - lp
        nnp = -(-(lp + num_steps) // page_size)
        for t in range(topk):
            for s in range(num_steps):
                out[b, t, s] = row[base + t * nnp * page_size + lp + s]
        for t in range(1, topk):
            for o in range(page_size):
                if o < lp:
                    src.append(row[base + o])
                    tgt.append(row[base + t * nnp * page_size + o])
    num_pairs = len(tgt)
    tgt = (tgt + [0] * max_pairs)[:max_pairs]
    src = (src + [0] * max_pairs)[:max_pairs]
    return out, np.array(tgt, np.int64), np.array(src, np.int64), num_pairs


def footprint(length, *, topk, num_steps, page_size):
    lp = length % page_size
    return length - lp + topk * -(-(lp + num_steps) // page_size) * page_size


def random_case(rng, *, batch, topk, num_steps, page_size, rows=None, pad_frac=0.25):
    """Random rows of distinct slot ids >= 1; lengths straddle page boundaries; padding rows.

    Positions past each request's draft footprint (and all of padding row 0) hold POISON.
    """
    p = page_size
    choices = [0, 1, p - 1, p, p + 1, 2 * p - 1, 3 * p, 5 * p + 2]
    seq_lens = np.array(
        [
            max(
                0,
                int(rng.choice(choices)) if rng.random() < 0.6 else int(rng.integers(0, 6 * p + 3)),
            )
            for _ in range(batch)
        ]
    )
    width = max(
        footprint(int(x), topk=topk, num_steps=num_steps, page_size=p) for x in seq_lens
    ) + int(rng.integers(0, 3))
    rows = rows or batch + 2
    r2t = np.full((rows, width), POISON, np.int64)
    perm = rng.permutation(rows * width)[: rows * width] + 1
    r2t[1:] = perm[: (rows - 1) * width].reshape(rows - 1, width)
    rpi = rng.permutation(np.arange(1, rows))[:batch]
    valid = rng.random(batch) >= pad_frac
    rpi = np.where(valid, rpi, 0)
    for b in range(batch):
        if valid[b]:
            f = footprint(int(seq_lens[b]), topk=topk, num_steps=num_steps, page_size=p)
            r2t[rpi[b], f:] = POISON
    return (
        jnp.asarray(r2t, jnp.int32),
        jnp.asarray(rpi, jnp.int32),
        jnp.asarray(seq_lens, jnp.int32),
        jnp.asarray(valid),
    )


def _np(*xs):
    return [np.asarray(x) for x in xs]


# ---- SPEC §14 worked example -----------------------------------------------------------------
def test_spec14_worked_example_layout() -> None:
    width = 48
    row = 1000 + np.arange(width)
    r2t = np.zeros((2, width), np.int32)
    r2t[1] = row
    args = (jnp.asarray(r2t), jnp.array([1], jnp.int32), jnp.array([7], jnp.int32))
    out = draft_out_cache_loc(*args, geometry=geom(topk=2, num_steps=3, page_size=4))
    np.testing.assert_array_equal(np.asarray(out).reshape(-1), row[[7, 8, 9, 15, 16, 17]])
    tgt, src, n = prefix_tail_copy_pairs(
        *args, geometry=geom(topk=2, num_steps=3, page_size=4), max_pairs=5
    )
    assert int(n) == 3
    np.testing.assert_array_equal(np.asarray(tgt), list(row[[12, 13, 14]]) + [0, 0])
    np.testing.assert_array_equal(np.asarray(src), list(row[[4, 5, 6]]) + [0, 0])
    np.testing.assert_array_equal(np.asarray(draft_positions(args[2], topk=2)), [7, 7])


@pytest.mark.parametrize("page_size,topk", [(1, 4), (16, 1)], ids=["P1", "K1"])
def test_contiguous_layout(page_size, topk) -> None:
    row = 500 + np.arange(64)
    r2t = jnp.asarray(np.stack([np.zeros(64), row]).astype(np.int32))
    out = draft_out_cache_loc(
        r2t,
        jnp.array([1], jnp.int32),
        jnp.array([9], jnp.int32),
        geometry=geom(topk=topk, num_steps=3, page_size=page_size),
    )
    np.testing.assert_array_equal(np.asarray(out).reshape(-1), row[9 : 9 + topk * 3])
    tgt, src, n = prefix_tail_copy_pairs(
        r2t,
        jnp.array([1], jnp.int32),
        jnp.array([9], jnp.int32),
        geometry=geom(topk=topk, num_steps=3, page_size=page_size),
        max_pairs=4,
    )
    assert int(n) == 0 and not np.asarray(tgt).any() and not np.asarray(src).any()


# ---- reference vs the loop oracle --------------------------------------------------------------
CASES = [
    pytest.param(1, 4, 3, id="P1K4"),
    pytest.param(2, 2, 1, id="P2K2S1"),
    pytest.param(4, 2, 3, id="P4K2S3"),
    pytest.param(4, 8, 5, id="P4K8S5"),
    pytest.param(16, 4, 6, id="P16K4S6"),
    pytest.param(16, 1, 5, id="P16K1"),
    pytest.param(64, 8, 5, id="P64K8S5"),
    pytest.param(8, 5, 8, id="P8K5S8"),
]


@pytest.mark.parametrize("page_size,topk,num_steps", CASES)
def test_reference_matches_loop(page_size, topk, num_steps) -> None:
    rng = np.random.default_rng(page_size * 100 + topk * 10 + num_steps)
    for trial in range(3):
        batch = int(rng.integers(1, 7))
        r2t, rpi, seq, valid = random_case(
            rng, batch=batch, topk=topk, num_steps=num_steps, page_size=page_size
        )
        max_pairs = (
            max_prefix_tail_pairs(batch, geometry=geom(topk=topk, page_size=page_size)) + trial
        )
        got = draft_cache_loc(
            r2t,
            rpi,
            seq,
            valid,
            geometry=geom(topk=topk, num_steps=num_steps, page_size=page_size),
            max_pairs=max_pairs,
        )
        want = loop_layout(
            *_np(r2t, rpi, seq, valid),
            topk=topk,
            num_steps=num_steps,
            page_size=page_size,
            max_pairs=max_pairs,
        )
        for g, w in zip(_np(*got[:3]), want[:3]):
            np.testing.assert_array_equal(g, w)
        assert int(got[3]) == want[3]
        # poison: nothing outside a live footprint (nor row 0) was read.
        assert POISON not in np.asarray(got[0]) and POISON not in np.asarray(got[1])


def test_truncated_pairs_keep_order_and_count() -> None:
    rng = np.random.default_rng(3)
    r2t, rpi, seq, valid = random_case(rng, batch=6, topk=4, num_steps=3, page_size=8, pad_frac=0.0)
    seq = seq.at[:].set(jnp.array([5, 7, 3, 6, 1, 2], jnp.int32))
    full = loop_layout(*_np(r2t, rpi, seq, valid), topk=4, num_steps=3, page_size=8, max_pairs=200)
    _, tgt, src, n = draft_cache_loc(
        r2t, rpi, seq, valid, geometry=geom(topk=4, num_steps=3, page_size=8), max_pairs=20
    )
    assert int(n) == full[3] == 3 * 24
    np.testing.assert_array_equal(np.asarray(tgt), full[1][:20])
    np.testing.assert_array_equal(np.asarray(src), full[2][:20])


def test_positions_repeat_interleave() -> None:
    seq = jnp.array([5, 0, 17], jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(draft_positions(seq, topk=3)), [5, 5, 5, 0, 0, 0, 17, 17, 17]
    )


# ---- Pallas kernel vs reference ------------------------------------------------------------------
@pytest.mark.parametrize(
    "page_size,topk,num_steps", [(1, 4, 3), (4, 2, 3), (16, 4, 5), (64, 8, 5), (8, 3, 2), (4, 1, 3)]
)
def test_pallas_matches_reference(interpret, page_size, topk, num_steps) -> None:
    rng = np.random.default_rng(7 + page_size + topk)
    batch = 5
    r2t, rpi, seq, valid = random_case(
        rng, batch=batch, topk=topk, num_steps=num_steps, page_size=page_size
    )
    max_pairs = max_prefix_tail_pairs(batch, geometry=geom(topk=topk, page_size=page_size))
    # truncated pair buffers on one case only (each size is another interpret compile)
    for mp in sorted({max_pairs, max_pairs // 3} if page_size == 16 else {max_pairs}):
        kw = {"topk": topk, "num_steps": num_steps, "page_size": page_size, "max_pairs": mp}
        want = draft_cache_loc_reference(r2t, rpi, seq, valid, **with_geometry(kw))
        got = draft_cache_loc(
            r2t, rpi, seq, valid, impl="pallas", interpret=interpret, **with_geometry(kw)
        )
        for g, w in zip(_np(*got), _np(*want)):
            np.testing.assert_array_equal(g, w)
        assert POISON not in np.asarray(got[0]) and POISON not in np.asarray(got[2])


def test_pallas_poisoned_pair_buffers(interpret) -> None:
    """The kernel writes exactly [0, num_pairs) of the pair buffers: the tail keeps the poison."""
    rng = np.random.default_rng(21)
    r2t, rpi, seq, valid = random_case(rng, batch=4, topk=4, num_steps=3, page_size=8)
    kw = {
        "topk": 4,
        "num_steps": 3,
        "page_size": 8,
        "max_pairs": max_prefix_tail_pairs(4, geometry=geom(topk=4, page_size=8)),
    }
    want = draft_cache_loc_reference(r2t, rpi, seq, valid, **with_geometry(kw))
    with poisoned_outputs():  # every output, the pair buffers included, starts as POISON
        out, tgt, src, n = jax.jit(
            lambda *a: _draft_cache_loc_pallas(*a, interpret=interpret, **kw)
        )(r2t, rpi, seq, valid)
    n = int(n)
    assert n == int(want[3]) and n > 0
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want[0]))
    for got, ref in ((tgt, want[1]), (src, want[2])):
        np.testing.assert_array_equal(np.asarray(got)[:n], np.asarray(ref)[:n])
        assert (np.asarray(got)[n:] == POISON).all()


def test_pallas_all_padding_rows(interpret) -> None:
    r2t = jnp.full((3, 40), POISON, jnp.int32)
    rpi = jnp.zeros((4,), jnp.int32)
    seq = jnp.array([1, 7, 3, 0], jnp.int32)
    valid = jnp.zeros((4,), bool)
    out, tgt, src, n = draft_cache_loc(
        r2t,
        rpi,
        seq,
        valid,
        geometry=geom(topk=2, num_steps=3, page_size=4),
        max_pairs=12,
        impl="pallas",
        interpret=interpret,
    )
    assert int(n) == 0
    assert not np.asarray(out).any() and not np.asarray(tgt).any() and not np.asarray(src).any()


# ---- static checks and probes ----------------------------------------------------------------
def _small():
    r2t = jnp.arange(2 * 32, dtype=jnp.int32).reshape(2, 32)
    return r2t, jnp.array([1], jnp.int32), jnp.array([5], jnp.int32)


@pytest.mark.parametrize(
    "kw,pattern",
    [
        ({"page_size": 3}, "page_size=3 must be a power of 2"),
        ({"topk": 0}, "topk=0 must be an int >= 1"),
        ({"num_steps": 0}, "num_steps=0 must be an int >= 1"),
        ({"max_pairs": -1}, "max_pairs=-1"),
        ({"impl": "cuda"}, "impl='cuda' is not available for draft_cache_loc"),
    ],
)
def test_static_errors(kw, pattern) -> None:
    args = {"topk": 2, "num_steps": 3, "page_size": 4, "max_pairs": 4} | kw
    with pytest.raises(ValueError, match=pattern):
        draft_cache_loc(*_small(), **with_geometry(args))


def test_static_dtype_and_shape_errors() -> None:
    r2t, rpi, seq = _small()
    kw = {"topk": 2, "num_steps": 3, "page_size": 4, "max_pairs": 4}
    with pytest.raises(ValueError, match="req_to_token.dtype"):
        draft_cache_loc(r2t.astype(jnp.float32), rpi, seq, **with_geometry(kw))
    with pytest.raises(ValueError, match=r"seq_lens.shape=\(2,\) must be \(1,\)"):
        draft_cache_loc(r2t, rpi, jnp.array([5, 6], jnp.int32), **with_geometry(kw))


def test_probe_footprint_past_row_width() -> None:
    r2t, rpi, _ = _small()

    def fn(s):
        return draft_out_cache_loc(r2t, rpi, s, geometry=geom(topk=2, num_steps=3, page_size=4))

    probes.checked(fn)(jnp.array([20], jnp.int32))  # footprint 16 + 2*8 = 32 == width: fine
    with pytest.raises(probes.ProbeError, match=r"draft footprint.*max value 36 > high bound 32"):
        probes.checked(fn)(jnp.array([29], jnp.int32))  # 28 + 2*4


def test_probe_pairs_overflow() -> None:
    r2t, rpi, _ = _small()

    def fn(s):
        return prefix_tail_copy_pairs(
            r2t, rpi, s, geometry=geom(topk=2, num_steps=1, page_size=4), max_pairs=2
        )

    probes.checked(fn)(jnp.array([2], jnp.int32))  # lp=2: 2 pairs fit
    with pytest.raises(probes.ProbeError, match="num_pairs 3 exceeds max_pairs=2"):
        probes.checked(fn)(jnp.array([3], jnp.int32))


def test_probes_off_add_nothing() -> None:
    r2t, rpi, seq = _small()
    kw = {"topk": 2, "num_steps": 3, "page_size": 4, "max_pairs": 4}
    assert not probes.probes_on()
    jaxpr = str(jax.make_jaxpr(lambda s: draft_cache_loc(r2t, rpi, s, **with_geometry(kw)))(seq))
    assert "check" not in jaxpr
