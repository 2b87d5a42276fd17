"""Bit-packed boolean residuals: one bit per element instead of a bool's byte.

A rule that keeps a mask (relu's ``x > 0``, reduce_max's ties, a ``where``
predicate, clamp's in-range test) keeps it through `pack_mask`, declares its aval
with `mask_aval`, and reads it back with `unpack_mask`. The packed value is a
plain uint8 array, so residual policies, `memory_report` and `jax.live_arrays`
all see (and count) the packed size.

Bits are packed along the *last* axis (8 per byte, the tail padded with zeros):
leading axes, where batch sharding lives, keep their size. A mask is left as a
bool array, unpacked, when packing would gain little or cost a reshard:

* its last axis is shorter than 8 (a byte per row would be most of the mask);
* it has fewer than `MIN_ELEMENTS` elements (a few bytes saved for two extra ops);
* its last axis is sharded over an Explicit mesh axis (packing would move data
  between devices).

The choice depends only on the mask's shape and type-level sharding, so the aval
declared at trace time and the value made in forward always agree.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
from jax import lax

from tapegrad import _jax_compat as compat

__all__ = ["MIN_ELEMENTS", "packs", "mask_aval", "pack_mask", "unpack_mask", "is_packed"]

# Masks smaller than this stay bool: see the module docstring and bench/structural_bench.py.
MIN_ELEMENTS = 256

_SHIFTS = np.arange(8, dtype=np.uint8)


def _last_axis_sharded(sharding: Any) -> bool:
    s = compat.explicit_sharding(SimpleNamespace(sharding=sharding))
    spec = tuple(getattr(s, "spec", ())) if s is not None else ()
    return len(spec) > 0 and spec[-1] is not None


def packs(shape: tuple[int, ...], sharding: Any = None) -> bool:
    """Whether a bool mask of this shape (and type-level sharding) is kept packed."""
    return (
        len(shape) > 0
        and shape[-1] >= 8
        and math.prod(shape) >= MIN_ELEMENTS
        and not _last_axis_sharded(sharding)
    )


def _packed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(shape[:-1]) + (-(-shape[-1] // 8),)


def mask_aval(shape: tuple[int, ...], sharding: Any = None) -> jax.ShapeDtypeStruct:
    """The aval of a kept bool mask of ``shape``: packed uint8 or plain bool."""
    shape = tuple(shape)
    if packs(shape, sharding):
        return jax.ShapeDtypeStruct(_packed_shape(shape), np.uint8)
    return jax.ShapeDtypeStruct(shape, np.bool_)


def _sharding_of(x: Any) -> Any:
    try:
        return jax.typeof(x).sharding
    except Exception:
        return None


def pack_mask(mask: Any) -> Any:
    """``mask`` (bool) as kept for backward: bit-packed when `packs` says so."""
    shape = tuple(mask.shape)
    if not packs(shape, _sharding_of(mask)):
        return mask
    return _pack(mask) if isinstance(mask, jax.core.Tracer) else _pack_jit(mask)


def is_packed(value: Any) -> bool:
    return np.dtype(value.dtype) == np.uint8


def unpack_mask(kept: Any, shape: tuple[int, ...]) -> Any:
    """The bool mask of ``shape`` that `pack_mask` kept as ``kept``."""
    if np.dtype(kept.dtype) == np.bool_:
        return kept
    if isinstance(kept, jax.core.Tracer):
        return _unpack(kept, tuple(shape))
    return _unpack_jit(kept, tuple(shape))


def _pack(mask):
    n = mask.shape[-1]
    u = lax.convert_element_type(mask, np.uint8)
    tail = -n % 8
    if tail:
        u = lax.pad(u, np.uint8(0), [(0, 0, 0)] * (u.ndim - 1) + [(0, tail, 0)])
    u = lax.reshape(u, tuple(u.shape[:-1]) + ((n + tail) // 8, 8))
    bits = lax.shift_left(u, lax.broadcast_in_dim(_SHIFTS, u.shape, (u.ndim - 1,)))
    # Distinct bits: their sum is their bitwise or, and fits in a byte.
    return lax.reduce_sum(bits, (u.ndim - 1,))


def _unpack(packed, shape):
    n = shape[-1]
    full = packed.shape + (8,)
    spread = lax.broadcast_in_dim(packed, full, tuple(range(packed.ndim)))
    bits = lax.shift_right_logical(spread, lax.broadcast_in_dim(_SHIFTS, full, (packed.ndim,)))
    bits = lax.bitwise_and(bits, np.uint8(1))
    flat = lax.reshape(bits, tuple(packed.shape[:-1]) + (packed.shape[-1] * 8,))
    if flat.shape[-1] != n:
        flat = lax.slice_in_dim(flat, 0, n, axis=flat.ndim - 1)
    return lax.convert_element_type(flat, np.bool_)


# Eagerly one dispatch per pack (the rules' backward is already one compiled call).
_pack_jit = jax.jit(_pack)
_unpack_jit = jax.jit(_unpack, static_argnums=1)
