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
"""

from __future__ import annotations

from typing import Any

from tapegrad.policies._base import SAVE

__all__ = ["ScanCheckpoint", "scan_checkpoint"]


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
        self, every: int | str = "sqrt", base: Any = None, min_length: int = 4, levels: int = 1
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
        self.every, self.min_length, self.levels = every, min_length, levels
        self.base = SAVE if base is None else base
        self.prefetch = getattr(self.base, "prefetch", 0)

    def loop_schedule(self, rec: Any) -> tuple[int, ...]:
        """Segment lengths for a scan record, outermost first (() keeps every step)."""
        T = rec.trip_count
        if rec.primitive != "scan" or T < self.min_length:
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

    def pack(self, value, info):
        return self.base.pack(value, info)

    def unpack(self, packed, info):
        return self.base.unpack(packed, info)

    def __getattr__(self, name: str) -> Any:
        # selective decisions (decide/choose/plan) of a wrapped policy still apply
        if name in ("decide", "choose", "plan"):
            return getattr(self.base, name)
        raise AttributeError(name)

    def __repr__(self) -> str:
        lv = f", levels={self.levels}" if self.levels != 1 else ""
        return f"scan_checkpoint(every={self.every!r}{lv}, base={self.base!r})"


def scan_checkpoint(
    every: int | str = "sqrt", base: Any = None, min_length: int = 4, levels: int = 1
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

    ```python
    pol = tg.policies.scan_checkpoint("sqrt", levels=2)  # ~3·T^(1/3) steps, 2 extra fwd
    g = tg.grad(rnn_loss, policy=pol)(w, xs)
    ```
    Applies to scans of at least ``min_length`` steps, forward or ``reverse=True`` (a
    reverse scan's segments follow its own step order). Under anomaly detection every
    step is kept, so checks see each one. `tg.memory_report` lists each scheduled scan's
    levels, carries kept, peak steps held in backward and forward steps recomputed.
    """
    return ScanCheckpoint(every, base, min_length, levels)
