"""A scan record's steps, forward and backward (a checkpoint schedule's segments are
scans too: `tapegrad.engine.loops.schedule` runs them through the scan kind again).

Under a trace, or eagerly with `save()`, the steps are a ``lax.scan`` whose body runs
the interpreter: the packed residuals leave it as stacked outputs, and backward is a
reverse ``lax.scan`` over them. Eagerly with any other policy the steps run as a Python
loop, so the policy sees concrete arrays one step at a time (offload really moves each
step to host as it is produced).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax

from tapegrad.core.tape import Record, Tape
from tapegrad.engine.loops.common import (
    _active_carries,
    _add,
    _arrays,
    _body_backward,
    _body_forward,
    _child,
    _clone,
    _codes,
    _coerce,
    _concrete,
    _input_cts,
    _stack_cts,
    _Stored,
    _zeros,
)
from tapegrad.engine.loops.saves import _carry_pairs, forwarded_ids


def _scan_forward(rec: Record, ins: list, res, observer, start: Any = 0) -> tuple[list, Any]:
    """The steps of a scan record (or one segment of a checkpointed one); ``start``: the
    index of the first step run here (a segment's offset in its scan)."""
    ins = _arrays(ins)  # a scheduled scan's innermost segment: its inputs' steps
    p = rec.params
    body = rec.bodies[0]
    nc, nk, T = p["num_consts"], p["num_carry"], int(p["length"])
    consts, init, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
    fwd = forwarded_ids(rec)
    order = list(reversed(range(T)) if p["reverse"] else range(T))  # the steps as they run
    if not res.plain and _concrete(ins):
        # Eagerly, a policy other than save() sees one step's concrete arrays at a time.
        steps: list[Any] = [None] * T
        ys_t: list[Any] = [None] * T
        carry = list(init)
        codes, child, prev = [], None, None
        for t in order:
            child = _child(observer, body)
            args = [*consts, *carry, *(x[t] for x in xs)]
            outs, r = _body_forward(body, args, res, rec, fwd, child, start + t)
            codes.append(_codes(child))
            for k in fwd:
                r.store.pop(k, None)
            if prev is not None:  # share the previous step's packed output (one copy)
                for k_in, k_out, _ in _carry_pairs(rec, r.store):
                    # unpacked as it was packed: a per-residual policy (route) chose by
                    # the producing record's info, which may differ from the reader's
                    r.store[k_in], r.infos[k_in] = prev.store[k_out], prev.infos[k_out]
            steps[t], carry, ys_t[t], prev = r, outs[:nk], outs[nk:], r
        if child is not None:
            observer.add_loop(rec, child, jnp.stack(codes), order)
        n_ys = len(rec.outputs) - nk
        ys = [
            jnp.stack([jnp.asarray(ys_t[t][j]) for t in range(T)])
            if T
            else jnp.zeros((0,) + rec.outputs[nk + j].shape[1:], rec.outputs[nk + j].dtype)
            for j in range(n_ys)
        ]
        return _coerce(carry, rec.outputs[:nk]) + ys, _Stored(steps=steps)

    box: dict[str, Any] = {}

    def step(carry, xt):
        x, t = xt
        child = box["child"] = _child(observer, body)
        outs, r = _body_forward(body, [*consts, *carry, *x], res, rec, fwd, child, t)
        keys = [k for k in r.store if k not in fwd]
        pairs = box["pairs"] = _carry_pairs(rec, keys) if res.plain and T else []
        keys = [k for k in keys if k not in {p[0] for p in pairs}]
        box["skel"], box["keys"] = r, keys
        ys = _coerce(outs[nk:], body.outputs[nk:])
        return _coerce(outs[:nk], body.outputs[:nk]), (
            ys,
            [r.store[k] for k in keys],
            _codes(child),
        )

    # Each step's index (in xs order), so steps that see identical data still pack
    # with their own noise.
    ts = jnp.asarray(start, jnp.uint32) + jnp.arange(T, dtype=jnp.uint32)
    carry, (ys, stacked, codes) = lax.scan(
        step, list(init), (list(xs), ts), length=T, reverse=p["reverse"], unroll=p["unroll"]
    )
    if observer is not None:
        observer.add_loop(rec, box["child"], codes[jnp.asarray(order, jnp.int32)], order)
    skel = box["skel"]
    skel.store, skel.steps = {}, ()  # the steps were the body's tracers
    shifted = tuple((k_in, k_out, init[j]) for k_in, k_out, j in box["pairs"])
    stored = _Stored(skel=skel, keys=box["keys"], values=stacked, shifted=shifted)
    return list(carry) + list(ys), stored


class _Layout(NamedTuple):
    """What every backward step of a scan record reads, in either mode."""

    rec: Record
    body: Tape
    nc: int
    nk: int
    T: int
    n_xs: int
    const_store: dict  # the consts the body forwards, by its input ids
    xs_pos: list[int]  # the scanned inputs the body forwards (a slice per step)
    c_act: list[bool]  # carries that carry a cotangent between steps
    x_act: list[bool]  # scanned inputs that get one
    y_ct: list[int]  # the ys that bring one
    order: list[int]  # backward's step order
    retain: bool


def _scan_backward(rec: Record, x: list, stored: Any, gs: list, retain: bool, observer) -> list:
    """Cotangents of a scan record's inputs (or one segment's of a checkpointed one): the
    steps' backward in reverse, as a Python loop over the steps forward kept one by one
    (``stored.steps``), else as a reverse ``lax.scan`` over the stacked residuals."""
    x, gs = _arrays(x), _arrays(gs)
    lay = _layout(rec, x, gs, retain)
    body, nc, nk, c_act = lay.body, lay.nc, lay.nk, lay.c_act
    ct_c0 = [
        (gs[j] if gs[j] is not None else _zeros(body.inputs[nc + j])) if c_act[j] else None
        for j in range(nk)
    ]
    acc0 = [_zeros(body.inputs[j]) if rec.active[j] else None for j in range(nc)]
    if stored.steps is not None:  # Python-loop mode
        ct_c, acc, ct_xs = _backward_loop(lay, x, gs, stored, observer, ct_c0, acc0)
    else:
        ct_c, acc, ct_xs = _backward_scan(lay, x, gs, stored, observer, ct_c0, acc0)
    return _input_cts(rec, acc, ct_c, c_act, ct_xs)


def _layout(rec: Record, x: list, gs: list, retain: bool) -> _Layout:
    """The scan record's `_Layout` for this backward (``x``, ``gs``: its inputs and its
    outputs' cotangents)."""
    p = rec.params
    body = rec.bodies[0]
    nc, nk, T = p["num_consts"], p["num_carry"], int(p["length"])
    n_xs = len(rec.inputs) - nc - nk
    fwd = forwarded_ids(rec)
    const_store = {body.inputs[j].id: x[j] for j in range(nc) if body.inputs[j].id in fwd}
    xs_pos = [
        j for j in range(n_xs) if body.inputs[nc + nk + j].id in fwd and x[nc + nk + j] is not None
    ]
    # Which carries carry a cotangent between steps, which scanned inputs get one.
    c_act = _active_carries(rec)
    x_act = [rec.active[nc + nk + j] for j in range(n_xs)]
    y_ct = [j for j in range(len(rec.outputs) - nk) if gs[nk + j] is not None]
    order = list(range(T) if p["reverse"] else reversed(range(T)))  # backward's step order
    return _Layout(
        rec, body, nc, nk, T, n_xs, const_store, xs_pos, c_act, x_act, y_ct, order, retain
    )


def _step_cts(lay: _Layout, r: Any, ct_c: list, ct_y: list, child: Any) -> tuple[list, list]:
    """One step's backward from its residuals ``r``: (its inputs' cotangents, the carries'
    cotangents for the step before)."""
    body, nc, nk, c_act = lay.body, lay.nc, lay.nk, lay.c_act
    cts = [ct_c[j] if c_act[j] else None for j in range(nk)]
    ys_cts: list[Any] = [None] * (len(lay.rec.outputs) - nk)
    for j, g in zip(lay.y_ct, ct_y):
        ys_cts[j] = g
    in_cts = _body_backward(body, r, cts + ys_cts, lay.retain, child)
    new_c = [
        (in_cts[nc + j] if in_cts[nc + j] is not None else _zeros(body.inputs[nc + j]))
        if c_act[j]
        else None
        for j in range(nk)
    ]
    return in_cts, new_c


def _backward_loop(
    lay: _Layout, x: list, gs: list, stored: Any, observer, ct_c: list, acc: list
) -> tuple[list, list, list]:
    """Python-loop mode: each step's backward on the residuals forward kept for it, freed
    after it unless retained; (carries', consts', scanned inputs' cotangents)."""
    rec, body, nc, nk, T, n_xs = lay.rec, lay.body, lay.nc, lay.nk, lay.T, lay.n_xs
    xs_pos, y_ct, order, retain = lay.xs_pos, lay.y_ct, lay.order, lay.retain
    ct_xs_t: list[Any] = [None] * T
    codes, child = [], None
    for t in order:
        r = stored.steps[t]
        r.store.update(lay.const_store)
        for j in xs_pos:
            r.store[body.inputs[nc + nk + j].id] = x[nc + nk + j][t]
        child = _child(observer, body)
        in_cts, ct_c = _step_cts(lay, r, ct_c, [gs[nk + j][t] for j in y_ct], child)
        codes.append(_codes(child))
        acc = [_add(a, c) for a, c in zip(acc, in_cts[:nc])]
        ct_xs_t[t] = in_cts[nc + nk :]
        if not retain:
            stored.steps[t] = None
        else:  # the step's slices go back in next time: a retained step keeps none
            for j in xs_pos:
                r.store.pop(body.inputs[nc + nk + j].id, None)
    ct_xs = [
        _stack_cts([ct_xs_t[t][j] for t in range(T)], rec.inputs[nc + nk + j])
        if lay.x_act[j]
        else None
        for j in range(n_xs)
    ]
    if child is not None:
        observer.add_loop(rec, child, jnp.stack(codes), order)
    return ct_c, acc, ct_xs


def _backward_scan(
    lay: _Layout, x: list, gs: list, stored: Any, observer, ct_c0: list, acc0: list
) -> tuple[list, list, list]:
    """A reverse ``lax.scan`` over the stacked residuals, each step's rebuilt around the
    body's skeleton; (carries', consts', scanned inputs' cotangents)."""
    rec, body, nc, nk, T = lay.rec, lay.body, lay.nc, lay.nk, lay.T
    p = rec.params
    xs_pos, x_act, const_store = lay.xs_pos, lay.x_act, lay.const_store
    box: dict[str, Any] = {}

    first = T - 1 if p["reverse"] else 0  # the step whose carry-in is the initial carry
    stacks = dict(zip(stored.keys, stored.values))

    def bstep(carry, inp):
        ct_c, acc = carry
        vals, x_sl, ct_y, t = inp
        store = dict(zip(stored.keys, vals))
        for k_in, k_out, init in stored.shifted:
            prev = jnp.clip(t + 1 if p["reverse"] else t - 1, 0, T - 1)
            before = lax.dynamic_index_in_dim(stacks[k_out], prev, keepdims=False)
            store[k_in] = lax.select(t == first, init, before)
        store.update(const_store)
        for j, v in zip(xs_pos, x_sl):
            store[body.inputs[nc + nk + j].id] = v
        child = box["child"] = _child(observer, body)
        in_cts, new_c = _step_cts(lay, _clone(stored.skel, store), ct_c, ct_y, child)
        acc = [_add(a, c) for a, c in zip(acc, in_cts[:nc])]
        ct_x = [
            (c if c is not None else _zeros(body.inputs[nc + nk + j])) if x_act[j] else None
            for j, c in enumerate(in_cts[nc + nk :])
        ]
        return (new_c, acc), (ct_x, _codes(child))

    (ct_c, acc), (ct_xs, codes) = lax.scan(
        bstep,
        (ct_c0, acc0),
        (
            stored.values,
            [x[nc + nk + j] for j in xs_pos],
            [gs[nk + j] for j in lay.y_ct],
            jnp.arange(T),
        ),
        length=T,
        reverse=not p["reverse"],
        unroll=p["unroll"],
    )
    ct_xs = list(ct_xs)
    if observer is not None:
        observer.add_loop(rec, box["child"], codes[jnp.asarray(lay.order, jnp.int32)], lay.order)
    if not lay.retain:
        stored.values = None
    return ct_c, acc, ct_xs
