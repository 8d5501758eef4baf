"""The kernel policy: "auto" resolved once from backend, dtype and widths; concrete names only."""

from __future__ import annotations

import pytest

from jspec.engine import KERNEL_CHOICES, KernelPolicy, resolve_kernel_policy
from jspec.kernels.policy import CUBLAS_MIN_TOKENS
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
