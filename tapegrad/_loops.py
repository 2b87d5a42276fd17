"""Forward and backward of loop and branch records (``scan``, ``cond``).

A loop record carries its body as a `Tape`; its forward runs the *same*
forward interpreter on that body once per step, and its backward runs the same
backward interpreter once per step in the opposite order. Nothing here knows
a rule: it only moves values between steps.

* Per-step residuals are packed inside the step, through the active policy, so
  a policy that moves or shrinks a residual does it step by step. Residuals
  that are the body's loop-invariant inputs (a scan's consts) or its scanned
  slices are not stacked: the outer record saves them once (its ``saves``) and
  backward hands them (or the step's slice) back to the body.
* Under a trace, or eagerly with `save()`, a scan is a ``lax.scan`` whose body
  runs the interpreter: the packed residuals leave it as stacked outputs, and
  backward is a reverse ``lax.scan`` over them. Eagerly with any other policy
  the steps run as a Python loop, so the policy sees concrete arrays one step
  at a time (offload really moves each step to host as it is produced).
* A cond with a concrete index runs the branch taken; under a trace it is a
  ``lax.switch`` whose residuals are the union over branches (zeros for the
  branches not taken, as jax does), and backward switches on the saved index;
  a ``lax.platform_dependent`` cond selects by platform again, forward and
  backward, so only the lowering platform's branch is compiled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tapegrad._tape import Lit, Record, Saved, Tape, Var, as_dtype

__all__ = ["loop_forward", "loop_backward", "forwarded_ids"]


def forwarded_ids(rec: Record) -> frozenset[int]:
    """Ids of the body inputs whose residuals the outer record keeps once (consts and
    scanned slices of a scan, every operand of a cond)."""
    body = rec.bodies[0]
    if rec.primitive == "cond":
        return frozenset(v.id for b in rec.bodies for v in b.inputs)
    nc, nk = rec.params["num_consts"], rec.params["num_carry"]
    return frozenset(v.id for j, v in enumerate(body.inputs) if j < nc or j >= nc + nk)


def outer_saves(rec: Record) -> tuple[Saved, ...]:
    """What a loop/branch record keeps itself: the inputs its bodies' residuals forward
    (kept once, not per step), and a cond's index (backward runs the branch it picks)."""
    keep: set[int] = {0} if rec.primitive == "cond" else set()
    if rec.schedule or rec.snapshots:  # segments re-run from every const and scanned input
        nc, nk = rec.params["num_consts"], rec.params["num_carry"]
        keep.update(j for j in range(len(rec.inputs)) if j < nc or j >= nc + nk)
    for body in rec.bodies:
        kept, _ = body.residual_keys()
        pos = _outer_positions(rec, body)
        keep.update(pos[k] for k in kept if k in pos)
    return tuple(
        Saved("in", i, tuple(v.shape), as_dtype(v.dtype))
        for i in sorted(keep)
        if not isinstance(v := rec.inputs[i], Lit)
    )


def _outer_positions(rec: Record, body: Tape) -> dict[int, int]:
    """Body input id -> the outer input it is (or is sliced from), for forwarded inputs."""
    if rec.primitive == "cond":
        return {v.id: j + 1 for j, v in enumerate(body.inputs)}
    nc, nk = rec.params["num_consts"], rec.params["num_carry"]
    return {v.id: j for j, v in enumerate(body.inputs) if j < nc or j >= nc + nk}


class _Stored:
    """The per-step residuals of one loop/branch record's forward.

    ``skel`` is a body `Residuals` without values (keys, refs, infos, policy); ``keys``
    the order of the per-step values; ``values`` their stacked (scan) or union (switch)
    values, or ``steps``: one `Residuals` per step (Python-loop mode, concrete cond).
    """

    __slots__ = ("skel", "keys", "values", "steps", "branch", "shifted")

    def __init__(self, skel=None, keys=None, values=None, steps=None, branch=None, shifted=()):
        self.skel, self.keys, self.values, self.steps, self.branch = (
            skel,
            keys,
            values,
            steps,
            branch,
        )
        # (carry-in key, carry-out key, initial carry): the carry a step saves is the
        # previous step's saved output, so only the outputs are stacked (see _carry_pairs).
        self.shifted = shifted


class _Static:
    """Pytree metadata that never tells two traces apart: the branches of a
    ``lax.switch`` (and its ``eval_shape``) trace a nested record's skeleton separately,
    and the skeletons hold equal structure in different objects."""

    __slots__ = ("v",)

    def __init__(self, v):
        self.v = v

    def __eq__(self, other) -> bool:
        return type(other) is _Static

    def __hash__(self) -> int:
        return 0


# A nested loop's residuals leave the enclosing step as a pytree: its values are leaves.
jax.tree_util.register_pytree_node(
    _Stored,
    lambda s: (
        (s.values, [init for _, _, init in s.shifted]),
        _Static((s.skel, s.keys, s.steps, s.branch, [k[:2] for k in s.shifted])),
    ),
    lambda a, c: _Stored(
        a.v[0], a.v[1], c[0], a.v[2], a.v[3], tuple((*k, i) for k, i in zip(a.v[4], c[1]))
    ),
)


def _concrete(vals: Sequence[Any]) -> bool:
    return not any(isinstance(v, jax.core.Tracer) for v in vals)


def _coerce(vals: Sequence[Any], vars_) -> list:
    """Body outputs as arrays of the body's declared types (lax.scan checks carries)."""
    out = []
    for v, var in zip(vals, vars_):
        a = jnp.asarray(v)
        if a.dtype != var.dtype and jnp.issubdtype(var.dtype, jnp.number):
            a = a.astype(var.dtype)
        out.append(a)
    return out


def loop_forward(rec: Record, ins: list, res, observer=None) -> tuple[list, _Stored]:
    """Outputs of a loop/branch record and its per-step residuals, packed through
    ``res.policy`` (``res`` is the enclosing tape's `Residuals`). An anomaly
    ``observer`` receives the body's checks of every step as one block."""
    if rec.primitive == "cond":
        return _cond_forward(rec, ins, res, observer)
    return _scan_forward(rec, ins, res, observer)


def loop_backward(
    rec: Record, x: list, stored: _Stored, gs: list, retain: bool, observer=None
) -> list:
    """Cotangents of a loop/branch record's inputs (None where none); ``x`` holds the
    record's saved inputs (consts, scanned inputs, a cond's index and operands)."""
    if rec.primitive == "cond":
        return _cond_backward(rec, x, stored, gs, retain, observer)
    return _scan_backward(rec, x, stored, gs, retain, observer)


def _body_forward(
    body: Tape, args, res, rec: Record, fwd: frozenset[int], child=None, step: Any = 0
):
    """One step (``step``: its index, an int or a traced uint32) or branch of ``rec``."""
    from tapegrad._interpret import forward

    loops, steps = res.loops + (rec,), res.steps + (step,)
    return forward(body, args, res.policy, loops=loops, steps=steps, forwarded=fwd, observer=child)


def _body_backward(body: Tape, r, cts, retain: bool, child=None) -> list:
    from tapegrad._interpret import backward

    return backward(body, r, cts, retain=retain, observer=child)


def _clone(skel, store: dict):
    from tapegrad._interpret import Residuals

    r = Residuals(skel.policy)
    r.store = store
    r.refs, r.keys, r.infos = skel.refs, skel.keys, skel.infos
    r.input_ids, r.plain, r.raw, r.loops = skel.input_ids, skel.plain, skel.raw, skel.loops
    return r


def _child(observer, body: Tape):
    """An anomaly observer for one step of ``body`` (None when anomaly mode is off)."""
    return observer.child(body) if observer is not None else None


def _codes(child):
    return child.step_codes() if child is not None else jnp.zeros((0,), jnp.float32)


def _zeros(var):
    return jnp.zeros(var.shape, var.dtype)


def _carry_pairs(rec: Record, keys) -> list[tuple[int, int, int]]:
    """(carry-in key, carry-out key, carry index) for each carry whose value is saved both
    as the step's input and as the step's output (an RNN's ``h``: ``tanh`` saves its output,
    the next step's ``h @ w`` saves its input). Step t's input is step t-1's output, so
    keeping both would store the whole sequence twice."""
    body = rec.bodies[0]
    nc, nk = rec.params["num_consts"], rec.params["num_carry"]
    ins = {v.id for v in body.inputs}
    pairs = []
    for j in range(nk):
        k_in, out = body.inputs[nc + j].id, body.outputs[j]
        if isinstance(out, Var) and out.id not in ins and k_in in keys and out.id in keys:
            pairs.append((k_in, out.id, j))
    return pairs


# ------------------------------------------------------------------------ scan


def _scan_forward(rec: Record, ins: list, res, observer, start: Any = 0) -> tuple[list, Any]:
    """``start``: the index of the first step run here (a segment's offset in its scan)."""
    if rec.snapshots and observer is None:
        from tapegrad._revolve import revolve_forward

        return revolve_forward(rec, ins, res)
    if rec.schedule and observer is None:
        return _segmented_forward(rec, ins, res)
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


def _scan_backward(rec: Record, x: list, stored: Any, gs: list, retain: bool, observer) -> list:
    if isinstance(stored, _Segmented):
        if rec.snapshots:
            from tapegrad._revolve import revolve_backward

            return revolve_backward(rec, x, stored, gs, retain)
        return _segmented_backward(rec, x, stored, gs, retain)
    x, gs = _arrays(x), _arrays(gs)
    p = rec.params
    body = rec.bodies[0]
    nc, nk, T = p["num_consts"], p["num_carry"], int(p["length"])
    n_xs = len(rec.inputs) - nc - nk
    fwd = forwarded_ids(rec)
    const_store = {body.inputs[j].id: x[j] for j in range(nc) if body.inputs[j].id in fwd}
    xs_pos = [
        j for j in range(n_xs) if body.inputs[nc + nk + j].id in fwd and x[nc + nk + j] is not None
    ]
    # Which carries carry a cotangent between steps, which consts accumulate one.
    c_act = _active_carries(rec)
    k_act = [rec.active[j] for j in range(nc)]
    x_act = [rec.active[nc + nk + j] for j in range(n_xs)]
    y_ct = [j for j in range(len(rec.outputs) - nk) if gs[nk + j] is not None]
    order = list(range(T) if p["reverse"] else reversed(range(T)))  # backward's step order

    def step_cts(r, ct_c, ct_y, child):
        cts = [ct_c[j] if c_act[j] else None for j in range(nk)]
        ys_cts: list[Any] = [None] * (len(rec.outputs) - nk)
        for j, g in zip(y_ct, ct_y):
            ys_cts[j] = g
        in_cts = _body_backward(body, r, cts + ys_cts, retain, child)
        new_c = [
            (in_cts[nc + j] if in_cts[nc + j] is not None else _zeros(body.inputs[nc + j]))
            if c_act[j]
            else None
            for j in range(nk)
        ]
        return in_cts, new_c

    ct_c0 = [
        (gs[j] if gs[j] is not None else _zeros(body.inputs[nc + j])) if c_act[j] else None
        for j in range(nk)
    ]
    acc0 = [_zeros(body.inputs[j]) if k_act[j] else None for j in range(nc)]

    if stored.steps is not None:  # Python-loop mode
        ct_c, acc = ct_c0, acc0
        ct_xs_t: list[Any] = [None] * T
        codes, child = [], None
        for t in order:
            r = stored.steps[t]
            r.store.update(const_store)
            for j in xs_pos:
                r.store[body.inputs[nc + nk + j].id] = x[nc + nk + j][t]
            child = _child(observer, body)
            in_cts, ct_c = step_cts(r, ct_c, [gs[nk + j][t] for j in y_ct], child)
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
            if x_act[j]
            else None
            for j in range(n_xs)
        ]
        if child is not None:
            observer.add_loop(rec, child, jnp.stack(codes), order)
    else:
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
            in_cts, new_c = step_cts(_clone(stored.skel, store), ct_c, ct_y, child)
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
                [gs[nk + j] for j in y_ct],
                jnp.arange(T),
            ),
            length=T,
            reverse=not p["reverse"],
            unroll=p["unroll"],
        )
        ct_xs = list(ct_xs)
        if observer is not None:
            observer.add_loop(rec, box["child"], codes[jnp.asarray(order, jnp.int32)], order)
        if not retain:
            stored.values = None
    return _input_cts(rec, acc, ct_c, c_act, ct_xs)


def _active_carries(rec: Record) -> list[bool]:
    """Which carries pass a cotangent from step to step (active and differentiable)."""
    from tapegrad._trace import is_differentiable_dtype

    body, nc = rec.bodies[0], rec.params["num_consts"]
    return [
        body.active_inputs[nc + j] and is_differentiable_dtype(body.inputs[nc + j].dtype)
        for j in range(rec.params["num_carry"])
    ]


def _input_cts(rec: Record, acc: list, ct_c: list, c_act: list, ct_xs: list) -> list:
    """A scan record's input cotangents: accumulated consts, the initial carries', the
    scanned inputs'; None for inputs that get none."""
    nc, nk = rec.params["num_consts"], rec.params["num_carry"]
    cts = [*acc, *ct_c, *ct_xs]
    return [
        c if rec.active[i] and (not nc <= i < nc + nk or c_act[i - nc]) else None
        for i, c in enumerate(cts)
    ]


def _add(a, c):
    if a is None or c is None:
        return a
    return lax.add(a, c.astype(a.dtype) if c.dtype != a.dtype else c)


def _stack_cts(cts: list, var) -> Any:
    per = [c if c is not None else jnp.zeros(var.shape[1:], var.dtype) for c in cts]
    return jnp.stack(per) if per else jnp.zeros((0,) + var.shape[1:], var.dtype)


# ------------------------------------------------------------------------ cond


def _cond_forward(rec: Record, ins: list, res, observer) -> tuple[list, _Stored]:
    idx, ops = ins[0], ins[1:]
    fwd = forwarded_ids(rec)
    n = len(rec.bodies)
    if _concrete([idx, *ops]):
        # Only outside a trace: under one, the branch's residuals must leave as values
        # (a `_Stored`'s leaves), not held in its static part, even when the index is a
        # constant of the traced program.
        b = int(min(max(int(idx), 0), n - 1))
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


def _cond_backward(rec: Record, x: list, stored: _Stored, gs: list, retain: bool, observer) -> list:
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


# ------------------------------------------------------------ scan checkpointing


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


def schedule_levels(rec: Record) -> tuple[int, ...]:
    """A scan's segment lengths, outermost first (() when it keeps every step)."""
    return (rec.schedule, *rec.inner_schedule) if rec.schedule else ()


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


def _flip(vals: Sequence[Any]) -> list:
    """Scanned values in the order a reverse scan runs its steps (None stays None)."""
    return [None if v is None else jnp.flip(v, 0) for v in vals]


def _split(rec: Record) -> tuple[int, int, int]:
    """(segment length k, full segments n, remainder steps r) of a scheduled scan."""
    T, k = int(rec.params["length"]), rec.schedule
    return k, T // k, T - (T // k) * k


class _Window:
    """Steps ``start`` to ``start + length`` of a scanned input (or a ys cotangent), counted
    in the order the scan runs them (``rev``: it runs ``base`` last to first). A nested
    schedule hands its segments windows, not slices: only the innermost segment, and one
    step at a time of a plain forward run, are ever copied out of ``base``."""

    __slots__ = ("base", "start", "length", "rev")

    def __init__(self, base, start, length: int, rev: bool):
        self.base, self.start, self.length, self.rev = base, start, length, rev

    def take(self, start, size: int) -> _Window:
        return _Window(self.base, self.start + start, size, self.rev)

    def step(self, t):
        """Step ``t`` (may be traced) of the window."""
        i = self.start + t
        i = self.base.shape[0] - 1 - i if self.rev else i
        return lax.dynamic_index_in_dim(self.base, i, keepdims=False)

    def array(self):
        if not self.rev:
            return lax.dynamic_slice_in_dim(self.base, self.start, self.length)
        end = self.base.shape[0] - self.start - self.length
        return jnp.flip(lax.dynamic_slice_in_dim(self.base, end, self.length), 0)


def _window(v, rev: bool):
    """A scanned input as a window of all its steps (None and windows pass through)."""
    if v is None or isinstance(v, _Window):
        return v
    return _Window(v, 0, v.shape[0], rev)


def _arrays(vals: Sequence[Any]) -> list:
    return [v.array() if isinstance(v, _Window) else v for v in vals]


def _leaves(vals: Sequence[Any]) -> list:
    """The arrays behind ``vals`` (a window's base and start), for `_concrete`."""
    return [x for v in vals for x in ((v.base, v.start) if isinstance(v, _Window) else (v,))]


def _segmented_forward(rec: Record, ins: list, res) -> tuple[list, _Segmented]:
    from tapegrad._interpret import forward
    from tapegrad._policy import SAVE

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
    outs_rem, rem = _scan_forward(rem_rec, rem_ins, res, None, start=n * k)
    ys = [
        jnp.concatenate([y.reshape((n * k,) + y.shape[2:]), y_rem])
        for y, y_rem in zip(ys_main, outs_rem[nk:])
    ]
    return list(outs_rem[:nk]) + (_flip(ys) if rev else ys), _Segmented(checkpoints, rem, res, r)


def _ct_or_zeros(c, shape, dtype):
    return c if c is not None else jnp.zeros(shape, dtype)


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
    in_rem = _scan_backward(rem_rec, x_rem, st.rem, gs_rem, retain, None)
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
        _, stored = _scan_forward(seg_rec, [*consts, *cp, *xseg], st.res, None, start=i * k)
        seg_gs = [*ct_c, *steps(g_ys, i * k, k)]
        # The recomputed residuals are this call's own: free each step once it is used.
        in_cts = _scan_backward(
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


@dataclasses.dataclass(frozen=True)
class ScheduleCosts:
    """What a scan's checkpoint schedule holds and recomputes, in carries and steps.

    ``levels``: segment lengths, outermost first; ``carries`` / ``steps``: carries and
    steps' residuals kept after forward (a remainder shorter than every level keeps its
    steps); ``peak_carries`` / ``peak_steps``: held at once at backward's peak (the kept
    ones included); ``recomputed``: forward steps backward runs again (T per level
    at most). A revolve schedule (``snapshots``, `scan_checkpoint(snapshots=s)`) has no
    levels: forward keeps its spine's snapshots and the last step; backward holds its
    snapshot slots, the carry in hand and one step's residuals at a time."""

    levels: tuple[int, ...]
    carries: int
    steps: int
    peak_carries: int
    peak_steps: int
    recomputed: int
    snapshots: int = 0


def _schedule_plan(T: int, levels: Sequence[int]):
    """(carries kept, steps kept, [(carries, steps) held during backward], recomputed)
    of ``T`` steps under ``levels``, as `_segmented_forward`/`_backward` run them."""
    first = next((i for i, k in enumerate(levels) if k < T), None)
    if first is None:
        return 0, T, [(0, T)], 0
    k, inner = levels[first], levels[first + 1 :]
    n, r = T // k, T % k
    rc, rs, r_held, r_rec = _schedule_plan(r, inner)
    _, _, s_held, s_rec = _schedule_plan(k, inner)
    held = [(n + c, s) for c, s in r_held] + ([(n + c, s) for c, s in s_held] if n else [])
    return n + rc, rs, held, r_rec + n * (k + s_rec)


def schedule_costs(rec: Record) -> ScheduleCosts | None:
    """`ScheduleCosts` of a scheduled scan record (None without a schedule); the peak is
    the point of backward holding the most bytes (`loop_bytes`' step and carry sizes)."""
    from tapegrad._tape import loop_bytes

    if rec.primitive == "scan" and rec.snapshots:
        from tapegrad._revolve import revolve_counts

        kept, slots, recomputed = revolve_counts(rec)
        held = slots + 1 if recomputed else 0  # the slots and the carry in hand
        return ScheduleCosts((), kept, 1, held, 1, recomputed, rec.snapshots)
    levels = schedule_levels(rec)
    if rec.primitive != "scan" or not levels:
        return None
    carries, steps, held, recomputed = _schedule_plan(rec.trip_count, levels)
    lb = loop_bytes(rec)
    pc, ps = max(held, key=lambda h: dataclasses.replace(lb, checkpoints=h[0], steps=h[1]).total)
    return ScheduleCosts(levels, carries, steps, pc, ps, recomputed)


def schedule_text(rec: Record) -> str:
    """A scheduled scan's costs in words (for reports): ``keeps 10 carries + 0 steps;
    peak 20 carries + 10 steps; re-runs 2,000 steps`` (backward's peak, forward steps)."""
    c = schedule_costs(rec)
    if c is None:
        return ""
    return (
        f"keeps {c.carries:,} carries + {c.steps:,} steps; peak "
        f"{c.peak_carries:,} carries + {c.peak_steps:,} steps; re-runs {c.recomputed:,} steps"
    )
