"""The exact joint chain program (`planner.chain_joint`) against the two-stage joint
planner (save/recompute plans first, then mechanisms per residual), in one run:

    python bench/chain_joint_bench.py [--quick] [--exhaustive]

On 16- and 32-layer tanh MLPs (widths alternating, so residuals differ in size), at
budgets from 90% to 15% of save()'s peak, with offload and compress (bf16, int8)
allowed: the predicted step time the two-stage planner reaches, the one the budget
policy reaches with the chain program among its candidates, their ratio (never above
1: the program is exact, and its plan is scored by the same model), which family won,
and planning wall time (two-stage; with the program; the program alone).

``--exhaustive`` first checks the program against brute force (every save/recompute
assignment and every mechanism, scored by `planner.joint.timeline`/`evaluate`) on 6-
and 7-layer MLPs with offload, as ``tests/policies/test_planner_chain_joint.py`` does
on shallower ones (the 7-layer brute force takes about a minute).

Times are the planner's cost model (fixed figures below, so the table does not
depend on this machine), not measured step times.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp

import tapegrad as tg
from tapegrad.planner import Budget, estimate
from tapegrad.planner import chain_joint as cj
from tapegrad.planner.cost import CostModel

ALL = ("save", "recompute", "offload", "compress")
# Fixed figures: a CPU's (`planner.cost.DEFAULTS`), a GPU's, and one in between where neither
# recomputation nor transfers are cheap next to the other.
COSTS = {
    "cpu": CostModel(5e10, 5e9, 5e9, 2e9),
    "gpu": CostModel(5e13, 2.5e10, 2.5e10, 1e12),
    "mid": CostModel(1e12, 2e10, 2e10, 1e11),
}


def mlp(ws, x):
    h = x
    for w in ws:
        h = jnp.tanh(h @ w)
    return jnp.sum(h**2)


def chain(depth: int):
    ks = jax.random.split(jax.random.key(0), depth + 1)
    widths = [(128, 256, 64, 192)[i % 4] for i in range(depth + 1)]
    ws = [
        jax.random.normal(k, (widths[i], widths[i + 1])) / widths[i] ** 0.5
        for i, k in enumerate(ks[:depth])
    ]
    return ws, jax.random.normal(ks[depth], (64, widths[0]))


def plan(tape, bytes: int, with_program: bool, costs: CostModel):
    budget_mod = sys.modules["tapegrad.planner.candidates"]
    saved = budget_mod._chain_joint
    if not with_program:
        budget_mod._chain_joint = lambda *a: []
    try:
        pol = Budget(bytes, allow=ALL, max_error="int8", costs=costs)
        t0 = time.perf_counter()
        try:
            pol.plan(tape, [None] * len(tape.records))
        except tg.policies.BudgetError:
            return None, time.perf_counter() - t0
        return pol.last, time.perf_counter() - t0
    finally:
        budget_mod._chain_joint = saved


def exhaustive() -> None:
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "policies"))
    import test_planner_chain_joint as t

    for layers in (6, 7):
        ws, x = t.mlp_args(layers)
        tape = tg.trace(t.mlp, argnums=0)(ws, x)
        t0 = time.perf_counter()
        t.check_exact(tape, *t.MODES["offload"], t.COSTS["cpu"])
        print(
            f"{layers} layers ({len(tape.records)} records, offload): the program's time is the "
            f"brute-force optimum at every budget ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--exhaustive", action="store_true")
    opts = ap.parse_args()
    quick = opts.quick
    if opts.exhaustive:
        exhaustive()
    fracs = (0.9, 0.6, 0.3, 0.15) if quick else (0.9, 0.75, 0.6, 0.45, 0.3, 0.2, 0.15)
    print(
        f"{'costs':>5} {'layers':>6} {'budget':>6} {'two-stage s':>12} {'with DP s':>12} "
        f"{'ratio':>6} {'winner':>16} {'plan 2st':>9} {'plan all':>9} {'DP alone':>9}"
    )
    for name, costs in COSTS.items():
        for depth in (16,) if quick else (16, 32):
            ws, x = chain(depth)
            tape = tg.trace(mlp, argnums=0)(ws, x)
            full = estimate(tape)[0]
            ch = cj.joint_chain(tape, 1)
            assert ch is not None
            for frac in fracs:
                b = int(full * frac)
                two, t_two = plan(tape, b, False, costs)
                both, t_both = plan(tape, b, True, costs)
                mechs = ("offload", "bf16", "int8")
                t0 = time.perf_counter()
                got = cj.chain_joint_plan(ch, [None] * len(tape.records), b, mechs, costs, 1)
                t_dp = time.perf_counter() - t0
                s_two = f"{two['time_s']:.3e}" if two else "infeasible"
                s_both = f"{both['time_s']:.3e}" if both else "infeasible"
                ratio = f"{both['time_s'] / two['time_s']:.3f}" if two and both else "-"
                if two and both:
                    assert both["time_s"] <= two["time_s"] * (1 + 1e-9)
                    assert got is not None and abs(got[2] - both["time_s"]) <= 1e-9 * both["time_s"]
                win = both["plan"].split(" + ")[0] if both else "-"
                print(
                    f"{name:>5} {depth:>6} {frac:>6.0%} {s_two:>12} {s_both:>12} "
                    f"{ratio:>6} {win:>16} {t_two:>8.2f}s {t_both:>8.2f}s {t_dp:>8.2f}s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
