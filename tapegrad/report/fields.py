"""The fields of a `MemoryReport`: one `RecordMemory` row per record charged residuals
(a value is charged to its producer, else to its first saver; a loop or branch record's
row lists its body records' rows), the byte totals, the timeline and peaks
(`tapegrad.report.timeline`), what the report cannot see (`jax.vjp` inside a
backward), and, when a `tg.policies.budget` planned the tape or ``compress(bits="auto")``
packed it, the plan's decisions and predictions and the bit widths used."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tapegrad.core.residual_policy import wrapped
from tapegrad.core.tape import Tape, custom_vjp_name
from tapegrad.engine.loops.saves import forwarded_ids
from tapegrad.planner import Budget, segment_flops
from tapegrad.report.accounting import (
    _Acc,
    _add,
    _Body,
    _devices,
    _is_body_key,
    _processes,
    account,
)
from tapegrad.report.timeline import replay
from tapegrad.report.unseen import unseen_backwards, unseen_notes

__all__ = ["RecordMemory", "report_fields"]


@dataclass(frozen=True, slots=True)
class RecordMemory:
    """What one record keeps: bytes by where they live (distinct values, first saver)."""

    index: int
    primitive: str
    source: str
    saves: str
    device_bytes: int
    host_bytes: int
    compressed_bytes: int  # bytes stored in a dtype other than the residual's own
    original_bytes: int  # bytes the residuals would take unpacked
    # A record inside a loop or branch body: its bytes are summed over the ``steps`` body
    # runs whose residuals are held (a scan's trip count, times enclosing loops'); 1 at
    # the top level. ``depth`` counts the enclosing bodies, ``branch`` is the cond
    # branch (None elsewhere).
    steps: int = 1
    depth: int = 0
    branch: int | None = None
    # For a loop/branch record: the rows of its body records (all branches, in order).
    # The record's own bytes include theirs (and its own saves, kept once).
    body: tuple[RecordMemory, ...] = ()
    # A checkpointed scan's carries (kept every `schedule` steps), in its bytes too.
    checkpoint_bytes: int = 0
    # When a `tg.policies.budget` planned the tape: what it chose for the residuals
    # charged to this row ("save", "offload", "bf16", "int8"; several joined by "+") and
    # the seconds its cost model predicts they add to a step.
    planned: str = ""
    planned_seconds: float = 0.0
    # Under `compress(bits="auto")`: the bit widths its residuals were packed at, read
    # off the packed values ("2", "4+8"; the dtype's own width for one kept as it is).
    bits: str = ""

    @property
    def bytes(self) -> int:
        return self.device_bytes + self.host_bytes

    @property
    def step_bytes(self) -> int:
        """Bytes one body run holds (``bytes`` / ``steps``; ``bytes`` at the top level)."""
        return self.bytes // max(self.steps, 1)

    @property
    def body_bytes(self) -> int:
        """Bytes of the body rows (over all steps); 0 for a record without a body."""
        return sum(r.bytes for r in self.body)

    def walk(self):
        """This row, then its body rows (recursively), depth first."""
        yield self
        for r in self.body:
            yield from r.walk()


def _saves_label(rec, keys, first_user, skip=frozenset()) -> str:
    """What a row holds: the record's own saves (less ``skip``: in a body, what the loop
    record keeps once), then outputs it is charged for because a later record keeps them
    (``out0→tanh``), a recompute segment's input, or a loop record's per-step residuals
    (``body``)."""
    saves = [s for s in rec.saves if rec.residual_key(s) not in skip]
    own = {rec.residual_key(s) for s in saves}
    parts = [",".join(map(str, saves))] if saves else []
    for key in keys:
        if key in own:
            continue
        if _is_body_key(key):
            parts.append("body")
            continue
        i = next((j for j, o in enumerate(rec.outputs) if o.id == key), None)
        user = first_user.get(key)
        parts.append(f"out{i}→#{user}" if i is not None and user is not None else "(segment input)")
    return ",".join(dict.fromkeys(parts)) or "(segment input)"


def _label(rec) -> str:
    """A row's primitive: a tg.Function / custom_vjp by its name."""
    return custom_vjp_name(rec.params) if rec.primitive == "custom_vjp_call" else rec.primitive


def _owners(tape: Tape, keys) -> tuple[dict[int, list], dict[Any, str]]:
    """(record index -> the kept keys charged to it, key -> its first saver's primitive).
    A value is charged to its producer, else to its first saver; a loop record's
    per-step residuals to the loop record."""
    producer = {o.id: rec.index for rec in tape.records for o in rec.outputs}
    owner: dict[Any, int] = {}
    first_user: dict[Any, str] = {}  # the label of the first record that keeps the value
    for rec in tape.records:
        for s_ in rec.saves:
            key = rec.residual_key(s_)
            owner.setdefault(key, producer.get(key, rec.index))
            first_user.setdefault(key, _label(rec))
        if rec.bodies:
            owner[("body", rec.index)] = rec.index
    for seg in tape.segments:
        for v in seg.inputs:
            owner.setdefault(v.id, producer.get(v.id, seg.records[0]))
    by_rec: dict[int, list] = {}
    for key in keys:
        by_rec.setdefault(owner.get(key, -1), []).append(key)
    return by_rec, first_user


def _rows(
    tape: Tape,
    sizes: dict[Any, _Acc],
    bodies: dict[int, _Body],
    steps: int = 1,
    depth: int = 0,
    branch: int | None = None,
    skip=frozenset(),
    bits: dict | None = None,
) -> list[RecordMemory]:
    """One row per record of ``tape`` that is charged residuals; loop/branch records'
    rows carry their bodies' rows; ``bits`` (key -> bit width) fills their bits column."""
    by_rec, first_user = _owners(tape, sizes)
    skip = frozenset(skip)
    rows = []
    for rec in tape.records:
        keys = by_rec.get(rec.index)
        if not keys:
            continue
        acc = [0] * 5
        for key in keys:
            _add(acc, sizes[key])
        body: tuple[RecordMemory, ...] = ()
        bm = bodies.get(rec.index)
        if bm is not None:
            body = tuple(
                row
                for b in range(len(rec.bodies))
                for row in _rows(
                    rec.bodies[b],
                    bm.sizes(b),
                    bm.nested[b],
                    bm.runs[b],
                    depth + 1,
                    b if rec.primitive == "cond" else None,
                    forwarded_ids(rec),
                    bm.bits[b] if bits is not None else None,
                )
            )
        rows.append(
            RecordMemory(
                rec.index,
                _label(rec),
                rec.source,
                _saves_label(rec, keys, first_user, skip),
                acc[0],
                acc[1],
                acc[2] + acc[3],
                acc[4],
                steps,
                depth,
                branch,
                body,
                sum(bm.checkpoints[:2]) if bm is not None else 0,
                bits="+".join(map(str, sorted(set().union(*(bits.get(k, ()) for k in keys)))))
                if bits is not None
                else "",
            )
        )
    return rows


def _average_bits(named: dict | None, auto: Any) -> float | None:
    """Bits a value over the residuals the allocation budgets (all it packed, when it
    has none), as packed in this run."""
    if auto is None or named is None:
        return None
    alloc = getattr(auto, "allocation", None)
    fixed = {r.name for r in alloc.rows if r.fixed} if alloc is not None else set()
    got = [bv for n, bv in named.items() if n not in fixed]
    n = sum(v for _, v in got)
    return sum(b * v for b, v in got) / n if n else None


def _with_decisions(row: RecordMemory, keys: Any, decisions: dict) -> RecordMemory:
    """``row`` with the planner's decisions for the residual keys charged to it."""
    got = [decisions[k] for k in keys if k in decisions]
    if not got:
        return row
    names = "+".join(dict.fromkeys(m for m, _, _ in got))
    return dataclasses.replace(row, planned=names, planned_seconds=sum(t for _, _, t in got))


def _planner_of(policy: Any) -> Any:
    """The `tg.policies.budget` policy that planned the tape (it or one it wraps), or None."""
    return next((p for p in wrapped(policy) if isinstance(p, Budget)), None)


def report_fields(tape: Tape, res: Any, policy: Any, args: Sequence[Any] = ()) -> dict[str, Any]:
    """`MemoryReport`'s fields, from a forward run of ``tape`` on ``args`` under ``policy``
    whose kept residuals are ``res``."""
    acc = account(tape, res, policy, args)
    auto, named = acc.auto, acc.named
    rows = _rows(tape, acc.bytes_of, acc.bodies, bits=acc.bits if auto is not None else None)
    by_rec, _ = _owners(tape, acc.bytes_of)
    unseen = unseen_backwards(tape)
    tl = replay(tape, policy, acc, by_rec, unseen)
    planner = _planner_of(policy)
    decisions = planner.decisions(tape) if planner is not None else None
    if decisions is not None:
        rows = [_with_decisions(r, by_rec.get(r.index, ()), decisions) for r in rows]
    # The planner's points as this run measured them (recomputations included).
    measured_dev = max((b for _, b in tl.plan_points), default=0) if planner is not None else None
    return dict(
        policy=policy,
        records=tuple(rows),
        residual_bytes=tl.residual_bytes,
        device_bytes=sum(a[0] for a in acc.bytes_of.values()),
        host_bytes=sum(a[1] for a in acc.bytes_of.values()),
        peak_bytes=tl.peak_bytes,
        input_bytes=sum(acc.caller.values()),
        timeline=tl.points,
        tape=tape,
        timeline_kinds=tl.kinds,
        input_residual_bytes=tl.input_residual_bytes,
        budget_bytes=planner.bytes if planner is not None else None,
        recompute_flops=sum(segment_flops(tape, seg) for seg in tape.segments),
        plan=planner.last.get("plan") if planner is not None else None,
        notes=unseen_notes([u for _, u in unseen]),
        peak_beyond_inputs_bytes=tl.peak_beyond_inputs_bytes,
        unseen=tuple(u for _, u in unseen),
        devices=_devices(list(res.store.values()) + list(args)),
        processes=_processes(list(res.store.values()) + list(args)),
        decisions=decisions,
        planned_peak_bytes=planner.last.get("peak_bytes") if planner is not None else None,
        measured_device_peak_bytes=measured_dev,
        planned_seconds=planner.last.get("time_s") if planner is not None else None,
        bits={n: b for n, (b, _) in named.items()} if named is not None else None,
        average_bits=_average_bits(named, auto),
        budget_bits=auto.budget_bits if auto is not None else None,
        planned_timeline=planner.last.get("timeline") if planner is not None else None,
        measured_plan_timeline=tl.plan_points if planner is not None else None,
    )
