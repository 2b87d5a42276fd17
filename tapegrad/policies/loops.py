"""Checkpoint schedules for loops: keep a scan's carry every k steps, recompute the rest.

A scan of T steps normally keeps every step's residuals (T × one step's bytes).
`scan_checkpoint(every=k)` keeps only the carry at the start of each k-step segment
in forward; backward re-runs one segment at a time from its carry, with the body's
forward interpreter, keeping that segment's residuals, then runs its backward. With
k = √T that is about 2√T steps' worth of memory for one extra forward pass.

Nested schedules (``levels=L``) checkpoint each recomputed segment again: the segment
runner runs the segment as a scan with the next level's schedule. L levels hold about
(L+1)·T^(1/(L+1)) steps' worth for L extra forward passes; ``every="log"`` halves the
segment at each level (about 2·log₂T carries, log₂T extra forwards).

Binomial checkpointing (``snapshots=s``, Griewank's *revolve*) holds at most ``s``
carries at once and re-runs the fewest forward steps that allows: with ``r`` re-runs per
step at most C(s + r, s) steps can be reversed. Its snapshots are not evenly spaced: the
schedule is computed from T and s (`tapegrad.engine.loops.revolve.revolve_plan`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tapegrad.core.residual_policy import SAVE, declared
from tapegrad.engine.loops.revolve import revolve_reruns
from tapegrad.engine.loops.saves import loop_bytes, schedule_costs

__all__ = ["ScanCheckpoint", "scan_checkpoint", "LoopPlan", "choose_loop_schedule"]


def _root_ceil(n: int, r: int) -> int:
    """The least k >= 1 with k**r >= n (an exact integer root, rounded up)."""
    k = max(1, round(n ** (1.0 / r)))
    while k**r < n:
        k += 1
    while k > 1 and (k - 1) ** r >= n:
        k -= 1
    return k


def balanced_levels(T: int, levels: int) -> tuple[int, ...]:
    """Segment lengths for ``levels`` nested levels over ``T`` steps, outermost first:
    level i keeps the carry every ⌈T^((L+1-i)/(L+1))⌉ steps, so each level holds about
    T^(1/(L+1)) carries (``levels=1``: ⌈√T⌉)."""
    L = levels
    return tuple(_root_ceil(T ** (L + 1 - i), L + 1) for i in range(1, L + 1))


def halving_levels(T: int) -> tuple[int, ...]:
    """Segment lengths 2^(m-1), …, 2 with 2^m >= T: two segments per level."""
    out, k = [], 1
    while 2 * k < T:
        k *= 2
    while k >= 2:
        out.append(k)
        k //= 2
    return tuple(out)


class ScanCheckpoint:
    """Wraps a policy: residuals still go through ``base``; scans get a schedule."""

    def __init__(
        self,
        every: int | str = "sqrt",
        base: Any = None,
        min_length: int = 4,
        levels: int = 1,
        snapshots: int | None = None,
    ):
        if not (every in ("sqrt", "log") or (isinstance(every, int) and every >= 1)):
            raise ValueError(
                f"scan_checkpoint: every must be a positive int, 'sqrt' or 'log', got {every!r}."
            )
        if not (isinstance(levels, int) and levels >= 1):
            raise ValueError(f"scan_checkpoint: levels must be a positive int, got {levels!r}.")
        if every == "log" and levels != 1:
            raise ValueError(
                "scan_checkpoint: every='log' picks its own levels (one per halving); "
                f"drop levels={levels!r} or pass every='sqrt' with levels."
            )
        if snapshots is not None:
            if not (isinstance(snapshots, int) and snapshots >= 1):
                raise ValueError(
                    f"scan_checkpoint: snapshots must be a positive int, got {snapshots!r}."
                )
            if every != "sqrt" or levels != 1:
                raise ValueError(
                    "scan_checkpoint: snapshots= picks its own (binomial) schedule; drop "
                    f"every={every!r}/levels={levels!r}, or drop snapshots={snapshots!r}."
                )
        self.every, self.min_length, self.levels = every, min_length, levels
        self.snapshots = snapshots
        self.base = SAVE if base is None else base

    @property
    def prefetch(self) -> int | str:
        return declared(self.base, "prefetch", 0)  # read now: a budget sets it as it plans

    def loop_schedule(self, rec: Any) -> tuple[int, ...]:
        """Segment lengths for a scan record, outermost first (() keeps every step)."""
        T = rec.trip_count
        if rec.primitive != "scan" or T < self.min_length or self.snapshots is not None:
            return ()
        if self.every == "log":
            want = halving_levels(T)
        elif self.every == "sqrt":
            want = balanced_levels(T, self.levels)
        else:
            k = int(self.every)
            want = (k, *balanced_levels(k, self.levels - 1)) if self.levels > 1 else (k,)
        out: list[int] = []
        for k in want:  # strictly shorter at each level; a 1-step inner level adds nothing
            if k < (out[-1] if out else T) and (k > 1 or not out):
                out.append(k)
        return tuple(out)

    def loop_segment(self, rec: Any) -> int:
        """Outermost segment length for a scan record (0: keep every step)."""
        levels = self.loop_schedule(rec)
        return levels[0] if levels else 0

    def loop_snapshots(self, rec: Any) -> int:
        """Snapshots of a binomial (revolve) schedule for a scan record (0: none)."""
        if self.snapshots is None or rec.primitive != "scan":
            return 0
        if rec.trip_count < self.min_length or not rec.params["num_carry"]:
            return 0
        return self.snapshots

    def pack(self, value, info):
        return self.base.pack(value, info)

    def unpack(self, packed, info):
        return self.base.unpack(packed, info)

    def __getattr__(self, name: str) -> Any:
        # selective decisions (decide/choose/plan) of a wrapped policy still apply
        if name in ("decide", "choose", "plan"):
            got = declared(self.base, name)
            if got is not None:
                return got
        raise AttributeError(name)

    def __repr__(self) -> str:
        if self.snapshots is not None:
            return f"scan_checkpoint(snapshots={self.snapshots}, base={self.base!r})"
        lv = f", levels={self.levels}" if self.levels != 1 else ""
        return f"scan_checkpoint(every={self.every!r}{lv}, base={self.base!r})"


def scan_checkpoint(
    every: int | str = "sqrt",
    base: Any = None,
    min_length: int = 4,
    levels: int = 1,
    snapshots: int | None = None,
):
    """Keep a scan's carry every ``every`` steps and recompute each segment in backward;
    residuals go through ``base`` (default `save()`).

    * ``every="sqrt"`` (default): ⌈√T⌉ steps per segment, about 2√T steps held for one
      extra forward. With ``levels=L`` the schedule nests: each recomputed segment is
      checkpointed again, level by level (segments of ⌈T^(L/(L+1))⌉, …, ⌈T^(1/(L+1))⌉
      steps), about (L+1)·T^(1/(L+1)) steps held for L extra forwards.
    * ``every=k``: k steps per outer segment; ``levels=L`` nests L-1 balanced levels
      inside each segment.
    * ``every="log"``: halve the segment at each level down to 2 steps: about 2·log₂T
      carries held for about log₂T extra forwards.
    * ``snapshots=s``: binomial checkpointing (Griewank's revolve): at most ``s`` carries
      held at once (the initial one included) and one step's residuals, for the fewest
      forward steps re-run that allows: r·T − C(s + r, r − 1) for the least r with
      C(s + r, s) ≥ T (s = 10, T = 10,000: r = 7, 57,624 steps re-run).

    ```python
    pol = tg.policies.scan_checkpoint("sqrt", levels=2)  # ~3·T^(1/3) steps, 2 extra fwd
    g = tg.grad(rnn_loss, policy=pol)(w, xs)
    ```
    Applies to scans of at least ``min_length`` steps, forward or ``reverse=True`` (a
    reverse scan's segments follow its own step order). Under anomaly detection every
    step is kept, so checks see each one. `tg.memory_report` lists each scheduled scan's
    levels, carries kept, peak steps held in backward and forward steps recomputed.
    """
    return ScanCheckpoint(every, base, min_length, levels, snapshots)


# ------------------------------------------------------------ choosing a schedule


@dataclasses.dataclass(frozen=True)
class LoopPlan:
    """A scan's checkpoint schedule as a policy hands it to the tape: segment ``levels``
    (outermost first; () keeps every step) or binomial ``snapshots`` (0: none), with what
    it was predicted to cost: ``peak_bytes`` of residuals and carries held at once in
    backward, ``recomputed`` forward steps re-run."""

    levels: tuple[int, ...] = ()
    snapshots: int = 0
    peak_bytes: int = 0
    recomputed: int = 0

    def __repr__(self) -> str:
        what = (
            f"snapshots={self.snapshots}"
            if self.snapshots
            else f"levels={self.levels}"
            if self.levels
            else "every step"
        )
        return f"LoopPlan({what}, peak {self.peak_bytes:,} B, re-runs {self.recomputed:,})"


def _strictly_shorter(T: int, want: tuple[int, ...]) -> tuple[int, ...]:
    out: list[int] = []
    for k in want:  # as `ScanCheckpoint.loop_schedule` keeps them
        if k < (out[-1] if out else T) and (k > 1 or not out):
            out.append(k)
    return tuple(out)


def loop_plans(rec: Any) -> list[LoopPlan]:
    """The schedules a budget chooses among for a scan record, each with its predicted
    backward peak (`_loops.schedule_costs`' carries and steps, in `loop_bytes`' sizes) and
    forward steps re-run: keep every step; one level of k = √(T·carry/step) steps (the
    fewest bytes for one extra forward) and of ⌈√T⌉; 2-4 balanced nested levels; the
    halving schedule; binomial schedules with as many snapshots as each of those holds
    at its peak, and with 2·log₂T."""
    T = rec.trip_count
    base = dataclasses.replace(rec, schedule=0, inner_schedule=(), snapshots=0)
    lb = loop_bytes(base)
    out = [LoopPlan((), 0, lb.total, 0)]
    if rec.primitive != "scan":
        return out
    nc, nk = rec.params["num_consts"], rec.params["num_carry"]
    if T < 2 or not lb.step or not nk:
        return out
    carry = sum(v.nbytes for v in rec.bodies[0].inputs[nc : nc + nk]) or 1
    lb = dataclasses.replace(lb, carry=carry)
    k_min = max(1, round(math.sqrt(T * carry / lb.step)))
    wants = {(k_min,), (_root_ceil(T, 2),), halving_levels(T)}
    wants |= {balanced_levels(T, L) for L in range(2, 5)}
    held = set()
    for want in sorted(wants):
        levels = _strictly_shorter(T, want)
        if not levels:
            continue
        c = schedule_costs(dataclasses.replace(base, schedule=levels[0], inner_schedule=levels[1:]))
        assert c is not None
        peak = dataclasses.replace(lb, steps=c.peak_steps, checkpoints=c.peak_carries).total
        out.append(LoopPlan(levels, 0, peak, c.recomputed))
        held.add(c.peak_carries + c.peak_steps * max(1, lb.step // carry))
    for s in sorted(held | {2 * T.bit_length()}):
        s = max(2, min(s, T - 1))
        # at most s slots and the carry in hand, one step's residuals (`schedule_costs`)
        peak = dataclasses.replace(lb, steps=1, checkpoints=s + 1).total
        out.append(LoopPlan((), s, peak, revolve_reruns(T, s)))
    return out


def choose_loop_schedule(rec: Any, bytes: int) -> LoopPlan:
    """The schedule for a scan record that re-runs the fewest forward steps among
    `loop_plans` whose predicted backward peak fits ``bytes`` (ties: the fewest bytes);
    when none fits, the one with the smallest peak. Binomial schedules get the most
    snapshots that fit: (bytes − one step) / carry − 1."""
    if rec.primitive != "scan":
        return LoopPlan()
    plans = loop_plans(rec)
    if rec.trip_count < 2 or len(plans) == 1:
        return plans[0]
    keep = plans[0]
    nc, nk = rec.params["num_consts"], rec.params["num_carry"]
    carry = sum(v.nbytes for v in rec.bodies[0].inputs[nc : nc + nk]) or 1
    lb = loop_bytes(dataclasses.replace(rec, schedule=0, inner_schedule=(), snapshots=0))
    s = min((bytes - lb.step) // carry - 1, rec.trip_count - 1)
    if s >= 2:
        peak = dataclasses.replace(lb, steps=1, checkpoints=s + 1, carry=carry).total
        plans.append(LoopPlan((), s, peak, revolve_reruns(rec.trip_count, s)))
    fits = [p for p in plans if p.peak_bytes <= bytes]
    if keep in fits:
        return keep
    if fits:
        return min(fits, key=lambda p: (p.recomputed, p.peak_bytes))
    return min(plans, key=lambda p: (p.peak_bytes, p.recomputed))
