"""The planning problem as the planner sees it: what the executor's schedule makes of a
planned tape (`simulate`, `estimate`: peak live activation bytes and recompute flops,
replaying the save/release/recompute order the interpreter follows), what a plan may
not change (`_keep_effects`: records with side effects stay saved), and names that
survive re-tracing (`structure_key` for the plan cache, canonical names for the
mechanisms chosen per residual). Plain data in, plain data out: nothing here searches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tapegrad.core.tape import Tape, Var
from tapegrad.engine.backward_schedule import Recompute, Release, Run, schedule
from tapegrad.engine.checkpoint import segment_peak
from tapegrad.engine.loops.saves import loop_residual_bytes
from tapegrad.errors import TapegradError
from tapegrad.passes.checks import _harmful, effects_of
from tapegrad.planner.cost import record_flops, segment_flops

__all__ = [
    "BudgetError",
    "estimate",
    "loops_held",
    "simulate",
    "segment_cost",
    "structure_key",
]


class BudgetError(TapegradError, ValueError):
    """No save/recompute plan fits the budget."""


def loops_held(tape: Tape, segments: Sequence[Any] | None = None) -> dict[Any, int]:
    """``("body", index)`` -> bytes of the per-step residuals a loop or branch record keeps
    from forward until its backward runs (`loop_residual_bytes`, as save() keeps them),
    for each such record not recomputed by one of ``segments`` (the tape's own)."""
    segs = tape.segments if segments is None else segments
    inside = {i for g in segs for i in g.records}
    held = {}
    for rec in tape.records:
        if rec.bodies and rec.rule != "none" and rec.index not in inside:
            b = loop_residual_bytes(rec)
            if b:
                held["body", rec.index] = b
    return held


def segment_cost(tape: Tape, seg: Any, memo: dict) -> tuple[float, int]:
    """(flops, recomputation peak) of one segment, kept in ``memo`` by its records and
    outputs (plans scored on one tape share most of their segments)."""
    key = (seg.records, tuple(o.id for o in seg.outputs))
    got = memo.get(key)
    if got is None:
        got = memo[key] = (segment_flops(tape, seg), segment_peak(tape, seg))
    return got


def estimate(tape: Tape, memo: dict | None = None) -> tuple[int, float]:
    """(peak live activation-residual bytes, recompute flops) of a planned tape.

    ``memo`` (optional, for the planner scoring many plans of one tape) caches each
    segment's recomputation peak and flops across calls."""
    peak, flops, _ = simulate(tape, memo)
    return peak, flops


def simulate(
    tape: Tape, memo: dict | None = None, trace: dict | None = None
) -> tuple[int, float, dict[Any, int]]:
    """`estimate`'s schedule: (peak, flops, bytes of each kept residual key); with
    ``trace``, also the largest live bytes while backward runs each record (by index).

    Backward's schedule (`engine.backward_schedule`), counted as the planner sizes
    values: kept residuals whole (the caller's own arrays free), a loop's per-step
    residuals until its backward (`loops_held`), a recomputed segment's
    peak while it runs and what it makes after (outputs, derived residuals such as a
    custom_vjp's), until their last use."""
    memo = {} if memo is None else memo
    inputs = tape.caller_ids()
    kept, _ = tape.residual_keys()
    size = {k: (0 if k in inputs else v.nbytes) for k, v in kept.items()}
    extra: dict[Any, int] = loops_held(tape)  # and, as backward runs, recomputed values
    live = sum(size.values()) + sum(extra.values())  # forward only adds: its end is its peak
    peak = live
    flops = 0.0

    def at(i: int, total: int) -> None:
        if trace is not None:
            trace[i] = max(trace.get(i, 0), total)

    for st in schedule(tape).steps:
        for ev in st.events:
            if type(ev) is Release:
                live -= size.get(ev.key, 0) + extra.pop(ev.key, 0)
            elif type(ev) is Recompute:
                seg_flops, seg_peak = segment_cost(tape, ev.segment, memo)
                flops += seg_flops
                peak = max(peak, live + seg_peak)
                at(st.record.index, live + seg_peak)
                for key, v in ev.held:  # its outputs and derived residuals
                    if v is not None:
                        extra[key] = v.nbytes
                        live += v.nbytes
            elif type(ev) is Run:
                peak = max(peak, live)
                at(st.record.index, live)
    return peak, flops, size


def _keep_effects(tape: Tape, fixed: Sequence[str | None]) -> list[str | None]:
    """Binding "save" for every free record with a harmful side effect."""
    return [
        f if f is not None or not _harmful(effects_of(r)) else "save"
        for r, f in zip(tape.records, fixed)
    ]


def _canonical_names(tape: Tape) -> dict[int, tuple]:
    """Var id -> a name that survives re-tracing: ("in", position) or ("out", record,
    output)."""
    names: dict[int, tuple] = {v.id: ("in", i) for i, v in enumerate(tape.inputs)}
    for i, (v, _) in enumerate(tape.consts):
        names[v.id] = ("const", i)
    for r in tape.records:
        for j, o in enumerate(r.outputs):
            names[o.id] = ("out", r.index, j)
    return names


def _to_canonical(tape: Tape, mech: dict) -> dict:
    names = _canonical_names(tape)
    return {(names[k] if isinstance(k, int) else k): m for k, m in mech.items()}


def _from_canonical(tape: Tape, canon: dict) -> dict:
    if not canon:
        return {}
    ids = {n: i for i, n in _canonical_names(tape).items()}
    return {(ids[k] if k[0] != "aux" else k): m for k, m in canon.items()}


def structure_key(tape: Tape, fixed: Sequence[Any]) -> tuple:
    """Identifies a tape's structure (what the plan depends on), to reuse a plan when
    the same function is traced again (tg.grad, memory_report, jit of the same f).

    Values are renamed canonically, inputs and constants alike (both cost nothing to
    keep): `memory_report` traces an argument as an input where `tg.grad` with
    ``argnums`` makes it a constant, and the plan is the same."""
    names: dict[int, tuple] = {}
    recs = []
    for r in tape.records:
        ins: list[tuple | None] = []
        for u in r.inputs:
            if not isinstance(u, Var):
                ins.append(None)
                continue
            if u.id not in names:
                names[u.id] = ("free", len(names), u.shape, str(u.dtype))
            ins.append(names[u.id])
        for o in r.outputs:
            names[o.id] = ("out", len(names), o.shape, str(o.dtype))
        recs.append(
            (
                r.primitive,
                tuple(ins),
                tuple(names[o.id] for o in r.outputs),
                r.saves,
                r.rule,
                r.region,
                record_flops(r),
            )
        )
    return tuple(recs), tuple(fixed)
