"""The memory-budget planner: choose save or recompute per record so that the
peak of live residual bytes stays under a budget at the least recompute cost.

The planner is a tape pass. It respects binding decisions (``ALWAYS`` /
``NEVER`` from a `tg.selective` base, and the policies of `jax.checkpoint`
regions) and treats ``PREFER_*`` as hints. Peak memory and recompute cost are
estimated statically from the tape (shapes, dtypes; flops from shapes), by
replaying the same save/release/recompute schedule the interpreter follows.

Budgets count *activation* residuals: values kept for backward that are not
the function's own inputs (those are alive anyway, whatever is saved).

Search (see `Budget.plan`): keep the hints if they fit; otherwise a family of
single-level "cut" plans in the style of Chen et al.'s sublinear
checkpointing, each scored exactly by `estimate`. This is a tested heuristic;
it is not the optimal dynamic program on chains (revolve), left as future work.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from tapegrad._tape import Record, Tape, Var
from tapegrad.errors import TapegradError

__all__ = ["Budget", "budget", "estimate", "BudgetError", "record_flops"]


class BudgetError(TapegradError, ValueError):
    """No save/recompute plan fits the budget."""


def record_flops(rec: Record) -> float:
    """A rough cost of re-running ``rec``: 2·M·N·K for dots, output size otherwise."""
    out = sum(int(np.prod(o.shape)) for o in rec.outputs)
    if rec.primitive == "dot_general":
        (lc, _), _ = rec.params["dimension_numbers"]
        k = int(np.prod([rec.inputs[0].shape[d] for d in lc])) if lc else 1
        return 2.0 * out * k
    if rec.primitive == "conv_general_dilated":
        rhs = rec.inputs[1].shape
        return 2.0 * out * int(np.prod(rhs)) / max(rhs[0], 1)
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


def estimate(tape: Tape) -> tuple[int, float]:
    """(peak live activation-residual bytes, recompute flops) of a planned tape."""
    from tapegrad._checkpoint import segment_peak

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
            flops += sum(record_flops(tape.records[i]) for i in seg.records)
            peak = max(peak, live + segment_peak(tape, seg))
            for o in seg.outputs:
                extra[o.id] = o.nbytes
                live += o.nbytes
            for v in seg.inputs:
                release(v.id)
        peak = max(peak, live)
        for key in keys:
            release(key)
    return peak, flops


class Budget:
    """A residual policy whose tape plan keeps the activation peak under ``bytes``."""

    def __init__(self, bytes: int, base: Any = None):
        from tapegrad.policies._base import SAVE

        if bytes < 0:
            raise ValueError(f"budget: bytes must be >= 0, got {bytes}")
        self.bytes = int(bytes)
        self.base = SAVE if base is None else base
        self.prefetch = getattr(self.base, "prefetch", 0)
        self.last: dict[str, Any] = {}

    def pack(self, value, info):
        return self.base.pack(value, info)

    def unpack(self, packed, info):
        return self.base.unpack(packed, info)

    def plan(self, tape: Tape, fixed: Sequence[str | None]) -> list[str]:
        """Decisions for every record; ``fixed[i]`` is a binding decision or None.

        1. If the hints (PREFER_x means x; unannotated means save) fit, keep them.
        2. Otherwise try *cut plans*: walk the tape accumulating activation bytes;
           every ~S bytes, cut (the values crossing the cut are saved); the spans
           between cuts are recomputed, except the last ``k`` spans, which stay
           saved (cheaper, more memory). For each span size S (a geometric range)
           the largest ``k`` that fits is found by bisection.
        3. And *ratio plans*: recompute records in order of flops per byte freed
           (cheap elementwise ops first), the shortest fitting prefix.
        Every candidate is scored by `estimate` — the executor's own schedule — and
        the fitting plan with the least recompute flops wins.
        """
        from tapegrad._checkpoint import build_segments

        n = len(tape.records)
        choose = getattr(self.base, "choose", None)
        hints = [choose(r) if (choose is not None and f is None) else None
                 for r, f in zip(tape.records, fixed)]

        def planned(decisions):
            recs = tuple(dataclasses.replace(r, decision=d) for r, d in zip(tape.records, decisions))
            t = dataclasses.replace(tape, records=recs, segments=())
            return dataclasses.replace(t, segments=build_segments(t, decisions))

        def with_fixed(dec):
            return [f if f is not None else d for f, d in zip(fixed, dec)]

        hinted = with_fixed(["save" if h is None or h.saves else "recompute" for h in hints])
        peak, flops = estimate(planned(hinted))
        if peak <= self.bytes:
            self.last = {"peak_bytes": peak, "recompute_flops": flops, "plan": "hints"}
            return hinted

        inputs = {v.id for v in tape.inputs} | {v.id for v, _ in tape.consts}
        kept0, _ = planned(with_fixed(["save"] * n)).residual_keys()
        producer = {o.id: r.index for r in tape.records for o in r.outputs}
        act = [0] * n
        for k, v in kept0.items():
            if isinstance(k, int) and k not in inputs and k in producer:
                act[producer[k]] += v.nbytes
        last_use: dict[int, int] = {}
        for r in tape.records:
            for u in r.inputs:
                if isinstance(u, Var):
                    last_use[u.id] = r.index

        def crossing(c: int) -> set[int]:
            """Producers of the values made at or before record c and used after it."""
            return {producer[v] for v, lu in last_use.items()
                    if lu > c and v in producer and producer[v] <= c}

        # Bytes crossing each possible cut (values made at or before it, used after it):
        # cuts go where little crosses, e.g. between transformer blocks.
        delta = [0] * (n + 1)
        for v, lu in last_use.items():
            if v in producer and v not in inputs:
                p0 = producer[v]
                if lu > p0:
                    nb = tape.records[p0].outputs[[o.id for o in tape.records[p0].outputs].index(v)].nbytes
                    delta[p0] += nb
                    delta[lu] -= nb
        cross, run = [], 0
        for i in range(n):
            run += delta[i]
            cross.append(run)
        total = max(sum(act), 1)
        best = None
        floor = peak
        sizes = sorted({max(1, int(total / 2 ** (k / 2))) for k in range(0, 25)})
        for size in sizes:
            cuts, acc, start = [], 0, 0
            for i in range(n):
                acc += act[i]
                if acc >= size and i < n - 1:
                    # cut where the least crosses within the last span
                    c = min(range(max(start, (start + i) // 2), i + 1), key=lambda j: (cross[j], -j))
                    cuts.append(c)
                    start = c + 1
                    acc = sum(act[start:i + 1])
            spans = [(a + 1, b) for a, b in zip([-1] + cuts, cuts + [n - 1])]
            keep_at_cuts = set().union(*(crossing(c) for c in cuts)) if cuts else set()

            def decisions(k_saved: int) -> list[str]:
                dec = ["save"] * n
                for j, (a, b) in enumerate(spans):
                    if j >= len(spans) - k_saved:
                        continue
                    for i in range(a, b + 1):
                        if i not in keep_at_cuts:
                            dec[i] = "recompute"
                return with_fixed(dec)

            lo, hi = 0, len(spans)  # largest k_saved that fits, by bisection
            found = None
            while lo <= hi:
                mid = (lo + hi) // 2
                dec = decisions(mid)
                p, f = estimate(planned(dec))
                floor = min(floor, p)
                if p <= self.bytes:
                    found = (f, p, dec)
                    lo = mid + 1
                else:
                    hi = mid - 1
            if found is not None and (best is None or found[:2] < best[:2]):
                best = found
        # Ratio plans: recompute the records that free the most bytes per flop first
        # (cheap elementwise ops before matmuls, as jax's dots_saveable does by hand);
        # the shortest fitting prefix of that order, found by bisection.
        ratio = sorted((i for i in range(n) if fixed[i] is None and act[i] > 0),
                       key=lambda i: record_flops(tape.records[i]) / act[i])
        lo, hi = 1, len(ratio)
        while lo <= hi:
            mid = (lo + hi) // 2
            chosen = set(ratio[:mid])
            dec = with_fixed(["recompute" if i in chosen else "save" for i in range(n)])
            p, f = estimate(planned(dec))
            floor = min(floor, p)
            if p <= self.bytes:
                if best is None or (f, p) < best[:2]:
                    best = (f, p, dec)
                hi = mid - 1
            else:
                lo = mid + 1
        if best is None:
            raise BudgetError(
                f"no save/recompute plan found that keeps activation residuals under "
                f"{self.bytes:,} bytes; the smallest peak among the plans tried is {floor:,} "
                "bytes. Raise the budget to at least that, or make a finer-grained program "
                "(e.g. tg.checkpoint per layer) so less must be held at once.")
        flops, peak, dec = best
        self.last = {"peak_bytes": peak, "recompute_flops": flops, "plan": "cuts"}
        return dec

    def __repr__(self) -> str:
        return f"budget(bytes={self.bytes:,}, base={self.base!r})"


def budget(bytes: int, base: Any = None) -> Budget:
    """Let the planner choose what to recompute so residuals stay under ``bytes``.

    ```python
    tg.grad(loss, policy=tg.policies.budget(bytes=64 << 20))(params, x)
    ```
    ``base`` is the residual policy for what is saved; a `tg.selective` base makes
    its ALWAYS/NEVER binding and its PREFER_* hints.
    """
    return Budget(bytes, base)

