"""The raw Triton paged attention kernel (``jspec.kernels.paged_attention_triton``).

On CPU the kernel runs in Triton's interpreter on torch tensors (``TRITON_INTERPRET=1`` must be
set before triton is first imported: ``triton_interpret``, imported first, sets it; if triton
was already imported compiled by an earlier module of the same pytest process, the file re-runs
itself in a fresh subprocess). With ``JSPEC_TEST_GPU=1`` it runs compiled through ``jax_triton`` as
``paged_attention(..., impl="triton")`` against the pure-jnp reference.

Oracle: an independent f64 numpy loop over the visible keys only. Pool rows no query sees
(unlisted slots, every other layer, listed-but-masked columns) hold NaN: reading one fails.
"""

from __future__ import annotations

# isort: off
from triton_interpret import (  # first: sets TRITON_INTERPRET before triton is imported
    in_process,
    rerun_here,
    rerun_in_fresh_process,
)
# isort: on

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jspec.kernels import paged_attention_triton as pat
from jspec.kernels.paged_attention import paged_attention

# (Bp, Qp, Hq, Hkv, D, W, mask kind, tuning): decode / draft A / draft B / verify tree /
# extend-causal; MQA, GQA, MHA; Qp 1, 8, odd; W not a power of 2; forced splits.
CASES = [
    pytest.param(3, 1, 8, 2, 128, 70, "length", {}, id="decode-gqa4-d128"),
    pytest.param(2, 8, 4, 1, 64, 48, "length", {"block_n": 16}, id="draftA-mqa-d64"),
    pytest.param(
        4, 1, 4, 4, 64, 37, "length", {"block_n": 16, "num_splits": 3}, id="draftB-mha-w37-split3"
    ),
    pytest.param(2, 8, 8, 2, 128, 8, "tree", {}, id="verify-tree-q8"),
    pytest.param(
        2, 5, 4, 2, 64, 29, "causal", {"block_n": 16, "num_splits": 2}, id="extend-causal-q5"
    ),
    pytest.param(2, 3, 2, 1, 64, 100, "random", {"block_n": 32, "block_m": 16}, id="random-q3"),
    pytest.param(1, 20, 8, 2, 64, 33, "causal", {"block_m": 32, "block_n": 16}, id="rowblocks-q20"),
]
DTYPES = [pytest.param(np.float32, id="f32"), pytest.param("bfloat16", id="bf16")]


def _mask(rng, kind: str, bp: int, qp: int, w: int) -> np.ndarray:
    cols = np.arange(w)
    if kind == "length":
        lens = rng.integers(0, w + 1, bp)
        lens[0] = w
        lens[-1] = 0  # a row that sees nothing
        return np.broadcast_to((cols[None, :] < lens[:, None])[:, None, :], (bp, qp, w)).copy()
    if kind == "causal":
        starts = rng.integers(-2, w - qp + 1, bp)
        last = starts[:, None] + np.arange(qp)[None, :]
        return cols[None, None, :] <= last[:, :, None]
    if kind == "tree":  # ancestors (random lower-triangular) + self
        anc = np.tril(rng.random((bp, qp, w)) < 0.4, k=-1)
        return anc | np.eye(qp, w, dtype=bool)[None]
    mask = rng.random((bp, qp, w)) < 0.3
    mask[0, 0] = False
    return mask


def _case(rng, bp, qp, hq, hkv, d, w, kind, dtype, *, num_layers=3, layer=1):
    num_slots = bp * w + 11
    slots = rng.permutation(np.arange(1, num_slots))[: bp * w].reshape(bp, w).astype(np.int32)
    mask = _mask(rng, kind, bp, qp, w)
    k_pool = np.full((num_layers, num_slots, hkv, d), np.nan, np.float32)
    v_pool = np.full_like(k_pool, np.nan)
    seen = mask.any(axis=1)  # [Bp, W]: columns some query sees get finite values
    k_pool[layer, slots[seen]] = 2.0 * rng.standard_normal((int(seen.sum()), hkv, d))
    v_pool[layer, slots[seen]] = rng.standard_normal((int(seen.sum()), hkv, d))
    q = 2.0 * rng.standard_normal((bp, qp, hq, d)).astype(np.float32)
    if dtype == "bfloat16":  # round to bf16 so the oracle sees the kernel's exact inputs
        k_pool, v_pool, q = (
            np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
            for x in (k_pool, v_pool, q)
        )
    return q, k_pool, v_pool, slots, mask


def _oracle(q, k_layer, v_layer, slots, mask):
    bp, qp, hq, d = q.shape
    group = hq // k_layer.shape[1]
    out = np.zeros((bp, qp, hq, d))
    lse = np.full((bp, qp, hq), -np.inf)
    for b in range(bp):
        for i in range(qp):
            keys = slots[b][mask[b, i]]
            if keys.size == 0:
                continue
            for h in range(hq):
                s = k_layer[keys, h // group].astype(np.float64) @ q[b, i, h] / np.sqrt(d)
                e = np.exp(s - s.max())
                out[b, i, h] = e @ v_layer[keys, h // group] / e.sum()
                lse[b, i, h] = s.max() + np.log(e.sum())
    return out, lse


def _check(got_out, got_lse, want_out, want_lse, dtype):
    assert np.isfinite(got_out).all(), "NaN/inf in out (unwritten or read a poisoned row)"
    empty = np.isneginf(want_lse)
    assert np.isneginf(got_lse[empty]).all() and (got_out[empty] == 0).all()
    atol = 3e-2 if dtype == "bfloat16" else 2e-5
    np.testing.assert_allclose(got_out, want_out, atol=atol, rtol=0)
    np.testing.assert_allclose(got_lse[~empty], want_lse[~empty], atol=atol / 3, rtol=1e-5)


@rerun_here
def test_rerun_in_fresh_process():
    rerun_in_fresh_process(__file__, timeout=900)


@in_process
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bp,qp,hq,hkv,d,w,kind,tuning", CASES)
def test_interpreted_kernel_vs_oracle(bp, qp, hq, hkv, d, w, kind, tuning, dtype):
    rng = np.random.default_rng(bp * 1000 + qp * 100 + w)
    q, k_pool, v_pool, slots, mask = _case(rng, bp, qp, hq, hkv, d, w, kind, dtype)
    tdtype = torch.float32 if dtype == np.float32 else torch.bfloat16
    out, lse = pat.paged_attention_torch(
        torch.tensor(q).to(tdtype),
        torch.tensor(k_pool).to(tdtype),
        torch.tensor(v_pool).to(tdtype),
        1,
        torch.tensor(slots),
        torch.tensor(mask),
        **tuning,
    )
    assert not torch.isnan(lse).any(), "a partial lse was never written"
    got_out, got_lse = pat.merge_torch_partials(out, lse)
    want_out, want_lse = _oracle(q, k_pool[1], v_pool[1], slots, mask)
    _check(got_out, got_lse, want_out, want_lse, dtype)


def test_launch_plan_splits_fill_the_gpu():
    # bs=1 decode over 2k keys: one program per KV head would leave the GPU idle.
    grid, meta, _ = pat.launch_plan(1, 1, 32, 8, 128, 2048, jnp.bfloat16)
    assert grid[0] * grid[1] * grid[2] >= 128 and meta["NS"] == grid[2]
    assert meta["CHUNK"] * meta["NS"] >= 2048 and meta["CHUNK"] % meta["BLOCK_N"] == 0
    assert (meta["NS"] - 1) * meta["CHUNK"] < 2048  # no empty split
    grid, meta, _ = pat.launch_plan(64, 1, 32, 8, 128, 1024, jnp.bfloat16)
    assert grid[:2] == (64, 8) and grid[2] <= 2 and not meta["IEEE"]
    grid, meta, _ = pat.launch_plan(2, 8, 32, 8, 128, 8, jnp.float32)
    assert grid == (2, 8, 1) and meta["IEEE"] and meta["BLOCK_M"] == 32
    # bs=64 decode over a short row (4 key blocks): the grid is half full, no split (measured).
    grid, meta, _ = pat.launch_plan(64, 1, 32, 8, 128, 256, jnp.bfloat16)
    assert grid == (64, 8, 1) and meta["BLOCK_N"] == 64
    # ... but bs=16 over the same row still splits to fill the GPU.
    assert pat.launch_plan(16, 1, 32, 8, 128, 256, jnp.bfloat16)[0][2] > 1


def test_merge_splits_matches_one_pass():
    rng = np.random.default_rng(5)
    out = jnp.asarray(rng.standard_normal((2, 3, 4, 2, 8)), jnp.float32)
    lse = jnp.asarray(rng.standard_normal((2, 3, 4, 2)), jnp.float32)
    lse = lse.at[0, 1].set(-jnp.inf).at[1].set(-jnp.inf)  # an empty split; an empty row
    got_out, got_lse = pat.merge_splits(out, lse)
    w = np.exp(np.asarray(lse, np.float64))
    want_lse = np.log(w.sum(1))
    with np.errstate(invalid="ignore"):
        want_out = (np.asarray(out) * w[..., None]).sum(1) / w.sum(1)[..., None]
    np.testing.assert_allclose(got_lse[0], want_lse[0], rtol=1e-6)
    np.testing.assert_allclose(got_out[0], want_out[0], rtol=1e-5, atol=1e-6)
    assert np.isneginf(np.asarray(got_lse[1])).all() and (np.asarray(got_out[1]) == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bp,qp,hq,hkv,d,w,kind,tuning", CASES)
def test_jax_triton_vs_oracle_on_gpu(bp, qp, hq, hkv, d, w, kind, tuning, dtype):
    rng = np.random.default_rng(bp * 1000 + qp * 100 + w + 1)
    q, k_pool, v_pool, slots, mask = _case(rng, bp, qp, hq, hkv, d, w, kind, dtype)
    jdtype = jnp.float32 if dtype == np.float32 else jnp.bfloat16
    kw = {"block_q": tuning.get("block_m"), "block_w": tuning.get("block_n")}
    got = paged_attention(
        jnp.asarray(q, jdtype),
        jnp.asarray(k_pool, jdtype),
        jnp.asarray(v_pool, jdtype),
        1,
        jnp.asarray(slots),
        jnp.asarray(mask),
        impl="triton",
        **kw,
    )
    want = _oracle(q, k_pool[1], v_pool[1], slots, mask)
    _check(np.asarray(got[0]), np.asarray(got[1]), *want, dtype)


@pytest.mark.gpu
def test_jax_triton_large_decode_bf16_on_gpu():
    """bs 64 x 1000 keys, 32/8 heads x 128 (the 8B decode pass): vs the jnp reference."""
    rng = np.random.default_rng(3)
    bp, w, num_slots = 64, 1000, 70000
    k_pool = jnp.asarray(rng.standard_normal((2, num_slots, 8, 128)), jnp.bfloat16)
    v_pool = jnp.asarray(rng.standard_normal((2, num_slots, 8, 128)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((bp, 1, 32, 128)), jnp.bfloat16)
    slots = jnp.asarray(rng.integers(1, num_slots, (bp, w)), jnp.int32)
    lens = rng.integers(1, w + 1, bp)
    mask = jnp.asarray(np.arange(w)[None, None, :] < lens[:, None, None])
    got = paged_attention(q, k_pool, v_pool, 1, slots, mask, impl="triton")
    want = paged_attention(q, k_pool, v_pool, 1, slots, mask, impl="xla")
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=2e-2)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=1e-3, rtol=1e-4)


_COMPILE_SCRIPT = """
import jax.numpy as jnp
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from jspec.kernels import paged_attention_triton as pat

kernel = pat.get_kernel()
for dtype, ty, qp, d in ((jnp.bfloat16, "*bf16", 1, 128), (jnp.bfloat16, "*bf16", 8, 64),
                         (jnp.float32, "*fp32", 4, 128)):
    grid, meta, opts = pat.launch_plan(64, qp, 32, 8, d, 1024, dtype)
    sig = {n: t for n, t in zip(kernel.arg_names[:9], [ty, ty, ty, "*i32", "*i8", "*i32",
                                                      "*i32", "*fp32", "*fp32"])}
    meta = {**meta, "NUM_SLOTS": 70000}
    sig.update({n: "constexpr" for n in meta})
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=meta),
                              target=GPUTarget("cuda", 90, 32), options=opts)
    assert "cubin" in compiled.asm
print("COMPILED_OK")
"""


def test_kernel_compiles_for_sm90():
    """The compiled (not interpreted) branch: Triton's own compiler on CPU, no GPU needed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("Triton's bundled ptxas is not available")
    assert "COMPILED_OK" in proc.stdout, proc.stderr[-4000:]
