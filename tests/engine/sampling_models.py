"""Table-driven models for the sampling tests: a target whose law is known exactly.

:class:`TableTarget` follows :mod:`jspec.engine.protocol`: token ``x`` at position ``p`` gives
the logits ``table[p % period, x]`` for the next token (a Markov chain whose rows change with
the position), so the law of the first emitted tokens after a prompt is a product of processed
rows: :func:`exact_joint` computes it in float64 with the independent numpy processing oracle
``tests/tree/sampling_stats.processed_np`` (sort-based). It still writes its KV through
``attn_fn`` (the engine's pools and allocator run as for a real model); the attention output is
unused.

:class:`TableDraft` proposes from its own table over a draft vocabulary mapped to target ids by
``d2t`` (which may map two draft ids to one target id: duplicate siblings in the tree). Its
hidden state is the one-hot of (position, token), with EAGLE's shift (the draft sees token
``x[p+1]`` at position ``p``).
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tree"))
from sampling_stats import processed_np  # noqa: E402


def _one_hot_index(index: jax.Array, width: int) -> jax.Array:
    return jax.nn.one_hot(index, width, dtype=jnp.float32)


def _touch_pool(pool, attn_fn, num_tokens: int, head_dim: int):
    """One attention call (writes this layer's K/V at the engine's slots); output unused."""
    zeros = jnp.zeros((num_tokens, 1, head_dim), jnp.float32)
    pool, _ = attn_fn(0, pool, zeros, zeros, zeros)
    return pool


@dataclasses.dataclass(frozen=True)
class TableTarget:
    """Logits ``table[p % period, x]`` after token ``x`` at position ``p`` (params: ``table``
    f32[period * V, V], -inf allowed)."""

    vocab_size: int
    period: int = 3
    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 2
    dtype: str = "float32"

    @property
    def hidden_size(self) -> int:
        return self.period * self.vocab_size

    def forward(
        self, params, pool, token_ids, positions, attn_fn, *, capture_layers=(), tp_axis=None
    ):
        del params, tp_axis
        index = (positions % self.period) * self.vocab_size + token_ids
        hidden = _one_hot_index(index, self.hidden_size)
        pool = _touch_pool(pool, attn_fn, token_ids.shape[0], self.head_dim)
        aux = jnp.concatenate([hidden] * len(capture_layers), -1) if capture_layers else None
        return pool, hidden, aux

    def logits(self, params, hidden):
        return params["table"][jnp.argmax(hidden, -1)]


@dataclasses.dataclass(frozen=True)
class TableDraft:
    """Draft logits ``table[(p + 1) % period, x]`` over ``vocab_size`` draft ids, mapped to
    target ids by ``d2t`` (params: ``table`` f32[period * V, vocab_size], ``d2t`` i32)."""

    vocab_size: int
    target_vocab: int
    period: int = 3
    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 2
    dtype: str = "float32"
    capture_layers: tuple[int, ...] = ()

    @property
    def hidden_size(self) -> int:
        return self.period * self.target_vocab

    def forward(
        self, params, target_params, pool, token_ids, hidden_in, positions, attn_fn, *, tp_axis=None
    ):
        del params, target_params, hidden_in, tp_axis
        index = ((positions + 1) % self.period) * self.target_vocab + token_ids
        pool = _touch_pool(pool, attn_fn, token_ids.shape[0], self.head_dim)
        return pool, _one_hot_index(index, self.hidden_size)

    def combine_hidden_states(self, params, feature):
        return feature

    def logits(self, params, target_params, hidden):
        del target_params
        return params["table"][jnp.argmax(hidden, -1)]

    def to_target_ids(self, params, draft_ids):
        return params["d2t"][draft_ids]


# ---- the exact law ------------------------------------------------------------------------------
def markov_rows(table: np.ndarray, period: int, params: dict) -> np.ndarray:
    """f64[period, V, V]: ``rows[p, x]`` = processed law of the token after ``x`` at ``p``."""
    v = table.shape[-1]
    rows = np.zeros((period, v, v))
    for p, x in itertools.product(range(period), range(v)):
        rows[p, x] = processed_np(table[p * v + x], **params)
    return rows


def exact_joint(table, period, prompt, num_tokens, params) -> dict[tuple[int, ...], float]:
    """Exact law of the first ``num_tokens`` tokens after ``prompt`` (TableTarget)."""
    rows = markov_rows(np.asarray(table), period, params)
    out = {}
    v = rows.shape[-1]
    n0 = len(prompt)
    for seq in itertools.product(range(v), repeat=num_tokens):
        prob, prev = 1.0, prompt[-1]
        for i, tok in enumerate(seq):
            prob *= rows[(n0 - 1 + i) % period, prev, tok]
            prev = tok
            if prob == 0:
                break
        if prob > 0:
            out[seq] = prob
    return out


def make_tables(
    seed: int, vocab: int, period: int, *, draft_vocab: int | None = None, zero_frac=0.15
) -> tuple[dict, dict]:
    """(target params, draft params): random logits with a few -inf (zero-probability) entries
    per row; the draft's table is the target's plus noise over its draft ids (so it is often
    right), ``d2t`` maps draft ids onto target ids (non-injective when ``draft_vocab`` > the
    ids it covers: duplicates)."""
    rng = np.random.default_rng(seed)
    rows = period * vocab
    table = rng.normal(0.0, 1.5, (rows, vocab))
    forbid = rng.random((rows, vocab)) < zero_frac
    forbid[np.arange(rows), np.argmax(table, -1)] = False  # every row keeps its argmax
    table = np.where(forbid, -np.inf, table).astype(np.float32)
    draft_vocab = draft_vocab or vocab
    d2t = np.arange(draft_vocab) % vocab
    if draft_vocab == vocab:  # make duplicates: two draft ids on one target id
        d2t[-1] = d2t[0]
    noisy = np.where(np.isfinite(table), table, 2.0) + rng.normal(0, 1.0, table.shape)
    dtable = noisy[:, d2t].astype(np.float32)
    return {"table": jnp.asarray(table)}, {
        "table": jnp.asarray(dtable),
        "d2t": jnp.asarray(d2t, jnp.int32),
    }
