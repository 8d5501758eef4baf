"""The protocol's geometry fields of a model object, read from its ``config``: one mixin for
the Llama target and the EAGLE heads (each a frozen dataclass with a ``config`` field)."""

from __future__ import annotations

from typing import Any

import numpy as np

from jspec.models.layers import check_tensor_parallel, rope_inv_freq


class ConfigGeometry:
    """``num_heads``, ``num_kv_heads``, ``head_dim``, ``hidden_size``, ``vocab_size``, ``dtype``
    (``TargetModel`` / ``DraftModel`` attributes), the RoPE table and the tensor-parallel check,
    all from ``self.config`` (a ``LlamaConfig`` or ``Eagle3Config``)."""

    __slots__ = ()
    config: Any

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def dtype(self) -> str:
        return self.config.dtype

    @property
    def inv_freq(self) -> np.ndarray:
        """f32[head_dim // 2] RoPE inverse frequencies (llama3 scaling applied)."""
        cfg = self.config
        return rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        """ValueError unless ``tensor_parallel`` divides the KV heads and the MLP width."""
        check_tensor_parallel(
            tensor_parallel,
            num_kv_heads=self.config.num_kv_heads,
            intermediate_size=self.config.intermediate_size,
        )
