"""Random valid worlds for the comparison harness (:mod:`interop.compare`).

A :class:`Case` is one grid config (page size, topk, steps, batch). :func:`make_world` draws a
consistent paged state for it: committed lengths straddling page boundaries, rows allocated to
``ceil_P(L + reserve)`` exactly as ``prepare_for_decode`` would, one random physical page per row
page (SPEC.md §4.1's page correspondence), in random req_to_token rows.

An :class:`Op` draws its inputs from a world (torch tensors, sglang dtypes), runs the torch
reference and jspec on clones of the same inputs, and returns both output dicts (numpy).
The ops live in ``interop.{kv,tree,attention_meta}.compare``; :mod:`interop.registry` lists them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from interop.kv import reference as ref_mem

I64, I32 = torch.int64, torch.int32
POISON = -7
Outputs = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Case:
    page_size: int
    topk: int
    num_steps: int
    batch: int
    max_draft_tokens: int = 8

    @property
    def num_draft_tokens(self) -> int:
        k, s = self.topk, self.num_steps
        return min(1 + k + (s - 1) * k * k, self.max_draft_tokens)

    def __str__(self) -> str:
        return (
            f"P={self.page_size} K={self.topk} S={self.num_steps} "
            f"N={self.num_draft_tokens} B={self.batch}"
        )


@dataclasses.dataclass
class World:
    case: Case
    seq_lens: torch.Tensor  # i64[B] committed lengths L
    allocated: torch.Tensor  # i64[B] page-aligned allocated lengths
    req_pool_indices: torch.Tensor  # i64[B]
    req_to_token: torch.Tensor  # i32[rows, R]
    num_pages: int


def _straddling_lens(page_size: int, batch: int, rng: np.random.Generator) -> list[int]:
    p = page_size
    pool = [1, 2, p - 1, p, p + 1, 2 * p + 3, 3 * p - 1] if p > 1 else [1, 2, 5, 9, 13]
    pool = [x for x in pool if x >= 1]
    return [
        int(rng.choice(pool)) if rng.random() < 0.7 else int(rng.integers(1, 4 * p + 9))
        for _ in range(batch)
    ]


def make_world(case: Case, rng: np.random.Generator) -> World:
    p = case.page_size
    reserve = ref_mem.get_alloc_reserve_per_decode(
        page_size=p,
        topk=case.topk,
        num_steps=case.num_steps,
        num_draft_tokens=case.num_draft_tokens,
    )
    lens = _straddling_lens(p, case.batch, rng)
    allocated = [-(-(length + reserve) // p) * p for length in lens]
    width = max(allocated) + p
    num_pages = sum(a // p for a in allocated) + 8
    pages = (rng.permutation(num_pages) + 1).tolist()
    rows = (rng.permutation(case.batch + 2) + 1)[: case.batch].tolist()
    table = torch.zeros(case.batch + 3, width, dtype=I32)
    for row, alloc_len in zip(rows, allocated):
        mine, pages = pages[: alloc_len // p], pages[alloc_len // p :]
        pos = torch.arange(alloc_len)
        table[row, :alloc_len] = (torch.tensor(mine)[pos // p] * p + pos % p).to(I32)
    return World(
        case,
        torch.tensor(lens, dtype=I64),
        torch.tensor(allocated, dtype=I64),
        torch.tensor(rows, dtype=I64),
        table,
        num_pages,
    )


def to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()
    return np.asarray(x)


class RandomPool:
    """sglang-like pool object (``k_buffer``/``v_buffer`` lists) with random distinct rows."""

    def __init__(
        self, num_slots: int, page_size: int, rng: np.random.Generator, layers: int = 2
    ) -> None:
        self.page_size = page_size
        gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
        self.k_buffer = [torch.randn(num_slots, 2, 4, generator=gen) for _ in range(layers)]
        self.v_buffer = [torch.randn(num_slots, 2, 4, generator=gen) for _ in range(layers)]

    def clone(self) -> RandomPool:
        other = object.__new__(RandomPool)
        other.page_size = self.page_size
        other.k_buffer = [b.clone() for b in self.k_buffer]
        other.v_buffer = [b.clone() for b in self.v_buffer]
        return other

    def move_kv_cache(self, tgt: torch.Tensor, src: torch.Tensor) -> None:
        ref_mem.move_kv_cache(self.k_buffer, self.v_buffer, tgt, src)

    def outputs(self) -> dict[str, np.ndarray]:
        return {
            "k_buffer": to_numpy(torch.stack(self.k_buffer)),
            "v_buffer": to_numpy(torch.stack(self.v_buffer)),
        }


def num_slots(w: World) -> int:
    return (w.num_pages + 1) * w.case.page_size


@dataclasses.dataclass(frozen=True)
class Op:
    """One interop op: its sglang name, comparison, jspec impls, reference and drop-in."""

    name: str
    run: Callable[[World, np.random.Generator, str], tuple[Outputs, Outputs, dict]]
    impls: tuple[str, ...]
    requires: tuple[str, ...]  # "module:attr" that must import for the op to be available
    reference: Any = None  # the PyTorch reference (sglang's signature)
    dropin: Any = None  # jspec behind sglang's signature (None: sglang has no such function)
