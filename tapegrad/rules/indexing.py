"""Indexing and layout primitives: slicing, padding, concatenation, gather/scatter.

Almost all of these are linear in their array operands, so they save nothing
but the integer indices their backward needs (inputs that never receive a
cotangent themselves):

=====================  ==================================================
primitive              saves
=====================  ==================================================
rev, slice, pad,       nothing
concatenate, split,
stack, unstack
dynamic_slice          the start indices (x1..xn)
dynamic_update_slice   the start indices (x2..xn)
gather                 the indices (x1)
scatter-add/-sub       the indices (x1), and only when ``updates`` is
                       differentiated
scatter                the indices (x1)
scatter-mul            indices, plus ``updates`` (for the operand) and the
                       operand (for ``updates``)
scatter-min/-max       operand, indices, updates and the output
select_and_gather_add  the operand (x1), which selects the window element
=====================  ==================================================

The rules follow jax's own transpose/JVP rules for these primitives
but are written with public ``jax.lax`` functions, so the backward pass is
itself traceable and differentiable.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from tapegrad.rules._registry import Rule, deflinear, defrule

# jax's JVP rules read scattered values back with ``lax.gather``'s default mode,
# which is PROMISE_IN_BOUNDS (XLA clamps out-of-bounds starts); to give the same
# cotangents as jax.grad, so do we.
_PROMISE = lax.GatherScatterMode.PROMISE_IN_BOUNDS


def _refs(*idx: int) -> tuple:
    return tuple(("in", i) for i in idx)


def _zeros(shape, dtype):
    return jnp.zeros(tuple(shape), dtype)


def _zero_scalar(g):
    return np.array(0, g.dtype)


# --------------------------------------------------------------------------- rev, slice

deflinear("rev", lambda g, r, p: lax.rev(g, tuple(p["dimensions"])))


def _slice_ct(g, r, p):
    in_shape = r.in_avals[0].shape
    start, limit, strides = p["start_indices"], p["limit_indices"], p["strides"]
    out_shape = r.out_avals[0].shape
    if strides is None or all(s == 1 for s in strides):
        pads = [(int(s), int(n - l), 0) for s, l, n in zip(start, limit, in_shape)]
    else:
        # The last element a strided slice reads is start + (n_out - 1) * stride.
        real_limits = [
            s if o == 0 else s + 1 + (o - 1) * st for s, o, st in zip(start, out_shape, strides)
        ]
        pads = [
            (int(s), int(n - l), int(st - 1))
            for s, l, n, st in zip(start, real_limits, in_shape, strides)
        ]
    return lax.pad(g, _zero_scalar(g), pads)


deflinear("slice", _slice_ct)


# --------------------------------------------------------------------------- dynamic slices


def _ds_saves(p, ins, outs, active):
    return _refs(*range(1, len(ins))) if active[0] else ()


def _ds_vjp(p, r, cts, active):
    g = cts[0]
    n = len(r.in_avals)
    out = [None] * n
    if active[0]:
        starts = [r.x[i] for i in range(1, n)]
        zeros = _zeros(r.in_avals[0].shape, g.dtype)
        out[0] = lax.dynamic_update_slice(zeros, g, starts)
    return out


defrule(Rule("dynamic_slice", _ds_saves, _ds_vjp))


def _dus_saves(p, ins, outs, active):
    return _refs(*range(2, len(ins))) if (active[0] or active[1]) else ()


def _dus_vjp(p, r, cts, active):
    g = cts[0]
    n = len(r.in_avals)
    starts = [r.x[i] for i in range(2, n)]
    upd_shape = r.in_avals[1].shape
    out = [None] * n
    if active[0]:
        out[0] = lax.dynamic_update_slice(g, _zeros(upd_shape, g.dtype), starts)
    if active[1]:
        out[1] = lax.dynamic_slice(g, starts, upd_shape)
    return out


defrule(Rule("dynamic_update_slice", _dus_saves, _dus_vjp))


# --------------------------------------------------------------------------- concatenate, split


def _no_saves(p, ins, outs, active):
    return ()


def _concat_vjp(p, r, cts, active):
    g = cts[0]
    dim = p["dimension"]
    out = []
    start = 0
    for aval, a in zip(r.in_avals, active):
        size = aval.shape[dim]
        out.append(lax.slice_in_dim(g, start, start + size, axis=dim) if a else None)
        start += size
    return out


defrule(Rule("concatenate", _no_saves, _concat_vjp))


def _split_vjp(p, r, cts, active):
    if not active[0]:
        return [None]
    dtype = next(c.dtype for c in cts if c is not None)
    parts = [c if c is not None else _zeros(o.shape, dtype) for c, o in zip(cts, r.out_avals)]
    return [lax.concatenate(parts, p["axis"])]


defrule(Rule("split", _no_saves, _split_vjp))


# --------------------------------------------------------------------------- pad


def _pad_operand_ct(g, config):
    # Negative pads crop, so un-padding is a pad by the negated amounts; then every
    # (interior + 1)-th element is the operand's. A scalar has an empty config.
    unpadded = lax.pad(g, _zero_scalar(g), [(-int(lo), -int(hi), 0) for lo, hi, _ in config])
    strides = tuple(int(i) + 1 for _, _, i in config)
    return lax.slice(unpadded, (0,) * g.ndim, unpadded.shape, strides)


def _pad_vjp(p, r, cts, active):
    g = cts[0]
    config = p["padding_config"]
    t_op = _pad_operand_ct(g, config) if (active[0] or active[1]) else None
    t_pad = None
    if active[1]:
        # Everything not the operand's was padding. lax.reduce_sum, as jax's transpose,
        # so half-precision sums round the same way.
        axes = tuple(range(g.ndim))
        t_pad = lax.reduce_sum(g, axes) - lax.reduce_sum(t_op, axes)
    return [t_op if active[0] else None, t_pad]


defrule(Rule("pad", _no_saves, _pad_vjp))


# --------------------------------------------------------------------------- gather / scatter


def _scatter_dnums_of_gather(dn) -> lax.ScatterDimensionNumbers:
    return lax.ScatterDimensionNumbers(
        update_window_dims=tuple(dn.offset_dims),
        inserted_window_dims=tuple(dn.collapsed_slice_dims),
        scatter_dims_to_operand_dims=tuple(dn.start_index_map),
        operand_batching_dims=tuple(dn.operand_batching_dims),
        scatter_indices_batching_dims=tuple(dn.start_indices_batching_dims),
    )


def _gather_dnums_of_scatter(dn) -> lax.GatherDimensionNumbers:
    return lax.GatherDimensionNumbers(
        offset_dims=tuple(dn.update_window_dims),
        collapsed_slice_dims=tuple(dn.inserted_window_dims),
        start_index_map=tuple(dn.scatter_dims_to_operand_dims),
        operand_batching_dims=tuple(dn.operand_batching_dims),
        start_indices_batching_dims=tuple(dn.scatter_indices_batching_dims),
    )


def _inverse_slice_sizes(dn, operand_shape, updates_shape) -> tuple[int, ...]:
    """The slice sizes of the gather that reads back what a scatter wrote."""
    sizes, pos = [], 0
    for i in range(len(operand_shape)):
        if i in dn.inserted_window_dims or i in dn.operand_batching_dims:
            sizes.append(1)
        else:
            sizes.append(int(updates_shape[dn.update_window_dims[pos]]))
            pos += 1
    return tuple(sizes)


def _gather_back(t, indices, p, operand_shape, updates_shape, mode=None):
    """The transpose of scatter-add w.r.t. ``updates``: gather ``t`` at the windows."""
    dn = p["dimension_numbers"]
    return lax.gather(
        t,
        indices,
        _gather_dnums_of_scatter(dn),
        _inverse_slice_sizes(dn, operand_shape, updates_shape),
        indices_are_sorted=p["indices_are_sorted"],
        unique_indices=p["unique_indices"],
        mode=p["mode"] if mode is None else mode,
        fill_value=0,
    )


def _gather_ct(g, r, p):
    zeros = _zeros(r.in_avals[0].shape, g.dtype)
    return lax.scatter_add(
        zeros,
        r.x[1],
        g,
        _scatter_dnums_of_gather(p["dimension_numbers"]),
        indices_are_sorted=p["indices_are_sorted"],
        unique_indices=p["unique_indices"],
        mode=p["mode"],
    )


def _gather_saves(p, ins, outs, active):
    return _refs(1) if active[0] else ()


def _gather_vjp(p, r, cts, active):
    return [_gather_ct(cts[0], r, p) if active[0] else None, None]


defrule(Rule("gather", _gather_saves, _gather_vjp))


def _updates_only_saves(p, ins, outs, active):
    return _refs(1) if active[2] else ()


def _scatter_addsub(sign):
    def vjp(p, r, cts, active):
        g = cts[0]
        op_ct = g if active[0] else None
        upd_ct = None
        if active[2]:
            upd_ct = _gather_back(g, r.x[1], p, r.in_avals[0].shape, r.in_avals[2].shape)
            if sign < 0:
                upd_ct = -upd_ct
        return [op_ct, None, upd_ct]

    return vjp


defrule(Rule("scatter-add", _updates_only_saves, _scatter_addsub(+1)))
defrule(Rule("scatter-sub", _updates_only_saves, _scatter_addsub(-1)))


def _scatter_saves(p, ins, outs, active):
    return _refs(1) if (active[0] or active[2]) else ()


def _scatter_vjp(p, r, cts, active):
    """Overwriting scatter, as jax.grad differentiates it.

    With ``unique_indices`` the operand's cotangent is ``g`` with the written
    windows zeroed and the updates' is ``g`` gathered at their windows. Without
    it, several updates may target one element and only one of them "wins":
    as in jax's ``_scatter_jvp``, each update gets an id, the ids are scattered
    with the same indices and read back, and an update receives a cotangent only
    where its id survived (an out-of-bounds, dropped update gets none).
    """
    if p.get("update_jaxpr") is not None:
        raise NotImplementedError("scatter_apply JVP not implemented (jax has none either)")
    g = cts[0]
    idx = r.x[1]
    dn = p["dimension_numbers"]
    op_shape, upd_shape = r.in_avals[0].shape, r.in_avals[2].shape
    op_ct = upd_ct = None
    if p["unique_indices"]:
        if active[0]:
            op_ct = lax.scatter(
                g,
                idx,
                _zeros(upd_shape, g.dtype),
                dn,
                indices_are_sorted=p["indices_are_sorted"],
                unique_indices=True,
                mode=p["mode"],
            )
        if active[2]:
            upd_ct = _gather_back(g, idx, p, op_shape, upd_shape)
        return [op_ct, None, upd_ct]

    ids_shape = list(upd_shape)
    for d in dn.update_window_dims:
        ids_shape[d] = 1
    num_ids = int(np.prod(ids_shape, dtype=np.int64))
    id_dtype = jnp.int64 if num_ids >= np.iinfo(np.int32).max else jnp.int32
    update_ids = lax.broadcast_in_dim(
        lax.iota(id_dtype, num_ids).reshape(ids_shape) + 1,
        tuple(upd_shape),
        tuple(range(len(upd_shape))),
    )
    scattered_ids = lax.scatter(
        _zeros(op_shape, id_dtype),
        idx,
        update_ids,
        dn,
        indices_are_sorted=p["indices_are_sorted"],
        unique_indices=False,
        mode=p["mode"],
    )
    zero = _zero_scalar(g)
    if active[0]:
        op_ct = jnp.where(scattered_ids == 0, g, zero)
    if active[2]:
        # jax reads the ids back with gather's default mode, whatever the
        # scatter's mode was: a dropped update never finds its own id.
        back_ids = lax.gather(
            scattered_ids,
            idx,
            _gather_dnums_of_scatter(dn),
            _inverse_slice_sizes(dn, op_shape, upd_shape),
            indices_are_sorted=p["indices_are_sorted"],
            mode=_PROMISE,
        )
        upd_ct = jnp.where(
            update_ids == back_ids, _gather_back(g, idx, p, op_shape, upd_shape), zero
        )
    return [op_ct, None, upd_ct]


defrule(Rule("scatter", _scatter_saves, _scatter_vjp))


def _scatter_mul_saves(p, ins, outs, active):
    refs = []
    if active[0]:
        refs += [1, 2]
    if active[2]:
        refs += [0, 1]
    return _refs(*dict.fromkeys(refs))


def _scatter_mul_vjp(p, r, cts, active):
    g = cts[0]
    idx = r.x[1]
    dn = p["dimension_numbers"]
    op_ct = upd_ct = None
    if active[0]:
        op_ct = lax.scatter_mul(
            g,
            idx,
            r.x[2].astype(g.dtype),
            dn,
            indices_are_sorted=p["indices_are_sorted"],
            unique_indices=p["unique_indices"],
            mode=p["mode"],
        )
    if active[2]:
        if not p["unique_indices"]:
            raise NotImplementedError(
                "scatter_mul gradients are only implemented if `unique_indices=True` (as in jax)"
            )
        upd_ct = _gather_back(
            g * r.x[0].astype(g.dtype), idx, p, r.in_avals[0].shape, r.in_avals[2].shape
        )
    return [op_ct, None, upd_ct]


defrule(Rule("scatter-mul", _scatter_mul_saves, _scatter_mul_vjp))


def _scatter_extremal_saves(p, ins, outs, active):
    return (("in", 0), ("in", 1), ("in", 2), ("out", 0)) if (active[0] or active[2]) else ()


def _scatter_extremal_vjp(p, r, cts, active):
    """Transpose of jax's ``_scatter_extremal_jvp`` (scatter-min / scatter-max).

    Ties between updates (and the operand) share the cotangent equally.
    """
    g = cts[0]
    operand, idx, updates, out = r.x[0], r.x[1], r.x[2], r.y[0]
    dn = p["dimension_numbers"]
    op_shape, upd_shape = r.in_avals[0].shape, r.in_avals[2].shape
    gdn = _gather_dnums_of_scatter(dn)
    sizes = _inverse_slice_sizes(dn, op_shape, upd_shape)

    def gather_default(x):  # jax's JVP gathers with the default mode
        return lax.gather(x, idx, gdn, sizes, mode=_PROMISE)

    def scatter_add_default(x):
        return lax.scatter_add(jnp.zeros(op_shape, g.dtype), idx, x, dn)

    initial = gather_default(operand)
    target = gather_default(out)
    successful = updates == target
    retained = initial == target
    ones = jnp.ones(upd_shape, g.dtype)
    num_updates = gather_default(scatter_add_default(jnp.where(successful, ones, 0)))
    num_refs = gather_default(scatter_add_default(ones))
    upd_norm = jnp.where(retained, 1.0 / (num_updates + 1), 1.0 / num_updates)
    upd_coef = jnp.where(successful, upd_norm, 0).astype(g.dtype)
    op_norm = jnp.where(retained, 1.0 / (num_updates + 1), 0)
    op_coef = ((-1.0 + op_norm) / num_refs).astype(g.dtype)

    # tangent_out = g_op + scatter_add(gather(g_op) * op_coef + g_upd * upd_coef)
    ct_tu = _gather_back(g, idx, p, op_shape, upd_shape)
    op_ct = upd_ct = None
    if active[0]:
        # the transpose of gather_default
        op_ct = g + lax.scatter_add(
            jnp.zeros(op_shape, g.dtype), idx, ct_tu * op_coef, dn, mode=_PROMISE
        )
    if active[2]:
        upd_ct = ct_tu * upd_coef
    return [op_ct, None, upd_ct]


defrule(Rule("scatter-min", _scatter_extremal_saves, _scatter_extremal_vjp))
defrule(Rule("scatter-max", _scatter_extremal_saves, _scatter_extremal_vjp))


# --------------------------------------------------------------------------- select_and_gather_add


def _sga_saves(p, ins, outs, active):
    return _refs(1) if active[0] else ()


def _sga_vjp(p, r, cts, active):
    """select_and_gather_add (from the JVP of max/min pooling) is linear in its
    tangents; its transpose scatters each window's cotangent to the element the
    operand selects. The operand gets no cotangent (as in jax)."""
    if not active[0]:
        return [None, None]
    g = cts[0]
    operand = r.x[1]
    if any(d != 1 for d in p["window_dilation"]):
        raise NotImplementedError(
            "VJP not implemented for select_and_gather (MaxPool) with window dilation, got "
            f"window_dilation={p['window_dilation']}."
        )
    base_dilation = p["base_dilation"]
    dilated = any(d != 1 for d in base_dilation)
    if dilated:
        dt = np.dtype(operand.dtype)
        if p["select_prim"] is lax.ge_p:
            ident = -np.inf if jnp.issubdtype(dt, jnp.inexact) else np.iinfo(dt).min
        else:
            ident = np.inf if jnp.issubdtype(dt, jnp.inexact) else np.iinfo(dt).max
        operand = lax.pad(operand, np.array(ident, dt), tuple((0, 0, d - 1) for d in base_dilation))
    out = lax.select_and_scatter_add_p.bind(
        g,
        operand,
        select_prim=p["select_prim"],
        window_dimensions=tuple(p["window_dimensions"]),
        window_strides=tuple(p["window_strides"]),
        padding=tuple(p["padding"]),
    )
    if dilated:
        out = lax.slice(out, (0,) * out.ndim, out.shape, tuple(base_dilation))
    return [out, None]


defrule(Rule("select_and_gather_add", _sga_saves, _sga_vjp))


# --------------------------------------------------------------------------- stack, unstack


def _stack_vjp(p, r, cts, active):
    parts = lax.unstack(cts[0], p["axis"])
    return [part if a else None for part, a in zip(parts, active)]


defrule(Rule("stack", _no_saves, _stack_vjp))


def _unstack_vjp(p, r, cts, active):
    if not active[0]:
        return [None]
    dtype = next(c.dtype for c in cts if c is not None)
    parts = [c if c is not None else _zeros(o.shape, dtype) for c, o in zip(cts, r.out_avals)]
    return [lax.stack(parts, p["axis"])]


defrule(Rule("unstack", _no_saves, _unstack_vjp))
