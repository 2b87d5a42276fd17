"""The save/recompute search's candidate families on general tapes, each plan scored by
the executor's own schedule (`scorer.Scorer`, `problem.estimate`); the planner keeps the
fitting plan with the least flops:

* *class plans*: the decisions of the hand-written policies themselves — save only
  dots (`jax.checkpoint_policies.dots_saveable`), dots without batch dimensions,
  everything but cheap elementwise/layout ops, nothing — so the planner is never
  worse than one of them at its budget;
* *cut plans* (Chen et al.'s sublinear checkpointing): cuts where little crosses
  (between transformer blocks, say); the values crossing a cut are saved, the
  spans between cuts recomputed except the last ``k`` (largest ``k`` that fits, by
  bisection); inside a recomputed span a class plan may still save its records
  (dots saved, the rest recomputed span by span is what
  ``jax.checkpoint(dots_saveable)`` per layer does); with few spans, also every
  mix of saved spans, dots-saved spans and fully recomputed spans;
* *ratio plans*: recompute records in order of flops per activation byte;
* *greedy descent* (small tapes): from save-all, recompute the record that frees
  the most peak bytes per flop, re-scored each step, until the plan fits;
* *refinement*: from the best plan, give records back to "save", largest
  recompute cost first, while the plan still fits.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from tapegrad.planner.cost import record_flops
from tapegrad.planner.scorer import CLASSES, Scorer, _activation_bytes, _spread

__all__ = ["class_plans", "cut_plans", "ratio_plans", "descend", "refine"]


def class_plans(sc: Scorer) -> None:
    for name, saved in CLASSES.items():
        sc.score(["save" if saved(r) else "recompute" for r in sc.tape.records], name)


def cut_plans(
    sc: Scorer,
    classes: Sequence[str] = ("nothing_saveable", "dots_saveable"),
    mixed_spans: int = 12,
    share: int | None = None,
) -> None:
    """Cut plans (see the module's docstring); at most ``share`` new scores (default:
    no bound but the scorer's limit), cut sets tried coarse to fine."""
    n = sc.n
    if n < 2:
        return
    stop = sc.scores + (share if share is not None else sc.left())
    act, cross, producer, last_use = _activation_bytes(sc)
    spans_of = [
        (producer[v], lu) for v, lu in last_use.items() if v in producer and lu > producer[v]
    ]

    def crossing_any(cut_set: Sequence[int]) -> set[int]:
        """Producers of the values crossing some cut (produced at or before it, used
        after it)."""
        out = set()
        for p, lu in spans_of:
            j = bisect.bisect_left(cut_set, p)
            if j < len(cut_set) and cut_set[j] < lu:
                out.add(p)
        return out

    total = max(sum(act), 1)
    cut_sets: list[tuple[int, ...]] = []
    for size in sorted({max(1, int(total / 2 ** (k / 2))) for k in range(0, 25)}):
        cuts, acc, start = [], 0, 0
        for i in range(n):
            acc += act[i]
            if acc >= size and i < n - 1:
                # cut where the least crosses within the later half of the span
                c = min(range(max(start, (start + i) // 2), i + 1), key=lambda j: (cross[j], -j))
                cuts.append(c)
                start = c + 1
                acc = sum(act[start : i + 1])
        if tuple(cuts) not in cut_sets:
            cut_sets.append(tuple(cuts))
    for j in _spread(len(cut_sets)):
        if sc.scores >= stop:
            return
        cut_set = cut_sets[j]
        spans = [(a + 1, b) for a, b in zip((-1,) + cut_set, cut_set + (n - 1,))]
        at_cuts = crossing_any(cut_set) if cut_set else set()

        def decisions(levels: Sequence[str | None]) -> list[str]:
            """Span j recomputed except what class levels[j] saves; None: span saved."""
            dec = ["save"] * n
            for (a, b), cls in zip(spans, levels):
                if cls is not None:
                    saved = CLASSES[cls]
                    for i in range(a, b + 1):
                        if i not in at_cuts and not saved(sc.tape.records[i]):
                            dec[i] = "recompute"
            return dec

        m = len(spans)
        for cls in classes:
            lo, hi = 0, m  # the largest number of saved spans that fits
            while lo <= hi and sc.scores < stop:
                mid = (lo + hi) // 2
                if sc.fits(decisions([cls] * (m - mid) + [None] * mid), f"cuts+{cls}"):
                    lo = mid + 1
                else:
                    hi = mid - 1
        if m <= mixed_spans and len(classes) >= 2 and sc.scores < stop:
            # Mixed: the last spans saved, the ones before them with the lighter class
            # (dots kept), the first ones with the heavier (nothing kept).
            heavy, light = classes[0], classes[1]

            def mixed(k_saved: int, k_light: int) -> list[str]:
                levels = [heavy] * (m - k_saved - k_light) + [light] * k_light + [None] * k_saved
                return decisions(levels)

            fam = f"cuts+{heavy}/{light}"
            every = m * (m - 1) // 2 <= stop - sc.scores
            for k_saved in range(m):
                if every:
                    for k_light in range(1, m - k_saved):
                        sc.score(mixed(k_saved, k_light), fam)
                    continue
                # Under the work limit: per k_saved, the most lighter spans that fit
                # (bisection; more of them is less recompute and more bytes).
                lo, hi = 1, m - k_saved - 1
                while lo <= hi and sc.scores < stop:
                    mid = (lo + hi) // 2
                    if sc.fits(mixed(k_saved, mid), fam):
                        lo = mid + 1
                    else:
                        hi = mid - 1


def ratio_plans(sc: Scorer) -> None:
    """Recompute first the records that free the most bytes per flop; the shortest
    fitting prefix of that order, by bisection."""
    act = _activation_bytes(sc)[0]
    order = sorted(
        (i for i in range(sc.n) if sc.fixed[i] is None and act[i] > 0),
        key=lambda i: record_flops(sc.tape.records[i]) / act[i],
    )
    lo, hi = 1, len(order)
    while lo <= hi:
        mid = (lo + hi) // 2
        chosen = set(order[:mid])
        if sc.fits(["recompute" if i in chosen else "save" for i in range(sc.n)], "ratio"):
            hi = mid - 1
        else:
            lo = mid + 1


def descend(sc: Scorer, max_records: int = 48) -> None:
    """Greedy from save-all on small tapes: recompute, one record at a time, the one
    that frees the most peak bytes per flop added (re-scored with the schedule each
    step), until the plan fits. O(n^2) scores, so only for tapes of few records."""
    if sc.n > max_records:
        return
    current = ["save"] * sc.n
    peak, flops = sc.score(current, "greedy")
    for _ in range(sc.n):
        if peak <= sc.budget:
            return
        step = None
        for i in range(sc.n):
            if current[i] == "recompute" or sc.fixed[i] is not None:
                continue
            trial = current[:i] + ["recompute"] + current[i + 1 :]
            p, f = sc.score(trial, "greedy")
            # freed peak bytes per flop; when no single step lowers the peak (values
            # shared by several records), take the one that raises it least
            if p < peak:
                key = ((peak - p) / (f - flops + 1.0), -f)
            else:
                key = (-float(p - peak), -f - 1e30)
            if step is None or key > step[0]:
                step = (key, trial, p, f)
        if step is None:
            return
        _, current, peak, flops = step


def refine(sc: Scorer, starts: int = 2, max_tries: int = 512, patience: int = 96) -> None:
    """Give recomputed records back to "save", costliest first, while the plan fits;
    from the best plan of each of the ``starts`` best families (one greedy path can
    stall where another does not); a path stops after ``patience`` tries in a row
    that do not help (each try is one score)."""
    for flops, _, dec, family in sorted(sc.by_family.values(), key=lambda b: b[:2])[:starts]:
        planned = sc.planned(dec)
        in_segments = sorted(
            {i for seg in planned.segments for i in seg.records if sc.fixed[i] is None},
            key=lambda i: -record_flops(sc.tape.records[i]),
        )
        current = list(dec)
        misses = 0
        for i in in_segments[:max_tries]:
            if sc.left() <= 0:
                return
            trial = list(current)
            trial[i] = "save"
            peak, f = sc.score(trial, family + "+refined")
            if peak <= sc.budget and f < flops:
                current, flops, misses = trial, f, 0
            else:
                misses += 1
                if misses >= patience:
                    break
