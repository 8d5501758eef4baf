"""check_models: what a target / draft must have and how they must fit, each mistake named.

The members come from the protocols (TargetModel, DraftModel and the ModelGeometry both
extend), so a member the check stops seeing (e.g. an inherited property) fails here."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from jspec.engine.protocol import DraftModel, TargetModel, check_models


@dataclasses.dataclass(frozen=True)
class _Target:
    num_layers: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    hidden_size: int = 32
    vocab_size: int = 64
    dtype: str = "float32"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def logits(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class _Draft(_Target):
    num_layers: int = 1
    capture_layers: tuple[int, ...] = ()

    def combine_hidden_states(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def to_target_ids(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def _without(cls: type, name: str) -> Any:
    """An instance of ``cls`` whose class lacks ``name`` (a field or a method)."""
    obj = cls()
    members = {n: getattr(obj, n) for n in dir(obj) if not n.startswith("_") and n != name}
    return type(f"{cls.__name__}_no_{name}", (), members)()


def test_models_that_fit_pass_and_conform():
    target, draft = _Target(), _Draft(capture_layers=(0, 3))
    check_models(target, draft)
    check_models(target)
    assert isinstance(target, TargetModel) and isinstance(draft, DraftModel)


@pytest.mark.parametrize(
    "name", ["num_layers", "num_kv_heads", "head_dim", "hidden_size", "vocab_size", "dtype"]
)
def test_a_missing_geometry_member_is_named(name):
    with pytest.raises(TypeError, match=rf"target model _Target_no_{name} lacks \['{name}'\]"):
        check_models(_without(_Target, name))
    with pytest.raises(TypeError, match=rf"draft model _Draft_no_{name} lacks \['{name}'\]"):
        check_models(_Target(), _without(_Draft, name))


@pytest.mark.parametrize(
    "cls, name, role",
    [
        (_Target, "forward", "target"),
        (_Target, "logits", "target"),
        (_Draft, "capture_layers", "draft"),
        (_Draft, "combine_hidden_states", "draft"),
        (_Draft, "to_target_ids", "draft"),
    ],
)
def test_a_missing_member_is_named(cls, name, role):
    model = _without(cls, name)
    args = (model,) if role == "target" else (_Target(), model)
    with pytest.raises(TypeError, match=rf"{role} model .* lacks \['{name}'\]"):
        check_models(*args)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_kv_heads", 0, r"target\.num_kv_heads=0 must be an int >= 1"),
        ("head_dim", 8.0, r"target\.head_dim=8\.0 must be an int >= 1"),
        ("num_layers", True, r"target\.num_layers=True must be an int >= 1"),
        ("dtype", "int8", r"target\.dtype='int8' must be one of"),
    ],
)
def test_a_bad_target_field_is_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        check_models(dataclasses.replace(_Target(), **{field: value}))


def test_the_draft_must_fit_the_target():
    with pytest.raises(ValueError, match=r"draft\.capture_layers=\(0, 4\) must lie in \[0, "):
        check_models(_Target(), _Draft(capture_layers=(0, 4)))
    with pytest.raises(ValueError, match=r"draft\.capture_layers=\(-1,\) must lie in"):
        check_models(_Target(), _Draft(capture_layers=(-1,)))
    with pytest.raises(ValueError, match=r"draft\.vocab_size=65 must be <= target\.vocab_size"):
        check_models(_Target(), _Draft(vocab_size=65))
    with pytest.raises(ValueError, match=r"draft\.hidden_size=0 must be an int >= 1"):
        check_models(_Target(), _Draft(hidden_size=0))
