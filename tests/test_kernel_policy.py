"""The kernel policy: "auto" resolved once from backend, dtype and widths; concrete names only."""

from __future__ import annotations

import pytest

from jspec.engine import KERNEL_CHOICES, KernelPolicy, resolve_kernel_policy
from jspec.kernels.policy import CHOICES, CUBLAS_MIN_TOKENS, GPU_ONLY, KEYWORDS
from jspec.kernels.rms_norm import MAX_HIDDEN
from jspec.kernels.topk_probs import MAX_COLS
from jspec.models import LlamaConfig, LlamaTarget, with_kernel_policy

CFG = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
)
BF16 = {"hidden_size": 4096, "vocab_size": 128256, "dtype": "bfloat16"}


@pytest.mark.parametrize(
    "backend,kw,want",
    [
        pytest.param("cpu", BF16, KernelPolicy(), id="cpu_all_references"),
        pytest.param(
            "gpu",
            BF16,
            KernelPolicy("pallas", "cudnn", "cublas", CUBLAS_MIN_TOKENS, "xla", "triton"),
            id="gpu_bf16_wide_vocab",
        ),
        pytest.param(
            "gpu",
            {"hidden_size": 64, "vocab_size": 512, "dtype": "float32"},
            KernelPolicy("pallas", "triton", "cublas", CUBLAS_MIN_TOKENS, "xla", "pallas"),
            id="gpu_f32_narrow_vocab",
        ),
        pytest.param(
            "gpu",
            {"hidden_size": MAX_HIDDEN, "vocab_size": MAX_COLS, "rms_norm_impl": "triton"},
            KernelPolicy("pallas", "triton", "cublas", CUBLAS_MIN_TOKENS, "triton", "pallas"),
            id="gpu_norm_kernel_named",
        ),
        pytest.param(
            "cpu",
            {**BF16, "impl": "pallas"},
            KernelPolicy(bookkeeping="pallas", topk_probs="xla"),
            id="cpu_pallas_wide_vocab_takes_reference",
        ),
        pytest.param(
            "gpu",
            {**BF16, "impl": "xla", "gemm_impl": "cublas", "rms_norm_impl": "xla"},
            KernelPolicy("xla", "cudnn", "cublas", 0, "xla", "xla"),
            id="gpu_explicit",
        ),
        pytest.param(
            "gpu",
            {**BF16, "attention_impl": "triton"},
            KernelPolicy("pallas", "triton", "cublas", CUBLAS_MIN_TOKENS, "xla", "triton"),
            id="gpu_bf16_triton_named",
        ),
        pytest.param(
            "gpu",
            {"hidden_size": 64, "vocab_size": 512},
            KernelPolicy("pallas", "triton", "cublas", CUBLAS_MIN_TOKENS, "xla", "pallas"),
            id="gpu_dtype_unknown",
        ),
    ],
)
def test_resolve(backend, kw, want):
    assert resolve_kernel_policy(backend=backend, **kw) == want


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"impl": "triton"}, r"impl='triton' must be one of \('auto', 'xla', 'pallas'\)"),
        ({"attention_impl": "flash"}, r"attention_impl='flash' must be one of"),
        ({"gemm_impl": "cudnn"}, r"gemm_impl='cudnn' must be one of"),
        ({"rms_norm_impl": "pallas"}, r"rms_norm_impl='pallas' must be one of"),
        ({"topk_probs_impl": "auto2"}, r"topk_probs_impl='auto2' must be one of"),
        (
            {"topk_probs_impl": "pallas", "vocab_size": MAX_COLS + 1},
            r"topk_probs_impl='pallas' takes rows of at most",
        ),
        (
            {"attention_impl": "cudnn", "dtype": "float32"},
            r"attention_impl='cudnn' takes bf16 / f16 models; dtype=float32",
        ),
        (
            {"rms_norm_impl": "triton", "hidden_size": MAX_HIDDEN + 1},
            r"rms_norm_impl='triton' takes rows of at most 32768 columns; hidden_size=32769",
        ),
    ],
)
def test_resolve_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        resolve_kernel_policy(backend="gpu", **kw)


def test_cudnn_is_available_on_this_jax():
    """The private jax function the cuDNN prefill calls is where the kernel expects it (jax
    0.10.2 on CPU, 0.11.2 on the GPU machine): a jax that moves it fails here first."""
    from jspec.kernels import paged_prefill_cudnn

    assert paged_prefill_cudnn.unavailable() is None


@pytest.mark.parametrize(
    "module",
    [
        pytest.param(None, id="module_gone"),
        pytest.param(object(), id="function_gone"),
        pytest.param("keyword_gone", id="keyword_gone"),
    ],
)
def test_a_jax_without_the_cudnn_call_gets_triton(module, monkeypatch):
    """A jax whose private cuDNN function moved or changed: "auto" picks Triton on the GPU, an
    explicit ``attention_impl="cudnn"`` is refused naming the field, and the kernel itself
    refuses (never a TypeError from inside a trace)."""
    import sys
    import types

    import jax.numpy as jnp

    from jspec.kernels import paged_prefill_cudnn

    name = "jax._src.cudnn.fused_attention_stablehlo"
    if module == "keyword_gone":
        real = sys.modules.get(name) or __import__(name, fromlist=["x"])
        module = types.SimpleNamespace(
            dot_product_attention=lambda query, key, value, *, q_seqlen, kv_seqlen, scale: 0,
            MaskType=real.MaskType,
        )
    paged_prefill_cudnn.unavailable.cache_clear()
    try:
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, name, module)
            reason = paged_prefill_cudnn.unavailable()
            assert reason is not None and reason.startswith("jax ")
            auto = resolve_kernel_policy(backend="gpu", **BF16)
            assert auto.attention == "triton"
            with pytest.raises(ValueError, match="attention_impl='cudnn': jax"):
                resolve_kernel_policy(backend="gpu", attention_impl="cudnn", **BF16)
            q = jnp.zeros((1, 4, 2, 16), jnp.bfloat16)
            pool = jnp.zeros((1, 32, 1, 16), jnp.bfloat16)
            lens = jnp.full((1,), 4, jnp.int32)
            with pytest.raises(ValueError, match="impl='cudnn': jax"):
                paged_prefill_cudnn.paged_prefill_cudnn(
                    q, pool, pool, 0, jnp.zeros((1, 2), jnp.int32), lens, lens, page_size=16
                )
    finally:
        paged_prefill_cudnn.unavailable.cache_clear()
    assert paged_prefill_cudnn.unavailable() is None  # the real module back


def test_policy_is_concrete_and_hashable():
    for family, choices in KERNEL_CHOICES.items():
        assert "auto" not in choices
        with pytest.raises(ValueError, match=rf"{family}='auto' must be one of"):
            KernelPolicy(**{family: "auto"})
    assert hash(KernelPolicy()) == hash(KernelPolicy())
    with pytest.raises(ValueError, match="cublas_min_tokens"):
        KernelPolicy(cublas_min_tokens=-1)


def test_with_kernel_policy_sets_the_models_norm():
    target = LlamaTarget(CFG)
    assert target.rms_norm_impl == "xla"
    assert with_kernel_policy(target, KernelPolicy(rms_norm="triton")).rms_norm_impl == "triton"
    assert with_kernel_policy(None, KernelPolicy()) is None
    with pytest.raises(ValueError, match="rms_norm_impl='auto' must be one of"):
        LlamaTarget(CFG, rms_norm_impl="auto")


def test_check_backend_refuses_only_gpu_kernels_off_the_gpu():
    assert set(KEYWORDS) == set(CHOICES)
    for family, keyword in KEYWORDS.items():
        for impl in CHOICES[family]:
            policy = KernelPolicy(**{family: impl})
            policy.check_backend("gpu")
            if impl in GPU_ONLY:
                with pytest.raises(ValueError, match=rf"^{keyword}='{impl}' needs a GPU.*'cpu'"):
                    policy.check_backend("cpu")
                policy.check_backend("cpu", skip=(family,))
            else:
                policy.check_backend("cpu")


def test_the_runner_hands_the_policy_to_the_models():
    from jspec.engine import Runner, make_engine_config

    target = LlamaTarget(CFG)
    ecfg = make_engine_config(
        target, context_len=64, max_running_requests=1, max_prompt_len=8, rms_norm_impl="triton"
    )
    assert ecfg.kernels.rms_norm == "triton" and target.rms_norm_impl == "xla"
    runner = Runner(ecfg, target)
    assert runner.target.rms_norm_impl == "triton"  # one policy, whatever the model came with
    same = make_engine_config(target, context_len=64, max_running_requests=1, max_prompt_len=8)
    assert Runner(same, target).target is target  # nothing to change: the model itself


# ---- the policy reaches every op the engine calls ---------------------------------------------
def _ops_taking_impl(root) -> set[str]:
    """Names of jspec's public functions with an ``impl`` parameter (the ops whose kernel the
    policy chooses), the policy's own entry points left out (they take "auto")."""
    import ast

    names = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                params = node.args.args + node.args.kwonlyargs
                if any(p.arg == "impl" for p in params):
                    names.add(node.name)
    # the policy's own entry points (they take "auto") and the validators (impl positional)
    return names - {
        "resolve_kernel_policy",
        "make_engine_config",
        "resolve_impl",
        "check_rms_norm_impl",
    }


def _calls_without_impl(sources: dict[str, str], ops: set[str]) -> list[str]:
    """``file:line name`` of every call to one of ``ops`` that passes no ``impl=`` keyword
    (nor ``**kwargs``): such a call runs the op's default, whatever the policy says."""
    import ast

    missing = []
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            callee = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if callee in ops and not any(k.arg in (None, "impl") for k in node.keywords):
                missing.append(f"{name}:{node.lineno} {callee}")
    return missing


def test_the_engine_passes_the_policy_to_every_op():
    """Every op call in jspec's layers above the ops (engine, models, apps, and the tree / kv /
    attention_meta ops that call other ops) names its ``impl``. The accepted-KV move into the
    target pool once ran XLA's scatter whatever the policy said: its call passed none."""
    import pathlib

    import jspec

    root = pathlib.Path(jspec.__file__).parent
    ops = _ops_taking_impl(root)
    assert {"move_accept_tokens_to_target_kvcache", "paged_attention", "set_kv_buffer"} <= ops
    units = ("engine", "models", "apps", "tree", "kv", "attention_meta")
    sources = {
        str(p.relative_to(root)): p.read_text() for u in units for p in (root / u).rglob("*.py")
    }
    assert _calls_without_impl(sources, ops) == []
    # the check has teeth: the call as it stood before the fix is found
    bad = "move_accept_tokens_to_target_kvcache(pool, table, rows, lens, loc, idx, n, valid=ok)\n"
    assert _calls_without_impl({"x.py": bad}, ops) == [
        "x.py:1 move_accept_tokens_to_target_kvcache"
    ]
