"""Per-residual mechanisms on top of a save/recompute plan: keep, offload or compress
each kept residual so the device peak fits the budget at the least added step time.

Given the save/recompute decisions (hence the recompute segments), the executor's
schedule (`problem.simulate`) fixes, for every kept residual, *when* it is released in
backward and *when* backward first unpacks it (at its first use, or one record
earlier under prefetch). What a mechanism changes is only how many device bytes the
residual holds in between:

* ``save``: its bytes from forward until its release;
* ``offload``: none while it is on host, its full bytes from the unpack on (the
  device copy), at two transfers' time;
* ``bf16`` / ``int8`` / ``4-bit`` / ``2-bit`` (compress): the packed bytes until its
  release, plus the unpacked copy from the unpack on, at a round trip's time.

So a `Timeline` is a list of points (the end of forward, each recomputation, each
backward record) with, per point, the bytes the plan holds whatever the mechanisms
(recomputed values, segment transients) and, per residual, two intervals — stored
``[0, release]`` and copied ``[unpack, release]`` — and the live device bytes of any
assignment are ``fixed + Σ stored·[t ≤ release] + Σ copy·[unpack ≤ t ≤ release]``,
linear in the choice. `assign_greedy` converts, at the current peak point, the
residual with the most bytes freed there (up to the excess) per second added, until
the plan fits, then gives back conversions that are no longer needed (costliest
first) and exchanges pairs of them where that saves time; on the `bench/ilp_bench.py`
plans it is within 0.2% of the exact assignment on average (`bench/greedy_gap.py`).
`tapegrad.planner.ilp.mechanisms` solves the same linear model exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tapegrad.core.sizes import sharding_of
from tapegrad.core.tape import Tape
from tapegrad.engine.backward_schedule import Recompute, Release, Unpack, schedule
from tapegrad.planner.cost import LOWBIT, CostModel, compressed_nbytes, device_nbytes
from tapegrad.planner.problem import loops_held, segment_cost
from tapegrad.policies._lowbit import pole

__all__ = ["Timeline", "timeline", "options", "assign_greedy", "evaluate", "pole_keys"]


@dataclasses.dataclass
class Timeline:
    """The schedule of one planned tape, as the linear model above."""

    keys: list  # residual keys that forward packs (activations, not the tape's inputs)
    vars: list  # the Var / Saved of each key (shape, dtype, sharding)
    full: np.ndarray  # device bytes of each key
    release: np.ndarray  # last point where each key is held
    unpack: np.ndarray  # first point where its unpacked copy exists
    fixed: np.ndarray  # bytes held at each point whatever the mechanisms
    recompute_flops: float
    # What happens at each point: "forward" (its end), "recompute" (a segment re-run),
    # "bwd i" (record i's backward; `memory_report`'s timeline names its steps alike).
    labels: tuple[str, ...] = ()
    # Keys the low-bit columns do not apply to: values some record divides by in
    # backward (`_lowbit.read_through_a_pole`: rounding them would bias the gradient),
    # and inputs of recomputed segments (re-run through nonlinear records, a 2-bit
    # rounding would no longer be right on average, and its error would spread).
    exact: frozenset = frozenset()

    @property
    def points(self) -> int:
        return len(self.fixed)


def timeline(tape: Tape, prefetch: int = 0, memo: dict | None = None) -> Timeline:
    """The `Timeline` of a planned tape (segments built): backward's schedule
    (`engine.backward_schedule`: prefetch, unpack at first use, release at last), as
    `problem.simulate` counts it.
    The planner builds thousands per call with `TapeIndex.timeline`, the same loop over
    per-tape facts computed once; this plain version over the tape is its reference
    (``tests/policies/test_planner_fast.py`` checks the two agree field by field) and
    serves callers that have a tape only."""
    memo = {} if memo is None else memo
    free = tape.caller_ids()
    kept, _ = tape.residual_keys()
    keys = [k for k in kept if k not in free]
    idx = {k: i for i, k in enumerate(keys)}
    full = np.array([device_nbytes(kept[k]) for k in keys], dtype=np.int64)
    K = len(keys)
    release = np.full(K, -1, dtype=np.int64)
    unpack = np.full(K, -1, dtype=np.int64)
    # bytes held whatever the mechanisms: loops' per-step residuals, recomputed values
    extra: dict[Any, int] = loops_held(tape)
    held = sum(extra.values())
    fixed: list[int] = [held]  # point 0: the end of forward
    labels = ["forward"]
    flops = 0.0
    for st in schedule(tape, prefetch).steps:
        for ev in st.events:
            if type(ev) is Unpack:
                i = idx.get(ev.key)
                if i is not None and unpack[i] < 0:
                    unpack[i] = len(fixed)  # present from the next point on
            elif type(ev) is Release:
                held -= extra.pop(ev.key, 0)
                i = idx.get(ev.key)
                if i is not None:
                    release[i] = len(fixed) - 1
            elif type(ev) is Recompute:
                seg_flops, seg_peak = segment_cost(tape, ev.segment, memo)
                flops += seg_flops
                fixed.append(held + seg_peak)
                labels.append("recompute")
                for key, v in ev.held:  # its outputs and derived residuals
                    if v is not None:
                        extra[key] = device_nbytes(v)
                        held += extra[key]
            else:
                fixed.append(held)
                labels.append(f"bwd {st.record.index}")
    last = len(fixed) - 1
    release[release < 0] = last
    never = unpack < 0
    unpack[never] = release[never] + 1
    return Timeline(
        keys,
        [kept[k] for k in keys],
        full,
        release,
        unpack,
        np.array(fixed, np.int64),
        flops,
        tuple(labels),
        pole_keys(tape) | {v.id for seg in tape.segments for v in seg.inputs},
    )


def pole_keys(tape: Tape) -> frozenset:
    """Residual keys some record of ``tape`` divides by in backward: `compress(bits=...)`
    keeps them exact (the mean of ``1 / x`` over a rounding is not ``1 / x``)."""
    return frozenset(
        rec.residual_key(s)
        for rec in tape.records
        if rec.rule != "none"
        for s in rec.saves
        if pole(rec, s)
    )


COLUMNS = ("save", "offload", "bf16", "int8", "4-bit", "2-bit")
# `np.iinfo(np.int64).max`, once: `np.iinfo` builds an object per call, and the greedy
# completion needs it thousands of times per planning call.
INT64_MAX = int(np.iinfo(np.int64).max)


@dataclasses.dataclass
class Options:
    """Per key and mechanism (columns `COLUMNS`): stored bytes, copy bytes, seconds;
    ``valid`` says which apply (``save`` always does)."""

    stored: np.ndarray  # (K, len(COLUMNS))
    copied: np.ndarray
    seconds: np.ndarray
    valid: np.ndarray

    def names(self, choice: np.ndarray) -> list[str]:
        return [COLUMNS[c] for c in choice]


def options(
    tl: Timeline, mechanisms: tuple[str, ...], costs: CostModel, rows: dict | None = None
) -> Options:
    """The mechanisms that apply to each key (``mechanisms`` among `COLUMNS`).
    ``rows`` (optional, for a search completing many plans of one tape with the same
    mechanisms and costs) caches each key's row: it depends on the key only (and on
    whether low-bit applies to it)."""
    K, M = len(tl.keys), len(COLUMNS)
    S = np.zeros((K, M), np.int64)
    C = np.zeros((K, M), np.int64)
    sec = np.zeros((K, M), np.float64)
    ok = np.zeros((K, M), bool)
    S[:, 0], ok[:, 0] = tl.full, True
    lowbit = any(m in LOWBIT for m in mechanisms)
    for k, v in enumerate(tl.vars):
        b = int(tl.full[k])
        if b <= 0:
            continue
        exact = lowbit and tl.keys[k] in tl.exact
        got = rows.get((tl.keys[k], exact)) if rows is not None else None
        if got is not None:
            S[k], C[k], sec[k], ok[k] = got
            continue
        for m in mechanisms:
            j = COLUMNS.index(m)
            if m == "offload":
                S[k, j], C[k, j], sec[k, j], ok[k, j] = 0, b, costs.offload_s(b), True
            elif not (m in LOWBIT and exact):
                sharding = sharding_of(v)
                c = compressed_nbytes(m, tuple(v.shape), v.dtype, b, sharding)
                if c is not None and c < b:
                    S[k, j], C[k, j], ok[k, j] = c, b, True
                    sec[k, j] = costs.mechanism_s(m, b)
        if rows is not None:
            rows[(tl.keys[k], exact)] = (S[k].copy(), C[k].copy(), sec[k].copy(), ok[k].copy())
    return Options(S, C, sec, ok)


def live_bytes(tl: Timeline, stored: np.ndarray, copied: np.ndarray | None = None) -> np.ndarray:
    """Device bytes at every point for per-key stored and copy bytes (none: no copies)."""
    T = tl.points
    # Per point, the bytes released after it and the copies made at it. `np.bincount`
    # sums in float64, exactly: byte counts stay far below 2**53. (`np.add.at` did the
    # same ~5x slower, and the planner calls this for every plan it scores.)
    held = stored if copied is None else stored + copied
    diff = -np.bincount(tl.release + 1, held, T + 1)
    if copied is not None:
        diff += np.bincount(tl.unpack, copied, T + 1)
    diff[0] += float(stored.sum())
    return tl.fixed + np.cumsum(diff)[:T].astype(np.int64)


def evaluate(tl: Timeline, opts: Options, choice: np.ndarray) -> tuple[int, float]:
    """(peak device bytes, seconds the mechanisms add) of ``choice`` (a column per key)."""
    r = np.arange(len(tl.keys))
    live = live_bytes(tl, opts.stored[r, choice], opts.copied[r, choice])
    return int(live.max()), float(opts.seconds[r, choice].sum())


def assign_greedy(
    tl: Timeline, opts: Options, budget: int, polish: bool = True
) -> np.ndarray | None:
    """A column per key whose peak fits ``budget`` at little added time, or None.

    Step: at the point of the current peak, among the keys stored there, take the
    change of mechanism that frees the most bytes *at that point* per second added,
    counting no more bytes than the point is over the budget (else the largest key
    always wins a tie of bytes per second, and a plan a few bytes over the budget
    offloads its biggest residual); repeat until the plan fits. Then undo, costliest
    first, every change the plan no longer needs (back to the cheapest option that
    still fits), and (``polish``) exchange changes: a key back to a cheaper option,
    another to one freeing the bytes that needs, where that adds fewer seconds
    (`_exchange`)."""
    K = len(tl.keys)
    choice = np.zeros(K, np.int64)
    if tl.points == 0 or K == 0:
        return choice if K or tl.fixed.max(initial=0) <= budget else None
    cols = np.nonzero(opts.valid.any(axis=0))[0]
    S, C, sec = opts.stored[:, cols], opts.copied[:, cols], opts.seconds[:, cols]
    valid = opts.valid[:, cols]
    pick = np.zeros(K, np.int64)  # index into cols (column 0, save, is always there)
    stored = S[:, 0].copy()
    copied = np.zeros(K, np.int64)
    spent = np.zeros(K, np.float64)
    live = live_bytes(tl, stored, copied)
    rel, unp = tl.release, tl.unpack
    # changes from the current option: bytes stored, bytes copied, seconds (and where
    # they add time, the seconds floored away from 0, for the score below)
    dS, dC, dT = S - stored[:, None], C.copy(), sec.copy()
    adds, per = dT > 0, np.maximum(dT, 1e-30)

    def apply(k: int, c: int) -> None:
        ds, dc = S[k, c] - stored[k], C[k, c] - copied[k]
        live[: rel[k] + 1] += ds
        live[unp[k] : rel[k] + 1] += dc
        stored[k], copied[k], spent[k] = S[k, c], C[k, c], sec[k, c]
        dS[k], dC[k], dT[k] = S[k] - stored[k], C[k] - copied[k], sec[k] - spent[k]
        adds[k], per[k] = dT[k] > 0, np.maximum(dT[k], 1e-30)
        pick[k] = c

    M = S.shape[1]
    for _ in range(4 * K + 4):
        t = int(np.argmax(live))
        over = int(live[t]) - budget
        if over <= 0:
            break
        delta = dS + (unp <= t)[:, None] * dC
        ok = valid & (rel >= t)[:, None] & (delta < 0)
        # freed bytes per second added (a change that also saves time: first); bytes
        # beyond the excess at this point count for nothing here. Where ``ok`` the
        # score is positive, so a best score below 0 means no change frees anything.
        freed = np.minimum(-delta, over)
        score = np.where(ok, np.where(adds, freed / per, np.inf), -1.0).ravel()
        top = int(np.argmax(score))
        if score[top] < 0:
            break
        tied = np.flatnonzero(score == score[top])
        if len(tied) > 1:  # ties: the one freeing the most (the first, row-major)
            top = int(tied[np.argmax(-delta.ravel()[tied])])
        apply(top // M, top % M)
    if live.max() > budget:
        # The steps above can trade bytes at one point for bytes at another and stall;
        # start instead from every key at its fewest bytes (`least_bytes`'s plan), which
        # fits whenever anything does, and let the refinement below buy time back.
        fewest = _fewest_bytes(opts)
        for k in range(K):
            apply(k, int(np.searchsorted(cols, fewest[k])))
        if live.max() > budget:
            return None
    # Refine: back to cheaper options where the plan still fits, costliest first.
    head = np.minimum(unp, rel + 1)  # points [0, head) hold the stored bytes only
    for k in np.argsort(-spent, kind="stable"):
        k = int(k)
        if spent[k] <= 0:
            break
        fits = _fits(live, budget, int(head[k]), int(rel[k]), dS[k], dC[k])
        fits &= valid[k] & (dT[k] < 0)
        if fits.any():
            apply(k, int(np.argmin(np.where(fits, dT[k], np.inf))))
    if polish:
        _exchange(tl, budget, live, S, C, sec, valid, pick, apply)
    choice[:] = cols[pick]
    return choice


def _fits(live: np.ndarray, budget: int, head: int, rel: int, ds: Any, dc: Any) -> Any:
    """Whether a key holding its stored bytes over [0, rel] and its copy from ``head``
    can change them by ``ds`` / ``dc`` (arrays: one per option) and still fit, the
    plan fitting now."""
    fits = live[:head].max(initial=0) + ds <= budget
    if head <= rel:
        fits &= live[head : rel + 1].max() + ds + dc <= budget
    return fits


# How many changes back to a cheaper option `_exchange` tries per completion (each
# O(keys x options + points)): the costliest keys' first.
EXCHANGE_TRIES = 8


def _exchange(
    tl: Timeline,
    budget: int,
    live: np.ndarray,
    S: np.ndarray,
    C: np.ndarray,
    sec: np.ndarray,
    valid: np.ndarray,
    pick: np.ndarray,
    apply: Any,
) -> None:
    """Pairs of changes on a plan that fits: a key ``k`` back to a cheaper option
    (more bytes over its life), and the change of another key ``j`` that frees at
    least those bytes wherever the first one makes the plan exceed the budget and
    saves the most seconds net, where some does. Costliest ``k`` first, its cheapest
    options first; sweeps again while one pair was exchanged (at most 3 sweeps)."""
    K = len(pick)
    rel, unp = tl.release, tl.unpack
    head = np.minimum(unp, rel + 1)
    span = np.stack([unp, rel + 1], 1).ravel()
    has_copy = unp <= rel
    r = np.arange(K)
    inf = INT64_MAX // 4
    tries = EXCHANGE_TRIES
    for _ in range(3):
        exchanged = False
        spent = sec[r, pick]
        order = np.argsort(-spent, kind="stable")[: int((spent > 0).sum())]
        stale = True
        for k in order:
            k = int(k)
            if tries <= 0:
                return
            if stale:  # the changes from the current options
                spent = sec[r, pick]
                jS = S - S[r, pick][:, None]
                jSC = jS + C - C[r, pick][:, None]
                jT = sec - spent[:, None]
                stale = False
            if spent[k] <= 0:
                continue
            for c in np.argsort(sec[k], kind="stable"):
                c = int(c)
                if not valid[k, c] or sec[k, c] >= spent[k]:
                    continue
                tries -= 1
                room = budget - live  # bytes left at each point once k is at c
                room[: rel[k] + 1] -= S[k, c] - S[k, pick[k]]
                room[unp[k] : rel[k] + 1] -= C[k, c] - C[k, pick[k]]
                if room.min() >= 0:  # fits alone
                    apply(k, c)
                    exchanged = stale = True
                    break
                pre = np.concatenate(([inf], np.minimum.accumulate(room)))[head]
                post = np.concatenate((np.minimum.accumulate(room[::-1])[::-1], [inf]))
                mid = np.minimum.reduceat(np.append(room, inf), span)[::2]
                mid = np.where(has_copy, mid, inf)
                ok = valid & (post[rel + 1] >= 0)[:, None] & (jS <= pre[:, None])
                ok &= jSC <= mid[:, None]
                ok[k] = False
                net = np.where(ok, spent[k] - sec[k, c] - jT, -np.inf)
                j, cj = divmod(int(np.argmax(net)), net.shape[1])
                if net[j, cj] > 1e-9 * spent[k]:
                    apply(k, c)
                    apply(j, cj)
                    exchanged = stale = True
                    break
        if not exchanged:
            return


def _fewest_bytes(opts: Options) -> np.ndarray:
    """Each key's fewest-bytes option (offload where allowed)."""
    # bytes a key holds over its life, weighted as the stored part counts everywhere
    weight = np.where(opts.valid, opts.stored * 4 + opts.copied, INT64_MAX)
    return np.argmin(weight, axis=1)


def least_bytes(tl: Timeline, opts: Options) -> int:
    """The peak with every key at its fewest-bytes option (offload where allowed): the
    floor this save/recompute plan can reach."""
    r = np.arange(len(tl.keys))
    c = _fewest_bytes(opts)
    return int(live_bytes(tl, opts.stored[r, c], opts.copied[r, c]).max()) if tl.points else 0


def least_seconds(tl: Timeline, opts: Options, budget: int) -> float:
    """A lower bound on the seconds any choice of ``opts`` that fits ``budget`` adds
    (`inf`: none fits). At the point where saving every key is furthest over the
    budget, the keys held there must free the excess; each frees at most its largest
    saving at that point, at no fewer seconds per byte than its best option's (a
    fractional knapsack, so a bound on the greedy's choice and on the exact one).

    Why: a search compares thousands of plans against the best so far; a plan whose
    recomputation plus this bound already costs more cannot beat it, and needs no
    completion (`assign_greedy`, the costliest step at tight budgets)."""
    K = len(tl.keys)
    if K == 0 or tl.points == 0 or (opts.seconds < 0).any():
        return 0.0
    base = opts.stored[:, 0]
    live = live_bytes(tl, base)
    t = int(np.argmax(live))
    over = int(live[t]) - budget
    if over <= 0:
        return 0.0
    freed = (base[:, None] - opts.stored) - (tl.unpack <= t)[:, None] * opts.copied
    ok = opts.valid & (tl.release >= t)[:, None] & (freed > 0)
    rows = np.nonzero(ok.any(axis=1))[0]
    if rows.size == 0:
        return float("inf")
    f = np.where(ok[rows], freed[rows], 0)
    rate = np.where(ok[rows], opts.seconds[rows] / np.maximum(f, 1), np.inf).min(axis=1)
    cap = f.max(axis=1)
    order = np.argsort(rate, kind="stable")
    rate, cap = rate[order], cap[order]
    before = np.cumsum(cap) - cap  # bytes freed by the cheaper keys
    if before[-1] + cap[-1] < over:
        return float("inf")
    take = np.clip(over - before, 0, cap)
    return float((rate * take).sum())
