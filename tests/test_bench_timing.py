"""bench/_timing.py: HLO op-name parsing and the attribution of GPU kernels to op classes."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from bench._timing import (
    MIXED_SUFFIX,
    UNATTRIBUTED,
    attribute_events,
    hlo_fused_op_names,
    hlo_op_names,
    matmul_tflops_sustained,
    profile_kernel_us,
    profile_split_us,
)


@jax.jit
def _scoped(x, w, idx):
    with jax.named_scope("a"):
        y = jnp.tanh(x @ w)
    with jax.named_scope("b"):
        y = y.at[jnp.cumsum(idx) % 7].add(1.0)
    return y


def _scoped_args():
    return jnp.ones((16, 16)), jnp.ones((16, 16)), jnp.arange(16)


def _classify(op_name: str) -> str:
    return "a" if "a" in op_name.split("/") else "rest"


def test_matmul_tflops_sustained_runs_on_cpu():
    rate = matmul_tflops_sustained(seconds=0.3)
    assert 0 < rate < 1e3


def test_hlo_op_names_on_compiled_cpu_hlo():
    text = _scoped.lower(*_scoped_args()).compile().as_text()
    names = hlo_op_names(text)
    assert names, text
    scopes = {_classify(op) for op in names.values()}
    assert any("a/" in op for op in names.values()), names
    assert any("b/" in op for op in names.values()), names
    assert scopes == {"a", "rest"}
    # Instructions without metadata map to ""; computation headers are not instructions.
    assert any(op == "" for op in names.values())
    entry = re.search(r"^ENTRY %([\w.\-]+)", text, re.MULTILINE).group(1)
    assert entry not in names
    root = next(line for line in text.splitlines() if line.lstrip().startswith("ROOT %"))
    assert root.split("%", 1)[1].split(" ", 1)[0] in names
    fused = hlo_fused_op_names(text)
    assert fused and set(fused) <= set(names)
    assert any("a/" in op for ops in fused.values() for op in ops), fused


def test_hlo_op_names_line_format():
    text = """HloModule jit_f, is_scheduled=true
1 {file_name_id=1 function_name_id=1 line=11}
%fused_scatter (param_0: f32[4]) -> f32[4] {
  ROOT %scatter-add.4 = f32[4]{0} scatter(%p), metadata={op_name="jit(f)/b/scatter-add"}
}
ENTRY %main.10 (x.1: f32[4]) -> f32[4] {
  %x.1 = f32[4]{0} parameter(0), metadata={op_name="x"}
  %constant.15 = f32[] constant(1)
  ROOT %input_scatter_fusion.1 = f32[4]{0} fusion(%x.1), kind=kInput, calls=%fused_scatter, \
metadata={op_name="jit(f)/b/scatter-add" scheduling_name="input_scatter_fusion.1"}
}
"""
    assert hlo_op_names(text) == {
        "scatter-add.4": "jit(f)/b/scatter-add",
        "x.1": "x",
        "constant.15": "",
        "input_scatter_fusion.1": "jit(f)/b/scatter-add",
    }


_FUSED_HLO = """HloModule jit_step
%inner (p: s32[4]) -> s32[4] {
  %p = s32[4]{0} parameter(0)
  ROOT %add.1 = s32[4]{0} add(%p, %p), metadata={op_name="jit(step)/b/jit(cache_loc)/add"}
}
%fused_kv (param_0: f32[4], param_1: s32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0), metadata={op_name="jit(step)/b/stray"}
  %constant.2 = s32[] constant(0), metadata={op_name="jit(step)/b/cse_d"}
  %broadcast.2 = s32[4]{0} broadcast(%constant.2), dimensions={}, metadata={op_name="jit(step)/b/x"}
  %loc = s32[4]{0} fusion(%param_1), kind=kLoop, calls=%inner
  ROOT %scatter.3 = f32[4]{0} scatter(%param_0, %loc), metadata={op_name="jit(step)/a/scatter"}
}
%fused_rope (param_0.1: f32[4]) -> f32[4] {
  %param_0.1 = f32[4]{0} parameter(0)
  %constant.3 = f32[] constant(2), metadata={op_name="jit(step)/b/cse_d"}
  ROOT %cos.1 = f32[4]{0} cosine(%param_0.1), metadata={op_name="jit(step)/a/cos"}
}
ENTRY %main (x: f32[4], i: s32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %i = s32[4]{0} parameter(1)
  %loop_cos_fusion = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_rope, \
metadata={op_name="jit(step)/a/cos"}
  ROOT %input_scatter_fusion = (f32[4]{0}, s32[]) fusion(%loop_cos_fusion, %i), kind=kInput, \
calls=%fused_kv, metadata={op_name="jit(step)/a/scatter"}
}
"""


def test_hlo_fused_op_names_nested_and_plumbing_skipped():
    fused = hlo_fused_op_names(_FUSED_HLO)
    assert fused == {
        "loc": frozenset({"jit(step)/b/jit(cache_loc)/add"}),
        "loop_cos_fusion": frozenset({"jit(step)/a/cos"}),
        "input_scatter_fusion": frozenset(
            {"jit(step)/a/scatter", "jit(step)/b/jit(cache_loc)/add"}
        ),
    }


def test_attribute_events_mixed_fusions():
    op_names = hlo_op_names(_FUSED_HLO)
    events = [
        ("input_scatter_fusion", "input_scatter_fusion", 50.0),
        ("loop_cos_fusion", "loop_cos_fusion", 20.0),
    ]
    fused = hlo_fused_op_names(_FUSED_HLO)
    assert attribute_events(events, op_names, _classify, fused) == {
        "a" + MIXED_SUFFIX: 50.0,
        "a": 20.0,
    }
    assert attribute_events(events, op_names, _classify) == {"a": 70.0}


_OP_NAMES = {
    "gemm_fusion_dot": "jit(step)/a/dot_general",
    "input_reduce_fusion.1": "jit(step)/b/reduce_sum",
    "custom-call.3": "jit(step)/a/cublas",
    "cond.1.clone": "jit(step)/cond",
    "sort.2": "jit(step)/b/sort",
    "copy.1": "",
}


def test_attribute_events_exact_hlo_op():
    # Command buffers off: hlo_op is the instruction, whatever the kernel is called.
    events = [
        ("sm90_xmma_gemm_f32", "custom-call.3", 1000.0),
        ("input_reduce_fusion_1", "input_reduce_fusion.1", 200.0),
        ("cond_1_clone", "cond.1.clone", 30.0),
        ("MemcpyD2D", "copy.1", 5.0),
    ]
    assert attribute_events(events, _OP_NAMES, _classify) == {"a": 1000.0, "rest": 235.0}


def test_attribute_events_by_kernel_name_under_command_buffers():
    events = [
        ("gemm_fusion_dot", "command_buffer_1", 400.0),
        ("input_reduce_fusion_1", "command_buffer_1", 200.0),
        ("sort_2_1", "command_buffer_1", 7.0),  # an instruction run as several kernels
        ("sort_2_2", "command_buffer_1", 8.0),
        ("sm90_xmma_gemm_f32", "command_buffer_1", 1000.0),  # cuBLAS: no instruction
        ("input_reduce_fusion_9", "", 3.0),
    ]  # no such instruction
    assert attribute_events(events, _OP_NAMES, _classify) == {
        "a": 400.0,
        "rest": 215.0,
        UNATTRIBUTED: 1003.0,
    }


def test_attribute_events_empty():
    assert attribute_events([], _OP_NAMES, _classify) == {}


def test_profilers_return_none_on_cpu_and_keep_donated_inputs_fresh():
    if jax.default_backend() == "gpu":
        split = profile_split_us(_scoped, _scoped_args, _classify, num_calls=2)
        assert split is not None and split["total"] > 0
        assert abs(sum(v for k, v in split.items() if k != "total") - split["total"]) < 1e-6
        return
    donating = jax.jit(lambda x: x * 2.0, donate_argnums=0)
    assert profile_split_us(donating, lambda: (jnp.ones((8,)),), _classify, num_calls=2) is None
    assert profile_kernel_us(lambda: donating(jnp.ones((8,))), 1) is None


def test_e2e_op_key_and_top_ops():
    from bench.e2e import _op_key, _top_ops

    assert (
        _op_key("jit(fn)/jit(main)/shard_map/cond/branch_1_fun/jspec_model/dot_general")
        == "model:dot_general"
    )
    assert (
        _op_key("jit(fn)/cond/branch_1_fun/while/body/verify_tree/gather")
        == "while/body/verify_tree/gather"
    )
    assert _op_key("") == "(no op_name)"
    assert _op_key("@copy.3") == "@copy.3"
    text = _top_ops({"config": "c", "_by_op": {"model:x": 5.0, "a/b": 2.0, "c": 3.0}}, top=1)
    assert "| c | 3.0 |" in text and "a/b" not in text and "| model:x | 5.0 |" in text


def test_e2e_classify_and_device_row():
    from bench.e2e import Case, _classify, _device_row

    assert _classify("jit(fn)/cond/jspec_model/draft/dot_general") == "draft"
    assert _classify("jit(fn)/jspec_model/target/jit(set_kv_buffer)/scatter") == "target"
    assert _classify("jit(fn)/jit(build_tree)/pallas_call") == "bookkeeping"
    split = {
        "draft": 10.0,
        "draft (mixed)": 2.0,
        "target": 20.0,
        "bookkeeping": 5.0,
        "unattributed": 1.0,
        "total": 38.0,
    }
    row = _device_row(split, Case("c", 16, 8, 5, 32, 64, 32, 64, 8, compare_anchors=True))
    assert (row["draft us"], row["verify us"], row["model us"]) == (12.0, 20.0, 32.0)
    assert (row["bookkeeping us"], row["mixed us"]) == (6.0, 2.0)
    assert row["vs sglang anchors"] == 6.0 / 875.0


def test_launch_gaps_split_timeline_on_a_made_up_trace():
    """bench.launch_gaps: busy time is the union of kernel intervals (an overlapping event on
    another stream counts once), gaps inside dispatches land in their length bins, and the
    gap before a dispatch's first kernel counts as the host loop's."""
    from bench.launch_gaps import dispatch_starts, split_timeline

    us = 1000
    events = [  # (start ns, end ns, name): two dispatches, the second starting at 1000 us
        (0, 10 * us, "a"),
        (11 * us, 20 * us, "b"),  # 1 us gap: < 2 us
        (15 * us, 25 * us, "c"),  # overlaps b: 5 us more busy
        (35 * us, 40 * us, "d"),  # 10 us gap: 2-20 us
        (140 * us, 150 * us, "e"),  # 100 us gap: 20-200 us
        (1000 * us, 1010 * us, "f"),  # 850 us: the host loop between dispatches
        (1400 * us, 1401 * us, "g"),  # 390 us: >= 200 us, inside the second dispatch
    ]
    starts = dispatch_starts(events, 2)
    assert starts == [1000 * us]
    split = split_timeline(events, starts)
    assert split["busy_ns"] == (10 + 14 + 5 + 10 + 10 + 1) * us
    assert split["between_ns"] == 850 * us
    assert split["bins_ns"] == [1 * us, 10 * us, 100 * us, 390 * us]
    assert split["longest"][0][:3] == (390.0, "f", "g")
    assert split["between_windows"] == [(150 * us, 1000 * us)]
    assert split["pairs"] == [
        ("f -> g", [1, 390 * us]),
        ("d -> e", [1, 100 * us]),
        ("c -> d", [1, 10 * us]),
    ]
    assert dispatch_starts(events, 1) == []


def test_step_kernels_by_op_sums_a_layers_kernels():
    from bench.step_kernels import by_op

    rows = [
        {"us": 2.0, "calls": 1.0, "class": "target", "what": "fusion[kLoop] bf16[1]", "op": "a"},
        {"us": 3.0, "calls": 1.0, "class": "target", "what": "fusion[kLoop] bf16[2]", "op": "a"},
        {"us": 9.0, "calls": 1.0, "class": "target", "what": "fusion[kCustom] DOT f32", "op": "a"},
        {"us": 4.0, "calls": 2.0, "class": "draft", "what": "fusion[kLoop] x", "op": "a"},
    ]
    got = by_op(rows)
    assert [(r["us"], r["calls"], r["class"], r["what"]) for r in got] == [
        (9.0, 1.0, "target", "fusion[kCustom] DOT"),
        (5.0, 2.0, "target", "fusion[kLoop]"),
        (4.0, 2.0, "draft", "fusion[kLoop]"),
    ]


def test_step_kernels_phases_against_their_floors():
    from bench.serving_size import PHASES
    from bench.step_kernels import against_floor, phase_of

    ops = {
        "target linear": ("target", "jit(step)/model:target/jspec_model/target/dot_general", 1),
        "target attention": ("attention", "model:jspec_model/target/jit(paged_attention)/k", 0),
        "draft linear": ("draft", "jit(step)/model:draft/jspec_model/draft/dot_general", 1),
        "draft attention": ("attention", "model:draft/jit(paged_attention)/select_n", 0),
        "target glue": ("target", "model:target/jspec_model/target/mul", 0),
        "bookkeeping": ("bookkeeping", "while/body/scatter", 0),
    }
    assert set(PHASES) < set(ops)  # every phase with a floor is one a kernel can be in
    for phase, (cls, op, matmul) in ops.items():
        assert phase_of(cls, op, bool(matmul)) == phase, (phase, op)
    assert phase_of("attention", "model:jspec_model/drafty/x", False) == "target attention"
    rows = [
        {"us": us, "calls": 1.0, "phase": phase}
        for phase, us in [("target linear", 50.0), ("target linear", 30.0), ("bookkeeping", 7.0)]
    ]
    rows.append({"us": 12.0, "calls": 2.0, "phase": "target attention"})
    got = against_floor(rows, {"target linear": 60.0, "target attention": 10.0})
    assert [(r["phase"], r["us"], r["launches"], r["floor us"], r["over us"]) for r in got] == [
        ("target linear", 80.0, 2.0, 60.0, 20.0),
        ("target attention", 12.0, 2.0, 10.0, 2.0),
        ("bookkeeping", 7.0, 1.0, "", ""),
        ("all", 99.0, 5.0, 70.0, 29.0),
    ]


def test_paged_attention_sweep_shapes_parse_and_name_a_bad_item():
    from bench.paged_attention import Pass, parse_sweep_shapes

    assert parse_sweep_shapes("verify:16x2048,decode:64x8192") == [
        Pass("verify", 16, 8, 2048, tail_len=8),
        Pass("decode", 64, 1, 8192),
    ]
    assert parse_sweep_shapes("") == []
    for bad in ("prefill:1x2048", "verify:16", "verify:ax2048"):
        with pytest.raises(ValueError, match=bad):
            parse_sweep_shapes(bad)
