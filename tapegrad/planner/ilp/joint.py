"""A reference for the whole joint plan: an integer program over per-record
save/recompute *and* per-residual mechanisms (save / offload / bf16 / int8), solved by
HiGHS (``pip install tapegrad[planner]``). Its optimum is a **lower bound** on the
predicted step time (`problem.estimate`'s recompute flops at ``flops_per_s`` plus the
mechanisms' seconds, `joint`) of every plan the executor can run within the
budget; its solution, decoded and scored by the executor's own model, is one more
candidate for `Budget` (`plan_candidate`).

The model — a relaxation of the executor's schedule, with time-indexed run variables —
and the proof that it is one are in `ilp_joint_model` (`build`, `Model`).
`solve` reports the bound HiGHS proved even when it stops at its work or time limit
(`ilp.WORK`: `Budget`'s candidates stop at a count of work, so they do not
depend on the machine's load; `optimum`, a benchmark's tool, at wall-clock seconds).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from tapegrad.core.tape import Tape
from tapegrad.planner import joint
from tapegrad.planner.cost import CostModel
from tapegrad.planner.ilp import mechanisms as ilp
from tapegrad.planner.ilp.joint_model import WINDOW, Model, build
from tapegrad.planner.index import TapeIndex

__all__ = [
    "Model",
    "Solution",
    "build",
    "solve",
    "plan_candidate",
    "Optimum",
    "optimum",
    "plan_seconds",
    "MAX_RECORDS",
    "TIME_LIMIT_S",
    "WORK",
    "WINDOW",
    "PLAN_WINDOW",
    "WIDE_RECORDS",
    "plan_windows",
]

MAX_RECORDS = 300
TIME_LIMIT_S = 2.0  # `optimum`'s default; `plan_candidate` stops at `WORK` (backstop below)
WORK = ilp.WORK
PLAN_WINDOW: int | None = 4  # `plan_candidate`'s run window (a smaller model, solved sooner)
# `Budget` decodes the bound's window (`WINDOW`) instead up to this many records: solved
# within the time limit there, sometimes a plan that fits where the smaller window's does
# not (a 46-record transformer block at 31%: 5.150 -> 4.341 µs, the optimum); above, it
# stops short and decodes worse plans than `PLAN_WINDOW`'s (`bench/RESULTS.md`).
WIDE_RECORDS = 100


def plan_windows(records: int) -> tuple[int | None, ...]:
    """The run windows `Budget` decodes the ILP at on a tape of ``records`` records."""
    return (0, WINDOW if records <= WIDE_RECORDS else PLAN_WINDOW)


@dataclasses.dataclass
class Solution:
    """What HiGHS returned: ``status`` ("optimal", "time limit", "work limit",
    "infeasible", ...);
    ``bound``: seconds no executor plan within the budget beats (None if none proved);
    ``seconds``: the relaxation's objective at ``decisions`` (None without a solution);
    ``decisions``: "save"/"recompute" per record (binding ones applied); ``mechanisms``:
    residual key -> mechanism name of the kept values; ``solve_s``: wall seconds;
    ``work``: the work `solve` counted (`ilp.stop_after`'s units)."""

    status: str
    bound: float | None
    seconds: float | None
    decisions: tuple[str, ...] | None
    mechanisms: dict
    solve_s: float
    work: float = 0.0


def _load(model: Model):
    """A HiGHS instance holding ``model``, and the cost scale it is solved in."""
    import highspy

    h = ilp._highs()
    h.setOptionValue("mip_rel_gap", 1e-6)
    h.setOptionValue("mip_abs_gap", 1e-9)
    inf = highspy.kHighsInf
    ncol = model.columns
    # seconds are ~1e-9..1e-3: solve in units of the dearest column (see ilp)
    scale = max(float(model.cost.max()), 1e-30)
    h.addVars(ncol, np.zeros(ncol), model.upper)
    idx = np.arange(ncol, dtype=np.int32)
    h.changeColsCost(ncol, idx, model.cost / scale)
    ints = np.nonzero(model.integer)[0].astype(np.int32)
    h.changeColsIntegrality(len(ints), ints, np.full(len(ints), highspy.HighsVarType.kInteger))
    for cols, coef, lo, hi in model.rows:
        h.addRow(
            float(lo), inf if np.isinf(hi) else float(hi), len(cols), cols.astype(np.int32), coef
        )
    # points whose bytes cannot exceed the budget under any choice need no row
    worst = np.maximum(model.mem * np.where(np.isinf(model.upper), 0, model.upper), 0).sum(axis=1)
    for t in np.nonzero(worst > model.budget)[0]:
        nz = np.nonzero(model.mem[t])[0]
        h.addRow(-inf, float(model.budget), len(nz), nz.astype(np.int32), model.mem[t, nz])
    for _, cols, coef in model.runs:
        h.addRow(-inf, float(model.budget), len(cols), cols.astype(np.int32), coef)
    return h, scale


def _run(h, model: Model, scale: float, time_limit: float, t0: float) -> Solution:
    import highspy

    h.setOptionValue("time_limit", float(time_limit))
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    name = {
        highspy.HighsModelStatus.kOptimal: "optimal",
        highspy.HighsModelStatus.kTimeLimit: "time limit",
        highspy.HighsModelStatus.kInterrupt: "work limit",  # `ilp.stop_after`
        highspy.HighsModelStatus.kInfeasible: "infeasible",
    }.get(status, str(status))
    stopped = name in ("time limit", "work limit")
    bound = None
    if name == "optimal":
        bound = float(info.objective_function_value) * scale
    elif stopped and np.isfinite(info.mip_dual_bound):
        bound = float(info.mip_dual_bound) * scale
    elif name == "infeasible":
        bound = float("inf")
    if not (name == "optimal" or stopped) or info.primal_solution_status != 2:
        return Solution(name, bound, None, None, {}, time.perf_counter() - t0)
    z = np.asarray(h.getSolution().col_value)
    dec = tuple("recompute" if z[i] > 0.5 else "save" for i in range(model.n))
    mech = {}
    for j, (k, m) in enumerate(model.ycols):
        if z[model.n + j] > 0.5:
            mech[model.keys[k]] = joint.COLUMNS[m]
    ni = model.n + len(model.ycols)
    secs = float(model.cost[:ni] @ np.round(z[:ni]))  # z and h cost nothing
    return Solution(name, bound, secs, dec, mech, time.perf_counter() - t0)


def solve(model: Model, time_limit: float = TIME_LIMIT_S, work: float | None = None) -> Solution:
    """Solve the relaxation, stopping at ``time_limit`` seconds or ``work``
    (`ilp.WORK`'s units; None: no such limit); the bound is HiGHS's proved
    dual bound (the optimum when it finished)."""
    t0 = time.perf_counter()
    h, scale = _load(model)
    stop = ilp.stop_after(h, work)
    sol = _run(h, model, scale, time_limit, t0)
    sol.work = stop.used
    return sol


def plan_seconds(
    index,
    dec: Sequence[str],
    budget: int,
    mechanisms: tuple[str, ...],
    costs: CostModel,
    prefetch: int = 0,
) -> tuple[float | None, bool]:
    """Predicted seconds of the executor's plan for decisions ``dec`` (``index``: the
    tape's `TapeIndex`) with the exact mechanisms (`ilp.solve_proved`) and
    copies brought back ``prefetch`` records ahead, None when no assignment fits
    ``budget``; and whether HiGHS proved the mechanisms' answer (did not stop at its
    time limit)."""

    tl = index.timeline(index.segments(dec), prefetch)
    opts = joint.options(tl, mechanisms, costs)
    choice, proved = ilp.solve_proved(tl, opts, budget, time_limit=10.0, work=None)
    if choice is None:
        return None, proved
    peak, secs = joint.evaluate(tl, opts, choice)
    return (secs + costs.recompute_s(tl.recompute_flops) if peak <= budget else None), proved


@dataclasses.dataclass
class Optimum:
    """What `optimum` proved: ``decisions`` and ``seconds``, the fastest executor plan
    it found within the budget (None: none); ``lower``: seconds no executor plan
    within the budget beats; ``proved``: ``seconds`` is the optimum (``lower ≥
    seconds``), or no plan fits (``seconds`` None, ``lower`` inf); ``relaxation``: the
    model's bound before any cut; ``cuts``; ``solve_s``: wall seconds."""

    decisions: tuple[str, ...] | None
    seconds: float | None
    lower: float
    proved: bool
    relaxation: float | None
    cuts: int
    solve_s: float


def optimum(
    tape: Tape,
    fixed: Sequence[str | None],
    budget: int,
    mechanisms: tuple[str, ...],
    costs: CostModel,
    time_limit: float = TIME_LIMIT_S,
    starts: Sequence[Sequence[str]] = (),
    prefetch: int = 0,
    window: int | None = WINDOW,
) -> Optimum | None:
    """The fastest executor plan within ``budget``, proved, by cutting the relaxation
    (`build`) down to the executor's plans; None when highspy is missing or the tape is
    outside the model. Repeat: solve the model with the cuts so far (optimum
    ``LB_k``, decisions ``x*``); score ``x*`` exactly (`plan_seconds`), ``UB =
    min(UB, its seconds)``; cut it off, ``Σ_{x*_i = 1} (1 − x_i) + Σ_{x*_i = 0} x_i ≥
    1`` over the free records. Every executor plan is some ``x`` with mechanisms:
    either ``x`` was cut, and its seconds are ``≥ UB``, or it is feasible in the cut
    model, and they are ``≥ LB_k``. So ``max_k min(UB_k, LB_k)`` is a lower bound at
    every step, and once it reaches ``UB`` (or the cut model is infeasible) ``UB`` is
    the optimum — provided each cut plan's exact mechanisms were proved (HiGHS did not
    stop at its time limit on them; else ``proved`` is False and ``lower`` the
    relaxation's). ``starts``: plans scored and cut first (a planner's best, say:
    ``UB`` starts there). ``prefetch``: copies brought back that many records ahead (0, at
    first use: the fewest bytes at the same predicted seconds, so the optimum over
    every depth). Stops at ``time_limit`` seconds with what it proved."""
    if not ilp.available():
        return None
    t0 = time.perf_counter()
    model = build(tape, fixed, budget, mechanisms, costs, prefetch, window)
    if model is None:
        return None
    import highspy

    index = TapeIndex(tape)
    h, scale = _load(model)
    # the cuts' records: the others are bound (`fixed`, or kept by the model)
    free = np.array(
        [i for i in range(model.n) if fixed[i] is None and model.upper[i] > 0], np.int32
    )
    cut: set[tuple[str, ...]] = set()
    best: tuple[str, ...] | None = None
    ub: float | None = None

    def fix(dec: Sequence[str]) -> tuple[str, ...]:
        return tuple(f if f is not None else d for f, d in zip(fixed, dec))

    unproved = 0  # plans cut whose mechanisms HiGHS did not prove: no proof then

    def score_and_cut(dec: tuple[str, ...]) -> None:
        nonlocal best, ub, unproved
        v, sure = plan_seconds(index, dec, budget, mechanisms, costs, prefetch)
        unproved += not sure
        if v is not None and (ub is None or v < ub):
            best, ub = dec, v
        rec = np.array([dec[i] == "recompute" for i in free])
        h.addRow(1.0 - rec.sum(), highspy.kHighsInf, len(free), free, np.where(rec, -1.0, 1.0))
        cut.add(dec)

    relaxation = None
    lower = 0.0
    while True:
        left = time_limit - (time.perf_counter() - t0)
        if left <= 0:
            break
        sol = _run(h, model, scale, left, t0)
        first = relaxation is None
        if first:
            relaxation = sol.bound
            for dec in {fix(d): None for d in starts}:
                score_and_cut(dec)
        if sol.bound is not None:
            lower = max(lower, sol.bound if ub is None else min(ub, sol.bound))
        if sol.decisions is None or sol.status != "optimal":
            break
        if ub is not None and lower >= ub * (1 - 1e-9):
            break
        dec = fix(sol.decisions)
        if dec not in cut:
            score_and_cut(dec)
        elif not first:  # cannot happen: its cut excludes it (guards the loop)
            break
    if ub is not None:
        lower = min(lower, ub)
    if unproved:  # a cut may have removed a plan faster than its score: the cuts prove nothing
        lower = min(lower, relaxation or 0.0)
    proved = not unproved and (
        lower == float("inf") or (ub is not None and lower >= ub * (1 - 1e-9))
    )
    return Optimum(best, ub, lower, proved, relaxation, len(cut), time.perf_counter() - t0)


def plan_candidate(
    tape: Tape,
    fixed: Sequence[str | None],
    budget: int,
    mechanisms: tuple[str, ...],
    costs: CostModel,
    prefetch: int = 0,
    work: float | None = WORK,
    tries: int = 3,
    window: int | None = PLAN_WINDOW,
    time_limit: float = ilp.TIME_LIMIT_S,
) -> tuple[str, ...] | None:
    """The ILP's save/recompute decisions (binding ones applied) for `Budget` to score
    as one more candidate; None when highspy is missing, the tape is too large or
    outside the model, or no solution was found within ``work``
    (`ilp.WORK`'s units: the same plan on a quiet or a loaded machine) or the
    backstop ``time_limit`` seconds.

    The relaxation undercounts bytes, so its plan may not fit under the executor's
    schedule even with every residual at its fewest bytes; then it is solved again at
    a budget lowered by the overflow (up to ``tries`` solves, sharing the work and the
    time limit). ``window``: `build`'s (0: no run variables, the smallest model)."""
    if not ilp.available() or len(tape.records) > MAX_RECORDS:
        return None
    index = TapeIndex(tape)
    target = budget
    dec = None
    deadline = time.perf_counter() + time_limit
    left_work = work
    for _ in range(tries):
        left = deadline - time.perf_counter()
        # without the bound's ``r`` columns: Budget's decoding as measured before them
        model = build(tape, fixed, target, mechanisms, costs, prefetch, window, early_runs=False)
        if model is None or left <= 0 or (left_work is not None and left_work <= 0):
            break
        sol = solve(model, left, left_work)
        if left_work is not None:
            left_work -= sol.work
        if sol.decisions is None:
            break
        dec = tuple(f if f is not None else d for f, d in zip(fixed, sol.decisions))
        tl = index.timeline(index.segments(dec), prefetch)
        over = joint.least_bytes(tl, joint.options(tl, mechanisms, costs)) - budget
        if over <= 0:
            break
        target -= over
    return dec
