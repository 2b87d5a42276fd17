"""The true optimum of the joint plan on DAGs (`planner.ilp.joint.optimum`: the joint
ILP's relaxation cut down to the executor's plans by no-good cuts), and `Budget`'s gap
to it:

    python bench/ilp_exact.py [--cells quick|all] [--records 69,90] [--seconds S] [--budgets N]
                              [--pick 4]

`planner.ilp.joint`'s model is a relaxation: its optimum is below every executor plan
within the budget, but its decisions may not fit the budget under the executor's
schedule (`planner.joint.timeline` counts bytes the model does not). A gap to that
bound mixes the planner's loss with the relaxation's. `optimum` separates them: it
scores the model's decisions exactly, cuts them off and solves again, so its lower
bound rises from the relaxation's towards the optimum, and reaches it when it proves
one. Per cell (budgets from 90% of save()'s peak to the heuristic's floor, as in
`bench/ilp_bench.py`): `Budget` as shipped (with highspy), the heuristic alone, the
relaxation's bound, the proved lower bound after ``--seconds`` (each cell starts from
`Budget`'s plan), the optimum where proved, and `Budget`'s gap to it (or, "at most",
to the lower bound); "found": a plan faster than `Budget`'s that the cuts reached.
The optimum is taken among plans at `Budget`'s prefetch depth (copies one record
ahead, or at first use where `Budget` fell back to that): `Budget` plans one record
ahead wherever any plan fits so (to hide copies on a device), though the cost model
charges a copy's full time at any depth, so a plan at first use can be predicted
faster; ``--any-depth`` takes the optimum over both.

Times are the planner's cost model (fixed figures, as in `bench/ilp_bench.py`), not
wall-clock step times.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tapegrad as tg  # noqa: E402
from bench.ilp_bench import ALL, COSTS, MECHS, families, floor_of, fmt, heuristic  # noqa: E402
from tapegrad.planner import Budget, BudgetError, estimate  # noqa: E402
from tapegrad.planner.ilp import joint as J  # noqa: E402


def exact(tape, b: int, seconds: float, any_depth: bool = False) -> dict:
    n = len(tape.records)
    fixed = [None] * n
    shipped, starts, depth = None, [], 0
    try:
        pol = Budget(b, allow=ALL, max_error="bf16", costs=COSTS)
        starts = [tuple(pol.plan(tape, fixed))]
        shipped = pol.last["time_s"]
        depth = 0 if any_depth else min(int(pol.last["prefetch"]), 1)
    except BudgetError:
        pass
    r = J.optimum(tape, fixed, b, MECHS, COSTS, seconds, starts, prefetch=depth)
    return {"shipped": shipped, "r": r, "depth": depth}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="quick", choices=("quick", "all"))
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--budgets", type=int, default=5)
    ap.add_argument("--any-depth", action="store_true")
    ap.add_argument("--records", default="", help="only tapes of these sizes, e.g. 69,90")
    ap.add_argument("--pick", default="", help="only these budgets of a cell (0: 90%%), e.g. 4")
    args = ap.parse_args()
    picks = {int(k) for k in args.pick.split(",") if k}
    print(
        "| family | size | records | budget (% save) | prefetch | Budget | heuristic "
        "| relaxation "
        "| proved lower | optimum | Budget gap | cuts | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for fam, size, f, fargs in families(args.cells == "quick"):
        tape = tg.trace(f, argnums=0)(*fargs)
        n = len(tape.records)
        if args.cells == "quick" and n > 60 and not args.records:
            continue
        if args.records and str(n) not in args.records.split(","):
            continue
        full = estimate(tape)[0]
        lo = floor_of(tape)
        hi = int(full * 0.9)
        for k, b in enumerate(np.unique(np.linspace(hi, lo, args.budgets).astype(int))[::-1]):
            if picks and k not in picks:
                continue
            b = int(b)
            h, _ = heuristic(tape, b)
            e = exact(tape, b, args.seconds, args.any_depth)
            r, shipped, depth = e["r"], e["shipped"], e["depth"]
            gap = (
                "—"
                if shipped is None or not r.lower
                else f"{shipped / r.lower - 1:+.1%}" + ("" if r.proved else " (at most)")
            )
            found = (
                ""
                if r.seconds is None or shipped is None or r.seconds >= shipped
                else (f" (found {fmt(r.seconds)})")
            )
            print(
                f"| {fam} | {size} | {n} | {b / full:.0%} | {depth} | {fmt(shipped)}{found} "
                f"| {fmt(h)} "
                f"| {fmt(r.relaxation)} | {fmt(r.lower)} | "
                f"{fmt(r.seconds) if r.proved else 'not proved'} | {gap} | {r.cuts} "
                f"| {r.solve_s:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
