"""The joint ILP's columns (`ilp_joint_model` states the formulation and why it is a
relaxation; `ilp_joint_rows` writes its rows): which values may be kept and with which
mechanism (``y``), each re-runnable record's run window (``z``) and the points before
it (``r``), the held bytes ``h`` / ``c`` / ``g``, the member pairs ``s`` and prefixes
``m`` of the run rows, and each column's cost, bounds and integrality. `layout` numbers
them in that order (``x`` first, one per record; ``b[t]`` last, one per point) into a
`Layout`, the plain data the rows are written from.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from tapegrad.core.tape import Record, Tape, Var
from tapegrad.planner import joint
from tapegrad.planner.cost import CostModel, device_nbytes, record_flops
from tapegrad.planner.problem import _keep_effects

__all__ = ["Flags", "Layout", "layout"]


class Flags(NamedTuple):
    """`ilp_joint_model`'s switches (`SUPPORT_LAYERS`, ...), read when a model is built."""

    support_layers: int
    member_depth: int
    member_paths: int
    input_depth: int
    pruned: bool
    prefix: bool


@dataclasses.dataclass
class Layout:
    """What the rows are written from: the tape's facts (records, producers, backward's
    order of points, the candidate kept values ``keys`` with their first and last
    residual use and re-runnable readers, their options per mechanism), and the columns
    in `layout`'s order with what each stands for."""

    recs: Sequence[Record]
    n: int  # records: columns x[0..n-1]
    fixed: list  # binding decisions, records with side effects fixed to "save"
    producer: dict[int, int]  # value id -> its record
    order: list[int]  # the record backward runs at each point 1..T-1
    T: int  # points: 0 (the end of forward) and 1..T-1
    can_rerun: np.ndarray  # per record
    first: dict  # residual key -> its first use (point)
    last: dict  # residual key -> its last use (point)
    readers: dict[int, list[int]]  # value id -> records that may be re-run reading it
    keys: list  # candidate kept values
    kidx: dict  # key -> its index
    full: np.ndarray  # device bytes of each key
    opts: joint.Options  # per key: stored / copy bytes and seconds per mechanism
    kprod: np.ndarray  # record producing each key
    ycols: list  # (key index, mechanism column) of each y
    hbytes: np.ndarray  # (keys, mechanisms): bytes an h counts
    col: int = 0  # the next free column while `layout` numbers them
    need: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    win: dict = dataclasses.field(default_factory=dict)  # record -> (first z point, need, col)
    before: dict = dataclasses.field(default_factory=dict)  # record -> column of r[i, 1]
    holds: list = dataclasses.field(default_factory=list)  # per h: (col, key, points, pairs)
    claims: list = dataclasses.field(default_factory=list)  # (h col, key, reader q, bytes)
    shadows: list = dataclasses.field(default_factory=list)  # (c, h, key, q, bytes, r col)
    early: list = dataclasses.field(default_factory=list)  # per g: (col, key, points, pairs)
    adj: dict = dataclasses.field(default_factory=dict)  # re-runnable neighbours
    one: int = -1  # a column fixed to 1 (the run rows' constants), -1: none
    pairs: dict = dataclasses.field(default_factory=dict)  # (a, q) -> column of s[a, q]
    paths: dict = dataclasses.field(default_factory=dict)  # (a, q) -> paths of neighbours
    held_at: dict = dataclasses.field(default_factory=dict)  # q -> (bytes, a, reader)
    inputs_at: dict = dataclasses.field(default_factory=dict)  # q -> member a -> its inputs
    res: dict = dataclasses.field(default_factory=dict)  # record -> its residuals' bytes
    most: dict = dataclasses.field(default_factory=dict)  # q -> the most m[q] can be
    prefix: dict = dataclasses.field(default_factory=dict)  # q -> column of m[q]
    b0: int = 0  # b[t] is column b0 + t
    ncol: int = 0
    cost: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    upper: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    integer: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))
    ycol_of: list = dataclasses.field(default_factory=list)  # key -> its y columns

    def prod(self, key: Any) -> int:
        """The record producing residual key ``key`` (-1: a tape input or constant)."""
        return key[1] if isinstance(key, tuple) else self.producer.get(key, -1)

    def z_col(self, i: int, t: int) -> int | None:
        """The column for "re-run record ``i`` has run by point ``t``" (``x[i]`` from
        its need on; None before its window, where it is not modelled)."""
        win = self.win
        if i not in win or t >= win[i][1]:
            return i
        s, _, c = win[i]
        return c + t - s if t >= s else None

    def run_col(self, i: int, t: int) -> int | None:
        """`z_col`, or before ``i``'s window the column of ``r[i, t]`` where it has one."""
        c = self.z_col(i, t)
        before = self.before
        return before[i] + t - 1 if c is None and i in before and t >= 1 else c


def layout(
    tape: Tape,
    fixed: Sequence[str | None],
    mechanisms: tuple[str, ...],
    costs: CostModel,
    prefetch: int,
    window: int | None,
    early_runs: bool,
    flags: Flags,
) -> Layout | None:
    """The columns of `ilp_joint_model.build`'s model, numbered; None on tapes with
    checkpoint regions or loop/branch records (outside the model's argument)."""
    if any(r.region is not None or r.bodies for r in tape.records):
        return None
    L = _values(tape, fixed, mechanisms, costs, early_runs)
    _windows(L, window, early_runs)
    _holds(L)
    _early(L, prefetch)
    _members(L, early_runs, flags)
    _prefix(L, early_runs, flags)
    _bounds(L, costs)
    return L


def _spans(points: range, key: Callable[[int], Any]) -> list[tuple[range, Any]]:
    """The maximal runs of consecutive ``points`` with one ``key`` (None: the point is
    skipped), each as its range of points and that key."""
    out: list[tuple[range, Any]] = []
    for t in points:
        k = key(t)
        if k is None:
            continue
        if out and out[-1][1] == k and out[-1][0].stop == t:
            out[-1] = (range(out[-1][0].start, t + 1), k)
        else:
            out.append((range(t, t + 1), k))
    return out


def _values(
    tape: Tape,
    fixed: Sequence[str | None],
    mechanisms: tuple[str, ...],
    costs: CostModel,
    early_runs: bool,
) -> Layout:
    """The tape's facts and the candidate kept values (``x`` and ``y``'s columns)."""
    recs = tape.records
    fixed = _keep_effects(tape, fixed)
    n = len(recs)
    producer = {o.id: r.index for r in recs for o in r.outputs}
    order = [r.index for r in reversed(recs) if r.rule != "none"]
    point = {i: t + 1 for t, i in enumerate(order)}
    T = len(order) + 1
    can_rerun = np.array([f != "save" for f in fixed], bool)

    def prod(key: Any) -> int:
        return key[1] if isinstance(key, tuple) else producer.get(key, -1)

    first: dict[Any, int] = {}
    last: dict[Any, int] = {}
    obj: dict[Any, Any] = {}
    for i in order:
        rec = recs[i]
        for s in rec.saves:
            key = rec.residual_key(s)
            if prod(key) < 0:
                continue  # a tape input or constant: held by the caller
            first.setdefault(key, point[i])
            last[key] = point[i]
            if s.kind == "aux":
                obj.setdefault(key, s)
            else:
                obj.setdefault(key, rec.inputs[s.index] if s.kind == "in" else rec.outputs[s.index])
    readers: dict[int, list[int]] = {}  # value id -> records that may be re-run reading it
    for r in recs:
        if not can_rerun[r.index]:
            continue
        for u in r.inputs:
            if isinstance(u, Var) and u.id in producer and r.index not in readers.get(u.id, []):
                readers.setdefault(u.id, []).append(r.index)
                obj.setdefault(u.id, u)
    keys = list(obj)
    kidx = {k: j for j, k in enumerate(keys)}
    K = len(keys)
    full = np.array([device_nbytes(obj[k]) for k in keys], np.int64)
    tl = types.SimpleNamespace(keys=keys, vars=[obj[k] for k in keys], full=full)
    opts = joint.options(tl, mechanisms, costs)  # type: ignore[arg-type]
    kprod = np.array([prod(k) for k in keys], np.int64)
    ycols = [(k, m) for k in range(K) for m in range(opts.valid.shape[1]) if opts.valid[k, m]]
    ny = len(ycols)
    # bytes an h counts: u's stored bytes; with early_runs, a residual's copy too (made
    # at its first use, before h's points, and held with it)
    hbytes = opts.stored.astype(np.float64)
    if early_runs:
        hbytes += opts.copied * np.array([k in first for k in keys])[:, None]
    return Layout(
        recs, n, fixed, producer, order, T, can_rerun, first, last, readers, keys, kidx, full,
        opts, kprod, ycols, hbytes, col=n + ny,
    )  # fmt: skip


def _windows(L: Layout, window: int | None, early_runs: bool) -> None:
    """``need`` per record, the run windows (``z``) and the points before them (``r``)."""
    n, first, can_rerun, recs, readers, prod = L.n, L.first, L.can_rerun, L.recs, L.readers, L.prod
    # need[i]: the latest point record i, if re-run, has run by: the first use of one
    # of its residuals, or (none) the latest need of the re-run records reading it
    need = np.zeros(n, np.int64)
    for key, f in first.items():
        p = prod(key)
        need[p] = f if need[p] == 0 else min(need[p], f)
    for i in reversed(range(n)):
        if can_rerun[i] and need[i] == 0:
            rd = [need[q] for o in recs[i].outputs for q in readers.get(o.id, [])]
            need[i] = max(rd, default=0)
    win: dict[int, tuple[int, int, int]] = {}
    col = L.col
    for i in range(n):
        if can_rerun[i] and need[i] > 1:
            start = 1 if window is None else max(1, int(need[i]) - window)
            win[i] = (start, int(need[i]), col)
            col += int(need[i]) - start

    # r[i, t], t < i's window: a lower limit on "i's segment has run by t" (no column
    # before: nothing counted), pushed up along re-run neighbours from records run by t
    before: dict[int, int] = {}
    if early_runs:
        for i, (s0, _, _) in win.items():
            if s0 > 1:
                before[i] = col
                col += s0 - 1

    L.need, L.win, L.before, L.col = need, win, before, col


def _holds(L: Layout) -> None:
    """``h`` per kept value and span of points, the pairs it claims, and (with ``r``)
    their shadows ``c`` in the run rows."""
    recs, first, last, readers, kidx, full, opts = (
        L.recs, L.first, L.last, L.readers, L.kidx, L.full, L.opts,
    )  # fmt: skip
    win, before, col, z_col, run_col = L.win, L.before, L.col, L.z_col, L.run_col
    # h[u, t]: bytes of kept u still held at t (past its last residual use) because a
    # re-run reader has not run yet
    holds: list[tuple[int, int, range, tuple]] = []
    for uid, qs in readers.items():
        ku = kidx[uid]
        qs = [q for q in qs if q in win]
        lu = last.get(uid, 0)

        def held(t: int) -> tuple[tuple, tuple]:
            # before q's window: "q has not run by t" needs "not by its window's start"
            zq = tuple(
                (q, run_col(q, t) if q in before else z_col(q, max(t, win[q][0])))
                for q in qs
                if t < win[q][1]
            )
            return zq, tuple(t < win[q][0] for q in qs)  # a pair's row holds there only

        # points with the same rows, each before the same readers' windows, share one h
        for pts, (zq, _) in _spans(range(lu + 1, max([win[q][1] for q in qs], default=0)), held):
            holds.append((col, ku, pts, zq))
            col += 1
    # Before a reader q's window, where its run is not modelled: u still held, or q has
    # run and its residual w is held (w is not counted there otherwise): at least the
    # smaller. One pair per u and per q, so no two pairs claim the same w.
    cands = []
    for uid, qs in readers.items():
        for q in qs:
            for o in recs[q].outputs:
                if q in win and o.id in first and win[q][0] - 1 > last.get(uid, 0):
                    gain = min(int(full[kidx[uid]]), device_nbytes(o))
                    cands.append((gain * (win[q][0] - 1 - last.get(uid, 0)), uid, q, o))
    paired: dict[int, tuple[int, np.ndarray]] = {}
    used_q: set[int] = set()
    for gain, uid, q, o in sorted(cands, key=lambda c: -c[0]):
        ku = kidx[uid]
        if gain > 0 and ku not in paired and q not in used_q:
            used_q.add(q)
            coef = np.minimum(opts.stored[ku], device_nbytes(o)).astype(np.float64)
            coef[~opts.valid[ku]] = 0.0
            paired[ku] = (q, coef)
    claims = [
        (hcol, k, paired[k][0], paired[k][1])
        for hcol, k, pts, zq in holds
        if k in paired
        and pts.stop <= win[paired[k][0]][0]
        and any(q == paired[k][0] for q, _ in zq)
    ]
    # With r, a pair's w is counted from q's run on (r[q, t] at point t): its h holds
    # only at runs, in a column c of the run rows' base, where w counts from r[q, t - 1]
    shadows: list[tuple[int, int, int, int, np.ndarray, int | None]] = []
    if before:
        for hcol, k, q, coef in claims:
            t = next(sp.start for hc, _, sp, _ in holds if hc == hcol)
            shadows.append((col, hcol, k, q, coef, run_col(q, t - 1) if t >= 2 else None))
            col += 1
        claims = []
    L.holds, L.claims, L.shadows, L.col = holds, claims, shadows, col


def _early(L: Layout, prefetch: int) -> None:
    """``g``: copies a re-run reader's segment made before the value's own first use."""
    first, readers, kidx, opts, col, z_col = L.first, L.readers, L.kidx, L.opts, L.col, L.z_col
    # g[v, t]: the copy of kept v a re-run reader's segment made when it ran, held from
    # that run to v's last use, before v's first residual use (where its copy term
    # starts). Points with the same (reader, z column) pairs share one g.
    early: list[tuple[int, int, range, tuple]] = []
    for uid, qs in readers.items():
        ku = kidx[uid]
        if uid not in first or opts.copied[ku].max() <= 0:
            continue

        def copied(t: int) -> tuple | None:
            zq = tuple((q, c) for q in qs if (c := z_col(q, t)) is not None)
            return zq or None

        for pts, zq in _spans(range(1, max(1, first[uid] - prefetch)), copied):
            early.append((col, ku, pts, zq))
            col += 1
    L.early, L.col = early, col


def _members(L: Layout, early_runs: bool, flags: Flags) -> None:
    """Re-runnable neighbours (``adj``), and the run rows' member pairs ``s[a, q]``."""
    recs, producer, can_rerun, win, first, kidx, readers, col = (
        L.recs, L.producer, L.can_rerun, L.win, L.first, L.kidx, L.readers, L.col,
    )  # fmt: skip
    adj: dict[int, set[int]] = {i: set() for i in win}
    for r in recs:
        for u in r.inputs:
            if isinstance(u, Var) and u.id in producer and can_rerun[r.index]:
                j = producer[u.id]
                if can_rerun[j] and j != r.index:
                    adj.setdefault(r.index, set()).add(j)
                    adj.setdefault(j, set()).add(r.index)
    # s[a, q]: a lower limit on "a and q are in one segment" (a re-run path between
    # them), for the run rows' members: values of a held at q's step of the run
    one = -1
    pairs: dict[tuple[int, int], int] = {}
    paths: dict[tuple[int, int], list[list[int]]] = {}
    held_at: dict[int, list[tuple[int, int, int | None]]] = {}  # q -> (bytes, a, reader)
    inputs_at: dict[int, dict[int, list[int]]] = {}  # q -> member a -> a's inputs (keys)
    if early_runs:
        one = col  # fixed to 1: the constants of the run rows' member terms
        col += 1
        for q in win:
            ins_q = {v.id for v in recs[q].inputs if isinstance(v, Var)}
            seen = ins_q | {o.id for o in recs[q].outputs}
            for v in ins_q:
                if producer.get(v) in win:
                    seen |= {o.id for o in recs[producer[v]].outputs if o.id in first}
            found: dict[int, list[list[int]]] = {}
            stack = [[q]]
            while stack:  # simple paths of up to MEMBER_DEPTH neighbours from q
                pth = stack.pop()
                for j in sorted(adj.get(pth[-1], ())):
                    if j in pth:
                        continue
                    if len(found.setdefault(j, [])) < flags.member_paths:
                        found[j].append(pth + [j])
                    if len(pth) < flags.member_depth:
                        stack.append(pth + [j])
            # q's outputs are not kept when q runs: no row for them
            counted = ins_q | {o.id for o in recs[q].outputs}
            for src in sorted(found, key=lambda j: (len(found[j][0]), j)):
                # a member's inputs (kept ones are segment inputs, held through the run)
                got = list(
                    {
                        v.id: None
                        for v in recs[src].inputs
                        if isinstance(v, Var) and v.id in kidx and v.id not in counted
                    }
                )
                counted |= set(got)
                member = bool(got) and len(found[src][0]) - 1 <= flags.input_depth
                if member:
                    inputs_at.setdefault(q, {})[src] = got
                vals: list[tuple[int, int, int | None]] = []
                for o in recs[src].outputs if src < q else ():
                    if o.id in seen or o.id not in kidx:
                        continue
                    if o.id in first:
                        vals.append((device_nbytes(o), src, None))
                        continue
                    later = [r for r in readers.get(o.id, []) if r > q]
                    if later:  # read later in the segment: live at q's step
                        vals.append((device_nbytes(o), src, min(later)))
                if vals:
                    held_at.setdefault(q, []).extend(vals)
                if member or vals:  # one s[src, q] for its inputs and its values
                    pairs[(src, q)] = col
                    paths[(src, q)] = found[src]
                    col += 1
    L.adj, L.one, L.pairs, L.paths, L.held_at, L.inputs_at = (
        adj, one, pairs, paths, held_at, inputs_at,
    )  # fmt: skip
    L.col = col


def _prefix(L: Layout, early_runs: bool, flags: Flags) -> None:
    """``m[q]``: the residual bytes of ``q``'s segment's members before ``q``."""
    recs, n, first, can_rerun, adj, col = L.recs, L.n, L.first, L.can_rerun, L.adj, L.col
    # m[q]: a lower limit on the residual bytes of q's segment's members before q (all
    # held at q's step of the run), along chains of re-run neighbours p < q
    res = {
        i: sum(device_nbytes(o) for o in recs[i].outputs if o.id in first)
        for i in range(n)
        if can_rerun[i]
    }
    most: dict[int, int] = {}  # q -> the most m[q] can be (its component's members < q)
    prefix: dict[int, int] = {}  # q -> column of m[q]
    if early_runs and flags.prefix:
        comp: dict[int, int] = {}
        for i in sorted(adj):
            if i in comp:
                continue
            comp[i], todo = i, [i]
            while todo:
                for j in adj.get(todo.pop(), ()):
                    if j not in comp:
                        comp[j] = i
                        todo.append(j)
        acc: dict[int, int] = {}
        for i in sorted(comp):
            most[i] = acc.get(comp[i], 0)
            acc[comp[i]] = most[i] + res.get(i, 0)
        for q in sorted(most):
            if most[q] > 0:
                prefix[q] = col
                col += 1
    L.res, L.most, L.prefix, L.col = res, most, prefix, col


def _bounds(L: Layout, costs: CostModel) -> None:
    """The points' ``b`` columns last; each column's cost, bounds and integrality."""
    n, T, K, recs, fixed, col, ycols, opts, hbytes, kprod = (
        L.n, L.T, len(L.keys), L.recs, L.fixed, L.col, L.ycols, L.opts, L.hbytes, L.kprod,
    )  # fmt: skip
    holds, shadows, before, win, early, one, pairs, prefix, most, can_rerun = (
        L.holds, L.shadows, L.before, L.win, L.early, L.one, L.pairs, L.prefix, L.most,
        L.can_rerun,
    )  # fmt: skip
    b0 = col - 1  # b[t], t = 1..T-1: bytes a segment run at t finds held (base[t])
    ncol = col + T - 1
    cost = np.zeros(ncol)
    flops = [record_flops(r) for r in recs]
    cost[:n] = np.array(flops) / costs.flops_per_s
    for j, (k, m) in enumerate(ycols):
        cost[n + j] = opts.seconds[k, m]
    upper = np.ones(ncol)
    upper[:n] = can_rerun.astype(float)
    integer = np.zeros(ncol, bool)
    integer[:ncol] = True
    for hcol, k, _, _ in holds:
        upper[hcol] = float(hbytes[k].max())
        integer[hcol] = False
    for ccol, _, k, _, _, _ in shadows:
        upper[ccol] = float(hbytes[k].max())
        integer[ccol] = False
    for i, c0 in before.items():
        integer[c0 : c0 + win[i][0] - 1] = False
    for gcol, k, _, _ in early:
        upper[gcol] = float(opts.copied[k].max())
        integer[gcol] = False
    upper[b0 + 1 :] = np.inf
    integer[b0 + 1 :] = False
    if one >= 0:
        integer[one] = False
    for sc in pairs.values():
        integer[sc] = False
    for q, mc in prefix.items():
        upper[mc] = float(most[q])
        integer[mc] = False
    ycol_of: list[list[int]] = [[] for _ in range(K)]
    for j, (k, _) in enumerate(ycols):
        ycol_of[k].append(n + j)
        if fixed[kprod[k]] == "recompute":
            upper[n + j] = 0.0  # a binding recompute keeps none of its values

    L.b0, L.ncol, L.cost, L.upper, L.integer, L.ycol_of = b0, ncol, cost, upper, integer, ycol_of
