"""Probes: named errors with the offending value when on; nothing in the jaxpr when off."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import probes


def _all_probes(x, idx):
    probes.detect_nan(x, "p.nan")
    probes.detect_inf(x, "p.inf")
    probes.detect_oob(idx, 0, 10, "p.oob")
    probes.detect_in_closed_range(idx, 0, 10, "p.closed")
    probes.detect_page_aligned(idx, 4, "p.aligned")
    probes.assert_async(lambda: jnp.sum(idx) < 1000, "p.sum {total}", total=lambda: jnp.sum(idx))
    return x * 2, idx + 1


GOOD_X = jnp.array([1.0, 2.0, 3.0])
GOOD_IDX = jnp.array([0, 4, 8], jnp.int32)


def test_off_adds_nothing_to_jaxpr() -> None:
    assert not probes.probes_on()
    with_probes = str(jax.make_jaxpr(_all_probes)(GOOD_X, GOOD_IDX))
    plain = str(jax.make_jaxpr(lambda x, i: (x * 2, i + 1))(GOOD_X, GOOD_IDX))
    assert with_probes == plain


def test_on_adds_checks() -> None:
    with probes.probes_enabled():
        jaxpr = str(jax.make_jaxpr(_all_probes)(GOOD_X, GOOD_IDX))
    assert "check" in jaxpr


def test_clean_inputs_pass() -> None:
    out_x, out_idx = probes.checked(_all_probes)(GOOD_X, GOOD_IDX)
    np.testing.assert_array_equal(out_x, GOOD_X * 2)
    np.testing.assert_array_equal(out_idx, GOOD_IDX + 1)


@pytest.mark.parametrize(
    "x,idx,pattern",
    [
        pytest.param(jnp.array([1.0, jnp.nan, 3.0]), GOOD_IDX, r"p\.nan: 1 NaN.*index 1", id="nan"),
        pytest.param(
            jnp.array([1.0, 2.0, -jnp.inf]), GOOD_IDX, r"p\.inf: 1 Inf.*index 2", id="inf"
        ),
        pytest.param(
            GOOD_X, jnp.array([0, 4, 12], jnp.int32), r"p\.oob: max value 12 >= high", id="oob_high"
        ),
        pytest.param(
            GOOD_X, jnp.array([-4, 4, 8], jnp.int32), r"p\.oob: min value -4 < low", id="oob_low"
        ),
        pytest.param(
            GOOD_X,
            jnp.array([0, 5, 8], jnp.int32),
            r"p\.aligned: value 5 at flat index 1 is not a multiple of page_size=4",
            id="misaligned",
        ),
    ],
)
def test_planted_errors_are_named(x, idx, pattern) -> None:
    with pytest.raises(probes.ProbeError, match=pattern):
        probes.checked(_all_probes)(x, idx)


def test_assert_async_names_value() -> None:
    def f(i):
        probes.assert_async(lambda: jnp.sum(i) < 1000, "p.sum {total}", total=lambda: jnp.sum(i))
        return i

    probes.checked(f)(jnp.array([1, 2], jnp.int32))
    with pytest.raises(probes.ProbeError, match="p.sum 1200"):
        probes.checked(f)(jnp.array([400, 800], jnp.int32))


def test_closed_range_accepts_high() -> None:
    def f(i):
        probes.detect_in_closed_range(i, 0, 10, "closed")
        return i

    probes.checked(f)(jnp.array([10], jnp.int32))
    with pytest.raises(probes.ProbeError, match="closed: max value 11 > high bound 10"):
        probes.checked(f)(jnp.array([11], jnp.int32))


def test_where_mask_ignores_padding() -> None:
    def f(i, valid):
        probes.detect_oob(i, 0, 10, "masked", where=valid)
        return i

    probes.checked(f)(jnp.array([3, 99], jnp.int32), jnp.array([True, False]))
    with pytest.raises(probes.ProbeError, match="masked: max value 99"):
        probes.checked(f)(jnp.array([3, 99], jnp.int32), jnp.array([True, True]))


def test_return_error_mode_and_jit() -> None:
    f = jax.jit(_all_probes)
    err, _ = probes.checked(f, raise_error=False)(GOOD_X, jnp.array([0, 4, 40], jnp.int32))
    assert "p.oob" in err.get()
    # Back outside: plain jit of the same function runs with probes off (retraced).
    out = f(GOOD_X, jnp.array([0, 4, 40], jnp.int32))
    np.testing.assert_array_equal(out[1], [1, 5, 41])


def test_empty_and_none_skipped() -> None:
    def f(x):
        probes.detect_nan(x, "empty")
        probes.detect_oob(None, 0, 1, "none")
        return x

    probes.checked(f)(jnp.zeros((0,), jnp.float32))


def test_page_aligned_skips_page1() -> None:
    def f(i):
        probes.detect_page_aligned(i, 1, "p1")
        return i

    with probes.probes_enabled():
        assert "check" not in str(jax.make_jaxpr(f)(jnp.array([3], jnp.int32)))


def test_static_checks() -> None:
    probes.assert_buffer_fits(10, 10, "buf")
    with pytest.raises(ValueError, match=r"kv_indices: needs 11 but buffer holds 10 \(topk=8\)"):
        probes.assert_buffer_fits(11, 10, "kv_indices", topk=8)
    with pytest.raises(ValueError, match=r"x.shape=\(3,\) must be \(4,\)"):
        probes.static_check_shape(jnp.zeros(3), (4,), "x")
    with pytest.raises(ValueError, match="x.dtype=float32"):
        probes.static_check_dtype(jnp.zeros(3), jnp.int32, "x")
    probes.static_check_int(1, "n")
    probes.static_check_int(0, "step", low=0)
    for bad in (0, 2.0, "3", None):
        with pytest.raises(ValueError, match=f"n={bad!r} must be an int >= 1"):
            probes.static_check_int(bad, "n")
    for good in (1, 2, 64):
        probes.static_check_power_of_2(good, "page_size")
    for bad in (0, 3, -4, 4.0):
        with pytest.raises(ValueError, match=f"page_size={bad!r} must be a power of 2"):
            probes.static_check_power_of_2(bad, "page_size")


# ---- the switch: one mechanism under checked, plain jit, eager and the env var -------------------
def _counting(counter):
    def f(idx):
        counter.append(1)
        probes.detect_oob(idx, 0, 10, "p.count")
        return idx + 1

    return f


def test_probe_error_is_assertion_error() -> None:
    assert issubclass(probes.ProbeError, AssertionError)
    with pytest.raises(AssertionError, match=r"p\.oob: max value 12"):
        probes.checked(_all_probes)(GOOD_X, jnp.array([0, 4, 12], jnp.int32))


def test_checked_caches_and_leaves_other_jits_alone() -> None:
    traces, other = [], []
    f = _counting(traces)
    g = jax.jit(lambda x: (other.append(1), x * 2)[1])
    g(GOOD_IDX)
    for _ in range(3):
        probes.checked(f)(GOOD_IDX)
    assert len(traces) == 1  # traced once, then cached (no clear_caches)
    with pytest.raises(probes.ProbeError, match=r"p\.count: max value 11 >= high bound 10"):
        probes.checked(f)(jnp.array([0, 11, 2], jnp.int32))
    assert len(traces) == 1
    g(GOOD_IDX)
    assert len(other) == 1  # an unrelated jitted function did not retrace


def test_switch_is_part_of_the_jit_key() -> None:
    traces = []
    f = jax.jit(_counting(traces))
    bad = jnp.array([0, 11, 2], jnp.int32)
    np.testing.assert_array_equal(f(bad), [1, 12, 3])  # off: no check in the program
    with probes.probes_enabled():
        with pytest.raises(Exception, match=r"p\.count: max value 11 >= high bound 10"):
            jax.block_until_ready(f(bad))  # plain jit: runtime error
        np.testing.assert_array_equal(f(GOOD_IDX), [1, 5, 9])
    np.testing.assert_array_equal(f(bad), [1, 12, 3])  # off variant reused
    assert len(traces) == 2  # one trace per switch value


def test_eager_probe_fires_when_on() -> None:
    with probes.probes_enabled(), pytest.raises(Exception, match=r"p\.count: max value 11"):
        _counting([])(jnp.array([0, 11, 2], jnp.int32))
    _counting([])(jnp.array([0, 11, 2], jnp.int32))  # off: nothing


def test_checked_static_kwargs() -> None:
    def f(idx, *, high, name):
        probes.detect_oob(idx, 0, high, name)
        return idx * high

    np.testing.assert_array_equal(probes.checked(f)(GOOD_IDX, high=10, name="kw"), [0, 40, 80])
    with pytest.raises(probes.ProbeError, match=r"kw2: max value 8 >= high bound 5"):
        probes.checked(f)(GOOD_IDX, high=5, name="kw2")


def test_env_switch_under_plain_jit(tmp_path) -> None:
    import os
    import subprocess
    import sys

    code = (
        "import jax, jax.numpy as jnp\n"
        "from jspec import probes\n"
        "assert probes.probes_on()\n"
        "f = jax.jit(lambda i: (probes.detect_oob(i, 0, 10, 'env.oob'), i + 1)[1])\n"
        "assert f(jnp.array([1, 2], jnp.int32)).tolist() == [2, 3]\n"
        "try:\n"
        "    jax.block_until_ready(f(jnp.array([1, 42], jnp.int32)))\n"
        "except Exception as e:\n"
        "    assert 'env.oob: max value 42 >= high bound 10' in str(e), str(e)\n"
        "    print('FIRED')\n"
    )
    env = {**os.environ, "JSPEC_ENABLE_ASYNC_ASSERT": "1", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "FIRED" in out.stdout
