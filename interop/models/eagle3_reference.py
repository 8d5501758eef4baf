"""PyTorch reference of an EAGLE-3 draft head, in sglang's layout and forward order.

Written from shared/REAL_MODELS.md (sglang ``llama_eagle3.py``), plain torch, CPU, one sequence
(causal attention over the tokens given, no KV pool). Weights are the checkpoint's own tensors
by their HF names, in ``nn.Linear`` layout ``[out, in]`` (``y = x @ W.T``)::

    fc.weight [H, 3H] (+ fc.bias)   midlayer.{input_layernorm, hidden_norm,
    midlayer.self_attn.{q,k,v}_proj.weight [., 2H], o_proj [H, nh*hd]   post_attention_layernorm}
    midlayer.mlp.{gate,up,down}_proj.weight   norm.weight [H]   lm_head.weight [Vd, H]   d2t [Vd]

RoPE is written here as complex rotation of the (i, i + D/2) pairs (the same map as HF's
``rotate_half``, by a different route); llama3 scaling rescales the inverse frequencies.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if not scaling or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for f in inv.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            s = (old / wavelen - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return torch.tensor(out, dtype=torch.float64)


def _rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]: pairs (i, i + D/2) rotated by positions * inv_freq[i]."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    z = (
        z
        * torch.polar(
            torch.ones(1, dtype=torch.float64), positions.double()[:, None] * inv_freq[None, :]
        )[:, None, :]
    )
    return torch.cat([z.real, z.imag], -1).to(x.dtype)


class Eagle3Reference:
    """An EAGLE-3 head over one sequence.

    Args:
      config: the head's ``config.json`` dict (hidden_size, num_attention_heads,
        num_key_value_heads, optional head_dim, rms_norm_eps, rope_theta / rope_scaling or
        rope_parameters).
      weights: HF name -> tensor (see the module docstring).
      embed_tokens: [V, H] the TARGET's embedding (the head ships none).
    """

    def __init__(
        self, config: dict[str, Any], weights: dict[str, torch.Tensor], embed_tokens: torch.Tensor
    ) -> None:
        self.w = weights
        self.embed_tokens = embed_tokens
        self.hidden = config["hidden_size"]
        self.heads = config["num_attention_heads"]
        self.kv_heads = config.get("num_key_value_heads", self.heads)
        self.head_dim = config.get("head_dim") or self.hidden // self.heads
        self.eps = config.get("rms_norm_eps", 1e-6)
        rope = config.get("rope_parameters") or config.get("rope_scaling")
        theta = (config.get("rope_parameters") or {}).get(
            "rope_theta", config.get("rope_theta", 10000.0)
        )
        self.inv_freq = _inv_freq(self.head_dim, theta, rope)
        # sglang: hot_token_id = d2t + arange(draft_vocab)
        d2t = weights["d2t"].long()
        self.hot_token_id = d2t + torch.arange(d2t.shape[0])

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        y = x @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return y if bias is None else y + bias

    def _attention(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q = self._linear(x, "midlayer.self_attn.q_proj").view(t, self.heads, self.head_dim)
        k = self._linear(x, "midlayer.self_attn.k_proj").view(t, self.kv_heads, self.head_dim)
        v = self._linear(x, "midlayer.self_attn.v_proj").view(t, self.kv_heads, self.head_dim)
        q, k = _rope(q, positions, self.inv_freq), _rope(k, positions, self.inv_freq)
        group = self.heads // self.kv_heads
        out = torch.empty_like(q)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        for h in range(self.heads):
            scores = (q[:, h] @ k[:, h // group].T) / math.sqrt(self.head_dim)
            probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
            out[:, h] = probs @ v[:, h // group]
        return self._linear(out.reshape(t, -1), "midlayer.self_attn.o_proj")

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate = self._linear(x, "midlayer.mlp.gate_proj")
        up = self._linear(x, "midlayer.mlp.up_proj")
        return self._linear(torch.nn.functional.silu(gate) * up, "midlayer.mlp.down_proj")

    def forward(
        self, input_ids: torch.Tensor, hidden_states: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden_states_to_logits [T, H], hidden_states_to_aux [T, H]) as sglang returns them.

        Args:
          input_ids: [T] target ids; hidden_states: [T, 3H] (target aux) or [T, H];
          positions: [T].
        """
        embeds = self.embed_tokens[input_ids]
        if hidden_states.shape[-1] != embeds.shape[-1]:
            hidden_states = self._linear(hidden_states, "fc")
        # midlayer (LlamaDecoderLayer of llama_eagle3.py)
        residual = hidden_states
        embeds = _rms(embeds, self.w["midlayer.input_layernorm.weight"], self.eps)
        hidden_states = _rms(hidden_states, self.w["midlayer.hidden_norm.weight"], self.eps)
        hidden_states = torch.cat([embeds, hidden_states], dim=-1)
        hidden_states = self._attention(hidden_states, positions)
        residual = hidden_states + residual  # post_attention_layernorm(hidden, residual)
        hidden_states = _rms(residual, self.w["midlayer.post_attention_layernorm.weight"], self.eps)
        hidden_states = self._mlp(hidden_states)
        # final norm(hidden, residual): fused add + RMSNorm
        aux = hidden_states + residual
        return _rms(aux, self.w["norm.weight"], self.eps), aux

    def logits(self, hidden_states_to_logits: torch.Tensor) -> torch.Tensor:
        """[T, draft_vocab] = lm_head(normed hidden)."""
        return hidden_states_to_logits @ self.w["lm_head.weight"].T

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.hot_token_id[draft_ids]
