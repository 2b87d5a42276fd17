"""Convolutions and windowed reductions.

* ``conv_general_dilated``: each operand's cotangent is another convolution
  of the cotangent with the *other* operand, so each side saves only the
  other operand (a port of jax's ``_conv_general_dilated_transpose_lhs/rhs``
  onto public `jax.lax`).
* ``reduce_window_sum``: linear, saves nothing: the cotangent is padded
  (interior padding undoes the strides) and window-summed again.
* ``reduce_window_max`` / ``reduce_window_min`` (max/min pooling): saves, per
  output, which window element was chosen, as a small integer derived in
  forward, bit-packed for windows of up to 16 elements (2 bits for 2x2, 4 for
  3x3; int8 up to 127 elements), instead of the input and the output. The
  element is the one XLA's select-and-scatter (and so jax) picks: the first
  extremum in row-major window order, and jax's pick with NaN too. Backward scatters the
  cotangent with one strided pad per window element.
* ``reduce_window`` (the generic primitive, e.g. ``lax.reduce_window(x, 0.,
  lax.max, ...)`` whose init value is not the identity): one operand whose
  computation is a single ``add``/``max``/``min`` uses the rules above, with
  the init value as padding; any other computation keeps the generic
  fallback (which jax itself cannot reverse-differentiate).
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tapegrad.rules._bits import (
    codes_aval,
    mask_aval,
    pack_codes,
    pack_mask,
    unpack_codes,
    unpack_mask,
)
from tapegrad.rules._registry import Rule, defrule, defvjp
from tapegrad.rules.control import FALLBACK

__all__: list[str] = []


# ---------------------------------------------------------------------------
# Shape helpers (static: numpy on shapes only).


def _dilate_shape(shape, dilation):
    return tuple(0 if d == 0 else 1 + r * (d - 1) for d, r in zip(shape, dilation))


def _vjp_lhs_padding(in_shape, window, strides, out_shape, padding, lhs_dilation, rhs_dilation):
    lhs_d = _dilate_shape(in_shape, lhs_dilation)
    rhs_d = _dilate_shape(window, rhs_dilation)
    out_d = _dilate_shape(out_shape, strides)
    before = [r - lo - 1 for r, (lo, _) in zip(rhs_d, padding)]
    after = [l + r - 1 - o - b for l, r, o, b in zip(lhs_d, rhs_d, out_d, before)]
    return list(zip(before, after))


def _vjp_rhs_padding(in_shape, window, strides, out_shape, padding, lhs_dilation, rhs_dilation):
    if not in_shape:
        return []
    lhs_d = _dilate_shape(in_shape, lhs_dilation)
    rhs_d = _dilate_shape(window, rhs_dilation)
    out_d = _dilate_shape(out_shape, strides)
    lo = [l for l, _ in padding]
    hi = [(o - l) + (r - p - 1) for o, l, r, p in zip(out_d, lhs_d, rhs_d, lo)]
    return list(zip(lo, hi))


def _spec_t(spec):
    return (spec[1], spec[0]) + tuple(spec[2:])


def _take(shape, dims):
    return tuple(shape[d] for d in dims)


def _reshape_axis_into(src, dst, x):
    # ``dst`` numbers the dimensions after ``src`` is removed.
    perm = [i for i in range(x.ndim) if i != src]
    perm.insert(dst, src)
    new_shape = [d for i, d in enumerate(x.shape) if i != src]
    new_shape[dst] *= x.shape[src]
    return lax.reshape(lax.transpose(x, tuple(perm)), tuple(new_shape))


def _reshape_axis_out_of(src, size1, x):
    shape = list(x.shape)
    size2, ragged = divmod(shape[src], size1)
    assert not ragged
    shape[src : src + 1] = [size1, size2]
    return lax.reshape(x, tuple(shape))


# ---------------------------------------------------------------------------
# conv_general_dilated


def _conv_lhs(g, r, p):
    rhs = r.x[1]
    lhs_shape, rhs_shape = r.in_avals[0].shape, r.in_avals[1].shape
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    fgc, bgc = p["feature_group_count"], p["batch_group_count"]
    if fgc > 1:
        # Move the feature-group axis into the transposed kernel's output features.
        rhs = _reshape_axis_out_of(rhs_spec[0], fgc, rhs)
        rhs = _reshape_axis_into(rhs_spec[0], rhs_spec[1], rhs)
    elif bgc > 1:
        rhs = _reshape_axis_out_of(rhs_spec[0], bgc, rhs)
        rhs = _reshape_axis_into(rhs_spec[0], rhs_spec[1], rhs)
        fgc = bgc
    dn = lax.ConvDimensionNumbers(tuple(out_spec), _spec_t(rhs_spec), tuple(lhs_spec))
    padding = _vjp_lhs_padding(
        _take(lhs_shape, lhs_spec[2:]),
        _take(rhs_shape, rhs_spec[2:]),
        p["window_strides"],
        _take(g.shape, out_spec[2:]),
        p["padding"],
        p["lhs_dilation"],
        p["rhs_dilation"],
    )
    flipped = lax.rev(rhs, tuple(rhs_spec[2:]))
    if flipped.dtype != g.dtype:
        flipped = flipped.astype(g.dtype)
    out = lax.conv_general_dilated(
        g,
        flipped,
        window_strides=p["lhs_dilation"],
        padding=padding,
        lhs_dilation=p["window_strides"],
        rhs_dilation=p["rhs_dilation"],
        dimension_numbers=dn,
        feature_group_count=fgc,
        batch_group_count=1,
        precision=p["precision"],
        preferred_element_type=p["preferred_element_type"],
    )
    if bgc > 1:
        out = _reshape_axis_out_of(lhs_spec[1], bgc, out)
        out = _reshape_axis_into(lhs_spec[1], lhs_spec[0], out)
    return out


def _conv_rhs(g, r, p):
    lhs = r.x[0]
    lhs_shape, rhs_shape = r.in_avals[0].shape, r.in_avals[1].shape
    if math.prod(g.shape) == 0:
        # A degenerate (spatially empty) convolution: the kernel gets nothing.
        return jnp.zeros(rhs_shape, g.dtype)
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    fgc, bgc = p["feature_group_count"], p["batch_group_count"]
    if bgc > 1:
        fgc, bgc = bgc, 1
    elif fgc > 1:
        fgc, bgc = 1, fgc
    dn = lax.ConvDimensionNumbers(_spec_t(lhs_spec), _spec_t(out_spec), _spec_t(rhs_spec))
    padding = _vjp_rhs_padding(
        _take(lhs_shape, lhs_spec[2:]),
        _take(rhs_shape, rhs_spec[2:]),
        p["window_strides"],
        _take(g.shape, out_spec[2:]),
        p["padding"],
        p["lhs_dilation"],
        p["rhs_dilation"],
    )
    if lhs.dtype != g.dtype:
        lhs = lhs.astype(g.dtype)
    return lax.conv_general_dilated(
        lhs,
        g,
        window_strides=p["rhs_dilation"],
        padding=padding,
        lhs_dilation=p["lhs_dilation"],
        rhs_dilation=p["window_strides"],
        dimension_numbers=dn,
        feature_group_count=fgc,
        batch_group_count=bgc,
        precision=p["precision"],
        preferred_element_type=p["preferred_element_type"],
    )


defvjp("conv_general_dilated", ("x1", _conv_lhs), ("x0", _conv_rhs))


# ---------------------------------------------------------------------------
# reduce_window_sum


def _window_sum_ct(g, in_shape, p):
    n = len(in_shape)
    pads = _vjp_lhs_padding(
        in_shape,
        p["window_dimensions"],
        p["window_strides"],
        g.shape,
        p["padding"],
        p["base_dilation"],
        p["window_dilation"],
    )
    cfg = [(lo, hi, s - 1) for (lo, hi), s in zip(pads, p["window_strides"])]
    padded = lax.pad(g, np.array(0, g.dtype), cfg)
    return lax.reduce_window(
        padded,
        np.array(0, g.dtype),
        lax.add,
        p["window_dimensions"],
        p["base_dilation"],
        [(0, 0)] * n,
        base_dilation=(1,) * n,
        window_dilation=p["window_dilation"],
    )


defvjp("reduce_window_sum", ("", lambda g, r, p: _window_sum_ct(g, r.in_avals[0].shape, p)))


# ---------------------------------------------------------------------------
# reduce_window_max / reduce_window_min: which element of each window won.


def _geometry(in_shape, p):
    """(padded/dilated operand shape, output shape, window offsets in row-major order)."""
    dil = _dilate_shape(in_shape, p["base_dilation"])
    full = tuple(d + lo + hi for d, (lo, hi) in zip(dil, p["padding"]))
    win = _dilate_shape(p["window_dimensions"], p["window_dilation"])
    out = tuple(0 if f < w else (f - w) // s + 1 for f, w, s in zip(full, win, p["window_strides"]))
    offsets = list(itertools.product(*[range(w) for w in p["window_dimensions"]]))
    return full, out, offsets


def _window_start(off, p):
    return tuple(o * d for o, d in zip(off, p["window_dilation"]))


def _window_limit(start, out, p):
    return tuple(s + (n - 1) * st + 1 for s, n, st in zip(start, out, p["window_strides"]))


def _choice_dtype(p):
    """The narrowest integer type holding 0..K, K = the window's size (K: no element won)."""
    k = math.prod(p["window_dimensions"])
    return np.dtype(next(dt for dt in (np.int8, np.int16, np.int32) if k <= np.iinfo(dt).max))


def _choice(x, y, init, p):
    """Per output, the row-major index of the first window element equal to it
    (the window size where none is: the init value won)."""
    full, out, offsets = _geometry(x.shape, p)
    dt = _choice_dtype(p)
    choice = jnp.full(y.shape, len(offsets), dt)
    if 0 in out:
        return choice
    cfg = [(lo, hi, b - 1) for (lo, hi), b in zip(p["padding"], p["base_dilation"])]
    xp = lax.pad(x, jnp.asarray(init, x.dtype), cfg)
    # Later offsets first, so the first (row-major) match is the one that stays.
    for k in reversed(range(len(offsets))):
        start = _window_start(offsets[k], p)
        part = lax.slice(xp, start, _window_limit(start, out, p), p["window_strides"])
        choice = lax.select(lax.eq(part, y), jnp.full(y.shape, k, dt), choice)
    return choice


def _picked(x, p, select):
    """Per output, the row-major index of the window element XLA's select-and-scatter
    (jax's max/min-pool backward) picks, and that element's value: the first element,
    replaced by each later one for which ``select(picked, element)`` fails (``ge`` for
    max, ``le`` for min). Without NaN that is the first extremum; with NaN it is still
    jax's pick. Padding and base dilation holes hold the identity (-inf for max) and can
    be picked, as in XLA; their cotangent is dropped."""
    full, out, offsets = _geometry(x.shape, p)
    dt = _choice_dtype(p)
    if 0 in out:
        return jnp.full(out, len(offsets), dt), jnp.zeros(out, x.dtype)
    ident = np.array(-np.inf if select is lax.ge else np.inf, x.dtype)
    cfg = [(lo, hi, b - 1) for (lo, hi), b in zip(p["padding"], p["base_dilation"])]
    xp = lax.pad(x, ident, cfg)
    picked = choice = None
    for k, off in enumerate(offsets):
        start = _window_start(off, p)
        part = lax.slice(xp, start, _window_limit(start, out, p), p["window_strides"])
        if picked is None:
            picked, choice = part, jnp.zeros(out, dt)
            continue
        take = lax.bitwise_not(select(picked, part))
        picked = lax.select(take, part, picked)
        choice = lax.select(take, jnp.full(out, k, dt), choice)
    return choice, picked


def _chosen_ct(g, choice, in_shape, p):
    full, out, offsets = _geometry(in_shape, p)
    zero = np.array(0, g.dtype)
    ct = jnp.zeros(full, g.dtype)
    if 0 not in out:
        for k, off in enumerate(offsets):
            start = _window_start(off, p)
            limit = _window_limit(start, out, p)
            part = lax.select(choice == k, g, jnp.zeros_like(g))
            cfg = [
                (s, f - l, st - 1) for s, l, f, st in zip(start, limit, full, p["window_strides"])
            ]
            ct = ct + lax.pad(part, zero, cfg)
    # Drop the padding (negative pads crop), then the base-dilation holes.
    ct = lax.pad(ct, zero, [(-lo, -hi, 0) for lo, hi in p["padding"]])
    return lax.slice(ct, (0,) * ct.ndim, ct.shape, p["base_dilation"])


def _chooser_rule(name, select):
    # The chosen element's index, 0..K-1 for a window of K elements, is kept in
    # ceil(log2 K) bits rounded up to 1, 2 or 4 (rules/_bits.py): 2 bits per output
    # of a 2x2 pool, half a bit per input element.
    def window(p):
        return math.prod(p["window_dimensions"])

    # With ``relu_mask`` (`_rebuild._relu_into_pool`: the relu before it keeps no mask),
    # also whether each picked element is positive, and the cotangent masked by it.
    def derive(rec, ins):
        y = rec.prim.bind(*ins, **rec.bind_params)
        if not rec.saves:
            return [y], [None]
        choice, picked = _picked(ins[0], rec.params, select)
        aux = [pack_codes(choice, window(rec.params))]
        if rec.params.get("relu_mask"):
            aux.append(pack_mask(picked > 0))
        return [y], aux

    def avals(p, in_avals, out_avals, active):
        o = out_avals[0]
        sharding = getattr(o, "sharding", None)
        avals = [codes_aval(o.shape, window(p), _choice_dtype(p), sharding)]
        return avals + [mask_aval(o.shape, sharding)] if p.get("relu_mask") else avals

    def ct(g, r, p):
        shape = r.out_avals[0].shape
        if p.get("relu_mask"):
            g = lax.select(unpack_mask(r.aux[1], shape), g, jnp.zeros_like(g))
        choice = unpack_codes(r.aux[0], shape, window(p), _choice_dtype(p))
        return _chosen_ct(g, choice, r.in_avals[0].shape, p)

    defvjp(name, ("a0", ct), derive=derive, aux_avals=avals)


_chooser_rule("reduce_window_max", lax.ge)
_chooser_rule("reduce_window_min", lax.le)


# ---------------------------------------------------------------------------
# The generic reduce_window: a single add/max/min computation, any init value.


def _generic_kind(p, n_inputs):
    """'add' / 'max' / 'min' when the window computation is that one primitive
    of one operand, else None."""
    if n_inputs != 2:
        return None
    jaxpr = p["jaxpr"]
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    if len(jaxpr.eqns) != 1 or p.get("consts"):
        return None
    eqn = jaxpr.eqns[0]
    name = eqn.primitive.name
    if name not in ("add", "max", "min"):
        return None
    if (
        set(map(id, eqn.invars)) != set(map(id, jaxpr.invars))
        or len(jaxpr.invars) != 2
        or list(map(id, eqn.outvars)) != list(map(id, jaxpr.outvars))
    ):
        return None
    return name


def _generic_saves(p, ins, outs, active):
    kind = _generic_kind(p, len(ins))
    if kind is None:
        return FALLBACK.saves(p, ins, outs, active)
    if kind == "add":
        return ()
    return (("aux", 0),)


def _generic_avals(p, ins, outs, active):
    if _generic_kind(p, len(ins)) in ("max", "min"):
        return [jax.ShapeDtypeStruct(outs[0].shape, _choice_dtype(p))]
    return []


def _generic_derive(rec, ins):
    kind = _generic_kind(rec.params, len(ins))
    if kind not in ("max", "min"):
        return list(rec.prim.bind(*ins, **rec.bind_params)), []
    # The same values as the primitive (init pads the operand and starts every window),
    # from max/min pooling and one elementwise max/min: an outer jax transformation
    # (jax.grad of tg.grad) can differentiate these, not the generic primitive.
    x, init = ins
    p = rec.params
    dt = np.dtype(x.dtype)
    if jnp.issubdtype(dt, jnp.inexact):
        ident = -np.inf if kind == "max" else np.inf
    else:
        ident = np.iinfo(dt).min if kind == "max" else np.iinfo(dt).max
    op = lax.max if kind == "max" else lax.min
    pooled = lax.reduce_window(
        x,
        np.array(ident, dt),
        op,
        p["window_dimensions"],
        p["window_strides"],
        p["padding"],
        p["base_dilation"],
        p["window_dilation"],
    )
    y = op(pooled, jnp.asarray(init, dt))
    return [y], [_choice(x, y, init, p)]


def _generic_vjp(p, r, cts, active):
    kind = _generic_kind(p, len(r.in_avals))
    if kind is None:
        return FALLBACK.vjp(p, r, cts, active)
    if active[1]:
        raise NotImplementedError(
            "reduce_window: differentiating with respect to the init value is not supported "
            "(jax does not support it either); pass it as a constant."
        )
    g = cts[0]
    if not active[0] or g is None:
        return [None, None]
    shape = r.in_avals[0].shape
    if kind == "add":
        return [_window_sum_ct(g, shape, p), None]
    return [_chosen_ct(g, r.aux[0], shape, p), None]


defrule(
    Rule(
        "reduce_window",
        _generic_saves,
        _generic_vjp,
        derive=_generic_derive,
        aux_avals=_generic_avals,
    )
)
