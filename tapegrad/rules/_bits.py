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

from tapegrad.core import jax_compat as compat

__all__ = [
    "MIN_ELEMENTS",
    "packs",
    "mask_aval",
    "pack_mask",
    "unpack_mask",
    "code_bits",
    "packs_codes",
    "codes_aval",
    "pack_codes",
    "unpack_codes",
]

# Masks smaller than this stay bool: see the module docstring and bench/structural_bench.py.
MIN_ELEMENTS = 256


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
    return _pack(mask, 1) if isinstance(mask, jax.core.Tracer) else _pack_jit(mask, 1)


def unpack_mask(kept: Any, shape: tuple[int, ...]) -> Any:
    """The bool mask of ``shape`` that `pack_mask` kept as ``kept``."""
    if np.dtype(kept.dtype) == np.bool_:
        return kept
    args = (kept, 1, tuple(shape), np.dtype(np.bool_))
    return _unpack(*args) if isinstance(kept, jax.core.Tracer) else _unpack_jit(*args)


def code_bits(n_values: int) -> int:
    """Bits per element for codes 0..n_values-1 (1, 2 or 4: a divisor of 8), or 8 when
    they are kept unpacked in a byte or more."""
    return next((b for b in (1, 2, 4) if n_values <= 1 << b), 8)


def packs_codes(shape: tuple[int, ...], n_values: int, sharding: Any = None) -> bool:
    """Whether small integer codes (a max-pool's chosen window element) are kept packed,
    ``8 // code_bits`` to a byte along the last axis: the same conditions as masks, with
    a last axis at least one byte long."""
    bits = code_bits(n_values)
    return (
        bits < 8
        and len(shape) > 0
        and shape[-1] >= 8 // bits
        and math.prod(shape) * bits >= MIN_ELEMENTS
        and not _last_axis_sharded(sharding)
    )


def codes_aval(shape, n_values: int, dtype, sharding: Any = None) -> jax.ShapeDtypeStruct:
    """The aval of kept codes of ``shape`` (``dtype`` when unpacked)."""
    shape = tuple(shape)
    if packs_codes(shape, n_values, sharding):
        per = 8 // code_bits(n_values)
        return jax.ShapeDtypeStruct(shape[:-1] + (-(-shape[-1] // per),), np.uint8)
    return jax.ShapeDtypeStruct(shape, dtype)


def pack_codes(codes: Any, n_values: int) -> Any:
    """Integer ``codes`` in 0..n_values-1 as kept for backward (see `packs_codes`)."""
    if not packs_codes(tuple(codes.shape), n_values, _sharding_of(codes)):
        return codes
    bits = code_bits(n_values)
    return _pack(codes, bits) if isinstance(codes, jax.core.Tracer) else _pack_jit(codes, bits)


def unpack_codes(kept: Any, shape: tuple[int, ...], n_values: int, dtype) -> Any:
    """The codes of ``shape`` and ``dtype`` that `pack_codes` kept as ``kept``."""
    if not packs_codes(tuple(shape), n_values) or np.dtype(kept.dtype) != np.uint8:
        return kept
    args = (kept, code_bits(n_values), tuple(shape), np.dtype(dtype))
    return _unpack(*args) if isinstance(kept, jax.core.Tracer) else _unpack_jit(*args)


def _pack(x, bits):
    """Values below 2**bits (bool or integer), ``8 // bits`` to a byte along the last axis."""
    u = lax.convert_element_type(x, np.uint8)
    per = 8 // bits
    n = u.shape[-1]
    tail = -n % per
    if tail:
        u = lax.pad(u, np.uint8(0), [(0, 0, 0)] * (u.ndim - 1) + [(0, tail, 0)])
    u = lax.reshape(u, tuple(u.shape[:-1]) + ((n + tail) // per, per))
    shifts = np.arange(per, dtype=np.uint8) * np.uint8(bits)
    fields = lax.shift_left(u, lax.broadcast_in_dim(shifts, u.shape, (u.ndim - 1,)))
    # Disjoint bit fields: their sum is their bitwise or, and fits in a byte.
    return lax.reduce_sum(fields, (u.ndim - 1,))


def _unpack(packed, bits, shape, dtype):
    per = 8 // bits
    n = shape[-1]
    full = packed.shape + (per,)
    spread = lax.broadcast_in_dim(packed, full, tuple(range(packed.ndim)))
    shifts = np.arange(per, dtype=np.uint8) * np.uint8(bits)
    u = lax.shift_right_logical(spread, lax.broadcast_in_dim(shifts, full, (packed.ndim,)))
    u = lax.bitwise_and(u, np.uint8((1 << bits) - 1))
    flat = lax.reshape(u, tuple(packed.shape[:-1]) + (packed.shape[-1] * per,))
    if flat.shape[-1] != n:
        flat = lax.slice_in_dim(flat, 0, n, axis=flat.ndim - 1)
    return lax.convert_element_type(flat, dtype)


# Eagerly one dispatch per pack (the rules' backward is already one compiled call).
_pack_jit = jax.jit(_pack, static_argnums=1)
_unpack_jit = jax.jit(_unpack, static_argnums=(1, 2, 3))
