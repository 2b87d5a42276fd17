"""Store residuals in a smaller dtype; unpack restores the original dtype.

Floating residuals only: integer and boolean residuals (indices, masks) are
kept exactly, since rounding them would change the gradient's structure.

``"int8"`` is absmax quantization, ``value ≈ q * scale`` with ``q`` in
[-127, 127] rounded to nearest (ties to even); scales are rounded *up* when
stored, so the absmax element is never clipped and every element's error is
at most half its scale. Why blocks by default: one scale per tensor is set by
the largest element, ~4.5σ for 65,536 Gaussian-like weights, so every other
element carries ~1% error, and those errors compound through each layer's
backward matmul (1.75e-2 relative gradient error on the 8-layer tanh MLP of
``bench/policy_bench.py``). The absmax of 16 such values is ~1.8σ, which cuts
the error ~2.5x (9e-3 there). A bfloat16 scale per 16 elements would cost
2 bytes in 16; instead each block stores a 1-byte code, its scale relative to
the tensor's largest one on a log grid of 16 steps per octave (at most 4.4%
coarser than its own absmax, at least 2^-16 of the largest), as bitsandbytes'
double quantization does: 17 bytes per 16 float32 values, ~0.27x.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tapegrad.policies._base import as_array

__all__ = ["Compress", "compress", "Int8", "Int8Blocks", "DEFAULT_BLOCK_SIZE"]

DEFAULT_BLOCK_SIZE = 16
_QMAX = 127  # symmetric: -128 is never used, so q and -q are both representable
_STEPS_PER_OCTAVE = 16
# Block scale = tensor scale * _GRID[code]: 1, 2^(-1/16), ..., 2^(-255/16).
_GRID = np.exp2(-np.arange(256) / _STEPS_PER_OCTAVE)


class Int8(NamedTuple):
    """An int8-quantized residual: ``value ≈ q * scale`` (per tensor or per channel)."""

    q: Any
    scale: Any


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Int8Blocks:
    """An int8-quantized residual with one scale per ``block_size`` consecutive
    elements of its row-major flattening (along the last axis):
    ``flat(value)[i] ≈ flat(q)[i] * block_scales(self)[i // block_size]``.

    ``q`` keeps the residual's shape (the last block may be short); ``code``
    (uint8, one per block) and ``scale`` (the largest block scale) encode the
    block scales, ``scale * 2 ** (-code / 16)``.
    """

    q: Any
    code: Any
    scale: Any
    block_size: int = field(metadata=dict(static=True))


def _grid_scales(code, top):
    return top * jnp.asarray(_GRID, top.dtype)[code.astype(jnp.int32)]


def block_scales(packed: Int8Blocks):
    """The scale of each block of an `Int8Blocks`, in the dtype of its ``scale``."""
    return _grid_scales(packed.code, packed.scale)


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    # float16/bfloat16 residuals are quantized in float32: their own precision
    # would add rounding error to the division and their range may not hold a scale.
    return np.dtype(jnp.float64) if dtype.itemsize > 4 else np.dtype(jnp.float32)


def _round_up(scale, dtype):
    """``scale`` stored as ``dtype``, rounded up so ``|value| / stored <= 127``:
    rounding it down would push the absmax element past 127 and into the clip."""
    s = scale.astype(dtype)
    return jnp.where(s.astype(scale.dtype) < scale, jnp.nextafter(s, jnp.array(jnp.inf, dtype)), s)


def _scale_for(amax):
    return jnp.where(amax > 0, amax / _QMAX, 1).astype(amax.dtype)


def _round_q(value, scale):
    return jnp.clip(jnp.round(value / scale), -_QMAX, _QMAX).astype(jnp.int8)


def _blocks(flat, block_size):
    """``flat`` zero-padded to whole blocks, as ``(n_blocks, block_size)``."""
    pad = -flat.shape[0] % block_size
    if pad:
        flat = jnp.pad(flat, (0, pad))
    return flat.reshape(-1, block_size)


# Pack and unpack are a dozen small ops each: jitted, eager backward pays one
# dispatch for them instead of a dozen (under an outer jit they are inlined).
@functools.partial(jax.jit, static_argnums=1)
def _pack_blocks(value, block_size: int) -> Int8Blocks:
    ct = _compute_dtype(value.dtype)
    blocks = _blocks(value.reshape(-1).astype(ct), block_size)
    want = _scale_for(jnp.max(jnp.abs(blocks), axis=1))
    top = jnp.max(want)
    # The finest grid point at or above each block's own scale (ratio <= 1, so
    # code 0 = the largest block always qualifies); below 2^-16 of it, code 255.
    ascending = jnp.asarray(_GRID[::-1], ct)
    code = (255 - jnp.searchsorted(ascending, want / top)).astype(jnp.uint8)
    q = _round_q(blocks, _grid_scales(code, top)[:, None])
    # Drop the padding: q has the residual's shape and bytes.
    q = q.reshape(-1)[: value.size].reshape(value.shape)
    return Int8Blocks(q, code, top, block_size)


@functools.partial(jax.jit, static_argnums=1)
def _unpack_blocks(packed: Int8Blocks, dtype):
    q = packed.q
    ct = _compute_dtype(dtype)
    blocks = _blocks(q.reshape(-1), packed.block_size).astype(ct)
    flat = (blocks * block_scales(packed).astype(ct)[:, None]).reshape(-1)
    return flat[: q.size].reshape(q.shape).astype(dtype)


@functools.partial(jax.jit, static_argnums=1)
def _pack_scaled(value, axis: int | None) -> Int8:
    """One scale per tensor (``axis=None``) or per channel along ``axis``."""
    ct = _compute_dtype(value.dtype)
    x = value.astype(ct)
    if axis is None or value.ndim == 0:
        amax = jnp.max(jnp.abs(x))
    else:
        axis = axis % value.ndim
        amax = jnp.max(
            jnp.abs(x), axis=tuple(i for i in range(value.ndim) if i != axis), keepdims=True
        )
    # A few scales per tensor: bfloat16 (float32's range) is enough; float64
    # residuals keep float32 scales.
    scale = _round_up(_scale_for(amax), jnp.float32 if ct.itemsize > 4 else jnp.bfloat16)
    return Int8(_round_q(x, scale.astype(ct)), scale)


@functools.partial(jax.jit, static_argnums=1)
def _unpack_scaled(packed: Int8, dtype):
    ct = _compute_dtype(dtype)
    return (packed.q.astype(ct) * packed.scale.astype(ct)).astype(dtype)


class Compress:
    """Floating residuals stored in ``dtype`` (or int8 blocks); see `compress`."""

    def __init__(
        self, dtype: Any, axis: int | None = None, block_size: Any = "auto", inputs: bool = False
    ):
        self.inputs = bool(inputs)
        self.int8 = isinstance(dtype, str) and dtype == "int8"
        self.dtype: Any = None if self.int8 else np.dtype(dtype)
        self.axis = axis
        if self.dtype is not None and not jnp.issubdtype(self.dtype, jnp.floating):
            raise ValueError(f"compress: dtype must be a floating dtype or 'int8', got {dtype!r}.")
        if isinstance(block_size, str) and block_size == "auto":
            block_size = DEFAULT_BLOCK_SIZE if (self.int8 and axis is None) else None
        elif block_size is not None:
            if not self.int8:
                raise ValueError(
                    f"compress({np.dtype(dtype).name!r}): block_size= applies to "
                    "'int8' only; drop it."
                )
            if axis is not None:
                raise ValueError(
                    "compress('int8'): give either axis= (one scale per channel) or "
                    "block_size= (one scale per block), not both."
                )
            if (
                isinstance(block_size, bool)
                or not isinstance(block_size, (int, np.integer))
                or block_size < 1
            ):
                raise ValueError(
                    "compress('int8'): block_size must be a positive int, or None "
                    f"for one scale per tensor; got {block_size!r}."
                )
            block_size = int(block_size)
        self.block_size = block_size

    def _applies(self, info) -> bool:
        if info.is_input and not self.inputs:
            return False  # the caller holds it: a compressed copy would only add bytes
        dt = info.dtype
        if not isinstance(dt, np.dtype) or not jnp.issubdtype(dt, jnp.floating):
            return False
        target = 1 if self.int8 else self.dtype.itemsize
        return target < dt.itemsize

    def pack(self, value, info):
        if not self._applies(info):
            return value
        value = as_array(value, info)  # an input may be a Python or numpy scalar
        if not self.int8:
            if jnp.issubdtype(self.dtype, jnp.floating) and self.dtype.itemsize == 1:
                # float8 has no inf; saturate instead of overflowing to NaN.
                fmax = float(jnp.finfo(self.dtype).max)
                value = jnp.clip(value, -fmax, fmax)
            return value.astype(self.dtype)
        if self.block_size is not None and value.size > self.block_size:
            return _pack_blocks(value, self.block_size)
        return _pack_scaled(value, self.axis)

    def unpack(self, packed, info):
        if isinstance(packed, Int8Blocks):
            return _unpack_blocks(packed, info.dtype)
        if isinstance(packed, Int8):
            return _unpack_scaled(packed, info.dtype)
        if not self._applies(info):
            return packed
        return packed.astype(info.dtype)

    def __repr__(self) -> str:
        name = "int8" if self.int8 else self.dtype.name
        extra = ""
        if self.axis is not None:
            extra = f", axis={self.axis}"
        elif self.int8 and self.block_size != DEFAULT_BLOCK_SIZE:
            extra = f", block_size={self.block_size}"
        if self.inputs:
            extra += ", inputs=True"
        return f"compress({name!r}{extra})"


def compress(
    dtype: Any, axis: int | None = None, *, block_size: Any = "auto", inputs: bool = False
) -> Compress:
    """Store floating residuals in a smaller format; backward gets the original dtype back.

    ``dtype`` is ``jnp.bfloat16``, ``jnp.float16``, ``jnp.float8_e4m3fn`` (a cast) or
    ``"int8"``: absmax quantization, by default with one scale per ``block_size=16``
    consecutive elements (each scale stored in one byte, relative to the tensor's
    largest), ~0.27x of float32's bytes. ``axis=`` gives one scale per channel along
    that axis instead, ``block_size=None`` one scale per tensor (exactly 0.25x, less
    accurate: see `tapegrad.policies.compress`'s module notes).

    Residuals that are the function's own inputs (weights, the batch) are kept as they
    are: the caller holds them anyway, so a compressed copy would add bytes, not save
    them. ``inputs=True`` compresses them too (backward then sees their rounded values).

    ```python
    tg.grad(loss, policy=tg.policies.compress("int8"))(w, x)
    ```
    """
    return Compress(dtype, axis, block_size, inputs)
