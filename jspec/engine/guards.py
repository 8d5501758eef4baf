"""Input guards of the public step functions: every slot, row and token id a caller hands
``prefill`` / ``greedy_step`` / ``spec_decode_step`` / ``release`` is checked here, in one place.

A step body calls one ``validate_*`` at its top and folds the flag in (``live &= ok`` and
``ok &= ok``), so a bad call changes no state (only the padding page, the write sink of padding
entries, may change) and returns ``ok=False``; with probes on a probe names the entry and the
value. Shapes and dtypes are static: a mistake there is a ``ValueError`` naming the field.

What a traced input must satisfy (``M`` = max_running_requests, ``Lp`` the prompt padding)::

    step             live entries: slot in [0, M), the slot live in the state, no slot twice
    release          finished entries: slot in [0, M), the slot holds a request (live, or
                     prefilling between chunks: it has a req_to_token row), no slot twice
    prefill chunk    entries with chunk_len > 0: slot in [0, M), no slot twice, chunk_len <= Cq,
                     ids[:chunk_len] in [0, vocab_size); a first chunk (start 0): the slot free
                     (not live, no row); a later chunk: the KV backend checks it continues its slot

(jnp indexing would clamp slot ``M + 3`` onto slot ``M - 1`` and the embedding gather clamp id
999 to ``vocab_size - 1``: another request's pages, a wrong token, with ``ok`` True.)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jspec import _index, probes
from jspec.engine.step_types import VerifyResult

__all__ = [
    "probe_target_logits",
    "probe_verify_logits",
    "validate_prefill",
    "validate_step_slots",
]


def _static_batch(slot_idx: Any, mask: Any, what: str, mask_name: str) -> None:
    probes.static_check(
        jnp.ndim(slot_idx) == 1 and jnp.issubdtype(jnp.result_type(slot_idx), jnp.integer),
        f"{what}: slot_idx must be a 1-D int array, got shape {jnp.shape(slot_idx)} "
        f"dtype {jnp.result_type(slot_idx)}",
    )
    probes.static_check(
        jnp.shape(mask) == jnp.shape(slot_idx),
        f"{what}: {mask_name}.shape={jnp.shape(mask)} must be slot_idx.shape={jnp.shape(slot_idx)}",
    )


def _probe(bad: jax.Array, values: jax.Array, what: str, msg: str) -> None:
    """A probe naming the first bad entry and its value (nothing traced when probes are off)."""
    if not probes.probes_on():
        return
    at, value = _index.first_bad(bad, values)
    probes.assert_async(~jnp.any(bad), f"{what}: entry {{at}}: {msg}", at=at, value=value)


_SLOT_STATES = {
    # want: (predicate on (live, held) of the slot, what the probe says when it fails)
    "live": (lambda live, held: live, "not live (never prefilled or released)"),
    "free": (lambda live, held: ~live & ~held, "not free (live, or holding a request)"),
    "held": (lambda live, held: live | held, "holding no request"),
    "any": (lambda live, held: jnp.ones_like(live), ""),
}

SlotStatus = tuple[jax.Array, jax.Array]
"""``(live bool[M], held bool[M])`` per batch slot (``KVBackend.slot_status``)."""


def _slot_faults(
    status: SlotStatus,
    slot_idx: jax.Array,
    mask: jax.Array,
    what: str,
    *,
    want: str,
    check: jax.Array | None = None,
) -> jax.Array:
    """bool[]: no masked entry names a slot out of range or twice, and every ``check``-ed
    entry (default: every masked one) a slot in state ``want`` (:data:`_SLOT_STATES`)."""
    slot_live, slot_held = status
    m = slot_live.shape[0]
    slot = slot_idx.astype(jnp.int32)
    mask = mask.astype(bool)
    check = mask if check is None else mask & check
    bad_range = _index.out_of_range(slot, mask, 0, m)
    twice = _index.repeated(slot, mask, m)
    at = jnp.clip(slot, 0, m - 1)
    pred, state_word = _SLOT_STATES[want]
    wrong = check & ~bad_range & ~pred(slot_live[at], slot_held[at])
    _probe(bad_range, slot, what, f"slot {{value}} outside [0, max_running_requests={m})")
    _probe(twice, slot, what, "slot {value} given twice")
    _probe(wrong, slot, what, f"slot {{value}} is {state_word}")
    return ~jnp.any(bad_range | twice | wrong)


def validate_step_slots(
    status: SlotStatus,
    slot_idx: jax.Array,
    live: jax.Array,
    what: str = "step",
    live_name: str = "live",
    want: str = "live",
) -> jax.Array:
    """bool[]: the live entries of a decode step (or the finished ones of a release) name
    distinct slots in ``[0, M)``, live (``want="held"``: live or prefilling, for a release).

    Args:
      status: the KV backend's ``slot_status`` (one shard).
      slot_idx: i32[Bb] batch slots (padding entries: any value).
      live: bool[Bb] entries to step / release.
      what, live_name: the caller's and the mask's names, for the messages.

    Raises:
      ValueError (trace time): ``slot_idx`` not a 1-D int array, ``live`` of another shape.
    """
    _static_batch(slot_idx, live, what, live_name)
    return _slot_faults(status, slot_idx, live, what, want=want)


def validate_prefill(
    status: SlotStatus,
    slot_idx: jax.Array,
    prompt_ids: jax.Array,
    prompt_lens: jax.Array,
    *,
    vocab_size: int,
    starts: jax.Array | None = None,
    max_start: int | None = None,
    what: str = "prefill",
) -> jax.Array:
    """bool[]: the chunks (``prompt_lens > 0``) go to distinct slots in ``[0, M)``, the first
    chunks to free ones, fit the padding and hold token ids in ``[0, vocab_size)``.

    Args:
      status: the KV backend's ``slot_status`` (one shard).
      slot_idx: i32[Bp]; prompt_ids: i32[Bp, Cq]; prompt_lens: i32[Bp] (0: padding entry).
      vocab_size: static, the target's.
      starts: i32[Bp] each entry's chunk start (default all 0): entries at 0 start their
        prompt, the others continue a prefilling slot (checked by the prefill itself).
      max_start: static bound on the chunks' starts (``Runner.max_prefix_len``; None: none).

    Raises:
      ValueError (trace time): shapes or dtypes that do not fit each other.
    """
    _static_batch(slot_idx, prompt_lens, what, "prompt_lens")
    probes.static_check(
        jnp.ndim(prompt_ids) == 2 and jnp.shape(prompt_ids)[0] == jnp.shape(slot_idx)[0],
        f"{what}: prompt_ids.shape={jnp.shape(prompt_ids)} must be (Bp={jnp.shape(slot_idx)[0]}, "
        "max_prompt_len)",
    )
    for name, x in (("prompt_ids", prompt_ids), ("prompt_lens", prompt_lens)):
        probes.static_check(
            jnp.issubdtype(jnp.result_type(x), jnp.integer),
            f"{what}: {name}.dtype={jnp.result_type(x)} must be an integer dtype",
        )
    lp = prompt_ids.shape[1]
    lens = prompt_lens.astype(jnp.int32)
    valid = lens > 0
    first = None if starts is None else starts == 0
    slots_ok = _slot_faults(status, slot_idx, valid, what, want="free", check=first)
    too_long = valid & (lens > lp)
    _probe(too_long, lens, what, f"prompt_len {{value}} > max_prompt_len={lp}")
    in_prompt = jnp.arange(lp, dtype=jnp.int32)[None, :] < lens[:, None]
    ids = prompt_ids.astype(jnp.int32)
    bad_id = in_prompt & ((ids < 0) | (ids >= vocab_size))
    _probe(
        jnp.any(bad_id, axis=1),
        ids[jnp.arange(ids.shape[0]), jnp.argmax(bad_id, axis=1)],
        what,
        f"token id {{value}} outside the vocabulary [0, vocab_size={vocab_size})",
    )
    ok = slots_ok & ~jnp.any(too_long) & ~jnp.any(bad_id)
    if starts is not None and max_start is not None:
        past = valid & (starts > max_start)
        _probe(past, starts, what, f"chunk start {{value}} > max_prefix_len={max_start}")
        ok = ok & ~jnp.any(past)
    return ok


def probe_target_logits(logits: jax.Array, live: jax.Array, what: str) -> None:
    """Probe: no NaN in the target logits f32[Bb, V] of the live rows (bool[Bb]).

    A NaN ``lm_head`` would otherwise decode token 0 (the argmax of NaN) forever. Probes off:
    nothing traced.
    """
    probes.detect_nan(logits, f"{what}: target logits", where=live[:, None])


def probe_verify_logits(x: Any) -> None:
    """:func:`probe_target_logits` on a speculative step's phase output when it is the verify
    result (f32[Bb*N, V], the live rows' N nodes); any other phase output is left alone."""
    if isinstance(x, VerifyResult):
        n = x.logits.shape[0] // x.batch.live.shape[0]
        probe_target_logits(x.logits, jnp.repeat(x.batch.live, n), "spec_decode_step")
