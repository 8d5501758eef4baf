"""Log-sum-exp merges of partial attentions (sglang FA3's ``merge_state_v2``), pure jnp.

A partial attention over a subset of the keys is ``(out, lse)``: the softmax-weighted values
over those keys and the log of their softmax denominator (``lse = -inf``: the subset held no
visible key). Two or more partials over disjoint key subsets merge exactly into the attention
over their union::

    lse = logsumexp_s(lse_s);   out = sum_s exp(lse_s - lse) * out_s

- :func:`merge_states`: two partials (the engine's passes, :mod:`jspec.engine.attention`; the
  cuDNN prefill's diagonal and prefix, :mod:`jspec.kernels.paged_prefill_cudnn`).
- :func:`merge_splits`: the ``NS`` key splits of one kernel launch, stacked on axis 1 (the
  oracle of :func:`jspec.kernels.paged_attention_triton.merge_splits_triton`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_states(
    out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Log-sum-exp merge of two partial attentions (sglang ``merge_state_v2``).

    Args:
      out_*: f32[..., Hq, D]; lse_*: f32[..., Hq] (-inf = the partial saw no key).

    Returns:
      ``(out f32[..., Hq, D], lse f32[..., Hq])``; neither saw a key: 0, -inf.
    """
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w_a = jnp.where(jnp.isfinite(lse_a), jnp.exp(lse_a - safe), 0.0)
    w_b = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - safe), 0.0)
    return out_a * w_a[..., None] + out_b * w_b[..., None], lse


def merge_splits(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Log-sum-exp merge over axis 1: ``f32[B, NS, Qp, Hq, D], f32[B, NS, Qp, Hq]`` ->
    ``(f32[B, Qp, Hq, D], f32[B, Qp, Hq])``.

    Splits with ``lse = -inf`` (nothing seen) are ignored; all of them: 0, -inf. A NaN lse or
    out of a split that saw keys stays NaN in the merged result.
    """
    if out.shape[1] == 1:
        return out[:, 0], lse[:, 0]
    empty = lse == -jnp.inf  # [B, NS, Qp, Hq]
    has_key = jnp.any(~empty, axis=1)
    top = jnp.max(lse, axis=1)  # NaN propagates
    top = jnp.where(has_key, top, 0.0)
    weight = jnp.where(empty, 0.0, jnp.exp(lse - top[:, None]))
    total = jnp.sum(weight, axis=1)
    safe = jnp.where(has_key, total, 1.0)
    merged = jnp.sum(jnp.where(empty[..., None], 0.0, out) * weight[..., None], axis=1)
    merged = merged / safe[..., None]
    lse_out = jnp.where(has_key, top + jnp.log(safe), -jnp.inf)
    return jnp.where(has_key[..., None], merged, 0.0), lse_out
