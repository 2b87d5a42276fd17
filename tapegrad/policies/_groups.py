"""Groups of consecutive values along a residual's rows, laid out so sharding survives.

Block quantizers (``compress("int8")``, ``compress(bits=...)``) keep one scale per
group of consecutive values. Grouping the row-major flattening of a sharded array
would mix values that live on different devices: under `jax.jit` XLA then gathers
the whole array, under Explicit mesh axes the flattening reshape is a type error.
So groups run along *rows* and a group never crosses a shard:

* the row is the product of the trailing dimensions after the last sharded one
  (``(B@data, H, W, C)``: rows of ``H*W*C``); those merges and the split of the row
  into ``(groups, group)`` keep every sharded dimension where it was;
* when the last dimension itself is sharded, the row is that dimension and the
  group length divides one shard's length, so the ``groups`` axis takes the
  dimension's sharding and each device quantizes its own slice;
* when the sharding cannot be known (a tracer under `jax.jit` with Auto mesh axes,
  or with several devices and no mesh set) the row is the last dimension: XLA's
  sharding propagation carries the layout through, the rows never mix.

On one device every dimension is unsharded, so the row is the whole array.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Layout",
    "layout_for",
    "to_groups",
    "from_groups",
    "dim_shards",
    "type_shards",
    "explicit_sharding",
]


def _explicit_mesh(mesh) -> bool:
    types = getattr(mesh, "axis_types", ())
    return bool(types) and all(t == jax.sharding.AxisType.Explicit for t in types)


def explicit_sharding(x):
    """``x``'s sharding as a type (to pass as ``out_sharding=``) under Explicit mesh
    axes, else None (Auto axes and no mesh: XLA places the value)."""
    try:
        s = jax.typeof(x).sharding
    except Exception:  # noqa: BLE001 - no abstract sharding: nothing to preserve
        return None
    mesh = getattr(s, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True) or not _explicit_mesh(mesh):
        return None
    return s


def dim_shards(x) -> tuple[int, ...] | None:
    """How many shards each dimension of ``x`` is split into, or None when unknown."""
    shape = tuple(x.shape)
    if jax.device_count() == 1:
        return (1,) * len(shape)
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        try:
            local = x.sharding.shard_shape(shape)
        except Exception:  # noqa: BLE001 - a sharding that cannot say
            return None
        return tuple(n // s if s else 1 for n, s in zip(shape, local))
    try:
        s = jax.typeof(x).sharding
    except Exception:  # noqa: BLE001
        return None
    return type_shards(shape, s)


def type_shards(shape: tuple[int, ...], s: Any) -> tuple[int, ...] | None:
    """`dim_shards` of a value of ``shape`` whose type's sharding is ``s`` (Explicit
    mesh axes split it; Auto axes, or no mesh, leave it to XLA: None)."""
    if jax.device_count() == 1:
        return (1,) * len(shape)
    mesh = getattr(s, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True):
        return None  # several devices, no mesh in the type: XLA decides
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    if any(t == jax.sharding.AxisType.Auto for t in types.values()):
        return None
    spec = tuple(s.spec) + (None,) * (len(shape) - len(s.spec))
    out = []
    for entry in spec:
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        k = 1
        for n in names:
            if types.get(n) == jax.sharding.AxisType.Explicit:
                k *= mesh.shape[n]
        out.append(k)
    return tuple(out)


@dataclass(frozen=True)
class Layout:
    """``shape`` seen as ``(*shape[:lead], groups, size)``: the trailing dimensions merged
    into rows of ``row`` values, each row padded to ``groups * group`` and cut into
    groups of ``group`` values, each group padded to ``size`` (a multiple of the values
    per byte a bit-packing needs)."""

    shape: tuple[int, ...]
    lead: int  # dimensions kept before the row
    row: int
    groups: int
    group: int
    size: int

    @property
    def lead_shape(self) -> tuple[int, ...]:
        return self.shape[: self.lead]

    @property
    def grouped_shape(self) -> tuple[int, ...]:
        return (*self.lead_shape, self.groups, self.size)


def _largest_divisor_at_most(n: int, cap: int, multiple: int) -> int:
    """The largest divisor of ``n`` at most ``cap``, a multiple of ``multiple`` if one is."""
    divs = {c for d in range(1, math.isqrt(n) + 1) if n % d == 0 for c in (d, n // d)}
    divs = {d for d in divs if d <= cap}
    good = [d for d in divs if d % multiple == 0]
    return max(good) if good else max(divs)


def layout_for(shape, shards: tuple[int, ...] | None, group: int, per_byte: int = 1) -> Layout:
    """The grouping of an array of ``shape`` with ``shards`` per dimension (see the
    module notes); groups hold at most ``group`` values, balanced along the row."""
    shape = tuple(int(n) for n in shape)
    ndim = len(shape)
    if ndim == 0:
        lead, row = 0, 1
        sharded_row = 1
    elif shards is None:
        lead, row, sharded_row = ndim - 1, shape[-1], 1
    else:
        last = max((d for d in range(ndim) if shards[d] > 1), default=-1)
        if last == ndim - 1:
            lead, row, sharded_row = ndim - 1, shape[-1], shards[-1]
        else:
            lead = last + 1
            row, sharded_row = int(np.prod(shape[lead:], dtype=np.int64)), 1
    if sharded_row > 1 and row % sharded_row == 0:
        # Groups inside one shard: the group length divides the shard's length.
        g = _largest_divisor_at_most(row // sharded_row, group, per_byte)
        groups = row // g
    else:
        groups = max(1, -(-row // group))
        g = -(-row // groups)  # balanced: the padding is under one value per group
    size = -(-g // per_byte) * per_byte
    return Layout(shape, lead, row, groups, g, size)


def _pad_last(x, n: int):
    """``x`` padded along its last axis by ``n`` copies of its last value (edge
    padding: a group's min and max stay its own)."""
    if n == 0:
        return x
    return jnp.concatenate([x, jnp.repeat(x[..., -1:], n, axis=-1)], axis=-1)


def to_groups(x, lay: Layout, edge: bool = True):
    """``x`` (of ``lay.shape``) as ``lay.grouped_shape``, padded (edge or zeros)."""
    x = x.reshape(*lay.lead_shape, lay.row)
    pad = lay.groups * lay.group - lay.row
    if pad:
        x = _pad_last(x, pad) if edge else jnp.pad(x, [(0, 0)] * lay.lead + [(0, pad)])
    x = x.reshape(*lay.lead_shape, lay.groups, lay.group)
    pad = lay.size - lay.group
    if pad:
        x = _pad_last(x, pad) if edge else jnp.pad(x, [(0, 0)] * (lay.lead + 1) + [(0, pad)])
    return x


def from_groups(x, lay: Layout):
    """Inverse of `to_groups`: drop the padding, give back ``lay.shape``."""
    if lay.size != lay.group:
        x = x[..., : lay.group]
    x = x.reshape(*lay.lead_shape, lay.groups * lay.group)
    if lay.groups * lay.group != lay.row:
        x = x[..., : lay.row]
    return x.reshape(lay.shape)
