"""Reductions, cumulative reductions and sort.

What each rule keeps for backward, and why:

* ``reduce_max`` / ``reduce_min``: a boolean mask of the elements equal to the
  result (derived in forward and bit-packed: 1 bit per element instead of the
  input and the output). The cotangent is split equally among tied extrema, as
  in jax; an argmax index would be smaller for long reductions but cannot
  represent ties, so the mask stays.
* ``reduce_prod``: the input. The cotangent is the product of the *other*
  elements, from an exclusive prefix and an exclusive suffix product: no
  division, so zeros (one or several) are exact.
* ``cumsum``: nothing (linear).
* ``cumprod``: the input; the exclusive cumulative product is recomputed in
  backward. ``cumlogsumexp``: the input and the output.
  Both cotangents are a first-order linear recurrence run against the scan
  direction (`_linrec`), again without any division.
* ``cummax`` / ``cummin``: one int8 code per element (derived in forward):
  bit 0 says the element equals the running extremum, bit 1 that the running
  extremum changes there. Ties share the cotangent equally (jax's own rule
  splits by its scan tree, so only the per-plateau totals agree on ties).
* ``sort``: the permutation (derived in forward by sorting an extra iota
  operand, in the narrowest integer type that holds it); the cotangent of
  each float operand is scattered back through it.

``reduce_and`` / ``reduce_or`` / ``reduce_xor`` have no cotangent.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tapegrad.rules._bits import mask_aval, pack_mask, unpack_mask
from tapegrad.rules._registry import Rule, deflinear, defnondiff, defrule, defvjp

__all__: list[str] = []


def _kept(ndim, axes):
    return tuple(i for i in range(ndim) if i not in axes)


def _expand(v, shape, axes):
    """Broadcast a reduced value back to the operand's shape."""
    return lax.broadcast_in_dim(v, tuple(shape), _kept(len(shape), axes))


def _bind(rec, ins):
    out = rec.prim.bind(*ins, **rec.bind_params)
    return list(out) if rec.prim.multiple_results else [out]


def _index_dtype(n):
    """The narrowest signed integer type holding 0..n-1 (indices saved for backward)."""
    for dt in (np.int8, np.int16, np.int32):
        if n - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int64)


def _scalar(v, dtype):
    return np.array(v, dtype)


# ---------------------------------------------------------------------------
# reduce_max / reduce_min: cotangent split equally among the tied extrema.


def _chooser_derive(rec, ins):
    (y,) = _bind(rec, ins)
    if not rec.saves:
        return [y], [None]
    x = ins[0]
    return [y], [pack_mask(lax.eq(x, _expand(y, x.shape, rec.params["axes"])))]


def _chooser_avals(p, in_avals, out_avals, active):
    return [mask_aval(in_avals[0].shape, getattr(in_avals[0], "sharding", None))]


def _chooser_ct(g, r, p):
    axes = tuple(p["axes"])
    shape = r.in_avals[0].shape
    hit = unpack_mask(r.aux[0], shape).astype(g.dtype)
    counts = lax.reduce_sum(hit, axes)  # as jax: 0/0 = NaN where the extremum is NaN
    return _expand(g / counts, shape, axes) * hit


for _name in ("reduce_max", "reduce_min"):
    defvjp(_name, ("a0", _chooser_ct), derive=_chooser_derive, aux_avals=_chooser_avals)


# ---------------------------------------------------------------------------
# reduce_prod: d/dx_i = product of the other elements, zero-safe.


def _shift(x, axis, toward_end, fill):
    """Shift ``x`` by one along ``axis``: position i gets x[i-1] (``toward_end``)
    or x[i+1]; the vacated end gets ``fill``."""
    cfg = [(0, 0, 0)] * x.ndim
    cfg[axis] = (1, -1, 0) if toward_end else (-1, 1, 0)
    return lax.pad(x, _scalar(fill, x.dtype), cfg)


def _exclusive_cumprod(x, axis, reverse):
    # A parallel prefix scan rather than the cumprod primitive, whose CPU lowering
    # (a reduce_window) is quadratic in the axis length.
    prod = lax.associative_scan(lax.mul, x, reverse=reverse, axis=axis)
    return _shift(prod, axis, not reverse, 1)


def _prod_ct(g, r, p):
    x = r.x[0]
    axes = tuple(sorted(p["axes"]))
    if not axes:
        return g
    kept = _kept(x.ndim, axes)
    perm = axes + kept
    n = math.prod(x.shape[a] for a in axes)
    # Reduced axes first, flattened into one: (n, *kept).
    flat = lax.reshape(lax.transpose(x, perm), (n,) + tuple(x.shape[k] for k in kept))
    others = _exclusive_cumprod(flat, 0, False) * _exclusive_cumprod(flat, 0, True)
    ct = others * lax.broadcast_in_dim(g, others.shape, tuple(range(1, others.ndim)))
    ct = lax.reshape(ct, tuple(x.shape[i] for i in perm))
    return lax.transpose(ct, tuple(int(i) for i in np.argsort(perm)))


defvjp("reduce_prod", ("x0", _prod_ct))


# ---------------------------------------------------------------------------
# Cumulative reductions.


def _compose(inner, outer):
    # (outer o inner)(s) for affine maps s -> a*s + b.
    a1, b1 = inner
    a2, b2 = outer
    return a2 * a1, a2 * b1 + b2


def _linrec(a, b, axis, reverse):
    """s[k] = b[k] + a[k] * s[k-1]  (s[k+1] when ``reverse``), s = 0 before the start.

    A parallel prefix scan of affine maps: log-depth, no division.
    """
    return lax.associative_scan(_compose, (a, b), reverse=reverse, axis=axis)[1]


deflinear("cumsum", lambda g, r, p: lax.cumsum(g, axis=p["axis"], reverse=not p["reverse"]))


def _cumprod_ct(g, r, p):
    # y[i] = x[0]...x[i];  ct[k] = (x[0]...x[k-1]) * s[k],  with
    # s[k] = sum_{i>=k} g[i] x[k+1]...x[i] = g[k] + x[k+1] s[k+1].
    x = r.x[0]
    axis, rev = p["axis"], p["reverse"]
    before = _exclusive_cumprod(x, axis, rev)
    s = _linrec(_shift(x, axis, rev, 1), g, axis, not rev)
    return before * s


defvjp("cumprod", ("x0", _cumprod_ct))


def _cumlogsumexp_ct(g, r, p):
    # ct[k] = sum_{i>=k} g[i] exp(x[k] - y[i]) = exp(x[k] - y[k]) * s[k],  with
    # s[k] = g[k] + exp(y[k] - y[k+1]) s[k+1]: every factor is <= 1, so nothing
    # overflows however large x is.
    x, y = r.x[0], r.y[0]
    axis, rev = p["axis"], p["reverse"]
    decay = jnp.exp(y - _shift(y, axis, rev, np.inf))
    s = _linrec(decay, g, axis, not rev)
    return jnp.exp(x - y) * s


defvjp("cumlogsumexp", ("x0 y0", _cumlogsumexp_ct))


def _cumchooser_derive(rec, ins):
    (y,) = _bind(rec, ins)
    x = ins[0]
    axis, rev = rec.params["axis"], rec.params["reverse"]
    hit = lax.eq(x, y)
    # The running extremum changes here; the NaN fill makes the scan's first
    # element a start, and NaN outputs each start their own (gradient-free) plateau.
    start = lax.ne(y, _shift(y, axis, not rev, np.nan))
    code = hit.astype(np.int8) + 2 * start.astype(np.int8)
    return [y], [code]


def _cumchooser_avals(p, in_avals, out_avals, active):
    return [jax.ShapeDtypeStruct(in_avals[0].shape, np.int8)]


def _cumchooser_ct(g, r, p):
    # Along each plateau of the running extremum y, y[i] is shared equally by
    # the count[i] elements x[j] == y[i] seen so far on that plateau:
    #   ct[k] = hit[k] * sum_{i>=k on k's plateau} g[i] / count[i].
    code = r.aux[0]
    axis, rev = p["axis"], p["reverse"]
    hit = (code & 1).astype(g.dtype)
    cont = 1 - (code >> 1).astype(g.dtype)  # 1 where the plateau continues
    count = _linrec(cont, hit, axis, rev)
    share = jnp.where(count > 0, g / jnp.where(count > 0, count, 1), 0)
    # Suffix sums that restart at each plateau (a scan, not a difference of
    # cumulative sums, so long arrays lose no precision).
    total = _linrec(_shift(cont, axis, rev, 0), share, axis, not rev)
    return hit * total


for _name in ("cummax", "cummin"):
    defvjp(_name, ("a0", _cumchooser_ct), derive=_cumchooser_derive, aux_avals=_cumchooser_avals)


# ---------------------------------------------------------------------------
# sort: scatter each float operand's cotangent back through the permutation.


def _is_float(dtype):
    return jnp.issubdtype(dtype, jnp.inexact)


def _sort_perm_dtype(p, in_avals):
    return _index_dtype(in_avals[0].shape[p["dimension"]])


def _sort_derive(rec, ins):
    dim = rec.params["dimension"]
    shape = ins[0].shape
    iota = lax.broadcasted_iota(_sort_perm_dtype(rec.params, rec.inputs), shape, dim)
    # The iota is not a key, so the sorted operands are the plain sort's.
    outs = _bind(rec, list(ins) + [iota])
    return outs[:-1], [outs[-1]]


def _sort_avals(p, in_avals, out_avals, active):
    return [jax.ShapeDtypeStruct(in_avals[0].shape, _sort_perm_dtype(p, in_avals))]


def _sort_saves(p, in_avals, out_avals, active):
    return (("aux", 0),)


def _unsort(g, perm, dim):
    others = _kept(g.ndim, (dim,))
    dn = lax.ScatterDimensionNumbers(
        update_window_dims=(),
        inserted_window_dims=(dim,),
        scatter_dims_to_operand_dims=(dim,),
        operand_batching_dims=others,
        scatter_indices_batching_dims=others,
    )
    return lax.scatter_add(
        jnp.zeros_like(g),
        perm[..., None],
        g,
        dn,
        indices_are_sorted=False,
        unique_indices=True,
        mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS,
    )


def _sort_vjp(p, r, cts, active):
    perm = r.aux[0]
    out = []
    for a, g, aval in zip(active, cts, r.in_avals):
        if a and g is not None and _is_float(aval.dtype):
            out.append(_unsort(g, perm, p["dimension"]))
        else:
            out.append(None)
    return out


defrule(Rule("sort", _sort_saves, _sort_vjp, derive=_sort_derive, aux_avals=_sort_avals))


defnondiff("reduce_and", "reduce_or", "reduce_xor")
