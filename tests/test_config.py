"""SpecConfig validation and the SPEC.md §3/§4/§14 sizing examples."""

from __future__ import annotations

import pytest

from jspec.config import SpecConfig


def test_spec_examples_alloc_len() -> None:
    cfg = SpecConfig(page_size=4, topk=2, num_steps=3, num_draft_tokens=4)
    assert cfg.alloc_len_per_decode == 16
    assert cfg.alloc_reserve_per_decode == 32
    # SPEC.md §14: row width >= ctx + max(4+4, 32+3) = ctx + 35.
    assert cfg.req_to_token_extra_len == 35
    assert cfg.req_to_token_width == cfg.context_len + 35
    big = SpecConfig(page_size=64, topk=8, num_steps=5, num_draft_tokens=32)
    assert big.alloc_len_per_decode == 1024
    assert big.alloc_reserve_per_decode == 2048


@pytest.mark.parametrize(
    "page_size,topk,steps,ndt,expected",
    [
        pytest.param(1, 8, 5, 32, 40, id="page1_S*K"),
        pytest.param(1, 2, 3, 8, 8, id="page1_ndt_dominates"),
        pytest.param(16, 1, 5, 6, 6, id="topk1_ndt"),
        pytest.param(16, 1, 7, 2, 7, id="topk1_steps"),
        pytest.param(16, 4, 3, 8, 2 * 16 * 4, id="holey_two_pages"),
        pytest.param(16, 4, 1, 5, 1 * 16 * 4, id="holey_one_page"),
        pytest.param(4, 2, 6, 8, 3 * 4 * 2, id="holey_three_pages"),
        pytest.param(2, 8, 2, 70, 70, id="holey_ndt_dominates"),
    ],
)
def test_alloc_len_branches(page_size, topk, steps, ndt, expected) -> None:
    cfg = SpecConfig(page_size=page_size, topk=topk, num_steps=steps, num_draft_tokens=ndt)
    assert cfg.alloc_len_per_decode == expected
    # Independent formula: worst last page P-1, S drafts, per branch ceil((P-1+S)/P) pages.
    if page_size > 1 and topk > 1:
        nnp = -(-(page_size - 1 + steps) // page_size)
        assert cfg.alloc_len_per_decode == max(nnp * page_size * topk, ndt)


def test_no_spec_and_adaptive() -> None:
    assert SpecConfig(spec_enabled=False).alloc_len_per_decode == 1
    cfg = SpecConfig(page_size=1, topk=2, num_steps=2, num_draft_tokens=4, max_num_draft_tokens=9)
    assert cfg.ndt_max == 9 and cfg.alloc_len_per_decode == 9


def test_derived_sizes() -> None:
    cfg = SpecConfig(page_size=16, num_pages=100, max_running_requests=8, topk=4, context_len=512)
    assert cfg.pool_size == 1600 and cfg.num_slots == 1616
    assert cfg.num_req_rows == 9
    assert cfg.kv_indices_width(8) == 8 * 4 * 512
    assert cfg.is_holey and not SpecConfig(page_size=1).is_holey
    hash(cfg)  # static jit argument


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"page_size": 3}, "page_size"),
        ({"page_size": 0}, "page_size"),
        ({"topk": 0}, "topk"),
        ({"num_steps": 0}, "num_steps"),
        (
            {"num_steps": 17, "topk": 1, "num_draft_tokens": 8},
            "num_steps=17 must be <= MAX_NUM_STEPS=16",
        ),
        ({"num_draft_tokens": 0}, "num_draft_tokens"),
        ({"topk": 2, "num_steps": 2, "num_draft_tokens": 8}, "num_draft_tokens"),
        ({"topk": 1, "num_steps": 3, "num_draft_tokens": 5}, "num_draft_tokens"),
        ({"context_len": 0}, "context_len"),
        ({"max_running_requests": 0}, "max_running_requests"),
        ({"num_pages": 0}, "num_pages"),
        ({"num_layers": -1}, "num_layers"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"head_dim": 0}, "head_dim"),
        ({"dtype": "int8"}, "dtype"),
        ({"page_size": 2.0}, "page_size"),
        ({"max_num_draft_tokens": -1}, "max_num_draft_tokens"),
        ({"topk": 8, "num_steps": 20, "num_draft_tokens": 1100}, "num_draft_tokens"),
        ({"max_running_requests": 4096, "topk": 8, "context_len": 131072}, "max_running_requests"),
        ({"num_pages": 2**27, "page_size": 64}, "num_pages"),
    ],
)
def test_invalid_config_names_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SpecConfig(**kwargs)


def test_frozen() -> None:
    cfg = SpecConfig()
    with pytest.raises(AttributeError):
        cfg.page_size = 8  # type: ignore[misc]
