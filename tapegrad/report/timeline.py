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
    r = _Replay(tape, plain, acc, unseen)
    r.forward(by_rec)
    for st in schedule(tape, 0 if plain else resolve_prefetch(policy, tape)).steps:
        for ev in st.events:
            if type(ev) is Unpack:
                r.unpack(ev.key, ev.saved.nbytes)
            elif type(ev) is Release:
                r.release(ev.key)
            elif type(ev) is Recompute:
                r.recompute(ev, st.record)
            else:
                r.run(st.record)
        r.point(f"bwd {st.record.index}")
    return Timeline(
        tuple(r.points),
        tuple(r.kinds),
        r.residual,
        r.peak,
        r.peak_beyond,
        r.input_live,
        tuple(r.plan_points),
    )


class _Replay:
    """`replay`'s running counts: live bytes (all, the caller's, and by kind: device,
    host, compressed), the device copies and recomputed values backward holds per key,
    the peaks, and the points recorded so far."""

    def __init__(
        self, tape: Tape, plain: bool, acc: Accounts, unseen: Sequence[tuple[int, UnseenBackward]]
    ):
        self.tape, self.plain = tape, plain
        self.sizes_acc, self.sizes, self.kind_of, self.caller = (
            acc.bytes_of,
            acc.sizes,
            acc.kind_of,
            acc.caller,
        )
        self.input_ids = {v.id for v in tape.inputs} | {v.id for v, _ in tape.consts}
        self.lk = [0, 0, 0]  # live bytes by kind (device, host, compressed), as ``live``
        self.unseen_at: dict[int, int] = {}  # top-level record -> largest estimate within it
        for at, u in unseen:
            self.unseen_at[at] = max(self.unseen_at.get(at, 0), u.bytes)
        self.points: list[tuple[str, int]] = []
        self.kinds: list[tuple[int, int, int]] = []
        # The schedule as a budget's planner sees it (`tapegrad.planner.joint.Timeline`):
        # device and compressed bytes of activations (the tape's own inputs not counted) at
        # the end of forward, at each recomputation and during each record's backward.
        self.plan_points: list[tuple[str, int]] = []
        self.inp = {k for k in self.sizes if isinstance(k, int) and k in self.input_ids}
        self.live = sum(self.sizes[k] for k in self.inp)
        self.caller_live = sum(self.caller.get(k, 0) for k in self.inp)
        for k in self.inp:
            self._add_kind(k)
        self.input_live = self.live
        self.inp_lk = sum(self.kind_of[k][0] + self.kind_of[k][2] for k in self.inp)
        self.extra: dict[Any, int] = {}  # unpacked device copies and recomputed values
        self.residual = self.peak = self.peak_beyond = 0

    def _add_kind(self, key, sign=1) -> None:
        for i, b in enumerate(self.kind_of.get(key, (0, 0, 0))):
            self.lk[i] += sign * b

    def point(self, label: str, transient: int = 0) -> None:
        self.points.append((label, self.live + transient))
        self.kinds.append((self.lk[0] + transient, self.lk[1], self.lk[2]))

    def plan_point(self, label: str, transient: int = 0) -> None:
        self.plan_points.append((label, self.lk[0] + self.lk[2] - self.inp_lk + transient))

    def forward(self, by_rec: dict[int, list]) -> None:
        """Each record's kept keys become live; its point follows it."""
        for rec in self.tape.records:
            for key in by_rec.get(rec.index, ()):
                if not (isinstance(key, int) and key in self.input_ids):
                    self.live += self.sizes[key]
                    self.caller_live += self.caller.get(key, 0)
                    self._add_kind(key)
            self.point(f"fwd {rec.index}")
        self.residual = self.peak = self.live
        self.peak_beyond = self.live - self.caller_live
        self.plan_point("forward")

    def reach(self, total: int) -> None:
        self.peak = max(self.peak, total)
        self.peak_beyond = max(self.peak_beyond, total - self.caller_live)

    def _moved(self, key) -> bool:
        # Unpacking makes a device copy only of what packing moved to host or shrank; a
        # residual kept as it is on device (a budget's "save") unpacks to itself.
        a = self.sizes_acc.get(key)
        return a is None or bool(a[1] or a[2] or a[3])

    def release(self, key) -> None:
        copy = self.extra.pop(key, 0)
        self.live -= self.sizes.get(key, 0) + copy
        self.caller_live -= self.caller.get(key, 0)
        self._add_kind(key, -1)
        self.lk[0] -= copy
        if key in self.inp:
            self.inp_lk -= self.kind_of[key][0] + self.kind_of[key][2] + copy

    def unpack(self, key, nbytes: int) -> None:
        """The device copy unpacking brings back: only of what packing moved or shrank."""
        sizes = self.sizes
        if (
            self.plain
            or key not in sizes
            or self.caller.get(key, 0) >= sizes[key]
            or not self._moved(key)
        ):
            return
        self.extra[key] = nbytes
        self.live += nbytes
        self.lk[0] += nbytes
        if key in self.inp:
            self.inp_lk += nbytes

    def recompute(self, ev: Recompute, rec: Record) -> None:
        transient = segment_peak(self.tape, ev.segment)
        self.reach(self.live + transient)
        self.point(f"bwd {rec.index} recompute", transient)
        self.plan_point("recompute", transient)
        for key, v in ev.held:
            if v is not None:
                self.extra[key] = v.nbytes
                self.live += v.nbytes
                self.lk[0] += v.nbytes

    def run(self, rec: Record) -> None:
        unseen = self.unseen_at.get(rec.index, 0)
        if ("body", rec.index) in self.sizes:
            # A loop's stacked residuals stay until its backward ends; each step unpacks
            # its own residuals (device copies) on top of them, and a checkpointed scan
            # recomputes one segment's residuals first.
            # jax.vjp inside a body record's backward runs one step at a time too.
            step = (0 if self.plain else _step_transient(rec)) + _segment_transient(rec)
            step += max(unseen, 0)
            if step:
                self.reach(self.live + step)
                self.point(f"bwd {rec.index} step", step)
        elif unseen > 0:
            # jax.vjp's residuals for this record, made and freed inside its backward.
            self.reach(self.live + unseen)
            self.point(f"bwd {rec.index} jax.vjp", unseen)
        self.reach(self.live)
        self.plan_point(f"bwd {rec.index}")
