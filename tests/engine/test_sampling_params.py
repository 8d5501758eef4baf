"""SamplingParams: validation naming the field, dict parsing (the prompts-file hook), seeds,
and the batch packing of the device-side SamplingBatch."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jspec.engine import SamplingBatch, SamplingParams
from jspec.engine.inputs import InputError
from jspec.engine.sampling_params import GREEDY, normalize_sampling, pack_sampling
from jspec.tree.sampling import LossyThresholds


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("temperature", -0.1, r"temperature=-0.1 must be >= 0"),
        ("temperature", math.nan, "temperature=nan must be finite"),
        ("temperature", "1", "temperature='1' must be a number"),
        ("temperature", True, "temperature=True must be a number"),
        ("top_k", -1, r"top_k=-1 must be >= 0"),
        ("top_k", 2.0, r"top_k=2.0 must be an int"),
        ("top_p", 0.0, r"top_p=0.0 must be in \(0, 1\]"),
        ("top_p", 1.5, r"top_p=1.5 must be in \(0, 1\]"),
        ("min_p", -0.5, r"min_p=-0.5 must be in \[0, 1\]"),
        ("min_p", 1.01, r"min_p=1.01 must be in \[0, 1\]"),
        ("seed", -1, r"seed=-1 must be in \[0, 2\*\*64\)"),
        ("seed", 2**64, r"seed=18446744073709551616 must be in"),
        ("seed", 1.0, r"seed=1.0 must be an int"),
    ],
)
def test_bad_values_name_the_field(field, value, match):
    with pytest.raises(InputError, match=match):
        SamplingParams(**{field: value})


def test_defaults_are_greedy_and_edges_are_valid():
    assert GREEDY.is_greedy and SamplingParams() == GREEDY
    SamplingParams(temperature=2.0, top_k=1, top_p=1e-6, min_p=1.0, seed=2**64 - 1)
    assert not SamplingParams(temperature=1e-3).is_greedy


def test_from_dict_overrides_a_base():
    base = SamplingParams(temperature=0.7, top_p=0.9, seed=3)
    line = SamplingParams.from_dict({"top_p": 0.5, "seed": 11}, base=base)
    assert line == SamplingParams(temperature=0.7, top_p=0.5, seed=11)
    assert SamplingParams.from_dict(line.to_dict()) == line
    with pytest.raises(InputError, match=r"unknown sampling field\(s\) \['top-p'\]"):
        SamplingParams.from_dict({"top-p": 0.5}, base=base)
    with pytest.raises(InputError, match="top_k=-2"):
        SamplingParams.from_dict({"top_k": -2})


def test_resolved_draws_a_seed_only_when_sampling():
    assert GREEDY.resolved() is GREEDY
    fixed = SamplingParams(temperature=1.0, seed=5)
    assert fixed.resolved() is fixed
    a, b = SamplingParams(temperature=1.0).resolved(), SamplingParams(temperature=1.0).resolved()
    assert a.seed is not None and a.seed != b.seed


def test_normalize():
    shared = SamplingParams(temperature=1.0)
    out = normalize_sampling(shared, 3)
    assert len({p.seed for p in out}) == 3  # one object, three independent requests
    assert normalize_sampling(None, 2) == [GREEDY, GREEDY]
    assert normalize_sampling([None, shared.resolved()], 2)[0] == GREEDY
    with pytest.raises(InputError, match="sampling has 1 entries for 2 requests"):
        normalize_sampling([shared], 2)


def test_pack_sampling_shapes_and_static_presence():
    a = SamplingParams(temperature=0.5, top_p=0.9, seed=(7 << 32) | 3)
    b = SamplingParams(temperature=1.0, seed=1)
    batch = pack_sampling([[a, None], [b, GREEDY]])
    assert isinstance(batch, SamplingBatch)
    assert batch.temperature.shape == (2, 2) and batch.seed.shape == (2, 2, 2)
    np.testing.assert_array_equal(batch.temperature, [[0.5, 0.0], [1.0, 0.0]])
    np.testing.assert_array_equal(batch.seed[0, 0], [7, 3])
    assert batch.top_k is None and batch.min_p is None  # nobody uses them: not compiled
    np.testing.assert_allclose(batch.top_p, [[0.9, 1.0], [1.0, 1.0]])
    # A sampled request at a filter's off value (top_p 1) does not switch it on either.
    assert pack_sampling([b]).top_p is None
    # A greedy request's filters do not switch a filter on.
    assert pack_sampling([b, SamplingParams(top_k=3)]).top_k is None
    lossy = LossyThresholds(threshold_acc=0.5)
    assert pack_sampling([b], lossy).lossy == lossy
    with pytest.raises(InputError, match="a sampled entry has no seed"):
        pack_sampling([SamplingParams(temperature=1.0)])


def test_lossy_thresholds_validate():
    with pytest.raises(ValueError, match=r"threshold_acc=1.5 must be in \[0, 1\]"):
        LossyThresholds(threshold_acc=1.5)
    with pytest.raises(ValueError, match="threshold_single='x'"):
        LossyThresholds(threshold_single="x")
    with pytest.raises(ValueError, match="threshold_acc=True must be a float"):
        LossyThresholds(threshold_acc=True)
    LossyThresholds(threshold_single=0.0, threshold_acc=0.0)  # both ends of [0, 1] are valid
    LossyThresholds(threshold_single=1, threshold_acc=1)
