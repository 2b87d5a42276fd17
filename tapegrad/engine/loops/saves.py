"""What a loop or branch record (``scan``, ``cond``) keeps, as data: which body inputs
its residuals forward to the outer record (kept once), the bytes its bodies' residuals
take over all steps as `save()` keeps them (`loop_bytes`), and what a checkpoint
schedule keeps, holds at its peak and re-runs (`schedule_costs`). Nothing here runs a
loop; `tapegrad.engine.loops.kinds` registers these sizes with the record's kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tapegrad.core.tape import Lit, Record, Saved, Tape, Var, as_dtype
from tapegrad.engine.loops.revolve import revolve_counts

__all__ = [
    "LoopBytes",
    "ScheduleCosts",
    "forwarded_ids",
    "loop_bytes",
    "loop_residual_bytes",
    "outer_saves",
    "schedule_costs",
    "schedule_levels",
    "schedule_text",
    "step_residual_bytes",
    "step_residual_vars",
]


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


def schedule_levels(rec: Record) -> tuple[int, ...]:
    """A scan's segment lengths, outermost first (() when it keeps every step)."""
    return (rec.schedule, *rec.inner_schedule) if rec.schedule else ()


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
    if rec.primitive == "scan" and rec.snapshots:
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


def step_residual_vars(rec: Record, branch: int = 0) -> dict[Any, int]:
    """The residuals one step of a loop/branch record's body ``branch`` packs, and their
    bytes: the body's `Tape.residual_vars` less the values the record keeps once for all
    steps (`tapegrad.engine.loops.kinds.forwarded_ids`: a scan's consts and scanned slices, a cond's
    operands). A nested loop is one entry with its bytes over all its own steps."""
    fwd = forwarded_ids(rec)
    return {k: n for k, n in rec.bodies[branch].residual_vars().items() if k not in fwd}


def step_residual_bytes(rec: Record) -> int:
    """Bytes of one step of a loop/branch record's per-step residuals (a cond: the sum
    over its branches, what a traced ``lax.switch`` keeps; eagerly only the branch
    taken is kept, which `tg.memory_report` measures)."""
    if not rec.bodies or not rec.in_backward:
        return 0
    return sum(sum(step_residual_vars(rec, b).values()) for b in range(len(rec.bodies)))


@dataclass(frozen=True, slots=True)
class LoopBytes:
    """What a loop/branch record keeps of its bodies' residuals, as `save()` keeps them.

    ``step`` bytes per step, of which ``shared`` are carries the step saves as its input
    that the previous step saved as its output (stored once: only the first step's input
    is extra); ``steps`` steps keep their residuals (the trip count; a checkpointed scan's
    remainder steps) and ``checkpoints`` carries of ``carry`` bytes are kept besides
    (a checkpointed scan's carry at each full segment's start). A cond: one run of the
    union of its branches.
    """

    step: int
    shared: int = 0
    steps: int = 1
    checkpoints: int = 0
    carry: int = 0

    @property
    def total(self) -> int:
        kept = self.steps * (self.step - self.shared) + (self.shared if self.steps else 0)
        return kept + self.checkpoints * self.carry


def loop_bytes(rec: Record) -> LoopBytes:
    """`LoopBytes` of a loop/branch record (all zero for another record)."""
    step = step_residual_bytes(rec)
    if rec.primitive != "scan" or not step and not rec.schedule and not rec.snapshots:
        return LoopBytes(step)
    nc, nk = rec.params["num_consts"], rec.params["num_carry"]
    body = rec.bodies[0]
    kept = step_residual_vars(rec)
    shared = sum(kept[k_in] for k_in, _, _ in _carry_pairs(rec, kept))
    T = rec.trip_count
    if rec.snapshots:  # revolve: the spine's snapshots and the last step's residuals
        carry = sum(v.nbytes for v in body.inputs[nc : nc + nk])
        return LoopBytes(step, shared, min(T, 1), revolve_counts(rec)[0], carry)
    if rec.schedule:  # carries every `schedule` steps, the remainder's residuals as usual
        n = 0  # a nested schedule checkpoints the remainder again, level by level
        for k in (rec.schedule, *rec.inner_schedule):
            if k < T:
                n, T = n + T // k, T % k
        carry = sum(v.nbytes for v in body.inputs[nc : nc + nk])
        return LoopBytes(step, shared, T, n, carry)
    return LoopBytes(step, shared, T)


def loop_residual_bytes(rec: Record) -> int:
    """Bytes of a loop/branch record's per-step residuals over all its steps, as `save()`
    keeps them: `step_residual_bytes` × `Record.trip_count`, less the carries a step saves
    that the previous step saved as its output (kept once), nested loops multiplied; a
    checkpointed scan (`Record.schedule`): its carry checkpoints and remainder steps."""
    if not rec.bodies or not rec.in_backward:
        return 0
    return loop_bytes(rec).total
