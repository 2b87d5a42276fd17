"""``compress(bits=2 | 4 | 8)``: per-group min/scale quantization with unbiased
stochastic rounding (ActNN's scheme), the codes bit-packed into uint8.

Each group of at most ``group`` consecutive values along a row (see
`tapegrad.policies._groups`: rows never mix shards) keeps its minimum ``low`` and a
step ``scale = (max - low) / (2**bits - 1)``; each value becomes

    q = floor((x - low) / scale + u),   u ~ U[0, 1)

so ``E[q] = (x - low) / scale`` and the dequantized ``low + q * scale`` is ``x`` on
average (stochastic rounding is unbiased where round-to-nearest is not: its errors
do not pile up through a network's backward). One value is off by less than one
``scale``. ``low`` and ``scale`` are stored in bfloat16 (float32 for float64
residuals): ``low`` rounded *down* and ``scale`` rounded *up*, so every value of the
group still lies in ``[low, low + (2**bits - 1) * scale]`` and nothing is clipped;
the cost is a range at most ``|min| * 2**-7`` wider than the group's own (and a
``scale`` at most ``2**-7`` coarser). Per group of 128 float32 values: 2-bit codes
take 32 bytes, 4-bit 64, 8-bit 128, plus 4 bytes of ``low`` and ``scale``
(~0.070x, ~0.133x, ~0.258x of the 512 float32 bytes).

Zero-exact codes (``positive``), for a value ``>= 0`` whose zeros backward reads (relu's
mask ``y > 0`` read off its output ``y`` instead of kept, `Saved.reads_positive`): code 0
is exactly 0 and codes ``1 .. 2**bits - 1`` run from the group's least positive value
``low`` to its max, with ``scale = (max - low) / (2**bits - 2)``. Positives never round
to 0, so the mask read off the rounded value is relu's own; the price is one level fewer
for the positives (at 2 bits, three levels instead of four), the saving 1 bit a value of
mask.

The noise. ``u`` comes from a counter-based hash of each value's position, seeded
by a 32-bit hash of the policy's key, the residual's id (its record's index, the
enclosing loops' indices, which of the record's values) and a digest of the
residual's group minima and maxima. Each hash step is a bijection, so for a fixed
position ``u`` is exactly uniform over (uniformly random) keys; the same key and
data give the same codes (reproducible); two residuals, or one residual in two
training steps whose data differ, get different noise. A loop body
packs its residuals once per step and the residual's id takes the step's index
(``ResidualInfo.steps``), so two steps that see bit-identical data still get
independent noise (summed over steps, their errors average out instead of adding
up in one direction). Why a hash and not ``jax.random.bits`` for
every value: threefry costs ~4x more per value than the rest of the packing on CPU,
and adds ~0.5 s of compile to every program that packs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tapegrad.policies._groups import (
    Layout,
    dim_shards,
    explicit_sharding,
    from_groups,
    layout_for,
    to_groups,
)

__all__ = [
    "LowBit",
    "pack_lowbit",
    "unpack_lowbit",
    "lowbit_layout",
    "residual_id",
    "residual_name",
    "residual_path",
    "key_words",
    "read_through_a_pole",
    "stays_exact",
    "pole",
    "reads_positive",
]

_KINDS = {"in": 0, "out": 1}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LowBit:
    """A residual quantized to ``bits`` per value: ``words`` (uint8, ``8 // bits`` codes
    per byte, shaped ``(*lead, groups, size * bits // 8)``), and per group ``low`` and
    ``scale`` (shaped ``(*lead, groups)``): value ``≈ low + q * scale``. Every array keeps
    the residual's leading dimensions and their sharding."""

    words: Any
    low: Any
    scale: Any
    bits: int = field(metadata=dict(static=True))
    layout: Layout = field(metadata=dict(static=True))
    # Zero-exact codes (`pack_lowbit`'s ``positive``): code 0 is 0, codes 1.. from ``low``.
    positive: bool = field(default=False, metadata=dict(static=True))

    def codes(self):
        """The codes ``q`` as uint8, shaped ``(*lead, groups, size)``."""
        return _unpack_bits(self.words, self.bits)


def _compute_dtype(dtype) -> np.dtype:
    return np.dtype(jnp.float64) if np.dtype(dtype).itemsize > 4 else np.dtype(jnp.float32)


def _stats_dtype(ct: np.dtype) -> Any:
    return jnp.float32 if ct.itemsize > 4 else jnp.bfloat16


def lowbit_layout(value, bits: int, group: int) -> Layout:
    return layout_for(value.shape, dim_shards(value), group, per_byte=8 // bits)


def packed_nbytes(lay: Layout, bits: int, dtype) -> int:
    stats = np.dtype(_stats_dtype(_compute_dtype(dtype))).itemsize
    rows = int(np.prod(lay.lead_shape, dtype=np.int64))
    return rows * lay.groups * (lay.size * bits // 8 + 2 * stats)


def residual_path(info) -> tuple:
    """Which residual ``info`` describes, the same in every trace of one function: the
    indices of the loop records it runs in, its record's index, which of the record's
    values (``"in"`` / ``"out"`` / ``"aux"``, index). A value several records keep is
    packed once, with its first saver's info, so it has one path."""
    path: list = [int(getattr(r, "index", 0)) for r in getattr(info, "loops", ())]
    rec, saved = getattr(info, "record", None), getattr(info, "saved", None)
    if rec is not None:
        path.append(int(rec.index))
    if saved is not None:
        path += [saved.kind, int(saved.index)]
    return tuple(path)


def residual_name(info) -> str:
    """`residual_path` as text: ``#3 out0``, or ``#5/#2 in1`` for record #2 of the body
    of loop record #5."""
    path = residual_path(info)
    if len(path) < 3 or not isinstance(path[-2], str):
        return "/".join(f"#{i}" for i in path)
    recs = "/".join(f"#{i}" for i in path[:-2])
    return f"{recs} {path[-2]}{path[-1]}"


def residual_id(info):
    """A uint32 naming a residual within one traced function (FNV-1a over its
    `residual_path`), then mixed with its step in each enclosing loop (``info.steps``:
    traced inside a traced scan, so the result is then a traced uint32). A traced
    argument of the packing, not a static one: one compile serves every residual and
    every step."""
    h = 0x811C9DC5
    for i in residual_path(info):
        i = _KINDS.get(i, 2) if isinstance(i, str) else i
        h = ((h ^ (i & 0xFFFFFFFF)) * 0x01000193) & 0xFFFFFFFF
    out: Any = np.uint32(h)
    for t in getattr(info, "steps", ()):
        # _mix is a bijection: distinct steps of one residual get distinct ids.
        out = _mix(jnp.asarray(out, jnp.uint32) ^ jnp.asarray(t).astype(jnp.uint32))
    return out


# (primitive, kind, index) of residuals whose rule's backward divides by them (or takes
# a root or logarithm with a pole): g / x for log's input, g / y for div's divisor, ...
# Stochastic rounding is unbiased for the value, but E[1 / x_hat] > 1 / x (Jensen): the
# bias grows like Var / x^2 with no bound near the pole, and does not average out over
# steps. Measured on bench/accuracy_study.py's CNN: compressing log_softmax's one
# (128, 1) log input at 2 bits left the gradient's mean over keys as far from jax.grad
# as one key's (biased) and cost 4.6 points of test accuracy; kept exact, 0.44 (3 seeds).
_POLES = frozenset(
    {
        ("log", "in", 0),
        ("log1p", "in", 0),
        ("div", "in", 1),
        ("sqrt", "out", 0),
        ("pow", "in", 0),
        ("asin", "in", 0),
        ("acos", "in", 0),
        ("acosh", "in", 0),
        ("atanh", "in", 0),
        ("atan2", "in", 0),
        ("atan2", "in", 1),
    }
)


def read_through_a_pole(info) -> bool:
    """Whether backward divides by this residual (see `_POLES`), through any of the
    records that keep it (``info.savers``: the value is packed once, with its first
    saver's info; a matmul may keep it before a log does): rounding it would bias the
    gradient, so low-bit compression keeps it exact."""
    return any(pole(rec, saved) for rec, saved in info.savers)


def stays_exact(info) -> bool:
    """Whether low-bit compression keeps this residual as it is: backward divides by it
    (`read_through_a_pole`: rounding would bias the gradient), or re-runs records from
    it (``info.segment_input``: every recomputed value would carry the rounding, through
    nonlinear records, where it is no longer right on average)."""
    return read_through_a_pole(info) or info.segment_input


def pole(rec, saved) -> bool:
    """Whether ``rec``'s backward divides by its residual ``saved`` (`_POLES`)."""
    prim = getattr(rec, "primitive", None)
    if rec is None or prim is None or saved is None:
        return False
    if prim == "integer_pow":
        return saved.kind == "in" and int(rec.params.get("y", 0)) < 0
    return (prim, saved.kind, int(saved.index)) in _POLES


def reads_positive(info) -> bool:
    """Whether a record keeping this residual reads only where it is positive
    (`Saved.reads_positive`: relu's mask off its output): packed with zero-exact codes."""
    return any(getattr(s, "reads_positive", False) for _, s in info.savers)


def key_words(key):
    """The policy's ``key=`` (an int seed, a typed PRNG key, or raw uint32 key data) as
    uint32 words: an int seed gives the words of ``jax.random.key(seed)``."""
    if isinstance(key, (int, np.integer)):
        seed = int(key) % 2**64
        return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return key.reshape(-1)


def _round(x, dtype, up: bool):
    """``x`` stored as ``dtype``, rounded up (or down) rather than to nearest."""
    s = x.astype(dtype)
    back = s.astype(x.dtype)
    if up:
        return jnp.where(back < x, jnp.nextafter(s, jnp.array(jnp.inf, dtype)), s)
    return jnp.where(back > x, jnp.nextafter(s, jnp.array(-jnp.inf, dtype)), s)


def _digest(*arrays):
    """A uint32 summary of the arrays' bits (wrapping sums)."""
    out = jnp.uint32(0)
    for i, a in enumerate(arrays):
        bits = jax.lax.bitcast_convert_type(a.astype(jnp.float32), jnp.uint32)
        out = out * jnp.uint32(0x01000193) + jnp.sum(bits, dtype=jnp.uint32) + jnp.uint32(i)
    return out


def _mix(h):
    """lowbias32 (Chris Wellons' integer hash): a bijection of uint32 with good
    avalanche, ~6 integer ops."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def _seed(words, rid, digest):
    """One uint32 from the key's words, the residual's id and its data's digest. Each
    step is a bijection of the first key word, so a uniformly random key gives a
    uniformly random seed (no threefry: it costs ~0.5 s of compile per program)."""
    h = rid
    for i in range(words.shape[0]):
        h = _mix(h ^ words[i])
    return _mix(h + digest)


def _uniform(seed, like):
    """U[0, 1) per element of ``like`` (24 bits), from a hash of each element's
    position (lowbias32, a bijection of uint32) seeded by ``seed``."""
    shape, sharding = like.shape, explicit_sharding(like)
    pos = None
    stride = 1
    for d in reversed(range(len(shape))):
        i = jax.lax.broadcasted_iota(jnp.uint32, shape, d, out_sharding=sharding)
        term = i if stride == 1 else i * jnp.uint32(stride % 2**32)
        pos = term if pos is None else pos + term
        stride *= shape[d]
    h = _mix(pos * jnp.uint32(0x9E3779B9) + seed)
    return (h >> 8).astype(like.dtype) * like.dtype.type(2.0**-24)


def _pack_bits(q, bits: int):
    per = 8 // bits
    if per == 1:
        return q
    q = q.reshape(*q.shape[:-1], q.shape[-1] // per, per)
    words = q[..., 0]
    for i in range(1, per):
        words = words | (q[..., i] << jnp.uint8(i * bits))
    return words


def _unpack_bits(words, bits: int):
    per = 8 // bits
    if per == 1:
        return words
    mask = jnp.uint8(2**bits - 1)
    parts = [(words >> jnp.uint8(i * bits)) & mask for i in range(per)]
    q = jnp.stack(parts, axis=-1)
    return q.reshape(*words.shape[:-1], words.shape[-1] * per)


@functools.partial(jax.jit, static_argnames=("bits", "lay", "positive"))
def pack_lowbit(value, words, rid, *, bits: int, lay: Layout, positive: bool = False) -> LowBit:
    ct = _compute_dtype(value.dtype)
    sd = _stats_dtype(ct)
    levels = 2**bits - 1
    x = to_groups(value.astype(ct), lay)  # edge-padded: the padding is no group's extreme
    hi = jnp.max(x, axis=-1)
    if positive:
        # Zero-exact codes for a value >= 0 whose positives backward reads (relu's mask
        # off its output): code 0 is exactly 0, codes 1..levels run from the group's
        # least positive value to its max, so positives stay positive. One level fewer
        # for the positives. ``low`` is at least the smallest normal number (a positive
        # below it comes back as it: a bias under 2**-126). A NaN counts as positive
        # and makes low NaN: it and the group's positives decode to NaN (as every value
        # of its group does in the plain codes), never to 0.
        pos = ~(x <= 0)
        lo = jnp.min(jnp.where(pos, x, hi[..., None]), axis=-1)  # hi = 0 if none is
        low = jnp.maximum(_round(lo, sd, up=False), jnp.asarray(jnp.finfo(sd).tiny, sd))
        levels -= 1
    else:
        lo = jnp.min(x, axis=-1)
        low = _round(lo, sd, up=False)
    seed = _seed(jnp.asarray(words, jnp.uint32), jnp.uint32(rid), _digest(lo, hi))
    step = (hi - low.astype(ct)) / levels
    scale = _round(jnp.where(step > 0, step, 1), sd, up=True)
    t = (x - low.astype(ct)[..., None]) / scale.astype(ct)[..., None]
    # Up with probability frac(t): floor(t + u) would round t + u itself (one ulp of t
    # is 2^-16 at t ~ 255), this compares in [0, 1) (bias under 2^-24 of a step).
    whole = jnp.floor(t)
    r = whole + (_uniform(seed, t) < t - whole).astype(ct)
    r = jnp.where(r > 0, jnp.minimum(r, levels), 0)  # NaN -> 0: a cast of NaN is undefined
    q = jnp.where(pos, r + 1, 0) if positive else r
    return LowBit(_pack_bits(q.astype(jnp.uint8), bits), low, scale, bits, lay, positive)


@functools.partial(jax.jit, static_argnums=1)
def unpack_lowbit(packed: LowBit, dtype):
    ct = _compute_dtype(dtype)
    q = packed.codes().astype(ct)
    low, scale = packed.low.astype(ct)[..., None], packed.scale.astype(ct)[..., None]
    if packed.positive:
        x = jnp.where(q > 0, low + (q - 1) * scale, 0)
    else:
        x = low + q * scale
    return from_groups(x, packed.layout).astype(dtype)
