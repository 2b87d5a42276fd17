"""The memory-budget planner: choose save or recompute per record so that the
peak of live residual bytes stays under a budget at the least recompute cost.

The planner is a tape pass. It respects binding decisions (``ALWAYS`` /
``NEVER`` from a `tg.selective` base, and the policies of `jax.checkpoint`
regions) and treats ``PREFER_*`` as hints. Peak memory and recompute cost are
estimated statically from the tape (shapes, dtypes; flops from shapes), by
replaying the same save/release/recompute schedule the interpreter follows.

Budgets count *activation* residuals: values kept for backward that are not
the function's own inputs (those are alive anyway, whatever is saved).

Search (see `Budget.plan`): keep the hints if they fit; on a chain, the exact
dynamic program of `_planner_chain`; on other tapes, the same program over
layers (`_planner_stages`); on any tape, the hand-written policies' own
decisions (dots saved, ...), cut plans in the style of Chen et al.'s sublinear
checkpointing alone and combined with them, and greedy search
(`_planner_search`). Every candidate is scored by `estimate`, the executor's
own schedule, so the choice is never worse than a candidate it tried.
Records with side effects (io_callback, any effect `passes.check_effects` rejects)
are never recomputed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from tapegrad._tape import Record, Tape, itemsize
from tapegrad.errors import TapegradError

__all__ = ["Budget", "budget", "estimate", "BudgetError", "record_flops"]


class BudgetError(TapegradError, ValueError):
    """No save/recompute plan fits the budget."""


def record_flops(rec: Record) -> float:
    """A rough cost of re-running ``rec``: 2·M·N·K for dots, output size otherwise."""
    out = sum(math.prod(o.shape) for o in rec.outputs)
    if rec.primitive == "dot_general":
        (lc, _), _ = rec.params["dimension_numbers"]
        k = math.prod(rec.inputs[0].shape[d] for d in lc) if lc else 1
        return 2.0 * out * k
    if rec.primitive == "conv_general_dilated":
        rhs = rec.inputs[1].shape
        return 2.0 * out * math.prod(rhs) / max(rhs[0], 1)
    return float(max(out, 1))


def _nbytes(v) -> int:
    # Var.nbytes's number, without numpy's per-call overhead (the planner scores
    # hundreds of plans of hundreds of records)
    return math.prod(v.shape) * itemsize(v.dtype)


def _uses(tape: Tape) -> dict[Any, int]:
    uses: dict[Any, int] = {}
    for rec in tape.records:
        if rec.rule == "none":
            continue
        for s in rec.saves:
            key = rec.residual_key(s)
            uses[key] = uses.get(key, 0) + 1
    for seg in tape.segments:
        for v in seg.inputs:
            uses[v.id] = uses.get(v.id, 0) + 1
    return uses


def segment_flops(tape: Tape, seg: Any) -> float:
    """What backward spends recomputing one segment: each of its records once."""
    return sum(record_flops(tape.records[i]) for i in seg.records)


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
    ``trace``, also the largest live bytes while backward runs each record (by index)."""
    from tapegrad._checkpoint import segment_peak

    memo = {} if memo is None else memo
    inputs = {v.id for v in tape.inputs} | {v.id for v, _ in tape.consts}
    kept, seg_of = tape.residual_keys()
    size = {k: (0 if (isinstance(k, int) and k in inputs) else _nbytes(v)) for k, v in kept.items()}
    live = sum(size.values())  # forward only adds: the peak of forward is its end
    peak = live
    remaining = _uses(tape)
    extra: dict[Any, int] = {}
    flops = 0.0
    done: set[int] = set()

    def release(key):
        nonlocal live
        remaining[key] -= 1
        if remaining[key] == 0:
            live -= size.get(key, 0) + extra.pop(key, 0)

    for rec in reversed(tape.records):
        if rec.rule == "none":
            continue
        keys = []
        for s in rec.saves:
            key = rec.residual_key(s)
            keys.append(key)
            if key in extra or key in size or key not in seg_of:
                continue
            seg = tape.segments[seg_of[key]]
            if seg.id in done:
                continue
            done.add(seg.id)
            mkey = (seg.records, tuple(o.id for o in seg.outputs))
            if mkey not in memo:
                memo[mkey] = (segment_flops(tape, seg), segment_peak(tape, seg))
            seg_flops, seg_peak = memo[mkey]
            flops += seg_flops
            peak = max(peak, live + seg_peak)
            if trace is not None:
                trace[rec.index] = max(trace.get(rec.index, 0), live + seg_peak)
            for o in seg.outputs:
                extra[o.id] = _nbytes(o)
                live += extra[o.id]
            for v in seg.inputs:
                release(v.id)
        peak = max(peak, live)
        if trace is not None:
            trace[rec.index] = max(trace.get(rec.index, 0), live)
        for key in keys:
            release(key)
    return peak, flops, size


class Budget:
    """A residual policy whose tape plan keeps the activation peak under ``bytes``."""

    def __init__(self, bytes: int, base: Any = None):
        from tapegrad.policies._base import SAVE

        if bytes < 0:
            raise ValueError(f"budget: bytes must be >= 0, got {bytes}")
        self.bytes = int(bytes)
        self.base = SAVE if base is None else base
        self.prefetch = getattr(self.base, "prefetch", 0)
        self.last: dict[str, Any] = {}
        # Plans by tape structure: tg.grad, memory_report and jit of one function
        # trace the same tape; planning it once keeps tracing cheap. Bounded.
        self._plans: dict[tuple, tuple[list[str], dict[str, Any]]] = {}

    def pack(self, value, info):
        return self.base.pack(value, info)

    def unpack(self, packed, info):
        return self.base.unpack(packed, info)

    def loop_segment(self, rec: Record) -> Any:
        """A checkpoint schedule (`policies.loops.LoopPlan`) for a scan whose per-step
        residuals, over all its steps, do not fit the budget: among keep-every-step,
        one level every k steps, nested levels, the halving schedule and binomial
        (revolve) schedules, the one re-running the fewest forward steps whose predicted
        backward peak fits (`choose_loop_schedule`, by `_loops.schedule_costs`).
        (Loops are scheduled on their own: the tape plan does not yet trade a loop's
        bytes against the records around it.)"""
        from tapegrad.policies.loops import LoopPlan, choose_loop_schedule

        if rec.primitive != "scan" or rec.trip_count < 4:
            return LoopPlan()
        return choose_loop_schedule(rec, self.bytes)

    def plan(self, tape: Tape, fixed: Sequence[str | None]) -> list[str]:
        """Decisions for every record; ``fixed[i]`` is a binding decision or None.

        1. Records with side effects are kept ("save"): recomputing them would run
           the effect again (`passes.check_effects` would reject the plan).
        2. If the hints (PREFER_x means x; unannotated means save) fit, keep them.
        3. Otherwise score candidates with `estimate` (the executor's schedule) and
           keep the fitting one with the least recompute flops: the exact chain
           program when the tape is a chain (`_planner_chain`), else the same
           program over layers (`_planner_stages`); the hand-written policies'
           decisions, cut plans alone and combined with them, ratio plans, a greedy
           descent on small tapes, then a greedy refinement of the best
           (`_planner_search`).
        ``self.last`` says what was chosen: peak bytes, flops, the winning family.
        """
        from tapegrad.policies import _planner_search as search
        from tapegrad.policies._planner_chain import as_chain, chain_plan
        from tapegrad.policies._planner_stages import stage_plan

        fixed = _keep_effects(tape, fixed)
        choose = getattr(self.base, "choose", None)
        hints = [
            choose(r) if (choose is not None and f is None) else None
            for r, f in zip(tape.records, fixed)
        ]
        key = (search.structure_key(tape, fixed), tuple(hints))
        if key in self._plans:
            dec, self.last = self._plans[key]
            return list(dec)
        sc = search.Scorer(tape, fixed, self.bytes)
        hinted = sc.with_fixed("save" if h is None or h.saves else "recompute" for h in hints)
        if sc.fits(hinted, "hints"):
            best = sc.best
        else:
            ch = as_chain(tape)
            if ch is not None:
                chain_dec = chain_plan(ch, fixed, self.bytes)
                if chain_dec is not None:
                    sc.score(chain_dec, "chain DP")
            else:
                stage_dec = stage_plan(sc)
                if stage_dec is not None:
                    sc.score(stage_dec, "stage DP")
            search.class_plans(sc)
            search.cut_plans(sc)
            search.ratio_plans(sc)
            if ch is None:  # on a chain the program is already optimal
                search.descend(sc)
            search.refine(sc)
            best = sc.best
        if best is None:
            raise BudgetError(
                f"no save/recompute plan found that keeps activation residuals under "
                f"{self.bytes:,} bytes; the smallest peak among the plans tried is {sc.floor:,} "
                "bytes. Raise the budget to at least that, or make a finer-grained program "
                "(e.g. tg.checkpoint per layer) so less must be held at once."
            )
        flops, peak, chosen, family = best
        self.last = {"peak_bytes": peak, "recompute_flops": flops, "plan": family}
        if len(self._plans) >= 8:
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = (list(chosen), self.last)
        return list(chosen)

    def __repr__(self) -> str:
        return f"budget(bytes={self.bytes:,}, base={self.base!r})"


def _keep_effects(tape: Tape, fixed: Sequence[str | None]) -> list[str | None]:
    """Binding "save" for every free record with a harmful side effect."""
    from tapegrad.passes.checks import _harmful, effects_of

    return [
        f if f is not None or not _harmful(effects_of(r)) else "save"
        for r, f in zip(tape.records, fixed)
    ]


def budget(bytes: int, base: Any = None) -> Budget:
    """Let the planner choose what to recompute so residuals stay under ``bytes``.

    ```python
    tg.grad(loss, policy=tg.policies.budget(bytes=64 << 20))(params, x)
    ```
    ``base`` is the residual policy for what is saved; a `tg.selective` base makes
    its ALWAYS/NEVER binding and its PREFER_* hints. Records with side effects are
    never chosen for recompute.
    """
    return Budget(bytes, base)
