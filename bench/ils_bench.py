"""The joint search's kicks (`planner.search.iterate_joint`) on the worst cells of
`bench/ilp_bench.py`, and what they cost:

    python bench/ils_bench.py [--families]

Per cell (U-Net 58 records, random DAG 69 records; budgets as ilp_bench picks them:
``linspace(90% of save()'s peak, the heuristic's floor, 5)``): the heuristic's
predicted step time (`Budget` without the joint-ILP candidates, as ilp_bench's
"heuristic" column) with the kicks off (``JOINT_KICK_WORK = 0``) and on, the best
plan simulated annealing found and the joint ILP's bound (both from bench/RESULTS.md,
"Issue 15"), and the CPU seconds of each `Budget.plan`. ``--families``: also every
ilp_bench family at its 5 budgets, kicks off / on: the cells that change and the
planning CPU (max and total). ``--greedy-only``: as without highspy installed (the
"heuristic" column above still completes its best plans' mechanisms exactly when
highspy is importable, as ilp_bench's does).

Times are the planner's cost model (fixed figures), not wall-clock step times.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tapegrad as tg  # noqa: E402
from bench.ilp_bench import ALL, COSTS, families, floor_of, fmt  # noqa: E402
from tapegrad.planner import Budget, BudgetError, estimate  # noqa: E402
from tests.policies.test_planner_ilp_joint import unet, unet_args, varied_dag  # noqa: E402

B = sys.modules["tapegrad.planner.candidates"]

# (budget as a fraction of save()'s peak, rounded as ilp_bench prints it): (annealing's
# best, the bound), predicted µs, bench/RESULTS.md "Issue 15".
KNOWN = {
    ("U-Net 58", "70%"): (0.717, 0.399),
    ("U-Net 58", "31%"): (7.096, 4.567),
    ("DAG 69", "72%"): (0.399, 0.102),
    ("DAG 69", "37%"): (4.467, 2.552),
    ("DAG 69", "19%"): (8.827, 6.372),
}


def heuristic(tape, b: int, kicks: bool) -> tuple[float | None, float]:
    """(`Budget`'s predicted seconds without the joint-ILP candidates, CPU seconds)."""
    saved, work = B._joint_ilp_candidate, B.JOINT_KICK_WORK
    B._joint_ilp_candidate = lambda *a: []
    B.JOINT_KICK_WORK = work if kicks else 0
    try:
        pol = Budget(b, allow=ALL, max_error="bf16", costs=COSTS)
        t0 = time.process_time()
        try:
            pol.plan(tape, [None] * len(tape.records))
        except BudgetError:
            return None, time.process_time() - t0
        return pol.last["time_s"], time.process_time() - t0
    finally:
        B._joint_ilp_candidate, B.JOINT_KICK_WORK = saved, work


def budgets(tape) -> list[int]:
    lo, hi = floor_of(tape), int(estimate(tape)[0] * 0.9)
    return [int(b) for b in np.unique(np.linspace(hi, lo, 5).astype(int))[::-1]]


def cells() -> None:
    print(
        "| cell | records | kicks off | kicks on | on/off | annealing best | bound "
        "| CPU s off / on |"
    )
    print("|---|---|---|---|---|---|---|---|")
    f, args = varied_dag(6, 6, 3)
    for name, fn, a in (("U-Net 58", unet, unet_args(4, 2)), ("DAG 69", f, args)):
        tape = tg.trace(fn, argnums=0)(*a)
        full = estimate(tape)[0]
        for b in budgets(tape):
            frac = f"{b / full:.0%}"
            if (name, frac) not in KNOWN:
                continue
            best, bound = KNOWN[(name, frac)]
            off, c_off = heuristic(tape, b, False)
            on, c_on = heuristic(tape, b, True)
            ratio = f"{on / off:.3f}" if on and off else "—"
            print(
                f"| {name} {frac} | {len(tape.records)} | {fmt(off)} | {fmt(on)} | {ratio} | "
                f"{best:.3f} | {bound:.3f} | {c_off:.2f} / {c_on:.2f} |",
                flush=True,
            )


def all_families() -> None:
    print(
        "\n| family | size | records | cells changed (off -> on, µs) | CPU s off: max / total "
        "| on: max / total |"
    )
    print("|---|---|---|---|---|---|")
    for fam, size, f, args in families(False):
        tape = tg.trace(f, argnums=0)(*args)
        full = estimate(tape)[0]
        changed, cpu = [], {False: [], True: []}
        for b in budgets(tape):
            got = {}
            for kicks in (False, True):
                got[kicks], c = heuristic(tape, b, kicks)
                cpu[kicks].append(c)
            if got[False] != got[True]:
                changed.append(f"{b / full:.0%}: {fmt(got[False])} -> {fmt(got[True])}")
        print(
            f"| {fam} | {size} | {len(tape.records)} | {'; '.join(changed) or 'none'} | "
            f"{max(cpu[False]):.2f} / {sum(cpu[False]):.1f} | "
            f"{max(cpu[True]):.2f} / {sum(cpu[True]):.1f} |",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", action="store_true", help="every ilp_bench family too")
    ap.add_argument(
        "--greedy-only",
        action="store_true",
        help="no exact (HiGHS) mechanisms for the best plans either: what users without "
        "highspy get",
    )
    a = ap.parse_args()
    if a.greedy_only:
        B._ilp_solver = lambda tape: None
    print(f"cost model {COSTS}; JOINT_WORK {B.JOINT_WORK:,}; JOINT_KICK_WORK {B.JOINT_KICK_WORK:,}")
    t0 = time.perf_counter()
    cells()
    if a.families:
        all_families()
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
