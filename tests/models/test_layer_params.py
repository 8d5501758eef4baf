"""``LayerParams``: the fused q/k/v and gate/up layout, built from and read back as the
checkpoint's separate projections, and the same forward as the separate matmuls."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.models import LayerParams
from jspec.models.layers import apply_rope, attention_block, mlp_block, rope_inv_freq

HIN, HQ, HKV, D, H, INTER = 24, 6, 2, 4, 24, 20


def _parts(rng, xp=np):
    def w(a, b):
        return xp.asarray(rng.standard_normal((a, b)), np.float32)

    return dict(
        attn_norm=xp.asarray(rng.standard_normal(H), np.float32),
        wq=w(HIN, HQ * D),
        wk=w(HIN, HKV * D),
        wv=w(HIN, HKV * D),
        wo=w(HQ * D, H),
        mlp_norm=xp.asarray(rng.standard_normal(H), np.float32),
        w_gate=w(H, INTER),
        w_up=w(H, INTER),
        w_down=w(INTER, H),
    )


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_round_trip(xp):
    parts = _parts(np.random.default_rng(0), xp)
    lp = LayerParams.from_projections(**parts, head_dim=D)
    assert lp.wqkv.shape == (HIN, HKV, HQ // HKV + 2, D)
    assert lp.w_gate_up.shape == (H, 2, INTER)
    for name in ("wq", "wk", "wv", "w_gate", "w_up"):
        np.testing.assert_array_equal(np.asarray(getattr(lp, name)), np.asarray(parts[name]))
    # KV head g's query heads sit beside its K and V (so a TP shard holds whole groups).
    group = HQ // HKV
    np.testing.assert_array_equal(
        np.asarray(lp.wqkv[:, 1, :group]).reshape(HIN, -1),
        np.asarray(parts["wq"])[:, group * D : 2 * group * D],
    )


def test_forward_equals_separate_matmuls():
    rng = np.random.default_rng(1)
    parts = _parts(rng)
    lp = LayerParams.from_projections(**parts, head_dim=D)
    t = 5
    h = rng.standard_normal((t, HIN)).astype(np.float32)
    pos = np.arange(t, dtype=np.int32) + 3
    inv_freq = rope_inv_freq(D, 10000.0, None)
    seen = {}

    def attn_fn(layer, pool, q, k, v):
        seen.update(q=q, k=k, v=v)
        return pool, jnp.repeat(v, HQ // HKV, axis=1) + q  # any function of q, k, v

    _, out = attention_block(
        lp.wqkv, lp.wo, jnp.asarray(h), 0, None, pos, attn_fn, inv_freq=inv_freq
    )
    hp = np.asarray(h, np.float64)
    q = apply_rope(jnp.asarray(hp @ parts["wq"], jnp.float32).reshape(t, HQ, D), pos, inv_freq)
    k = apply_rope(jnp.asarray(hp @ parts["wk"], jnp.float32).reshape(t, HKV, D), pos, inv_freq)
    v = (hp @ parts["wv"]).reshape(t, HKV, D)
    np.testing.assert_allclose(np.asarray(seen["q"]), np.asarray(q), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(seen["k"]), np.asarray(k), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(seen["v"]), v, rtol=1e-5, atol=1e-5)
    want = (np.repeat(v, HQ // HKV, axis=1) + np.asarray(q)).reshape(t, -1) @ parts["wo"]
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4)

    x = rng.standard_normal((t, H)).astype(np.float32)
    gate = x.astype(np.float64) @ parts["w_gate"]
    want = (gate / (1 + np.exp(-gate)) * (x @ parts["w_up"])) @ parts["w_down"]
    got = mlp_block(lp.w_gate_up, lp.w_down, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "field,shape,match",
    [
        ("wk", (HIN, HKV * D + 1), "wk.shape"),
        ("wv", (HIN, 2 * HKV * D), "wv.shape"),
        ("wq", (HIN, HKV * D + D), "wq.shape"),
        ("w_up", (H, INTER + 1), "w_up.shape"),
    ],
)
def test_bad_shapes_name_the_field(field, shape, match):
    parts = _parts(np.random.default_rng(2))
    parts[field] = np.zeros(shape, np.float32)
    with pytest.raises(ValueError, match=match):
        LayerParams.from_projections(**parts, head_dim=D)
