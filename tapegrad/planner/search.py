"""The joint search: save/recompute decisions scored by a caller's cost (the predicted
step time, recompute plus mechanisms, `joint_search`; or flops under the budget,
`save_recompute._descend_flops`) instead of by flops alone.

The joint planner (`joint_plan.plan_joint`) completes the families' plans
(`families`) with per-residual mechanisms, then searches around the best completed ones
with `descend_joint`; `iterate_joint` then kicks the best plan out of its local
optimum (runs of records recomputed, saved or flipped, repaired around; then decisions
swapped across graph edges, repaired over the whole tape: `swap_edges`; then
annealing, `anneal_joint`) and keeps what improves; `oscillate` crosses plans over the
budget at a penalty per byte.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from tapegrad.planner.cost import record_flops
from tapegrad.planner.scorer import Scorer, _spread

__all__ = [
    "descend_joint",
    "iterate_joint",
    "kicks",
    "swap_edges",
    "anneal_joint",
    "oscillate",
]


def _better(a: tuple[int, float], b: tuple[int, float]) -> bool:
    return a[0] < b[0] or (a[0] == b[0] and a[1] < b[1] * (1 - 1e-9))


def _remembered(
    seen: dict[tuple[str, ...], tuple[tuple[int, float], bool]],
    cost: Callable[[tuple[str, ...], tuple[int, float] | None], tuple[int, float]],
    dec: tuple[str, ...],
    beat: tuple[int, float] | None,
) -> tuple[tuple[int, float], bool]:
    """(``cost`` of ``dec``, whether it was evaluated now): remembered in ``seen`` with
    whether it is exact (an answer not below the score it had to beat may be a lower
    bound only: evaluated again where it would beat a lower score)."""
    got = seen.get(dec)
    if got is not None and (got[1] or (beat is not None and not _better(got[0], beat))):
        return got[0], False
    t = cost(dec, beat)
    seen[dec] = (t, beat is None or _better(t, beat))
    return t, True


def descend_joint(
    sc: Scorer,
    start: Sequence[str],
    cost: Callable[[tuple[str, ...], tuple[int, float] | None], tuple[int, float]],
    max_evals: int,
    runs: Sequence[int] = (1, 2, 3, 4),
    window: tuple[int, int] | None = None,
    seen: dict[tuple[str, ...], tuple[tuple[int, float], bool]] | None = None,
    frozen: Collection[int] = (),
) -> tuple[tuple[str, ...], tuple[int, float], int]:
    """First-improvement local search over save/recompute decisions scored by ``cost``
    (decisions -> ``(0, predicted step time)`` when mechanisms fit the budget, else
    ``(1, bytes over it)``: a start that does not fit is repaired first), from
    ``start``: (best decisions, their cost, evaluations spent). ``cost``'s second
    argument is the score to beat (None: none): it may answer any score not below it
    once it knows the plan cannot beat it.

    Moves, in sweeps until one improves nothing or ``max_evals`` is spent: flip one free
    record (recomputed ones back to "save" first, costliest first; then saved ones to
    "recompute", most activation bytes per flop first), then set runs of 2..4 records
    adjacent on the tape to one decision; with ``window`` = (lo, hi), only moves on
    records lo..hi-1 (a repair around a kick, `iterate_joint`); records in ``frozen``
    keep their decisions (single flips only then: a repair that may not undo a swap,
    `swap_edges`). ``seen`` (shared by several descents) remembers scores: only plans
    not seen count as evaluations.
    The flops-only searches above cannot see that a record kept (and offloaded or
    compressed) may cost less than its recomputation, or that recomputing a cheap
    record may spare a costly conversion elsewhere; this scores exactly that.
    Deterministic: the order depends on the tape only."""
    lo, hi = window if window is not None else (0, sc.n)
    seen = {} if seen is None else seen
    evals = 0

    def score(dec: tuple[str, ...], beat: tuple[int, float] | None) -> tuple[int, float]:
        nonlocal evals
        t, new = _remembered(seen, cost, dec, beat)
        evals += new
        return t

    cur = sc.with_fixed(start)
    best = score(cur, None)
    free = [i for i in range(lo, hi) if sc.fixed[i] is None and i not in frozen]
    flops = {i: record_flops(sc.tape.records[i]) for i in free}
    act = sc.activation()
    improved = True
    while improved and evals < max_evals:
        improved = False
        back = sorted((i for i in free if cur[i] == "recompute"), key=lambda i: -flops[i])
        out = sorted(
            (i for i in free if cur[i] == "save" and act[i] > 0),
            key=lambda i: -act[i] / max(flops[i], 1.0),
        )
        moves: list[tuple[int, int, str]] = [(i, 1, "save") for i in back]
        moves += [(i, 1, "recompute") for i in out]
        for length in runs:
            if length > 1 and not frozen:
                moves += [
                    (i, length, v)
                    for i in range(lo, hi - length + 1)
                    for v in ("save", "recompute")
                ]
        for i, length, v in moves:
            if evals >= max_evals:
                break
            trial = sc.with_fixed(cur[:i] + (v,) * length + cur[i + length :])
            t = score(trial, best)
            if _better(t, best):
                cur, best, improved = trial, t, True
    return cur, best, evals


# Iterated local search (`iterate_joint`): how many adjacent records a kick sets, and
# how far on each side of it the repair descent looks.
KICK = 6
KICK_REACH = 2


def kicks(n: int, hot: Sequence[int] = ()) -> list[tuple[int, str]]:
    """Kicks for `iterate_joint`: (first record of a run of `KICK` records, "recompute",
    "save" or "flip" it), first on runs centred on the ``hot`` records (where the plan
    spends its time, costliest first), then at positions coarse to fine over the tape
    (`_spread`, so a search cut short has kicked all over it), the three kinds at
    each."""
    if KICK >= n:
        return []
    firsts = [min(max(r - KICK // 2, 0), n - KICK) for r in hot]
    firsts += [round(p * (n - KICK) / max(n - 1, 1)) for p in _spread(n)]
    return [(i, v) for i in dict.fromkeys(firsts) for v in ("recompute", "save", "flip")]


def iterate_joint(
    sc: Scorer,
    starts: Sequence[Sequence[str]],
    cost: Callable[[tuple[str, ...], tuple[int, float] | None], tuple[int, float]],
    max_evals: int,
    kick_evals: int = 0,
    hot: Callable[[tuple[str, ...]], Sequence[int]] | None = None,
    swap_evals: int = 0,
    anneal_evals: int = 0,
) -> tuple[list[tuple[int, tuple[str, ...], tuple[int, float]]], int]:
    """Iterated local search: `descend_joint` from each of ``starts`` in turn (sharing
    ``max_evals``), then, for up to ``kick_evals`` more evaluations, kick the best plan
    found (a run of records recomputed, saved or flipped, `kicks`) and repair around
    the kick (`descend_joint` on a window), keeping the result whenever it beats the
    best (``hot``: decisions -> the records where that plan spends its time, costliest
    first, where the kicks aim first, again after each improvement); then a descent
    over the whole tape from the best kicked plan, with what is left; then, for up to
    ``swap_evals`` more, edge swaps from the best plan (`swap_edges`); then annealing
    from the best plan (`anneal_joint`), one chain per `ANNEAL_T` schedule, each given
    its share of ``anneal_evals``.

    Why: single flips and runs of 2..4 stop where any one change costs more, yet a
    group of records recomputed (or kept) together may pay only as a group, e.g. six
    cheap records whose recomputation frees the bytes the mechanisms were paying for;
    a kick jumps there and the repair fixes its edges. Scores are shared by all the
    descents (a plan is evaluated once). Returns the plans that beat every plan before
    them, as (index of the start they came from, decisions, cost), and the
    evaluations spent. Deterministic: kicks and their order depend on the tape only."""
    found: list[tuple[int, tuple[str, ...], tuple[int, float]]] = []
    seen: dict[tuple[str, ...], tuple[tuple[int, float], bool]] = {}
    spent = 0
    for k, start in enumerate(starts):
        if spent >= max_evals - 1:
            break
        dec, t, e = descend_joint(sc, start, cost, max_evals - spent, seen=seen)
        spent += e
        if not found or _better(t, found[-1][2]):
            found.append((k, dec, t))
    if not found or kick_evals <= 0:
        return found, spent
    k, cur, best = found[-1]
    kicked = False
    stop = spent + kick_evals
    queue = kicks(sc.n, hot(cur) if hot is not None else ())
    while queue and spent < stop - 1:
        i, v = queue.pop(0)
        if v == "flip":
            run = tuple("save" if d == "recompute" else "recompute" for d in cur[i : i + KICK])
        else:
            run = (v,) * KICK
        trial = sc.with_fixed(cur[:i] + run + cur[i + KICK :])
        if trial == cur:
            continue
        window = (max(0, i - KICK_REACH), min(sc.n, i + KICK + KICK_REACH))
        dec, t, e = descend_joint(sc, trial, cost, stop - spent, window=window, seen=seen)
        spent += e
        if _better(t, best):
            cur, best, kicked = dec, t, True
            if hot is not None:  # aim again, at where the new plan spends its time
                queue = kicks(sc.n, hot(cur))
    if kicked:
        cur, best, e = descend_joint(sc, cur, cost, max(stop - spent, 1), seen=seen)
        spent += e
    if swap_evals > 0:
        dec, t, e = swap_edges(sc, cur, best, cost, swap_evals, seen)
        spent += e
        if _better(t, best):
            cur, best, kicked = dec, t, True
    for chain, (hi, lo, share) in enumerate(ANNEAL_T):
        dec, t, e = anneal_joint(
            sc, cur, best, cost, int(anneal_evals * share), seen, (hi, lo), ANNEAL_SEED + chain
        )
        spent += e
        if _better(t, best):
            cur, best, kicked = dec, t, True
    if kicked:
        found.append((k, cur, best))
    return found, spent


def _free_edges(sc: Scorer) -> list[tuple[int, int]]:
    """(producer, consumer) of each input a record reads from its own region, both ends
    free, once per read, consumers in tape order: the dataflow edges the edge swaps and
    the annealing's neighbour moves work along."""
    free = [f is None for f in sc.fixed]
    return [(p, c) for c in range(sc.n) for p in sc.index.same_region_in[c] if free[p] and free[c]]


# Edge swaps (`swap_edges`): evaluations of the descent that repairs each swap.
SWAP_REPAIR = 400


def swap_edges(
    sc: Scorer,
    cur: tuple[str, ...],
    best: tuple[int, float],
    cost: Callable[[tuple[str, ...], tuple[int, float] | None], tuple[int, float]],
    max_evals: int,
    seen: dict[tuple[str, ...], tuple[tuple[int, float], bool]] | None = None,
) -> tuple[tuple[str, ...], tuple[int, float], int]:
    """Kicks along the graph: for each edge producer -> consumer whose decisions differ,
    swap them (the boundary of a recomputed segment moves one record: the consumer's
    input kept instead of its output, or the other way round); repair the swaps in
    order of their own cost, least first, each with a descent of single flips over the
    whole tape that may not undo it (`SWAP_REPAIR` evaluations at most), and keep the
    first that beats ``best``; then again from it. Returns the best decisions, their
    cost and the evaluations spent.

    Why: a swap moves where a segment is cut, and the bytes it frees or adds are paid
    back elsewhere on the timeline, by a flip far away on the tape that a kick's
    windowed repair does not reach. On the bench's 149-record DAG at 52%, `Budget`'s
    plan (1.766 µs) was 9 flips from the proved optimum (1.658), every path through
    those flips over 1.94; two repaired swaps reach 1.737."""
    seen = {} if seen is None else seen
    edges = list(dict.fromkeys(_free_edges(sc)))
    spent = 0

    improved = True
    while improved and spent < max_evals - 1:
        improved = False
        swaps = []
        for p, c in edges:
            if cur[p] != cur[c] and spent < max_evals - 1:
                swapped = list(cur)
                swapped[p], swapped[c] = cur[c], cur[p]
                dec = sc.with_fixed(swapped)
                t, new = _remembered(seen, cost, dec, None)
                spent += new
                swaps.append((t, p, c, dec))
        swaps.sort(key=lambda s: (s[0], s[1], s[2]))
        for _, p, c, trial in swaps:
            if spent >= max_evals - 1:
                break
            repair = min(SWAP_REPAIR, max_evals - spent)
            dec, t, e = descend_joint(sc, trial, cost, repair, seen=seen, frozen=(p, c))
            spent += e
            if _better(t, best):
                cur, best, improved = dec, t, True
                break
    return cur, best, spent


# Annealing (`anneal_joint`): chains run one after another, each from the best plan so
# far, as (temperature at the start, at the end, as fractions of the best cost, geometric
# in between; share of ``anneal_evals``), the k-th seeded ``ANNEAL_SEED + k``. One chain
# at (0.03, 0.0005) (session 20); a second, cooler one after it (session 21) found faster
# plans on 12 of 30 of `bench/ilp_bench.py`'s cells on tapes of 46-256 records (up to
# -7.6%, DAG 256 at 50%) for ~20% more planning CPU, and, since the first chain's course
# is unchanged, none slower. The cooler schedule alone was faster on 10, slower on 3:
# which schedule wins is the tape's luck; both keep the better.
ANNEAL_T: tuple[tuple[float, float, float], ...] = ((0.03, 0.0005, 1.0), (0.01, 0.0002, 1.0))
ANNEAL_SEED = 0


def anneal_joint(
    sc: Scorer,
    cur: tuple[str, ...],
    best: tuple[int, float],
    cost: Callable[[tuple[str, ...], tuple[int, float] | None], tuple[int, float]],
    max_evals: int,
    seen: dict[tuple[str, ...], tuple[tuple[int, float], bool]] | None = None,
    temps: tuple[float, float] = ANNEAL_T[0][:2],
    seed: int = ANNEAL_SEED,
) -> tuple[tuple[str, ...], tuple[int, float], int]:
    """Simulated annealing from ``cur`` (a plan that fits, cost ``best``) for up to
    ``max_evals`` evaluations: a random move is taken when its cost is below the
    current one plus ``T * -log(u)``, ``T`` falling geometrically from ``temps[0]``
    to ``temps[1]`` of the best cost as the evaluations are spent;
    plans that do not fit are never taken. Moves: flip a free record; flip a record and
    a neighbour in the dataflow graph (both to one side, or both flipped); swap a
    recomputed and a saved record; set a run of 2..6 adjacent records to one decision;
    save a whole connected recomputed segment. Then a descent from the best plan met.
    Returns the best decisions, their cost and the evaluations spent. Deterministic
    (``seed``).

    Why: the descents, kicks and swaps above stop where every change within a few
    records costs more; on the bench's 69-record DAG at 37% of save()'s peak they
    stopped at 4.091 µs, 19 flips from a plan at 3.786 that an offline annealing found
    (`bench/plan_search.py`); this reaches it within the work the swaps get."""
    seen = {} if seen is None else seen
    free = [i for i in range(sc.n) if sc.fixed[i] is None]
    if not free or best[0] != 0 or max_evals < 2:
        return cur, best, 0
    adj: list[list[int]] = [[] for _ in range(sc.n)]
    for p, c in _free_edges(sc):
        if p != c:
            adj[p].append(c)
            adj[c].append(p)
    rng = np.random.default_rng(seed)
    other = {"save": "recompute", "recompute": "save"}
    spent, tries = 0, 0
    now, now_t = cur, best
    while spent < max_evals - 1 and tries < 20 * max_evals:
        tries += 1
        d = list(now)
        kind = rng.random()
        i = free[int(rng.integers(len(free)))]
        if kind < 0.3:
            d[i] = other[d[i]]
        elif kind < 0.55:
            if not adj[i]:
                continue
            j = adj[i][int(rng.integers(len(adj[i])))]
            d[j] = other[d[j]] if rng.random() < 0.5 else other[d[i]]
            d[i] = other[d[i]]
        elif kind < 0.75:
            rs = [k for k in free if d[k] == "recompute"]
            ss = [k for k in free if d[k] == "save"]
            if not rs or not ss:
                continue
            a, b = rs[int(rng.integers(len(rs)))], ss[int(rng.integers(len(ss)))]
            d[a], d[b] = "save", "recompute"
        elif kind < 0.92:
            length = int(rng.integers(2, 7))
            lo = int(rng.integers(0, max(sc.n - length, 1)))
            v = "save" if rng.random() < 0.5 else "recompute"
            for k in range(lo, min(lo + length, sc.n)):
                d[k] = v
        else:
            if d[i] != "recompute":
                continue
            stack, seg = [i], set()
            while stack:
                k = stack.pop()
                if k not in seg and d[k] == "recompute":
                    seg.add(k)
                    stack += adj[k]
            for k in seg:
                d[k] = "save"
        trial = sc.with_fixed(d)
        if trial == now:
            continue
        temp = best[1] * temps[0] * (temps[1] / temps[0]) ** (spent / max_evals)
        bar = (0, now_t[1] - temp * float(np.log(max(rng.random(), 1e-300))))
        t, new = _remembered(seen, cost, trial, bar)
        spent += new
        if not _better(t, bar):
            continue
        now, now_t = trial, t
        if _better(t, best):
            cur, best = trial, t
    if spent < max_evals - 1:
        cur, best, e = descend_joint(sc, cur, cost, max_evals - spent, seen=seen)
        spent += e
    return cur, best, spent


# Strategic oscillation (`oscillate`): the penalty rates tried, as multiples of the
# caller's rate (the start's cost per byte it keeps off the device).
OSCILLATE = (0.5, 1.0, 2.0, 4.0)


def oscillate(
    sc: Scorer,
    start: Sequence[str],
    cost: Callable[[tuple[str, ...], tuple[int, float] | None], tuple[int, float]],
    penalized: Callable[[tuple[str, ...], float], float],
    rate: float,
    max_evals: int,
) -> tuple[tuple[str, ...], tuple[int, float], int]:
    """Descents that cross plans over the budget: for each penalty rate (`OSCILLATE`
    times ``rate``), a descent from ``start`` scored by ``penalized(decisions, rate)``
    (the plan's cost plus the rate per byte over the budget), then a descent scored by
    ``cost`` (as in `descend_joint`) that repairs and polishes it, sharing
    ``max_evals``: (the best decisions, their cost, evaluations spent).

    Why: ``cost`` ranks every plan over the budget below every plan that fits, so a
    descent never crosses them, yet trading one group of kept records for another
    needs a step over the budget first (a U-Net at 70% of save()'s peak: keep a level's
    activations and recompute the level above and the pools, 35,840 flops, where the
    descents stopped at 67,072). Deterministic."""
    cur = sc.with_fixed(start)
    best = cost(cur, None)
    spent = 0
    for n, k in enumerate(OSCILLATE):
        if spent >= max_evals - 1:
            break
        share = (max_evals - spent) // (2 * (len(OSCILLATE) - n))

        def soft(d: tuple[str, ...], _beat: Any, lam: float = k * rate) -> tuple[int, float]:
            return (0, penalized(d, lam))

        d1, _, e1 = descend_joint(sc, cur, soft, share)
        spent += e1
        d2, t2, e2 = descend_joint(sc, d1, cost, max(share, (max_evals - spent) // 2))
        spent += e2
        if _better(t2, best):
            cur, best = d2, t2
    return cur, best, spent
