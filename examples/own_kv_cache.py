"""Bring your own KV cache: jspec's EAGLE spec step over a KV cache kept the way another serving
engine keeps it, with its own block allocator, written here in plain JAX.

vLLM and tpu-inference keep, per request, a **block table** (the ids of the KV blocks holding
its tokens, ``block_size`` tokens each) and a count of computed tokens; a block allocator hands
out free blocks. ``BlockTableKV`` below is that state (per batch slot) and ``BlockTableBackend``
implements jspec's ``KVBackend`` protocol over it: back the positions a step will write
(``prepare_decode`` / ``prepare_prefill``, popping blocks off a free stack), set the lengths
(``commit``), give the blocks back (``release``). The step sees the memory only through the
``KVView`` the backend returns, built from the block tables by ``view_from_page_table``; it
computes the draft layout, the verify window, the accepted-KV move and every attention pass
from it. Plugged in as ``Runner(ecfg, target, draft, kv=BlockTableBackend(...))``, the toy
target and its EAGLE-1 head decode speculatively and emit exactly the plain greedy tokens,
one step a call (``spec_decode_step``) or several rounds a dispatch (``decode_rounds``: the
loop a serving engine runs, each request stopped on the device at its budget).

    PYTHONPATH=. python examples/own_kv_cache.py
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jspec.engine import (
    DraftModel,
    KVView,
    Runner,
    TargetModel,
    Weights,
    decode_rounds,
    greedy_step,
    init_engine_state,
    make_engine_config,
    prefill,
    release,
    spec_decode_step,
    view_from_page_table,
)
from jspec.kv import KVPool
from jspec.models import (
    Eagle1Draft,
    Eagle1Params,
    LlamaConfig,
    LlamaParams,
    LlamaTarget,
    toy_eagle1,
    toy_llama_params,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockTableKV:
    """The engine's KV state (``M`` batch slots, ``NB`` blocks; block 0 is never handed out:
    it is the padding block jspec writes padding entries to)."""

    block_tables: jax.Array  # i32[M, max_blocks] block ids of each slot's request (0: none)
    num_blocks: jax.Array  # i32[M] blocks each slot's request holds
    seq_lens: jax.Array  # i32[M] KV-ready tokens (vLLM's num_computed_tokens)
    live: jax.Array  # bool[M] the request decodes
    held: jax.Array  # bool[M] the slot holds a request (decoding or prefilling)
    free_blocks: jax.Array  # i32[NB] a stack of free block ids, [0 : num_free) valid
    num_free: jax.Array  # i32[]
    target_pool: KVPool  # [layers, (NB + 1) * block_size, kv_heads, head_dim]
    draft_pool: KVPool | None


@dataclasses.dataclass(frozen=True)
class BlockTableBackend:
    """``jspec.engine.KVBackend`` over :class:`BlockTableKV` (static, hashable)."""

    block_size: int
    num_blocks: int
    max_blocks: int  # per request: covers context_len + the spec step's reserve
    max_seqs: int

    def init_state(self, target: TargetModel, draft: DraftModel | None) -> BlockTableKV:
        def pool(model: TargetModel | DraftModel) -> KVPool:
            slots = (self.num_blocks + 1) * self.block_size
            shape = (model.num_layers, slots, model.num_kv_heads, model.head_dim)
            k, v = (jnp.zeros(shape, jnp.dtype(model.dtype)) for _ in "kv")
            return KVPool(k=k, v=v, page_size=self.block_size)

        m = self.max_seqs
        return BlockTableKV(
            block_tables=jnp.zeros((m, self.max_blocks), jnp.int32),
            num_blocks=jnp.zeros((m,), jnp.int32),
            seq_lens=jnp.zeros((m,), jnp.int32),
            live=jnp.zeros((m,), bool),
            held=jnp.zeros((m,), bool),
            free_blocks=jnp.arange(self.num_blocks, 0, -1, dtype=jnp.int32),
            num_free=jnp.asarray(self.num_blocks, jnp.int32),
            target_pool=pool(target),
            draft_pool=None if draft is None else pool(draft),
        )

    def slot_status(self, kv: BlockTableKV) -> tuple[jax.Array, jax.Array]:
        return kv.live, kv.held

    # -- the block allocator --------------------------------------------------------------
    def _at(self, x: jax.Array, slot_idx: jax.Array) -> jax.Array:
        return x[jnp.clip(slot_idx, 0, self.max_seqs - 1)]

    def _grow(
        self, kv: BlockTableKV, slot_idx: jax.Array, mask: jax.Array, new_lens: jax.Array
    ) -> tuple[BlockTableKV, jax.Array]:
        """Blocks for positions ``[0, new_len)`` of the masked entries, all or nothing."""
        have = jnp.where(mask, self._at(kv.num_blocks, slot_idx), 0)
        want = -(-new_lens // self.block_size)
        need = jnp.where(mask, jnp.maximum(want - have, 0), 0)
        total = jnp.sum(need)
        ok = (total <= kv.num_free) & jnp.all(have + need <= self.max_blocks)
        take = mask & ok
        col = jnp.arange(self.max_blocks, dtype=jnp.int32)[None, :] - have[:, None]
        new = take[:, None] & (col >= 0) & (col < need[:, None])
        top = kv.num_free - total + (jnp.cumsum(need) - need)  # pop from the stack's top
        ids = kv.free_blocks[jnp.clip(top[:, None] + col, 0, self.num_blocks - 1)]
        rows = jnp.where(new, ids, self._at(kv.block_tables, slot_idx))
        dst = jnp.where(take, slot_idx, self.max_seqs)
        kv = dataclasses.replace(
            kv,
            block_tables=kv.block_tables.at[dst].set(rows, mode="drop"),
            num_blocks=kv.num_blocks.at[dst].set(have + need, mode="drop"),
            num_free=kv.num_free - jnp.where(ok, total, 0),
        )
        return kv, ok

    def _view(
        self, kv: BlockTableKV, slot_idx: jax.Array, valid: jax.Array, seq_lens: jax.Array
    ) -> KVView:
        table = jnp.where(valid[:, None], self._at(kv.block_tables, slot_idx), 0)
        return view_from_page_table(table, seq_lens, valid, page_size=self.block_size)

    # -- the KVBackend protocol -----------------------------------------------------------
    def prepare_decode(
        self, kv: BlockTableKV, slot_idx: jax.Array, live: jax.Array, *, num_tokens: int
    ) -> tuple[BlockTableKV, KVView, jax.Array]:
        seq = jnp.where(live, self._at(kv.seq_lens, slot_idx), 0)
        kv, ok = self._grow(kv, slot_idx, live, seq + num_tokens)
        live = live & ok
        return kv, self._view(kv, slot_idx, live, seq), ok

    def prepare_prefill(
        self,
        kv: BlockTableKV,
        slot_idx: jax.Array,
        starts: jax.Array,
        ends: jax.Array,
        valid: jax.Array,
        *,
        chunk_width: int,
    ) -> tuple[BlockTableKV, KVView, jax.Array]:
        del chunk_width  # this allocator needs no static bound on the chunk
        cont = valid & (starts > 0)  # a later chunk continues its prefilling request
        same = self._at(kv.held, slot_idx) & ~self._at(kv.live, slot_idx)
        same = same & (self._at(kv.seq_lens, slot_idx) == starts)
        ok_cont = jnp.all(~cont | same)
        kv, ok = self._grow(kv, slot_idx, valid & ok_cont, ends)
        ok = ok & ok_cont
        valid = valid & ok
        dst = jnp.where(valid, slot_idx, self.max_seqs)
        kv = dataclasses.replace(kv, held=kv.held.at[dst].set(True, mode="drop"))
        return kv, self._view(kv, slot_idx, valid, starts), ok

    def commit(
        self,
        kv: BlockTableKV,
        slot_idx: jax.Array,
        valid: jax.Array,
        seq_lens: jax.Array,
        live: jax.Array,
    ) -> BlockTableKV:
        dst = jnp.where(valid, slot_idx, self.max_seqs)
        return dataclasses.replace(
            kv,
            seq_lens=kv.seq_lens.at[dst].set(seq_lens, mode="drop"),
            live=kv.live.at[dst].set(live, mode="drop"),
        )

    def release(
        self, kv: BlockTableKV, slot_idx: jax.Array, finished: jax.Array
    ) -> tuple[BlockTableKV, jax.Array]:
        have = jnp.where(finished, self._at(kv.num_blocks, slot_idx), 0)
        col = jnp.arange(self.max_blocks, dtype=jnp.int32)[None, :]
        back = finished[:, None] & (col < have[:, None])
        top = kv.num_free + (jnp.cumsum(have) - have)  # push onto the stack
        pos = jnp.where(back, top[:, None] + col, self.num_blocks)
        ids = self._at(kv.block_tables, slot_idx)
        dst = jnp.where(finished, slot_idx, self.max_seqs)
        zero = jnp.zeros(slot_idx.shape, jnp.int32)
        no = jnp.zeros(slot_idx.shape, bool)
        kv = dataclasses.replace(
            kv,
            free_blocks=kv.free_blocks.at[pos.reshape(-1)].set(ids.reshape(-1), mode="drop"),
            num_free=kv.num_free + jnp.sum(have),
            block_tables=kv.block_tables.at[dst].set(0, mode="drop"),
            num_blocks=kv.num_blocks.at[dst].set(zero, mode="drop"),
            seq_lens=kv.seq_lens.at[dst].set(zero, mode="drop"),
            live=kv.live.at[dst].set(no, mode="drop"),
            held=kv.held.at[dst].set(no, mode="drop"),
        )
        return kv, jnp.asarray(True)


def toy_models() -> tuple[LlamaTarget, LlamaParams, Eagle1Draft, Eagle1Params]:
    """The toy f32 target (vocab 64) and its EAGLE-1 head, with their params."""
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    target = LlamaTarget(cfg)
    params = toy_llama_params(target, 0, residual_scale=1.5)
    draft, dparams = toy_eagle1(target, params, 1, hidden_mix=1.0)
    return target, params, draft, dparams


def run(
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    spec: bool,
    own_kv: bool,
    page_size: int = 4,
    topk: int = 2,
    rounds: int = 0,
) -> tuple[list[list[int]], list[int]]:
    """Tokens of every prompt (one batch slot each), spec or plain greedy, over the block-table
    cache (``own_kv``) or jspec's paged allocator; one step a call, or with ``rounds`` up to
    that many steps a dispatch (``decode_rounds``). Returns (tokens, accept lengths)."""
    target, params, draft, dparams = toy_models()
    num = len(prompts)
    ecfg = make_engine_config(
        target,
        page_size=page_size,
        topk=topk,
        num_steps=3,
        num_draft_tokens=6,
        context_len=64,
        max_running_requests=num,
        max_prompt_len=max(map(len, prompts)),
        batch_buckets=(num,),
        prefill_batch=num,
    )
    backend = None  # None: jspec's paged allocator
    if own_kv:
        spec_cfg = ecfg.spec
        per_request = -(-(spec_cfg.context_len + spec_cfg.alloc_reserve_per_decode) // page_size)
        backend = BlockTableBackend(page_size, num * per_request, per_request, num)
    runner = Runner(ecfg, target, draft if spec else None, kv=backend)
    weights = Weights(params, dparams if spec else None)
    state = init_engine_state(runner)
    slots = jnp.arange(num, dtype=jnp.int32)
    ids = np.zeros((num, ecfg.max_prompt_len), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
    state, pre = prefill(runner, weights, state, slots, jnp.asarray(ids), lens)
    assert bool(pre.ok)
    out, accept_lens = [[int(t)] for t in pre.first_tokens], []
    live = jnp.ones((num,), bool)
    step_fn = spec_decode_step if spec else greedy_step
    while rounds and min(map(len, out)) < max_new_tokens:
        # Several steps in one dispatch; an entry stops on the device once its round's tokens
        # reach its budget (no stop ids here: eos_ids is empty), and the rest run on.
        left = [max(max_new_tokens - len(o), 0) for o in out]
        live = jnp.asarray([n > 0 for n in left])
        budget = jnp.asarray(left, jnp.int32)
        eos_ids = jnp.zeros((0,), jnp.int32)
        state, r = decode_rounds(
            step_fn, runner, weights, state, slots, live, budget, eos_ids, rounds, max_rounds=rounds
        )
        tokens, round_lens = np.asarray(r.tokens), np.asarray(r.lens)
        for k in range(int(r.num_rounds)):
            for i in range(num):
                out[i] += tokens[k, i, : round_lens[k, i]].tolist()
                accept_lens += [int(round_lens[k, i])] if spec and round_lens[k, i] else []
        assert bool(r.ok)
    while not rounds and min(map(len, out)) < max_new_tokens:
        if spec:
            state, spec_out = spec_decode_step(runner, weights, state, slots, live)
            assert bool(spec_out.ok)
            for i in range(num):
                n = int(spec_out.accept_lens[i])
                out[i] += [int(t) for t in spec_out.accept_tokens[i, :n]]
                accept_lens.append(n)
        else:
            state, greedy_out = greedy_step(runner, weights, state, slots, live)
            assert bool(greedy_out.ok)
            for i in range(num):
                out[i].append(int(greedy_out.next_tokens[i]))
    state, ok = release(runner, state, slots, jnp.ones((num,), bool), return_ok=True)
    assert bool(ok)
    if backend is not None:  # every block back on the free stack
        assert int(state.kv.num_free) == backend.num_blocks
    return [o[:max_new_tokens] for o in out], accept_lens


def main() -> bool:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, n).tolist() for n in (5, 11)]
    greedy, _ = run(prompts, 16, spec=False, own_kv=False)
    spec, accept_lens = run(prompts, 16, spec=True, own_kv=True)
    spec_rounds, _ = run(prompts, 16, spec=True, own_kv=True, rounds=4)
    print("greedy (jspec's paged KV):  ", greedy)
    print("spec (block tables, here):  ", spec)
    print("spec, 4 rounds a dispatch:  ", spec_rounds)
    print(f"mean acceptance length {np.mean(accept_lens):.2f} over {len(accept_lens)} steps")
    lossless = spec == greedy == spec_rounds
    print("lossless:", "PASS" if lossless else "FAIL")
    return lossless


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
