"""The joint planner's searches around its completed candidates (`joint_plan.complete`
calls them in turn), each scoring save/recompute plans by their predicted step time
(recompute, plus the per-residual mechanisms that complete them):

* `descend`: the iterated local search (`search.iterate_joint`) from the fastest
  candidates and the hand-written policies' plans, each plan completed with the
  greedy mechanisms (`greedy`);
* `windows`: on tapes of 101-300 records with highspy, the joint ILP over windows of
  consecutive records of the best plan (`ilp_joint.plan_candidate`);
* `descend_exact`: on small tapes with highspy, a descent whose plans are completed
  with the exact mechanisms (`ilp.solve`).

Their work limits are `candidates`' (`JOINT_WORK`, ...), read when they run. ``pol``
is the `Budget` planning (its byte budget, allowed mechanisms).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tapegrad.core.tape import Tape
from tapegrad.planner import candidates as C
from tapegrad.planner import chain_joint, joint, search
from tapegrad.planner.candidates import _no_lowbit
from tapegrad.planner.cost import record_flops
from tapegrad.planner.ilp import joint as ilp_joint
from tapegrad.planner.save_recompute import _class_starts

__all__ = ["greedy", "descend", "windows", "descend_exact"]


def _fact(facts: dict[str, Any], name: str, compute: Callable[[], Any]) -> Any:
    """``facts[name]``, computed on first use."""
    if name not in facts:
        facts[name] = compute()
    return facts[name]


def _facts_of(facts: dict[int, dict[str, Any]] | None, tl: Any) -> dict[str, Any]:
    """``tl``'s entry in a per-timeline memo (a fresh one where there is no memo)."""
    if facts is None:
        return {"tl": tl}
    return facts.setdefault(id(tl), {"tl": tl})


def greedy(
    pol: Any,
    tl: Any,
    rec_s: float,
    costs: Any,
    rows: dict | None = None,
    facts: dict[int, dict[str, Any]] | None = None,
    opts: Any = None,
) -> tuple[Any, Any, float | None]:
    """A plan's timeline completed with the greedy mechanisms: (the options, the
    choice or None where nothing fits the budget, the predicted step time or None).
    ``facts`` (optional): `joint_plan.complete`'s per-timeline memo, where the options and
    the completion are kept. ``opts``: the options, where the caller has them."""
    f = _facts_of(facts, tl)
    if "greedy" not in f:
        if "opts" not in f:
            f["opts"] = opts if opts is not None else joint.options(tl, pol.mechanisms, costs, rows)
        choice = joint.assign_greedy(tl, f["opts"], pol.bytes)
        secs = joint.evaluate(tl, f["opts"], choice)[1] if choice is not None else None
        f["greedy"] = (choice, secs)
    choice, secs = f["greedy"]
    return f["opts"], choice, (rec_s + secs if secs is not None else None)


def descend(
    pol: Any,
    tape: Tape,
    sc: Any,
    scored: list,
    prefetch: int,
    costs: Any,
    facts: dict[int, dict[str, Any]] | None = None,
) -> list[list[Any]]:
    """`search.iterate_joint`: descents from the fastest completed
    candidate, from the hand-written policies' plans (`scorer.CLASSES`;
    repaired first where they do not fit), then from the second fastest, sharing
    `JOINT_WORK` record-evaluations, then kicks from the best plan found for
    `JOINT_KICK_WORK` more, aimed first at the records where that plan spends its
    time (`_hot_records`); when some candidate fits, and not on tapes over
    `JOINT_RECORDS` records nor on the chains `chain_joint` plans exactly.
    Returns the plans it improves, scored like the others."""
    n = len(tape.records)
    if "recompute" not in pol.allow or n > C.JOINT_RECORDS:
        return []
    if n <= chain_joint.MAX_RECORDS and chain_joint.joint_chain(tape, prefetch) is not None:
        return []
    left = C.JOINT_WORK // max(n, 1)
    facts = {} if facts is None else facts
    complete = _greedy_completion(pol, sc, prefetch, costs, facts)
    fitting = sorted((c for c in scored if c[0] is not None), key=lambda c: c[0])
    if not fitting:
        # Nothing to improve on: `joint_plan.plan_joint` tries prefetch 0 next, or gives up.
        # (Repairing from the class plans instead spent ~2 s CPU below the floor of
        # the bench's 69-record DAG, and fitted nothing.)
        return []
    starts = [(c[2], c[3]) for c in fitting[:1]]
    starts += _class_starts(sc)
    starts += [(c[2], c[3]) for c in fitting[1:2]]
    best = fitting[0][0]
    out: list[list[Any]] = []
    kick = C.JOINT_KICK_WORK // max(n, 1)
    found, _ = search.iterate_joint(
        sc,
        [s for s, _ in starts],
        lambda d, beat: complete(d, beat)[0],
        left,
        kick,
        _hot_records(tape, sc, costs, complete),
        C.SWAP_WORK // max(n, 1),
        C.ANNEAL_WORK // max(n, 1),
    )
    for k, dec, (over, total) in found:
        if over == 0 and total < best * (1 - 1e-9):
            best = total
            _, rec_s, tl, opts, choice = complete(dec)
            family = starts[k][1] + "+joint descent"
            out.append([total, rec_s, dec, family, "greedy", tl, opts, choice])
    return out


def _greedy_completion(
    pol: Any, sc: Any, prefetch: int, costs: Any, facts: dict[int, dict[str, Any]]
) -> Callable[..., Any]:
    """`descend`'s scoring of a plan, memoized: ``complete(dec, beat)`` is (its key for
    the search, recompute seconds, timeline, options, greedy choice), or only the key
    where a bound shows it cannot beat ``beat``."""
    memo: dict[tuple, Any] = {}
    rows: dict[tuple, Any] = {}  # `joint.options`' rows, by residual key

    def complete(dec: tuple, beat: tuple[int, float] | None = None) -> Any:
        got = memo.get(dec)
        if got is None:
            tl = sc.timeline(dec, prefetch)
            rec_s = costs.recompute_s(tl.recompute_flops)
            opts = None
            if beat is not None and beat[0] == 0:
                if rec_s >= beat[1]:
                    return ((0, rec_s),)  # recompute alone costs more: no mechanisms
                # The bound only, not the options under it (unless kept already):
                # kept for every timeline met, they added ~6% to the peak memory of
                # planning a 230-record U-Net.
                f = _facts_of(facts, tl)
                if "least" not in f:
                    opts = f.get("opts")
                    if opts is None:
                        opts = joint.options(tl, pol.mechanisms, costs, rows)
                    f["least"] = joint.least_seconds(tl, opts, pol.bytes)
                least = rec_s + f["least"]
                if least >= beat[1]:
                    # no mechanisms can make it faster (over half the plans a
                    # descent tries on the bench's 230-256-record tapes). Met again
                    # under a higher bar, such a plan is completed then, and that
                    # counts as an evaluation: the search's course can differ from
                    # completing every plan (2 of the bench's 60 cells, <= 0.07%).
                    return ((0, least),)
            opts, choice, total = greedy(pol, tl, rec_s, costs, rows, facts, opts)
            if total is None:
                key = (1, float(joint.least_bytes(tl, opts) - pol.bytes))
            else:
                key = (0, total)
            got = memo[dec] = (key, rec_s, tl, opts, choice)
        return got

    return complete


def _hot_records(
    tape: Tape, sc: Any, costs: Any, complete: Callable[..., Any]
) -> Callable[[tuple], list[int]]:
    """`descend`'s aim for its kicks: ``hot(dec)``, the records where plan ``dec`` spends
    time, costliest first."""
    producer = {o.id: r.index for r in tape.records for o in r.outputs}

    def hot(dec: tuple) -> list[int]:
        """Records where ``dec`` spends time, costliest first: those whose outputs the
        greedy mechanisms move or compress, and those backward re-runs."""
        _, _, tl, opts, choice = complete(dec)
        spend: dict[int, float] = {}
        if choice is None:
            return []
        for k, key in enumerate(tl.keys):
            i = key[1] if isinstance(key, tuple) else producer.get(key)
            secs = float(opts.seconds[k, choice[k]])
            if i is not None and secs > 0:
                spend[i] = spend.get(i, 0.0) + secs
        for seg in sc.planned(dec).segments:
            for i in seg.records:
                secs = costs.recompute_s(record_flops(tape.records[i]))
                spend[i] = spend.get(i, 0.0) + secs
        return sorted(spend, key=lambda i: (-spend[i], i))

    return hot


def windows(
    pol: Any,
    tape: Tape,
    fixed: list,
    scored: list,
    prefetch: int,
    costs: Any,
    complete: Callable[[tuple, str], list[Any]],
) -> list[list[Any]]:
    """A large-neighbourhood search with the joint ILP: from the fastest plan so
    far, `ilp_joint.plan_candidate` re-plans `WINDOW_RECORDS` consecutive
    records with every other record held at that plan's decision, the window
    sliding by `WINDOW_STEP`; each plan it decodes is completed (``complete``: the
    greedy mechanisms, then the exact ones) and becomes the plan to beat where it
    is faster; up to `WINDOW_ROUNDS` passes, until one improves nothing. Where
    `joint_plan.complete` has the exact mechanisms (highspy installed), on tapes over
    `ilp_joint.WIDE_RECORDS` records (below, the whole ILP's plans are
    compared already) up to its `MAX_RECORDS`. The whole ILP is out of HiGHS's
    reach there, a window's is not (0.1-1 s without run variables), and it moves
    dozens of records at once where the searches' moves are one to six: on the
    bench's 256-record DAG at 70% of save()'s peak, 1.356 -> 1.142 predicted µs
    (the best plan known before, from an offline search: 1.144).
    Returns the plans that beat the fastest, scored like the others."""
    n = len(tape.records)
    if "recompute" not in pol.allow or not ilp_joint.WIDE_RECORDS < n <= ilp_joint.MAX_RECORDS:
        return []
    if C.WINDOW_ROUNDS <= 0:
        return []
    fitting = [c for c in scored if c[0] is not None]
    if not fitting:
        return []
    start = min(fitting, key=lambda c: c[0])
    best = complete(start[2], start[3])
    if best[0] is None:
        return []
    family = start[3]
    mechs = _no_lowbit(pol.mechanisms)
    tried = {best[2]}
    out: list[list[Any]] = []
    for _ in range(C.WINDOW_ROUNDS):
        improved = False
        for a in range(0, max(n - C.WINDOW_RECORDS, 0) + C.WINDOW_STEP, C.WINDOW_STEP):
            held = [
                f if f is not None or a <= i < a + C.WINDOW_RECORDS else d
                for i, (f, d) in enumerate(zip(fixed, best[2]))
            ]
            # the model without run variables: windows of 80 records at window 0
            # beat windows of 20-60 at window 4 or 8 on the bench's large tapes,
            # at a fifth of the CPU (`bench/RESULTS.md`, session 23)
            dec = ilp_joint.plan_candidate(tape, held, pol.bytes, mechs, costs, prefetch, window=0)
            if dec is None or dec in tried:
                continue
            tried.add(dec)
            c = complete(dec, family + "+ILP windows")
            if c[0] is not None and c[0] < best[0] * (1 - 1e-9):
                best, improved = c, True
                out.append(c)
        if not improved:
            break
    return out


def descend_exact(
    pol: Any,
    tape: Tape,
    sc: Any,
    scored: list,
    prefetch: int,
    costs: Any,
    ilp: Any,
    facts: dict[int, dict[str, Any]] | None = None,
) -> list[list[Any]]:
    """A descent (`search.descend_joint`) from the fastest plan so far,
    each plan completed with the exact mechanisms (``ilp``, `ilp.solve`)
    instead of the greedy ones, for `EXACT_WORK` record-evaluations; where
    `descend` runs, on tapes of up to `EXACT_RECORDS` records. `descend` ranks
    plans by their greedy completion, which can be above the exact one (up to
    1.29x on the bench's timelines, 64x before `assign_greedy`'s capped score and
    exchanges): it cannot see plans whose mechanisms only the exact program packs
    well; single flips from its winner scored exactly reach them (with the old
    greedy, 3.482 -> 3.067 µs on a 46-record transformer block at 46% of save()'s
    peak; the new greedy's descent reaches that plan itself). Returns the plan when
    it beats the fastest, scored like the others."""
    n = len(tape.records)
    if "recompute" not in pol.allow or n > C.EXACT_RECORDS or C.EXACT_WORK <= 0:
        return []
    if n <= chain_joint.MAX_RECORDS and chain_joint.joint_chain(tape, prefetch) is not None:
        return []
    fitting = [c for c in scored if c[0] is not None]
    if not fitting:
        return []
    start = min(fitting, key=lambda c: c[0])
    memo: dict[tuple, Any] = {}
    facts = {} if facts is None else facts  # `joint_plan.complete`'s, by timeline

    def complete(dec: tuple, beat: tuple[int, float] | None = None) -> Any:
        got = memo.get(dec)
        if got is not None:
            return got
        tl = sc.timeline(dec, prefetch)
        rec_s = costs.recompute_s(tl.recompute_flops)
        f = _facts_of(facts, tl)
        opts = _fact(f, "opts", lambda: joint.options(tl, pol.mechanisms, costs))
        over = _fact(f, "over", lambda: joint.least_bytes(tl, opts) - pol.bytes)
        if over > 0:
            got = ((1, float(over)), rec_s, tl, opts, None)
        elif beat is not None and beat[0] == 0 and rec_s >= beat[1]:
            return ((0, rec_s), rec_s, tl, opts, None)  # not stored: a bound only
        elif (
            beat is not None
            and beat[0] == 0
            and (
                least := rec_s + _fact(f, "least", lambda: joint.least_seconds(tl, opts, pol.bytes))
            )
            >= beat[1]
        ):
            return ((0, least), rec_s, tl, opts, None)  # likewise
        else:
            choice = _fact(f, "exact", lambda: ilp(tl, opts, pol.bytes))
            if choice is None:  # HiGHS found none within its work limit
                got = ((1, 0.0), rec_s, tl, opts, None)
            else:
                got = (
                    (0, rec_s + joint.evaluate(tl, opts, choice)[1]),
                    rec_s,
                    tl,
                    opts,
                    choice,
                )
        memo[dec] = got
        return got

    memo[start[2]] = ((0, start[0]), start[1], start[5], start[6], start[7])
    dec, (over, total), _ = search.descend_joint(
        sc, start[2], lambda d, beat: complete(d, beat)[0], C.EXACT_WORK // max(n, 1)
    )
    if over != 0 or total >= start[0] * (1 - 1e-9):
        return []
    _, rec_s, tl, opts, choice = complete(dec)
    return [[total, rec_s, dec, start[3] + "+exact descent", "ILP", tl, opts, choice]]
