"""The memory-budget planner: choose save or recompute per record so that the
peak of live residual bytes stays under a budget at the least recompute cost.

The planner is a tape pass. It respects binding decisions (``ALWAYS`` /
``NEVER`` from a `tg.selective` base, and the policies of `jax.checkpoint`
regions) and treats ``PREFER_*`` as hints. Peak memory and recompute cost are
estimated statically from the tape (shapes, dtypes; flops from shapes), by
replaying the same save/release/recompute schedule the interpreter follows.

Budgets count *activation* residuals: values kept for backward that are not
the function's own inputs (those are alive anyway, whatever is saved).

Search (see `Budget.plan`): keep the hints if they fit; on a chain, the exact
dynamic program of `_planner_chain`; on other tapes, the same program over
layers (`_planner_stages`); on any tape, the hand-written policies' own
decisions (dots saved, ...), cut plans in the style of Chen et al.'s sublinear
checkpointing alone and combined with them, and greedy search
(`_planner_search`). Every candidate is scored by `estimate`, the executor's
own schedule, so the choice is never worse than a candidate it tried.
Records with side effects (io_callback, any effect `passes.check_effects` rejects)
are never recomputed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np

from tapegrad._policy import resolve_prefetch
from tapegrad._tape import Record, Tape
from tapegrad.errors import TapegradError
from tapegrad.policies._cost import (
    ERROR_CLASSES,
    LOWBIT,
    MECHANISMS,
    device_nbytes,
    prefetch_depth,
)

__all__ = ["Budget", "budget", "estimate", "BudgetError", "record_flops"]


class BudgetError(TapegradError, ValueError):
    """No save/recompute plan fits the budget."""


def record_flops(rec: Record) -> float:
    """A rough cost of re-running ``rec``: 2·M·N·K for dots, output size otherwise."""
    out = sum(math.prod(o.shape) for o in rec.outputs)
    if rec.primitive == "dot_general":
        (lc, _), _ = rec.params["dimension_numbers"]
        k = math.prod(rec.inputs[0].shape[d] for d in lc) if lc else 1
        return 2.0 * out * k
    if rec.primitive == "conv_general_dilated":
        rhs = rec.inputs[1].shape
        return 2.0 * out * math.prod(rhs) / max(rhs[0], 1)
    return float(max(out, 1))


def _uses(tape: Tape) -> dict[Any, int]:
    uses: dict[Any, int] = {}
    for rec in tape.records:
        if rec.rule == "none":
            continue
        for s in rec.saves:
            key = rec.residual_key(s)
            uses[key] = uses.get(key, 0) + 1
    for seg in tape.segments:
        for v in seg.inputs:
            uses[v.id] = uses.get(v.id, 0) + 1
    return uses


def segment_flops(tape: Tape, seg: Any) -> float:
    """What backward spends recomputing one segment: each of its records once."""
    return sum(record_flops(tape.records[i]) for i in seg.records)


def segment_cost(tape: Tape, seg: Any, memo: dict) -> tuple[float, int]:
    """(flops, recomputation peak) of one segment, kept in ``memo`` by its records and
    outputs (plans scored on one tape share most of their segments)."""
    key = (seg.records, tuple(o.id for o in seg.outputs))
    got = memo.get(key)
    if got is None:
        from tapegrad._checkpoint import segment_peak

        got = memo[key] = (segment_flops(tape, seg), segment_peak(tape, seg))
    return got


def estimate(tape: Tape, memo: dict | None = None) -> tuple[int, float]:
    """(peak live activation-residual bytes, recompute flops) of a planned tape.

    ``memo`` (optional, for the planner scoring many plans of one tape) caches each
    segment's recomputation peak and flops across calls."""
    peak, flops, _ = simulate(tape, memo)
    return peak, flops


def simulate(
    tape: Tape, memo: dict | None = None, trace: dict | None = None
) -> tuple[int, float, dict[Any, int]]:
    """`estimate`'s schedule: (peak, flops, bytes of each kept residual key); with
    ``trace``, also the largest live bytes while backward runs each record (by index)."""
    memo = {} if memo is None else memo
    inputs = {v.id for v in tape.inputs} | {v.id for v, _ in tape.consts}
    kept, seg_of = tape.residual_keys()
    size = {k: (0 if (isinstance(k, int) and k in inputs) else v.nbytes) for k, v in kept.items()}
    live = sum(size.values())  # forward only adds: the peak of forward is its end
    peak = live
    remaining = _uses(tape)
    extra: dict[Any, int] = {}
    flops = 0.0
    done: set[int] = set()

    def release(key):
        nonlocal live
        remaining[key] -= 1
        if remaining[key] == 0:
            live -= size.get(key, 0) + extra.pop(key, 0)

    for rec in reversed(tape.records):
        if rec.rule == "none":
            continue
        keys = []
        for s in rec.saves:
            key = rec.residual_key(s)
            keys.append(key)
            if key in extra or key in size or key not in seg_of:
                continue
            seg = tape.segments[seg_of[key]]
            if seg.id in done:
                continue
            done.add(seg.id)
            seg_flops, seg_peak = segment_cost(tape, seg, memo)
            flops += seg_flops
            peak = max(peak, live + seg_peak)
            if trace is not None:
                trace[rec.index] = max(trace.get(rec.index, 0), live + seg_peak)
            for o in seg.outputs:
                extra[o.id] = o.nbytes
                live += extra[o.id]
            for v in seg.inputs:
                release(v.id)
        peak = max(peak, live)
        if trace is not None:
            trace[rec.index] = max(trace.get(rec.index, 0), live)
        for key in keys:
            release(key)
    return peak, flops, size


class Budget:
    """A residual policy whose tape plan keeps the activation peak under ``bytes``."""

    def __init__(
        self,
        bytes: int,
        base: Any = None,
        allow: Sequence[str] = ("save", "recompute"),
        max_error: str | None = None,
        costs: Any = None,
        key: Any = None,
    ):
        from tapegrad._policy import SAVE, is_exact

        if bytes < 0:
            raise ValueError(f"budget: bytes must be >= 0, got {bytes}")
        self.bytes = int(bytes)
        self.base = SAVE if base is None else base
        self.allow, self.max_error = _check_allow(allow, max_error)
        self.costs = costs
        self.key = key  # stochastic rounding's, for the low-bit formats
        # Per-residual mechanisms beside save/recompute: offload, and the compress
        # formats whose error class max_error admits.
        self.mechanisms = _mechanisms(self.allow, self.max_error)
        # Not a plain policy once residuals may be moved or shrunk (see _base.is_plain).
        self.packs = bool(self.mechanisms)
        # Values backward rebuilds (`_rebuild.rebuilt_records`) are part of the plan; a
        # rebuild from a compressed operand errs within the class max_error admits.
        self.exact = is_exact(self.base)
        self.last: dict[str, Any] = {}
        # Plans by tape structure: tg.grad, memory_report and jit of one function
        # trace the same tape; planning it once keeps tracing cheap. Bounded.
        self._plans: dict[tuple, tuple[list[str], dict[str, Any], dict, dict]] = {}
        # The mechanism of each residual of the tape planned last (residual key -> name).
        self._mech: dict[Any, str] = {}
        self._res_canon: dict[Any, tuple[str, int, float]] = {}
        self._impl: dict[str, Any] = {}

    @property
    def prefetch(self) -> int | str:
        """How many records ahead backward brings offloaded residuals back: the depth
        the last plan was made with (`_cost.prefetch_depth`, or less where the deeper
        copies would not fit the budget)."""
        if "offload" in self.mechanisms:
            return int(self.last.get("prefetch", 1))
        return getattr(self.base, "prefetch", 0)

    def _mechanism(self, name: str) -> Any:
        impl = self._impl.get(name)
        if impl is None:
            import jax.numpy as jnp

            from tapegrad.policies.compress import Compress
            from tapegrad.policies.offload import Offload

            impl = {
                "offload": lambda: Offload(),
                "bf16": lambda: Compress(jnp.bfloat16),
                "int8": lambda: Compress("int8"),
                "4-bit": lambda: Compress(bits=4, key=self.key),
                "2-bit": lambda: Compress(bits=2, key=self.key),
            }[name]()
            self._impl[name] = impl
        return impl

    def pack(self, value, info):
        if self.packs and not info.loops:
            mech = self._mech.get(info.record.residual_key(info.saved), "save")
            if mech != "save":
                return self._mechanism(mech).pack(value, info)
        return self.base.pack(value, info)

    def unpack(self, packed, info):
        if self.packs and not info.loops:
            mech = _packed_by(packed, info, self.base)
            if mech is not None:
                return self._mechanism(mech).unpack(packed, info)
        return self.base.unpack(packed, info)

    def loop_segment(self, rec: Record) -> Any:
        """A checkpoint schedule (`policies.loops.LoopPlan`) for a scan whose per-step
        residuals, over all its steps, do not fit the budget: among keep-every-step,
        one level every k steps, nested levels, the halving schedule and binomial
        (revolve) schedules, the one re-running the fewest forward steps whose predicted
        backward peak fits (`choose_loop_schedule`, by `_loops.schedule_costs`).
        (Loops are scheduled on their own: the tape plan does not yet trade a loop's
        bytes against the records around it.)"""
        from tapegrad.policies.loops import LoopPlan, choose_loop_schedule

        if rec.primitive != "scan" or rec.trip_count < 4:
            return LoopPlan()
        return choose_loop_schedule(rec, self.bytes)

    def plan(
        self, tape: Tape, fixed: Sequence[str | None], rebuilt: AbstractSet[int] = frozenset()
    ) -> list[str]:
        """Decisions for every record; ``fixed[i]`` is a binding decision or None;
        ``rebuilt``: records backward can rebuild from operands kept anyway
        (`_rebuild.rebuilt_records`), hinted "recompute" where free.

        1. Records with side effects are kept ("save"): recomputing them would run
           the effect again (`passes.check_effects` would reject the plan).
        2. If the hints (PREFER_x means x; unannotated means save) fit, keep them.
        3. Otherwise score candidates with `estimate` (the executor's schedule) and
           keep the fitting one with the least recompute flops: the exact chain
           program when the tape is a chain (`_planner_chain`), else the same
           program over layers (`_planner_stages`); the hand-written policies'
           decisions, cut plans alone and combined with them, ratio plans, a greedy
           descent on small tapes, then a greedy refinement of the best
           (`_planner_search`).
        ``self.last`` says what was chosen: peak bytes, flops, the winning family.
        """
        from tapegrad._checkpoint import CheckpointPolicy as P
        from tapegrad.policies import _planner_joint as joint
        from tapegrad.policies import _planner_search as search

        fixed = _keep_effects(tape, fixed)
        choose = getattr(self.base, "choose", None)

        def hint(r: Record) -> Any:
            if r.index in rebuilt:
                return P.PREFER_RECOMPUTE
            return choose(r) if choose is not None else None

        hints = [hint(r) if f is None else None for r, f in zip(tape.records, fixed)]
        key = (search.structure_key(tape, fixed), tuple(hints))
        if key in self._plans:
            dec, self.last, canon, self._res_canon = self._plans[key]
            self._mech = _from_canonical(tape, canon)
            return list(dec)
        if self.mechanisms:
            chosen, canon = self._plan_joint(tape, fixed, hints)
        else:
            if "recompute" not in self.allow:  # e.g. allow=("save", "compress"), lossless
                fixed = [f or "save" for f in fixed]
            from tapegrad.policies._cost import default_costs

            costs = self.costs if self.costs is not None else default_costs()
            sc, best = _save_recompute(
                tape,
                fixed,
                hints,
                self.bytes,
                lambda: (
                    _joint_ilp_candidate(tape, fixed, self, costs)
                    if "recompute" in self.allow
                    else []
                ),
                seg_flops=costs.segment_flops(),
            )
            if best is None:
                raise BudgetError(
                    f"no save/recompute plan found that keeps activation residuals under "
                    f"{self.bytes:,} bytes; the smallest peak among the plans tried is "
                    f"{sc.floor:,} bytes. Raise the budget to at least that, or make a "
                    "finer-grained program (e.g. tg.checkpoint per layer) so less must be "
                    "held at once."
                )
            flops, peak, chosen, family = best
            segs = sc.index.segments(chosen)
            kept = sc.index.residual_keys(segs)[0]
            tl = sc.timeline(chosen, resolve_prefetch(self, tape))
            self.last = {
                "peak_bytes": peak,
                # the flops themselves: the objective adds `segment_s` per segment
                "recompute_flops": flops - len(segs) * sc.index.seg_flops,
                "recompute_segments": len(segs),
                "plan": family,
                "plans_scored": sc.scores,
                "residuals": {
                    k: ("save", device_nbytes(v), 0.0)
                    for k, v in kept.items()
                    if not (isinstance(k, int) and k in sc.index.free)
                },
                "timeline": tuple(
                    zip(tl.labels, joint.live_bytes(tl, tl.full, np.zeros_like(tl.full)).tolist())
                ),
            }
            canon = {}
        self._mech = _from_canonical(tape, canon)
        # Each kept residual's (mechanism, device bytes, predicted seconds), by names that
        # survive re-tracing: `memory_report` shows them on its own trace (`decisions`).
        self._res_canon = _to_canonical(tape, self.last.get("residuals", {}))
        if len(self._plans) >= 8:
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = (list(chosen), self.last, canon, self._res_canon)
        return list(chosen)

    def decisions(self, tape: Tape) -> dict[Any, tuple[str, int, float]]:
        """Residual key of ``tape`` (a trace of the function planned last) -> (mechanism:
        "save" / "offload" / "bf16" / "int8", device bytes, predicted seconds it adds)."""
        return _from_canonical(tape, self._res_canon)

    def _plan_joint(self, tape: Tape, fixed: list, hints: list) -> tuple[tuple, dict]:
        """Save/recompute plans at the budget and at relaxed ones (less recompute, more
        bytes left for offload/compress to remove), each completed with per-residual
        mechanisms (`_planner_joint`, or the exact `_planner_ilp` on small tapes); on a
        chain also the exact joint program (`_planner_chain_joint`: both chosen at once),
        on small tapes the plans of the joint ILP (`_planner_ilp_joint`; compared after
        the searches on tapes of up to `WIDE_RECORDS` records, else started from);
        then, on tapes up to `JOINT_RECORDS` records, a local search over save/recompute
        scored by predicted step time (`_descend`), and on tapes of 101-300 records with
        highspy the joint ILP over windows of the best plan (`_windows`); the least
        predicted step time that fits wins."""
        import numpy as np

        from tapegrad.policies import _planner_ilp_joint as J
        from tapegrad.policies import _planner_joint as joint
        from tapegrad.policies._cost import default_costs
        from tapegrad.policies._planner_search import Scorer

        costs = self.costs if self.costs is not None else default_costs()
        seg = costs.segment_flops()
        sc = Scorer(tape, fixed, self.bytes, seg_flops=seg)
        hinted = sc.with_fixed("save" if h is None or h.saves else "recompute" for h in hints)
        cands: list[tuple[tuple, str]] = [(hinted, "hints")]
        # Candidates completed and compared after the searches, not started from: the
        # descents are sensitive to their starts, and one more start moved them to
        # worse plans as often as to better ones (`bench/RESULTS.md`, session 13).
        late: list[tuple[tuple, str]] = []
        floor = None
        scored_plans = 0  # plans simulated by the save/recompute searches, and below

        def descend_flops(sr: Any, family: str) -> None:
            """`_descend_flops` on the search ``sr`` (on tapes it runs on), its plan a
            late candidate (`_complete` skips one already among the candidates)."""
            nonlocal scored_plans
            if REPAIR_FLOPS and sr.n <= JOINT_RECORDS:
                searched = sr.scores
                _descend_flops(sr)
                scored_plans += sr.scores - searched
                if sr.best is not None:
                    late.append((sr.best[2], family))

        if "recompute" in self.allow:
            save_peak = sc.score(hinted)[0]
            if self.bytes < save_peak:
                # One save/recompute search at the budget (at its floor when nothing
                # fits); the (peak, flops) Pareto front of every plan it scored gives
                # the relaxed candidates: less recompute, more bytes left to move.
                sr, best = _save_recompute(tape, fixed, hints, self.bytes, seg_flops=seg)
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
                ilp_plans = _joint_ilp_candidate(tape, fixed, self, costs)
                if len(tape.records) <= J.WIDE_RECORDS:
                    late += ilp_plans
                else:
                    cands += ilp_plans
        # Plan with copies brought back one record ahead (at first use where nothing fits
        # so), then bring them back as early as the cost model asks (`_cost.prefetch_depth`)
        # where the plan still fits: the model charges a copy's full time at any depth, so
        # in it deeper prefetch only holds memory longer; on a device it hides the copies.
        if "offload" in self.mechanisms:
            depths: tuple[int, ...] = (1, 0)
        else:
            depths = (resolve_prefetch(self, tape),)
        for prefetch in depths:
            winner, least = self._complete(tape, sc, cands, fixed, prefetch, costs, late)
            if least is not None:
                floor = least if floor is None else min(floor, least)
            if winner is not None:
                break
        if winner is not None and "offload" in self.mechanisms and prefetch == 1:
            (total, _), dec, family, how, _, opts, choice = winner
            for k in range(prefetch_depth(tape, costs), 1, -1):
                tl = sc.timeline(dec, k)
                peak = joint.evaluate(tl, opts, choice)[0]
                if peak <= self.bytes:
                    winner, prefetch = ((total, peak), dec, family, how, tl, opts, choice), k
                    break
        if winner is None:
            raise BudgetError(
                f"no plan ({', '.join(self.allow)}) found that keeps activation residuals "
                f"under {self.bytes:,} bytes; the smallest peak among the plans tried is "
                f"{floor or 0:,} bytes. Raise the budget to at least that, allow more "
                "mechanisms (allow=, max_error=), or make a finer-grained program "
                "(e.g. tg.checkpoint per layer) so less must be held at once."
            )
        (total, peak), dec, family, how, tl, opts, choice = winner
        names = opts.names(choice)
        counts = {m: names.count(m) for m in joint.COLUMNS if m in names}
        r = np.arange(len(tl.keys))
        nseg = len(sc.index.segments(dec))
        self.last = {
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
        mech = {k: m for k, m in zip(tl.keys, names) if m != "save"}
        return dec, _to_canonical(tape, mech)

    def _complete(
        self,
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
        from tapegrad.policies import _planner_joint as joint

        floor = None
        ilp = _ilp_solver(tape)
        scored: list[list[Any]] = []
        seen: set[tuple] = set()
        # What depends on a plan's timeline only (this call fixes the budget, mechanisms
        # and costs), by the timeline's id; each entry holds its timeline, so the id is
        # never reused while it is there. Many plans share one timeline
        # (`TapeIndex.timeline`: ~40 plans each on a 40-record DAG). Keys, each computed
        # on first use (`_fact`): "opts" (kept where a completion needs them), "greedy"
        # (`_greedy`'s choice and seconds), "least" (`least_seconds`), "over" (fewest
        # bytes over the budget), "exact" (HiGHS's choice).
        facts: dict[int, dict[str, Any]] = {}

        def completed(dec: tuple, family: str) -> list[Any]:
            """``dec`` completed with the greedy mechanisms, as a row of ``scored``."""
            nonlocal floor
            tl = sc.timeline(dec, prefetch)
            rec_s = costs.recompute_s(tl.recompute_flops)
            opts, choice, total = self._greedy(tl, rec_s, costs, facts=facts)
            least = joint.least_bytes(tl, opts)
            floor = least if floor is None else min(floor, least)
            return [total, rec_s, dec, family, "greedy", tl, opts, choice]

        def exactly(c: list[Any]) -> None:
            """Row ``c`` with the exact mechanisms (``ilp``) where they are faster."""
            _, rec_s, _, _, _, tl, opts, _ = c
            exact = _fact(_facts_of(facts, tl), "exact", lambda: ilp(tl, opts, self.bytes))
            if exact is not None:
                t = rec_s + joint.evaluate(tl, opts, exact)[1]
                if c[0] is None or t < c[0]:
                    c[0], c[4], c[7] = t, "ILP", exact

        for dec, family in cands:
            if dec not in seen:
                seen.add(dec)
                scored.append(completed(dec, family))
        searched = len(scored)
        scored += self._descend(tape, sc, scored, prefetch, costs, facts)
        if ilp is not None:  # (HiGHS installed, and a tape it solves the mechanisms of)

            def completed_exactly(dec: tuple, family: str) -> list[Any]:
                c = completed(dec, family)
                exactly(c)
                return c

            scored += self._windows(tape, fixed, scored, prefetch, costs, completed_exactly)

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
            scored += self._descend_exact(tape, sc, scored, prefetch, costs, ilp, facts)
        # On a chain: the exact joint program (save/recompute and mechanisms together).
        scored += _chain_joint(tape, sc, fixed, self, costs, scored, prefetch)
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

    def _greedy(
        self,
        tl: Any,
        rec_s: float,
        costs: Any,
        rows: dict | None = None,
        facts: dict[int, dict[str, Any]] | None = None,
        opts: Any = None,
    ) -> tuple[Any, Any, float | None]:
        """A plan's timeline completed with the greedy mechanisms: (the options, the
        choice or None where nothing fits the budget, the predicted step time or None).
        ``facts`` (optional): `_complete`'s per-timeline memo, where the options and
        the completion are kept. ``opts``: the options, where the caller has them."""
        from tapegrad.policies import _planner_joint as joint

        f = _facts_of(facts, tl)
        if "greedy" not in f:
            if "opts" not in f:
                f["opts"] = (
                    opts if opts is not None else joint.options(tl, self.mechanisms, costs, rows)
                )
            choice = joint.assign_greedy(tl, f["opts"], self.bytes)
            secs = joint.evaluate(tl, f["opts"], choice)[1] if choice is not None else None
            f["greedy"] = (choice, secs)
        choice, secs = f["greedy"]
        return f["opts"], choice, (rec_s + secs if secs is not None else None)

    def _descend(
        self,
        tape: Tape,
        sc: Any,
        scored: list,
        prefetch: int,
        costs: Any,
        facts: dict[int, dict[str, Any]] | None = None,
    ) -> list[list[Any]]:
        """`_planner_search.iterate_joint`: descents from the fastest completed
        candidate, from the hand-written policies' plans (`_planner_search.CLASSES`;
        repaired first where they do not fit), then from the second fastest, sharing
        `JOINT_WORK` record-evaluations, then kicks from the best plan found for
        `JOINT_KICK_WORK` more, aimed first at the records where that plan spends its
        time (`hot`); when some candidate fits, and not on tapes over
        `JOINT_RECORDS` records nor on the chains `_planner_chain_joint` plans exactly.
        Returns the plans it improves, scored like the others."""
        from tapegrad.policies import _planner_chain_joint as chain_joint
        from tapegrad.policies import _planner_joint as joint
        from tapegrad.policies import _planner_search as search

        n = len(tape.records)
        if "recompute" not in self.allow or n > JOINT_RECORDS:
            return []
        if n <= chain_joint.MAX_RECORDS and chain_joint.joint_chain(tape, prefetch) is not None:
            return []
        left = JOINT_WORK // max(n, 1)
        memo: dict[tuple, Any] = {}
        rows: dict[tuple, Any] = {}  # `_planner_joint.options`' rows, by residual key
        facts = {} if facts is None else facts

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
                            opts = joint.options(tl, self.mechanisms, costs, rows)
                        f["least"] = joint.least_seconds(tl, opts, self.bytes)
                    least = rec_s + f["least"]
                    if least >= beat[1]:
                        # no mechanisms can make it faster (over half the plans a
                        # descent tries on the bench's 230-256-record tapes). Met again
                        # under a higher bar, such a plan is completed then, and that
                        # counts as an evaluation: the search's course can differ from
                        # completing every plan (2 of the bench's 60 cells, <= 0.07%).
                        return ((0, least),)
                opts, choice, total = self._greedy(tl, rec_s, costs, rows, facts, opts)
                if total is None:
                    key = (1, float(joint.least_bytes(tl, opts) - self.bytes))
                else:
                    key = (0, total)
                got = memo[dec] = (key, rec_s, tl, opts, choice)
            return got

        fitting = sorted((c for c in scored if c[0] is not None), key=lambda c: c[0])
        if not fitting:
            # Nothing to improve on: `_plan_joint` tries prefetch 0 next, or gives up.
            # (Repairing from the class plans instead spent ~2 s CPU below the floor of
            # the bench's 69-record DAG, and fitted nothing.)
            return []
        starts = [(c[2], c[3]) for c in fitting[:1]]
        starts += _class_starts(sc)
        starts += [(c[2], c[3]) for c in fitting[1:2]]
        best = fitting[0][0]
        out: list[list[Any]] = []
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

        kick = JOINT_KICK_WORK // max(n, 1)
        found, _ = search.iterate_joint(
            sc,
            [s for s, _ in starts],
            lambda d, beat: complete(d, beat)[0],
            left,
            kick,
            hot,
            SWAP_WORK // max(n, 1),
            ANNEAL_WORK // max(n, 1),
        )
        for k, dec, (over, total) in found:
            if over == 0 and total < best * (1 - 1e-9):
                best = total
                _, rec_s, tl, opts, choice = complete(dec)
                family = starts[k][1] + "+joint descent"
                out.append([total, rec_s, dec, family, "greedy", tl, opts, choice])
        return out

    def _windows(
        self,
        tape: Tape,
        fixed: list,
        scored: list,
        prefetch: int,
        costs: Any,
        complete: Callable[[tuple, str], list[Any]],
    ) -> list[list[Any]]:
        """A large-neighbourhood search with the joint ILP: from the fastest plan so
        far, `_planner_ilp_joint.plan_candidate` re-plans `WINDOW_RECORDS` consecutive
        records with every other record held at that plan's decision, the window
        sliding by `WINDOW_STEP`; each plan it decodes is completed (``complete``: the
        greedy mechanisms, then the exact ones) and becomes the plan to beat where it
        is faster; up to `WINDOW_ROUNDS` passes, until one improves nothing. Where
        `_complete` has the exact mechanisms (highspy installed), on tapes over
        `_planner_ilp_joint.WIDE_RECORDS` records (below, the whole ILP's plans are
        compared already) up to its `MAX_RECORDS`. The whole ILP is out of HiGHS's
        reach there, a window's is not (0.1-1 s without run variables), and it moves
        dozens of records at once where the searches' moves are one to six: on the
        bench's 256-record DAG at 70% of save()'s peak, 1.356 -> 1.142 predicted µs
        (the best plan known before, from an offline search: 1.144).
        Returns the plans that beat the fastest, scored like the others."""
        from tapegrad.policies import _planner_ilp_joint as J

        n = len(tape.records)
        if "recompute" not in self.allow or not J.WIDE_RECORDS < n <= J.MAX_RECORDS:
            return []
        if WINDOW_ROUNDS <= 0:
            return []
        fitting = [c for c in scored if c[0] is not None]
        if not fitting:
            return []
        start = min(fitting, key=lambda c: c[0])
        best = complete(start[2], start[3])
        if best[0] is None:
            return []
        family = start[3]
        mechs = _no_lowbit(self.mechanisms)
        tried = {best[2]}
        out: list[list[Any]] = []
        for _ in range(WINDOW_ROUNDS):
            improved = False
            for a in range(0, max(n - WINDOW_RECORDS, 0) + WINDOW_STEP, WINDOW_STEP):
                held = [
                    f if f is not None or a <= i < a + WINDOW_RECORDS else d
                    for i, (f, d) in enumerate(zip(fixed, best[2]))
                ]
                # the model without run variables: windows of 80 records at window 0
                # beat windows of 20-60 at window 4 or 8 on the bench's large tapes,
                # at a fifth of the CPU (`bench/RESULTS.md`, session 23)
                dec = J.plan_candidate(tape, held, self.bytes, mechs, costs, prefetch, window=0)
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

    def _descend_exact(
        self,
        tape: Tape,
        sc: Any,
        scored: list,
        prefetch: int,
        costs: Any,
        ilp: Any,
        facts: dict[int, dict[str, Any]] | None = None,
    ) -> list[list[Any]]:
        """A descent (`_planner_search.descend_joint`) from the fastest plan so far,
        each plan completed with the exact mechanisms (``ilp``, `_planner_ilp.solve`)
        instead of the greedy ones, for `EXACT_WORK` record-evaluations; where
        `_descend` runs, on tapes of up to `EXACT_RECORDS` records. `_descend` ranks
        plans by their greedy completion, which can be above the exact one (up to
        1.29x on the bench's timelines, 64x before `assign_greedy`'s capped score and
        exchanges): it cannot see plans whose mechanisms only the exact program packs
        well; single flips from its winner scored exactly reach them (with the old
        greedy, 3.482 -> 3.067 µs on a 46-record transformer block at 46% of save()'s
        peak; the new greedy's descent reaches that plan itself). Returns the plan when
        it beats the fastest, scored like the others."""
        from tapegrad.policies import _planner_chain_joint as chain_joint
        from tapegrad.policies import _planner_joint as joint
        from tapegrad.policies import _planner_search as search

        n = len(tape.records)
        if "recompute" not in self.allow or n > EXACT_RECORDS or EXACT_WORK <= 0:
            return []
        if n <= chain_joint.MAX_RECORDS and chain_joint.joint_chain(tape, prefetch) is not None:
            return []
        fitting = [c for c in scored if c[0] is not None]
        if not fitting:
            return []
        start = min(fitting, key=lambda c: c[0])
        memo: dict[tuple, Any] = {}
        facts = {} if facts is None else facts  # `_complete`'s, by timeline

        def complete(dec: tuple, beat: tuple[int, float] | None = None) -> Any:
            got = memo.get(dec)
            if got is not None:
                return got
            tl = sc.timeline(dec, prefetch)
            rec_s = costs.recompute_s(tl.recompute_flops)
            f = _facts_of(facts, tl)
            opts = _fact(f, "opts", lambda: joint.options(tl, self.mechanisms, costs))
            over = _fact(f, "over", lambda: joint.least_bytes(tl, opts) - self.bytes)
            if over > 0:
                got = ((1, float(over)), rec_s, tl, opts, None)
            elif beat is not None and beat[0] == 0 and rec_s >= beat[1]:
                return ((0, rec_s), rec_s, tl, opts, None)  # not stored: a bound only
            elif (
                beat is not None
                and beat[0] == 0
                and (
                    least := rec_s
                    + _fact(f, "least", lambda: joint.least_seconds(tl, opts, self.bytes))
                )
                >= beat[1]
            ):
                return ((0, least), rec_s, tl, opts, None)  # likewise
            else:
                choice = _fact(f, "exact", lambda: ilp(tl, opts, self.bytes))
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
            sc, start[2], lambda d, beat: complete(d, beat)[0], EXACT_WORK // max(n, 1)
        )
        if over != 0 or total >= start[0] * (1 - 1e-9):
            return []
        _, rec_s, tl, opts, choice = complete(dec)
        return [[total, rec_s, dec, start[3] + "+exact descent", "ILP", tl, opts, choice]]

    def __repr__(self) -> str:
        return f"budget(bytes={self.bytes:,}, base={self.base!r})"


# Relaxed budgets for the save/recompute plans the joint planner completes with
# mechanisms: the budget itself, then less recompute and more bytes left to move.
_RELAXED = 6  # how many relaxed save/recompute plans the joint planner completes


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


def _relaxed(sc: Any, lo: int, hi: int) -> list[tuple]:
    """Up to `_RELAXED` plans from the (peak, flops) Pareto front of what ``sc`` scored,
    peaks spread between ``lo`` (the plan at the budget) and ``hi`` (save-all)."""
    front: list[tuple[int, float, tuple]] = []
    for dec, (peak, flops) in sorted(sc._seen.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        if lo < peak < hi and (not front or flops < front[-1][1]):
            front.append((peak, flops, dec))
    if len(front) <= _RELAXED:
        return [d for _, _, d in front]
    picks = np.linspace(0, len(front) - 1, _RELAXED).round().astype(int)
    return [front[i][2] for i in sorted(set(picks.tolist()))]


_KNOWN = ("save", "recompute", "offload", "compress")
# max_error -> its level: `ERROR_CLASSES`' order, lossless (or None) first
_ERRORS: dict[str | None, int] = {None: 0} | {c: i for i, c in enumerate(ERROR_CLASSES)}


def _check_allow(allow: Sequence[str], max_error: str | None) -> tuple[tuple[str, ...], Any]:
    if isinstance(allow, str):
        allow = (allow,)
    allow = tuple(allow)
    bad = [a for a in allow if a not in _KNOWN]
    if bad or "save" not in allow:
        raise ValueError(
            f"budget: allow must name some of {_KNOWN}, 'save' among them; got {allow!r}."
        )
    if max_error not in _ERRORS:
        raise ValueError(
            "budget: max_error must be None (lossless), 'bf16', 'int8', '4-bit' or "
            f"'2-bit'; got {max_error!r}."
        )
    return allow, max_error


def _mechanisms(allow: tuple[str, ...], max_error: str | None) -> tuple[str, ...]:
    out = []
    if "offload" in allow:
        out.append("offload")
    if "compress" in allow:
        level = _ERRORS[max_error]
        out += [
            m for m, c in MECHANISMS.items() if m not in ("save", "offload") and _ERRORS[c] <= level
        ]
    return tuple(out)


def _packed_by(packed: Any, info: Any, base: Any) -> str | None:
    """Which mechanism packed ``packed`` (None: the base policy did): compress formats
    and host memory say so themselves, so unpack needs no lookup that a later plan
    of another tape could have replaced."""
    import jax
    import numpy as np

    from tapegrad._policy import SAVE
    from tapegrad.policies._lowbit import LowBit
    from tapegrad.policies.compress import Int8, Int8Blocks

    if isinstance(packed, (Int8, Int8Blocks)):
        return "int8"
    if isinstance(packed, LowBit):
        return f"{packed.bits}-bit"
    if not isinstance(packed, jax.Array):
        return None
    if isinstance(packed, jax.core.Tracer):
        space = getattr(jax.typeof(packed), "memory_space", None)
        on_host = space is not None and "host" in str(space).lower()
    else:
        on_host = "host" in str(getattr(packed.sharding, "memory_kind", "") or "")
    if on_host:
        return "offload"
    if base is SAVE and np.dtype(packed.dtype) != np.dtype(info.dtype):
        return "bf16"
    return None


def _canonical_names(tape: Tape) -> dict[int, tuple]:
    """Var id -> a name that survives re-tracing: ("in", position) or ("out", record,
    output)."""
    names: dict[int, tuple] = {v.id: ("in", i) for i, v in enumerate(tape.inputs)}
    for i, (v, _) in enumerate(tape.consts):
        names[v.id] = ("const", i)
    for r in tape.records:
        for j, o in enumerate(r.outputs):
            names[o.id] = ("out", r.index, j)
    return names


def _to_canonical(tape: Tape, mech: dict) -> dict:
    names = _canonical_names(tape)
    return {(names[k] if isinstance(k, int) else k): m for k, m in mech.items()}


def _from_canonical(tape: Tape, canon: dict) -> dict:
    if not canon:
        return {}
    ids = {n: i for i, n in _canonical_names(tape).items()}
    return {(ids[k] if k[0] != "aux" else k): m for k, m in canon.items()}


def _save_recompute(
    tape: Tape, fixed: list, hints: list, budget: int, more: Any = None, seg_flops: float = 0.0
) -> tuple[Any, Any]:
    """The save/recompute search at ``budget``: (scorer, best) with best = (flops, peak,
    decisions, family) or None when nothing fits (``scorer.floor``: the least peak seen).
    ``more()``, given by plain budgets (save/recompute, scored by flops), is called when
    the hints do not fit: more plans to score (decisions, family), then a descent by
    flops from the best (`_descend_flops`). ``seg_flops``: each recomputed segment's
    fixed cost (`CostModel.segment_flops`). The joint planner gives none: its own
    descent scores by step time, and a flops descent here only moved its starts
    (worse on 6 of 39 `bench/ilp_bench.py` cells compared, better on 2)."""
    from tapegrad.policies import _planner_search as search
    from tapegrad.policies._planner_chain import as_chain, chain_plan
    from tapegrad.policies._planner_stages import stage_plan

    sc = search.Scorer(tape, fixed, budget, seg_flops=seg_flops)
    hinted = sc.with_fixed("save" if h is None or h.saves else "recompute" for h in hints)
    if sc.fits(hinted, "hints"):
        return sc, sc.best
    # The exact chain program's fronts grow with the chain (a 662-record MLP chain took
    # ~25 s); longer chains get the bounded searches below, like any tape.
    ch = as_chain(tape) if len(tape.records) <= CHAIN_DP_RECORDS else None
    if ch is not None:
        chain_dec = chain_plan(ch, fixed, budget)
        if chain_dec is not None:
            sc.score(chain_dec, "chain DP")
    else:
        # (its own bound, ~133,000 record-simulations, on tapes the limit does not bind)
        small = sc.limit >= SMALL_SEARCH
        stage_dec = stage_plan(sc, share=None if small else sc.left() // 5)
        if stage_dec is not None:
            sc.score(stage_dec, "stage DP")
    # On big tapes the scorer's work limit (`_planner_search.WORK`) bounds the search:
    # the families below share what is left, refinement takes the rest.
    search.class_plans(sc)
    search.ratio_plans(sc)
    search.cut_plans(sc, share=sc.left() * 2 // 3)
    if ch is None:  # on a chain the program is already optimal
        search.descend(sc)
    search.refine(sc)
    if more is not None:
        for dec, family in more():
            sc.score(dec, family)
        if ch is None and sc.n <= JOINT_RECORDS:
            _descend_flops(sc)
    return sc, sc.best


def _class_starts(sc: Any) -> list[tuple[tuple[str, ...], str]]:
    """The plans of `JOINT_CLASSES` (binding decisions applied), by name: where the
    descents start besides the best plan found."""
    from tapegrad.policies import _planner_search as search

    return [
        (sc.with_fixed("save" if keep(r) else "recompute" for r in sc.tape.records), name)
        for name, keep in search.CLASSES.items()
        if name in JOINT_CLASSES
    ]


def _descend_flops(sc: Any) -> None:
    """`_planner_search.iterate_joint` scored by recompute flops (bytes over the budget
    where a plan does not fit): descents from the best plan found (else the least peak
    seen, which they repair) and from the hand-written plans of `JOINT_CLASSES`,
    sharing `FLOPS_WORK` record-evaluations, then kicks for `FLOPS_KICK_WORK` more
    (at spread positions: never worse, up to 25% fewer flops on 8 of 24 DAG cells tried,
    ~0.1 s more), then descents that cross plans over the budget at a penalty per byte
    (`_planner_search.oscillate`, `OSCILLATE_WORK`; the penalty's scale is the best
    plan's flops per byte it keeps off the device). The searches above move one
    record at a time along one path each; on DAGs they stop far from plans this finds
    (or find none that fit where one does). Every plan it scores updates ``sc.best``."""
    from tapegrad.policies import _planner_search as search

    def cost(dec: tuple, beat: Any) -> tuple[int, float]:
        peak, flops = sc.score(dec, "descent")
        return (0, flops) if peak <= sc.budget else (1, float(peak - sc.budget))

    starts = [sc.best[2] if sc.best is not None else sc.floor_plan]
    starts += [dec for dec, _ in _class_starts(sc)]
    n = max(sc.n, 1)
    search.iterate_joint(
        sc, [s for s in starts if s is not None], cost, FLOPS_WORK // n, FLOPS_KICK_WORK // n
    )
    if OSCILLATE_WORK > 0 and sc.best is not None:

        def penalized(d: tuple, lam: float) -> float:
            peak, flops = sc.score(d, "descent")
            return flops + lam * max(peak - sc.budget, 0)

        rate = sc.best[0] / max(sc.score(sc.with_fixed(["save"] * sc.n))[0] - sc.budget, 1)
        search.oscillate(sc, sc.best[2], cost, penalized, rate, OSCILLATE_WORK // n)


# The joint descent (`Budget._descend`): record-evaluations it may spend (one
# evaluation of an n-record plan, timeline and greedy mechanisms, costs n; 1.5-4.5 µs
# per record on a busy 2-core CPU, least where `least_seconds` spares the mechanisms), on
# tapes of up to how many records; then as many again for the kicks of the iterated
# search (`_planner_search.iterate_joint`). On tapes of 150-270 records the descents
# stop at this limit, not at a local optimum: 240,000 (session 16; was 80,000) gave
# faster plans on 18 of `bench/ilp_bench.py`'s 60 cells without highspy and 14 with
# it; 480,000 (session 17, once evaluations cost less) on 14 more without and 9 with
# (up to -24%), none slower (`bench/RESULTS.md`).
JOINT_WORK = 480_000
JOINT_RECORDS = 320
JOINT_KICK_WORK = 480_000
# ... and then for edge swaps (`_planner_search.swap_edges`), each repaired by a descent
# over the whole tape: kicks that move where a segment is cut. Session 19 (`bench/
# RESULTS.md`): 8 of the 60 cells faster without highspy, 6 with it, none slower (DAG 149
# at 52%: 1.766 -> 1.737 µs, the optimum is 1.658), ~25% more planning CPU on tapes over
# ~100 records; at 240,000 that cell got 1.756.
SWAP_WORK = 480_000
# ... and then for annealing from the best plan (`_planner_search.anneal_joint`): random
# moves of one to six records, uphill ones taken at a falling temperature.
ANNEAL_WORK = 480_000
# The exact-mechanism descent (`Budget._descend_exact`, with highspy): record-evaluations,
# each an exact mechanism program (~2-30 ms on 46-90 records), on tapes of up to
# `EXACT_RECORDS` records: above, its share is a few dozen plans, not one sweep, and
# the joint descent's wider search finds more in that time.
EXACT_WORK = 9_000
EXACT_RECORDS = 100
# The joint ILP's window search (`Budget._windows`, with highspy, tapes of 101-300
# records): records per window, the slide, and passes at most.
WINDOW_RECORDS = 80
WINDOW_STEP = 40
WINDOW_ROUNDS = 2
# The flops descent (`_descend_flops`): record-evaluations for its descents and its
# kicks (kept at 80,000: more finds plans with fewer flops that are slower once
# completed with mechanisms, transformer 178 at 70% +9%), then for its oscillation,
# record-simulations, ~6 µs each (a plan of 58 records descends in ~200 simulations
# per penalty).
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


def _chain_joint(
    tape: Tape, sc: Any, fixed: list, pol: Budget, costs: Any, scored: list, prefetch: int
) -> list[list[Any]]:
    """`_planner_chain_joint.candidates`: on a chain, the exact joint plan when it beats
    the candidates ``scored`` so far, scored like them (none on other tapes)."""
    from tapegrad.policies import _planner_chain_joint

    if "recompute" not in pol.allow:
        fixed = [f or "save" for f in fixed]
    bound = min((c[0] for c in scored if c[0] is not None), default=math.inf)
    return _planner_chain_joint.candidates(
        tape, sc, fixed, pol.bytes, _no_lowbit(pol.mechanisms), prefetch, costs, bound
    )


def _no_lowbit(mechanisms: tuple[str, ...]) -> tuple[str, ...]:
    """``mechanisms`` less 4-bit and 2-bit, for the programs that choose recompute and
    mechanisms at once: they do not know that low-bit must not round what a recomputed
    segment reads (`_planner_joint.Timeline.exact`). Their plans are completed with
    every mechanism, low-bit included, like any other save/recompute candidate."""
    return tuple(m for m in mechanisms if m not in LOWBIT)


def _ilp_solver(tape: Tape) -> Any:
    """`_planner_ilp.solve` when highspy is importable and the tape is small enough to
    solve within its work limit (`_planner_ilp.WORK`); else None."""
    from tapegrad.policies import _planner_ilp

    if not _planner_ilp.available() or len(tape.records) > _planner_ilp.MAX_RECORDS:
        return None
    return _planner_ilp.solve


def _joint_ilp_candidate(
    tape: Tape, fixed: list, pol: Budget, costs: Any
) -> list[tuple[tuple, str]]:
    """The save/recompute decisions of `_planner_ilp_joint`'s solutions (scored like the
    other plans) when highspy is importable and the tape is small enough; else none.
    Two models: without run variables (solved in a fraction of a second, so a plan even
    where the larger one stops at its work limit) and with them (closer to the
    executor's schedule, often a better plan: the bound's window on tapes of at most
    `_planner_ilp_joint.WIDE_RECORDS` records, which HiGHS mostly solves within the work
    limit there, `PLAN_WINDOW` above)."""
    from tapegrad.policies import _planner_ilp_joint as J

    # planned with copies one record ahead, as `Budget._plan_joint` plans first
    prefetch = 1 if "offload" in pol.mechanisms else resolve_prefetch(pol, tape)
    mechs = _no_lowbit(pol.mechanisms)
    out: list[tuple[tuple, str]] = []
    for window in J.plan_windows(len(tape.records)):
        dec = J.plan_candidate(tape, fixed, pol.bytes, mechs, costs, prefetch, window=window)
        if dec is not None and all(dec != d for d, _ in out):
            out.append((dec, "joint ILP"))
    return out


def _keep_effects(tape: Tape, fixed: Sequence[str | None]) -> list[str | None]:
    """Binding "save" for every free record with a harmful side effect."""
    from tapegrad.passes.checks import _harmful, effects_of

    return [
        f if f is not None or not _harmful(effects_of(r)) else "save"
        for r, f in zip(tape.records, fixed)
    ]


def budget(
    bytes: int,
    base: Any = None,
    *,
    allow: Sequence[str] = ("save", "recompute"),
    max_error: str | None = None,
    costs: Any = None,
    key: Any = None,
) -> Budget:
    """Let the planner choose, per residual, how to keep activation residuals under
    ``bytes`` (device bytes, per device) at the least predicted step time.

    ```python
    tg.grad(loss, policy=tg.policies.budget(bytes=64 << 20))(params, x)
    tg.grad(loss, policy=tg.policies.budget(
        bytes=64 << 20, allow=("save", "recompute", "offload", "compress"), max_error="bf16"
    ))(params, x)
    ```
    ``allow`` names the mechanisms it may use: ``"save"`` (always), ``"recompute"``
    (re-run records in backward), ``"offload"`` (host memory between forward and
    backward, `tg.policies.offload`), ``"compress"`` (`tg.policies.compress`, in the
    formats whose error ``max_error`` admits: None = lossless only, so none;
    ``"bf16"``; ``"int8"``, which admits bf16 too; ``"4-bit"`` and ``"2-bit"``,
    `compress(bits=...)`'s stochastic rounding with the noise drawn from ``key=`` (an
    int seed or a `jax.random.key`, default seed 0: pass a fresh one each step, as to
    `compress`)). Each costs predicted time by
    ``costs`` (a `tg.policies.CostModel`; default: `tg.policies.calibrate`'s figures
    once measured, else per-backend defaults). ``base`` is the residual policy for
    what is saved; a `tg.selective` base makes its ALWAYS/NEVER binding and its
    PREFER_* hints. Records with side effects are never chosen for recompute. A
    budget no plan meets raises `BudgetError` naming the least peak found.
    """
    return Budget(bytes, base, allow, max_error, costs, key)
