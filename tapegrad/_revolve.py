"""Binomial checkpointing (Griewank's *revolve*) for a scan record.

With ``s`` carry snapshots held at once (the initial carry is one of them), revolve
reverses ``T`` steps re-running the fewest forward steps: with ``r`` repetitions per
step at most ``β(s, r) = C(s + r, s)`` steps can be reversed, and ``T`` steps cost
``r·T − β(s + 1, r − 1)`` re-run steps for the least such ``r`` (Griewank 1992).

The schedule is computed here in Python from ``T`` and ``s`` (`revolve_plan`) as a
list of unit actions, each on one step ``t``: restore the carry from a snapshot slot,
store the carry in a slot, then *advance* (run step ``t``'s forward, keeping nothing)
or *turn* (run step ``t``'s forward keeping its residuals, then its backward). Forward
runs the first actions (advances along the schedule's spine, storing its snapshots) and
records the last step; backward runs the rest as one ``lax.scan`` over the actions (or,
eagerly under a policy other than `save()`, a Python loop, so the policy sees concrete
steps). Nothing is unrolled: the program holds one step's forward and one 1-step
segment (`_loops._part`) run by the same segment runner as every other schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tapegrad._tape import Record

__all__ = ["RevolvePlan", "revolve_plan", "revolve_reruns", "binomial_steps"]

ADVANCE, TURN = 0, 1


def binomial_steps(snapshots: int, repetitions: int) -> int:
    """β(s, r) = C(s + r, s): the most steps ``s`` snapshots reverse when no step's forward
    runs more than ``r`` times beyond the first."""
    return math.comb(snapshots + repetitions, snapshots)


def _repetitions(T: int, s: int) -> int:
    """The least r with β(s, r) >= T."""
    r = 0
    while binomial_steps(s, r) < T:
        r += 1
    return r


def revolve_reruns(T: int, s: int) -> int:
    """Forward steps re-run to reverse ``T`` steps with ``s`` snapshots (revolve's
    optimum; the last step's residuals are kept by forward): r·T − β(s+1, r−1)."""
    if T <= 1:
        return 0
    r = _repetitions(T, s)
    return r * T - binomial_steps(s + 1, r - 1)


def _first_step(n: int, s: int) -> int:
    """Where to take the next snapshot, ``m`` steps on, reversing ``n`` steps with ``s``
    snapshots: the left part (re-run with ``s``) needs exactly r − 1 repetitions and the
    right one (``s − 1``) r; the largest such ``m``."""
    r = _repetitions(n, s)
    return max(1, min(n - 1, binomial_steps(s, r - 1), n - binomial_steps(s - 1, r - 1)))


@dataclasses.dataclass(frozen=True)
class RevolvePlan:
    """A revolve schedule for ``length`` steps.

    ``spine``: the positions forward keeps a snapshot of (slot i holds ``spine[i]``);
    ``slots``: snapshot slots used at once (at most the ``snapshots`` asked for);
    ``forward_store``: per step of forward's first ``length − 1`` steps, the slot its
    carry goes to (-1: none); ``actions``: backward's unit actions, rows of (step, kind,
    restore slot or -1, store slot or -1); ``recomputed``: forward steps backward runs
    (one per action)."""

    length: int
    snapshots: int
    slots: int
    spine: tuple[int, ...]
    forward_store: np.ndarray
    actions: np.ndarray

    @property
    def recomputed(self) -> int:
        return len(self.actions)


@functools.lru_cache(maxsize=32)
def revolve_plan(T: int, snapshots: int) -> RevolvePlan:
    """The revolve schedule of ``T`` steps with at most ``snapshots`` carries held."""
    if snapshots < 1:
        raise ValueError(f"revolve needs at least one snapshot, got {snapshots}")
    acts: list[tuple[int, int, int, int]] = []
    # Reverse steps [a, b) whose carry at a is in ``slot`` (``fresh``: it is the carry in
    # hand and goes into ``slot`` first); slots ``free`` to s - 1 are free. A stack, not
    # recursion: s may be in the thousands.
    todo = [(0, T, 0, 1, True)] if T >= 1 else []
    while todo:
        a, b, slot, free, fresh = todo.pop()
        first = (-1, slot) if fresh else (slot, -1)
        if b - a == 1 or free == snapshots:
            for t in range(b - 1, a - 1, -1):  # no slot left: advance from a each time
                acts.append((a, TURN if t == a else ADVANCE, *first))
                acts.extend((u, ADVANCE, -1, -1) for u in range(a + 1, t))
                if t > a:
                    acts.append((t, TURN, -1, -1))
                first = (slot, -1)
            continue
        m = a + _first_step(b - a, snapshots - free + 1)
        acts.append((a, ADVANCE, *first))
        acts.extend((u, ADVANCE, -1, -1) for u in range(a + 1, m))
        todo.append((a, m, slot, free, False))  # then [a, m), the slot at m free again
        todo.append((m, b, free, free + 1, True))  # first [m, b) from a new snapshot
    rows = _drop_unread_stores(np.asarray(acts, np.int32).reshape(-1, 4))
    # Forward runs the actions up to the first turn (step T-1, whose residuals it keeps).
    first_turn = int(np.argmax(rows[:, 1] == TURN)) if len(rows) else 0
    fwd, actions = rows[:first_turn], rows[first_turn + 1 :]
    store = np.full(max(T - 1, 0), -1, np.int32)
    store[fwd[:, 0]] = fwd[:, 3]
    spine = tuple(int(t) for t in fwd[fwd[:, 3] >= 0, 0])
    slots = int(rows[:, 2:].max()) + 1 if len(rows) else 0
    return RevolvePlan(T, snapshots, slots, spine, store, np.ascontiguousarray(actions))


def _drop_unread_stores(rows: np.ndarray) -> np.ndarray:
    """The actions without stores no restore reads (the last step's carry, at T = 1)."""
    rows = rows.copy()
    pending: dict[int, int] = {}  # slot -> row of its store not yet read
    for i in np.nonzero((rows[:, 2] >= 0) | (rows[:, 3] >= 0))[0].tolist():
        restore, store = int(rows[i, 2]), int(rows[i, 3])
        if restore >= 0:
            pending.pop(restore, None)
        if store >= 0:
            if store in pending:
                rows[pending[store], 3] = -1
            pending[store] = i
    for i in pending.values():
        rows[i, 3] = -1
    return rows


def revolve_counts(rec: Record) -> tuple[int, int, int]:
    """(carries kept by forward, slots held at once, forward steps re-run)."""
    plan = revolve_plan(rec.trip_count, rec.snapshots)
    return len(plan.spine), plan.slots, plan.recomputed


# ------------------------------------------------------------------ the executor


def revolve_forward(rec: Record, ins: list, res) -> tuple[list, Any]:
    """A revolve-scheduled scan's outputs and what backward needs: the spine's snapshots
    and the last step's residuals (packed through ``res.policy``)."""
    from tapegrad import _loops as L
    from tapegrad._interpret import forward
    from tapegrad._policy import SAVE

    p, body = rec.params, rec.bodies[0]
    nc, nk = p["num_consts"], p["num_carry"]
    rev = bool(p["reverse"])
    T = int(p["length"])
    plan = revolve_plan(T, rec.snapshots)
    consts, init = ins[:nc], L._coerce(ins[nc : nc + nk], body.inputs[nc : nc + nk])
    xs = [L._window(v, rev) for v in ins[nc + nk :]]

    def advance(carry, t):
        outs, _ = forward(body, [*consts, *carry, *(v.step(t) for v in xs)], SAVE)
        return L._coerce(outs[:nk], body.outputs[:nk]), L._coerce(outs[nk:], body.outputs[nk:])

    n0 = len(plan.spine)
    if not res.plain and L._concrete(L._leaves([*consts, *init, *xs])):
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
    last = L._part(rec, 1)
    last_ins = [*consts, *carry, *(v.take(T - 1, 1) for v in xs)]
    outs, rem = L._scan_forward(last, last_ins, res, None, start=T - 1)
    ys = [jnp.concatenate([a, b]) for a, b in zip(ys_main, outs[nk:])]
    return list(outs[:nk]) + (L._flip(ys) if rev else ys), L._Segmented(checkpoints, rem, res, 1)


def revolve_backward(rec: Record, x: list, st: Any, gs: list, retain: bool) -> list:
    """Cotangents of a revolve-scheduled scan's inputs: the kept last step's backward,
    then the plan's actions (restore/store snapshots, advance or turn one step)."""
    from tapegrad import _loops as L
    from tapegrad._interpret import forward
    from tapegrad._policy import SAVE

    p, body = rec.params, rec.bodies[0]
    nc, nk = p["num_consts"], p["num_carry"]
    n_xs = len(rec.inputs) - nc - nk
    rev = bool(p["reverse"])
    T = int(p["length"])
    plan = revolve_plan(T, rec.snapshots)
    c_act = L._active_carries(rec)
    x_act = [rec.active[nc + nk + j] for j in range(n_xs)]
    consts = x[:nc]
    xs, g_ys = [L._window(v, rev) for v in x[nc + nk :]], [L._window(g, rev) for g in gs[nk:]]
    step_in = [body.inputs[nc + nk + j] for j in range(n_xs)]  # one step of each xs
    one = L._part(rec, 1, c_act)

    def window(vals, t):
        return [None if v is None else v.take(t, 1) for v in vals]

    def carry_cts(in_cts):
        return [
            L._ct_or_zeros(c, v.shape, v.dtype) if c_act[j] else None
            for j, (c, v) in enumerate(zip(in_cts[nc : nc + nk], body.inputs[nc : nc + nk]))
        ]

    def turn(carry, ct_c, acc, t, keep):
        """Step t's residuals from its carry, then its backward."""
        if keep is None:
            _, keep = L._scan_forward(one, [*consts, *carry, *window(xs, t)], st.res, None, t)
        in_cts = L._scan_backward(
            one,
            [*consts, *([None] * nk), *window(xs, t)],
            keep,
            [*ct_c, *window(g_ys, t)],
            retain and keep is st.rem,
            None,
        )
        acc = [L._add(a, c) for a, c in zip(acc, in_cts[:nc])]
        ct_x = [
            L._ct_or_zeros(c if c is None else c[0], v.shape, v.dtype) if x_act[j] else None
            for j, (c, v) in enumerate(zip(in_cts[nc + nk :], step_in))
        ]
        return carry_cts(in_cts), acc, ct_x

    def advance(carry, t):
        outs, _ = forward(body, [*consts, *carry, *(v.step(t) for v in xs)], SAVE)
        return L._coerce(outs[:nk], body.outputs[:nk])

    ct_c = [
        L._ct_or_zeros(g, v.shape, v.dtype) if c_act[j] else None
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
        and L._concrete(L._leaves([*consts, *xs, *jax.tree.leaves(cps)]))
    ):
        slots: list[Any] = _snapshot_list(cps, nk) + [None] * (plan.slots - len(plan.spine))
        cps = None  # a slot overwritten frees its snapshot (unless forward's are retained)
        ct_rows: list[Any] = [None] * (T - 1)
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
            jnp.stack([row[j] for row in ct_rows]) if x_act[j] else None for j in range(n_xs)
        ]
    elif plan.recomputed:
        buf = _snapshot_buffer(cps, nk, plan.slots + 1)  # + a scratch row
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
            jnp.zeros((T - 1, *v.shape), v.dtype) if x_act[j] else None
            for j, v in enumerate(step_in)
        ]
        (_, _, ct_c, acc, ct_main), _ = lax.scan(
            act, (carry0, buf, ct_c, acc, ct_buf0), jnp.asarray(plan.actions)
        )
    else:
        ct_main = [
            jnp.zeros((0, *v.shape), v.dtype) if x_act[j] else None for j, v in enumerate(step_in)
        ]
    ct_xs: list[Any] = [None] * n_xs
    for j in range(n_xs):
        if x_act[j]:
            ct = jnp.concatenate([ct_main[j], ct_last[j][None]])  # in run order
            ct_xs[j] = jnp.flip(ct, 0) if rev else ct
    return L._input_cts(rec, acc, ct_c, c_act, ct_xs)


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
