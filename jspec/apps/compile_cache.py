"""The persistent XLA compilation cache of the jspec commands: a second run with the same model,
flags and devices loads its executables from disk instead of compiling them again.

On by default in ``$XDG_CACHE_HOME/jspec/xla`` (``~/.cache/jspec/xla``);
``JSPEC_COMPILATION_CACHE=DIR`` (read in :mod:`jspec.env`) moves it, ``=0`` / ``=off`` or the
``--no-compilation-cache`` flag turns it off. Every compile is stored (no minimum compile time
or entry size: the engine's steps of a small model compile in well under JAX's default 1 s).

NOTE: JAX reads the directory once, at the first compile that consults the cache; set it before
anything compiles. The cache is trusted code: a directory others can write to lets them run
code in this process (JAX's warning).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
from collections.abc import Iterator

from jspec import env

_OFF = ("0", "off", "false", "no", "none")
_HIT = "/jax/compilation_cache/cache_hits"
_MISS = "/jax/compilation_cache/cache_misses"  # recorded when an entry is written


def cache_dir(enabled: bool = True) -> str | None:
    """The cache directory to use, or None (off: ``enabled`` False or the env toggle off)."""
    setting = env.COMPILATION_CACHE
    if not enabled or (setting is not None and setting.strip().lower() in _OFF):
        return None
    if setting is not None:
        return os.path.abspath(os.path.expanduser(setting))
    return os.path.join(env.USER_CACHE_DIR, "jspec", "xla")


def add_cache_flag(parser: argparse._ActionsContainer) -> None:
    """The commands' ``--no-compilation-cache`` flag (on a parser or an argument group)."""
    parser.add_argument(
        "--no-compilation-cache",
        action="store_true",
        help="do not keep compiles in $XDG_CACHE_HOME/jspec/xla (JSPEC_COMPILATION_CACHE=DIR)",
    )


def use_compilation_cache(no_compilation_cache: bool) -> None:
    """Turn the cache on (:func:`cache_dir`) unless the flag or the env toggle says off; call it
    before anything compiles."""
    directory = cache_dir(not no_compilation_cache)
    if directory is not None:
        enable_compilation_cache(directory)


def enable_compilation_cache(directory: str) -> None:
    """Store every compile of this process in ``directory`` (and load hits from it)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@dataclasses.dataclass
class CacheCounts:
    """Compiles of a block that the persistent cache served (``hits``) or stored (``stored``)."""

    hits: int = 0
    stored: int = 0

    def describe(self) -> str:
        """``"3 from the compilation cache, 1 stored"``, or "" when the cache was not used."""
        if not self.hits and not self.stored:
            return ""
        return f"{self.hits} from the compilation cache, {self.stored} stored"


@contextlib.contextmanager
def count_cache_events() -> Iterator[CacheCounts]:
    """Count the persistent-cache hits and writes inside the block (``jax.monitoring``)."""
    import jax

    counts = CacheCounts()

    def listener(event: str, **kwargs: object) -> None:
        if event == _HIT:
            counts.hits += 1
        elif event == _MISS:
            counts.stored += 1

    jax.monitoring.register_event_listener(listener)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_listener(listener)
