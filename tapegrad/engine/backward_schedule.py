"""Backward's schedule: the one model of what a backward pass does, and in which order.

`schedule(tape, prefetch)` walks a planned tape's records as backward runs them (in
reverse, those in backward only) and lists each one's events:

* `Unpack`: a kept residual is unpacked at its first use, or ``prefetch`` records
  earlier (``early``: `offload`'s prefetch);
* `Recompute`: a checkpoint segment is re-run at the first use of a value it makes,
  after its kept inputs are unpacked for it; its inputs are released after it where it
  was their last use;
* `Run`: the record's own rule runs;
* `Release`: a residual's last use has passed, and it is dropped.

It depends on the tape alone (which values are kept, which recomputed, which records
read them), so it is computed once per tape and prefetch depth. Its readers:

* `engine.interpret.backward` executes it: its order, its prefetches and its use counts.
  Reads stay demand-driven: a record whose outputs get no cotangent (a symbolic zero)
  unpacks and recomputes nothing, and a later reader does it instead.
* `report.timeline.replay` counts its events' bytes as `tg.memory_report` measures
  them (memory kinds, a loop's per-step transients, `jax.vjp`'s unseen residuals).
* the planner's `problem.simulate` and `joint.timeline` count them as the planner
  sizes values; `planner.index.TapeIndex` does the same for many plans at once, and
  ``tests/policies/test_planner_fast.py`` checks it against them.

``tests/test_schedule.py`` checks that the interpreter's own unpacks, recomputations
and releases happen in exactly this order.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from tapegrad.core.tape import Record, Saved, Segment, Tape, Var

__all__ = ["Recompute", "Release", "Run", "Schedule", "Step", "Unpack", "keys_of", "schedule"]


@dataclass(frozen=True, slots=True, eq=False)
class Unpack:
    """A kept residual's first use: ``record`` reads it as ``saved``."""

    key: Any
    record: Record
    saved: Saved
    early: bool  # brought back ahead of its record (prefetch)


@dataclass(frozen=True, slots=True, eq=False)
class Recompute:
    """A segment re-run from its inputs, each unpacked for ``readers`` (the segment's
    first record reading it); ``held``: (key, Var or Saved, None for a loop's per-step
    residuals) of each value it makes that backward reads, held until its last use."""

    segment: Segment
    readers: tuple[Record, ...]
    held: tuple[tuple[Any, Any], ...]


@dataclass(frozen=True, slots=True, eq=False)
class Run:
    record: Record


@dataclass(frozen=True, slots=True, eq=False)
class Release:
    key: Any


@dataclass(frozen=True, slots=True, eq=False)
class Step:
    """One record's backward: its residual keys (save order; a kept loop's stored
    per-step residuals last), the residuals prefetched before it runs, and its events
    (prefetches first, then reads, `Run`, releases)."""

    record: Record
    keys: tuple[Any, ...]
    prefetch: tuple[Unpack, ...]
    events: tuple[Unpack | Recompute | Run | Release, ...]


@dataclass(frozen=True, slots=True, eq=False)
class Schedule:
    steps: tuple[Step, ...]
    recomputes: dict[int, Recompute]  # segment id -> how it is re-run
    recomputed: dict[Any, int]  # residual key -> the segment that remakes it
    # uses of each residual key by backward: one per record reading it, one per segment
    # taking it as an input; a key is released when its count reaches zero
    uses: dict[Any, int]
    prefetch: int


_CACHE: weakref.WeakKeyDictionary[Tape, dict[int, Schedule]] = weakref.WeakKeyDictionary()


def keys_of(rec: Record) -> tuple[Any, ...]:
    """``rec``'s residual keys as forward keeps them: one per save, and a kept loop's
    stored per-step residuals, ``("body", index)``, last."""
    keys = tuple(rec.residual_key(s) for s in rec.saves)
    if rec.bodies and rec.rule != "none" and rec.decision != "recompute":
        keys += (("body", rec.index),)
    return keys


def schedule(tape: Tape, prefetch: int = 0) -> Schedule:
    """Backward's `Schedule` for ``tape``, prefetching ``prefetch`` records ahead."""
    per = _CACHE.get(tape)
    if per is None:
        per = _CACHE[tape] = {}
    got = per.get(prefetch)
    if got is None:
        got = per[prefetch] = _build(tape, prefetch)
    return got


def _uses(tape: Tape, keys: dict[int, tuple]) -> dict[Any, int]:
    uses: dict[Any, int] = {}
    for rec in tape.records:
        if rec.rule != "none":
            for key in keys[rec.index]:
                uses[key] = uses.get(key, 0) + 1
    for seg in tape.segments:
        for v in seg.inputs:
            uses[v.id] = uses.get(v.id, 0) + 1
    return uses


def _reader(tape: Tape, seg: Segment, v: Var) -> Record:
    """The first record of ``seg`` that reads ``v`` (the segment unpacks it for it)."""
    return next(
        tape.records[k]
        for k in seg.records
        if any(isinstance(u, Var) and u.id == v.id for u in tape.records[k].inputs)
    )


def _recompute(tape: Tape, seg: Segment, seg_of: dict[Any, int]) -> Recompute:
    held: list[tuple[Any, Any]] = [(o.id, o) for o in seg.outputs]
    seen = {o.id for o in seg.outputs}
    for k in seg.records:
        rec = tape.records[k]
        for s in rec.saves:
            key = rec.residual_key(s)
            # (a derived value that is another's array has its key: `Record.aliases`)
            if s.kind == "aux" and key in seg_of and key not in seen:
                seen.add(key)
                held.append((key, s))
        if rec.bodies and rec.rule != "none":
            held.append((("body", rec.index), None))
    readers = tuple(_reader(tape, seg, v) for v in seg.inputs)
    return Recompute(seg, readers, tuple(held))


def _build(tape: Tape, prefetch: int) -> Schedule:
    kept, seg_of = tape.residual_keys() if tape.segments else (None, {})
    recomputes = {seg.id: _recompute(tape, seg, seg_of) for seg in tape.segments}
    keys = {rec.index: keys_of(rec) for rec in tape.records}
    uses = _uses(tape, keys)
    remaining = dict(uses)
    order = [r for r in reversed(tape.records) if r.rule != "none"]
    unpacked: set[Any] = set()
    held: set[Any] = set()  # recomputed values not yet released
    events: list[Any] = []  # the current step's, emptied at each step

    def is_kept(key) -> bool:
        return key not in seg_of if kept is None else key in kept

    def release(key) -> None:
        remaining[key] -= 1
        if remaining[key] == 0:
            unpacked.discard(key)
            held.discard(key)
            events.append(Release(key))

    def unpack(key, rec: Record, s: Saved, early: bool) -> None:
        if key not in unpacked:
            unpacked.add(key)
            events.append(Unpack(key, rec, s, early))

    def recompute(seg: Segment) -> None:
        ev = recomputes[seg.id]
        for v, r in zip(seg.inputs, ev.readers):
            unpack(v.id, r, Saved("in", 0, v.shape, v.dtype), False)
        events.append(ev)
        held.update(k for k, _ in ev.held)
        for v in seg.inputs:
            release(v.id)

    steps = []
    for n, rec in enumerate(order):
        events.clear()
        for nxt in order[n + 1 : n + 1 + prefetch]:
            for s, key in zip(nxt.saves, keys[nxt.index]):
                if is_kept(key):
                    unpack(key, nxt, s, True)
        pre = tuple(events)
        for s, key in zip(rec.saves, keys[rec.index]):
            if key in held:
                continue
            if is_kept(key):
                unpack(key, rec, s, False)
            elif key in seg_of:
                recompute(tape.segments[seg_of[key]])
        if rec.bodies and rec.rule != "none" and rec.decision == "recompute":
            if ("body", rec.index) not in held:  # a recomputed loop: its segment first
                recompute(next(g for g in tape.segments if rec.index in g.records))
            held.discard(("body", rec.index))  # taken by its backward
        events.append(Run(rec))
        for key in keys[rec.index]:
            release(key)
        steps.append(Step(rec, keys[rec.index], pre, tuple(events)))
    return Schedule(tuple(steps), recomputes, seg_of, uses, prefetch)
