"""The joint planner (`budget(allow=("save", "recompute", "offload", "compress"))`)
against the joint ILP's lower bound (`planner.ilp.joint`), in one run:

    python bench/ilp_bench.py [--quick] [--limit SECONDS]

1. DAG families with residuals of many shapes — pre-LN transformer blocks on a
   residual stream (1, 2, 4, 6 blocks), U-Net-style skips (down path, up path, skips
   concatenated), random layered DAGs with widths 8..64 — from ~30 to ~300 records, at
   budgets from 90% of save()'s peak down to the least peak the heuristic reaches. Per
   budget: the heuristic's predicted time (`Budget` without the joint-ILP candidates),
   the ILP's lower bound (its proved dual bound when it stops at ``--limit``; built
   with copies at first use, prefetch 0, since `Budget` falls back to that depth where
   nothing fits one record ahead, and a bound at prefetch 1 does not hold for those
   plans), the gap heuristic/bound - 1, the ILP's status and solve time, the
   predicted time of the better plan `Budget` decodes from it (`plan_candidate` at
   `plan_windows`, exact mechanisms) when one fits, and `Budget` as
   shipped (heuristic plus those candidates) with its gap; in the summary, how many
   budgets the decoded plan beats the heuristic at.
   ``--plans``: no bound, only the plans: per cell the heuristic's predicted time and
   planning CPU without highspy (as on CI: greedy mechanisms only) and `Budget` as
   shipped with it; ``--set NAME=VALUE,...`` sets the budget module's constants first
   (e.g. ``--set JOINT_WORK=80000,JOINT_KICK_WORK=80000``, to compare search work).
2. On tapes small enough for brute force (10 free records, every save/recompute plan
   with its exact mechanisms): heuristic, `Budget` with the joint-ILP candidate, the
   true optimum and the bound, so a gap can be put on the heuristic or on the
   relaxation (``--small``: this section only).

Times are the planner's cost model (fixed figures, so the tables do not depend on
this machine), not wall-clock step times.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import _results
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tapegrad as tg  # noqa: E402
from tapegrad.planner import (  # noqa: E402
    Budget,
    BudgetError,
    estimate,
    joint,  # noqa: E402
)
from tapegrad.planner.cost import CostModel  # noqa: E402
from tapegrad.planner.ilp import joint as J  # noqa: E402
from tapegrad.planner.ilp import mechanisms as ilp  # noqa: E402
from tapegrad.planner.index import TapeIndex  # noqa: E402
from tapegrad.planner.scorer import Scorer  # noqa: E402
from tests.policies.test_planner_ilp_joint import (  # noqa: E402
    block,
    block_args,
    mlp4,
    mlp4_args,
    unet,
    unet_args,
    varied_dag,
)

B = sys.modules["tapegrad.planner.candidates"]  # work limits, candidate sources
ALL = ("save", "recompute", "offload", "compress")
MECHS = ("offload", "bf16")  # max_error="bf16"
COSTS = CostModel(5e10, 5e9, 5e9, 2e9)


def families(quick: bool):
    blocks = [1, 2] if quick else [1, 2, 4, 6]
    unets = [(2, 1), (4, 2)] if quick else [(2, 1), (4, 2), (5, 4), (6, 8)]
    dags = [(3, 2), (6, 3)] if quick else [(3, 2), (6, 3), (10, 4), (14, 5)]
    out = []
    for nb in blocks:
        out.append(("transformer", f"{nb} blocks", block, block_args(nb)))
    for lv, c in unets:
        out.append(("U-Net", f"{lv} levels x{c}", unet, unet_args(lv, c)))
    for L, w in dags:
        f, args = varied_dag(L, L, w)
        out.append(("random DAG", f"{L}x{w}", f, args))
    return out


def heuristic(tape, b):
    """`Budget`'s plan without the joint-ILP candidate: (seconds, peak) or None."""
    saved = B._joint_ilp_candidate
    B._joint_ilp_candidate = lambda *a: []
    try:
        pol = Budget(b, allow=ALL, max_error="bf16", costs=COSTS)
        pol.plan(tape, [None] * len(tape.records))
        return pol.last["time_s"], pol.last["peak_bytes"]
    except BudgetError as e:
        return None, str(e)
    finally:
        B._joint_ilp_candidate = saved


def floor_of(tape):
    _, msg = heuristic(tape, 0)
    return int(msg.split("tried is ")[1].split(" bytes")[0].replace(",", ""))


def plan_time(tape, fixed, dec, b):
    """Predicted seconds of decisions ``dec`` with exact mechanisms (copies one record
    ahead), or None if no assignment fits ``b``."""
    return J.plan_seconds(
        TapeIndex(tape), Scorer(tape, fixed, b).with_fixed(dec), b, MECHS, COSTS, 1
    )[0]


def fmt(s):
    return "—" if s is None else f"{s * 1e6:.3f}"


def quality(quick: bool, limit: float) -> None:
    print("\n## 1. heuristic vs the joint ILP's lower bound (predicted µs per step)")
    print(
        "| family | size | records | budget (% save) | heuristic | ILP bound | gap | "
        "ILP status | solve s | decoded plan | Budget | Budget gap |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    summary: dict[tuple[str, str, int], list[float]] = {}
    for fam, size, f, args in families(quick):
        tape = tg.trace(f, argnums=0)(*args)
        n = len(tape.records)
        full = estimate(tape)[0]
        lo = floor_of(tape)
        hi = int(full * 0.9)
        steps = 3 if quick else 5
        for b in np.unique(np.linspace(hi, lo, steps).astype(int))[::-1]:
            b = int(b)
            h, _ = heuristic(tape, b)
            shipped = Budget(b, allow=ALL, max_error="bf16", costs=COSTS)
            try:
                shipped.plan(tape, [None] * n)
                w = shipped.last["time_s"]
            except BudgetError:
                w = None
            model = J.build(tape, [None] * n, b, MECHS, COSTS, 0)
            sol = J.solve(model, limit)
            d = None
            for window in J.plan_windows(n):
                dec = J.plan_candidate(tape, [None] * n, b, MECHS, COSTS, 1, window=window)
                dt = plan_time(tape, [None] * n, dec, b) if dec is not None else None
                if dt is not None and (d is None or dt < d):
                    d = dt
            gap = wgap = None
            if h is not None and sol.bound is not None and sol.bound > 0:
                gap = h / sol.bound - 1
                wgap = w / sol.bound - 1 if w is not None else gap
                wins = d is not None and d < h * (1 - 1e-9)
                summary.setdefault((fam, size, n), []).append((gap, wgap, wins))
            print(
                f"| {fam} | {size} | {n} | {b / full:.0%} | {fmt(h)} | {fmt(sol.bound)} | "
                f"{'—' if gap is None else f'{gap:+.1%}'} | {sol.status} | "
                f"{sol.solve_s:.2f} | {fmt(d)} | {fmt(w)} | "
                f"{'—' if wgap is None else f'{wgap:+.1%}'} |",
                flush=True,
            )
    print(
        "\n| family | size | records | budgets | heuristic: worst gap | mean gap "
        "| Budget: worst gap | mean gap | decoded plan wins |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for (fam, size, n), gaps in summary.items():
        g = np.array(gaps)
        print(
            f"| {fam} | {size} | {n} | {len(g)} | {g[:, 0].max():+.1%} | {g[:, 0].mean():+.1%} "
            f"| {g[:, 1].max():+.1%} | {g[:, 1].mean():+.1%} | {int(g[:, 2].sum())} |"
        )


def _timed(tape, b, highspy: bool) -> tuple[float | None, float]:
    """`Budget.plan` at ``b``: (predicted seconds or None, planning CPU seconds); without
    highspy (no joint-ILP candidate, greedy mechanisms only) or as shipped."""
    saved = B._joint_ilp_candidate, B._ilp_solver
    if not highspy:
        B._joint_ilp_candidate, B._ilp_solver = (lambda *a: []), (lambda tape: None)
    t0 = time.process_time()
    try:
        pol = Budget(b, allow=ALL, max_error="bf16", costs=COSTS)
        pol.plan(tape, [None] * len(tape.records))
        got = pol.last["time_s"]
    except BudgetError:
        got = None
    finally:
        B._joint_ilp_candidate, B._ilp_solver = saved
    return got, time.process_time() - t0


def plans(quick: bool) -> None:
    print("\n## plans only (predicted µs per step; planning CPU s)")
    print("| family | size | records | budget (% save) | no highspy | CPU s | shipped | CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    tot = np.zeros(4)
    for fam, size, f, args in families(quick):
        tape = tg.trace(f, argnums=0)(*args)
        n = len(tape.records)
        full = estimate(tape)[0]
        lo, hi = floor_of(tape), int(full * 0.9)
        for b in np.unique(np.linspace(hi, lo, 3 if quick else 5).astype(int))[::-1]:
            h, hs = _timed(tape, int(b), False)
            w, ws = _timed(tape, int(b), True)
            tot += [h or 0.0, hs, w or 0.0, ws]
            print(
                f"| {fam} | {size} | {n} | {b / full:.0%} | {fmt(h)} | {hs:.2f} | {fmt(w)} | "
                f"{ws:.2f} |",
                flush=True,
            )
    h, hs, w, ws = tot
    print(f"| total | | | | {h * 1e6:.3f} | {hs:.1f} | {w * 1e6:.3f} | {ws:.1f} |")


def brute(tape, fixed, b):
    free = [i for i, x in enumerate(fixed) if x is None]
    sc = Scorer(tape, fixed, b)
    best = None
    for bits in itertools.product(["save", "recompute"], repeat=len(free)):
        dec = ["save"] * len(fixed)
        for i, x in zip(free, bits):
            dec[i] = x
        dec = sc.with_fixed(dec)
        tl = joint.timeline(sc.planned(dec), 1, sc._memo)
        rs = COSTS.recompute_s(tl.recompute_flops)
        if best is not None and rs >= best:
            continue
        opts = joint.options(tl, MECHS, COSTS)
        c = ilp.solve(tl, opts, b)
        if c is None:
            continue
        peak, secs = joint.evaluate(tl, opts, c)
        if peak <= b and (best is None or rs + secs < best):
            best = rs + secs
    return best


def small(quick: bool) -> None:
    print("\n## 2. tiny tapes: heuristic vs brute-force optimum vs the bound (µs)")
    print(
        "| tape | records (free) | budget | heuristic | with ILP candidate | optimum | bound "
        "| heur/opt | opt/bound |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    cases = [("MLP 4x16", mlp4, mlp4_args()), ("U-Net 2 levels", unet, unet_args(2, 1))]
    if not quick:
        f, a = varied_dag(0, 3, 2)
        cases.append(("random DAG 3x2", f, a))
    for name, f, args in cases:
        tape = tg.trace(f, argnums=0)(*args)
        n = len(tape.records)
        rng = np.random.default_rng(0)
        free = set(rng.choice(n, size=min(n, 10), replace=False).tolist())
        fixed = [None if i in free else "save" for i in range(n)]
        full = estimate(tape)[0]
        for frac in (0.9, 0.75, 0.6, 0.5, 0.4):
            b = int(full * frac)
            pol = Budget(b, allow=ALL, max_error="bf16", costs=COSTS)
            saved = B._joint_ilp_candidate
            B._joint_ilp_candidate = lambda *a: []
            try:
                pol.plan(tape, fixed)
                h = pol.last["time_s"]
            except BudgetError:
                h = None
            finally:
                B._joint_ilp_candidate = saved
            with_ilp = Budget(b, allow=ALL, max_error="bf16", costs=COSTS)
            try:
                with_ilp.plan(tape, fixed)
                w = with_ilp.last["time_s"]
            except BudgetError:
                w = None
            opt = brute(tape, fixed, b)
            sol = J.solve(J.build(tape, fixed, b, MECHS, COSTS, 1), 30.0)
            ho = f"{h / opt:.3f}" if h and opt else "—"
            ob = f"{opt / sol.bound:.3f}" if opt and sol.bound else "—"
            print(
                f"| {name} | {n} ({len(free)}) | {frac:.0%} | {fmt(h)} | {fmt(w)} | {fmt(opt)} | "
                f"{fmt(sol.bound)} | {ho} | {ob} |",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--limit", type=float, default=10.0, help="ILP time limit, seconds")
    ap.add_argument("--small", action="store_true", help="section 2 only")
    ap.add_argument("--plans", action="store_true", help="the plans only, no bound")
    ap.add_argument(
        "--set", default="", help="work limits (tapegrad.planner.candidates), NAME=VALUE,..."
    )
    _results.add_arguments(ap)
    a = ap.parse_args()
    for item in filter(None, a.set.split(",")):
        name, value = item.split("=")
        if not hasattr(B, name):
            raise SystemExit(f"no constant {name} in tapegrad.planner.candidates")
        setattr(B, name, int(value))
    if not ilp.available() and not a.plans:  # --plans measures the plans CI ships too
        print("highspy not installed (pip install tapegrad[planner]): nothing to measure")
        return
    _results.start(a)
    print(f"cost model {COSTS}; mechanisms {MECHS}; prefetch 1; ILP limit {a.limit:g} s")
    t0 = time.perf_counter()
    if a.plans:
        plans(a.quick)
        print(f"\n({time.perf_counter() - t0:.0f} s)")
        _results.finish(a, "ilp_bench_plans")
        return
    small(a.quick)
    if not a.small:
        quality(a.quick, a.limit)
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    _results.finish(a, "ilp_bench_small" if a.small else "ilp_bench")


if __name__ == "__main__":
    main()
