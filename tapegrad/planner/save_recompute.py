"""The save/recompute search at a budget: the exact chain program on chains, the same
program over layers (`stages`) elsewhere, the candidate families (`families`: the
hand-written policies' plans, cut plans, ratio plans, a greedy descent, refinement),
every plan scored by the executor's own schedule (`scorer.Scorer`); then, for plain
budgets (plans scored by flops), the joint ILP's plans and a descent by flops
(`_descend_flops`: the iterated search of `search`, scored by recompute flops, and
its oscillation across plans over the budget). The joint planner starts from these
plans and completes them with per-residual mechanisms (`joint_plan`).
"""

from __future__ import annotations

from typing import Any

from tapegrad.core.tape import Tape
from tapegrad.planner import candidates as C
from tapegrad.planner import families, search
from tapegrad.planner.chain import Chain, as_chain, chain_plan
from tapegrad.planner.scorer import CLASSES, Scorer
from tapegrad.planner.stages import stage_plan

__all__ = ["_save_recompute", "_class_starts", "_descend_flops"]


def _save_recompute(
    tape: Tape,
    fixed: list,
    hints: list,
    budget: int,
    more: Any = None,
    seg_flops: float = 0.0,
    least: bool = False,
) -> tuple[Any, Any]:
    """The save/recompute search at ``budget``: (scorer, best) with best = (flops, peak,
    decisions, family) or None when nothing fits (``scorer.floor``: the least peak seen).
    ``more()``, given by plain budgets (save/recompute, scored by flops), is called when
    the hints do not fit: more plans to score (decisions, family), then a descent by
    flops from the best (`_descend_flops`). ``seg_flops``: each recomputed segment's
    fixed cost (`CostModel.segment_flops`). The joint planner gives none: its own
    descent scores by step time, and a flops descent here only moved its starts
    (worse on 6 of 39 `bench/ilp_bench.py` cells compared, better on 2). ``least``:
    where nothing fits on a chain, find the least peak of any plan (`_least_on_chain`)
    for the error to name."""
    sc = Scorer(tape, fixed, budget, seg_flops=seg_flops)
    hinted = sc.with_fixed("save" if h is None or h.saves else "recompute" for h in hints)
    if sc.fits(hinted, "hints"):
        return sc, sc.best
    # The exact chain program's fronts grow with the chain (a 662-record MLP chain took
    # ~25 s); longer chains get the bounded searches below, like any tape.
    ch = as_chain(tape) if len(tape.records) <= C.CHAIN_DP_RECORDS else None
    if ch is not None:
        chain_dec = chain_plan(ch, fixed, budget)
        if chain_dec is not None:
            sc.score(chain_dec, "chain DP")
        elif least and len(tape.records) <= C.CHAIN_LEAST_RECORDS:
            _least_on_chain(sc, ch, fixed, budget)
    else:
        # (its own bound, ~133,000 record-simulations, on tapes the limit does not bind)
        small = sc.limit >= C.SMALL_SEARCH
        stage_dec = stage_plan(sc, share=None if small else sc.left() // 5)
        if stage_dec is not None:
            sc.score(stage_dec, "stage DP")
    # On big tapes the scorer's work limit (`search.WORK`) bounds the search:
    # the families below share what is left, refinement takes the rest.
    families.class_plans(sc)
    families.ratio_plans(sc)
    families.cut_plans(sc, share=sc.left() * 2 // 3)
    if ch is None:  # on a chain the program is already optimal
        families.descend(sc)
    families.refine(sc)
    if more is not None:
        for dec, family in more():
            sc.score(dec, family)
        if ch is None and sc.n <= C.JOINT_RECORDS:
            _descend_flops(sc)
    return sc, sc.best


def _least_on_chain(sc: Scorer, ch: Chain, fixed: list, budget: int) -> None:
    """No plan fits: score the chain program's plans at budgets bisected between
    ``budget`` and the least peak seen, so that the scorer's floor, which the
    BudgetError names, is the least peak of any plan."""
    assert sc.floor is not None  # the hinted plan is scored first
    lo, hi = budget, sc.floor
    while hi - lo > 1:
        mid = (lo + hi) // 2
        dec = chain_plan(ch, fixed, mid)
        if dec is None:
            lo = mid
        else:
            hi = min(mid, sc.score(dec, "chain DP, least peak")[0])


def _class_starts(sc: Any) -> list[tuple[tuple[str, ...], str]]:
    """The plans of `JOINT_CLASSES` (binding decisions applied), by name: where the
    descents start besides the best plan found."""
    return [
        (sc.with_fixed("save" if keep(r) else "recompute" for r in sc.tape.records), name)
        for name, keep in CLASSES.items()
        if name in C.JOINT_CLASSES
    ]


def _descend_flops(sc: Any) -> None:
    """`search.iterate_joint` scored by recompute flops (bytes over the budget
    where a plan does not fit): descents from the best plan found (else the least peak
    seen, which they repair) and from the hand-written plans of `JOINT_CLASSES`,
    sharing `FLOPS_WORK` record-evaluations, then kicks for `FLOPS_KICK_WORK` more
    (at spread positions: never worse, up to 25% fewer flops on 8 of 24 DAG cells tried,
    ~0.1 s more), then descents that cross plans over the budget at a penalty per byte
    (`search.oscillate`, `OSCILLATE_WORK`; the penalty's scale is the best
    plan's flops per byte it keeps off the device). The searches above move one
    record at a time along one path each; on DAGs they stop far from plans this finds
    (or find none that fit where one does). Every plan it scores updates ``sc.best``."""

    def cost(dec: tuple, beat: Any) -> tuple[int, float]:
        peak, flops = sc.score(dec, "descent")
        return (0, flops) if peak <= sc.budget else (1, float(peak - sc.budget))

    starts = [sc.best[2] if sc.best is not None else sc.floor_plan]
    starts += [dec for dec, _ in _class_starts(sc)]
    n = max(sc.n, 1)
    search.iterate_joint(
        sc, [s for s in starts if s is not None], cost, C.FLOPS_WORK // n, C.FLOPS_KICK_WORK // n
    )
    if C.OSCILLATE_WORK > 0 and sc.best is not None:

        def penalized(d: tuple, lam: float) -> float:
            peak, flops = sc.score(d, "descent")
            return flops + lam * max(peak - sc.budget, 0)

        rate = sc.best[0] / max(sc.score(sc.with_fixed(["save"] * sc.n))[0] - sc.budget, 1)
        search.oscillate(sc, sc.best[2], cost, penalized, rate, C.OSCILLATE_WORK // n)
