"""Property tests: random alloc/free op sequences against the list model (hypothesis).

Invariants checked after every op (``_alloc_model.Harness.check``): identical slot ids and free
lists to the model, no leak (free + owned == total), no duplicate free page, page 0 never free or
owned, page correspondence of every row; a failed allocation returns ``ok=False``, all-zero slot
ids and the input state bit-identical.
"""

from __future__ import annotations

import pathlib
import random
import sys

import jax.numpy as jnp
import numpy as np
from hypothesis import given, note
from hypothesis import strategies as st

from jspec.kv import allocator as A

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _alloc_model import Harness, ModelAllocator, assert_state_identical

ops_strategy = st.lists(
    st.tuples(st.sampled_from(Harness.KINDS), st.integers(0, 2**20)), min_size=1, max_size=14
)


# NOTE: one pool geometry per (page_size, need_sort) keeps the jit compiles few (CPU budget);
# page_size 64 is covered by test_allocator.py's sequences.
@given(page_size=st.sampled_from([1, 4, 16]), need_sort=st.booleans(), ops=ops_strategy)
def test_op_sequences_match_model(
    page_size: int, need_sort: bool, ops: list[tuple[str, int]]
) -> None:
    h = Harness(page_size, need_sort, num_pages=8)
    for kind, seed in ops:
        note(f"{kind} seed={seed} rows={h.rows}")
        h.step(kind, random.Random(seed))


@st.composite
def exhausting_extend(draw):
    """A pool with some pages taken, then an extend batch asking for more than is left."""
    page_size = draw(st.sampled_from([1, 4]))
    num_pages = 8
    taken = draw(st.integers(0, num_pages))
    free_back = draw(st.lists(st.integers(1, taken), max_size=3, unique=True)) if taken else []
    need_pages = draw(st.integers(num_pages - taken + len(free_back) + 1, num_pages + 2))
    split = draw(st.integers(0, need_pages))
    return page_size, num_pages, taken, free_back, [split, need_pages - split]


@given(case=exhausting_extend(), need_sort=st.booleans())
def test_exhaustion_is_atomic(case, need_sort: bool) -> None:
    page_size, num_pages, taken, free_back, pages_per_req = case
    a = A.init_allocator(num_pages, page_size, need_sort=need_sort)
    a = A.alloc(a, jnp.int32(taken * page_size), max_slots=num_pages * page_size)[0]
    slots = [p * page_size for p in free_back]
    a = A.free(
        a, jnp.asarray(slots + [0] * (3 - len(slots)), jnp.int32), valid=jnp.arange(3) < len(slots)
    )
    seq = jnp.asarray([n * page_size for n in pages_per_req], jnp.int32)
    zeros = jnp.zeros(2, jnp.int32)
    new, out, ok = A.alloc_extend(
        a, zeros, seq, zeros - 1, max_new_slots=(num_pages + 2) * page_size
    )
    model = ModelAllocator(num_pages, page_size, need_sort)
    model.alloc(taken * page_size)
    model.free(slots)
    assert model.alloc_extend([0, 0], list(np.asarray(seq)), [-1, -1]) is None
    assert not bool(ok) and not np.asarray(out).any()
    assert_state_identical(new, a)
