"""A cond record (``lax.cond``/``switch``), forward and backward.

A cond with a concrete index runs the branch taken; under a trace it is a
``lax.switch`` whose residuals are the union over branches (zeros for the branches not
taken, as jax does), and backward switches on the saved index; a
``lax.platform_dependent`` cond selects by platform again, forward and backward, so only
the lowering platform's branch is compiled.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tapegrad.core.tape import Record
from tapegrad.engine.loops.common import (
    _body_backward,
    _body_forward,
    _child,
    _clone,
    _codes,
    _coerce,
    _concrete,
    _Stored,
    _zeros,
)
from tapegrad.engine.loops.saves import forwarded_ids


def _cond_forward(rec: Record, ins: list, res, observer=None) -> tuple[list, _Stored]:
    idx, ops = ins[0], ins[1:]
    fwd = forwarded_ids(rec)
    n = len(rec.bodies)
    if _concrete([idx, *ops]):
        # Only outside a trace: under one, the branch's residuals must leave as values
        # (a `_Stored`'s leaves), not held in its static part, even when the index is a
        # constant of the traced program.
        b = min(max(_branch_index(idx), 0), n - 1)
        child = _child(observer, rec.bodies[b])
        outs, r = _body_forward(rec.bodies[b], list(ops), res, rec, fwd, child)
        if child is not None:
            observer.add_loop(rec, child, _codes(child)[None], [b])
        for k in fwd:
            r.store.pop(k, None)
        return _coerce(outs, rec.outputs), _Stored(steps=[r], branch=b)

    skels: list[Any] = [None] * n
    keys: list[Any] = [None] * n
    children: list[Any] = [None] * n

    def branch_fn(b):
        def run(*ops):
            child = children[b] = _child(observer, rec.bodies[b])
            outs, r = _body_forward(rec.bodies[b], list(ops), res, rec, fwd, child)
            skels[b], keys[b] = r, [k for k in r.store if k not in fwd]
            return _coerce(outs, rec.outputs), ([r.store[k] for k in keys[b]], _codes(child))

        return run

    outs, union = _switch_union(idx, branch_fn, n, ops, rec.params.get("branches_platforms"))
    for c in range(n):
        skels[c].store = {}
        if observer is not None:
            observer.add_loop(rec, children[c], union[c][1][None], [c])
    return list(outs), _Stored(skel=skels, keys=keys, values=[u[0] for u in union])


def _branch_index(idx) -> int:
    """The Python int of a concrete index, read through ``np.asarray``: ``int(idx)`` on a
    jax array reads ``idx._value``, which on CPU leaves a second array aliasing ``idx``'s
    buffer alive for as long as ``idx`` is, and ``idx`` is a residual (the backward
    switch's index), so ``jax.live_arrays()`` would count its bytes twice."""
    return int(np.asarray(idx))


def _switch_union(idx, branch_fn, n: int, ops, platforms=None):
    """``lax.switch`` over branches that return (outputs, extras of their own structure):
    every branch returns the extras of all branches, zeros for the ones not taken.
    ``platforms``: a platform_dependent cond's ``branches_platforms`` (see `_switch`)."""
    avals: list[Any] = [None] * n

    def typed(b):
        def run(*ops):
            outs, mine = branch_fn(b)(*ops)
            avals[b] = jax.tree.map(jax.typeof, mine)
            return outs, mine

        return run

    for b in range(n):
        jax.eval_shape(typed(b), *ops)

    def with_union(b):
        def run(*ops):
            outs, mine = branch_fn(b)(*ops)
            zeros = [jax.tree.map(_zeros_like_aval, a) for a in avals]
            return outs, [mine if c == b else zeros[c] for c in range(n)]

        return run

    return _switch(idx, [with_union(b) for b in range(n)], ops, platforms)


def _switch(idx, fns: list, ops, platforms):
    """``lax.switch``, or for a ``lax.platform_dependent`` cond the same selection by
    platform again: jax lowers only the branch of the platform it compiles for, whereas a
    switch on the saved index would compile every branch (and its backward) into the
    program, where another platform's branch may not even lower."""
    if platforms is None:
        return lax.switch(idx, fns, *ops)
    per = {p: fn for ps, fn in zip(platforms, fns) if ps is not None for p in ps}
    default = fns[-1] if platforms[-1] is None else None
    return lax.platform_dependent(*ops, default=default, **per)


def _zeros_like_aval(aval):
    """Zeros of ``aval``'s type, in its memory space (an offloaded residual lives on host)."""
    z = jnp.zeros(aval.shape, aval.dtype)
    space = getattr(aval, "memory_space", None)
    if space is not None and space != jax.memory.Space.Device:
        z = jax.device_put(z, space)
    return z


def _cond_backward(
    rec: Record, x: list, stored: _Stored, gs: list, retain: bool, observer=None
) -> list:
    ops_vars = rec.inputs[1:]
    act = rec.active[1:]
    n = len(rec.bodies)
    children: list[Any] = [None] * n

    def run(b, r, ops_saved, dense=True):
        """``dense``: zeros where the branch gives an operand no cotangent (under
        ``lax.switch`` every branch returns the same structure); else None."""
        body = rec.bodies[b]
        for v, val in zip(body.inputs, ops_saved):
            if val is not None:
                r.store[v.id] = val
        child = children[b] = _child(observer, body)
        in_cts = _body_backward(body, r, list(gs), retain, child)
        cts = [
            (c if c is not None or not dense else _zeros(v)) if a else None
            for c, v, a in zip(in_cts, ops_vars, act)
        ]
        return cts, _codes(child)

    if stored.branch is not None:
        b = stored.branch
        cts, codes = run(b, stored.steps[0], x[1:], dense=False)
        if observer is not None:
            observer.add_loop(rec, children[b], codes[None], [b])
    else:

        def bwd(b):
            def f(union, ops_saved):
                r = _clone(stored.skel[b], dict(zip(stored.keys[b], union[b])))
                return run(b, r, ops_saved)

            return f

        platforms = rec.params.get("branches_platforms")
        cts, union = _switch_union(x[0], bwd, n, (stored.values, list(x[1:])), platforms)
        if observer is not None:
            for c in range(n):
                observer.add_loop(rec, children[c], union[c][None], [c])
    return [None] + list(cts)
