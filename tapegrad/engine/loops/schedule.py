"""Checkpointed scans: a scan record with a ``schedule`` (segments of ``k`` steps,
nested levels) or ``snapshots`` (revolve, `tapegrad.engine.loops.revolve`'s plan) keeps carries at
segment starts and re-runs each segment's steps in backward. Every segment is the same
scan record over fewer steps (`_part`), run by the scan kind (`tapegrad.core.tape.kind_of`),
so nested schedules recurse through the one scan implementation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tapegrad.core.residual_policy import SAVE
from tapegrad.core.tape import Record, kind_of
from tapegrad.engine.interpret import forward
from tapegrad.engine.loops.common import (
    _active_carries,
    _add,
    _coerce,
    _concrete,
    _ct_or_zeros,
    _flip,
    _input_cts,
    _leaves,
    _Static,
    _window,
)
from tapegrad.engine.loops.revolve import TURN, revolve_plan


def _forward_part(rec: Record, ins: list, res, observer, start: Any = 0) -> tuple[list, Any]:
    """A segment (`_part`) of a scheduled scan, run by the scan kind (a nested schedule
    runs its own segments the same way)."""
    return kind_of(rec).forward(rec, ins, res, observer, start=start)


def _backward_part(rec: Record, x: list, stored: Any, gs: list, retain: bool, observer) -> list:
    return kind_of(rec).backward(rec, x, stored, gs, retain, observer)


class _Segmented:
    """A scheduled scan's forward: the carry at the start of each full segment (stacked),
    the remainder's ``rem_length`` steps (a `_Stored` kept as usual, or, under a nested
    schedule, a `_Segmented` of the inner levels), and the enclosing `Residuals` whose
    policy the recomputed segments pack with."""

    __slots__ = ("checkpoints", "rem", "res", "rem_length")

    def __init__(self, checkpoints, rem, res, rem_length=0):
        self.checkpoints, self.rem, self.res = checkpoints, rem, res
        self.rem_length = rem_length


jax.tree_util.register_pytree_node(
    _Segmented,
    lambda s: ((s.checkpoints, s.rem), _Static((s.res, s.rem_length))),
    lambda a, c: _Segmented(c[0], c[1], *a.v),
)


def _part(
    rec: Record,
    length: int,
    carries_active: Sequence[bool] | None = None,
    levels: Sequence[int] = (),
) -> Record:
    """The same scan record over ``length`` steps, running forward (a reverse scan's
    segments are run on its flipped inputs), scheduled with the first of ``levels``
    shorter than ``length`` and the ones after it (no schedule when none is)."""
    params = dict(rec.params, length=length, reverse=False)
    active = rec.active
    if carries_active is not None:
        nc, nk = params["num_consts"], params["num_carry"]
        active = active[:nc] + tuple(carries_active) + active[nc + nk :]
    inner = [i for i, k in enumerate(levels) if k < length]
    sched = (levels[inner[0]], tuple(levels[inner[0] + 1 :])) if inner else (0, ())
    return dataclasses.replace(
        rec,
        params=MappingProxyType(params),
        schedule=sched[0],
        inner_schedule=sched[1],
        snapshots=0,
        active=active,
    )


def _split(rec: Record) -> tuple[int, int, int]:
    """(segment length k, full segments n, remainder steps r) of a scheduled scan."""
    T, k = int(rec.params["length"]), rec.schedule
    return k, T // k, T - (T // k) * k


def _segmented_forward(rec: Record, ins: list, res) -> tuple[list, _Segmented]:

    p, body = rec.params, rec.bodies[0]
    nc, nk = p["num_consts"], p["num_carry"]
    rev = bool(p["reverse"])  # top level only: nested segments run forward over windows
    k, n, r = _split(rec)
    consts, init = ins[:nc], list(ins[nc : nc + nk])
    xs = [_window(v, rev) for v in ins[nc + nk :]]

    def plain_step(carry, t):  # forward only: nothing is kept
        outs, _ = forward(body, [*consts, *carry, *(v.step(t) for v in xs)], SAVE)
        return _coerce(outs[:nk], body.outputs[:nk]), _coerce(outs[nk:], body.outputs[nk:])

    def segment(carry, i):
        steps = i * k + jnp.arange(k)
        out, ys = lax.scan(plain_step, carry, steps, length=k, unroll=p["unroll"])
        return out, (ys, carry)

    carry, (ys_main, checkpoints) = lax.scan(segment, init, jnp.arange(n), length=n)
    # Segments and remainder run forward over the steps in the scan's own order.
    rem_ins = [*consts, *carry, *(v.take(n * k, r) for v in xs)]
    rem_rec = _part(rec, r, None, rec.inner_schedule)
    outs_rem, rem = _forward_part(rem_rec, rem_ins, res, None, start=n * k)
    ys = [
        jnp.concatenate([y.reshape((n * k,) + y.shape[2:]), y_rem])
        for y, y_rem in zip(ys_main, outs_rem[nk:])
    ]
    return list(outs_rem[:nk]) + (_flip(ys) if rev else ys), _Segmented(checkpoints, rem, res, r)


def _segmented_backward(rec: Record, x: list, st: _Segmented, gs: list, retain: bool) -> list:
    p, body = rec.params, rec.bodies[0]
    nc, nk = p["num_consts"], p["num_carry"]
    n_xs = len(rec.inputs) - nc - nk
    rev = bool(p["reverse"])
    k, n, r = _split(rec)
    c_act = _active_carries(rec)
    consts = x[:nc]
    xs, g_ys = [_window(v, rev) for v in x[nc + nk :]], [_window(g, rev) for g in gs[nk:]]
    x_in = [rec.inputs[nc + nk + j] for j in range(n_xs)]

    def carry_cts(in_cts):
        return [
            _ct_or_zeros(c, body.inputs[nc + j].shape, body.inputs[nc + j].dtype)
            if c_act[j]
            else None
            for j, c in enumerate(in_cts[nc : nc + nk])
        ]

    def steps(vals, start, size):
        return [None if v is None else v.take(start, size) for v in vals]

    # The remainder ran last: its backward comes first.
    x_rem = [*consts, *([None] * nk), *steps(xs, n * k, r)]
    gs_rem = [*gs[:nk], *steps(g_ys, n * k, r)]
    rem_rec = _part(rec, r, c_act, rec.inner_schedule)
    in_rem = _backward_part(rem_rec, x_rem, st.rem, gs_rem, retain, None)
    ct_c = carry_cts(in_rem)
    acc = [
        _ct_or_zeros(c, body.inputs[j].shape, body.inputs[j].dtype) if rec.active[j] else None
        for j, c in enumerate(in_rem[:nc])
    ]
    seg_rec = _part(rec, k, c_act, rec.inner_schedule)  # nested: checkpointed again

    def seg_bwd(carry, inp):
        ct_c, acc = carry
        cp, i = inp
        xseg = steps(xs, i * k, k)
        # Recompute this segment's residuals from its carry, then run its backward.
        _, stored = _forward_part(seg_rec, [*consts, *cp, *xseg], st.res, None, start=i * k)
        seg_gs = [*ct_c, *steps(g_ys, i * k, k)]
        # The recomputed residuals are this call's own: free each step once it is used.
        in_cts = _backward_part(
            seg_rec, [*consts, *([None] * nk), *xseg], stored, seg_gs, False, None
        )
        acc = [_add(a, c) for a, c in zip(acc, in_cts[:nc])]
        ct_x = [
            _ct_or_zeros(c, (k,) + v.shape[1:], v.dtype) if rec.active[nc + nk + j] else None
            for j, (c, v) in enumerate(zip(in_cts[nc + nk :], x_in))
        ]
        return (carry_cts(in_cts), acc), ct_x

    if not st.res.plain and _concrete(_leaves([*consts, *xs, *jax.tree.leaves(st.checkpoints)])):
        per_seg: list[Any] = [None] * n
        for i in reversed(range(n)):  # eagerly, the policy sees concrete steps
            inp = ([c[i] for c in st.checkpoints], i)
            (ct_c, acc), per_seg[i] = seg_bwd((ct_c, acc), inp)
        ct_main = [
            jnp.stack([per_seg[i][j] for i in range(n)]) if rec.active[nc + nk + j] else None
            for j in range(n_xs)
        ]
    else:
        (ct_c, acc), ct_main = lax.scan(
            seg_bwd, (ct_c, acc), (st.checkpoints, jnp.arange(n)), length=n, reverse=True
        )
    ct_xs: list[Any] = [None] * n_xs
    for j in range(n_xs):
        if rec.active[nc + nk + j]:
            seg_ct = ct_main[j]
            assert seg_ct is not None  # an active scanned input gets a cotangent per segment
            main = seg_ct.reshape((n * k,) + seg_ct.shape[2:])
            rem_ct = _ct_or_zeros(in_rem[nc + nk + j], (r,) + main.shape[1:], main.dtype)
            ct = jnp.concatenate([main, rem_ct])  # in run order
            ct_xs[j] = jnp.flip(ct, 0) if rev else ct
    return _input_cts(rec, acc, ct_c, c_act, ct_xs)


def revolve_forward(rec: Record, ins: list, res) -> tuple[list, Any]:
    """A revolve-scheduled scan's outputs and what backward needs: the spine's snapshots
    and the last step's residuals (packed through ``res.policy``)."""

    p, body = rec.params, rec.bodies[0]
    nc, nk = p["num_consts"], p["num_carry"]
    rev = bool(p["reverse"])
    T = int(p["length"])
    plan = revolve_plan(T, rec.snapshots)
    consts, init = ins[:nc], _coerce(ins[nc : nc + nk], body.inputs[nc : nc + nk])
    xs = [_window(v, rev) for v in ins[nc + nk :]]

    def advance(carry, t):
        outs, _ = forward(body, [*consts, *carry, *(v.step(t) for v in xs)], SAVE)
        return _coerce(outs[:nk], body.outputs[:nk]), _coerce(outs[nk:], body.outputs[nk:])

    n0 = len(plan.spine)
    if not res.plain and _concrete(_leaves([*consts, *init, *xs])):
        # Eagerly the snapshots are the carries themselves (no copy into a buffer).
        carry, snaps, ys_t = init, [], []
        for t in range(T - 1):
            if plan.forward_store[t] >= 0:
                snaps.append(tuple(carry))
            carry, y = advance(carry, t)
            ys_t.append(y)
        ys_main = [
            jnp.stack([y[j] for y in ys_t]) if ys_t else jnp.zeros((0,) + v.shape[1:], v.dtype)
            for j, v in enumerate(rec.outputs[nk:])
        ]
        checkpoints: Any = tuple(snaps)
    else:
        # One scan over the first T-1 steps; a step's carry goes to its slot, or to a
        # scratch row past the spine (an unconditional in-place write, no select).
        slot = np.where(plan.forward_store >= 0, plan.forward_store, n0).astype(np.int32)

        def step(state, inp):
            carry, buf = state
            t, i = inp
            buf = [lax.dynamic_update_index_in_dim(b, c, i, 0) for b, c in zip(buf, carry)]
            carry, y = advance(carry, t)
            return (carry, buf), y

        buf0 = [jnp.broadcast_to(c[None], (n0 + 1, *jnp.shape(c))) for c in init]
        (carry, buf), ys_main = lax.scan(
            step,
            (init, buf0),
            (jnp.arange(T - 1, dtype=jnp.int32), jnp.asarray(slot)),
            length=T - 1,
            unroll=p["unroll"],
        )
        checkpoints = [b[:n0] for b in buf]
    # The last step runs as a 1-step segment whose residuals are kept.
    last = _part(rec, 1)
    last_ins = [*consts, *carry, *(v.take(T - 1, 1) for v in xs)]
    outs, rem = _forward_part(last, last_ins, res, None, start=T - 1)
    ys = [jnp.concatenate([a, b]) for a, b in zip(ys_main, outs[nk:])]
    return list(outs[:nk]) + (_flip(ys) if rev else ys), _Segmented(checkpoints, rem, res, 1)


def revolve_backward(rec: Record, x: list, st: Any, gs: list, retain: bool) -> list:
    """Cotangents of a revolve-scheduled scan's inputs: the kept last step's backward,
    then the plan's actions (restore/store snapshots, advance or turn one step)."""

    p, body = rec.params, rec.bodies[0]
    nc, nk = p["num_consts"], p["num_carry"]
    n_xs = len(rec.inputs) - nc - nk
    rev = bool(p["reverse"])
    T = int(p["length"])
    plan = revolve_plan(T, rec.snapshots)
    c_act = _active_carries(rec)
    x_act = [rec.active[nc + nk + j] for j in range(n_xs)]
    consts = x[:nc]
    xs, g_ys = [_window(v, rev) for v in x[nc + nk :]], [_window(g, rev) for g in gs[nk:]]
    step_in = [body.inputs[nc + nk + j] for j in range(n_xs)]  # one step of each xs
    one = _part(rec, 1, c_act)

    def turn(carry, ct_c, acc, t, keep):
        """Step t's residuals from its carry, then its backward."""
        if keep is None:
            _, keep = _forward_part(one, [*consts, *carry, *_one_step(xs, t)], st.res, None, t)
        in_cts = _backward_part(
            one,
            [*consts, *([None] * nk), *_one_step(xs, t)],
            keep,
            [*ct_c, *_one_step(g_ys, t)],
            retain and keep is st.rem,
            None,
        )
        acc = [_add(a, c) for a, c in zip(acc, in_cts[:nc])]
        ct_x = [
            _ct_or_zeros(c if c is None else c[0], v.shape, v.dtype) if x_act[j] else None
            for j, (c, v) in enumerate(zip(in_cts[nc + nk :], step_in))
        ]
        ct_c = [
            _ct_or_zeros(c, v.shape, v.dtype) if c_act[j] else None
            for j, (c, v) in enumerate(zip(in_cts[nc : nc + nk], body.inputs[nc : nc + nk]))
        ]
        return ct_c, acc, ct_x

    def advance(carry, t):
        outs, _ = forward(body, [*consts, *carry, *(v.step(t) for v in xs)], SAVE)
        return _coerce(outs[:nk], body.outputs[:nk])

    ct_c = [
        _ct_or_zeros(g, v.shape, v.dtype) if c_act[j] else None
        for j, (g, v) in enumerate(zip(gs[:nk], body.inputs[nc : nc + nk]))
    ]
    acc = [
        jnp.zeros(body.inputs[j].shape, body.inputs[j].dtype) if rec.active[j] else None
        for j in range(nc)
    ]
    # The last step ran last and kept its residuals: its backward comes first.
    ct_c, acc, ct_last = turn(None, ct_c, acc, T - 1, st.rem)
    cps = st.checkpoints
    if not retain:
        st.checkpoints = None  # the slots below take the snapshots over
    if (
        plan.recomputed
        and not st.res.plain
        and _concrete(_leaves([*consts, *xs, *jax.tree.leaves(cps)]))
    ):
        slots: list[Any] = _snapshot_list(cps, nk) + [None] * (plan.slots - len(plan.spine))
        cps = None  # a slot overwritten frees its snapshot (unless forward's are retained)
        ct_c, acc, ct_main = _replay_eagerly(plan, slots, x_act, turn, advance, ct_c, acc)
    elif plan.recomputed:
        buf = _snapshot_buffer(cps, nk, plan.slots + 1)  # + a scratch row
        ct_c, acc, ct_main = _replay_in_scan(plan, buf, step_in, x_act, turn, advance, ct_c, acc)
    else:
        ct_main = [
            jnp.zeros((0, *v.shape), v.dtype) if x_act[j] else None for j, v in enumerate(step_in)
        ]
    ct_xs: list[Any] = [None] * n_xs
    for j in range(n_xs):
        if x_act[j]:
            ct = jnp.concatenate([ct_main[j], ct_last[j][None]])  # in run order
            ct_xs[j] = jnp.flip(ct, 0) if rev else ct
    return _input_cts(rec, acc, ct_c, c_act, ct_xs)


def _one_step(vals: list, t: Any) -> list:
    """Step ``t`` of each windowed value (None stays None)."""
    return [None if v is None else v.take(t, 1) for v in vals]


def _replay_eagerly(
    plan: Any, slots: list, x_act: list, turn: Callable, advance: Callable, ct_c: list, acc: list
) -> tuple[list, list, list]:
    """The revolve plan's actions as a Python loop over the snapshots ``slots`` (each a
    tuple of carries): (the carries' and consts' cotangents, the scanned inputs' stacked
    cotangents of the first T-1 steps)."""
    ct_rows: list[Any] = [None] * (plan.length - 1)
    carry: Any = None
    for t, kind, restore, store in plan.actions.tolist():
        if restore >= 0:
            carry = slots[restore]
        if store >= 0:
            slots[store] = carry
        if kind == TURN:
            ct_c, acc, ct_rows[t] = turn(carry, ct_c, acc, t, None)
        else:
            carry = tuple(advance(carry, t))
    ct_main: list[Any] = [
        jnp.stack([row[j] for row in ct_rows]) if x_act[j] else None for j in range(len(x_act))
    ]
    return ct_c, acc, ct_main


def _replay_in_scan(
    plan: Any,
    buf: list,
    step_in: list,
    x_act: list,
    turn: Callable,
    advance: Callable,
    ct_c: list,
    acc: list,
) -> tuple[list, list, list]:
    """The revolve plan's actions as one ``lax.scan`` over them, the snapshots stacked per
    carry in ``buf`` (with a scratch row last): as `_replay_eagerly`."""
    scratch = plan.slots

    def act(state, a):
        carry, buf, ct_c, acc, ct_buf = state
        t, kind, restore, store = a[0], a[1], a[2], a[3]
        got = [lax.dynamic_index_in_dim(b, jnp.maximum(restore, 0), 0, False) for b in buf]
        carry = [lax.select(restore >= 0, g, c) for g, c in zip(got, carry)]
        at = jnp.where(store >= 0, store, scratch)
        buf = [lax.dynamic_update_index_in_dim(b, c, at, 0) for b, c in zip(buf, carry)]

        def do_turn(op):
            carry, ct_c, acc = op
            ct_c, acc, ct_x = turn(carry, ct_c, acc, t, None)
            return carry, ct_c, acc, ct_x

        def do_advance(op):
            carry, ct_c, acc = op
            zeros = [
                jnp.zeros(v.shape, v.dtype) if x_act[j] else None for j, v in enumerate(step_in)
            ]
            return advance(carry, t), ct_c, acc, zeros

        carry, ct_c, acc, ct_x = lax.cond(
            kind == TURN, do_turn, do_advance, (list(carry), ct_c, acc)
        )
        # Steps below the one being reversed have no cotangent yet: an advance's
        # zeros are overwritten by that step's own turn later.
        ct_buf = [
            None if b is None else lax.dynamic_update_index_in_dim(b, c, t, 0)
            for b, c in zip(ct_buf, ct_x)
        ]
        return (carry, buf, ct_c, acc, ct_buf), None

    carry0 = [lax.dynamic_index_in_dim(b, 0, 0, False) for b in buf]
    ct_buf0 = [
        jnp.zeros((plan.length - 1, *v.shape), v.dtype) if x_act[j] else None
        for j, v in enumerate(step_in)
    ]
    (_, _, ct_c, acc, ct_main), _ = lax.scan(
        act, (carry0, buf, ct_c, acc, ct_buf0), jnp.asarray(plan.actions)
    )
    return ct_c, acc, ct_main


def _snapshot_list(cps, nk: int) -> list:
    """Snapshots as one tuple of carries each (forward kept a tuple of them eagerly, or
    one stacked array per carry)."""
    if isinstance(cps, tuple):
        return list(cps)
    n = cps[0].shape[0] if nk else 0
    return [tuple(c[i] for c in cps) for i in range(n)]


def _snapshot_buffer(cps, nk: int, rows: int) -> list:
    """Snapshots stacked per carry, padded to ``rows`` rows (slots not yet used)."""
    if isinstance(cps, tuple):
        cps = [jnp.stack([s[j] for s in cps]) for j in range(nk)]
    return [
        jnp.concatenate([c, jnp.broadcast_to(c[:1], (rows - c.shape[0], *c.shape[1:]))])
        for c in cps
    ]
