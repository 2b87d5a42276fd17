"""The exact joint planner for chains: save, recompute and, per kept residual,
offload or compress, chosen together by one dynamic program over the chain.

`chain` plans save/recompute alone; the mechanisms then complete a plan
(`joint`). That is not exact: the recompute plan best combined with offload
is in general none of the save/recompute search's plans. Here (as in Beaumont et al.
2021, "Efficient Combination of Rematerialization and Offloading for Training
DNNs") the program chooses both, and scores exactly what `joint.timeline`
and `evaluate` compute for the plan it returns.

A plan is a sequence of *units*: a run of recomputed records ``a..s-1`` (maybe
empty) and the saved record ``s`` after it (a last unit may be a run to the end).
Backward visits a unit's points (`Timeline`: a recomputation point ``R``, then one
point ``Q`` per record) together, from ``s`` down to ``a``. At those points the live
device bytes are

* the stored bytes of every kept residual left of the unit (all still held: a chain
  releases a value at its own record or the next one) — the program's state;
* the unit's own fixed bytes: its segment's recomputation peak at ``R``, then the
  recomputed values until their last use;
* copies and stored bytes of a window of residuals: the value entering the run
  ``v[a-1]`` (unpacked at the recomputation, at its first use, or one record early
  under prefetch), the derived values of record ``a-1`` and its input ``v[a-2]``
  (prefetched at record ``a``), and record ``s``'s own residuals.

So the state after a unit is the position ``s``, the stored bytes so far, and what
the next unit reads of this window (copy bytes of ``v[s]``, of ``s``'s derived
values, of ``v[s-1]``; ``v[s]`` is *pending* when only a following run would keep
it, as its input). One Pareto front of (stored bytes, seconds) per state, pruned at
the budget, gives the least predicted time exactly. The seconds are
`CostModel.recompute_s` of the runs' flops plus each residual's mechanism seconds.
``tests/policies/test_planner_chain_joint.py`` checks the result against brute force
over every save/recompute and mechanism assignment scored by `timeline`/`evaluate`.

Chains with records backward skips, loop bodies, or a prefetch depth above one are
left to the two-stage planner (`joint_chain` returns None).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from tapegrad.core.tape import Tape, Var
from tapegrad.planner import joint
from tapegrad.planner.chain import as_chain
from tapegrad.planner.cost import CostModel, device_nbytes

__all__ = ["JointChain", "joint_chain", "chain_joint_plan", "candidates"]

# Longer chains keep the two-stage plans alone: the program's fronts grow with the
# chain, and its planning time with them (32-layer MLP, 66 records: ~0.6 s for the whole
# plan; 100 layers: ~7 s; 330 layers: ~2 min, measured on the 2-core CPU machine).
MAX_RECORDS = 128

PENDING = -1  # sig: v[s] kept only if the next unit starts with a recomputation


@dataclasses.dataclass(frozen=True)
class JointChain:
    """Per-record facts (index ``i`` = record ``i`` = value ``v[i]``)."""

    n: int
    nbytes: tuple[int, ...]  # v[i]'s bytes (segment peaks count these)
    dbytes: tuple[int, ...]  # v[i]'s device bytes (residuals, recomputed values)
    key: tuple[Any, ...]  # residual key of v[i]
    wanted: tuple[bool, ...]
    saves_out: tuple[bool, ...]
    saves_in: tuple[bool, ...]
    need: tuple[bool, ...]  # a recomputation must run record i (v[i] wanted, or aux)
    aux: tuple[tuple[Any, ...], ...]  # aux residual keys of record i
    # record i's first save of v[i] / of each aux, before its first save of v[i-1]?
    out_first: tuple[bool, ...]
    aux_first: tuple[tuple[bool, ...], ...]
    flops: tuple[float, ...]
    vars: dict  # residual key -> Var / Saved


def joint_chain(tape: Tape, prefetch: int) -> JointChain | None:
    """The chain view of ``tape`` for this program, or None when it does not apply."""
    ch = as_chain(tape)
    if ch is None or prefetch not in (0, 1):
        return None
    if any(r.rule == "none" or r.bodies for r in tape.records):
        return None
    free = tape.caller_ids()
    n = len(tape.records)
    aux: list[tuple] = []
    out_first, aux_first = [], []
    vars_: dict = {}
    for rec in tape.records:
        first_in = None
        first_out = None
        ak, af = [], []
        for j, s in enumerate(rec.saves):
            if s.kind == "aux":
                k = rec.residual_key(s)
                if k not in vars_:
                    vars_[k] = s
                    ak.append(k)
                    af.append(j)
                continue
            v = rec.inputs[s.index] if s.kind == "in" else rec.outputs[s.index]
            if not isinstance(v, Var) or v.id in free:
                continue
            if s.kind == "in" and first_in is None:
                first_in = j
            if s.kind == "out" and first_out is None:
                first_out = j
        big = len(rec.saves) + 1
        fi = big if first_in is None else first_in
        out_first.append(first_out is not None and first_out < fi)
        aux.append(tuple(ak))
        aux_first.append(tuple(j < fi for j in af))
        vars_[rec.outputs[0].id] = rec.outputs[0]
    outs = [r.outputs[0] for r in tape.records]
    need = tuple(ch.wanted[i] or bool(aux[i]) for i in range(n))
    return JointChain(
        n,
        tuple(o.nbytes for o in outs),
        tuple(device_nbytes(o) for o in outs),
        tuple(o.id for o in outs),
        ch.wanted,
        ch.saves_out,
        ch.saves_in,
        need,
        tuple(aux),
        tuple(out_first),
        tuple(aux_first),
        ch.flops,
        vars_,
    )


@dataclasses.dataclass
class _Unit:
    """The backward points of records ``top..a`` (a run ``a..b``, then ``s`` saved)."""

    points: int
    fixed: np.ndarray  # bytes held whatever the mechanisms
    flops: float  # of the segment
    seg: bool  # a segment is recomputed
    r_t: int  # index of the recomputation point (-1: none)
    f_a: int  # index of record a's first point (its prefetch)
    vprev: np.ndarray  # where v[a-1]'s copy lives, when it is kept anyway
    s_pts: int  # how many leading points are record s's (R_s, Q_s)
    seg_peak: int  # grows with the run: past the budget, longer runs fit no better


def _unit(ch: JointChain, a: int, top: int, has_s: bool, prefetch: int) -> _Unit:
    n = ch.n
    b = top - 1 if has_s else top
    c = max((j for j in range(a, b + 1) if ch.need[j]), default=None)
    T = None
    if c is not None:
        T = c + 1 if (c + 1 < n and ch.saves_in[c + 1]) else c
    idx_r, idx_q = -1, {}
    pts = 0
    for j in range(top, a - 1, -1):
        if j == T:
            idx_r = pts
            pts += 1
        idx_q[j] = pts
        pts += 1
    fixed = np.zeros(pts, np.int64)
    flops = 0.0
    seg_peak = 0
    if c is not None and T is not None:
        # the segment's recomputation peak, as `_checkpoint.segment_peak` counts it
        kept_inside, seg_peak = 0, 0
        for j in range(a, c + 1):
            prev_live = ch.nbytes[j - 1] if j > a and not ch.wanted[j - 1] else 0
            seg_peak = max(seg_peak, kept_inside + prev_live + ch.nbytes[j])
            if ch.wanted[j]:
                kept_inside += ch.nbytes[j]
            flops += ch.flops[j]
        fixed[idx_r] = seg_peak
        # recomputed values, held from the recomputation (Q_T) to their last use
        diff = np.zeros(pts + 1, np.int64)
        for m in range(a, c + 1):
            if ch.wanted[m]:
                last = m if ch.saves_out[m] else m + 1
                diff[idx_q[T]] += ch.dbytes[m]
                diff[idx_q[last] + 1] -= ch.dbytes[m]
        fixed += np.cumsum(diff)[:pts]

    def first(j: int) -> int:
        return idx_r if j == T else idx_q[j]

    f_a = first(a)
    vprev = np.zeros(pts, np.int64)
    if a >= 1 and ch.wanted[a - 1]:
        cands = []
        if prefetch and ch.saves_out[a - 1]:
            cands.append(f_a)
        if ch.saves_in[a]:
            cands.append(f_a)
            if prefetch and a + 1 < n:
                cands.append(first(a + 1) if a + 1 <= top else -1)
        if c is not None:
            cands.append(idx_r)
        unp = min(cands, default=pts)
        rel = idx_q[a] if not ch.saves_out[a - 1] else pts - 1
        lo = max(unp, 0)
        vprev[lo : rel + 1] = 1
    s_pts = 0
    if has_s:
        s_pts = 2 if T == top else 1
    return _Unit(pts, fixed, flops, c is not None, idx_r, f_a, vprev, s_pts, seg_peak)


def _key_options(ch: JointChain, keys: list, mechanisms: tuple[str, ...], costs: CostModel):
    """Per key: the list of (column, stored, copied, seconds) `joint.options` allows."""
    if not keys:
        return {}
    full = np.array([device_nbytes(ch.vars[k]) for k in keys], dtype=np.int64)
    z = np.zeros(len(keys), np.int64)
    tl = joint.Timeline(keys, [ch.vars[k] for k in keys], full, z, z, z[:1], 0.0)
    opts = joint.options(tl, mechanisms, costs)
    out = {}
    for i, k in enumerate(keys):
        out[k] = [
            (c, int(opts.stored[i, c]), int(opts.copied[i, c]), float(opts.seconds[i, c]))
            for c in range(len(joint.COLUMNS))
            if opts.valid[i, c]
        ]
    return out


def _pareto(S: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Indices of the (stored bytes, seconds) Pareto front, by increasing bytes."""
    order = np.lexsort((t, S))
    ts = t[order]
    best = np.minimum.accumulate(ts)
    keep = np.ones(len(ts), bool)
    keep[1:] = ts[1:] < best[:-1]
    return order[keep]


def chain_joint_plan(
    ch: JointChain,
    fixed: Sequence[str | None],
    budget: int,
    mechanisms: tuple[str, ...],
    costs: CostModel,
    prefetch: int,
    bound: float = np.inf,
) -> tuple[list[str], dict, float, int] | None:
    """(decisions, residual key -> mechanism column, predicted seconds, stored bytes) of
    the least-time plan whose device peak fits ``budget``; None if none fits.

    ``bound``: seconds of a plan already known (another planner's); partial plans
    slower than it are dropped (seconds only grow along the chain), so the program
    returns its optimum if that is at most ``bound``, else None."""
    n = ch.n
    keys = [ch.key[i] for i in range(n)] + [k for ks in ch.aux for k in ks]
    prog = _Program(
        ch, fixed, budget, _key_options(ch, keys, mechanisms, costs), costs, prefetch, bound
    )
    for p in range(-1, n - 1):
        # the states after record p: before the chain, none kept yet
        here: list[tuple[tuple, int | None]] = [((PENDING, 0, 0, None), 0)]
        if p >= 0:
            here = [(sig, prog.merged(parts)) for sig, parts in prog.pend[p].items()]
        for sig, fid in here:
            if fid is not None:
                prog.extend(p + 1, sig, fid)
    prog.end_at_last_record()
    best = _best_entry(prog.final)
    if best is None:
        return None
    dec, mech = _backtrack(ch, prog.trans, prog.stores, best)
    return dec, mech, best[0], best[1]


class _Program:
    """The program's tables as it runs: the fronts (`stores`), the transitions taken, the
    parts of each state's front not merged yet (`pend`), and the terminal entries."""

    def __init__(
        self,
        ch: JointChain,
        fixed: Sequence[str | None],
        budget: int,
        opt: dict,
        costs: CostModel,
        prefetch: int,
        bound: float,
    ):
        self.ch, self.budget, self.opt = ch, budget, opt
        self.costs, self.prefetch, self.bound = costs, prefetch, bound
        self.can_save = [f in (None, "save") for f in fixed]
        self.can_rec = [f in (None, "recompute") for f in fixed]
        self.units: dict[tuple, _Unit] = {}
        self.trans: list[tuple] = []  # (a, top, has_s, pending column, v[s] column, aux columns)
        # pend[s][sig]: parts of the front of states (s, sig), each (stored bytes, seconds,
        # parent front id, parent index, transition), merged when the program reaches s
        self.pend: list[dict[tuple, list]] = [dict() for _ in range(ch.n)]
        self.final: list = []
        # front id -> (S, t, parent fid, parent idx, trans); front 0: nothing planned yet
        self.stores: list[tuple] = [
            (np.zeros(1, np.int64), np.zeros(1), np.full(1, -1), np.zeros(1, int), np.full(1, -1))
        ]

    def merged(self, parts: list) -> int | None:
        """The Pareto front of ``parts`` stored as a new front: its id, None if empty."""
        S = np.concatenate([p[0] for p in parts])
        t = np.concatenate([p[1] for p in parts])
        keep = _pareto(S, t)
        if not len(keep):
            return None
        self.stores.append(
            (S[keep], t[keep], *(np.concatenate([p[j] for p in parts])[keep] for j in (2, 3, 4)))
        )
        return len(self.stores) - 1

    def extend(self, a: int, sig: tuple, fid: int) -> None:
        """Every unit from record ``a`` on after the states ``sig`` of front ``fid``: what
        fits goes to the front of the state after the unit, or is a terminal entry."""
        ch, n, budget = self.ch, self.ch.n, self.budget
        S0 = self.stores[fid][0]
        vkind, aux_copy, prev_copy, promise = sig
        for top in range(a, n + 1):
            # top < n: run a..top-1 then top saved; top == n: a run to the end
            if top > a and not self.can_rec[top - 1]:
                break
            has_s = top < n
            if has_s and not self.can_save[top]:
                continue
            last = top if has_s else n - 1
            key = (a, last, has_s)
            u = self.units.get(key)
            if u is None:
                u = self.units[key] = _unit(ch, a, last, has_s, self.prefetch)
            if u.seg_peak > budget - S0[0]:
                break
            if promise is not None and promise != u.seg:
                continue
            base = u.fixed.copy()
            if a >= 1 and vkind != PENDING:
                base += vkind * u.vprev
            if self.prefetch and a >= 1:
                extra = aux_copy + (prev_copy if ch.saves_in[a - 1] else 0)
                base[u.f_a :] += extra
            rec_s = self.costs.recompute_s(u.flops) if u.flops else 0.0
            pend_opts: list = [(None, 0, 0, 0.0)]
            if a >= 1 and vkind == PENDING and u.seg:
                pend_opts = self.opt[ch.key[a - 1]]
            for pc, pst, pcp, psec in pend_opts:
                b2 = base
                if pc is not None:
                    b2 = base.copy()
                    b2[: u.r_t + 1] += pst
                    b2[u.r_t] += pcp
                rest = int(b2[u.s_pts :].max()) if u.points > u.s_pts else 0
                if has_s:
                    self.save_top(fid, a, top, u, b2, rest, vkind, pc, pst, psec + rec_s)
                else:
                    self.run_to_end(fid, a, rest, pc, pst, psec + rec_s)

    def save_top(
        self, fid: int, a: int, top: int, u: _Unit, b2, rest: int, vkind: int, pc, pst, secs
    ) -> None:
        """The unit ``a..top`` with record ``top`` saved, each of its choices for ``top``'s
        residuals: the partial plans that fit, a part of the next state's front."""
        S0, t0 = self.stores[fid][0], self.stores[fid][1]
        budget = self.budget
        own = _own(self.ch, top, u, b2, self.opt, self.prefetch, vkind, a)
        for vs, auxs, dS, dt, m, nsig in _undominated(own, rest):
            k = int(np.searchsorted(S0, budget - m, side="right"))
            if k == 0:
                continue
            S = S0[:k] + (pst + dS)
            t = t0[:k] + (secs + dt)
            keep = (S <= budget) & (t <= self.bound)
            if not keep.any():
                continue
            tr = len(self.trans)
            self.trans.append((a, top, True, pc, vs, auxs))
            S, idx = S[keep], np.arange(k)[keep]
            self.pend[top].setdefault(nsig, []).append(
                (S, t[keep], np.full(len(S), fid), idx, np.full(len(S), tr))
            )

    def run_to_end(self, fid: int, a: int, rest: int, pc, dS, dt) -> None:
        """A run from record ``a`` to the end after the front ``fid``: what fits is a
        terminal entry."""
        tr = len(self.trans)
        self.trans.append((a, self.ch.n, False, pc, None, ()))
        S0, t0 = self.stores[fid][0], self.stores[fid][1]
        k = int(np.searchsorted(S0, self.budget - rest, side="right"))
        if k == 0:
            return
        S = S0[:k] + dS
        t = t0[:k] + dt
        keep = (S <= self.budget) & (t <= self.bound)
        self.final.append(
            (
                S[keep],
                t[keep],
                np.full(int(keep.sum()), fid),
                np.arange(k)[keep],
                np.full(int(keep.sum()), tr),
            )
        )

    def end_at_last_record(self) -> None:
        """The states at the last record (but those promising a recomputation after it)
        as terminal entries."""
        stores = self.stores
        for sig, parts in self.pend[self.ch.n - 1].items():
            if sig[3] is True:
                continue
            end = self.merged(parts)
            if end is not None:
                S, t = stores[end][0], stores[end][1]
                self.final.append(
                    (S, t, np.full(len(S), end), np.arange(len(S)), np.full(len(S), -2))
                )


def _best_entry(final: list) -> tuple[float, int, int, int, int] | None:
    """(seconds, stored bytes, front id, index, transition) of the fastest terminal entry
    (then the fewest bytes): a final run (transition >= 0, its parent the state before
    it) or a state at the last record (transition -2: the entry itself); None if none."""
    best = None
    for S, t, pfid, pidx, tr in final:
        if not len(t):
            continue
        j = int(np.argmin(t))
        cand = (float(t[j]), int(S[j]), int(pfid[j]), int(pidx[j]), int(tr[j]))
        if best is None or cand[:2] < best[:2]:
            best = cand
    return best


def _backtrack(ch: JointChain, trans: list, stores: list, best: tuple) -> tuple[list[str], dict]:
    """The decisions and mechanism columns of the plan ending at terminal entry ``best``,
    from its transitions back to the chain's start."""
    _, _, fid, k, tr = best
    dec = ["save"] * ch.n
    mech: dict = {}
    if tr == -2:
        tr = int(stores[fid][4][k])
        fid, k = int(stores[fid][2][k]), int(stores[fid][3][k])
    while tr >= 0:
        a, top, has_s, pc, vs, auxs = trans[tr]
        end = top if has_s else ch.n
        for j in range(a, end):
            dec[j] = "recompute"
        if pc is not None:
            mech[ch.key[a - 1]] = pc
        if has_s:
            if vs is not None:
                mech[ch.key[top]] = vs
            for kk, cc in zip(ch.aux[top], auxs):
                mech[kk] = cc
        if fid <= 0:
            break
        tr = int(stores[fid][4][k])
        fid, k = int(stores[fid][2][k]), int(stores[fid][3][k])
    return dec, mech


def _undominated(own: list, rest: int) -> list:
    """``own`` with each live peak raised to ``rest``, less the choices another with the
    same next state beats on peak, stored bytes and seconds at once."""
    rows = [(vs, auxs, dS, dt, max(rest, live), nsig) for vs, auxs, dS, dt, live, nsig in own]
    keep = []
    for r in rows:
        if not any(
            o is not r
            and o[5] == r[5]
            and o[4] <= r[4]
            and o[2] <= r[2]
            and o[3] <= r[3]
            and (o[4], o[2], o[3]) != (r[4], r[2], r[3])
            for o in rows
        ):
            keep.append(r)
    return keep


def _own(ch, s, u, b2, opt, prefetch, vkind, a):
    """Record ``s``'s choices: (v[s] column, aux columns, stored added, seconds added,
    live bytes at s's points beyond the state's, the next state)."""
    n = ch.n
    has_r = u.s_pts == 2
    base_s = b2[: u.s_pts]
    nxt = s + 1 < n
    early_all = bool(prefetch and nxt)
    v_opts = opt[ch.key[s]] if ch.wanted[s] else [(None, 0, 0, 0.0)]
    # v[s]'s copy at R_s: unpacked before it, unless only s itself and (maybe) a
    # following recomputation use it; then the next unit decides (a promise).
    v_early = early_all or (nxt and ch.saves_in[s + 1]) or ch.out_first[s]
    aux_opts = [opt[k] for k in ch.aux[s]]
    aux_early = [early_all or f for f in ch.aux_first[s]]
    results = []
    for combo in itertools.product(*aux_opts) if aux_opts else [()]:
        a_st = sum(o[1] for o in combo)
        a_cp_q = sum(o[2] for o in combo)
        a_cp_r = sum(o[2] for o, e in zip(combo, aux_early) if e)
        a_sec = sum(o[3] for o in combo)
        for vc, vst, vcp, vsec in v_opts:
            held = vst if ch.saves_out[s] else 0
            cp_q = vcp if ch.saves_out[s] else 0
            promises = [None]
            if has_r and cp_q and not v_early and nxt:
                promises = [True, False]
            for pr in promises:
                cp_r = cp_q if (v_early or pr) else 0
                live_q = int(base_s[-1]) + held + a_st + cp_q + a_cp_q
                live = live_q
                if has_r:
                    live = max(live, int(base_s[0]) + held + a_st + cp_r + a_cp_r)
                vk = PENDING if vc is None else vcp
                aux_copy = a_cp_q if prefetch else 0
                prev_copy = 0
                if prefetch and a == s and s >= 1 and ch.saves_in[s] and vkind != PENDING:
                    prev_copy = vkind
                nsig = (vk, aux_copy, prev_copy, pr)
                results.append(
                    (vc, tuple(o[0] for o in combo), vst + a_st, vsec + a_sec, live, nsig)
                )
    return results


def candidates(
    tape: Tape,
    sc: Any,
    fixed: Sequence[str | None],
    budget: int,
    mechanisms: tuple[str, ...],
    prefetch: int,
    costs: CostModel,
    bound: float = np.inf,
) -> list[list[Any]]:
    """The program's plan as a joint-planner candidate ``[total, recompute seconds,
    decisions, family, how, timeline, options, choice]`` scored by `joint.timeline` and
    `joint.evaluate` (empty when the tape is not such a chain, or when nothing fits in
    at most ``bound`` seconds: the best candidate so far)."""
    if len(tape.records) > MAX_RECORDS:
        return []
    ch = joint_chain(tape, prefetch)
    if ch is None:
        return []
    got = chain_joint_plan(ch, fixed, budget, mechanisms, costs, prefetch, bound)
    if got is None:
        return []
    dec, mech = tuple(sc.with_fixed(got[0])), got[1]
    tl = sc.timeline(dec, prefetch)
    opts = joint.options(tl, mechanisms, costs)
    choice = np.array([mech.get(k, 0) for k in tl.keys], dtype=np.int64)
    if len(choice) and not opts.valid[np.arange(len(choice)), choice].all():
        return []
    rec_s = costs.recompute_s(tl.recompute_flops)
    total = rec_s + joint.evaluate(tl, opts, choice)[1]
    return [[total, rec_s, dec, "joint chain DP", "DP", tl, opts, choice]]
