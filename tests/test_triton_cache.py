"""jspec.kernels.triton_cache: jax-triton's kernel compiles kept beside JAX's compilation cache.

On CPU the wrapper runs against a stand-in for jax-triton's compile and jaxlib's kernel object
(jax-triton imports only with a GPU jaxlib); on the GPU a second process compiles no kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest

from jspec.kernels import triton_cache

VERSIONS = ("3.6.0", "0.3.1")


class FakeKernel:
    def __init__(self, *args):
        self.args = args


class FakeLib:
    """jaxlib's gpu_triton: the kernel object and the compute capability."""

    TritonKernel = FakeKernel

    @staticmethod
    def get_compute_capability(device):
        return 90


class FakeFn:
    def __init__(self, source):
        self.cache_key = "hash-of-" + source


class FakeTritonLib:
    """jax_triton.triton_lib: its compile builds the kernel through the module's lib."""

    def __init__(self):
        self.triton_kernel_call_lib = FakeLib
        self.compiles = 0

    def get_or_create_triton_kernel(self, backend, platform, fn, arg_dtypes, scalar_args, **kw):
        self.compiles += 1
        name = f"kernel_{fn.cache_key}_{kw['num_warps']}"
        kernel = self.triton_kernel_call_lib.TritonKernel(
            name, kw["num_warps"], 1, 1024, "ptx", "ttir", 90
        )
        return kernel, {(0,): [["tt.divisibility", 16]], (1,): []}


KW = dict(
    num_warps=4,
    num_stages=2,
    num_ctas=1,
    compute_capability=None,
    enable_fp_fusion=True,
    metaparams={"BLOCK": 64},
    dump=False,
)


@pytest.fixture
def jax_cache(tmp_path):
    previous = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    yield tmp_path
    jax.config.update("jax_compilation_cache_dir", previous)


def _wrapped():
    module = FakeTritonLib()
    return module, triton_cache.cached(module.get_or_create_triton_kernel, module, VERSIONS)


def test_a_second_process_rebuilds_the_kernel_without_compiling(jax_cache):
    first, get = _wrapped()
    kernel, attrs = get(None, "cuda", FakeFn("src"), ["*bf16", "i32"], [(1, "i32", 7)], **KW)
    assert first.compiles == 1 and first.triton_kernel_call_lib is FakeLib  # restored
    files = os.listdir(jax_cache / "jax_triton")
    assert len(files) == 1 and files[0].endswith(".json")
    second, get2 = _wrapped()  # a new process: nothing in memory
    again, attrs2 = get2(None, "cuda", FakeFn("src"), ["*bf16", "i32"], [(1, "i32", 9)], **KW)
    assert second.compiles == 0
    assert again.args == kernel.args and attrs2 == {(0,): [["tt.divisibility", 16]], (1,): []}
    assert ["tt.divisibility", 16] in attrs2[(0,)]  # what jax-triton's lowering asks of them


@pytest.mark.parametrize(
    "change",
    [
        {"fn": FakeFn("edited source")},
        {"arg_dtypes": ["*f32", "i32"]},
        {"scalar_args": [(1, "i32", 1)]},  # a scalar equal to 1 is specialized by Triton
        {"num_warps": 8},
        {"metaparams": {"BLOCK": 128}},
        {"compute_capability": 80},
    ],
)
def test_what_changes_the_compile_misses(jax_cache, change):
    args = {"fn": FakeFn("src"), "arg_dtypes": ["*bf16", "i32"], "scalar_args": [(1, "i32", 7)]}
    _, get = _wrapped()
    get(None, "cuda", *args.values(), **KW)
    module, get2 = _wrapped()
    kw = {**KW, **{k: v for k, v in change.items() if k in KW}}
    args.update({k: v for k, v in change.items() if k not in KW})
    get2(None, "cuda", *args.values(), **kw)
    assert module.compiles == 1
    assert len(os.listdir(jax_cache / "jax_triton")) == 2


def test_versions_are_part_of_the_key(jax_cache):
    _, get = _wrapped()
    get(None, "cuda", FakeFn("src"), ["i32"], [], **KW)
    module = FakeTritonLib()
    get2 = triton_cache.cached(module.get_or_create_triton_kernel, module, ("3.7.0", "0.3.1"))
    get2(None, "cuda", FakeFn("src"), ["i32"], [], **KW)
    assert module.compiles == 1


def test_a_corrupt_entry_is_compiled_again_and_rewritten(jax_cache):
    _, get = _wrapped()
    get(None, "cuda", FakeFn("src"), ["i32"], [], **KW)
    (path,) = (jax_cache / "jax_triton").iterdir()
    path.write_text('{"kernel": [1, 2')
    module, get2 = _wrapped()
    kernel, _ = get2(None, "cuda", FakeFn("src"), ["i32"], [], **KW)
    assert module.compiles == 1 and kernel.args[0] == "kernel_hash-of-src_4"
    assert json.loads(path.read_text())["kernel"][0] == "kernel_hash-of-src_4"


def test_off_without_jax_cache_and_for_unstable_keys(tmp_path):
    assert jax.config.jax_compilation_cache_dir in (None, "")
    module, get = _wrapped()
    get(None, "cuda", FakeFn("src"), ["i32"], [], **KW)
    get(None, "cuda", FakeFn("src"), ["i32"], [], **KW)
    assert module.compiles == 2  # the cache is off: every call goes to jax-triton

    class Opaque:  # repr with an address: no stable key, never stored
        pass

    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    try:
        module, get = _wrapped()
        get(None, "cuda", FakeFn("src"), ["i32"], [], **{**KW, "metaparams": {"X": Opaque()}})
        get(None, "cuda", FakeFn("src"), ["i32"], [], **{**KW, "metaparams": {"X": Opaque()}})
        assert module.compiles == 2 and not (tmp_path / "jax_triton").exists()
    finally:
        jax.config.update("jax_compilation_cache_dir", None)


GPU_SCRIPT = textwrap.dedent(
    """
    import sys, jax, jax.numpy as jnp
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    from jspec.kernels import _common
    jt = _common.import_jax_triton()
    compiles = []
    inner = jt.triton_lib.compile_ttir_inplace
    jt.triton_lib.compile_ttir_inplace = lambda *a, **k: compiles.append(1) or inner(*a, **k)
    from jspec.models.layers import rms_norm
    x = jax.random.normal(jax.random.key(0), (8, 4096), jnp.bfloat16)
    w = jnp.ones((4096,), jnp.bfloat16)
    y = jax.jit(lambda x, w: rms_norm(x, w, 1e-6, impl="triton"))(x, w)
    print(len(compiles), float(jnp.abs(y.astype(jnp.float32)).sum()))
    """
)


@pytest.mark.gpu
def test_gpu_second_process_compiles_no_triton_kernel(tmp_path):
    runs = [
        subprocess.run(
            [sys.executable, "-c", GPU_SCRIPT, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        for _ in range(2)
    ]
    outs = [r.stdout.split() for r in runs]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    assert int(outs[0][0]) >= 1 and int(outs[1][0]) == 0, outs
    assert outs[0][1] == outs[1][1]  # the same result from the rebuilt kernel


def test_concurrent_compiles_do_not_record_each_other(jax_cache):
    """The Engine's background compiles lower kernels on another thread: a miss swaps the
    module's gpu_triton for a recorder, so compiles run one at a time and each stored entry is
    its own kernel."""
    import threading
    import time

    module = FakeTritonLib()
    inside, overlap = [0], []
    compile_one = module.get_or_create_triton_kernel

    def slow(*args, **kw):
        inside[0] += 1
        overlap.append(inside[0])
        time.sleep(0.05)
        try:
            return compile_one(*args, **kw)
        finally:
            inside[0] -= 1

    get = triton_cache.cached(slow, module, VERSIONS)
    threads = [
        threading.Thread(target=get, args=(None, "cuda", FakeFn(f"src{i}"), ["i32"], []), kwargs=KW)
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(overlap) == 1 and module.compiles == 4
    for path in (jax_cache / "jax_triton").iterdir():
        name = json.loads(path.read_text())["kernel"][0]
        assert path.name == triton_cache.cache_key(
            FakeFn(name.split("hash-of-")[1].rsplit("_", 1)[0]), ["i32"], [],
            {**{k: v for k, v in KW.items() if k != "dump"}, "compute_capability": 90}, VERSIONS,
        ) + ".json"  # fmt: skip
