"""verify_tree_greedy and post-processing: SPEC §13.3 goldens, python-loop oracle, kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tree_oracles import gen_draft_tree, ref_verify_tree_greedy

from jspec import probes
from jspec.kernels.verify_tree_greedy import _verify_tree_greedy_pallas
from jspec.tree.build import TreeMaskMode, build_tree_kernel_efficient
from jspec.tree.verify import (
    compact_accept_to_front,
    eagle_sample_greedy,
    fill_accept_out_cache_loc,
    fill_bonus_tokens,
    verify_tree_greedy,
    verify_tree_greedy_reference,
)
from poisoned_outputs import poisoned_outputs
from tree_geometry import geom

IMPLS = ["xla", "pallas"]

# SPEC §13.3 (sgl_kernel test_eagle_utils.py::test_verify_tree_greedy).
G_CANDIDATES = [[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]
G_RIDX = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
G_NEXT_TOKEN = [[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]
G_NEXT_SIBLING = [[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]


def golden_logits() -> np.ndarray:
    logits = np.ones((2, 6, 20), np.float32)
    for (b, j), tok in {(0, 0): 3, (0, 3): 4, (0, 4): 5, (1, 0): 11, (1, 4): 12}.items():
        logits[b, j, tok] = 10
    hot = logits.max(-1) < 10
    logits[hot, 18] = 10
    return logits


def _i32(x):
    return jnp.asarray(np.asarray(x), jnp.int32)


def _verify(cand, ridx, nt, ns, target, s1, impl="xla", init=-1):
    return verify_tree_greedy(
        _i32(cand),
        _i32(ridx),
        _i32(nt),
        _i32(ns),
        _i32(target),
        num_spec_steps=s1,
        predicts_init=init,
        impl=impl,
    )


def _check_oracle(got, cand, ridx, nt, ns, target, s1, init=-1):
    want = ref_verify_tree_greedy(cand, ridx, nt, ns, target, s1, predicts_init=init)
    for name, g, w in zip(("predicts", "accept_index", "accept_token_num"), got, want):
        np.testing.assert_array_equal(g, w, err_msg=name)


@pytest.mark.parametrize("impl", IMPLS)
def test_golden(impl):
    target = golden_logits().argmax(-1)
    got = _verify(G_CANDIDATES, G_RIDX, G_NEXT_TOKEN, G_NEXT_SIBLING, target, 4, impl)
    assert got[0].tolist() == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
    assert got[1].tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
    assert got[2].tolist() == [3, 2]
    _check_oracle(got, G_CANDIDATES, G_RIDX, G_NEXT_TOKEN, G_NEXT_SIBLING, target, 4)


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_chain(impl):
    got = _verify(
        [[10, 3, 4, 5]], [[0, 1, 2, 3]], [[1, 2, 3, -1]], [[-1] * 4], [[3, 4, 9, 9]], 4, impl
    )
    assert got[0].tolist() == [3, 4, 9, -1]
    assert got[1].tolist() == [[0, 1, 2, -1]]
    assert got[2].tolist() == [2]


@pytest.mark.parametrize("impl", IMPLS)
def test_chain_topk1_forced_accept_counts(impl):
    bs, n, steps, vocab = 4, 4, 3, 100
    rng = np.random.default_rng(0)
    ridx = np.arange(bs * n).reshape(bs, n)
    nt = np.tile([1, 2, 3, -1], (bs, 1))
    ns = np.full((bs, n), -1)
    target = rng.integers(0, vocab, (bs, n))
    cand = rng.integers(0, vocab, (bs, n))
    forced = [b % (steps + 1) for b in range(bs)]
    for b, m in enumerate(forced):
        for i in range(n - 1):
            cand[b, i + 1] = target[b, i] if i < m else (target[b, i] + 1) % vocab
    got = _verify(cand, ridx, nt, ns, target, steps + 1, impl)
    assert got[2].tolist() == forced
    _check_oracle(got, cand, ridx, nt, ns, target, steps + 1)


def _random_tree(rng, bs, topk, steps, n, vocab):
    parent_list, sel = gen_draft_tree(rng, bs, topk, steps, n)
    out = build_tree_kernel_efficient(
        jnp.zeros(bs, jnp.int32),
        _i32(parent_list),
        _i32(sel),
        jnp.zeros((bs, n - 1), jnp.int32),
        jnp.zeros(bs, jnp.int32),
        geometry=geom(topk=topk, num_steps=steps, num_draft_tokens=n),
        mode=TreeMaskMode.QLEN_ONLY,
    )
    cand = rng.integers(0, vocab, (bs, n))
    target = rng.integers(0, vocab, (bs, n))
    return cand, out.retrive_index, out.retrive_next_token, out.retrive_next_sibling, target


@pytest.mark.parametrize("topk,steps,n,bs", [(4, 3, 16, 3), (2, 5, 12, 4), (8, 5, 32, 2)])
def test_random_trees_match_python_loop(topk, steps, n, bs):
    rng = np.random.default_rng(n)
    total = 0
    for _ in range(3):  # small vocab: accepts, rejects and sibling hops all happen
        cand, ridx, nt, ns, target = _random_tree(rng, bs, topk, steps, n, vocab=3)
        assert int((np.asarray(ns) != -1).sum()) > 0 or topk == 1
        got = _verify(cand, ridx, nt, ns, target, steps + 1, init=-7)
        _check_oracle(got, cand, ridx, nt, ns, target, steps + 1, init=-7)
        total += int(got[2].sum())
    assert total > 0


@pytest.mark.parametrize("topk,steps,n,bs", [(8, 5, 32, 3), (4, 3, 13, 2)])
def test_kernel_matches_reference(interpret, topk, steps, n, bs):
    rng = np.random.default_rng(11 * n)
    cand, ridx, nt, ns, target = _random_tree(rng, bs, topk, steps, n, vocab=2)
    args = (_i32(cand), _i32(ridx), _i32(nt), _i32(ns), _i32(target))
    for init in (0, -1):
        ref = verify_tree_greedy_reference(*args, num_spec_steps=steps + 1, predicts_init=init)
        with poisoned_outputs():  # an output element the kernel skips keeps the poison
            got = _verify_tree_greedy_pallas(
                *args[:4],
                args[4].reshape(-1),
                num_spec_steps=steps + 1,
                predicts_init=init,
                interpret=interpret,
            )
        for name, r, g in zip(("predicts", "accept_index", "accept_token_num"), ref, got):
            np.testing.assert_array_equal(g, r, err_msg=name)


@pytest.mark.parametrize("impl", IMPLS)
def test_cyclic_links_terminate(impl):
    # Malformed links (sibling cycle 1 <-> 2, nothing matches): the walk stops after N visits.
    got = _verify([[0, 5, 6]], [[0, 1, 2]], [[1, -1, -1]], [[-1, 2, 1]], [[9, 9, 9]], 3, impl)
    assert got[1].tolist() == [[0, -1, -1]] and got[2].tolist() == [0]
    assert got[0].tolist() == [9, -1, -1]


def test_depth_zero_accepts_nothing():
    got = _verify(G_CANDIDATES, G_RIDX, G_NEXT_TOKEN, G_NEXT_SIBLING, golden_logits().argmax(-1), 1)
    assert got[1].tolist() == [[0], [6]] and got[2].tolist() == [0, 0]
    assert got[0].tolist() == [3, -1, -1, -1, -1, -1, 11, -1, -1, -1, -1, -1]


def test_probes():
    def f(nt):
        return verify_tree_greedy(
            _i32(G_CANDIDATES),
            _i32(G_RIDX),
            nt,
            _i32(G_NEXT_SIBLING),
            _i32(golden_logits().argmax(-1)),
            num_spec_steps=4,
        )[2]

    assert probes.checked(f)(_i32(G_NEXT_TOKEN)).tolist() == [3, 2]
    bad = np.array(G_NEXT_TOKEN)
    bad[1, 3] = 6
    with pytest.raises(probes.ProbeError, match="retrive_next_token vs N: max value 6 >= high"):
        probes.checked(f)(_i32(bad))
    assert "check" not in str(jax.make_jaxpr(f)(_i32(G_NEXT_TOKEN)))


def test_static_errors():
    z = jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(ValueError, match="num_spec_steps=0 must be an int >= 1"):
        verify_tree_greedy(z, z, z, z, z, num_spec_steps=0)
    with pytest.raises(ValueError, match=r"retrive_next_token.shape=\(2, 3\) must be"):
        verify_tree_greedy(z, z, z[:, :3], z, z, num_spec_steps=2)
    with pytest.raises(ValueError, match="impl='triton' is not available"):
        verify_tree_greedy(z, z, z, z, z, num_spec_steps=2, impl="triton")


# ---- eagle_sample (greedy) and post-processing ---------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_eagle_sample_greedy_golden(impl):
    logits = jnp.asarray(golden_logits().reshape(12, 20))
    predict, accept_lens, accept_index = eagle_sample_greedy(
        logits,
        _i32(G_CANDIDATES),
        _i32(G_RIDX),
        _i32(G_NEXT_TOKEN),
        _i32(G_NEXT_SIBLING),
        num_spec_steps=4,
        impl=impl,
    )
    assert predict.tolist() == [3, 0, 0, 4, 5, 18, 11, 0, 0, 0, 12, 18]  # zeros: eagle_sample init
    assert accept_lens.tolist() == [4, 3]
    assert accept_index.tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
    accept_tokens = predict[jnp.maximum(accept_index, 0)]
    assert fill_bonus_tokens(accept_tokens, accept_lens).tolist() == [18, 18]
    compact, _ = compact_accept_to_front(predict, None, accept_index, num_draft_tokens=6)
    # next_token_ids[b*N : b*N + accept_lens[b]] = accepted tokens then the bonus.
    assert compact[0:4].tolist() == [3, 4, 5, 18] and compact[6:9].tolist() == [11, 12, 18]


def test_fill_bonus_tokens():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, (4, 4)).astype(np.int32)
    lens = np.array([1, 4, 2, 3], np.int32)
    got = fill_bonus_tokens(_i32(tokens), _i32(lens))
    np.testing.assert_array_equal(got, tokens[np.arange(4), lens - 1])


def test_fill_accept_out_cache_loc():
    accept_index = np.array([[0, 1, -1, -1], [16, 18, 21, -1], [32, -1, -1, -1]], np.int32)
    rng = np.random.default_rng(0)
    out_cache_loc = rng.permutation(4096)[:48].astype(np.int32)
    got = fill_accept_out_cache_loc(_i32(accept_index), _i32(out_cache_loc))
    flat = accept_index.reshape(-1)
    valid = flat[flat > -1]
    want = np.zeros(12, np.int32)
    want[: valid.size] = out_cache_loc[valid]
    np.testing.assert_array_equal(got, want)
    with pytest.raises(probes.ProbeError, match="accept_index vs"):
        probes.checked(fill_accept_out_cache_loc)(_i32(accept_index), _i32(out_cache_loc[:30]))


def test_compact_accept_to_front():
    bs, n, h = 2, 5, 3
    rng = np.random.default_rng(1)
    predict = np.arange(100, 100 + bs * n, dtype=np.int32)
    hidden = rng.standard_normal((bs * n, h)).astype(np.float32)
    accept_index = np.array([[0, 3, -1], [5, 7, 9]], np.int32)
    got_p, got_h = compact_accept_to_front(
        _i32(predict), jnp.asarray(hidden), _i32(accept_index), num_draft_tokens=n
    )
    safe = np.maximum(accept_index, 0)
    want_p, want_h = predict.copy(), hidden.copy()
    for b in range(bs):
        want_p[b * n : b * n + 3] = predict[safe[b]]
        want_h[b * n : b * n + 3] = hidden[safe[b]]
    np.testing.assert_array_equal(got_p, want_p)
    np.testing.assert_array_equal(got_h, want_h)
    assert got_p[3:5].tolist() == [103, 104]  # entries past S+1 unchanged


def test_kernel_lowers_to_triton_for_gpu():
    """The Pallas-Triton lowering (to TTIR) runs without a GPU: catches unsupported primitives."""
    from jax import export

    z = jnp.zeros((4, 32), jnp.int32)

    def fn(*a):
        return verify_tree_greedy(*a, num_spec_steps=6, impl="pallas", interpret=False)

    exported = export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(z, z, z, z, z)
    assert "xla.gpu.triton" in exported.mlir_module()
