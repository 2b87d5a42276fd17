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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tapegrad.core.residual_policy import as_array
from tapegrad.policies._allocate import BitAllocation, fit_allocation
from tapegrad.policies._groups import (
    Layout,
    dim_shards,
    explicit_sharding,
    from_groups,
    layout_for,
    to_groups,
)
from tapegrad.policies._lowbit import (
    LowBit,
    key_words,
    lowbit_layout,
    pack_lowbit,
    packed_nbytes,
    reads_positive,
    residual_id,
    residual_name,
    stays_exact,
    unpack_lowbit,
)

__all__ = ["Compress", "compress", "Int8", "Int8Blocks", "LowBit", "DEFAULT_BLOCK_SIZE"]

DEFAULT_BLOCK_SIZE = 16
DEFAULT_GROUP = 128
BITS = (2, 4, 8)
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
    """An int8-quantized residual with one scale per block of ``block_size``
    consecutive elements along its rows (`tapegrad.policies._groups`: the trailing
    dimensions after the last sharded one; on one device, the whole row-major
    flattening): ``row(value)[i] ≈ row(q)[i] * block_scales(self)[..., i // block_size]``.

    ``q`` keeps the residual's shape and sharding (a row's last block may be short);
    ``code`` (uint8, one per block, shaped ``(*lead, blocks)``, sharded like the
    residual's leading dimensions) and ``scale`` (the largest block scale) encode the
    block scales, ``scale * 2 ** (-code / 16)``.
    """

    q: Any
    code: Any
    scale: Any
    block_size: int = field(metadata=dict(static=True))


def _grid(code, dtype):
    # A gather from a replicated table: under Explicit mesh axes it must be told to
    # give its result the codes' sharding.
    table = jnp.asarray(_GRID, dtype)
    return table.at[code.astype(jnp.int32)].get(out_sharding=explicit_sharding(code))


def _grid_scales(code, top):
    return top * _grid(code, top.dtype)


def _grid_code(ratio):
    """The largest code whose grid point is at or above ``ratio`` (in (0, 1]): the
    finest scale that does not clip. Below 2^-16 of the top, code 255.

    (``jnp.searchsorted`` on the grid says the same, but it cannot take sharded
    queries under Explicit mesh axes.) The logarithm lands within one code of the
    answer; two comparisons with the grid itself make it exact.
    """
    c = jnp.clip(jnp.floor(-_STEPS_PER_OCTAVE * jnp.log2(ratio)), 0, 255).astype(jnp.int32)
    c = jnp.where(_grid(c, ratio.dtype) < ratio, c - 1, c)
    up = jnp.minimum(c + 1, 255)
    c = jnp.where((c < 255) & (_grid(up, ratio.dtype) >= ratio), up, c)
    return c.astype(jnp.uint8)


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


def _block_layout(value, block_size: int) -> Layout:
    return layout_for(value.shape, dim_shards(value), block_size)


def _packed_layout(packed: Int8Blocks) -> Layout:
    shape, lead = tuple(packed.q.shape), packed.code.ndim - 1
    row = int(np.prod(shape[lead:], dtype=np.int64))
    g = packed.block_size
    return Layout(shape, lead, row, packed.code.shape[-1], g, g)


# Pack and unpack are a dozen small ops each: jitted, eager backward pays one
# dispatch for them instead of a dozen (under an outer jit they are inlined).
@functools.partial(jax.jit, static_argnums=1)
def _pack_blocks(value, lay: Layout) -> Int8Blocks:
    ct = _compute_dtype(value.dtype)
    blocks = to_groups(value.astype(ct), lay, edge=False)
    want = _scale_for(jnp.max(jnp.abs(blocks), axis=-1))
    top = jnp.max(want)
    # The finest grid point at or above each block's own scale (ratio <= 1, so
    # code 0 = the largest block always qualifies); below 2^-16 of it, code 255.
    code = _grid_code(want / top)
    q = _round_q(blocks, _grid_scales(code, top)[..., None])
    # Drop the padding: q has the residual's shape, bytes and sharding.
    return Int8Blocks(from_groups(q, lay), code, top, lay.group)


@functools.partial(jax.jit, static_argnums=1)
def _unpack_blocks(packed: Int8Blocks, dtype):
    lay = _packed_layout(packed)
    ct = _compute_dtype(dtype)
    blocks = to_groups(packed.q, lay, edge=False).astype(ct)
    return from_groups(blocks * block_scales(packed).astype(ct)[..., None], lay).astype(dtype)


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


def _check_bits_args(bits, group, key, axis, block_size) -> None:
    if isinstance(bits, bool) or not (bits in BITS or bits == "auto"):
        raise ValueError(f"compress: bits must be one of {BITS} or 'auto', got {bits!r}.")
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1:
        raise ValueError(f"compress(bits={bits}): group must be a positive int, got {group!r}.")
    if axis is not None or not (isinstance(block_size, str) and block_size == "auto"):
        raise ValueError(
            f"compress(bits={bits}): axis= and block_size= apply to 'int8'; "
            "bits= takes group= (values per min/scale) instead."
        )
    if key is not None and not isinstance(key, (int, np.integer)):
        dt = getattr(key, "dtype", None)
        if dt is None or not (
            jnp.issubdtype(dt, jax.dtypes.prng_key) or (dt == jnp.uint32 and key.shape == (2,))
        ):
            raise TypeError(
                f"compress(bits={bits}): key must be an int seed or a jax PRNG key "
                f"(jax.random.key(0)), got {type(key).__name__}."
            )


class Compress:
    """Floating residuals stored in ``dtype``, int8 blocks or ``bits``-bit groups; see
    `compress`."""

    def __init__(
        self,
        dtype: Any = None,
        axis: int | None = None,
        block_size: Any = "auto",
        inputs: bool = False,
        *,
        bits: int | str | None = None,
        group: int = DEFAULT_GROUP,
        key: Any = None,
        budget_bits: float | None = None,
        allocation: Any = None,
    ):
        self.inputs = bool(inputs)
        self.bits, self.group, self.key = bits, group, key
        self.dtype: Any = None
        self.allocation = _check_allocation(bits, allocation)
        if budget_bits is None and allocation is not None:
            budget_bits = allocation.budget_bits
        self.budget_bits = _check_budget_bits(bits, budget_bits)
        if bits is not None:
            if dtype is not None:
                raise ValueError(
                    f"compress: give a dtype ({dtype!r}) or bits= ({bits!r}), not both."
                )
            _check_bits_args(bits, group, key, axis, block_size)
            self.int8, self.axis, self.block_size = False, None, None
            self.group = int(group)
            return
        if dtype is None:
            raise ValueError(
                "compress: give a dtype (jnp.bfloat16, 'int8', ...) or bits=2, 4 or 8."
            )
        self.int8 = isinstance(dtype, str) and dtype == "int8"
        self.dtype = None if self.int8 else np.dtype(dtype)
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
        if self.bits is not None:
            return True  # pack checks the bytes against the group overhead
        target = 1 if self.int8 else self.dtype.itemsize
        return target < dt.itemsize

    def keeps_exact(self, info) -> bool:
        """Whether every residual like ``info`` reaches backward unchanged, whichever
        record keeps it: integers and booleans, inputs (unless ``inputs=True``), values
        whose dtype is no larger than the target. (Divisors kept exact under ``bits=``
        are not counted: that depends on the record reading them.) Under ``bits=``, also
        what ``info``'s record reads when that is only where the value is positive
        (`Saved.reads_positive`: relu's mask off its output): the low-bit codes keep
        zeros zero and positives positive for it (`_lowbit`'s zero-exact codes)."""
        if self.bits is not None and getattr(info.saved, "reads_positive", False):
            return True
        return not self._applies(info)

    def fit(
        self,
        fun: Any,
        *args: Any,
        argnums: int | Sequence[int] = 0,
        samples: int = 4,
        probe_bits: int = 2,
        seed: int = 0,
    ) -> Compress:
        """This ``bits="auto"`` policy with a bit width per residual of ``fun(*args)``:
        a new policy (this one is left as it is), for `tg.grad(fun, argnums, policy=...)`
        of the same function, eagerly, under `jax.jit`, `jax.vmap` or in a scan.

        Each residual is rounded alone at ``probe_bits`` under ``samples`` keys (one
        compiled program, ``len(residuals) * samples`` gradients of ``fun``); its mean
        squared distance from the exact gradient gives its sensitivity, and the widths
        (2, 4, 8 bits or kept as it is) minimise the predicted gradient error under
        ``budget_bits`` a value on average (`tapegrad.policies._allocate`). The result's
        ``allocation`` says what was chosen (``print`` it; ``.bits`` maps residual names
        to widths); `tg.memory_report` shows each row's bits.
        """
        if self.bits != "auto":
            raise ValueError(f"{self!r}.fit: only compress(bits='auto', ...) is fitted.")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"compress.fit: samples must be a positive int, got {samples!r}.")
        if probe_bits not in BITS:
            raise ValueError(f"compress.fit: probe_bits must be one of {BITS}, got {probe_bits!r}.")
        alloc = fit_allocation(
            self, fun, args, argnums, float(self.budget_bits or 0), samples, probe_bits, seed
        )
        return Compress(
            bits="auto",
            group=self.group,
            key=self.key,
            inputs=self.inputs,
            budget_bits=self.budget_bits,
            allocation=alloc,
        )

    def _auto_bits(self, info) -> int:
        if self.allocation is None:
            raise ValueError(
                f"{self!r} has no bit allocation yet: call policy = policy.fit(f, *args, "
                "argnums=...) with the function you differentiate (a few gradients of it "
                "measure each residual's sensitivity), then use the policy it returns."
            )
        name = residual_name(info)
        bits = self.allocation.bits.get(name)
        if bits is None:
            raise ValueError(
                f"compress(bits='auto'): residual {name}, {info}, was not seen by fit(); "
                "fit the policy on the function (and argnums) you differentiate with it."
            )
        return bits

    def pack(self, value, info):
        if not self._applies(info):
            return value
        value = as_array(value, info)  # an input may be a Python or numpy scalar
        if self.bits is not None:
            if stays_exact(info):  # a divisor, or a recomputed segment's input
                return value
            bits = self._auto_bits(info) if self.bits == "auto" else self.bits
            if bits >= np.dtype(value.dtype).itemsize * 8:
                return value  # the allocation keeps it as it is
            lay = lowbit_layout(value, bits, self.group)
            if packed_nbytes(lay, bits, value.dtype) >= info.nbytes:
                return value  # a few values: min and scale would cost more than they save
            words = key_words(0 if self.key is None else self.key)
            rid = residual_id(info)
            positive = reads_positive(info)
            return pack_lowbit(value, words, rid, bits=bits, lay=lay, positive=positive)
        if not self.int8:
            if jnp.issubdtype(self.dtype, jnp.floating) and self.dtype.itemsize == 1:
                # float8 has no inf; saturate instead of overflowing to NaN.
                fmax = float(jnp.finfo(self.dtype).max)
                value = jnp.clip(value, -fmax, fmax)
            return value.astype(self.dtype)
        if self.block_size is not None and value.size > self.block_size:
            return _pack_blocks(value, _block_layout(value, self.block_size))
        return _pack_scaled(value, self.axis)

    def unpack(self, packed, info):
        if isinstance(packed, LowBit):
            return unpack_lowbit(packed, info.dtype)
        if isinstance(packed, Int8Blocks):
            return _unpack_blocks(packed, info.dtype)
        if isinstance(packed, Int8):
            return _unpack_scaled(packed, info.dtype)
        if getattr(packed, "dtype", info.dtype) == info.dtype:
            return packed  # left as it was (an integer, an input, a few values)
        return packed.astype(info.dtype)

    def __repr__(self) -> str:
        if self.bits is not None:
            args = [f"bits={self.bits!r}"]
            if self.budget_bits is not None:
                args.append(f"budget_bits={self.budget_bits:g}")
            if self.group != DEFAULT_GROUP:
                args.append(f"group={self.group}")
            if self.key is not None:
                args.append(f"key={self.key!r}" if isinstance(self.key, int) else "key=...")
            if self.inputs:
                args.append("inputs=True")
            text = f"compress({', '.join(args)})"
            if self.allocation is not None:
                a = self.allocation
                text += f".fit(...): {a.average_bits:.2f} bits a value over {len(a.rows)} residuals"
            return text
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
    dtype: Any = None,
    axis: int | None = None,
    *,
    bits: int | str | None = None,
    budget_bits: float | None = None,
    allocation: Any = None,
    group: int = DEFAULT_GROUP,
    key: Any = None,
    block_size: Any = "auto",
    inputs: bool = False,
) -> Compress:
    """Store floating residuals in a smaller format; backward gets the original dtype back.

    ``dtype`` is ``jnp.bfloat16``, ``jnp.float16``, ``jnp.float8_e4m3fn`` (a cast) or
    ``"int8"``: absmax quantization, by default with one scale per ``block_size=16``
    consecutive elements (each scale stored in one byte, relative to the tensor's
    largest), ~0.27x of float32's bytes. ``axis=`` gives one scale per channel along
    that axis instead, ``block_size=None`` one scale per tensor (exactly 0.25x, less
    accurate: see `tapegrad.policies.compress`'s module notes).

    ``bits=2``, ``4`` or ``8`` (instead of a dtype): per-group min/scale quantization
    with unbiased stochastic rounding (ActNN), ``group=128`` consecutive values per
    bfloat16 min and scale, the codes bit-packed into uint8: ~0.070x (2 bits), ~0.133x
    (4), ~0.258x (8) of float32's bytes. Each value is off by less than its group's
    scale, and right on average: the noise is drawn from ``key=`` (an int seed or a
    `jax.random.key`; default seed 0) folded with the residual's id and data, so it is
    reproducible and differs between residuals (see `tapegrad.policies._lowbit`).
    Residuals that backward divides by (log's input, a divisor, sqrt's output) are kept
    exact: the mean of ``1 / x`` over a rounding is not ``1 / x``, so rounding them would
    bias the gradient.

    ``bits="auto", budget_bits=3.0``: a width per residual (2, 4, 8 bits, or kept as it
    is) averaging at most ``budget_bits`` a value, more bits where the gradient is more
    sensitive to rounding (GACT). The widths are measured on your function first:
    ``policy = compress(bits="auto", budget_bits=3.0).fit(loss, params, x)`` (see
    `Compress.fit`); an unfitted ``"auto"`` policy raises ``ValueError`` when it packs.
    ``allocation=`` reuses a fitted one's (``policy.allocation``), e.g. with a key that
    changes every step: ``compress(bits="auto", allocation=alloc, key=step_key)``.

    Groups and blocks run along rows and never cross a shard: packed residuals keep
    the sharding of the value they stand for, and gradients keep jax.grad's.

    Residuals that are the function's own inputs (weights, the batch) are kept as they
    are: the caller holds them anyway, so a compressed copy would add bytes, not save
    them. ``inputs=True`` compresses them too (backward then sees their rounded values).

    ```python
    tg.grad(loss, policy=tg.policies.compress("int8"))(w, x)
    tg.grad(loss, policy=tg.policies.compress(bits=2, key=jax.random.key(1)))(w, x)
    ```
    """
    return Compress(
        dtype,
        axis,
        block_size,
        inputs,
        bits=bits,
        group=group,
        key=key,
        budget_bits=budget_bits,
        allocation=allocation,
    )


def _check_allocation(bits: Any, allocation: Any) -> Any:
    if allocation is None:
        return None
    if bits != "auto" or isinstance(bits, bool):
        raise ValueError(
            f"compress: allocation= goes with bits='auto' (got bits={bits!r}); drop it."
        )
    if not isinstance(allocation, BitAllocation):
        raise TypeError(
            "compress(bits='auto'): allocation must be the BitAllocation of a fitted "
            f"policy (policy.fit(f, *args).allocation), got {type(allocation).__name__}."
        )
    return allocation


def _check_budget_bits(bits: Any, budget_bits: Any) -> float | None:
    if bits != "auto" or isinstance(bits, bool):
        if budget_bits is not None:
            raise ValueError(
                f"compress: budget_bits= goes with bits='auto' (got bits={bits!r}); drop it "
                "or ask for bits='auto'."
            )
        return None
    if budget_bits is None:
        raise ValueError(
            "compress(bits='auto'): give budget_bits=, the average bits a value to spend "
            "(at least 2), e.g. compress(bits='auto', budget_bits=3.0)."
        )
    if isinstance(budget_bits, bool) or not isinstance(budget_bits, (int, float, np.number)):
        raise ValueError(f"compress: budget_bits must be a number, got {budget_bits!r}.")
    if not np.isfinite(budget_bits) or budget_bits < BITS[0]:
        raise ValueError(
            f"compress: budget_bits must be at least {BITS[0]} (every residual at "
            f"{BITS[0]} bits), got {budget_bits!r}."
        )
    return float(budget_bits)
