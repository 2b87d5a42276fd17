"""The exact reference for per-residual mechanisms: an integer program over
`joint`'s linear model, solved by HiGHS (``pip install tapegrad[planner]``).

Variables ``x[k, m]`` in {0, 1}: residual ``k`` uses mechanism ``m`` (the options
that apply to it). Constraints: one mechanism per residual; at every point ``t`` of
the schedule, ``fixed[t] + Σ x[k, m]·(stored[k, m]·[t ≤ release_k] +
copy[k, m]·[unpack_k ≤ t ≤ release_k]) ≤ budget``. Objective: the seconds the
mechanisms add. `Budget` uses it, when highspy is importable and the tape has at
most `MAX_RECORDS` records, on each save/recompute plan it completes; the greedy
result stands when the solver stops at its work limit without a better plan.

Solves stop at a count of work (`WORK`, `stop_after`), not at a wall-clock time, so
the plan `Budget` returns is the same on a quiet machine and a loaded one;
`TIME_LIMIT_S` is only a backstop for a machine far slower than expected.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

__all__ = [
    "available",
    "solve",
    "solve_proved",
    "stop_after",
    "MAX_RECORDS",
    "TIME_LIMIT_S",
    "WORK",
]

MAX_RECORDS = 300
# The work one solve may do: HiGHS's rounds (calls of its MIP interrupt callback: after
# presolve, per root separation round, between batches of nodes) times the model's
# nonzeros. A round re-solves the LP, ~2-4 ms per 1,000 nonzeros on one x86 core, so
# this is ~2 s there; small models get more rounds, large ones fewer. Being a count, the
# point where a solve stops, and so the plan, does not depend on the machine's load.
WORK = 1_000_000
# A backstop only: stops a solve the work limit would let run far longer (a much slower
# machine). Where it binds, the plan depends on the load again: at 10 s it bound on a
# busy 2-core machine, where the 230-record U-Net's windowed joint ILP reaches its work
# limit in 6 s when quiet (its plan at 90% of save()'s peak: 5.222 µs quiet, 5.489 busy).
TIME_LIMIT_S = 30.0


def available() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


_BANNER_SHOWN = False


def _highs() -> Any:
    """A silent `highspy.Highs`: its first construction in a process prints a banner
    from C++ to stdout, which a training log does not need."""
    import highspy

    global _BANNER_SHOWN
    if _BANNER_SHOWN:
        h = highspy.Highs()
    else:
        _BANNER_SHOWN = True
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 1)
                h = highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
    h.silent()
    return h


class stop_after:
    """Interrupts ``h``'s next MIP solves once they have done ``work`` (`WORK`'s units:
    rounds times the nonzeros of the model as it is at each round); ``used`` counts the
    work done so far. ``work=None``: no limit (a wall-clock one only)."""

    def __init__(self, h: Any, work: float | None) -> None:
        self.used = 0.0
        self.work = work
        self.h = h
        h.cbMipInterrupt.subscribe(self._round)

    def _round(self, e: Any) -> None:
        self.used += max(self.h.getNumNz(), 1)
        if self.work is not None and self.used >= self.work:
            e.interrupt()


def solve(
    tl: Any, opts: Any, budget: int, time_limit: float = TIME_LIMIT_S, work: float | None = WORK
) -> np.ndarray | None:
    """The least-seconds column per key whose peak fits ``budget``; None when the
    program is infeasible or no solution was found within ``work`` (`WORK`) or
    ``time_limit`` seconds."""
    return solve_proved(tl, opts, budget, time_limit, work)[0]


def solve_proved(
    tl: Any,
    opts: Any,
    budget: int,
    time_limit: float = TIME_LIMIT_S,
    work: float | None = WORK,
) -> tuple[np.ndarray | None, bool]:
    """`solve`, and whether HiGHS proved its answer (the optimum, or that nothing fits)
    rather than stopping at its work or time limit."""
    import highspy

    K = len(tl.keys)
    if K == 0:  # nothing to choose: the plan fits or not
        fits = tl.points == 0 or tl.fixed.max() <= budget
        return (np.zeros(0, np.int64) if fits else None), True
    T = tl.points
    cols = [(k, m) for k in range(K) for m in range(opts.valid.shape[1]) if opts.valid[k, m]]
    h = _highs()
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", 1e-6)
    inf = highspy.kHighsInf
    n = len(cols)
    cost = np.array([opts.seconds[k, m] for k, m in cols], np.float64)
    # Seconds per residual are ~1e-9..1e-3: HiGHS's absolute tolerances (1e-6 gap, 1e-7
    # dual feasibility) would call any feasible plan optimal. Solve in units of the
    # dearest option.
    cost = cost / max(float(cost.max()), 1e-30)
    h.setOptionValue("mip_abs_gap", 1e-9)
    h.addVars(n, np.zeros(n), np.ones(n))
    h.changeColsCost(n, np.arange(n, dtype=np.int32), cost)
    h.changeColsIntegrality(
        n, np.arange(n, dtype=np.int32), np.full(n, highspy.HighsVarType.kInteger)
    )
    by_key: list[list[int]] = [[] for _ in range(K)]
    for j, (k, _) in enumerate(cols):
        by_key[k].append(j)
    for js in by_key:
        h.addRow(1.0, 1.0, len(js), np.array(js, np.int32), np.ones(len(js)))
    # One row per point: a dense (T, n) coefficient matrix, built column by column.
    coef = np.zeros((T, n), np.float64)
    for j, (k, m) in enumerate(cols):
        r = tl.release[k] + 1
        coef[:r, j] += opts.stored[k, m]
        coef[tl.unpack[k] : r, j] += opts.copied[k, m]
    # Points whose bytes cannot exceed the budget under any choice need no row.
    worst = tl.fixed + np.maximum(coef, 0).sum(axis=1)
    for t in np.nonzero(worst > budget)[0]:
        nz = np.nonzero(coef[t])[0]
        h.addRow(-inf, float(budget - tl.fixed[t]), len(nz), nz.astype(np.int32), coef[t, nz])
    stop_after(h, work)
    h.run()
    status = h.getModelStatus()
    # cut short (at the time limit, or by `stop_after`): its answer is not proved
    stopped = status in (highspy.HighsModelStatus.kTimeLimit, highspy.HighsModelStatus.kInterrupt)
    if status != highspy.HighsModelStatus.kOptimal and not stopped:
        return None, status == highspy.HighsModelStatus.kInfeasible
    proved = status == highspy.HighsModelStatus.kOptimal
    info = h.getInfo()
    if info.primal_solution_status != 2:  # no feasible solution found
        return None, False
    x = np.asarray(h.getSolution().col_value)
    choice = np.zeros(K, np.int64)
    for j, (k, m) in enumerate(cols):
        if x[j] > 0.5:
            choice[k] = m
    return choice, proved
