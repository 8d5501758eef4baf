"""``paged_attention``'s pure-jnp reference against an independent f64 loop oracle.

The passes of paged_attention_cases.CASES (decode, draft A / B, token tables, verify / extend
tails, ragged causal prefill, padding rows, an empty page table; MQA / GQA / MHA; P 1 / 4 / 8 /
16 / 64; f32 and bf16): every pool position a pass does not read is NaN, and must not reach
the output; a NaN at a read position must. The kernel against the same oracle:
test_paged_attention_triton.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import paged_attention_cases as pc
import pytest

from jspec import probes
from jspec.kernels import paged_attention as pa
from jspec.kernels.paged_attention import paged_attention, paged_attention_reference

DTYPES = ["float32", "bfloat16"]


def _seed(*parts) -> int:
    return sum(ord(c) * (i + 1) for i, c in enumerate("/".join(map(str, parts)))) % 2**31


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(pc.CASES))
def test_reference_matches_oracle(name, dtype):
    case = pc.make_case(np.random.default_rng(_seed(name, dtype)), dtype=dtype, **pc.CASES[name])
    got = paged_attention(*case.jax_args(), **case.static, impl="xla")
    # bf16 pools hold exactly the oracle's (rounded) values; the reference computes in f32.
    pc.check(*got, *pc.oracle(case), atol=2e-5, lse_atol=2e-5)


def test_reference_with_traced_layer():
    case = pc.make_case(
        np.random.default_rng(3), **pc.CASES["verify-tree-n8"], num_layers=4, layer=2
    )
    args = case.jax_args()

    @jax.jit
    def run(layer):
        return paged_attention_reference(*args[:3], layer, *args[4:], **case.static)

    pc.check(*run(jnp.int32(2)), *pc.oracle(case), atol=2e-5, lse_atol=2e-5)


def test_padding_queries_see_nothing_whatever_they_hold():
    """Causal queries past q_lens: 0 and -inf even when their q is NaN (lengths decide)."""
    case = pc.make_case(np.random.default_rng(4), **pc.CASES["prefill-ragged-mqa"])
    want = pc.oracle(case)
    for b, q_len in enumerate(case.q_lens):
        case.q[b, q_len:] = np.nan
    got = paged_attention(*case.jax_args(), **case.static)
    pc.check(*got, *want, atol=2e-5, lse_atol=2e-5)


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("name", ["decode-gqa4-p16", "prefill-ragged-mqa", "verify-tree-n8"])
def test_nan_at_a_read_position_reaches_the_output(name, where):
    """A NaN in K or V that a query sees makes that query's output NaN on the KV head's query
    heads; every other row of the batch stays as the oracle says."""
    case = pc.make_case(np.random.default_rng(5), **pc.CASES[name])
    want_out, want_lse = pc.oracle(case)
    b, i, others = pc.plant_nan(case, where)
    out, lse = (np.asarray(x) for x in paged_attention(*case.jax_args(), **case.static))
    group = case.q.shape[2] // case.k_pool.shape[2]
    assert np.isnan(out[b, i, :group]).any()
    if where == "k":
        assert np.isnan(lse[b, i, :group]).all()
    pc.check(out[others], lse[others], want_out[others], want_lse[others], atol=2e-5, lse_atol=2e-5)


@pytest.mark.parametrize("name", ["decode-gqa4-p16", "verify-tree-n8", "prefill-ragged-mqa"])
def test_reference_out_dtype_is_the_f32_output_rounded_once(name):
    """``out_dtype`` (what FlashAttention returns: the activations' dtype) is the f32 output
    rounded once; lse stays f32."""
    case = pc.make_case(np.random.default_rng(_seed(name)), dtype="bfloat16", **pc.CASES[name])
    out32, lse32 = paged_attention(*case.jax_args(), **case.static, impl="xla")
    out16, lse16 = paged_attention(
        *case.jax_args(), **case.static, impl="xla", out_dtype=jnp.bfloat16
    )
    assert out32.dtype == jnp.float32 and out16.dtype == jnp.bfloat16
    assert lse16.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out16), np.asarray(out32.astype(jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(lse16), np.asarray(lse32))


def test_empty_batch():
    q = jnp.zeros((0, 2, 4, 8), jnp.float32)
    pool = jnp.zeros((1, 16, 2, 8), jnp.float32)
    out, lse = paged_attention(
        q, pool, pool, 0, jnp.zeros((0, 3), jnp.int32), jnp.zeros((0,), jnp.int32), page_size=4
    )
    assert out.shape == (0, 2, 4, 8) and lse.shape == (0, 2, 4)


def _bad_call(**over):
    """paged_attention on a small valid pass with one argument replaced."""
    args = {
        "q": jnp.zeros((2, 3, 4, 8), jnp.float32),
        "k_pool": jnp.zeros((2, 32, 2, 8), jnp.float32),
        "v_pool": jnp.zeros((2, 32, 2, 8), jnp.float32),
        "layer": 0,
        "page_table": jnp.zeros((2, 4), jnp.int32),
        "kv_lens": jnp.zeros((2,), jnp.int32),
        "q_lens": None,
        "tail_slot_ids": None,
        "tail_mask": None,
        "page_size": 4,
        "causal": False,
    }
    knobs = over.pop("knobs", {})
    args.update(over)
    static = {k: args.pop(k) for k in ("page_size", "causal")}
    return paged_attention(*args.values(), **static, **knobs)


@pytest.mark.parametrize(
    "over,match",
    [
        ({"q": jnp.zeros((2, 3, 4), jnp.float32)}, "q.shape"),
        ({"v_pool": jnp.zeros((2, 32, 2, 4), jnp.float32)}, "v_pool.shape"),
        ({"q": jnp.zeros((2, 3, 4, 16), jnp.float32)}, "head_dim"),
        ({"q": jnp.zeros((2, 3, 3, 8), jnp.float32)}, "multiple of Hkv"),
        ({"page_size": 3}, "page_size=3"),
        ({"page_size": 64}, "page_size=64 must divide"),
        ({"page_table": jnp.zeros((3, 4), jnp.int32)}, "page_table.shape"),
        ({"page_table": jnp.zeros((2, 4), jnp.float32)}, "page_table.dtype"),
        ({"kv_lens": jnp.zeros((3,), jnp.int32)}, "kv_lens.shape"),
        ({"kv_lens": jnp.zeros((2,), jnp.int16)}, "kv_lens.dtype"),
        ({"causal": 1}, "causal=1"),
        ({"q_lens": jnp.zeros((2,), jnp.int32)}, "q_lens is only read by causal"),
        ({"q_lens": jnp.zeros((3,), jnp.int32), "causal": True}, "q_lens.shape"),
        ({"q_lens": jnp.zeros((2,), jnp.float32), "causal": True}, "q_lens.dtype"),
        ({"tail_slot_ids": jnp.zeros((2, 5), jnp.int32)}, "give both or neither"),
        (
            {"tail_slot_ids": jnp.zeros((2, 5, 1), jnp.int32), "tail_mask": jnp.zeros((2, 3, 5))},
            "tail_slot_ids.shape",
        ),
        (
            {
                "tail_slot_ids": jnp.zeros((2, 5), jnp.int32),
                "tail_mask": jnp.zeros((2, 3, 4), bool),
            },
            "tail_mask.shape",
        ),
        (
            {"tail_slot_ids": jnp.zeros((2, 5), jnp.int32), "tail_mask": jnp.zeros((2, 3, 5))},
            "tail_mask.dtype",
        ),
        ({"knobs": {"block_n": 24}}, "block_n=24"),
        ({"knobs": {"num_warps": 3}}, "num_warps=3"),
        ({"knobs": {"impl": "cuda"}}, "impl='cuda'"),
        ({"knobs": {"out_dtype": jnp.int32}}, "out_dtype="),
        ({"knobs": {"out_dtype": "float64"}}, "out_dtype='float64'"),
        ({"knobs": {"out_dtype": "bf"}}, "out_dtype='bf'"),
        ({"knobs": {"num_splits": 0}}, "num_splits=0"),
    ],
)
def test_validation_names_the_argument(over, match):
    with pytest.raises(ValueError, match=match):
        _bad_call(**over)


def test_reference_tail_needs_its_mask():
    """Regression: the oracle called directly with tail_slot_ids but no tail_mask failed in
    jnp.any(None) (TypeError); now the ValueError paged_attention's validation gives."""
    q = jnp.zeros((2, 3, 4, 8), jnp.float32)
    pool = jnp.zeros((2, 32, 2, 8), jnp.float32)
    table, lens = jnp.zeros((2, 4), jnp.int32), jnp.zeros((2,), jnp.int32)
    tail = jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="give both or neither"):
        paged_attention_reference(q, pool, pool, 0, table, lens, None, tail, page_size=4)


@pytest.mark.parametrize("layer", [2, -1, True])
def test_validation_of_a_static_layer(layer):
    """An int layer out of ``[0, L)`` (checked where the layer is a Python int: the jitted op
    traces it, so only its direct validation sees one)."""
    q = jnp.zeros((2, 3, 4, 8), jnp.float32)
    pool = jnp.zeros((2, 32, 2, 8), jnp.float32)
    table, lens = jnp.zeros((2, 4), jnp.int32), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match=f"layer={layer!r}"):
        pa._validate(q, pool, pool, layer, table, lens, None, None, None, 4, False)


def test_validation_accepts_a_static_layer_in_range():
    q = jnp.zeros((2, 3, 4, 8), jnp.float32)
    pool = jnp.zeros((2, 32, 2, 8), jnp.float32)
    table, lens = jnp.zeros((2, 4), jnp.int32), jnp.zeros((2,), jnp.int32)
    for layer in (0, 1):
        pa._validate(q, pool, pool, layer, table, lens, None, None, None, 4, False)


def test_knobs_at_their_lower_bounds_are_accepted():
    """The smallest value of each launch knob and bound is valid (``"xla"`` ignores them):
    1 split / stage / key, and ``max_prefix_len=0`` on a pass whose rows are all first
    chunks (``kv_lens == q_lens``)."""
    lens = [5, 3, 0]
    case = pc.make_case(
        np.random.default_rng(6), **pc.CASES["causal-small-p1"] | {"q_lens": lens, "kv_lens": lens}
    )
    knobs = {"num_splits": 1, "num_stages": 1, "max_kv_len": 1, "max_prefix_len": 0}
    got = paged_attention(*case.jax_args(), **case.static, **knobs)
    pc.check(*got, *pc.oracle(case), atol=2e-5, lse_atol=2e-5)


def test_probe_checks_the_page_ids_a_pass_reads_and_only_those():
    """With probes on, a page id a row reads must be in ``[0, S / P)``: the first id past it is
    named; entries from ``ceil(kv_lens / P)`` on are never read, so any value there passes
    (here row 0's column at exactly ``kv_lens / P``, and every column of the empty row 2)."""
    case = pc.make_case(np.random.default_rng(7), **pc.CASES["draftA-k4-mqa"])  # kv 48, 64, 0
    num_page_ids = case.k_pool.shape[1] // case.page_size
    run = probes.checked(paged_attention)
    want = pc.oracle(case)
    pc.check(*run(*case.jax_args(), **case.static), *want, atol=2e-5, lse_atol=2e-5)
    case.page_table[0, 3] = num_page_ids  # unread: position 48 = kv_lens[0]
    case.page_table[2] = -1
    pc.check(*run(*case.jax_args(), **case.static), *want, atol=2e-5, lse_atol=2e-5)
    case.page_table[1, 3] = num_page_ids  # read: positions 48..63 of row 1
    with pytest.raises(probes.ProbeError, match="page id read from page_table"):
        run(*case.jax_args(), **case.static)


def test_a_pass_is_non_causal_by_default():
    """``causal`` left out: every query of a row sees the row's whole prefix (draft pass A's
    K queries), in the op and in the reference alike."""
    case = pc.make_case(np.random.default_rng(8), **pc.CASES["draftA-k4-mqa"])
    want = pc.oracle(case)
    args, page_size = case.jax_args(), case.page_size
    pc.check(*paged_attention(*args, page_size=page_size), *want, atol=2e-5, lse_atol=2e-5)
    got = paged_attention_reference(*args, page_size=page_size)
    pc.check(*got, *want, atol=2e-5, lse_atol=2e-5)
