"""How many bytes one device holds of a value: the one sizing the budget planner, the
residual policies and `tg.memory_report` share.

A value sharded over several devices costs each device its shard, since that is what
must fit in a device's memory. Where the shard is known from the value's type (jax's
Explicit mesh axes: ``aval.sharding``), from the concrete array (what the report
measures), or from where the tape's values are placed on Auto axes
(`tapegrad.engine.placement`: the sharding jax gives each value when the tape runs
eagerly), it is the shard's bytes; where nothing says, the whole value's (an upper
bound: a device never holds more than all of it).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

__all__ = ["as_dtype", "itemsize", "device_nbytes", "array_nbytes", "sharding_of"]


def as_dtype(dtype: Any) -> Any:
    """A numpy dtype, or jax's own for extended dtypes (PRNG keys)."""
    try:
        return np.dtype(dtype)
    except TypeError:
        return dtype


def itemsize(dtype: Any) -> int:
    return int(getattr(as_dtype(dtype), "itemsize", 0))


def sharding_of(value: Any) -> Any:
    """The sharding a tape value (`Var`, `Saved`) is sized by: where it is placed on an
    Auto mesh (``placement``), else its type-level sharding (``sharding``), else None."""
    placed = getattr(value, "placement", None)
    return placed if placed is not None else getattr(value, "sharding", None)


def device_nbytes(shape: tuple[int, ...], dtype: Any, sharding: Any = None) -> int:
    """Bytes one device holds of a value of this shape and dtype under ``sharding``: a
    type-level sharding over a mesh (Explicit axes), or a concrete array's or placed
    value's sharding, splits it into shards and a device holds one. None, or a type
    that says nothing (Auto axes under jit: ``P(None, ...)``), counts the whole value."""
    if sharding is None:
        return math.prod(shape) * itemsize(dtype)
    try:
        return _shard_nbytes(tuple(shape), dtype, sharding)
    except TypeError:  # an unhashable sharding
        return _shard_nbytes.__wrapped__(tuple(shape), dtype, sharding)


@functools.lru_cache(maxsize=4096)
def _shard_nbytes(shape: tuple[int, ...], dtype: Any, sharding: Any) -> int:
    n = math.prod(shape) * itemsize(dtype)
    mesh = getattr(sharding, "mesh", None)
    if n == 0 or getattr(mesh, "empty", False) or not hasattr(sharding, "shard_shape"):
        return n
    try:
        return math.prod(sharding.shard_shape(shape)) * itemsize(dtype)
    except Exception:  # noqa: BLE001 -- a shape the spec does not divide: count it whole
        return n


def array_nbytes(x: Any) -> int:
    """Bytes one device holds of a concrete array: its shard's (a replicated array: all
    of it); numpy arrays and scalars: their size."""
    sharding = getattr(x, "sharding", None)
    shape = getattr(x, "shape", None)
    if sharding is None or shape is None or len(getattr(sharding, "device_set", ())) <= 1:
        return int(getattr(x, "nbytes", 0))
    return device_nbytes(tuple(shape), x.dtype, sharding)
