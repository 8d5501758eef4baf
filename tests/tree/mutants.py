"""Mutants of jspec's sampling code: the real module's source with one expression replaced.

A mutant is loaded as a fresh module object (its own jit caches) and swapped into the module
that calls it (``monkeypatch``), so the test harness traces the mutated code. Each mutation
must match its module's source exactly once: a refactor that moves the code breaks the mutant
loudly instead of silently testing the original.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types

# name -> (module, old, new, what it models)
MUTANTS: dict[str, tuple[str, str, str, str]] = {
    "le_boundary": (
        "jspec.tree.sampling",
        "hit = (coin < prob_acc / t_acc)",
        "hit = (coin <= prob_acc / t_acc)",
        "the coin compared closed (sglang before #35798)",
    ),
    "duplicate_counted_twice": (
        "jspec.tree.sampling",
        "q_tok = jnp.where(seen, 0.0, q_tok)",
        "q_tok = q_tok",
        "a duplicate sibling's token counted again (sglang 0.5.23)",
    ),
    "sibling_not_cumulative": (
        "jspec.tree.sampling",
        "prob_acc = jnp.where(cur_ok, prob_acc + q_tok, prob_acc)\n            hit",
        "prob_acc = jnp.where(cur_ok, q_tok, prob_acc)\n            hit",
        "each sibling compared with its own probability (sibling-order bias)",
    ),
    "residual_not_removed": (
        "jspec.tree.sampling",
        "residual = jnp.where(removed, 0.0, q_last)",
        "residual = q_last",
        "the bonus drawn from q, rejected siblings' tokens not removed",
    ),
    "child_row": (
        "jspec.tree.sampling",
        "q_tok = target_probs[rows, jnp.clip(last, 0, n - 1), jnp.clip(token, 0, v - 1)]",
        "q_tok = target_probs[rows, jnp.clip(cur, 0, n - 1), jnp.clip(token, 0, v - 1)]",
        "the wrong logits row: the child's distribution instead of its parent's",
    ),
    "temperature_twice": (
        "jspec.tree.sampling_probs",
        "scaled = logits / jnp.where(greedy, 1.0, temps[:, None, None])",
        "scaled = logits / jnp.where(greedy, 1.0, temps[:, None, None]) ** 2",
        "temperature applied twice",
    ),
    "coin_reused": (
        "jspec.engine.sampling",
        "coins = uniform_coins(sampling.seed, STREAM_NODE, committed_lens, n)",
        "coins = jnp.repeat(uniform_coins(sampling.seed, STREAM_NODE, committed_lens, 1), n, 1)",
        "one coin for every depth (not fresh after an acceptance)",
    ),
}

# Where each mutated module is called from: (caller module, attribute) -> mutant attribute.
_CALLERS = {
    "jspec.tree.sampling": (("jspec.engine.sampling", "tree_sampling_verify"),),
    "jspec.tree.sampling_probs": (("jspec.engine.sampling", "target_probs_from_logits"),),
    "jspec.engine.sampling": (
        ("jspec.engine.spec_step", "sample_tree"),
        ("jspec.engine.greedy", "next_tokens"),
        ("jspec.engine.lifecycle", "next_tokens"),
    ),
}


def load_mutant(name: str) -> types.ModuleType:
    """The mutated copy of the module ``MUTANTS[name]`` names."""
    module_name, old, new, _ = MUTANTS[name]
    module = importlib.import_module(module_name)
    source = inspect.getsource(module)
    count = source.count(old)
    if count != 1:
        raise AssertionError(f"mutant {name}: {old!r} occurs {count} times in {module_name}")
    mutant = types.ModuleType(f"{module_name}__mutant_{name}")
    mutant.__file__ = module.__file__
    sys.modules[mutant.__name__] = mutant  # dataclasses resolve annotations through it
    exec(compile(source.replace(old, new), module.__file__, "exec"), mutant.__dict__)
    return mutant


def apply_mutant(name: str, monkeypatch) -> types.ModuleType:
    """Swap the mutant into its callers (``monkeypatch`` undoes it); returns the mutant."""
    mutant = load_mutant(name)
    module_name = MUTANTS[name][0]
    for caller, attr in _CALLERS[module_name]:
        monkeypatch.setattr(importlib.import_module(caller), attr, getattr(mutant, attr))
    return mutant
