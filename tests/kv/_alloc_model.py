"""Independent python model of sglang's paged allocator (SPEC §10) and a JAX-vs-model harness.

The model is list based, like sglang's torch code: ``free_pages`` is a python list taken from the
front, ``free`` prepends ``sorted(set(slot // P))`` (or appends to ``staged`` when need_sort), and
``alloc_extend`` is a port of sglang's ``alloc_extend_naive`` three-part loop. It shares no code
with ``jspec.kv.allocator``.

:class:`Harness` drives jspec and the model with the same calls (fixed padded shapes, so every
jitted function compiles once per geometry) and checks identical slot ids and free lists, plus the
integrity invariants (no leak, no duplicate, no page 0) after every step.
"""

from __future__ import annotations

import random

import chex
import jax.numpy as jnp
import numpy as np

from jspec.kv import allocator as A
from jspec.kv import integrity as I


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ModelAllocator:
    """sglang ``PagedTokenToKVPoolAllocator`` on python lists (failed calls change nothing)."""

    def __init__(self, num_pages: int, page_size: int, need_sort: bool = False) -> None:
        self.num_pages, self.P, self.need_sort = num_pages, page_size, need_sort
        self.free_pages = list(range(1, num_pages + 1))
        self.staged: list[int] = []

    def available_size(self) -> int:
        return (len(self.free_pages) + len(self.staged)) * self.P

    def merge_and_sort_free(self) -> None:
        self.free_pages = sorted(self.free_pages + self.staged)
        self.staged = []

    def _take(self, n: int, bound: int | None = None) -> list[int] | None:
        """Pop ``n`` pages; need_sort merges first when ``bound`` (sglang's quick bound, default
        ``n``) exceeds the free list."""
        free, staged = self.free_pages, self.staged
        if self.need_sort and (n if bound is None else bound) > len(free):
            free, staged = sorted(free + staged), []
        if n > len(free):
            return None
        self.free_pages, self.staged = free[n:], staged
        return free[:n]

    def _release(self, pages: list[int]) -> None:
        if self.need_sort:
            self.staged = self.staged + list(pages)
        else:
            self.free_pages = list(pages) + self.free_pages

    # -- alloc ------------------------------------------------------------------------------
    def alloc(self, need_size: int) -> list[int] | None:
        P = self.P
        pages = self._take(need_size // P)
        if pages is None:
            return None
        return [pg * P + k for pg in pages for k in range(P)]

    def alloc_extend(self, pre, seq, last_loc, max_new_slots=None) -> list[int] | None:
        """Port of sglang ``alloc_extend_naive`` (three parts per request)."""
        P = self.P
        pre, seq, last_loc = (np.asarray(x, np.int64) for x in (pre, seq, last_loc))
        ext = seq - pre
        total = int(ext.sum())
        num_new_pages = (seq + P - 1) // P - (pre + P - 1) // P
        if max_new_slots is not None and total > max_new_slots:
            return None
        pages = self._take(int(num_new_pages.sum()), bound=total // P + len(pre) + 1)
        if pages is None:
            return None
        pages = np.asarray(pages, np.int64)
        end_pos = np.cumsum(ext)
        start_pos = end_pos - ext
        num_full_new_pages = seq // P - (pre + P - 1) // P
        need_page = num_new_pages - num_full_new_pages
        end_new = np.cumsum(num_new_pages)
        start_new = end_new - num_new_pages
        pos_in_page = np.arange(P)
        out = np.full(total, -99, np.int64)
        for i in range(len(pre)):
            num1 = min(seq[i], (pre[i] + P - 1) // P * P) - pre[i]
            if num1:
                out[start_pos[i] : start_pos[i] + num1] = last_loc[i] + 1 + pos_in_page[:num1]
            if pre[i] + num1 == seq[i]:
                continue
            num2 = (seq[i] // P - (pre[i] + P - 1) // P) * P
            if num2:
                pg = pages[start_new[i] : end_new[i] - need_page[i]] * P
                out[start_pos[i] + num1 : start_pos[i] + num1 + num2] = (
                    pg[:, None] + pos_in_page[None, :]
                ).reshape(-1)
            if pre[i] + num1 + num2 == seq[i]:
                continue
            num3 = seq[i] - seq[i] // P * P
            out[end_pos[i] - num3 : end_pos[i]] = pages[end_new[i] - 1] * P + pos_in_page[:num3]
        assert (out >= 0).all()
        return [int(x) for x in out]

    def alloc_decode(self, seq, last_loc, valid=None) -> list[int] | None:
        P = self.P
        valid = [True] * len(seq) if valid is None else list(valid)
        needs = [bool(v) and cdiv(s, P) - cdiv(s - 1, P) == 1 for s, v in zip(seq, valid)]
        pages = self._take(sum(needs), bound=sum(valid))
        if pages is None:
            return None
        out, rank = [], 0
        for s, ll, v, need in zip(seq, last_loc, valid, needs):
            if not v:
                out.append(0)
            elif need:
                out.append(pages[rank] * P)
                rank += 1
            else:
                out.append(int(ll) + 1)
        return out

    # -- free -------------------------------------------------------------------------------
    def free(self, slot_ids) -> None:
        if len(slot_ids):
            self._release(sorted({int(s) // self.P for s in slot_ids}))

    def free_page_ids(self, page_ids) -> None:
        self._release([int(p) for p in page_ids])

    def free_segment(self, row, start: int, end: int) -> None:
        self._release([int(row[i]) // self.P for i in range(start, end, self.P)])


def state_lists(a: A.PagedAllocator) -> tuple[list[int], list[int]]:
    nf, ns = int(a.num_free), int(a.num_staged)
    free, staged = np.asarray(a.free_pages), np.asarray(a.staged_pages)
    assert (free[nf:] == A.PAD_PAGE_ID).all() and (staged[ns:] == A.PAD_PAGE_ID).all()
    return [int(x) for x in free[:nf]], [int(x) for x in staged[:ns]]


def assert_same_state(a: A.PagedAllocator, model: ModelAllocator) -> None:
    free, staged = state_lists(a)
    assert free == model.free_pages
    assert staged == model.staged
    assert int(A.available_size(a)) == model.available_size()


def assert_state_identical(x: A.PagedAllocator, y: A.PagedAllocator) -> None:
    chex.assert_trees_all_equal(x, y)


class Harness:
    """Runs random alloc/free ops on jspec and the model side by side (fixed padded shapes)."""

    KINDS = ("extend", "decode", "alloc", "free", "free_segment", "free_page_ids", "merge")

    def __init__(
        self,
        page_size: int,
        need_sort: bool = False,
        *,
        num_pages: int = 24,
        batch: int = 4,
        max_reqs: int = 8,
        impl: str = "xla",
    ) -> None:
        self.P, self.B, self.impl = page_size, batch, impl
        self.W = 6 * page_size + 4  # row width (positions)
        self.max_ext = 2 * page_size + 3
        self.M = batch * self.max_ext  # max_new_slots
        self.F = 2 * self.W  # padded length of free() inputs
        self.max_reqs = max_reqs
        self.a = A.init_allocator(num_pages, page_size, need_sort=need_sort)
        self.model = ModelAllocator(num_pages, page_size, need_sort)
        self.rows: dict[int, list[int]] = {}  # request id -> slots of positions 0..len-1
        self.next_id = 0
        self.failures = 0

    # -- helpers ----------------------------------------------------------------------------
    def _pad(self, xs, n, fill=0):
        out = np.full(n, fill, np.int32)
        out[: len(xs)] = xs
        return jnp.asarray(out)

    def _new_id(self) -> int | None:
        if len(self.rows) >= self.max_reqs:
            return None
        self.next_id += 1
        return self.next_id

    def _check_alloc(self, before, after, ok, slots, expect, n_out) -> bool:
        slots = np.asarray(slots)
        if expect is None:
            assert not bool(ok)
            assert (slots == 0).all()
            assert_state_identical(after, before)
            self.failures += 1
            return False
        assert bool(ok)
        assert list(slots[: len(expect)]) == expect
        assert (slots[len(expect) : n_out] == 0).all()
        return True

    def check(self) -> None:
        assert_same_state(self.a, self.model)
        # Page correspondence (SPEC §4.1): row page k maps to one physical page, offset = pos % P.
        seen: set[int] = set()
        for row in self.rows.values():
            for pos, slot in enumerate(row):
                assert slot % self.P == pos % self.P
                assert slot // self.P == row[pos - pos % self.P] // self.P
            assert seen.isdisjoint(row) and len(set(row)) == len(row)
            seen.update(row)
        table = np.zeros((self.max_reqs + 1, self.W), np.int32)
        lens = np.zeros(self.max_reqs, np.int32)
        for k, row in enumerate(self.rows.values()):
            table[k + 1, : len(row)] = row
            lens[k] = len(row)
        owned = I.owned_page_mask(
            jnp.asarray(table),
            jnp.arange(1, self.max_reqs + 1),
            jnp.asarray(lens),
            num_pages=self.a.num_pages,
            page_size=self.P,
        )
        I.check_integrity(self.a, owned, what="harness")
        counts = {k: int(v) for k, v in I.integrity_violations(self.a, owned).items()}
        assert counts["lost"] == counts["owned_and_free"] == counts["duplicate_free"] == 0
        assert counts["page0_free"] == counts["out_of_range_free"] == 0
        assert not bool(np.asarray(owned)[0])  # rows never point at page 0

    # -- ops --------------------------------------------------------------------------------
    def step(self, kind: str, rng: random.Random) -> None:
        getattr(self, "op_" + kind)(rng)
        self.check()

    def op_extend(self, rng: random.Random) -> None:
        P, entries = self.P, []
        for _ in range(rng.randint(1, self.B)):
            choices = [r for r in self.rows if r not in {e[0] for e in entries}]
            if choices and rng.random() < 0.7:
                rid = rng.choice(choices)
            else:
                rid = self._new_id()
                if rid is None:
                    continue
                self.rows[rid] = []
            pre = len(self.rows[rid])
            ext = rng.choice([0, 1, P - 1, P, P + 1, rng.randint(0, self.max_ext)])
            ext = max(0, min(ext, self.max_ext, self.W - pre))
            entries.append((rid, pre, pre + ext))
        pad = [(None, 0, 0)] * (self.B - len(entries))
        entries = entries + pad
        rng.shuffle(entries)  # padding rows anywhere in the batch
        pre = [e[1] for e in entries]
        seq = [e[2] for e in entries]
        last = [self.rows[e[0]][e[1] - 1] if e[0] is not None and e[1] > 0 else -1 for e in entries]
        expect = self.model.alloc_extend(pre, seq, last, self.M)
        before = self.a
        self.a, slots, ok = A.alloc_extend(
            before,
            jnp.asarray(pre, jnp.int32),
            jnp.asarray(seq, jnp.int32),
            jnp.asarray(last, jnp.int32),
            max_new_slots=self.M,
            impl=self.impl,
        )
        if self._check_alloc(before, self.a, ok, slots, expect, self.M):
            k = 0
            for rid, p, s in entries:
                if rid is not None:
                    self.rows[rid].extend(expect[k : k + s - p])
                k += s - p
        for rid in [r for r, row in self.rows.items() if not row]:
            del self.rows[rid]

    def op_decode(self, rng: random.Random) -> None:
        cands = [r for r, row in self.rows.items() if len(row) < self.W]
        picked = rng.sample(cands, min(len(cands), rng.randint(1, self.B)))
        entries = picked + [None] * (self.B - len(picked))
        rng.shuffle(entries)
        seq = [len(self.rows[r]) + 1 if r is not None else rng.randint(0, 9) for r in entries]
        last = [self.rows[r][-1] if r is not None else rng.randint(-1, 9) for r in entries]
        valid = [r is not None for r in entries]
        expect = self.model.alloc_decode(seq, last, valid)
        before = self.a
        self.a, slots, ok = A.alloc_decode(
            before,
            jnp.asarray(seq, jnp.int32),
            jnp.asarray(last, jnp.int32),
            valid=jnp.asarray(valid),
            impl=self.impl,
        )
        if self._check_alloc(before, self.a, ok, slots, expect, self.B):
            for r, s in zip(entries, expect):
                if r is not None:
                    self.rows[r].append(s)

    def op_alloc(self, rng: random.Random) -> None:
        rid = self._new_id()
        if rid is None:
            return
        n = rng.randint(0, self.W // self.P) * self.P
        expect = self.model.alloc(n)
        before = self.a
        self.a, slots, ok = A.alloc(before, jnp.int32(n), max_slots=self.W)
        if self._check_alloc(before, self.a, ok, slots, expect, self.W) and expect:
            self.rows[rid] = expect

    def op_free(self, rng: random.Random) -> None:
        if not self.rows:
            return
        rid = rng.choice(list(self.rows))
        slots = list(self.rows.pop(rid))
        slots += rng.sample(slots, min(len(slots), rng.randint(0, 3)))  # repeats are fine
        rng.shuffle(slots)
        n = len(slots)
        valid = np.zeros(self.F, bool)
        valid[:n] = True
        ids = self._pad(slots, self.F, fill=rng.randint(0, 3))  # junk under valid=False
        perm = np.random.default_rng(rng.randint(0, 99)).permutation(self.F)
        self.model.free(slots)
        self.a = A.free(self.a, ids[perm], valid=jnp.asarray(valid[perm]))

    def op_free_segment(self, rng: random.Random) -> None:
        cands = [r for r, row in self.rows.items() if row]
        if not cands:
            return
        rid = rng.choice(cands)
        row = self.rows[rid]
        start = cdiv(rng.randint(0, len(row)), self.P) * self.P
        if start > len(row):
            return
        self.model.free_segment(row, start, len(row))
        self.a = A.free_segment(
            self.a, self._pad(row, self.W), jnp.int32(start), jnp.int32(len(row))
        )
        del row[start:]
        if not row:
            del self.rows[rid]

    def op_free_page_ids(self, rng: random.Random) -> None:
        cands = [r for r, row in self.rows.items() if row and len(row) % self.P == 0]
        if not cands:
            return
        rid = rng.choice(cands)
        pages = [s // self.P for s in self.rows.pop(rid)[:: self.P]]
        rng.shuffle(pages)
        valid = np.zeros(self.W, bool)
        valid[: len(pages)] = True
        self.model.free_page_ids(pages)
        self.a = A.free_page_ids(self.a, self._pad(pages, self.W), valid=jnp.asarray(valid))

    def op_merge(self, rng: random.Random) -> None:
        del rng
        self.model.merge_and_sort_free()
        self.a = A.merge_and_sort_free(self.a)
