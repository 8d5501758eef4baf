"""Dense (no KV cache, no paging) greedy decoding: the independent oracle for the engine.

Every step recomputes the whole sequence with a causal mask, padded to a static length, so
nothing here touches a pool, an allocator or a req_to_token row. The paged greedy baseline and
the speculative engine must both reproduce these tokens exactly (f32).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec._jit import jit

if TYPE_CHECKING:  # annotations only: the oracle runs no jspec code
    from jspec.engine.protocol import TargetModel


def _dense_attn_fn(length: jax.Array):
    """Causal GQA softmax attention over the forward's own K/V (f32, HIGHEST): no pool, no
    page table, nothing shared with the engine's attention path."""

    def attn_fn(layer, pool, q, k, v):
        del layer
        num_tokens, hq, dim = q.shape
        hkv = k.shape[1]
        pos = jnp.arange(num_tokens, dtype=jnp.int32)
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] < length)  # [T, T]
        qg = q.astype(jnp.float32).reshape(num_tokens, hkv, hq // hkv, dim)
        hp = jax.lax.Precision.HIGHEST
        s = jnp.einsum("qhgd,khd->hgqk", qg, k.astype(jnp.float32), precision=hp)
        s = jnp.where(mask, s * dim**-0.5, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        out = jnp.einsum("hgqk,khd->qhgd", p, v.astype(jnp.float32), precision=hp)
        return pool, out.reshape(num_tokens, hq, dim)

    return attn_fn


@jit(static_argnames=("target",))
def dense_next_token(
    target: TargetModel, params: Any, token_ids: jax.Array, length: jax.Array
) -> jax.Array:
    """Greedy next token after ``token_ids[:length]`` (``token_ids: i32[T]`` padded).

    ``target``: static :class:`jspec.engine.protocol.TargetModel` (its ``forward`` gets
    ``pool=None`` and an ``attn_fn`` that attends over the forward's own K/V).
    """
    positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
    _, hidden, _ = target.forward(params, None, token_ids, positions, _dense_attn_fn(length))
    return jnp.argmax(target.logits(params, hidden[length - 1][None])[0]).astype(jnp.int32)


def dense_greedy_generate(
    target: TargetModel,
    params: Any,
    prompt: list[int],
    max_new_tokens: int,
    *,
    max_len: int | None = None,
    eos_token_id: int | None = None,
) -> list[int]:
    """Plain greedy continuation of ``prompt`` by full recomputation (the oracle)."""
    total = len(prompt) + max_new_tokens
    max_len = max_len or total
    buf = np.zeros(max_len, np.int32)
    buf[: len(prompt)] = prompt
    out: list[int] = []
    length = len(prompt)
    for _ in range(max_new_tokens):
        tok = int(dense_next_token(target, params, jnp.asarray(buf), jnp.int32(length)))
        out.append(tok)
        if eos_token_id is not None and tok == eos_token_id:
            break
        buf[length] = tok
        length += 1
    return out
