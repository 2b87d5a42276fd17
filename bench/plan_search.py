"""An offline search for executor plans faster than `Budget`'s, scored exactly:

    python bench/plan_search.py [--cells gap|all] [--seconds S] [--lower S] [--seed N]

`bench/ilp_exact.py` puts `Budget`'s plan against the proved lower bound of
`planner.ilp.joint.optimum`; where the two are far apart the gap is the planner's
(faster plans exist) or the bound's (the relaxation is loose). This looks for faster
plans with a heavy search, every plan scored as `planner.ilp.joint.plan_seconds`
scores it (the executor's timeline, exact per-residual mechanisms by HiGHS), at
`Budget`'s prefetch depth (min with 1, as ilp_exact compares):

1. simulated annealing over save/recompute decisions from `Budget`'s plan and from
   the joint ILP's decoded plans (`plan_candidate` at `plan_windows`), moves: flip a
   record, flip a record and a neighbour in the dataflow graph (same value or both
   flipped), swap a recomputed and a saved record, set a run of 2..6 adjacent records,
   save a whole connected recompute segment;
2. local branching on the joint ILP (`build` at the bound's window): the relaxation
   restricted to plans within Hamming distance k of the incumbent over the free
   records, no-good cuts on every plan scored, each solution scored exactly; the
   incumbent moves when it improves, k grows when the neighbourhood is exhausted.

Cells (``--cells gap``): those where `Budget`'s gap to the proved lower bound was
large in bench/RESULTS.md's Session 12. The table: `Budget`'s predicted µs, the best
found, the improvement, the proved lower bound (``--lower`` seconds of `optimum`
started from both plans; 0 skips it), and the search's wall seconds. Times are the
planner's cost model, not wall-clock step times.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tapegrad as tg  # noqa: E402
from bench.ilp_bench import ALL, COSTS, MECHS, families, floor_of, fmt  # noqa: E402
from tapegrad.planner import (  # noqa: E402
    Budget,
    BudgetError,
    estimate,
    joint,  # noqa: E402
)
from tapegrad.planner.ilp import joint as J  # noqa: E402
from tapegrad.planner.ilp import mechanisms as ilp  # noqa: E402
from tapegrad.planner.index import TapeIndex  # noqa: E402

# (family, records, budget as % of save()'s peak) from RESULTS.md Session 12
GAP_CELLS = [
    ("random DAG", 69, 55),
    ("random DAG", 69, 37),
    ("U-Net", 58, 70),
    ("U-Net", 58, 31),
    ("transformer", 46, 46),
    ("transformer", 46, 61),
    ("transformer", 90, 35),
]


class Exact:
    """`plan_seconds` with a memo, and a cheap rejection: a plan whose recompute time
    alone reaches ``limit`` (or whose fewest bytes do not fit) skips HiGHS."""

    def __init__(self, tape, budget: int, prefetch: int):
        self.tape, self.budget, self.prefetch = tape, budget, prefetch
        self.index = TapeIndex(tape)
        self.memo: dict[tuple, float | None] = {}
        self.lower: dict[tuple, float] = {}
        self.solves = 0

    def __call__(self, dec: tuple, limit: float = math.inf) -> float | None:
        if dec in self.memo:
            return self.memo[dec]
        if self.lower.get(dec, -1.0) >= limit:
            return math.inf
        tl = joint.timeline(self.index.planned(dec), self.prefetch, self.index._seg_memo)
        rec_s = COSTS.recompute_s(tl.recompute_flops)
        opts = joint.options(tl, MECHS, COSTS)
        if joint.least_bytes(tl, opts) > self.budget:
            self.memo[dec] = None
            return None
        if rec_s >= limit:
            self.lower[dec] = rec_s
            return math.inf
        self.solves += 1
        choice, _ = ilp.solve_proved(tl, opts, self.budget, time_limit=10.0)
        v = None
        if choice is not None:
            peak, secs = joint.evaluate(tl, opts, choice)
            v = secs + rec_s if peak <= self.budget else None
        self.memo[dec] = v
        return v


def neighbours(tape) -> list[list[int]]:
    producer = {o.id: r.index for r in tape.records for o in r.outputs}
    adj: list[set[int]] = [set() for _ in tape.records]
    for r in tape.records:
        for u in r.inputs:
            p = producer.get(getattr(u, "id", None))
            if p is not None and p != r.index:
                adj[r.index].add(p)
                adj[p].add(r.index)
    return [sorted(a) for a in adj]


def anneal(ex: Exact, free, adj, start, seconds, rng, t_hi=0.03, t_lo=0.0005):
    """Simulated annealing from ``start`` (a fitting plan): (best, its seconds)."""
    cur = tuple(start)
    cv = ex(cur)
    best, bv = cur, cv
    t0 = time.perf_counter()
    n = len(cur)
    fr = np.array(free)
    while True:
        el = (time.perf_counter() - t0) / seconds
        if el >= 1:
            break
        T = bv * t_hi * (t_lo / t_hi) ** el
        d = list(cur)
        kind = rng.random()
        i = int(rng.choice(fr))
        flip = "save" if d[i] == "recompute" else "recompute"
        if kind < 0.3:
            d[i] = flip
        elif kind < 0.55:
            js = [j for j in adj[i] if j in ex_free(free)]
            if not js:
                continue
            j = int(rng.choice(js))
            if rng.random() < 0.5:
                d[i] = d[j] = flip
            else:
                d[i] = flip
                d[j] = "save" if d[j] == "recompute" else "recompute"
        elif kind < 0.75:
            rs = [k for k in free if d[k] == "recompute"]
            ss = [k for k in free if d[k] == "save"]
            if not rs or not ss:
                continue
            a, b = int(rng.choice(rs)), int(rng.choice(ss))
            d[a], d[b] = "save", "recompute"
        elif kind < 0.92:
            length = int(rng.integers(2, 7))
            lo = int(rng.integers(0, max(n - length, 1)))
            v = "save" if rng.random() < 0.5 else "recompute"
            for k in range(lo, min(lo + length, n)):
                if k in ex_free(free):
                    d[k] = v
        else:  # save the connected recompute segment around a recomputed record
            rs = [k for k in free if d[k] == "recompute"]
            if not rs:
                continue
            stack, seen = [int(rng.choice(rs))], set()
            while stack:
                k = stack.pop()
                if k in seen or d[k] != "recompute":
                    continue
                seen.add(k)
                stack += adj[k]
            for k in seen:
                if k in ex_free(free):
                    d[k] = "save"
        trial = tuple(d)
        if trial == cur:
            continue
        thr = cv - T * math.log(max(rng.random(), 1e-300))
        v = ex(trial, thr)
        if v is None or v >= thr:
            continue
        cur, cv = trial, v
        if v < bv * (1 - 1e-12):
            best, bv = trial, v
    return best, bv


_FREE_SETS: dict[int, frozenset] = {}


def ex_free(free) -> frozenset:
    s = _FREE_SETS.get(id(free))
    if s is None:
        s = _FREE_SETS[id(free)] = frozenset(free)
    return s


def local_branching(ex: Exact, tape, budget, prefetch, start, sv, seconds, k0=4):
    """Local branching on the joint ILP around the incumbent: (best, its seconds)."""
    import highspy

    model = J.build(tape, [None] * len(tape.records), budget, MECHS, COSTS, prefetch, J.WINDOW)
    if model is None:
        return start, sv
    h, scale = J._load(model)
    free = np.array([i for i in range(model.n) if model.upper[i] > 0], np.int32)
    inc, iv = tuple(start), sv
    t0 = time.perf_counter()
    k = k0
    row = None  # the Hamming row's index

    def hamming(center, kk):
        nonlocal row
        rec = np.array([center[i] == "recompute" for i in free])
        lo_, hi_ = -highspy.kHighsInf, float(kk - rec.sum())
        if row is None:
            h.addRow(lo_, hi_, len(free), free, np.where(rec, -1.0, 1.0))
            row = h.getNumRow() - 1
        else:
            h.changeRowBounds(row, lo_, hi_)
            for j, c in zip(free, np.where(rec, -1.0, 1.0)):
                h.changeCoeff(row, int(j), float(c))

    cut: set[tuple] = set()

    def nogood(dec):
        rec = np.array([dec[i] == "recompute" for i in free])
        h.addRow(1.0 - rec.sum(), highspy.kHighsInf, len(free), free, np.where(rec, -1.0, 1.0))
        cut.add(dec)

    nogood(inc)
    hamming(inc, k)
    while True:
        left = seconds - (time.perf_counter() - t0)
        if left <= 0.5:
            break
        sol = J._run(h, model, scale, min(left, 20.0), t0)
        if sol.decisions is None:  # neighbourhood exhausted (or no solution): widen
            if sol.status == "infeasible":
                k += 2
                if k > len(free):
                    break
                hamming(inc, k)
                continue
            break
        dec = tuple(sol.decisions)
        if sol.bound is not None and sol.bound >= iv:  # nothing better in reach: widen
            k += 2
            if k > len(free):
                break
            hamming(inc, k)
            if dec in cut:
                continue
        if dec in cut:
            break
        v = ex(dec)
        nogood(dec)
        if v is not None and v < iv * (1 - 1e-12):
            inc, iv = dec, v
            k = k0
            hamming(inc, k)
    return inc, iv


def cells(which: str):
    for fam, _size, f, fargs in families(False):
        tape = tg.trace(f, argnums=0)(*fargs)
        n = len(tape.records)
        full = estimate(tape)[0]
        lo = floor_of(tape)
        for b in np.unique(np.linspace(int(full * 0.9), lo, 5).astype(int))[::-1]:
            b = int(b)
            pct = round(100 * b / full)
            if which == "gap" and (fam, n, pct) not in GAP_CELLS:
                continue
            if which == "all" and n > 100:
                continue
            yield fam, n, pct, tape, b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="gap", help="gap, all (≤100 records), or N:PCT,...")
    ap.add_argument("--seconds", type=float, default=120.0, help="search seconds per cell")
    ap.add_argument("--lower", type=float, default=0.0, help="optimum's seconds (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not ilp.available():
        print("highspy not installed: nothing to search")
        return
    which = args.cells
    pick = None
    if which not in ("gap", "all"):
        pick = {tuple(int(x) for x in c.split(":")) for c in which.split(",")}
        which = "any"
    print(
        "| cell | budget (% save) | prefetch | Budget µs | best found µs | improvement "
        "| found by | proved lower µs | plans solved | search s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for fam, n, pct, tape, b in cells(which):
        if pick is not None and (n, pct) not in pick:
            continue
        rng = np.random.default_rng(args.seed)
        t0 = time.perf_counter()
        try:
            pol = Budget(b, allow=ALL, max_error="bf16", costs=COSTS)
            start = tuple(pol.plan(tape, [None] * n))
        except BudgetError:
            continue
        depth = min(int(pol.last["prefetch"]), 1)
        ex = Exact(tape, b, depth)
        bv = ex(start)
        if bv is None:
            print(f"| {fam} {n} | {pct}% | {depth} | Budget's plan does not score |")
            continue
        best, by = start, "Budget"
        starts = [(start, "Budget")]
        for window in J.plan_windows(n):
            dec = J.plan_candidate(tape, [None] * n, b, MECHS, COSTS, depth, window=window)
            if dec is not None and ex(dec) is not None:
                starts.append((dec, f"ILP w{window}"))
        adj = neighbours(tape)
        free = list(range(n))
        share = args.seconds * 0.6 / len(starts)
        for s, name in starts:
            d, v = anneal(ex, free, adj, s, share, rng)
            if v < bv * (1 - 1e-12):
                best, bv, by = d, v, f"anneal from {name}"
        d, v = anneal(ex, free, adj, best, args.seconds * 0.15, rng, t_hi=0.005)
        if v < bv * (1 - 1e-12):
            best, bv = d, v
        d, v = local_branching(ex, tape, b, depth, best, bv, args.seconds * 0.25)
        if v < bv * (1 - 1e-12):
            best, bv, by = d, v, by + " + local branching"
        secs = time.perf_counter() - t0
        # every plan reported is scored by plan_seconds itself
        check, _ = J.plan_seconds(TapeIndex(tape), best, b, MECHS, COSTS, depth)
        assert check is not None and abs(check - bv) <= 1e-9 * bv, (check, bv)
        shipped = pol.last["time_s"]
        lower = "—"
        if args.lower > 0:
            r = J.optimum(
                tape, [None] * n, b, MECHS, COSTS, args.lower, [start, best], prefetch=depth
            )
            lower = fmt(r.lower) + ("" if r.proved else "") if r is not None else "—"
        rec = [i for i in range(n) if best[i] == "recompute"]
        print(
            f"| {fam} {n} | {pct}% | {depth} | {fmt(shipped)} | {fmt(check)} "
            f"| {1 - check / shipped:+.1%} | {by} | {lower} | {ex.solves} | {secs:.0f} |",
            flush=True,
        )
        print(f"<!-- {fam} {n} {pct}%: recompute {rec} -->", flush=True)


if __name__ == "__main__":
    main()
