"""Raw Triton metadata kernels (``jspec.kernels.triton_meta``) under Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before triton is first imported (``tl.sum`` and friends are
``@jit`` functions decorated at import time), so ``triton_interpret``, imported first, sets it. If triton
was already imported in compiled mode by an earlier test module of the same pytest process, the
in-process tests are skipped and the file re-runs itself in a fresh subprocess instead.

Also here: the kernels compile for sm_90 on CPU (Triton's own compiler, no GPU needed; run in a
subprocess without the interpreter), and GPU-only checks of the ``jax_triton`` path.
"""

from __future__ import annotations

# NOTE: with JSPEC_TEST_GPU=1 the process must keep compiled Triton (the jax_triton test below and
# every other kernel test in the same pytest process), so the interpreter tests go to a subprocess.
# isort: off
from triton_interpret import (  # first: sets TRITON_INTERPRET before triton is imported
    PREIMPORTED_COMPILED,
    in_process,
    rerun_in_fresh_process,
)

# isort: on
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from _attn_meta_cases import expand_loop, kv_indices_loop, make_draft_batch

torch = pytest.importorskip("torch")

from interop import triton_meta as torch_launch
from jspec.attention_meta.kv_indices import generate_draft_decode_kv_indices
from jspec.attention_meta.page_table import draft_decode_set_expand_metadata
from jspec.kernels import _common, triton_meta
from jspec.kernels.expand_page_table import expand_page_table_reference
from tree_geometry import geom, with_geometry

POISON = -7


def _t(x) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(np.asarray(x, np.int32)))


@pytest.mark.skipif(not PREIMPORTED_COMPILED, reason="tests run in this process")
def test_rerun_in_fresh_process():
    rerun_in_fresh_process(__file__, timeout=600)


# ---- expand page table ---------------------------------------------------------------------------
GOLDEN = [  # SPEC.md §13.4 (B=1, K=2, P=4, lp=3 unless noted); all columns, as sglang's function
    ([3], 1, [[23, 24], [31, 32]], 2, [4, 4], [[5, 6], [7, 8]]),
    (
        [3],
        5,
        [list(range(27, 33)), list(range(35, 41))],
        6,
        [8, 8],
        [[6, 7, 8, 0, 0, 0], [8, 9, 10, 0, 0, 0]],
    ),
    ([3], 2, [[23, 28], [31, 36]], 3, [5, 5], [[5, 7, 0], [7, 9, 0]]),
    (
        [1, 3, 0],
        3,
        [[1, 2, 3, 4], [6, 7, 8, 9], [3, 8, 9, 10], [14, 15, 16, 17], [0, 1, 2, 3], [4, 5, 6, 7]],
        4,
        [4, 4, 6, 6, 3, 3],
        [[0, 1, 0, 0], [1, 2, 0, 0], [0, 2, 0, 0], [3, 4, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]],
    ),
]


@in_process
def test_interpreter_is_active():
    assert _common.interpreting()
    assert "Interpreted" in type(triton_meta.get_kernel("expand_page_table")).__name__


@in_process
@pytest.mark.parametrize("case", range(len(GOLDEN)), ids=["d1", "d5", "crossing", "multi"])
def test_expand_triton_golden(case):
    lp, d, cache_loc, width, seqlens, table = GOLDEN[case]
    rows = len(cache_loc)
    out = (
        torch.full((rows,), POISON, dtype=torch.int32),
        torch.full((rows, width), POISON, dtype=torch.int32),
    )
    got_seqlens, got_table = torch_launch.expand_page_table_torch(
        _t(lp), _t(cache_loc), decode_length=d, topk=2, page_size=4, page_table_width=width, out=out
    )
    assert got_table is out[1]
    np.testing.assert_array_equal(got_seqlens.numpy(), seqlens)
    np.testing.assert_array_equal(got_table.numpy(), table)


@in_process
@pytest.mark.parametrize(
    "page_size,topk,ncols,d,width",
    [(1, 4, 5, 3, 4), (16, 3, 6, 6, 6), (4, 2, 5, 2, 7), (64, 1, 3, 3, 4)],
)
def test_expand_triton_vs_reference(page_size, topk, ncols, d, width):
    rng = np.random.default_rng(page_size + ncols + d)
    num_seqs = 13  # 13*K rows: several programs of 16 rows
    cache_loc = rng.integers(0, 8 * page_size, size=(num_seqs * topk, ncols)).astype(np.int32)
    cache_loc[::3] = np.sort(cache_loc[::3], axis=1)
    lp = rng.integers(0, page_size, size=num_seqs).astype(np.int32)
    want = expand_page_table_reference(
        jnp.asarray(lp),
        jnp.asarray(cache_loc),
        decode_length=d,
        geometry=geom(topk=topk, page_size=page_size),
        page_table_width=width,
        num_cols=d,
    )
    loop = expand_loop(
        lp, cache_loc, decode_length=d, topk=topk, page_size=page_size, width=width, num_cols=d
    )
    rows = num_seqs * topk
    out = (
        torch.full((rows,), POISON, dtype=torch.int32),
        torch.full((rows, width), POISON, dtype=torch.int32),
    )
    got = torch_launch.expand_page_table_torch(
        _t(lp),
        _t(cache_loc),
        decode_length=d,
        topk=topk,
        page_size=page_size,
        page_table_width=width,
        num_cols=d,
        block_rows=16,
        out=out,
    )
    for g, w, o in zip(got, want, loop):
        np.testing.assert_array_equal(np.asarray(w), o)
        np.testing.assert_array_equal(g.numpy(), o)


@in_process
def test_expand_triton_empty_batch():
    seqlens, table = torch_launch.expand_page_table_torch(
        _t(np.zeros((0,))),
        _t(np.zeros((0, 4))),
        decode_length=2,
        topk=4,
        page_size=16,
        page_table_width=3,
        num_cols=2,
    )
    assert tuple(seqlens.shape) == (0,) and tuple(table.shape) == (0, 3)


# ---- kv_indices ----------------------------------------------------------------------------------
@in_process
@pytest.mark.parametrize("page_size,topk,num_steps", [(1, 1, 3), (1, 3, 2), (4, 2, 3), (16, 4, 4)])
def test_kv_indices_triton_vs_loop(page_size, topk, num_steps):
    rng = np.random.default_rng(page_size * 7 + topk)
    seq_lens = rng.integers(0, 2 * page_size + 19, size=3)
    batch = make_draft_batch(rng, seq_lens, topk=topk, num_steps=num_steps, page_size=page_size)
    width = int(seq_lens.sum()) * topk + 3 * topk * num_steps + 11
    want = kv_indices_loop(
        batch["req_to_token"],
        batch["req_pool_indices"],
        batch["seq_lens"],
        topk=topk,
        num_steps=num_steps,
        page_size=page_size,
        width=width,
        fill=POISON,
    )
    buffer = torch.full((num_steps, width), POISON, dtype=torch.int32)
    indptr = torch.full((num_steps, 3 * topk + 1), POISON, dtype=torch.int32)
    got = torch_launch.draft_kv_indices_torch(
        _t(batch["req_pool_indices"]),
        _t(batch["req_to_token"]),
        _t(batch["seq_lens"]),
        topk=topk,
        num_steps=num_steps,
        page_size=page_size,
        kv_indices_width=width,
        kv_indices_buffer=buffer,
        kv_indptr_out=indptr,
        block_tokens=8,
    )
    np.testing.assert_array_equal(got[1].numpy(), want[1])
    np.testing.assert_array_equal(got[0].numpy(), want[0])
    # Same as the JAX reference (fresh output: zeros past the used length).
    ref = generate_draft_decode_kv_indices(
        jnp.asarray(batch["req_pool_indices"]),
        jnp.asarray(batch["req_to_token"]),
        jnp.asarray(batch["seq_lens"]),
        geometry=geom(topk=topk, num_steps=num_steps, page_size=page_size),
        kv_indices_width=width,
    )
    used = want[1][:, -1]
    for i in range(num_steps):
        np.testing.assert_array_equal(
            got[0][i, : used[i]].numpy(), np.asarray(ref[0][i, : used[i]])
        )


@in_process
def test_kv_indices_triton_masks_writes_past_width():
    rng = np.random.default_rng(4)
    batch = make_draft_batch(rng, [21, 17], topk=2, num_steps=3, page_size=4)
    width = 70  # needs 2*38 + 4*3 = 88 at the last step
    want = kv_indices_loop(
        batch["req_to_token"],
        batch["req_pool_indices"],
        batch["seq_lens"],
        topk=2,
        num_steps=3,
        page_size=4,
        width=width,
    )
    got = torch_launch.draft_kv_indices_torch(
        _t(batch["req_pool_indices"]),
        _t(batch["req_to_token"]),
        _t(batch["seq_lens"]),
        topk=2,
        num_steps=3,
        page_size=4,
        kv_indices_width=width,
        block_tokens=8,
    )
    np.testing.assert_array_equal(got[0].numpy(), want[0])
    np.testing.assert_array_equal(got[1].numpy(), want[1])


@in_process
def test_kv_indices_triton_empty_batch():
    kv_indices, kv_indptr = torch_launch.draft_kv_indices_torch(
        _t(np.zeros((0,))),
        _t(np.zeros((2, 8))),
        _t(np.zeros((0,))),
        topk=2,
        num_steps=3,
        page_size=4,
        kv_indices_width=16,
    )
    assert tuple(kv_indices.shape) == (3, 16) and tuple(kv_indptr.shape) == (3, 1)
    assert not kv_indices.any()


# ---- compiled Triton (sm_90 from CPU), and the jax_triton path on a GPU --------------------------
_COMPILE_SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from jspec.attention_meta import (
        draft_kv_indices_triton_launch,
        expand_page_table_triton_launch,
    )
    from jspec.config import TreeGeometry

    def build(num_ptrs, launch):
        meta = dict(launch.options)
        options = {k: meta.pop(k) for k in ("num_warps", "num_stages")}
        sig = {n: "*i32" for n in launch.kernel.arg_names[:num_ptrs]}
        sig.update({n: "constexpr" for n in meta})
        compiled = triton.compile(ASTSource(fn=launch.kernel, signature=sig, constexprs=meta),
                                  target=GPUTarget("cuda", 90, 32), options=options)
        assert "cubin" in compiled.asm, launch.kernel

    geometry = TreeGeometry(topk=8, num_steps=5, num_draft_tokens=1, page_size=16)
    build(4, expand_page_table_triton_launch(2048, 5, decode_length=4, geometry=geometry,
          page_table_width=5, num_cols=4))
    build(6, draft_kv_indices_triton_launch(256, 256 * 8 * 8192, 8300, geometry=geometry))
    print("COMPILED_OK")
""")


def test_triton_kernels_compile_for_sm90():
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


@pytest.mark.gpu
def test_jax_triton_impl_matches_xla_on_gpu():
    rng = np.random.default_rng(9)
    batch = make_draft_batch(rng, [700, 1500, 3], topk=8, num_steps=5, page_size=16)
    args = [jnp.asarray(batch[k]) for k in ("req_pool_indices", "req_to_token", "seq_lens")]
    kw = {"topk": 8, "num_steps": 5, "page_size": 16, "kv_indices_width": 3 * 8 * 2048}
    want = generate_draft_decode_kv_indices(*args, **with_geometry(kw))
    got = generate_draft_decode_kv_indices(*args, **with_geometry(kw), impl="triton")
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    cache_loc = jnp.asarray(batch["out_cache_loc"].reshape(-1, 5))
    lp = jnp.asarray(batch["seq_lens"] % 16)
    for d in range(1, 5):
        want = draft_decode_set_expand_metadata(
            lp, d, cache_loc, geometry=geom(topk=8, page_size=16)
        )
        got = draft_decode_set_expand_metadata(
            lp, d, cache_loc, geometry=geom(topk=8, page_size=16), impl="triton"
        )
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
