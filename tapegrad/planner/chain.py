"""The exact planner for chains: a dynamic program over the chain's positions.

On a *chain* (each record consumes the previous record's single output, plus the
tape's inputs), the executor's schedule (`problem.estimate`) decomposes:

* a plan is a sequence of saved records and *runs* of recomputed records;
* a run ``[a..b]`` recomputes, as one segment, the records ``a..c`` up to the last
  one whose output (or derived value) backward needs, from the value entering it;
* its recomputation happens at backward's first use of those values, when the
  live bytes are exactly the kept bytes of everything before the run (that is
  what a chain guarantees: everything after it has been released), plus the
  outputs the record after the run keeps for itself, plus the segment's own
  recomputation peak; once it has run, its input is released and what it made is
  held: the values backward needs and the derived values its records remake (a
  custom_vjp's residuals);
* the other candidate for the peak is the end of forward: every kept byte.

So ``peak = max(kept_total, max over runs (kept_before(run) + local(run)))`` and the
recompute flops are the sum over runs. A left-to-right program whose state is
(position, kept bytes so far) — one Pareto front of (kept bytes, flops) per
position, pruned at the budget — finds the least-flops plan under the budget
exactly, with no discretisation. This is Chen et al.'s single-level sublinear
checkpointing made exact for this executor, which recomputes each segment once
and keeps its values until backward consumes them (it does not nest segments the
way Griewank's revolve does, so revolve's deeper schedules are not plans here).
``tests/policies/test_budget.py`` checks the result against brute force over
every save/recompute subset, scored by `estimate` itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tapegrad.core.tape import Tape, Var
from tapegrad.planner.cost import record_flops

__all__ = ["Chain", "as_chain", "chain_plan"]


@dataclasses.dataclass(frozen=True)
class Chain:
    """Per-record facts the program needs (index ``i`` = record ``i`` = value ``v_i``)."""

    out_bytes: tuple[int, ...]  # bytes of v_i
    wanted: tuple[bool, ...]  # v_i is a residual of some record in backward
    saves_out: tuple[bool, ...]  # record i itself keeps v_i
    saves_in: tuple[bool, ...]  # record i keeps v_{i-1}: a run before it is recomputed there
    aux_bytes: tuple[int, ...]  # derived values record i keeps
    flops: tuple[float, ...]


def as_chain(tape: Tape) -> Chain | None:
    """The chain view of ``tape``, or None when the tape is not a chain."""
    if tape.regions or any(r.region is not None for r in tape.records) or not tape.records:
        return None
    free = tape.caller_ids()
    prev = None
    for rec in tape.records:
        if len(rec.outputs) != 1:
            return None
        used = {u.id for u in rec.inputs if isinstance(u, Var) and u.id not in free}
        if used != ({prev} if prev is not None else set()):
            return None
        prev = rec.outputs[0].id
    n = len(tape.records)
    wanted, saves_out, saves_in, aux = [False] * n, [False] * n, [False] * n, [0] * n
    for i, rec in enumerate(tape.records):
        if rec.rule == "none":
            continue
        outs = {o.id for o in rec.outputs}
        seen = set()
        for s in rec.saves:
            # by key: a derived value that is an input's or output's array has its key
            key = rec.residual_key(s)
            if key in free or key in seen:
                continue
            seen.add(key)
            if isinstance(key, tuple):  # ("aux", record, k)
                aux[i] += s.nbytes
                continue
            out = key in outs
            wanted[i if out else i - 1] = True
            (saves_out if out else saves_in)[i] = True
    return Chain(
        tuple(r.outputs[0].nbytes for r in tape.records),
        tuple(wanted),
        tuple(saves_out),
        tuple(saves_in),
        tuple(aux),
        tuple(record_flops(r) for r in tape.records),
    )


def chain_plan(ch: Chain, fixed: Sequence[str | None], budget: int) -> list[str] | None:
    """The least-recompute decisions whose peak (as `estimate` counts it) fits ``budget``;
    None if no plan fits. ``fixed[i]`` is a binding decision for record ``i``."""
    n = len(ch.out_bytes)
    can_save = [f in (None, "save") for f in fixed]
    can_rec = [f in (None, "recompute") for f in fixed]
    need = [ch.wanted[i] or ch.aux_bytes[i] > 0 for i in range(n)]
    kept_saved = [(ch.out_bytes[i] if ch.wanted[i] else 0) + ch.aux_bytes[i] for i in range(n)]
    own = [(ch.out_bytes[i] if ch.saves_out[i] else 0) + ch.aux_bytes[i] for i in range(n)]

    # fronts[i]: kept bytes -> (flops, back-pointer) for plans of records < i whose
    # record i-1 is saved (or i == 0). back-pointer: (prev position, prev kept, step).
    fronts: list[dict[int, tuple[float, tuple | None]]] = [dict() for _ in range(n + 1)]
    fronts[0][0] = (0.0, None)
    finals: dict[int, tuple[float, tuple | None]] = {}

    def offer(front, k, f, bp):
        if k <= budget and (k not in front or f < front[k][0]):
            front[k] = (f, bp)

    for i in range(n):
        front = _pareto(fronts[i])
        fronts[i] = front
        if not front:
            continue
        for k, (f, _) in front.items():
            if can_save[i]:
                offer(fronts[i + 1], k + kept_saved[i], f, (i, k, ("save",)))
        # Runs [i..b]: extend b while recomputing is allowed, tracking the segment
        # [i..c] (c = last needed record so far) incrementally.
        seg_in = ch.out_bytes[i - 1] if i > 0 and not ch.wanted[i - 1] else 0
        c = None
        kept_inside = 0  # wanted outputs of the segment recomputed so far
        made = 0  # and the derived values its records remake (held after it runs)
        seg_peak = 0
        seg_flops = 0.0
        at_c = (0, 0.0, 0)  # (segment_peak, flops, bytes held after) of [i..c]
        for b in range(i, n):
            if not can_rec[b]:
                break
            # segment_peak's running maximum over records i..b: kept outputs so far,
            # the previous output (freed after this record reads it), this output.
            prev_live = ch.out_bytes[b - 1] if b > i and not ch.wanted[b - 1] else 0
            peak_here = kept_inside + prev_live + ch.out_bytes[b]
            seg_peak = max(seg_peak, peak_here)
            seg_flops += ch.flops[b]
            if ch.wanted[b]:
                kept_inside += ch.out_bytes[b]
            made += ch.aux_bytes[b]
            if need[b]:
                c = b
                at_c = (seg_peak, seg_flops, kept_inside + made)
            nxt = b + 1
            if nxt < n and not can_save[nxt]:
                continue
            for k, (f, _) in front.items():
                if c is None:
                    k_in, f_new = k, f
                else:
                    k_in = k + seg_in
                    sp, sf, after = at_c
                    t_own = own[nxt] if (c == b and nxt < n and ch.saves_in[nxt]) else 0
                    # while it runs; then its input released, what it made held
                    if t_own + max(k_in + sp, k + after) > budget:
                        continue
                    f_new = f + sf
                if nxt == n:
                    if k_in <= budget and (k_in not in finals or f_new < finals[k_in][0]):
                        finals[k_in] = (f_new, (i, k, ("run", b)))
                else:
                    offer(fronts[nxt + 1], k_in + kept_saved[nxt], f_new, (i, k, ("run", b)))
    for k, (f, _) in fronts[n].items():
        if k not in finals or f < finals[k][0]:
            finals[k] = (f, fronts[n][k][1])
    if not finals:
        return None
    k_best = min(finals, key=lambda k: (finals[k][0], k))
    dec = ["save"] * n
    bp = finals[k_best][1]
    while bp is not None:
        i, k, step = bp
        if step[0] == "run":
            for j in range(i, step[1] + 1):
                dec[j] = "recompute"
        bp = fronts[i][k][1]
    return dec


def _pareto(front: dict[int, tuple[float, tuple | None]]) -> dict[int, tuple[float, tuple | None]]:
    """Drop states with more kept bytes and no fewer flops than another."""
    out, best = {}, float("inf")
    for k in sorted(front):
        f = front[k][0]
        if f < best:
            out[k] = front[k]
            best = f
    return out
