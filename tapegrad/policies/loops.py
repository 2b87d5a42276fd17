"""Checkpoint schedules for loops: keep a scan's carry every k steps, recompute the rest.

A scan of T steps normally keeps every step's residuals (T × one step's bytes).
`scan_checkpoint(every=k)` keeps only the carry at the start of each k-step segment
in forward; backward re-runs one segment at a time from its carry, with the body's
forward interpreter, keeping that segment's residuals, then runs its backward. With
k = √T that is about 2√T steps' worth of memory for one extra forward pass.
"""

from __future__ import annotations

import math
from typing import Any

from tapegrad.policies._base import SAVE

__all__ = ["ScanCheckpoint", "scan_checkpoint"]


class ScanCheckpoint:
    """Wraps a policy: residuals still go through ``base``; scans get a schedule."""

    def __init__(self, every: int | str = "sqrt", base: Any = None, min_length: int = 4):
        if not (every == "sqrt" or (isinstance(every, int) and every >= 1)):
            raise ValueError(
                f"scan_checkpoint: every must be a positive int or 'sqrt', got {every!r}."
            )
        self.every, self.min_length = every, min_length
        self.base = SAVE if base is None else base
        self.prefetch = getattr(self.base, "prefetch", 0)

    def loop_segment(self, rec: Any) -> int:
        """Segment length for a scan record (0: keep every step)."""
        T = rec.trip_count
        if rec.primitive != "scan" or T < self.min_length or rec.params.get("reverse"):
            return 0
        k = math.isqrt(T - 1) + 1 if self.every == "sqrt" else int(self.every)
        return k if 1 <= k < T else 0

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
        return f"scan_checkpoint(every={self.every!r}, base={self.base!r})"


def scan_checkpoint(every: int | str = "sqrt", base: Any = None, min_length: int = 4):
    """Keep a scan's carry every ``every`` steps (``"sqrt"``: ⌈√T⌉) and recompute each
    segment in backward; residuals go through ``base`` (default `save()`).

    ```python
    g = tg.grad(rnn_loss, policy=tg.policies.scan_checkpoint("sqrt"))(w, xs)
    ```
    Applies to forward scans of at least ``min_length`` steps (``reverse=True`` scans
    keep every step). Under anomaly detection every step is kept, so checks see each one.
    """
    return ScanCheckpoint(every, base, min_length)
