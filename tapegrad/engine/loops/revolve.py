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
segment (`_loop_schedule._part`) run by the same segment runner as every other schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from tapegrad.core.tape import Record

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
