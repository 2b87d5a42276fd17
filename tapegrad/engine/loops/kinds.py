"""The loop and branch record kinds (``scan``, ``cond``), registered with the tape's
kind table (`tapegrad.core.tape.register_kind`) the way jax's loops register their rules
into ``ad``: the interpreter runs a record with bodies through its kind, and the tape
sizes its residuals through it, without importing loop code.

A loop record carries its body as a `Tape`; its forward runs the *same* forward
interpreter on that body once per step, and its backward runs the same backward
interpreter once per step in the opposite order. Nothing here knows a rule: it only
moves values between steps.

* Per-step residuals are packed inside the step, through the active policy, so a policy
  that moves or shrinks a residual does it step by step. Residuals that are the body's
  loop-invariant inputs (a scan's consts) or its scanned slices are not stacked: the
  outer record saves them once (its ``saves``) and backward hands them (or the step's
  slice) back to the body.
* Scans: `tapegrad.engine.loops.scan` (steps), `tapegrad.engine.loops.schedule`
  (checkpoint schedules, revolve); conds: `tapegrad.engine.loops.cond`; sizes:
  `tapegrad.engine.loops.saves`.
"""

from __future__ import annotations

from typing import Any

from tapegrad.core.tape import Record, RecordKind, register_kind
from tapegrad.engine.loops.cond import _cond_backward, _cond_forward
from tapegrad.engine.loops.saves import loop_residual_bytes
from tapegrad.engine.loops.scan import _scan_backward, _scan_forward
from tapegrad.engine.loops.schedule import (
    _Segmented,
    _segmented_backward,
    _segmented_forward,
    revolve_backward,
    revolve_forward,
)

__all__ = ["scan_forward", "scan_backward"]


def scan_forward(rec: Record, ins: list, res, observer=None, start: Any = 0) -> tuple[list, Any]:
    """A scan record's outputs and per-step residuals; ``start``: the index of the first
    step run here (a segment's offset in its scan). A checkpointed scan runs its
    schedule (not under anomaly mode, which checks every step as it runs)."""
    if rec.snapshots and observer is None:
        return revolve_forward(rec, ins, res)
    if rec.schedule and observer is None:
        return _segmented_forward(rec, ins, res)
    return _scan_forward(rec, ins, res, observer, start)


def scan_backward(rec: Record, x: list, stored: Any, gs: list, retain: bool, observer=None) -> list:
    if isinstance(stored, _Segmented):
        if rec.snapshots:
            return revolve_backward(rec, x, stored, gs, retain)
        return _segmented_backward(rec, x, stored, gs, retain)
    return _scan_backward(rec, x, stored, gs, retain, observer)


register_kind("scan", RecordKind(scan_forward, scan_backward, loop_residual_bytes))
register_kind("cond", RecordKind(_cond_forward, _cond_backward, loop_residual_bytes))
