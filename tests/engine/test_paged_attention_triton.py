"""The raw Triton paged attention kernel (``jspec.kernels.paged_attention_triton``).

On CPU the kernel runs in Triton's interpreter on torch tensors (``TRITON_INTERPRET=1`` must be
set before triton is first imported: ``triton_interpret``, imported first, sets it; if triton
was already imported compiled by an earlier module of the same pytest process, the file re-runs
itself in a fresh subprocess). With ``JSPEC_TEST_GPU=1`` it runs compiled through ``jax_triton``
as ``paged_attention(..., impl="triton")`` against the compiled pure-jnp reference.

Oracle: paged_attention_cases' f64 loop over the keys each query sees; every pool position the
pass does not read is NaN and the outputs are NaN-poisoned before the launch, so a kernel that
reads one position too many or leaves an output unwritten fails. Every launch-plan branch runs:
splits or none, the tail in the last split, in a split of its own or no tail, causal full / masked blocks, the prefill
plan, several row blocks, block_n below and above the page size; a mutated kernel (a causal
limit one key off) must fail the same checks.
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

import jax
import jax.numpy as jnp
import numpy as np
import paged_attention_cases as pc
import pytest

torch = pytest.importorskip("torch")

from jspec.kernels import paged_attention_triton as pat
from jspec.kernels.paged_attention import paged_attention

# (case, launch knobs): the defaults of each pass shape plus forced branches.
KERNEL_CASES = [
    pytest.param("decode-gqa4-p16", {}, id="decode-default-splits"),
    pytest.param("decode-gqa4-p16", {"num_splits": 1}, id="decode-nosplit"),
    pytest.param("decode-gqa4-p16", {"block_n": 16, "num_splits": 2}, id="decode-bn16"),
    pytest.param("draftA-k4-mqa", {}, id="draftA"),
    pytest.param("draftB-expand-shared", {}, id="draftB-shared-pages"),
    pytest.param("tokens-p1", {"block_n": 16}, id="p1-bn16"),
    pytest.param("mha-p64", {"block_n": 16, "num_splits": 4}, id="p64-bn16-split4"),
    pytest.param("verify-tree-n8", {}, id="verify-tree"),
    pytest.param("verify-tree-n8", {"num_splits": 3, "block_n": 16}, id="verify-tree-split3"),
    pytest.param(
        "verify-tree-n8",
        {"num_splits": 3, "block_n": 16, "tail_split": False},
        id="verify-tail-in-last-split",
    ),
    pytest.param("verify-tree-n8", {"num_splits": 1, "tail_split": True}, id="verify-tail-split"),
    pytest.param(
        "causal-tail-ragged",
        {"block_n": 16, "num_splits": 2, "tail_split": True},
        id="causal-tail-split",
    ),
    pytest.param("tail-only", {"tail_split": False}, id="tail-only-no-split"),
    pytest.param("extend-causal-tail-n16", {"block_m": 16}, id="extend-rowblocks"),
    pytest.param("tail-random-d24", {}, id="tail-d24"),
    pytest.param("tail-random-n24", {"block_n": 16, "num_splits": 2}, id="tail-loop-n24"),
    pytest.param("prefill-ragged-mqa", {}, id="prefill-plan"),
    pytest.param(
        "causal-offsets-gqa2", {"block_m": 16, "block_n": 16, "num_splits": 1}, id="causal-full"
    ),
    pytest.param(
        "causal-offsets-gqa2", {"block_m": 16, "block_n": 16, "num_splits": 2}, id="causal-split"
    ),
    pytest.param("causal-small-p1", {}, id="causal-decode-plan"),
    pytest.param("causal-tail-ragged", {"block_n": 16, "num_splits": 2}, id="causal-tail"),
    pytest.param("d80-p16", {}, id="d80"),
    pytest.param("tail-only", {}, id="tail-only"),
    # the launch hint below the rows' lengths (fewer, longer splits: still every key read)
    pytest.param("decode-gqa4-p16", {"max_kv_len": 16}, id="decode-hint-short"),
    pytest.param("verify-tree-n8", {"max_kv_len": 1}, id="verify-hint-short"),
]
BF16_CASES = {"decode-default-splits", "verify-tree-split3", "prefill-plan", "causal-full"}
F32_TOL = {"atol": 2e-5, "lse_atol": 2e-5}
# bf16: p is rounded to bf16 before p @ v (one ulp, 2^-8 relative, of |v| <~ 4); lse is f32.
BF16_TOL = {"atol": 3e-2, "lse_atol": 2e-4}
# The GPU's f32 sums over up to 8k keys run in another order than the reference's.
GPU_F32_TOL = {"atol": 5e-5, "lse_atol": 5e-5}


def _seed(*parts) -> int:
    return sum(ord(c) * (i + 1) for i, c in enumerate("/".join(map(str, parts)))) % 2**31


@rerun_here
def test_rerun_in_fresh_process():
    rerun_in_fresh_process(__file__, timeout=900)


@in_process
@pytest.mark.parametrize("name,tuning", KERNEL_CASES)
def test_interpreted_kernel_vs_oracle(name, tuning, request):
    dtypes = ["float32"] + (["bfloat16"] if request.node.callspec.id in BF16_CASES else [])
    for dtype in dtypes:
        case = pc.make_case(
            np.random.default_rng(_seed(name, dtype)), dtype=dtype, **pc.CASES[name]
        )
        out, lse, part_lse = pc.launch_interpreted(case, **tuning)
        assert not np.isnan(part_lse).any(), "a partial lse was never written"
        tol = F32_TOL if dtype == "float32" else BF16_TOL
        pc.check(out, lse, *pc.oracle(case), **tol)


@in_process
@pytest.mark.parametrize(
    "name,tuning",
    [
        pytest.param("decode-gqa4-p16", {"num_splits": 1}, id="one-split-kernel-writes"),
        pytest.param("verify-tree-n8", {"num_splits": 3, "block_n": 16}, id="merge-writes"),
        pytest.param("prefill-ragged-mqa", {}, id="prefill-plan"),
    ],
)
def test_interpreted_out_dtype_is_the_f32_output_cast_once(name, tuning):
    """``out_dtype="bfloat16"`` (the engine's bf16 passes): the kernel (one split) or the split
    merge writes bf16, every number the f32 output cast once, as a convert after an f32 pass
    would give: the same activations without the convert launch. The cast is the
    interpreter's: Triton 3.6's interpreter truncates f32 -> bf16 toward zero (compiled, the
    kernel rounds to nearest even: ``test_jax_triton_out_dtype_on_gpu``)."""
    case = pc.make_case(
        np.random.default_rng(_seed(name, "out")), dtype="bfloat16", **pc.CASES[name]
    )
    out32, lse32, _ = pc.launch_interpreted(case, **tuning)
    out16, lse16, _ = pc.launch_interpreted(case, out_dtype="bfloat16", **tuning)
    truncated = (np.ascontiguousarray(out32, np.float32).view(np.uint32) & 0xFFFF0000).view(
        np.float32
    )
    assert not np.isnan(out16).all()
    np.testing.assert_array_equal(out16, truncated)  # NaN where the f32 run has NaN
    np.testing.assert_array_equal(lse16, lse32)
    assert (out16 != out32).any(), "the bf16 cast must show somewhere (else the check is void)"


@in_process
@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the interpreter's max over NaN rows
def test_interpreted_padding_queries_holding_nan():
    case = pc.make_case(np.random.default_rng(4), **pc.CASES["prefill-ragged-mqa"])
    want = pc.oracle(case)
    for b, q_len in enumerate(case.q_lens):
        case.q[b, q_len:] = np.nan
    pc.check(*pc.launch_interpreted(case)[:2], *want, **F32_TOL)


@in_process
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize(
    "name,tuning",
    [("decode-gqa4-p16", {}), ("prefill-ragged-mqa", {}), ("verify-tree-n8", {"num_splits": 2})],
)
def test_interpreted_nan_at_a_read_position_reaches_the_output(name, tuning, where):
    case = pc.make_case(np.random.default_rng(5), **pc.CASES[name])
    want_out, want_lse = pc.oracle(case)
    b, i, others = pc.plant_nan(case, where)
    out, lse, _ = pc.launch_interpreted(case, **tuning)
    group = case.q.shape[2] // case.k_pool.shape[2]
    assert np.isnan(out[b, i, :group]).any()
    if where == "k":
        assert np.isnan(lse[b, i, :group]).all()
    pc.check(out[others], lse[others], want_out[others], want_lse[others], **F32_TOL)


# Mutants of the kernel that the checks above must catch: a causal limit one key too far
# (masked blocks), a full-block boundary one key too far, the causal rows' reset before the tail.
MUTANTS = [
    pytest.param(
        "lim = offset + query + 1", "lim = offset + query + 2", "causal-offsets-gqa2", id="limit"
    ),
    pytest.param(
        "full = tl.minimum(tl.maximum(offset + q_first + 1, 0), hi)",
        "full = tl.minimum(tl.maximum(offset + q_first + 2, 0), hi)",
        "causal-offsets-gqa2",
        id="full-blocks",
    ),
    pytest.param(
        "if CAUSAL:  # rows past q_lens",
        "if CAUSAL and False:  # rows past q_lens",
        "causal-tail-ragged",
        id="tail-reset",
    ),
]


@in_process
@pytest.mark.parametrize("old,new,name", MUTANTS)
def test_interpreted_mutant_fails(old, new, name):
    case = pc.make_case(np.random.default_rng(_seed(name, "float32")), **pc.CASES[name])
    # the tail after the prefix in one split: where the causal rows' reset matters
    tuning = {"block_m": 16, "block_n": 16, "num_splits": 1, "tail_split": False}
    want = pc.oracle(case)
    pc.check(*pc.launch_interpreted(case, **tuning)[:2], *want, **F32_TOL)  # the real kernel
    out, lse, _ = pc.launch_interpreted(case, kernel=pc.mutated_kernel(old, new), **tuning)
    with pytest.raises(AssertionError):
        pc.check(out, lse, *want, **F32_TOL)


def _plan(batch, qp, context, *, causal=False, tail_len=0, **knobs):
    """8B geometry (32 / 8 heads x 128, bf16, P 16)."""
    return pat.launch_plan(
        batch,
        qp,
        32,
        8,
        128,
        context // 16,
        16,
        tail_len,
        jnp.bfloat16,
        causal=causal,
        **knobs,
    )


def test_launch_plan():
    # bs1 decode over 32k keys: splits fill the GPU with one 16-row tile per KV head.
    grid, meta, opts = _plan(1, 1, 32768)
    assert grid[0] == 8 and grid[0] * grid[1] >= pat.TARGET_PROGRAMS
    assert meta["BLOCK_M"] == 16 and not meta["CAUSAL"] and opts["num_stages"] == 2
    # bs64 decode over a short row: the grid is half full, no split (measured).
    grid, meta, _ = _plan(64, 1, 256)
    assert grid == (64 * 8, 1) and meta["BLOCK_N"] == 64
    assert _plan(16, 1, 256)[0][1] > 1  # ... but bs16 over the same row still splits
    # verify: 8 queries x 4 heads in one 32-row tile, the tail in the same launch: in a split
    # of its own when the prefix splits read one key block each (16 splits, + 1), in the last
    # prefix split when they read more (bs 4 x 2k: 8 splits of 2 blocks; bs 64 x 8k: 1 split).
    grid, meta, opts = _plan(4, 8, 2048, tail_len=8)
    assert meta["BLOCK_M"] == 32 and meta["ROW_BLOCKS"] == 1 and meta["TAIL_LEN"] == 8
    assert meta["TAIL_BLOCK"] == 16  # the 8-key tail as one tile loaded ahead of the prefix
    assert _plan(4, 8, 2048, tail_len=24)[1]["TAIL_BLOCK"] == 0  # past TAIL_TILE_MAX: a loop
    assert _plan(1, 8, 2048, tail_len=8)[1]["TAIL_BLOCK"] == 16  # 16 prefix splits + the tail's
    assert _plan(1, 8, 8192, tail_len=8)[1]["TAIL_BLOCK"] == 0  # 33 splits: a loop (measured)
    assert _plan(4, 1, 2048)[1]["TAIL_BLOCK"] == 0
    assert not meta["TAIL_SPLIT"] and grid == (32, 8) and opts["num_stages"] == 1
    assert _plan(4, 8, 2048, tail_len=8, tail_split=True)[0] == (32, 8 + 1)
    grid, meta, opts = _plan(64, 8, 8192, tail_len=8)
    assert not meta["TAIL_SPLIT"] and grid == (512, 1) and opts["num_stages"] == 2
    # bs 16: about 2 x NUM_SMS programs (2 splits); splits of 1-2 key blocks: no pipelining.
    assert _plan(16, 1, 2048)[0] == (128, 2)
    grid, meta, opts = _plan(1, 8, 2048, tail_len=8)
    assert grid == (8, 16 + 1) and meta["TAIL_SPLIT"] and opts["num_stages"] == 1
    grid, meta, opts = _plan(1, 8, 8192, tail_len=8)  # 33 splits of 2 blocks
    assert grid == (8, 33) and not meta["TAIL_SPLIT"] and opts["num_stages"] == 1
    assert _plan(1, 8, 32768, tail_len=8)[2]["num_stages"] == 2  # 8 blocks a split
    assert not _plan(4, 1, 2048)[1]["TAIL_SPLIT"]  # no tail: no tail split
    # prefill chunk: 128-row tiles (32 queries x 4 heads), 8 warps, no split.
    grid, meta, opts = _plan(1, 8192, 8192, causal=True)
    assert meta["BLOCK_M"] == 128 and meta["ROW_BLOCKS"] == 256 and grid == (256 * 8, 1)
    assert opts == {"num_warps": 8, "num_stages": 5} and meta["BLOCK_N"] == 128
    # a causal pass with few rows takes the decode plan; f32 pools take IEEE dots.
    assert _plan(2, 4, 1024, causal=True)[1]["BLOCK_M"] == 16
    assert pat.launch_plan(1, 1, 4, 2, 32, 4, 16, 0, jnp.float32, causal=False)[1]["IEEE"]
    # knobs override; splits never exceed the key blocks.
    grid, meta, opts = _plan(1, 8192, 8192, causal=True, block_n=128, num_warps=4)
    assert meta["BLOCK_N"] == 128 and opts["num_warps"] == 4
    assert _plan(1, 1, 64, num_splits=50)[0][1] == 2  # 64 keys: two blocks of 32
    # the launch hint: a 128-key batch in an 8k-key table planned for 128 keys (one split, as
    # a 128-key table), not 64 splits for the width; the plan's width never exceeds C.
    wide = pat.launch_plan(1, 1, 32, 8, 128, 512, 16, 0, jnp.bfloat16, causal=False)
    hinted = pat.launch_plan(
        1, 1, 32, 8, 128, pat.plan_pages(512, 16, 128), 16, 0, jnp.bfloat16, causal=False
    )
    assert wide[0] == (8, 33) and hinted[0][1] < 8 and hinted == _plan(1, 1, 128)
    assert pat.plan_pages(512, 16, None) == 512 and pat.plan_pages(512, 16, 10**9) == 512
    assert pat.plan_pages(512, 16, 1) == 1 and pat.plan_pages(512, 16, 17) == 2


def test_merge_splits():
    rng = np.random.default_rng(5)
    out = jnp.asarray(rng.standard_normal((2, 3, 4, 2, 8)), jnp.float32)
    lse = jnp.asarray(rng.standard_normal((2, 3, 4, 2)), jnp.float32)
    lse = lse.at[0, 1].set(-jnp.inf).at[1].set(-jnp.inf)  # an empty split; an empty row
    out = out.at[0, 1].set(jnp.nan)  # an empty split's out is ignored
    got_out, got_lse = pat.merge_splits(out, lse)
    w = np.where(np.isneginf(lse), 0.0, np.exp(np.asarray(lse, np.float64)))
    with np.errstate(divide="ignore"):  # the empty row: log 0
        want_lse = np.log(w.sum(1))
    with np.errstate(invalid="ignore"):  # the empty row: 0 / 0
        want_out = (np.nan_to_num(np.asarray(out)) * w[..., None]).sum(1) / w.sum(1)[..., None]
    np.testing.assert_allclose(got_lse[0], want_lse[0], rtol=1e-6)
    np.testing.assert_allclose(got_out[0], want_out[0], rtol=1e-5, atol=1e-6)
    assert np.isneginf(np.asarray(got_lse[1])).all() and (np.asarray(got_out[1]) == 0).all()
    # a NaN partial that saw keys stays NaN
    nan_out, nan_lse = pat.merge_splits(out.at[0, 2, 0].set(jnp.nan), lse.at[0, 0, 1].set(jnp.nan))
    assert np.isnan(np.asarray(nan_out[0, 0])).all() and np.isnan(np.asarray(nan_lse[0, 1])).all()


@in_process
@pytest.mark.filterwarnings("ignore:overflow encountered")  # exp of a huge lse difference
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the planted NaN lse
@pytest.mark.parametrize(
    "shape", [(2, 3, 4, 2, 8), (1, 17, 8, 32, 128), (3, 2, 5, 3, 24), (1, 5, 2, 4, 80)]
)
def test_interpreted_merge_kernel_vs_merge_splits(shape):
    """The Triton merge against the jnp one on random partials: empty splits (whose outputs
    are NaN and must not be read), a row no split saw, a NaN lse and a NaN output of splits
    that saw keys, and lse values far apart (the max shift); rows and head_dim not powers of 2,
    17 splits (three chunks); the head dim in column blocks (128 and 80 columns: 4 blocks of
    32, the last of 80's half masked)."""
    rng = np.random.default_rng(sum(shape))
    bsz, ns = shape[:2]
    out = rng.standard_normal(shape).astype(np.float32)
    lse = (rng.standard_normal(shape[:4]) * 30).astype(np.float32)
    lse[0, 0] = -np.inf  # an empty split (its out poisoned: never read)
    out[0, 0] = np.nan
    lse[bsz - 1, :, 0] = -np.inf  # a row no split saw
    lse[0, ns - 1, -1, -1] = np.nan
    out[bsz - 1, ns - 1, -1, 0] = np.nan
    got_out, got_lse = pc.merge_interpreted(out, lse)
    want_out, want_lse = map(np.asarray, pat.merge_splits(jnp.asarray(out), jnp.asarray(lse)))
    np.testing.assert_array_equal(np.isnan(got_out), np.isnan(want_out))
    np.testing.assert_array_equal(np.isnan(got_lse), np.isnan(want_lse))
    np.testing.assert_allclose(got_out, want_out, rtol=1e-5, atol=1e-6, equal_nan=True)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-6, atol=1e-5, equal_nan=True)
    assert np.isneginf(got_lse[bsz - 1, 0]).all() and (got_out[bsz - 1, 0] == 0).all()
    assert not np.isnan(got_out[0, 0]).any()  # the empty split's NaN never reached a row


_COMPILE_SCRIPT = """
import jax.numpy as jnp
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from jspec.kernels import paged_attention_triton as pat

kernel = pat.get_kernel()
for ty, dtype, qp, d, causal, tail in (
    ("*bf16", jnp.bfloat16, 1, 128, False, 0),
    ("*bf16", jnp.bfloat16, 8, 128, False, 8),
    ("*bf16", jnp.bfloat16, 4096, 128, True, 0),
    ("*fp32", jnp.float32, 4, 80, True, 16),
):
    grid, meta, opts = pat.launch_plan(16, qp, 32, 8, d, 512, 16, tail, dtype, causal=causal)
    types = [ty, ty, ty] + ["*i32"] * 5 + ["*i8" if tail else "*i32", "i32", "i32"]
    types += ["*fp32", "*fp32"]
    sig = dict(zip(kernel.arg_names[:13], types))
    # as jax_triton 0.3.1 compiles: every array 16-byte aligned, scalars unspecialized
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(13) if types[i] != "i32"}
    sig.update({n: "constexpr" for n in meta})
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=meta, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=opts)
    assert "cubin" in compiled.asm
    ptx = compiled.asm["ptx"]
    if opts["num_stages"] > 1:
        assert "cp.async" in ptx, "K / V loads must be pipelined (cp.async)"
    if causal and ty == "*bf16":
        assert "wgmma" in ptx, "the prefill plan must use Hopper's wgmma"
print("COMPILED_OK")
"""


def test_kernel_compiles_for_sm90():
    """The compiled (not interpreted) branches: Triton's own compiler on CPU, no GPU needed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("Triton's bundled ptxas is not available")
    assert "COMPILED_OK" in proc.stdout, proc.stderr[-4000:]


# ---- GPU (JSPEC_TEST_GPU=1): the compiled kernel vs the compiled reference -------------------

# The 8B geometry (32 / 8 heads x 128, P 16) at small contexts, and two long (8k) passes.
GPU_CASES = {
    "decode-bs4": dict(batch=4, qp=1, num_pages=24),
    "draftA-k4": dict(batch=4, qp=4, num_pages=20, kv_lens=[320, 32, 0, 192]),
    "draftB-bs4k4": dict(batch=16, qp=1, num_pages=3, share_pages=True),
    "verify-tree-n8": dict(batch=4, qp=8, num_pages=24, tail_len=8, tail_kind="tree"),
    # 64 rows (B * Qp): merged by the Triton launch at any split count (XLA_MERGE_MAX_ROWS)
    "verify-bs8-n8": dict(batch=8, qp=8, num_pages=24, tail_len=8, tail_kind="tree"),
    "extend-n16": dict(batch=2, qp=16, num_pages=16, tail_len=16, tail_kind="causal"),
    "prefill-ragged": dict(
        batch=2, qp=256, num_pages=32, causal=True, q_lens=[256, 131], kv_lens=[256, 200]
    ),
    "decode-8k": dict(batch=2, qp=1, num_pages=512, kv_lens=[8192, 5003]),
    "prefill-1k-of-8k": dict(
        batch=1, qp=1024, num_pages=512, causal=True, q_lens=[1024], kv_lens=[8192]
    ),
}


def _gpu_case(name: str, dtype: str):
    spec = {"hq": 32, "hkv": 8, "dim": 128, "page_size": 16, "num_layers": 2, **GPU_CASES[name]}
    if name.startswith("draftB"):
        spec["kv_lens"] = np.random.default_rng(1).integers(0, 16 + 3, spec["batch"])
    return pc.make_case(np.random.default_rng(_seed(name, dtype)), dtype=dtype, **spec)


def _gpu_compare(case, public: bool = False, **knobs):
    """(kernel out, lse) and (reference out, lse), both compiled (layer traced).

    NOTE: the kernel wrapper unjitted inside a fresh jit, so a patched ``pat.get_kernel`` (the
    mutant test) is traced again (the public op's own jit cache would reuse the real kernel).
    """
    args = case.jax_args()
    if public:  # the seam the engine calls
        fn = lambda *a: paged_attention(*a, **case.static, impl="triton", **knobs)  # noqa: E731
    else:
        fn = lambda *a: pat.paged_attention_triton(*a, **case.static, **knobs)  # noqa: E731
    got = jax.jit(fn)(*args[:3], jnp.int32(case.layer), *args[4:])
    want = jax.jit(lambda *a: paged_attention(*a, **case.static, impl="xla"))(*args)
    return [np.asarray(x, np.float64) for x in (*got, *want)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_jax_triton_vs_reference_on_gpu(name, dtype):
    case = _gpu_case(name, dtype)
    got_out, got_lse, want_out, want_lse = _gpu_compare(case, public=True)
    pc.check(
        got_out, got_lse, want_out, want_lse, **(GPU_F32_TOL if dtype == "float32" else BF16_TOL)
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "knobs",
    [
        {"num_splits": 1},
        {"num_splits": 3, "block_n": 32},
        {"block_m": 64, "num_stages": 2},
        {"max_kv_len": 16},
    ],
    ids=["nosplit", "split3", "bm64", "hint-short"],
)
def test_jax_triton_knobs_on_gpu(knobs):
    case = _gpu_case("verify-tree-n8", "bfloat16")
    pc.check(*_gpu_compare(case, **knobs), **BF16_TOL)
    case = _gpu_case("prefill-ragged", "bfloat16")
    pc.check(
        *_gpu_compare(case, **{k: v for k, v in knobs.items() if k != "num_splits"}), **BF16_TOL
    )


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [2, 4])
def test_jax_triton_few_splits_over_many_rows_on_gpu(num_splits):
    """A pass of XLA_MERGE_MAX_ROWS rows in few splits: the Triton merge, not the jnp one."""
    case = _gpu_case("verify-bs8-n8", "bfloat16")
    assert case.q.shape[0] * case.q.shape[1] >= pat.XLA_MERGE_MAX_ROWS
    assert num_splits <= pat.XLA_MERGE_MAX_SPLITS
    pc.check(*_gpu_compare(case, num_splits=num_splits), **BF16_TOL)


@pytest.mark.gpu
def test_jax_triton_mutant_fails_on_gpu(monkeypatch):
    """A causal limit one key too far, compiled: the GPU checks must catch it."""
    mutant = pc.mutated_kernel("lim = offset + query + 1", "lim = offset + query + 2")
    monkeypatch.setattr(pat, "get_kernel", lambda: mutant)
    case = _gpu_case("prefill-ragged", "bfloat16")
    with pytest.raises(AssertionError):
        pc.check(*_gpu_compare(case), **BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name,knobs",
    [
        ("verify-tree-n8", {"num_splits": 1}),  # the kernel writes bf16
        ("verify-tree-n8", {"num_splits": 3}),  # XLA's merge, cast fused
        ("verify-bs8-n8", {"num_splits": 2}),  # the Triton merge writes bf16
        ("prefill-ragged", {}),
    ],
    ids=["kernel", "xla-merge", "triton-merge", "prefill"],
)
def test_jax_triton_out_dtype_on_gpu(name, knobs):
    """Compiled, ``out_dtype=bfloat16`` is the f32 pass's output rounded once to nearest even,
    bit for bit (the engine's passes: the same activations, no convert launch)."""
    case = _gpu_case(name, "bfloat16")
    args = case.jax_args()

    def run(out_dtype):
        fn = lambda *a: paged_attention(  # noqa: E731
            *a, **case.static, impl="triton", out_dtype=out_dtype, **knobs
        )
        return jax.jit(fn)(*args)

    out32, lse32 = run(None)
    out16, lse16 = run(jnp.bfloat16)
    assert out16.dtype == jnp.bfloat16 and out32.dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(out16, np.float32), np.asarray(out32.astype(jnp.bfloat16), np.float32)
    )
    np.testing.assert_array_equal(np.asarray(lse16), np.asarray(lse32))


@pytest.mark.gpu
def test_jax_triton_empty_batch_on_gpu():
    q = jnp.zeros((0, 2, 32, 128), jnp.bfloat16)
    pool = jnp.zeros((1, 64, 8, 128), jnp.bfloat16)
    table, lens = jnp.zeros((0, 4), jnp.int32), jnp.zeros((0,), jnp.int32)
    out, lse = paged_attention(q, pool, pool, 0, table, lens, page_size=16, impl="triton")
    assert out.shape == (0, 2, 32, 128) and lse.shape == (0, 2, 32)
