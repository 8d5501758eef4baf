"""The holey draft layout's offset formula, in one place (SPEC.md §4.2).

Per request (``L`` = committed length, ``P`` = page size, ``K`` = topk, ``S`` = draft steps)::

    lp     = L % P                       last_page_len: the prefix tail on the last page
    base   = L - lp                      first row position of branch 0's region
    region = ceil((lp + S) / P) * P      row positions per branch region (nnp * P)

    branch t's step-s draft slot sits at row position  base + t*region + lp + s
    branch t's hole o (o < lp) sits at row position     base + t*region + o

With ``P == 1`` (lp = 0, region = S) or ``K == 1`` (t = 0) this is sglang's contiguous layout
``L + t*S + s``, so one formula serves every (P, K).

The helpers are plain arithmetic (``%``, ``//``, ``*``, ``+``): they work on Python ints (static
sizing), on jnp arrays and inside Pallas kernels alike. NOTE: the raw Triton kernel in
``jspec.kernels.triton_meta`` spells the formula out in ``tl`` code (a Triton kernel can only
call ``triton.jit`` functions); its tests compare it with these.
"""

from __future__ import annotations

from typing import Any

__all__ = ["draft_ext_start", "draft_footprint", "holey_geometry"]


def holey_geometry(seq_lens: Any, *, num_steps: int, page_size: int) -> tuple[Any, Any, Any]:
    """``(lp, base, region)`` of the holey layout for committed lengths ``seq_lens``.

    Args:
      seq_lens: int or i32[...] committed lengths ``L``.
      num_steps: static ``S``.
      page_size: static ``P``.

    Returns:
      ``lp = L % P``, ``base = L - lp`` and ``region = ceil((lp + S) / P) * P``, each shaped
      like ``seq_lens``.
    """
    lp = seq_lens % page_size
    region = (lp + num_steps + page_size - 1) // page_size * page_size
    return lp, seq_lens - lp, region


def draft_ext_start(seq_lens: Any, branch: Any, *, num_steps: int, page_size: int) -> Any:
    """Row position of branch ``branch``'s step-0 draft slot: ``base + t*region + lp``.

    Args:
      seq_lens: int or i32[...] committed lengths ``L``.
      branch: int or i32[...] branch index ``t`` (broadcast against ``seq_lens``).
      num_steps, page_size: static ``S``, ``P``.

    Returns:
      ``L + t*S`` when ``P == 1``; the holey position otherwise (equal for ``t == 0``).
    """
    lp, base, region = holey_geometry(seq_lens, num_steps=num_steps, page_size=page_size)
    return base + branch * region + lp


def draft_footprint(seq_lens: Any, *, topk: int, num_steps: int, page_size: int) -> Any:
    """End of the draft footprint: ``base + K*region`` (row positions used by all branches)."""
    _, base, region = holey_geometry(seq_lens, num_steps=num_steps, page_size=page_size)
    return base + topk * region
