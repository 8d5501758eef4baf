"""Every public drop-in (and its PyTorch reference) keeps sglang 0.5.23's signature.

The table is tests/interop/sglang_0_5_23_signatures.py (read from the 0.5.23 wheel). A drop-in
matches when sglang's parameters come first with the same names, kinds, order and defaults, and
anything jspec adds (``impl``, ``interpret``, ...) is keyword-only with a default, so sglang's
positional and keyword callers both work unchanged.
"""

from __future__ import annotations

import ast
import inspect

import pytest

pytest.importorskip("torch")

from sglang_0_5_23_signatures import DOCUMENTED_DIFFERENCES, SIGNATURES

from interop import registry, torch_api
from interop.kv import reference_allocator

_NO_DEFAULT = inspect.Parameter.empty
METHODS = sorted(
    k.split(".", 1)[1] for k in SIGNATURES if k.startswith("PagedTokenToKVPoolAllocator.")
)


def _ours(fn) -> list[tuple[str, str, object]]:
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return [(p.name, p.kind.name, p.default) for p in params]


def _mismatches(name: str, fn) -> list[str]:
    """Differences between ``fn``'s signature and sglang's recorded one (empty = compatible)."""
    want = SIGNATURES[name]
    got = _ours(fn)
    problems = []
    for i, (pname, kind, default) in enumerate(want):
        if i >= len(got):
            problems.append(f"missing parameter {pname!r}")
            continue
        gname, gkind, gdefault = got[i]
        if (gname, gkind) != (pname, kind):
            problems.append(f"parameter {i}: {gname!r} {gkind} but sglang has {pname!r} {kind}")
        elif default is None and gdefault is not _NO_DEFAULT:
            problems.append(f"{pname!r} has default {gdefault!r}; sglang has none")
        elif default is not None and (
            gdefault is _NO_DEFAULT or gdefault != ast.literal_eval(default)
        ):
            problems.append(f"{pname!r} default {gdefault!r}; sglang {default}")
    for gname, gkind, gdefault in got[len(want) :]:
        if gkind != "KEYWORD_ONLY" or gdefault is _NO_DEFAULT:
            problems.append(f"extra parameter {gname!r} must be keyword-only with a default")
    return problems


@pytest.mark.parametrize("name", sorted(torch_api.__all__))
def test_dropin_signature_matches_sglang(name):
    fn = getattr(torch_api, name)
    if name in DOCUMENTED_DIFFERENCES:
        why, params = DOCUMENTED_DIFFERENCES[name]
        assert why and tuple(p for p, _, _ in _ours(fn)) == params, name
        return
    if inspect.isclass(fn):
        for method in METHODS:
            problems = _mismatches(f"{name}.{method}", getattr(fn, method))
            assert not problems, (method, problems)
        return
    assert name in SIGNATURES, f"{name}: no sglang 0.5.23 signature recorded"
    assert not _mismatches(name, fn), _mismatches(name, fn)


def test_every_recorded_name_has_a_dropin():
    names = {k.split(".")[0] for k in SIGNATURES} | set(DOCUMENTED_DIFFERENCES)
    assert names == set(torch_api.__all__)


@pytest.mark.parametrize("method", METHODS)
def test_reference_allocator_signature_matches_sglang(method):
    cls = reference_allocator.PagedTokenToKVPoolAllocator
    assert not _mismatches(f"PagedTokenToKVPoolAllocator.{method}", getattr(cls, method))


def test_references_in_the_registry_match_sglang():
    checked = 0
    for op in registry.REGISTRY:
        name = op.reference.__name__ if op.reference is not None else ""
        if name in SIGNATURES and name not in DOCUMENTED_DIFFERENCES:
            assert not _mismatches(name, op.reference), (op.name, _mismatches(name, op.reference))
            checked += 1
    assert checked >= 8


def test_keyword_callers_of_build_tree_and_free_segment():
    """The two regressions of issue 11: sglang's keyword names are accepted."""
    sig = inspect.signature(torch_api.build_tree_kernel_efficient)
    sig.bind(
        bonus_tokens=1,
        parent_list=1,
        top_scores_index=1,
        draft_tokens=1,
        seq_lens=1,
        seq_lens_sum=1,
        topk=1,
        spec_steps=1,
        num_verify_tokens=1,
        fill_prefix_mask=False,
    )
    with pytest.raises(TypeError):
        sig.bind(verified_id=1)
    free_segment = inspect.signature(torch_api.PagedTokenToKVPoolAllocator.free_segment)
    free_segment.bind(None, 1, start_pos=0)
    with pytest.raises(TypeError):
        free_segment.bind(None, 1, 0)  # start_pos is keyword-only in 0.5.23


def test_mismatch_detector_catches_each_kind_of_difference():
    def renamed(verified_id, parent_list): ...

    def extra_positional(bonus_tokens, parent_list, x=1): ...

    table = {
        "f": (
            ("bonus_tokens", "POSITIONAL_OR_KEYWORD", None),
            ("parent_list", "POSITIONAL_OR_KEYWORD", None),
        )
    }
    real = dict(SIGNATURES)
    try:
        SIGNATURES.clear()
        SIGNATURES.update(table)
        assert _mismatches("f", renamed)
        assert _mismatches("f", extra_positional)

        def ok(bonus_tokens, parent_list, *, impl="xla"): ...

        assert not _mismatches("f", ok)
    finally:
        SIGNATURES.clear()
        SIGNATURES.update(real)
