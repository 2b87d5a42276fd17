"""Recompute instead of save: checkpoint regions, selective policies, segments.

Every record carries a *decision*: ``"save"`` (its outputs may be kept as
residuals) or ``"recompute"``. A residual whose producer is recomputed is not
kept; backward recomputes it, once per *segment* (a connected group of
recomputed records of one region), at the first backward use of any value the
segment provides, from the segment's saved inputs.

Decisions come from, in order: the record's checkpoint region (its
`jax.checkpoint` policy, or a `tg.selective` policy passed to `tg.checkpoint`),
else the residual policy's ``decide(record)`` (`tg.selective`, the budget
planner), else "save".
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, TypeGuard

import jax
import numpy as np

from tapegrad.core import jax_compat as compat
from tapegrad.core.residual_policy import (
    SAVE,
    capabilities,
    check_plan,
    declared,
    is_exact,
    keeps_exact,
)
from tapegrad.core.tape import Record, Segment, Tape, Var
from tapegrad.engine.loops.saves import outer_saves
from tapegrad.engine.rebuild import RANDOM, rebuilt_records, shared_in_body, switched

__all__ = [
    "CheckpointPolicy",
    "Selective",
    "selective",
    "plan_recompute",
]


class CheckpointPolicy(enum.Enum):
    """PyTorch's selective-checkpoint decisions.

    ALWAYS / NEVER are binding; PREFER_SAVE / PREFER_RECOMPUTE may be overridden
    by the budget planner (without a budget, PREFER_x means x).
    """

    ALWAYS = "always"
    NEVER = "never"
    PREFER_SAVE = "prefer_save"
    PREFER_RECOMPUTE = "prefer_recompute"

    @property
    def saves(self) -> bool:
        return self in (CheckpointPolicy.ALWAYS, CheckpointPolicy.PREFER_SAVE)


P = CheckpointPolicy


def _as_policy(d: Any) -> CheckpointPolicy:
    if isinstance(d, CheckpointPolicy):
        return d
    if isinstance(d, bool):
        return P.ALWAYS if d else P.NEVER
    raise TypeError(f"a selective policy must return a tg.CheckpointPolicy (or a bool), got {d!r}")


class Selective:
    """A residual policy that also decides, per record, save or recompute.

    Saved residuals go through ``base`` (default `save()`), so "save dots,
    offloaded" is ``tg.selective(fn, base=tg.policies.offload())``.
    """

    def __init__(self, fn: Callable[[Record], Any], base: Any = None):
        if not callable(fn):  # checked here, as create_selective_checkpoint_contexts does
            raise TypeError(
                f"tg.selective(fn): fn must be a function (record) -> tg.CheckpointPolicy, "
                f"got {type(fn).__name__} {fn!r}. To save some primitives, pass e.g. "
                "lambda r: P.ALWAYS if r.primitive in ('dot_general',) else P.PREFER_RECOMPUTE."
            )
        self.fn = fn
        self.base = SAVE if base is None else base

    @property
    def prefetch(self) -> int | str:
        return declared(self.base, "prefetch", 0)  # read now: a budget sets it as it plans

    def choose(self, record: Record) -> CheckpointPolicy:
        return _as_policy(self.fn(record))

    def decide(self, record: Record) -> str:
        return "save" if self.choose(record).saves else "recompute"

    def pack(self, value, info):
        return self.base.pack(value, info)

    def unpack(self, packed, info):
        return self.base.unpack(packed, info)

    # Called by jax.checkpoint when a tg.checkpoint(policy=selective) runs under jax.grad.
    def __call__(self, prim, *avals, **params) -> bool:
        ins = tuple(Var(-1, tuple(a.shape), np.dtype(a.dtype)) for a in avals)
        return self.choose(Record(-1, prim.name, ins, (), params, prim=prim)).saves

    def __repr__(self) -> str:
        return f"selective({getattr(self.fn, '__name__', '?')}, base={self.base!r})"


def selective(fn: Callable[[Record], Any], base: Any = None) -> Selective:
    """A selective-checkpoint policy: ``fn(record) -> tg.CheckpointPolicy``.

    ```python
    P = tg.CheckpointPolicy
    sac = tg.selective(lambda r: P.ALWAYS if r.primitive == "dot_general" else P.PREFER_RECOMPUTE)
    tg.grad(loss, policy=sac)(params, x)
    ```
    """
    return Selective(fn, base)


# ---------------------------------------------------------------------------
# The pass: decisions and segments.


def _region_decides(rec: Record, region) -> str:
    pol = region.policy
    if isinstance(pol, Selective):
        return pol.decide(rec)
    if rec.names:  # checkpoint_name: ask the policy as jax would, with name_p
        prim, avals, params = (
            compat.name_p,
            [jax.ShapeDtypeStruct(rec.outputs[0].shape, rec.outputs[0].dtype)],
            {"name": rec.names[0]},
        )
    else:
        prim = rec.prim
        avals = [jax.ShapeDtypeStruct(i.shape, i.dtype) for i in rec.inputs]
        params = dict(rec.params)
    return "save" if compat.policy_says_save(pol, prim, avals, params) else "recompute"


def _plan_bodies(tape: Tape, policy: Any) -> Tape:
    if not any(r.bodies for r in tape.records):
        return tape
    kept_exact = _kept_exact(policy)  # masks read off values the body keeps anyway
    caps = capabilities(policy)
    segment = caps.loop_segment  # an int, or a `LoopPlan`
    schedule = caps.loop_schedule  # nested: segment lengths by level
    revolve = caps.loop_snapshots  # binomial: snapshots held
    records = []
    for rec in tape.records:
        if rec.bodies and rec.rule != "none":
            bodies = tuple(
                plan_recompute(b, policy, decide_records(b, policy, whole=False))
                for b in (shared_in_body(b, kept_exact) for b in rec.bodies)
            )
            # the loop's schedule is chosen for the steps as its planned body keeps them
            planned = rec
            if any(b is not a for a, b in zip(rec.bodies, bodies)):
                planned = dataclasses.replace(rec, bodies=bodies)
                planned = dataclasses.replace(planned, saves=outer_saves(planned))
            snaps = int(revolve(planned)) if revolve is not None else 0
            if schedule is not None:
                levels = tuple(schedule(planned))
            elif segment is not None:
                got = segment(planned)
                levels = tuple(getattr(got, "levels", (got,)))
                snaps = int(getattr(got, "snapshots", snaps))
            else:
                levels = ()
            k, inner = (levels[0], levels[1:]) if levels and levels[0] and not snaps else (0, ())
            if (
                k != rec.schedule
                or inner != rec.inner_schedule
                or snaps != rec.snapshots
                or any(b is not a for a, b in zip(rec.bodies, bodies))
            ):
                rec = dataclasses.replace(
                    rec, bodies=bodies, schedule=k, inner_schedule=inner, snapshots=snaps
                )
                rec = dataclasses.replace(rec, saves=outer_saves(rec))
        records.append(rec)
    return dataclasses.replace(tape, records=tuple(records))


def _kept_exact(policy: Any) -> Callable[[Any], bool] | None:
    """Whether ``policy`` hands a kept value back unchanged, per value (`keeps_exact`),
    for `_rebuild`'s switches; None where it keeps every value exact (save, offload)."""
    return None if is_exact(policy) else functools.partial(keeps_exact, policy)


def decide_records(tape: Tape, policy: Any, whole: bool = True) -> list[str]:
    """Each record's decision; ``whole=False`` for a loop body, which a whole-tape
    planner (`budget`) does not plan: only binding per-record choices apply there.
    A whole tape's values that backward can rebuild for free are recomputed
    (`rebuilt_records`)."""
    return _decide(tape, policy, whole, rebuild=True)[0]


def _decide(
    tape: Tape, policy: Any, whole: bool, rebuild: bool
) -> tuple[list[str], set[int], Tape]:
    """Decisions, the records rebuilt for free, and the tape they apply to: records
    whose masks' operands are rebuilt keep those operands instead (`rebuilt_records`),
    which the planner must see to count what is kept."""
    regions = {r.id: r for r in tape.regions}
    caps = capabilities(policy)
    plan = caps.plan
    if plan is not None and not whole:
        choose = caps.planner_choose
        out = []
        for rec in tape.records:
            if rec.region is not None:
                out.append(_region_decides(rec, regions[rec.region]))
            else:
                c = choose(rec) if choose is not None else None
                out.append("recompute" if c is P.NEVER else "save")
        return out, set(), tape
    choose = caps.planner_choose if plan is not None else caps.choose
    decide = caps.decide
    fixed: list[str | None] = []
    open_: list[bool] = []  # a default or a preference, which a free rebuild may override
    for rec in tape.records:
        c = choose(rec) if choose is not None and rec.region is None else None
        if rec.region is not None:
            fixed.append(_region_decides(rec, regions[rec.region]))
        elif plan is not None:
            binding = c in (P.ALWAYS, P.NEVER)
            fixed.append(("save" if c is P.ALWAYS else "recompute") if binding else None)
        elif decide is not None:
            fixed.append(decide(rec))
        else:
            fixed.append("save")
        open_.append(rec.region is None and c in (None, P.PREFER_SAVE))
    rebuilt: set[int] = set()
    kept_exact = _kept_exact(policy)
    # A planner weighs its own rebuilds against its mechanisms (`budget`); a lossy policy
    # alone rebuilds only values whose every operand it keeps unchanged.
    if rebuild and whole and (kept_exact is None or plan is None):
        # A planner counts a recomputed segment record by record, a draw's transient (the
        # bits, the uniform floats: several times the packed mask it frees) included;
        # made binding here, that would raise the least peak it can reach. It keeps the
        # mask instead (eagerly the rebuild runs as one call, `Segment.compiled`, which
        # its cost model does not know).
        rebuilt, plain = rebuilt_records(
            tape,
            [f if f is not None else "save" for f in fixed],
            open_,
            draws=plan is None,
            kept_exact=kept_exact,
        )
        if plan is None:
            for i in rebuilt:
                fixed[i] = "recompute"
        if plain:
            tape = switched(tape, plain)
    if plan is not None:
        # A planner takes the free rebuilds as hints, not binding: under a tight budget
        # keeping the one rebuilt value can beat keeping the operands it is rebuilt from.
        # Its cost model groups every recomputed record into segments as any other
        # (`build_segments` without copies): no rebuilt set, or it would mispredict.
        got = plan(tape, fixed, rebuilt) if rebuilt else plan(tape, fixed)
        return check_plan(policy, tape, got), set(), tape
    return [f if f is not None else "save" for f in fixed], rebuilt, tape


def build_segments(
    tape: Tape, decisions: Sequence[str], copied: AbstractSet[int] = frozenset()
) -> tuple[Segment, ...]:
    """Group the recomputed records that backward needs into segments.

    A record in ``copied`` (free rebuilds) that reads no recomputed value and provides no
    residual itself joins no segments together: each segment that reads it runs its own
    copy. The zeros two CSE-merged ``jnp.where(m, x, 0.)`` share would otherwise make
    one segment of two dropouts, rebuilt together at the first one's backward."""
    producer: dict[int, Record] = {}
    for rec in tape.records:
        for o in rec.outputs:
            producer[o.id] = rec
    recompute = [d == "recompute" for d in decisions]
    needed, wanted = _needed(tape, producer, recompute)
    groups = _groups(tape, producer, recompute, needed, wanted, copied)
    return _segments(tape, producer, groups, wanted)


def _recomputed(v: object, producer: dict[int, Record], recompute: list[bool]) -> TypeGuard[Var]:
    """Whether ``v`` is the output of a recomputed record."""
    return isinstance(v, Var) and v.id in producer and recompute[producer[v.id].index]


def _needed(
    tape: Tape, producer: dict[int, Record], recompute: list[bool]
) -> tuple[set[int], dict[int, set[int]]]:
    """(the records backward re-runs, record -> the residual var ids it must provide):
    the producers of recomputed residuals and what they read, within their region."""
    needed: set[int] = set()  # record indices to recompute
    wanted: dict[int, set[int]] = {}  # record -> residual var ids it must provide
    stack: list[Record] = []
    for rec in tape.records:
        if rec.rule == "none":
            continue
        if rec.bodies and recompute[rec.index]:
            stack.append(rec)  # a loop's per-step residuals come from re-running it
        for s in rec.saves:
            if s.kind == "aux":
                if recompute[rec.index]:
                    stack.append(rec)
                continue
            v = rec.inputs[s.index] if s.kind == "in" else rec.outputs[s.index]
            if _recomputed(v, producer, recompute):
                p = producer[v.id]
                wanted.setdefault(p.index, set()).add(v.id)
                stack.append(p)
    while stack:
        rec = stack.pop()
        if rec.index in needed:
            continue
        needed.add(rec.index)
        for u in rec.inputs:
            if _recomputed(u, producer, recompute) and producer[u.id].region == rec.region:
                stack.append(producer[u.id])
    return needed, wanted


def _groups(
    tape: Tape,
    producer: dict[int, Record],
    recompute: list[bool],
    needed: set[int],
    wanted: dict[int, set[int]],
    copied: AbstractSet[int],
) -> list[list[int]]:
    """The needed records in connected groups (sorted record indices, the groups sorted):
    data edges within a region join them, a copied record joins each group that reads it."""
    # Union-find over data edges between needed records of the same region.
    parent = {i: i for i in needed}

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    # Copied: records built from kept values and literals alone (through other copies).
    copies: set[int] = set()
    for j in sorted(needed & set(copied)):
        if j not in wanted and all(
            not _recomputed(u, producer, recompute) or producer[u.id].index in copies
            for u in tape.records[j].inputs
        ):
            copies.add(j)
    for i in needed - copies:
        rec = tape.records[i]
        for u in rec.inputs:
            if isinstance(u, Var) and u.id in producer:
                j = producer[u.id].index
                if j in needed and j not in copies and tape.records[j].region == rec.region:
                    parent[find(i)] = find(j)
    groups: dict[int, list[int]] = {}
    for i in sorted(needed - copies):
        groups.setdefault(find(i), []).append(i)
    for members in groups.values():
        todo = list(members)
        while todo:
            for u in tape.records[todo.pop()].inputs:
                j = producer[u.id].index if _recomputed(u, producer, recompute) else -1
                if j in copies and j not in members:
                    members.append(j)
                    todo.append(j)
        members.sort()
    return sorted(groups.values())


def _segments(
    tape: Tape,
    producer: dict[int, Record],
    groups_l: list[list[int]],
    wanted: dict[int, set[int]],
) -> tuple[Segment, ...]:
    """The segments of the groups that provide backward something (`active_segments`),
    each pruned to what its outputs need where every wanted value stays provided."""
    regions = {r.id: r for r in tape.regions}
    inputs_of: list[dict[int, Var]] = []
    for idxs in groups_l:
        inside = {o.id for i in idxs for o in tape.records[i].outputs}
        inputs: dict[int, Var] = {}
        for i in idxs:
            for u in tape.records[i].inputs:
                if isinstance(u, Var) and u.id not in inside:
                    inputs.setdefault(u.id, u)
        inputs_of.append(inputs)
    has_aux = [any(_derives(tape.records[i]) for i in idxs) for idxs in groups_l]

    def outputs(g: int, stored: set[int]) -> list[Var]:
        return [
            o
            for i in groups_l[g]
            for o in tape.records[i].outputs
            if o.id in wanted.get(i, ()) and o.id not in stored
        ]

    active, stored = active_segments(
        inputs_of, has_aux, wanted, lambda g, stored: [o.id for o in outputs(g, stored)]
    )

    segments: list[Segment] = []
    for g in sorted(active):
        idxs = groups_l[g]
        outs = outputs(g, stored)
        region = tape.records[idxs[0]].region
        prevent = regions[region].prevent_cse if region is not None else True
        segments.append(
            Segment(len(segments), tuple(idxs), tuple(inputs_of[g].values()), tuple(outs), prevent)
        )
    pruned = tuple(_prune(tape, seg, producer) for seg in segments)
    kept = {v.id for seg in pruned for v in seg.inputs}
    provided = {o.id for seg in pruned for o in seg.outputs}
    if all(v in kept or v in provided for ws in wanted.values() for v in ws):
        return pruned
    return tuple(segments)


def active_segments(
    inputs_of: Sequence[Any],
    has_aux: Sequence[bool],
    wanted: dict[int, set[int]],
    provides: Callable[[int, set[int]], Sequence[int]],
) -> tuple[set[int], set[int]]:
    """Which candidate segments to keep, and the value ids kept as their inputs.

    A value some segment keeps as an input is stored, so no segment needs to recompute
    it; a segment left with nothing to provide (``provides(g, stored)``: the wanted
    output ids it would recompute) and no derived residual is dropped (e.g. a
    checkpointed layer with one activation, which is the next layer's input). Not
    converged after a few rounds, or a wanted value left unprovided: keep every segment
    (always correct)."""
    n = len(inputs_of)
    active = set(range(n))
    for _ in range(8):
        stored = {v for g in active for v in inputs_of[g]}
        new = {g for g in range(n) if has_aux[g] or provides(g, stored)}
        if new == active:
            break
        active = new
    stored = {v for g in active for v in inputs_of[g]}
    provided = {o for g in active for o in provides(g, stored)}
    if any(v not in stored and v not in provided for ws in wanted.values() for v in ws):
        active = set(range(n))
        stored = {v for g in active for v in inputs_of[g]}
    return active, stored


def _derives(rec: Record) -> bool:
    """Whether re-running ``rec`` provides backward something besides its outputs: derived
    (``aux``) residuals, or a loop's per-step residuals."""
    return rec.rule != "none" and (bool(rec.bodies) or any(s.kind == "aux" for s in rec.saves))


def _prune(tape: Tape, seg: Segment, producer: dict[int, Record]) -> Segment:
    """Keep only the records a segment needs to produce its outputs (and derived values)."""
    members = set(seg.records)
    keep: set[int] = set()
    stack = [producer[o.id].index for o in seg.outputs]
    stack += [i for i in seg.records if _derives(tape.records[i])]
    while stack:
        i = stack.pop()
        if i in keep:
            continue
        keep.add(i)
        for u in tape.records[i].inputs:
            if isinstance(u, Var) and u.id in producer and producer[u.id].index in members:
                stack.append(producer[u.id].index)
    idxs = tuple(sorted(keep))
    inside = {o.id for i in idxs for o in tape.records[i].outputs}
    inputs: dict[int, Var] = {}
    for i in idxs:
        for u in tape.records[i].inputs:
            if isinstance(u, Var) and u.id not in inside:
                inputs.setdefault(u.id, u)
    return Segment(seg.id, idxs, tuple(inputs.values()), seg.outputs, seg.prevent_cse)


def segment_peak(tape: Tape, seg: Segment) -> int:
    """Peak bytes a segment's recomputation holds: outputs kept so far plus the
    intermediates still needed (the interpreter frees them at their last use); a
    ``compiled`` segment's, its outputs alone (its intermediates live inside the one
    call, never as arrays)."""
    if seg.compiled:
        return sum(o.nbytes for o in seg.outputs)
    keep = {o.id for o in seg.outputs}
    last: dict[int, int] = {}
    for k in seg.records:
        for u in tape.records[k].inputs:
            if isinstance(u, Var):
                last[u.id] = k
    live, peak = 0, 0
    sizes: dict[int, int] = {}
    for k in seg.records:
        rec = tape.records[k]
        for o in rec.outputs:
            sizes[o.id] = o.nbytes
            live += o.nbytes
        peak = max(peak, live)
        for u in rec.inputs:
            if isinstance(u, Var) and last.get(u.id) == k and u.id in sizes and u.id not in keep:
                live -= sizes.pop(u.id)
        for o in rec.outputs:
            if o.id not in last and o.id not in keep and o.id in sizes:
                live -= sizes.pop(o.id)
    return peak


def plan_recompute(
    tape: Tape,
    policy: Any = None,
    decisions: Sequence[str] | None = None,
    rebuild: bool = True,
) -> Tape:
    """Tape pass: set each record's decision and build the recompute segments.

    Loop and branch bodies are planned first, record by record (`selective`, checkpoint
    regions inside the body): a body's segments recompute within one step. ``rebuild``:
    values backward can rebuild from what it keeps anyway are not kept
    (`rebuilt_records`); off where forward and backward run as one compiled call, in
    which nothing is held between them."""
    tape = _plan_bodies(tape, policy)
    rebuilt: set[int] = set()
    if decisions is None:
        decisions, rebuilt, tape = _decide(tape, policy, True, rebuild)
    if all(d == "save" for d in decisions) and all(r.decision == "save" for r in tape.records):
        return tape
    # A record whose decision stands is the very object (its cached fused key with it).
    records = tuple(
        r if r.decision == d else dataclasses.replace(r, decision=d)
        for r, d in zip(tape.records, decisions)
    )
    segs = build_segments(dataclasses.replace(tape, records=records), decisions, rebuilt)
    if rebuilt:  # a segment of free rebuilds alone needs no barrier against CSE
        # Eagerly, a draw rebuilt op by op would hold its random bits and floats, several
        # times the mask it frees, while backward rebuilds it: it runs as one compiled
        # call instead, where XLA fuses the draw into the mask (integer ops and
        # comparisons: the very bits forward drew). Float chains alone stay op by op:
        # XLA may fuse a multiply and an add into one rounding, and a rebuilt value must
        # be the one forward computed.
        segs = tuple(
            dataclasses.replace(
                g,
                prevent_cse=False,
                compiled=any(records[i].primitive in RANDOM for i in g.records),
            )
            if rebuilt.issuperset(g.records)
            else g
            for g in segs
        )
    return dataclasses.replace(tape, records=records, segments=segs)
