"""Per-request sampling parameters on the host: validated before anything compiles.

:class:`SamplingParams` is what a caller gives per request (``Engine.generate(...,
sampling=)``, ``jspec generate --temperature ...``, a prompts-file line): temperature, top-k,
top-p, min-p and a seed. It validates itself (an :class:`jspec.engine.inputs.InputError`
naming the field), parses from a dict (:meth:`SamplingParams.from_dict`, the per-line hook of
a prompts file: a line's keys override the flags' defaults) and packs a batch's requests into
the device-side :class:`jspec.engine.sampling.SamplingBatch` (:func:`pack_sampling`).

``temperature == 0`` is greedy: the other fields are then ignored (but still validated). A
``seed`` of None is drawn at random when the request starts (:meth:`SamplingParams.resolved`);
the resolved seed is reported (``RunStats.sampling``, the CLI's JSON), so every run can be
replayed: the same seed gives the same tokens, whatever the batch, slot or device layout.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np

from jspec.engine.inputs import InputError
from jspec.engine.sampling import SamplingBatch
from jspec.tree.sampling import LossyThresholds
from jspec.tree.sampling_keys import seed_words

# A drawn seed stays below 2**63: it round-trips through JSON and signed 64-bit readers.
_DRAWN_SEED_BITS = 63


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InputError(f"{name}={value!r} must be a number")
    if not math.isfinite(float(value)):
        raise InputError(f"{name}={value} must be finite")
    return float(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters (the defaults are greedy decoding).

    Attributes:
      temperature: >= 0; 0 is greedy (argmax).
      top_k: >= 0; 0 keeps every token.
      top_p: in (0, 1]; 1 keeps every token.
      min_p: in [0, 1]; keeps tokens with ``p >= min_p * max(p)``; 0 keeps every token.
      seed: int in [0, 2**64), or None: drawn at random when the request starts.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = _real("temperature", self.temperature)
        if t < 0:
            raise InputError(f"temperature={t} must be >= 0 (0 is greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)):
            raise InputError(f"top_k={self.top_k!r} must be an int >= 0 (0 is off)")
        if self.top_k < 0:
            raise InputError(f"top_k={self.top_k} must be >= 0 (0 is off)")
        p = _real("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise InputError(f"top_p={p} must be in (0, 1] (1 is off)")
        m = _real("min_p", self.min_p)
        if not 0.0 <= m <= 1.0:
            raise InputError(f"min_p={m} must be in [0, 1] (0 is off)")
        if self.seed is not None:
            try:
                seed_words(self.seed)
            except ValueError as e:
                raise InputError(str(e)) from None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_dict(
        cls, values: Mapping[str, Any], base: SamplingParams | None = None
    ) -> SamplingParams:
        """Parse ``values`` (e.g. one JSON line of a prompts file) over ``base``'s fields.

        Unknown keys are an error (a misspelt ``top_p`` must not silently sample wider).
        """
        base = base or cls()
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise InputError(f"unknown sampling field(s) {unknown}; known: {sorted(names)}")
        return dataclasses.replace(base, **dict(values))

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready values."""
        return dataclasses.asdict(self)

    def resolved(self) -> SamplingParams:
        """This request with a seed: its own, or a fresh random one (reported back)."""
        if self.seed is not None or self.is_greedy:
            return self
        return dataclasses.replace(self, seed=secrets.randbits(_DRAWN_SEED_BITS))


GREEDY = SamplingParams()


def normalize_sampling(
    sampling: SamplingParams | Sequence[SamplingParams | None] | None, num_requests: int
) -> list[SamplingParams]:
    """One resolved :class:`SamplingParams` per request (None: greedy for all; one object:
    the same for all, each request drawing its own seed when it has none)."""
    if sampling is None:
        return [GREEDY] * num_requests
    if isinstance(sampling, SamplingParams):
        sampling = [sampling] * num_requests
    sampling = list(sampling)
    if len(sampling) != num_requests:
        raise InputError(f"sampling has {len(sampling)} entries for {num_requests} requests")
    out = []
    for i, s in enumerate(sampling):
        if s is None:
            s = GREEDY
        if not isinstance(s, SamplingParams):
            raise InputError(f"sampling[{i}]={s!r} must be a SamplingParams or None")
        out.append(s.resolved())
    return out


def pack_sampling(params: Sequence[Any], lossy: LossyThresholds | None = None) -> SamplingBatch:
    """A batch's :class:`jspec.engine.sampling.SamplingBatch` (host numpy arrays).

    ``params[i]`` is entry ``i`` (None: a padding entry, packed greedy). A filter none of the
    entries uses is left None (static: not compiled). Leading batch axes of a nested
    sequence (e.g. ``[shards][entries]``) are kept.
    """
    arr = np.asarray(params, dtype=object)
    flat = [p if p is not None else GREEDY for p in arr.reshape(-1)]
    shape = arr.shape

    # NOTE: host numpy leaves, typed as the step reads them: its jit makes each a jax.Array.
    def field(get: Callable[[SamplingParams], Any], dtype: Any) -> jax.Array:
        return cast(jax.Array, np.asarray([get(p) for p in flat], dtype).reshape(shape))

    sampled = [p for p in flat if not p.is_greedy]
    if any(p.seed is None for p in sampled):  # a fresh seed per step would not replay
        raise InputError("a sampled entry has no seed: pack SamplingParams.resolved() values")
    seeds = np.asarray(
        [seed_words(p.seed if p.seed is not None else 0) for p in flat], np.uint32
    ).reshape(shape + (2,))
    return SamplingBatch(
        temperature=field(lambda p: p.temperature, np.float32),
        seed=cast(jax.Array, seeds),
        top_k=field(lambda p: p.top_k, np.int32) if any(p.top_k > 0 for p in sampled) else None,
        top_p=field(lambda p: p.top_p, np.float32) if any(p.top_p < 1 for p in sampled) else None,
        min_p=field(lambda p: p.min_p, np.float32) if any(p.min_p > 0 for p in sampled) else None,
        lossy=lossy,
    )
