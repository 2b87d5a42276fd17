"""Store residuals in a smaller dtype; unpack restores the original dtype.

Floating residuals only: integer and boolean residuals (indices, masks) are
kept exactly, since rounding them would change the gradient's structure.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

__all__ = ["Compress", "compress", "Int8"]


class Int8(NamedTuple):
    """An int8-quantized residual: ``value ≈ q * scale`` (per tensor or per channel)."""

    q: Any
    scale: Any


class Compress:
    def __init__(self, dtype: Any, axis: int | None = None):
        self.int8 = isinstance(dtype, str) and dtype == "int8"
        self.dtype = None if self.int8 else np.dtype(dtype)
        self.axis = axis
        if not self.int8 and not jnp.issubdtype(self.dtype, jnp.floating):
            raise ValueError(f"compress: dtype must be a floating dtype or 'int8', got {dtype!r}.")

    def _applies(self, info) -> bool:
        dt = info.dtype
        if not isinstance(dt, np.dtype) or not jnp.issubdtype(dt, jnp.floating):
            return False
        target = 1 if self.int8 else self.dtype.itemsize
        return target < dt.itemsize

    def pack(self, value, info):
        if not self._applies(info):
            return value
        if not self.int8:
            if jnp.issubdtype(self.dtype, jnp.floating) and self.dtype.itemsize == 1:
                # float8 has no inf; saturate instead of overflowing to NaN.
                fmax = float(jnp.finfo(self.dtype).max)
                value = jnp.clip(value, -fmax, fmax)
            return value.astype(self.dtype)
        if self.axis is None or value.ndim == 0:
            amax = jnp.max(jnp.abs(value))
        else:
            axis = self.axis % value.ndim
            others = tuple(i for i in range(value.ndim) if i != axis)
            amax = jnp.max(jnp.abs(value), axis=others, keepdims=True)
        scale = jnp.where(amax > 0, amax / 127.0, 1.0).astype(value.dtype)
        q = jnp.clip(jnp.round(value / scale), -127, 127).astype(jnp.int8)
        return Int8(q, scale)

    def unpack(self, packed, info):
        if isinstance(packed, Int8):
            return (packed.q.astype(info.dtype) * packed.scale).astype(info.dtype)
        if not self._applies(info):
            return packed
        return packed.astype(info.dtype)

    def __repr__(self) -> str:
        name = "int8" if self.int8 else self.dtype.name
        return f"compress({name!r}{'' if self.axis is None else f', axis={self.axis}'})"


def compress(dtype: Any, axis: int | None = None) -> Compress:
    """Store floating residuals as ``dtype`` (``jnp.bfloat16``, ``jnp.float16``,
    ``jnp.float8_e4m3fn``) or ``"int8"`` with an absmax scale per tensor, or per
    channel along ``axis``.
    """
    return Compress(dtype, axis)
