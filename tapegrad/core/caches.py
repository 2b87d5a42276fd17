"""Every cache tapegrad keeps from one call to the next, in one place.

Eagerly, tapegrad compiles small programs (one per VJP rule, one per fused
forward+backward, one per transposed ``custom_jvp`` rule) and reuses them when a
later call has the same *structure*. Values never key a cache that compiles:
literals and closed-over constants are arguments of the compiled programs, so a
learning-rate schedule or a changing temperature reuses what was compiled.

Each cache is a `BoundedCache`: least recently used out first, bounded by its
number of entries and, where entries hold arrays, by their bytes.
`tg.clear_caches()` empties all of them; `cache_info()` reports their sizes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import jax
import numpy as np

__all__ = [
    "BoundedCache",
    "LookupTable",
    "array_bytes",
    "cache_bytes",
    "cache_info",
    "clear_caches",
    "register",
]


class BoundedCache:
    """A dict bounded by entries and bytes, least recently used evicted first.

    ``nbytes`` given to `put` is what the entry keeps alive (arrays it holds); an
    entry bigger than ``max_bytes`` alone is not kept at all.
    """

    __slots__ = ("name", "max_entries", "max_bytes", "_data", "_bytes", "_total", "_lock")

    def __init__(self, name: str, max_entries: int, max_bytes: int | None = None):
        self.name = name
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._data: OrderedDict[Any, Any] = OrderedDict()
        self._bytes: dict[Any, int] = {}
        self._total = 0
        self._lock = threading.Lock()
        register(name, self)

    def get(self, key: Any, default: Any = None) -> Any:
        with self._lock:
            try:
                self._data.move_to_end(key)
            except KeyError:
                return default
            return self._data[key]

    def __contains__(self, key: Any) -> bool:
        return key in self._data

    def put(self, key: Any, value: Any, nbytes: int = 0) -> Any:
        """Store ``value`` under ``key`` (evicting the oldest entries to make room)."""
        with self._lock:
            if key in self._data:
                self._drop(key)
            if self.max_bytes is not None and nbytes > self.max_bytes:
                return value
            while self._data and (
                len(self._data) >= self.max_entries
                or (self.max_bytes is not None and self._total + nbytes > self.max_bytes)
            ):
                self._drop(next(iter(self._data)))
            self._data[key] = value
            self._bytes[key] = nbytes
            self._total += nbytes
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        self.put(key, value)

    def pop(self, key: Any, default: Any = None) -> Any:
        with self._lock:
            if key not in self._data:
                return default
            value = self._data[key]
            self._drop(key)
            return value

    def _drop(self, key: Any) -> None:
        del self._data[key]
        self._total -= self._bytes.pop(key, 0)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes.clear()
            self._total = 0

    def __len__(self) -> int:
        return len(self._data)

    def values(self) -> list:
        with self._lock:
            return list(self._data.values())

    @property
    def nbytes(self) -> int:
        return self._total

    def __repr__(self) -> str:
        return (
            f"BoundedCache({self.name!r}, {len(self)}/{self.max_entries} entries, "
            f"{self._total}/{self.max_bytes} bytes)"
        )


# name -> an object with __len__ and clear() (a BoundedCache, or a plain dict elsewhere)
class LookupTable(dict):
    """A memo for a small key space (dtypes), read on every traced value: a plain dict's
    lookup on a hit, emptied when it would pass ``max_entries``. Holds no arrays."""

    max_bytes = None
    nbytes = 0

    def __init__(self, name: str, max_entries: int):
        super().__init__()
        self.name, self.max_entries = name, max_entries
        register(name, self)

    def remember(self, key: Any, value: Any) -> Any:
        if len(self) >= self.max_entries:
            self.clear()
        self[key] = value
        return value


_REGISTRY: dict[str, Any] = {}


def register(name: str, cache: Any) -> None:
    """Make ``cache`` (anything with ``__len__`` and ``clear()``) known to `clear_caches`."""
    _REGISTRY[name] = cache


def _all() -> dict[str, Any]:
    # Every module that keeps a cache registers it on import (``import tapegrad`` imports
    # them all, and nothing reaches these functions without it).
    return dict(_REGISTRY)


def cache_info() -> dict[str, int]:
    """Entries per cache, by name (a private view for tests and benchmarks)."""
    return {name: len(c) for name, c in sorted(_all().items())}


def cache_bytes() -> dict[str, int]:
    """Bytes of arrays held per cache (0 for caches that hold none)."""
    return {name: int(getattr(c, "nbytes", 0)) for name, c in sorted(_all().items())}


def clear_caches() -> None:
    """Empty every cache tapegrad keeps between calls (compiled rules, fused programs,
    transposed ``custom_jvp`` rules, effect lookups), like `jax.clear_caches` does for jax.

    The next calls trace and compile again, then are cached afresh. Useful to release
    memory after a sweep over many model shapes, or to start a benchmark cold. jax's own
    caches are left alone: call `jax.clear_caches()` as well to empty those.

    ```python
    import jax.numpy as jnp
    import tapegrad as tg

    for lr in (0.1, 0.05, 0.025):  # a new constant each step: compiled once, reused
        tg.grad(lambda w: jnp.sum(jnp.tanh(w * lr) ** 2))(jnp.ones(3))
    tg.clear_caches()  # everything compiled so far is released
    ```
    """
    for c in _all().values():
        c.clear()


def array_bytes(tree: Any) -> int:
    """Bytes of the arrays among ``tree``'s leaves (what a cache entry keeps alive)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            try:
                total += int(leaf.nbytes)
            except Exception:  # a deleted array, an abstract one
                pass
    return total
