"""The greedy mechanism completion (`planner.joint.assign_greedy`) against the exact
one (`ilp.solve`, no work limit), on the timelines `Budget` completes:

    python bench/greedy_gap.py [--quick] [--per-cell N] [--flips N] [--cache PATH]

Timelines come from the `bench/ilp_bench.py` cells (its families, 5 budgets from 90%
of save()'s peak down to the heuristic's floor): per cell, ``--per-cell`` of the plans
`Budget` (without highspy's candidates, so the greedy ranks every plan) completes
while it plans — its candidates and the plans its descents score — sampled at
random, the plan it returns, and ``--flips`` plans one to three save/recompute flips
away from it. Per family: greedy/exact seconds the mechanisms add (mean, worst), for
the greedy as it was before the polish (`greedy_before`, a copy) and as it is now, and
the wall time per call of each. ``--cache`` keeps the timelines and exact answers
(pickle) so a second run only re-times the greedy.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from pathlib import Path

import numpy as np

# appended, not prepended: PYTHONPATH can point at another checkout to compare with
sys.path.append(str(Path(__file__).resolve().parent.parent))
import tapegrad as tg  # noqa: E402
from bench.ilp_bench import ALL, COSTS, families, floor_of  # noqa: E402
from tapegrad.planner import (  # noqa: E402
    Budget,
    BudgetError,
    estimate,
    joint,  # noqa: E402
)
from tapegrad.planner.ilp import mechanisms as ilp  # noqa: E402
from tapegrad.planner.joint import _fewest_bytes, live_bytes  # noqa: E402
from tapegrad.planner.scorer import Scorer  # noqa: E402

B = sys.modules["tapegrad.planner.candidates"]


def greedy_before(tl, opts, budget):
    """`assign_greedy` as it was before the polish (a frozen copy, for the comparison)."""
    K = len(tl.keys)
    r = np.arange(K)
    choice = np.zeros(K, np.int64)
    stored = opts.stored[:, 0].copy()
    copied = np.zeros(K, np.int64)
    live = live_bytes(tl, stored, copied)
    if tl.points == 0:
        return choice
    rel, unp = tl.release, tl.unpack

    def apply(k, c):
        ds = opts.stored[k, c] - stored[k]
        dc = opts.copied[k, c] - copied[k]
        live[: rel[k] + 1] += ds
        live[unp[k] : rel[k] + 1] += dc
        stored[k], copied[k] = opts.stored[k, c], opts.copied[k, c]
        choice[k] = c

    for _ in range(4 * K + 4):
        t = int(np.argmax(live))
        if live[t] <= budget:
            break
        in_copy = (unp <= t)[:, None]
        delta = (opts.stored - stored[:, None]) + np.where(
            in_copy, opts.copied - copied[:, None], 0
        )
        dt = opts.seconds - opts.seconds[r, choice][:, None]
        ok = opts.valid & (rel >= t)[:, None] & (delta < 0)
        if not ok.any():
            break
        score = np.where(dt > 0, -delta / np.maximum(dt, 1e-30), np.inf)
        score = np.where(ok, score, -1.0)
        top = score.max()
        cand = np.nonzero(score == top)
        j = int(np.argmax(-delta[cand]))
        apply(int(cand[0][j]), int(cand[1][j]))
    if live.max() > budget:
        for k, c in enumerate(_fewest_bytes(opts)):
            apply(k, int(c))
        if live.max() > budget:
            return None
    for k in np.argsort(-opts.seconds[r, choice], kind="stable"):
        k = int(k)
        cur = int(choice[k])
        if cur == 0:
            continue
        for c in np.argsort(opts.seconds[k], kind="stable"):
            c = int(c)
            if not opts.valid[k, c] or opts.seconds[k, c] >= opts.seconds[k, cur]:
                continue
            apply(k, c)
            if live.max() <= budget:
                break
            apply(k, cur)
    return choice


def collect(quick: bool, per_cell: int, flips: int, seed: int = 0) -> list:
    """[(family, size, records, budget fraction, kind, tl, opts, budget)] where kind is
    "search" (a plan `Budget` completed), "plan" (the one it returned) or "flip"."""
    rng = np.random.default_rng(seed)
    out = []
    real = joint.assign_greedy
    for fam, size, f, args in families(quick):
        tape = tg.trace(f, argnums=0)(*args)
        n = len(tape.records)
        full = estimate(tape)[0]
        for b in np.unique(np.linspace(int(full * 0.9), floor_of(tape), 5).astype(int))[::-1]:
            b = int(b)
            seen: list = []
            got: dict = {}

            def spy(tl, opts, budget, seen=seen):
                seen.append((tl, opts, budget))
                return real(tl, opts, budget)

            plan_joint = Budget._plan_joint

            def keep(self, tape, fixed, hints, got=got):
                dec, mech = plan_joint(self, tape, fixed, hints)
                got["dec"] = dec
                return dec, mech

            pol = Budget(b, allow=ALL, max_error="bf16", costs=COSTS)
            saved = (B._ilp_solver, B._joint_ilp_candidate)
            B._ilp_solver, B._joint_ilp_candidate = (lambda t: None), (lambda *a: [])
            joint.assign_greedy, Budget._plan_joint = spy, keep
            try:
                pol.plan(tape, [None] * n)
            except BudgetError:
                pass
            finally:
                joint.assign_greedy, Budget._plan_joint = real, plan_joint
                B._ilp_solver, B._joint_ilp_candidate = saved
            cell = (fam, size, n, b / full)
            idx = rng.permutation(len(seen))[:per_cell]
            out += [(*cell, "search", *seen[i]) for i in sorted(idx)]
            dec = got.get("dec")
            if dec is None:
                continue
            sc = Scorer(tape, [None] * n, b)
            prefetch = pol.last["prefetch"]
            mechs = pol.mechanisms
            tl = joint.timeline(sc.planned(dec), prefetch, sc._memo)
            out.append((*cell, "plan", tl, joint.options(tl, mechs, COSTS), b))
            for _ in range(flips):
                d = list(dec)
                for i in rng.choice(n, size=int(rng.integers(1, 4)), replace=False):
                    d[i] = "recompute" if d[i] == "save" else "save"
                d = sc.with_fixed(d)
                tl = joint.timeline(sc.planned(d), prefetch, sc._memo)
                out.append((*cell, "flip", tl, joint.options(tl, mechs, COSTS), b))
            print(f"collected {fam} {size} {b / full:.0%}: {len(seen)} calls", flush=True)
    return out


def exact_of(items: list) -> list:
    ex = []
    for *_, tl, opts, b in items:
        if joint.least_bytes(tl, opts) > b:
            ex.append(None)
            continue
        c = ilp.solve(tl, opts, b, work=None, time_limit=10)
        ex.append(None if c is None else joint.evaluate(tl, opts, c)[1])
    return ex


def timed(fn, items: list, reps: int) -> tuple[list, np.ndarray]:
    res, per = [], np.zeros(len(items))
    for i, (*_, tl, opts, b) in enumerate(items):
        best = np.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            c = fn(tl, opts, b)
            best = min(best, time.perf_counter() - t0)
        per[i] = best
        res.append(c)
    return res, per


def plans(quick: bool, max_records: int | None) -> None:
    """`Budget`'s plan on every cell (the ILP's where highspy is importable): one line
    per cell, predicted µs and planning seconds, and the totals."""
    print(f"highspy: {ilp.available()}")
    print("| family | size | records | budget | predicted µs | plan s |")
    print("|---|---|---|---|---|---|")
    tot_us, tot_s = 0.0, 0.0
    for fam, size, f, args in families(quick):
        tape = tg.trace(f, argnums=0)(*args)
        n = len(tape.records)
        if max_records is not None and n > max_records:
            continue
        full = estimate(tape)[0]
        for b in np.unique(np.linspace(int(full * 0.9), floor_of(tape), 5).astype(int))[::-1]:
            pol = Budget(int(b), allow=ALL, max_error="bf16", costs=COSTS)
            t0 = time.perf_counter()
            try:
                pol.plan(tape, [None] * n)
                us = pol.last["time_s"] * 1e6
            except BudgetError:
                us = float("nan")
            dt = time.perf_counter() - t0
            tot_s += dt
            tot_us += 0.0 if us != us else us
            print(f"| {fam} | {size} | {n} | {b / full:.0%} | {us:.3f} | {dt:.2f} |", flush=True)
    print(f"\ntotal predicted {tot_us:.3f} µs, planning {tot_s:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plans", action="store_true", help="Budget's plans per cell instead")
    ap.add_argument("--max-records", type=int, default=None, help="with --plans")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--per-cell", type=int, default=8)
    ap.add_argument("--flips", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache", default=None, help="pickle of timelines and exact answers")
    a = ap.parse_args()
    if a.plans:
        plans(a.quick, a.max_records)
        return
    if not ilp.available():
        print("highspy not installed (pip install tapegrad[planner]): nothing to measure")
        return
    if a.cache and os.path.exists(a.cache):
        with open(a.cache, "rb") as fh:
            items, exact = pickle.load(fh)
    else:
        items = collect(a.quick, a.per_cell, a.flips)
        t0 = time.perf_counter()
        exact = exact_of(items)
        print(f"exact: {len(items)} timelines, {time.perf_counter() - t0:.0f} s")
        if a.cache:
            with open(a.cache, "wb") as fh:
                pickle.dump((items, exact), fh)
    old, t_old = timed(greedy_before, items, a.reps)
    new, t_new = timed(joint.assign_greedy, items, a.reps)
    rows: dict = {}
    for i, it in enumerate(items):
        fam, size, n, frac, kind, tl, opts, b = it
        row = rows.setdefault((fam, size, n), {"o": [], "n": [], "to": [], "tn": [], "k": 0})
        row["to"].append(t_old[i])
        row["tn"].append(t_new[i])
        row["k"] = max(row["k"], len(tl.keys))
        e = exact[i]
        for c, key in ((old[i], "o"), (new[i], "n")):
            if c is not None:
                p, s = joint.evaluate(tl, opts, c)
                assert p <= b, (fam, size, kind)
            if e is None:
                continue
            assert c is not None, "greedy found nothing where the exact program fits"
            s = joint.evaluate(tl, opts, c)[1]
            row[key].append(s / e if e > 0 else (1.0 if s <= 0 else np.inf))
    print(
        "| family | size | records | keys (max) | timelines | before: mean | worst "
        "| now: mean | worst | µs/call before | now | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    allo, alln = [], []
    for (fam, size, n), row in rows.items():
        o, w = np.array(row["o"]), np.array(row["n"])
        allo += row["o"]
        alln += row["n"]
        to, tn = np.mean(row["to"]) * 1e6, np.mean(row["tn"]) * 1e6
        print(
            f"| {fam} | {size} | {n} | {row['k']} | {len(o)} | {o.mean():.3f} | {o.max():.3f} "
            f"| {w.mean():.3f} | {w.max():.3f} | {to:.0f} | {tn:.0f} | {tn / to:.2f} |"
        )
    o, w = np.array(allo), np.array(alln)
    print(
        f"\nall: {len(o)} timelines; greedy/exact before mean {o.mean():.4f} worst "
        f"{o.max():.3f}; now mean {w.mean():.4f} worst {w.max():.3f}; within 1% of exact: "
        f"before {np.mean(o <= 1.01):.0%}, now {np.mean(w <= 1.01):.0%}; time per call "
        f"now/before {t_new.sum() / t_old.sum():.2f}"
    )


if __name__ == "__main__":
    main()
