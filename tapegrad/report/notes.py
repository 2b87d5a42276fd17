"""Policies that say when they did nothing: `MemoryReport.policy_notes`.

A policy asked to move, compress or recompute residuals that changed no byte is
almost always a mistake the program does not show — an ``offload()`` whose only
residuals are the function's own inputs (which it leaves alone), a ``selective``
predicate that matched no record, a budget above what ``save()`` keeps anyway,
``compress`` on values already in a narrow dtype. `policy_notes` compares the run
with what ``save()`` would have done and says so, one line per finding; `memory_report`
also warns once per policy object (`UserWarning`), eagerly.

User policies built on hooks (`saved_tensors_hooks`, `hooks`, `residual_policy`) are not
judged: their pack/unpack may do anything, logging included.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

from tapegrad.core.residual_policy import SAVE
from tapegrad.core.tape import Tape
from tapegrad.display.common import human_bytes
from tapegrad.engine.checkpoint import Selective, plan_recompute
from tapegrad.planner import Budget
from tapegrad.policies.compress import Compress
from tapegrad.policies.hooks import Route
from tapegrad.policies.loops import ScanCheckpoint
from tapegrad.policies.offload import Offload

__all__ = ["policy_notes", "warn_once"]


def _recomputes(tape: Tape) -> set:
    """What a tape recomputes in backward: its recompute records, and its checkpointed
    loops (a scan with a schedule)."""
    out: set = {r.index for r in tape.records if r.decision == "recompute"}
    out |= {("loop", r.index) for r in tape.records if r.schedule or r.snapshots}
    return out


def _recomputes_more(tape: Tape, unplanned: Tape) -> bool:
    """Whether ``tape`` recomputes anything ``save()``'s plan of ``unplanned`` does not
    (save() rebuilds cheap exact values too; a policy may rebuild fewer)."""
    return bool(_recomputes(tape) - _recomputes(plan_recompute(unplanned, SAVE)))


def policy_notes(policy: Any, tape: Tape, unplanned: Tape, rep: Any) -> tuple[str, ...]:
    """Lines saying that ``policy`` (which planned ``tape`` from ``unplanned``; ``rep`` is
    its report) moved, compressed and recomputed nothing that ``save()`` would not."""
    if policy is None or policy is SAVE:
        return ()
    host = rep.host_bytes
    compressed = sum(r.compressed_bytes for r in rep.records)
    kept = human_bytes(rep.residual_bytes)
    if isinstance(policy, Offload):
        if host:
            return ()
        if rep.residual_bytes and rep.residual_bytes == rep.input_bytes and not policy.inputs:
            why = (
                f"all {kept} kept are the function's own inputs, which a policy leaves "
                "where the caller holds them (offload(inputs=True) moves them too)"
            )
        elif not rep.residual_bytes:
            why = "backward keeps nothing"
        else:
            why = "no residual reached it (a route or base policy kept them all)"
        return (f"{policy!r} moved no byte to host memory: {why}.",)
    if isinstance(policy, Compress):
        if compressed:
            return ()
        return (
            f"{policy!r} compressed no residual ({kept} kept as they are): they are "
            "inputs (inputs=False leaves them alone), integers, or already in a dtype "
            "no narrower than the target.",
        )
    if not isinstance(policy, (Budget, Selective, ScanCheckpoint, Route)):
        return ()
    if host or compressed:
        return ()
    if _recomputes_more(tape, unplanned):
        return ()
    if isinstance(policy, Budget):
        return (
            f"{policy!r} changed nothing: save() keeps {human_bytes(rep.beyond_inputs_bytes)} "
            "of activations, within the budget, so every residual is kept as save() keeps it.",
        )
    if isinstance(policy, Selective):
        return (
            f"{policy!r} recomputed nothing: its function chose to save every record "
            "(no record got CheckpointPolicy.NEVER or PREFER_RECOMPUTE).",
        )
    if isinstance(policy, ScanCheckpoint):
        return (f"{policy!r} checkpointed no loop: the tape has no scan it applies to.",)
    return (
        f"{policy!r} kept every residual as save() keeps it: it moved, compressed and "
        "recomputed nothing.",
    )


_WARNED: weakref.WeakSet = weakref.WeakSet()
_WARNED_IDS: set[int] = set()


def warn_once(policy: Any, notes: tuple[str, ...], stacklevel: int = 3) -> None:
    """A `UserWarning` with ``notes``, the first time ``policy`` (the object) has any."""
    if not notes:
        return
    try:
        if policy in _WARNED:
            return
        _WARNED.add(policy)
    except TypeError:  # unhashable or not weak-referenceable
        if id(policy) in _WARNED_IDS:
            return
        _WARNED_IDS.add(id(policy))
    warnings.warn(" ".join(notes), UserWarning, stacklevel=stacklevel)
