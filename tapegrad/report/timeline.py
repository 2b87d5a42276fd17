"""Live residual bytes through forward and backward: `replay` walks the tape's records
forward (each kept residual becomes live), then backward's schedule
(`engine.backward_schedule`, the one the interpreter executes: device copies that
unpacking brings back, recomputed segments, a loop's per-step transients and `jax.vjp`'s
unseen residuals, each released after its last use), and returns the timeline, its
split by memory kind, the peaks, and the points a budget's planner predicts."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tapegrad.core.residual_policy import is_plain, resolve_prefetch
from tapegrad.core.tape import Record, Tape
from tapegrad.engine.backward_schedule import Recompute, Release, Unpack, schedule
from tapegrad.engine.checkpoint import segment_peak
from tapegrad.engine.loops.saves import loop_bytes, schedule_costs
from tapegrad.report.accounting import Accounts
from tapegrad.report.unseen import UnseenBackward

__all__ = ["Timeline", "replay"]


def _step_transient(rec: Record) -> int:
    """Device bytes one step of a loop/branch record's backward unpacks on top of the
    stored residuals (non-`save` policies): the step's residuals and its slices of the
    scanned inputs, plus the deepest nested body's own step (a cond: its largest branch)."""
    best = 0
    for body in rec.bodies:
        kept, _ = body.residual_keys()
        skip = {v.id for v, _ in body.consts}
        nc = rec.params["num_consts"] if rec.primitive == "scan" else len(body.inputs)
        skip |= {v.id for v in body.inputs[:nc]}  # consts/operands: the record's own saves
        n = sum(v.nbytes for k, v in kept.items() if k not in skip)
        inner = [_step_transient(r) for r in body.records if r.bodies and r.in_backward]
        n += max(inner, default=0)
        best = max(best, n)
    return best


def _segment_transient(rec: Record) -> int:
    """Bytes a checkpointed scan's backward recomputes at a time: one segment's residuals
    (a nested schedule: its inner levels' carries too) on top of what forward kept."""
    c = schedule_costs(rec)
    if c is None:
        return 0
    extra = c.peak_carries - c.carries
    return dataclasses.replace(loop_bytes(rec), steps=c.peak_steps, checkpoints=extra).total


@dataclass(frozen=True)
class Timeline:
    """Live residual bytes over one forward and backward, as `replay` counted them."""

    points: tuple[tuple[str, int], ...]  # (step, live bytes) after each record, and during
    # each recomputation ("bwd i recompute"), loop step ("bwd i step") and jax.vjp
    kinds: tuple[tuple[int, int, int], ...]  # the same by kind: (device, host, compressed)
    residual_bytes: int  # live at the end of forward
    peak_bytes: int
    peak_beyond_inputs_bytes: int  # the peak less the caller's own arrays
    input_residual_bytes: int  # the tape's own inputs' residuals: the floor
    # Device and compressed bytes of activations where a budget's planner predicts them.
    plan_points: tuple[tuple[str, int], ...]


def replay(
    tape: Tape,
    policy: Any,
    acc: Accounts,
    by_rec: dict[int, list],
    unseen: Sequence[tuple[int, UnseenBackward]],
) -> Timeline:
    """Count live residual bytes record by record: forward, then backward's release order
    (``by_rec``: the kept keys charged to each record; ``unseen``: `jax.vjp` estimates by
    the top-level record whose backward runs them)."""
    plain = is_plain(policy)
    input_ids = {v.id for v in tape.inputs} | {v.id for v, _ in tape.consts}
    sizes_acc, sizes, kind_of, caller = acc.bytes_of, acc.sizes, acc.kind_of, acc.caller
    lk = [0, 0, 0]  # live bytes by kind (device, host, compressed), mirroring ``live``

    def add_kind(key, sign=1):
        for i, b in enumerate(kind_of.get(key, (0, 0, 0))):
            lk[i] += sign * b

    unseen_at: dict[int, int] = {}  # top-level record -> largest estimate run within it
    for at, u in unseen:
        unseen_at[at] = max(unseen_at.get(at, 0), u.bytes)

    timeline = []
    timeline_kinds = []
    live = sum(sizes[k] for k in sizes if isinstance(k, int) and k in input_ids)
    caller_live = sum(caller.get(k, 0) for k in sizes if isinstance(k, int) and k in input_ids)
    for k in sizes:
        if isinstance(k, int) and k in input_ids:
            add_kind(k)
    input_live = live
    # The schedule as a budget's planner sees it (`tapegrad.planner.joint.Timeline`): device and
    # compressed bytes of activations (the tape's own inputs not counted) at the end of
    # forward, at each recomputation and during each record's backward.
    inp = {k for k in sizes if isinstance(k, int) and k in input_ids}
    inp_lk = sum(kind_of[k][0] + kind_of[k][2] for k in inp)
    plan_points: list[tuple[str, int]] = []
    for rec in tape.records:
        for key in by_rec.get(rec.index, ()):
            if not (isinstance(key, int) and key in input_ids):
                live += sizes[key]
                caller_live += caller.get(key, 0)
                add_kind(key)
        timeline.append((f"fwd {rec.index}", live))
        timeline_kinds.append((lk[0], lk[1], lk[2]))
    residual = live
    plan_points.append(("forward", lk[0] + lk[2] - inp_lk))
    extra: dict[Any, int] = {}  # unpacked device copies and recomputed values, per key

    def _moved(key) -> bool:
        # Unpacking makes a device copy only of what packing moved to host or shrank; a
        # residual kept as it is on device (a budget's "save") unpacks to itself.
        a = sizes_acc.get(key)
        return a is None or bool(a[1] or a[2] or a[3])

    peak = live
    peak_beyond = live - caller_live

    def reach(total: int) -> None:
        nonlocal peak, peak_beyond
        peak = max(peak, total)
        peak_beyond = max(peak_beyond, total - caller_live)

    def release(key):
        nonlocal live, caller_live, inp_lk
        copy = extra.pop(key, 0)
        live -= sizes.get(key, 0) + copy
        caller_live -= caller.get(key, 0)
        add_kind(key, -1)
        lk[0] -= copy
        if key in inp:
            inp_lk -= kind_of[key][0] + kind_of[key][2] + copy

    def unpack(key, nbytes: int) -> None:
        # The device copy unpacking brings back: only of what packing moved or shrank.
        nonlocal live, inp_lk
        if plain or key not in sizes or caller.get(key, 0) >= sizes[key] or not _moved(key):
            return
        extra[key] = nbytes
        live += nbytes
        lk[0] += nbytes
        if key in inp:
            inp_lk += nbytes

    def recompute(ev: Recompute, rec: Record) -> None:
        nonlocal live
        transient = segment_peak(tape, ev.segment)
        reach(live + transient)
        timeline.append((f"bwd {rec.index} recompute", live + transient))
        timeline_kinds.append((lk[0] + transient, lk[1], lk[2]))
        plan_points.append(("recompute", lk[0] + lk[2] - inp_lk + transient))
        for key, v in ev.held:
            if v is not None:
                extra[key] = v.nbytes
                live += v.nbytes
                lk[0] += v.nbytes

    def run(rec: Record) -> None:
        if ("body", rec.index) in sizes:
            # A loop's stacked residuals stay until its backward ends; each step unpacks
            # its own residuals (device copies) on top of them, and a checkpointed scan
            # recomputes one segment's residuals first.
            # jax.vjp inside a body record's backward runs one step at a time too.
            step = (0 if plain else _step_transient(rec)) + _segment_transient(rec)
            step += max(unseen_at.get(rec.index, 0), 0)
            if step:
                reach(live + step)
                timeline.append((f"bwd {rec.index} step", live + step))
                timeline_kinds.append((lk[0] + step, lk[1], lk[2]))
        elif unseen_at.get(rec.index, 0) > 0:
            # jax.vjp's residuals for this record, made and freed inside its backward.
            est = unseen_at[rec.index]
            reach(live + est)
            timeline.append((f"bwd {rec.index} jax.vjp", live + est))
            timeline_kinds.append((lk[0] + est, lk[1], lk[2]))
        reach(live)
        plan_points.append((f"bwd {rec.index}", lk[0] + lk[2] - inp_lk))

    sched = schedule(tape, 0 if plain else resolve_prefetch(policy, tape))
    for st in sched.steps:
        for ev in st.events:
            if type(ev) is Unpack:
                unpack(ev.key, ev.saved.nbytes)
            elif type(ev) is Release:
                release(ev.key)
            elif type(ev) is Recompute:
                recompute(ev, st.record)
            else:
                run(st.record)
        timeline.append((f"bwd {st.record.index}", live))
        timeline_kinds.append((lk[0], lk[1], lk[2]))
    return Timeline(
        tuple(timeline),
        tuple(timeline_kinds),
        residual,
        peak,
        peak_beyond,
        input_live,
        tuple(plan_points),
    )
