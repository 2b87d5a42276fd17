"""The joint planner (`budget(allow=("save", "recompute", "offload", "compress"))`), in
one run:

    python bench/planner_bench.py [--quick]

1. quality: the greedy mechanism assignment vs the exact ILP (HiGHS) on random layered
   DAGs of up to 300 records, per save/recompute plan (save-all, dots saved), at budgets
   across the feasible range: worst and mean ratio of predicted added seconds;
2. planning time for a ~1,000-record tape: the mechanism layer alone (allow without
   recompute), the full joint planner, and the save/recompute planner for reference;
3. predicted vs measured device peak (`jax.live_arrays()`, eager) on an MLP, a
   transformer block and a DAG model, at several budgets;
4. monotonicity: measured peak over 20 budgets, tightening;
5. Pareto: predicted (seconds, peak) of single-mechanism policies (save, offload,
   compress bf16, each `jax.checkpoint_policies` via `tg.checkpoint`) and the planner
   at each of their peaks.

Times are the planner's cost model (fixed figures below, so the tables do not depend
on this machine), not wall-clock step times.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import _results
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "policies"))
from test_planner_joint import _single, block, layered_dag  # noqa: E402

import tapegrad as tg  # noqa: E402
from tapegrad.planner import (  # noqa: E402
    Budget,
    estimate,
    joint,  # noqa: E402
)
from tapegrad.planner.cost import CostModel  # noqa: E402
from tapegrad.planner.ilp import mechanisms as ilp  # noqa: E402
from tapegrad.planner.measure import measured_peak  # noqa: E402
from tapegrad.planner.scorer import Scorer  # noqa: E402

P = tg.policies
ALL = ("save", "recompute", "offload", "compress")
COSTS = CostModel(5e10, 5e9, 5e9, 2e9)


def mlp(ws, x):
    h = x
    for w in ws:
        h = jnp.tanh(h @ w)
    return jnp.sum(h**2)


def models(quick: bool):
    ks = jax.random.split(jax.random.key(0), 40)
    depth = 8 if quick else 16
    mlp_args = (
        [jax.random.normal(k, (128, 128)) / 11 for k in ks[:depth]],
        jax.random.normal(ks[-1], (64, 128)),
    )
    d, f = 64, 128
    it = iter(ks)
    nblk = 1 if quick else 2
    ps = [
        tuple(
            jax.random.normal(next(it), s) / np.sqrt(s[0])
            for s in [(d, d), (d, d), (d, d), (d, d), (d, f), (f, d)]
        )
        for _ in range(nblk)
    ]
    blk_args = (ps, jax.random.normal(ks[-2], (32, d)))
    dag = layered_dag(3, layers=4 if quick else 6, width=3)
    dag_args = (jnp.eye(64) * 0.5, jax.random.normal(ks[-3], (32, 64)))
    return {
        f"MLP {depth}x128": (mlp, mlp_args),
        f"transformer x{nblk}": (block, blk_args),
        "random DAG": (dag, dag_args),
    }


def quality(quick: bool, costs: CostModel = COSTS) -> None:
    print("\n## 1. greedy vs ILP (mechanism layer; ratio of predicted added seconds)")
    print(
        f"costs: {costs.d2h_bytes_per_s:.0e} B/s each way, "
        f"compress {costs.compress_bytes_per_s:.0e} B/s"
    )
    if not ilp.available():
        print("highspy not installed (pip install tapegrad[planner]): skipped")
        return
    print("| records | plans x budgets | worst greedy/ILP | mean | ILP time (max) |")
    print("|---|---|---|---|---|")
    sizes = [(4, 3), (8, 4)] if quick else [(4, 3), (8, 4), (12, 6), (16, 6)]
    for layers, width in sizes:
        ratios, worst_t = [], 0.0
        for seed in range(2 if quick else 3):
            f = layered_dag(seed, layers, width)
            tape = tg.trace(f)(jnp.eye(16) * 0.5, jnp.ones((8, 16)))
            n = len(tape.records)
            sc = Scorer(tape, [None] * n, 1 << 60)
            decs = [
                ("save",) * n,
                tuple(
                    "save" if r.primitive == "dot_general" else "recompute" for r in tape.records
                ),
            ]
            for dec in decs:
                tl = joint.timeline(sc.planned(dec), prefetch=1)
                opts = joint.options(tl, ("offload", "bf16", "int8"), costs)
                lo = joint.least_bytes(tl, opts)
                hi = joint.evaluate(tl, opts, np.zeros(len(tl.keys), np.int64))[0]
                for b in np.linspace(hi, lo, 7).astype(int)[1:]:
                    t0 = time.perf_counter()
                    ex = ilp.solve(tl, opts, int(b), time_limit=10.0, work=None)
                    worst_t = max(worst_t, time.perf_counter() - t0)
                    gr = joint.assign_greedy(tl, opts, int(b))
                    if ex is None or gr is None:
                        continue
                    se = joint.evaluate(tl, opts, ex)[1]
                    sg = joint.evaluate(tl, opts, gr)[1]
                    ratios.append(sg / se if se > 0 else 1.0)
        print(
            f"| ~{n} | {len(ratios)} | {max(ratios):.4f} | {np.mean(ratios):.4f} | "
            f"{worst_t:.2f} s |"
        )


def planning_time(quick: bool) -> None:
    print("\n## 2. planning time (one plan, wall clock)")
    depth = 120 if quick else 330  # ~3 records per layer
    ks = jax.random.split(jax.random.key(1), depth + 1)
    ws = [jax.random.normal(k, (64, 64)) / 8 for k in ks[:depth]]
    x = jax.random.normal(ks[-1], (32, 64))

    def deep(ws, x):
        h = x
        for w in ws:
            h = h + jnp.tanh(h @ w)
        return jnp.sum(h**2)

    tape = tg.trace(deep, argnums=0)(ws, x)
    n = len(tape.records)
    full = estimate(tape)[0]
    print(f"tape: {n} records; budget 40% of save()'s peak")
    print("| planner | wall s | CPU s | plans scored | peak | recompute MFLOP | model µs |")
    print("|---|---|---|---|---|---|---|")
    for label, kw in [
        (
            "mechanisms only (save/offload/compress)",
            dict(allow=("save", "offload", "compress"), max_error="int8"),
        ),
        ("joint (all four)", dict(allow=ALL, max_error="int8")),
        ("save/recompute (the existing planner)", {}),
    ]:
        pol = Budget(int(full * 0.4), costs=COSTS, **kw)
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            pol.plan(tape, [None] * n)
            L = pol.last
            note = (
                f"{L['plan']}) | {time.perf_counter() - t0:.2f} | {time.process_time() - c0:.2f} "
                f"| {L.get('plans_scored', '')} | {L['peak_bytes']:,} | "
                f"{L['recompute_flops'] / 1e6:.2f} | {L.get('time_s', 0.0) * 1e6:.1f}"
            )
        except P.BudgetError:
            note = f"infeasible) | {time.perf_counter() - t0:.2f} | | | | |"
        print(f"| {label} ({note} |")


def peaks(ms) -> None:
    print("\n## 3. predicted vs measured device peak (eager, jax.live_arrays)")
    print("| model | budget / save() | plan | mechanisms | predicted | measured | error |")
    print("|---|---|---|---|---|---|---|")
    for name, (f, args) in ms.items():
        full = estimate(tg.trace(f, argnums=0)(*args))[0]
        for frac in (0.8, 0.5, 0.3):
            pol = P.budget(int(full * frac), allow=ALL, max_error="bf16", costs=COSTS)
            try:
                m = measured_peak(f, args, pol)
            except P.BudgetError:
                print(f"| {name} | {frac:.0%} | infeasible | | | | |")
                continue
            p = pol.last["peak_bytes"]
            mech = ", ".join(f"{k} {v}" for k, v in pol.last["mechanisms"].items())
            print(
                f"| {name} | {frac:.0%} | {pol.last['plan']} | {mech} | {p:,} | {m:,} | "
                f"{abs(m - p) / p:.1%} |"
            )


def monotone(ms) -> None:
    print("\n## 4. measured peak over 20 budgets (tightening)")
    for name, (f, args) in ms.items():
        full = estimate(tg.trace(f, argnums=0)(*args))[0]
        got = []
        for b in np.linspace(full, full * 0.25, 20).astype(int):
            pol = P.budget(int(b), allow=ALL, max_error="bf16", costs=COSTS)
            try:
                got.append((int(b), measured_peak(f, args, pol)))
            except P.BudgetError:
                got.append((int(b), None))
        ok = [m for _, m in got if m is not None]
        rises = sum(1 for a, b in zip(ok, ok[1:]) if b > a)
        over = sum(1 for b, m in got if m is not None and m > b)
        print(
            f"- {name}: {len(ok)} feasible of 20, {rises} rises, {over} over budget; "
            f"measured {ok[0]:,} -> {ok[-1]:,} B"
        )


def pareto(ms) -> None:
    print("\n## 5. Pareto: single-mechanism policies vs the planner at their peak")
    print("| model | policy | its time (µs) | its peak | planner time (µs) | planner peak |")
    print("|---|---|---|---|---|---|")
    cps = jax.checkpoint_policies
    for name, (f, args) in ms.items():
        pts = {
            # each as the policy runs it (values it rebuilds for free recomputed)
            "save()": _single(f, args, 0, COSTS, P.save()),
            "offload()": _single(f, args, 1, COSTS, P.offload()),
            "compress(bf16)": _single(f, args, 2, COSTS, P.compress(jnp.bfloat16)),
        }
        for cp in ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable"):
            peak, flops = estimate(
                tg.trace(tg.checkpoint(f, policy=getattr(cps, cp)), argnums=0)(*args)
            )
            pts[cp] = (COSTS.recompute_s(flops), peak)
        for pname, (secs, peak) in pts.items():
            pol = P.budget(peak, allow=ALL, max_error="bf16", costs=COSTS)
            tape = tg.trace(f, argnums=0)(*args)
            pol.plan(tape, [None] * len(tape.records))
            flag = "" if pol.last["time_s"] <= secs * (1 + 1e-9) else " **worse**"
            print(
                f"| {name} | {pname} | {secs * 1e6:.1f} | {peak:,} | "
                f"{pol.last['time_s'] * 1e6:.1f}{flag} | {pol.last['peak_bytes']:,} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    _results.add_arguments(ap)
    a = ap.parse_args()
    _results.start(a)
    print(f"jax {jax.__version__}, {jax.default_backend()}; cost model {COSTS}")
    ms = models(a.quick)
    quality(a.quick)
    # compress cheap per byte freed: int8 and bf16 compete with offload
    quality(a.quick, CostModel(5e10, 5e9, 5e9, 1.2e10))
    planning_time(a.quick)
    peaks(ms)
    monotone(ms)
    pareto(ms)
    _results.finish(a, "planner_bench")


if __name__ == "__main__":
    main()
