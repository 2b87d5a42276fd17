"""Where the planner's candidate plans come from, and how much work each stage may
spend: the work limits of the searches (`JOINT_WORK`, `JOINT_KICK_WORK`, `SWAP_WORK`,
`ANNEAL_WORK`, `EXACT_WORK`, `WINDOW_ROUNDS`, `FLOPS_WORK`, ...) and the tape sizes
each stage runs on (`JOINT_RECORDS`, `CHAIN_DP_RECORDS`, ...), in one module so that
a benchmark or a test sets them in one place (``bench/ilp_bench.py --set NAME=VALUE``);
and the candidates of the exact programs (`_chain_joint`: the joint chain program;
`_ilp_solver`: the exact mechanisms; `_joint_ilp_candidate`: the joint ILP's plans),
which a benchmark replaces to plan without them. The planner reads every name here
as ``candidates.NAME`` when it runs, so a value set here takes effect.
"""

from __future__ import annotations

import math
from typing import Any

from tapegrad.core.residual_policy import resolve_prefetch
from tapegrad.core.tape import Tape
from tapegrad.planner import chain_joint
from tapegrad.planner.cost import LOWBIT
from tapegrad.planner.ilp import joint as ilp_joint
from tapegrad.planner.ilp import mechanisms as ilp

__all__ = [
    "JOINT_WORK",
    "JOINT_RECORDS",
    "JOINT_KICK_WORK",
    "SWAP_WORK",
    "ANNEAL_WORK",
    "EXACT_WORK",
    "EXACT_RECORDS",
    "WINDOW_RECORDS",
    "WINDOW_STEP",
    "WINDOW_ROUNDS",
    "FLOPS_WORK",
    "FLOPS_KICK_WORK",
    "OSCILLATE_WORK",
    "REPAIR_FLOPS",
    "JOINT_CLASSES",
    "SMALL_SEARCH",
    "CHAIN_DP_RECORDS",
    "CHAIN_LEAST_RECORDS",
]

# The joint descent (`joint_search.descend`): record-evaluations it may spend (one
# evaluation of an n-record plan, timeline and greedy mechanisms, costs n; 1.5-4.5 µs
# per record on a busy 2-core CPU, least where `least_seconds` spares the mechanisms), on
# tapes of up to how many records; then as many again for the kicks of the iterated
# search (`search.iterate_joint`). On tapes of 150-270 records the descents
# stop at this limit, not at a local optimum: 240,000 (session 16; was 80,000) gave
# faster plans on 18 of `bench/ilp_bench.py`'s 60 cells without highspy and 14 with
# it; 480,000 (session 17, once evaluations cost less) on 14 more without and 9 with
# (up to -24%), none slower (`bench/RESULTS.md`).
JOINT_WORK = 480_000
JOINT_RECORDS = 320
JOINT_KICK_WORK = 480_000
# ... and then for edge swaps (`search.swap_edges`), each repaired by a descent
# over the whole tape: kicks that move where a segment is cut. Session 19 (`bench/
# RESULTS.md`): 8 of the 60 cells faster without highspy, 6 with it, none slower (DAG 149
# at 52%: 1.766 -> 1.737 µs, the optimum is 1.658), ~25% more planning CPU on tapes over
# ~100 records; at 240,000 that cell got 1.756.
SWAP_WORK = 480_000
# ... and then for annealing from the best plan (`search.anneal_joint`): random
# moves of one to six records, uphill ones taken at a falling temperature.
ANNEAL_WORK = 480_000
# The exact-mechanism descent (`joint_search.descend_exact`, with highspy):
# record-evaluations, each an exact mechanism program (~2-30 ms on 46-90 records), on
# tapes of up to `EXACT_RECORDS` records: above, its share is a few dozen plans, not one
# sweep, and the joint descent's wider search finds more in that time.
EXACT_WORK = 9_000
EXACT_RECORDS = 100
# The joint ILP's window search (`joint_search.windows`, with highspy, tapes of 101-300
# records): records per window, the slide, and passes at most.
WINDOW_RECORDS = 80
WINDOW_STEP = 40
WINDOW_ROUNDS = 2
# The flops descent (`save_recompute._descend_flops`): record-evaluations for its
# descents and its kicks (kept at 80,000: more finds plans with fewer flops that are
# slower once completed with mechanisms, transformer 178 at 70% +9%), then for its
# oscillation, record-simulations, ~6 µs each (a plan of 58 records descends in ~200
# simulations per penalty).
FLOPS_WORK = 80_000
FLOPS_KICK_WORK = 80_000
OSCILLATE_WORK = 200_000
REPAIR_FLOPS = True
# The hand-written policies' plans it also starts from (a plan two sweeps of single
# flips cannot reach from the best candidate: dots kept, everything cheap recomputed).
JOINT_CLASSES = ("save_all_but_cheap", "nothing_saveable")
# A scorer allowed this many plans searches as it always did (tapes up to ~200 records).
SMALL_SEARCH = 1_000
# The longest tape the exact chain program plans (~1 s for the whole plan at ~130
# records on a 2-core CPU).
CHAIN_DP_RECORDS = 160
# The longest chain on which a budget no plan fits bisects the chain program's plans
# for the least peak the BudgetError names (one program per halving of the bytes
# between the budget and the least peak seen; 0.2 s in all on a 79-record chain).
CHAIN_LEAST_RECORDS = 80

# Relaxed budgets for the save/recompute plans the joint planner completes with
# mechanisms: the budget itself, then less recompute and more bytes left to move.
_RELAXED = 6  # how many relaxed save/recompute plans the joint planner completes


def _chain_joint(
    tape: Tape, sc: Any, fixed: list, pol: Any, costs: Any, scored: list, prefetch: int
) -> list[list[Any]]:
    """`chain_joint.candidates`: on a chain, the exact joint plan when it beats
    the candidates ``scored`` so far, scored like them (none on other tapes)."""
    if "recompute" not in pol.allow:
        fixed = [f or "save" for f in fixed]
    bound = min((c[0] for c in scored if c[0] is not None), default=math.inf)
    return chain_joint.candidates(
        tape, sc, fixed, pol.bytes, _no_lowbit(pol.mechanisms), prefetch, costs, bound
    )


def _no_lowbit(mechanisms: tuple[str, ...]) -> tuple[str, ...]:
    """``mechanisms`` less 4-bit and 2-bit, for the programs that choose recompute and
    mechanisms at once: they do not know that low-bit must not round what a recomputed
    segment reads (`joint.Timeline.exact`). Their plans are completed with
    every mechanism, low-bit included, like any other save/recompute candidate."""
    return tuple(m for m in mechanisms if m not in LOWBIT)


def _ilp_solver(tape: Tape) -> Any:
    """`ilp.solve` when highspy is importable and the tape is small enough to
    solve within its work limit (`ilp.WORK`); else None."""
    if not ilp.available() or len(tape.records) > ilp.MAX_RECORDS:
        return None
    return ilp.solve


def _joint_ilp_candidate(tape: Tape, fixed: list, pol: Any, costs: Any) -> list[tuple[tuple, str]]:
    """The save/recompute decisions of `ilp_joint`'s solutions (scored like the
    other plans) when highspy is importable and the tape is small enough; else none.
    Two models: without run variables (solved in a fraction of a second, so a plan even
    where the larger one stops at its work limit) and with them (closer to the
    executor's schedule, often a better plan: the bound's window on tapes of at most
    `ilp_joint.WIDE_RECORDS` records, which HiGHS mostly solves within the work
    limit there, `PLAN_WINDOW` above)."""
    # planned with copies one record ahead, as `joint_plan.plan_joint` plans first
    prefetch = 1 if "offload" in pol.mechanisms else resolve_prefetch(pol, tape)
    mechs = _no_lowbit(pol.mechanisms)
    out: list[tuple[tuple, str]] = []
    for window in ilp_joint.plan_windows(len(tape.records)):
        dec = ilp_joint.plan_candidate(
            tape, fixed, pol.bytes, mechs, costs, prefetch, window=window
        )
        if dec is not None and all(dec != d for d, _ in out):
            out.append((dec, "joint ILP"))
    return out
