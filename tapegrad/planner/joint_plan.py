"""The joint plan: save/recompute plans completed with per-residual mechanisms (offload,
compress) under the budget, the least predicted step time winning (`plan_joint`,
`Budget.plan` with mechanisms allowed).

Candidates: the hints; the save/recompute search's plan at the budget and relaxed plans
from its (peak, flops) front (less recompute, more bytes left for the mechanisms,
`_relaxed`); the flops descent's and the joint ILP's plans (`candidates`). `complete`
completes each with the greedy mechanisms (`joint.assign_greedy`), searches around the
best (`joint_search`), completes the most promising with the exact mechanisms where
highspy is installed, adds the exact joint chain program's plan on chains, and returns
the fastest plan that fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tapegrad.core.residual_policy import resolve_prefetch
from tapegrad.core.tape import Tape
from tapegrad.planner import candidates as C
from tapegrad.planner import joint
from tapegrad.planner.cost import default_costs, prefetch_depth
from tapegrad.planner.ilp import joint as ilp_joint
from tapegrad.planner.joint_search import (
    _fact,
    _facts_of,
    descend,
    descend_exact,
    greedy,
    windows,
)
from tapegrad.planner.problem import BudgetError, _to_canonical
from tapegrad.planner.save_recompute import _descend_flops, _save_recompute
from tapegrad.planner.scorer import Scorer

__all__ = ["plan_joint", "complete"]


def plan_joint(pol: Any, tape: Tape, fixed: list, hints: list) -> tuple[tuple, dict]:
    """Save/recompute plans at the budget and at relaxed ones (less recompute, more
    bytes left for offload/compress to remove), each completed with per-residual
    mechanisms (`joint`, or the exact `ilp` on small tapes); on a
    chain also the exact joint program (`chain_joint`: both chosen at once),
    on small tapes the plans of the joint ILP (`ilp_joint`; compared after
    the searches on tapes of up to `WIDE_RECORDS` records, else started from);
    then, on tapes up to `JOINT_RECORDS` records, a local search over save/recompute
    scored by predicted step time (`joint_search.descend`), and on tapes of 101-300
    records with highspy the joint ILP over windows of the best plan
    (`joint_search.windows`); the least
    predicted step time that fits wins."""

    costs = pol.costs if pol.costs is not None else default_costs()
    seg = costs.segment_flops()
    sc = Scorer(tape, fixed, pol.bytes, seg_flops=seg)
    hinted = sc.with_fixed("save" if h is None or h.saves else "recompute" for h in hints)
    cands, late, scored_plans = _candidates(pol, tape, fixed, hints, sc, hinted, costs, seg)
    winner, prefetch, floor = _fastest_fit(pol, tape, sc, cands, fixed, costs, late)
    if winner is None:
        raise BudgetError(
            f"no plan ({', '.join(pol.allow)}) found that keeps activation residuals "
            f"under {pol.bytes:,} bytes; the smallest peak among the plans tried is "
            f"{floor or 0:,} bytes. Raise the budget to at least that, allow more "
            "mechanisms (allow=, max_error=), or make a finer-grained program "
            "(e.g. tg.checkpoint per layer) so less must be held at once."
        )
    _, dec, _, _, tl, opts, choice = winner
    names = opts.names(choice)
    pol.last = _summary(sc, winner, names, scored_plans, prefetch)
    mech = {k: m for k, m in zip(tl.keys, names) if m != "save"}
    return dec, _to_canonical(tape, mech)


def _candidates(
    pol: Any,
    tape: Tape,
    fixed: list,
    hints: list,
    sc: Any,
    hinted: tuple,
    costs: Any,
    seg: float,
) -> tuple[list[tuple[tuple, str]], list[tuple[tuple, str]], int]:
    """The save/recompute plans to complete: (the candidates the searches start from, the
    late ones completed after them, how many plans the save/recompute searches scored)."""
    cands: list[tuple[tuple, str]] = [(hinted, "hints")]
    # Candidates completed and compared after the searches, not started from: the
    # descents are sensitive to their starts, and one more start moved them to
    # worse plans as often as to better ones (`bench/RESULTS.md`, session 13).
    late: list[tuple[tuple, str]] = []
    scored_plans = 0  # plans simulated by the save/recompute searches, and below

    def descend_flops(sr: Any, family: str) -> None:
        """`_descend_flops` on the search ``sr`` (on tapes it runs on), its plan a
        late candidate (`complete` skips one already among the candidates)."""
        nonlocal scored_plans
        if C.REPAIR_FLOPS and sr.n <= C.JOINT_RECORDS:
            searched = sr.scores
            _descend_flops(sr)
            scored_plans += sr.scores - searched
            if sr.best is not None:
                late.append((sr.best[2], family))

    if "recompute" not in pol.allow:
        return cands, late, scored_plans
    save_peak = sc.score(hinted)[0]
    if pol.bytes < save_peak:
        # One save/recompute search at the budget (at its floor when nothing
        # fits); the (peak, flops) Pareto front of every plan it scored gives
        # the relaxed candidates: less recompute, more bytes left to move.
        sr, best = _save_recompute(tape, fixed, hints, pol.bytes, seg_flops=seg)
        scored_plans += sr.scores
        if best is None and sr.floor is not None:
            floor_peak = sr.floor  # (the descent below may lower it)
            # Nothing it scored fits without mechanisms: a descent by flops
            # repairing its least-peak plan may find one that does (one more
            # candidate; the search goes on at the floor as before).
            descend_flops(sr, "repaired by flops")
            sr, best = _save_recompute(tape, fixed, hints, floor_peak, seg_flops=seg)
            scored_plans += sr.scores
        if best is not None:
            cands.append((best[2], best[3]))
            cands += [(d, "relaxed") for d in _relaxed(sr, best[1], save_peak)]
            # and the flops descent's plan: it crosses plans over the budget,
            # which the searches by step time do not
            descend_flops(sr, "flops descent")
        # The joint ILP's plans. On tapes of up to `WIDE_RECORDS` records the
        # searches reach local optima from their own starts, and started from,
        # an ILP plan held the kicks in its basin (a 69-record DAG at 55%: 1.797
        # µs with it, 1.505 without): compared after the searches there. On
        # larger tapes the searches stop at their work limits and an ILP plan
        # is the best start they have (`bench/RESULTS.md`, session 16).
        ilp_plans = C._joint_ilp_candidate(tape, fixed, pol, costs)
        if len(tape.records) <= ilp_joint.WIDE_RECORDS:
            late += ilp_plans
        else:
            cands += ilp_plans
    return cands, late, scored_plans


def _fastest_fit(
    pol: Any, tape: Tape, sc: Any, cands: list, fixed: list, costs: Any, late: list
) -> tuple[Any, int, int | None]:
    """(the fastest completed plan that fits or None, its prefetch depth, the least peak
    any candidate reaches)."""
    floor = None
    # Plan with copies brought back one record ahead (at first use where nothing fits
    # so), then bring them back as early as the cost model asks (`cost.prefetch_depth`)
    # where the plan still fits: the model charges a copy's full time at any depth, so
    # in it deeper prefetch only holds memory longer; on a device it hides the copies.
    if "offload" in pol.mechanisms:
        depths: tuple[int, ...] = (1, 0)
    else:
        depths = (resolve_prefetch(pol, tape),)
    for prefetch in depths:
        winner, least = complete(pol, tape, sc, cands, fixed, prefetch, costs, late)
        if least is not None:
            floor = least if floor is None else min(floor, least)
        if winner is not None:
            break
    if winner is not None and "offload" in pol.mechanisms and prefetch == 1:
        (total, _), dec, family, how, _, opts, choice = winner
        for k in range(prefetch_depth(tape, costs), 1, -1):
            tl = sc.timeline(dec, k)
            peak = joint.evaluate(tl, opts, choice)[0]
            if peak <= pol.bytes:
                winner, prefetch = ((total, peak), dec, family, how, tl, opts, choice), k
                break
    return winner, prefetch, floor


def _summary(sc: Any, winner: Any, names: list, scored_plans: int, prefetch: int) -> dict:
    """`Budget.last` for the plan ``winner`` (``names``: its residuals' mechanisms)."""
    (total, peak), dec, family, how, tl, opts, choice = winner
    counts = {m: names.count(m) for m in joint.COLUMNS if m in names}
    r = np.arange(len(tl.keys))
    nseg = len(sc.index.segments(dec))
    return {
        "peak_bytes": peak,
        "recompute_flops": tl.recompute_flops - nseg * sc.index.seg_flops,
        "recompute_segments": nseg,
        "plan": f"{family} + {how} mechanisms"
        if len(counts) > 1 or "save" not in counts
        else family,
        "time_s": total,
        "mechanisms": counts,
        "residuals": {
            k: (names[i], int(tl.full[i]), float(opts.seconds[i, choice[i]]))
            for i, k in enumerate(tl.keys)
        },
        "stored_bytes": int(opts.stored[r, choice].sum()),
        "plans_scored": scored_plans + sc.scores,
        "prefetch": prefetch,
        # Predicted device bytes of activations at each point of the schedule.
        "timeline": tuple(
            zip(
                tl.labels,
                joint.live_bytes(tl, opts.stored[r, choice], opts.copied[r, choice]).tolist(),
            )
        ),
    }


def complete(
    pol: Any,
    tape: Tape,
    sc: Any,
    cands: list,
    fixed: list,
    prefetch: int,
    costs: Any,
    late: Sequence = (),
) -> tuple[Any, int | None]:
    """Complete each save/recompute candidate with per-residual mechanisms (greedy,
    the exact ILP on the most promising): (the fastest plan that fits or None,
    the least peak any candidate can reach). ``late``: candidates completed (and
    with the exact ILP) after the searches, which neither see nor start from them."""
    floor = None
    ilp = C._ilp_solver(tape)
    scored: list[list[Any]] = []
    seen: set[tuple] = set()
    # What depends on a plan's timeline only (this call fixes the budget, mechanisms
    # and costs), by the timeline's id; each entry holds its timeline, so the id is
    # never reused while it is there. Many plans share one timeline
    # (`TapeIndex.timeline`: ~40 plans each on a 40-record DAG). Keys, each computed
    # on first use (`_fact`): "opts" (kept where a completion needs them), "greedy"
    # (`greedy`'s choice and seconds), "least" (`least_seconds`), "over" (fewest
    # bytes over the budget), "exact" (HiGHS's choice).
    facts: dict[int, dict[str, Any]] = {}

    def completed(dec: tuple, family: str) -> list[Any]:
        """``dec`` completed with the greedy mechanisms, as a row of ``scored``."""
        nonlocal floor
        tl = sc.timeline(dec, prefetch)
        rec_s = costs.recompute_s(tl.recompute_flops)
        opts, choice, total = greedy(pol, tl, rec_s, costs, facts=facts)
        least = joint.least_bytes(tl, opts)
        floor = least if floor is None else min(floor, least)
        return [total, rec_s, dec, family, "greedy", tl, opts, choice]

    def exactly(c: list[Any]) -> None:
        """Row ``c`` with the exact mechanisms (``ilp``) where they are faster."""
        _, rec_s, _, _, _, tl, opts, _ = c
        exact = _fact(_facts_of(facts, tl), "exact", lambda: ilp(tl, opts, pol.bytes))
        if exact is not None:
            t = rec_s + joint.evaluate(tl, opts, exact)[1]
            if c[0] is None or t < c[0]:
                c[0], c[4], c[7] = t, "ILP", exact

    for dec, family in cands:
        if dec not in seen:
            seen.add(dec)
            scored.append(completed(dec, family))
    searched = len(scored)
    scored += descend(pol, tape, sc, scored, prefetch, costs, facts)
    if ilp is not None:  # (HiGHS installed, and a tape it solves the mechanisms of)

        def completed_exactly(dec: tuple, family: str) -> list[Any]:
            c = completed(dec, family)
            exactly(c)
            return c

        scored += windows(pol, tape, fixed, scored, prefetch, costs, completed_exactly)

        # The exact mechanisms for the most promising plans (greedy's best two, and
        # plans greedy could not fit while they can).
        def rank(c: list) -> tuple[bool, float]:
            return (c[0] is None, c[0] or 0.0)

        order = sorted(scored, key=rank)
        extra = [c for c in order[2:] if c[0] is None][:2]
        # and the best two candidates from before the joint search: greedy's ranking
        # is not the exact one, and its plans alone could push them out
        extra += [
            c
            for c in sorted(scored[:searched], key=rank)[:2]
            if all(c is not e for e in order[:2] + extra)
        ]
        # and the joint ILP's plan, so its exact completion is always tried
        mine = [c for c in order[2:] if c[3] == "joint ILP"]
        extra += [c for c in mine if all(c is not e for e in extra)]
        for c in order[:2] + extra:
            exactly(c)
        scored += descend_exact(pol, tape, sc, scored, prefetch, costs, ilp, facts)
    # On a chain: the exact joint program (save/recompute and mechanisms together).
    scored += C._chain_joint(tape, sc, fixed, pol, costs, scored, prefetch)
    for dec, family in late:
        if dec not in seen:
            seen.add(dec)
            c = completed(dec, family)
            if ilp is not None:
                exactly(c)
            scored.append(c)
    winner = None
    for total, _, dec, family, how, tl, opts, choice in scored:
        if choice is None:
            continue
        peak = joint.evaluate(tl, opts, choice)[0]
        if winner is None or (total, peak) < winner[0]:
            winner = ((total, peak), dec, family, how, tl, opts, choice)
    return winner, floor


def _relaxed(sc: Any, lo: int, hi: int) -> list[tuple]:
    """Up to `_RELAXED` plans from the (peak, flops) Pareto front of what ``sc`` scored,
    peaks spread between ``lo`` (the plan at the budget) and ``hi`` (save-all)."""
    front: list[tuple[int, float, tuple]] = []
    for dec, (peak, flops) in sorted(sc._seen.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        if lo < peak < hi and (not front or flops < front[-1][1]):
            front.append((peak, flops, dec))
    if len(front) <= C._RELAXED:
        return [d for _, _, d in front]
    picks = np.linspace(0, len(front) - 1, C._RELAXED).round().astype(int)
    return [front[i][2] for i in sorted(set(picks.tolist()))]
