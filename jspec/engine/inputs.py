"""Host-side input validation: every request is checked before anything compiles.

A token id outside the vocabulary would otherwise be clamped by the embedding gather (``[1, 2,
64]`` decoded as ``[1, 2, 63]`` at vocab 64), and a bad count fails only after the buckets
compiled. :class:`InputError` (a ``ValueError``) names the field and the offending value; the
CLI prints it as one line and exits 2.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class InputError(ValueError):
    """A host input (a prompt, a count, a CLI number) is out of range; the message names it."""


def check_count(name: str, value: object, minimum: int = 1) -> int:
    """``value`` as an int, or :class:`InputError` unless it is an int ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InputError(f"{name}={value!r} must be an int >= {minimum}")
    if value < minimum:
        raise InputError(f"{name}={value} must be >= {minimum}")
    return int(value)


def check_token_ids(name: str, ids: Sequence[int], vocab_size: int) -> list[int]:
    """``ids`` as a list of ints, or :class:`InputError` naming the first id outside
    ``[0, vocab_size)``."""
    out = []
    for i, tok in enumerate(ids):
        if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
            raise InputError(f"{name}[{i}]={tok!r} must be an int token id")
        if not 0 <= tok < vocab_size:
            raise InputError(
                f"{name}[{i}]={int(tok)} is outside the vocabulary [0, vocab_size={vocab_size})"
            )
        out.append(int(tok))
    return out


def validate_requests(
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    *,
    vocab_size: int,
    max_prompt_len: int,
    context_len: int,
    arrivals: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[int], list[int]]:
    """Check a batch of requests against the engine's limits (no device work).

    Args:
      prompts: token id lists; each non-empty, at most ``max_prompt_len`` long, ids in
        ``[0, vocab_size)``.
      max_new_tokens: one int for all or one per prompt; each >= 1 and
        ``len(prompt) + max_new_tokens <= context_len``.
      arrivals: decode-step index per prompt (>= 0), default all 0.

    Returns:
      (prompts, max_new_tokens, arrivals) as plain int lists.

    Raises:
      InputError naming the prompt and the field.
    """
    if len(prompts) == 0:
        raise InputError("prompts is empty: give at least one prompt")
    n = len(prompts)
    if not isinstance(max_new_tokens, (Sequence, np.ndarray)):  # one for all (a bool: rejected)
        max_new = [check_count("max_new_tokens", max_new_tokens)] * n
    else:
        if len(max_new_tokens) != n:
            raise InputError(f"max_new_tokens has {len(max_new_tokens)} entries for {n} prompts")
        max_new = [check_count(f"max_new_tokens[{i}]", m) for i, m in enumerate(max_new_tokens)]
    if arrivals is None:
        arrivals = [0] * n
    elif len(arrivals) != n:
        raise InputError(f"arrivals has {len(arrivals)} entries for {n} prompts")
    arrivals = [check_count(f"arrivals[{i}]", a, 0) for i, a in enumerate(arrivals)]
    out = []
    for i, prompt in enumerate(prompts):
        prompt = check_token_ids(f"prompt {i}", list(prompt), vocab_size)
        if not prompt:
            raise InputError(f"prompt {i} is empty: give at least one token")
        if len(prompt) > max_prompt_len:
            raise InputError(
                f"prompt {i}: length {len(prompt)} exceeds max_prompt_len={max_prompt_len}"
            )
        if len(prompt) + max_new[i] > context_len:
            raise InputError(
                f"prompt {i}: len(prompt) + max_new_tokens = "
                f"{len(prompt)} + {max_new[i]} exceeds context_len={context_len}"
            )
        out.append(prompt)
    return out, max_new, arrivals
