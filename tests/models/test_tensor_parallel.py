"""param_specs + tp_axis: a 2-way head-sharded target and EAGLE-3 head (shard_map over 2 host
devices) give the one-device outputs. XLA's host device count must be set before JAX starts,
so the check runs in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import sys
    sys.path.insert(0, {helpers!r})
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from models_helpers import TARGET, dense_attn_fn
    from jspec.models import Eagle3Config, Eagle3Draft, random_eagle3_params, random_llama_params

    assert len(jax.devices()) == 2
    mesh = Mesh(np.asarray(jax.devices()), ("tp",))
    params = random_llama_params(TARGET, seed=1)
    draft = Eagle3Draft(Eagle3Config(hidden_size=32, intermediate_size=40, num_heads=4,
                                     num_kv_heads=2, head_dim=8, vocab_size=96,
                                     draft_vocab_size=40), (2, 4, 5))
    head = random_eagle3_params(draft, seed=2)
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 96, 10), jnp.int32)
    pos = jnp.arange(10, dtype=jnp.int32) + 5

    def run(p, h, tp_axis):
        _, hidden, aux = TARGET.forward(p, None, ids, pos, dense_attn_fn,
                                        capture_layers=draft.capture_layers, tp_axis=tp_axis)
        feature = draft.combine_hidden_states(h, aux)
        _, out = draft.forward(h, p, None, ids, feature, pos, dense_attn_fn, tp_axis=tp_axis)
        return TARGET.logits(p, hidden), draft.logits(h, p, out)

    want = jax.jit(lambda p, h: run(p, h, None))(params, head)
    specs = (TARGET.param_specs(params, "tp"), draft.param_specs(head, "tp"))
    placed = jax.device_put((params, head), jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    # Whole KV-head groups per device: 1 of 2 KV heads with its 2 query heads, K and V.
    assert placed[0].layers[0].wqkv.addressable_shards[0].data.shape == (32, 1, 4, 12)
    assert placed[0].layers[0].w_gate_up.addressable_shards[0].data.shape == (32, 2, 24)
    assert placed[1].layer.wqkv.addressable_shards[0].data.shape == (64, 1, 4, 8)
    sharded = jax.jit(jax.shard_map(lambda p, h: run(p, h, "tp"), mesh=mesh, in_specs=specs,
                                    out_specs=P(), check_vma=False))
    got = sharded(*placed)
    for g, w in zip(got, want):
        assert np.abs(np.asarray(w)).max() > 0.5
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    print("TP OK")
""")


def test_two_way_tensor_parallel_matches_one_device():
    helpers = os.path.dirname(os.path.abspath(__file__))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [os.path.dirname(os.path.dirname(helpers)), os.environ.get("PYTHONPATH", "")]
        ),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(helpers=helpers)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TP OK" in proc.stdout
