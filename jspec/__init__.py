"""jspec: speculative-decoding bookkeeping (EAGLE tree drafting over a paged KV cache) in JAX."""

from __future__ import annotations

from jspec.config import SpecConfig

__all__ = ["SpecConfig"]
__version__ = "0.1.0"
