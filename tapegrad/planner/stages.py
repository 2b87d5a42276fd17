"""The chain program lifted to *stages*: layers of a DAG (transformer blocks, say)
separated by boundaries where exactly one activation crosses.

Between two such boundaries the tape may branch freely, but the stages themselves
form a chain, and the decomposition of `chain` carries over: a run of
consecutive recomputed stages is processed by backward while exactly the kept bytes
of the stages before it are live, plus what the run and the saved stage after it
hold. The program chooses, per stage, "saved" or "in a recomputed run", and per run
a class plan for what it still saves (nothing, or dots, as
``jax.checkpoint(dots_saveable)`` per layer). Each run's kept bytes and local peak
are measured by the executor's own schedule (`problem.simulate`) on the plan that
recomputes that run alone, so the program needs O(stages^2) simulations.

The result is a candidate like any other: `Budget.plan` scores it with `estimate`
and keeps it only if it fits (inside a stage, values shared between the run and
its neighbours can make the decomposition approximate; on a chain it is exact).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from tapegrad.core.tape import Var
from tapegrad.planner.chain import _pareto
from tapegrad.planner.scorer import CLASSES, _activation_bytes

__all__ = ["stage_bounds", "stage_plan"]


def stage_bounds(sc: Any, max_stages: int = 32) -> list[tuple[int, int]] | None:
    """Record ranges ``[a, b]`` of the stages, or None when there are fewer than 3."""
    tape = sc.tape
    n = sc.n
    # The program simulates every run of stages once: O(stages^2 * records). Keep it
    # to about a second (32 stages of a 130-record tape, 17 of a 450-record one).
    max_stages = min(max_stages, max(8, math.isqrt(133_000 // max(n, 1))))
    free = tape.caller_ids()
    producer = {o.id: r.index for r in tape.records for o in r.outputs}
    last: dict[int, int] = {}
    for r in tape.records:
        for u in r.inputs:
            if isinstance(u, Var) and u.id not in free:
                last[u.id] = r.index
    count = [0] * (n + 1)  # values crossing the position after each record
    for v, lu in last.items():
        if v in producer and lu > producer[v]:
            count[producer[v]] += 1
            count[lu] -= 1
    cuts, run = [], 0
    for i in range(n - 1):
        run += count[i]
        if run == 1 and sc.fixed[i] != "recompute":
            cuts.append(i)
    if len(cuts) + 1 < 3:
        return None
    if len(cuts) + 1 > max_stages:
        # keep the boundaries that split the activation bytes most evenly
        act = _activation_bytes(sc)[0]
        target = sum(act) / max_stages
        kept, acc, j = [], 0.0, 0
        for i in range(n - 1):
            acc += act[i]
            if j < len(cuts) and cuts[j] == i:
                j += 1
                if acc >= target:
                    kept.append(i)
                    acc = 0.0
        cuts = kept
        if len(cuts) + 1 < 3:
            return None
    return [(a + 1, b) for a, b in zip([-1] + cuts, cuts + [n - 1])]


def stage_plan(
    sc: Any,
    modes: Sequence[str] = ("nothing_saveable", "dots_saveable"),
    share: int | None = None,
) -> list[str] | None:
    """The least-flops stage plan the decomposition predicts to fit, or None. It
    simulates L(L+1)/2 runs per mode for L stages: at most ``share`` simulations
    (fewer stages when needed)."""
    max_stages = 32
    if share is not None:
        while max_stages > 3 and max_stages * (max_stages + 1) // 2 * len(modes) + 1 > share:
            max_stages -= 1
    stages = stage_bounds(sc, max_stages)
    if stages is None:
        return None
    tape, n, budget = sc.tape, sc.n, sc.budget
    L = len(stages)
    stage_of = [0] * n
    for s, (a, b) in enumerate(stages):
        for i in range(a, b + 1):
            stage_of[i] = s

    producer = {o.id: r.index for r in tape.records for o in r.outputs}

    def owner(key) -> int:
        if isinstance(key, tuple):  # ("aux", record, k)
            return stage_of[key[1]]
        return stage_of[producer[key]] if key in producer else -1

    def run_decisions(s: int, t: int, mode: str) -> list[str]:
        saved = CLASSES[mode]
        dec = ["save"] * n
        for i in range(stages[s][0], stages[t][1] + 1):
            if not saved(tape.records[i]):
                dec[i] = "recompute"
        return list(sc.with_fixed(dec))

    def kept_by_stage(size: dict) -> list[int]:
        out = [0] * (L + 1)  # index -1 (tape inputs) lands in the extra slot
        for k, b in size.items():
            out[owner(k)] += b
        return out

    _, _, size0 = sc.simulate(sc.with_fixed(["save"] * n))
    kept0 = kept_by_stage(size0)
    before0 = [sum(kept0[:s]) for s in range(L + 1)]

    # run (s, t, mode) -> (extra prefix bytes it causes, kept bytes of s..t, local peak,
    # recompute flops)
    runs: dict[tuple[int, int, str], tuple[int, int, int, float]] = {}
    for s in range(L):
        for t in range(s, L):
            for mode in modes:
                dec = run_decisions(s, t, mode)
                trace: dict[int, int] = {}
                _, flops, size = sc.simulate(dec, trace)
                kept = kept_by_stage(size)
                before = sum(kept[:s])
                hi = stages[t + 1][1] if t + 1 < L else n - 1
                window = [trace[i] for i in range(stages[s][0], hi + 1) if i in trace]
                local = max(window, default=before) - before
                runs[(s, t, mode)] = (before - before0[s], sum(kept[s : t + 1]), local, flops)

    fronts = _fronts(L, budget, kept0, runs, modes)
    if fronts is None:
        return None
    k = min(fronts[L], key=lambda k: (fronts[L][k][0], k))
    dec = ["save"] * n
    bp = fronts[L][k][1]
    while bp is not None:
        s, k_prev, step = bp
        if step is not None:
            t, mode = step
            run = run_decisions(s, t, mode)
            for i in range(stages[s][0], stages[t][1] + 1):
                dec[i] = run[i]
        bp = fronts[s][k_prev][1]
    return dec


def _fronts(
    L: int,
    budget: int,
    kept0: list[int],
    runs: dict[tuple[int, int, str], tuple[int, int, int, float]],
    modes: Sequence[str],
) -> list[dict[int, tuple[float, Any]]] | None:
    """The stage plans' Pareto fronts: ``fronts[s]`` maps kept bytes -> (flops,
    back-pointer) with stage s-1 saved (or s == 0), ``fronts[L]`` the whole plans; None
    when no whole plan fits ``budget``. ``runs``: (s, t, mode) -> (extra prefix bytes it
    causes, kept bytes of s..t, local peak, recompute flops); ``kept0``: each stage's
    kept bytes under save()."""
    fronts: list[dict[int, tuple[float, Any]]] = [dict() for _ in range(L + 1)]
    fronts[0][0] = (0.0, None)

    def offer(pos, k, f, bp):
        if k <= budget and (k not in fronts[pos] or f < fronts[pos][k][0]):
            fronts[pos][k] = (f, bp)

    for s in range(L):
        fronts[s] = _pareto(fronts[s])
        for k, (f, _) in list(fronts[s].items()):
            offer(s + 1, k + kept0[s], f, (s, k, None))
            for t in range(s, L):
                for mode in modes:
                    extra, run_kept, local, run_flops = runs[(s, t, mode)]
                    if k + extra + local > budget:
                        continue
                    k2 = k + extra + run_kept
                    if t + 1 < L:  # the stage after a run is saved
                        offer(t + 2, k2 + kept0[t + 1], f + run_flops, (s, k, (t, mode)))
                    else:
                        offer(L, k2, f + run_flops, (s, k, (t, mode)))
    return fronts if fronts[L] else None
