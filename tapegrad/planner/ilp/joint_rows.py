"""The joint ILP's rows (`ilp_joint_model` states the formulation and why it is a
relaxation; `ilp_joint_columns` numbers the columns): the logic rows (a value kept or
its producer re-run, pruning, runs monotone and shared by neighbours, support, ``r``,
``h``, ``g``, ``c``), the modelled bytes at each point (``mem``), what a segment run at
a point finds held (``base``, with a ``b[t]`` column per point), and the run rows:
bytes at one record's step of a segment run, which `ilp_joint.solve` bounds by the
budget with the points' rows.
"""

from __future__ import annotations

import functools

import numpy as np

from tapegrad.core.tape import Var
from tapegrad.planner.cost import device_nbytes
from tapegrad.planner.ilp.joint_columns import Flags, Layout

__all__ = ["logic_rows", "point_bytes", "base_rows", "run_rows"]

Row = tuple[np.ndarray, np.ndarray, float, float]  # (columns, coefficients, lower, upper)
Run = tuple[int, np.ndarray, np.ndarray]  # (point t, columns, coefficients): bytes <= budget


def _add_row(rows: list[Row], cols: list, coef: list, lo: float, hi: float) -> None:
    merged: dict[int, float] = {}
    for c, a in zip(cols, coef):
        merged[c] = merged.get(c, 0.0) + a
    rows.append((np.array(list(merged), np.int64), np.array(list(merged.values())), lo, hi))


def logic_rows(L: Layout, rows: list[Row], early_runs: bool, flags: Flags) -> None:
    """Every row but the bytes': `rows` in the order `ilp_joint_model.build` wrote them."""
    _value_rows(L, rows, early_runs, flags)
    _support_rows(L, rows, flags)
    _hold_rows(L, rows)


def _value_rows(L: Layout, rows: list[Row], early_runs: bool, flags: Flags) -> None:
    """A value kept or its producer re-run; pruning; runs monotone and adjacent re-run
    records run at the same point."""
    row = functools.partial(_add_row, rows)
    keys, first, kprod, ycol_of, readers, recs, n, can_rerun, win, z_col = (
        L.keys, L.first, L.kprod, L.ycol_of, L.readers, L.recs, L.n, L.can_rerun, L.win, L.z_col,
    )  # fmt: skip
    K = len(keys)
    for k, key in enumerate(keys):
        ys = ycol_of[k]
        p = int(kprod[k])
        if key in first:
            row(ys + [p], [1.0] * (len(ys) + 1), 1.0, 1.0)
        else:
            row(ys + [p], [1.0] * (len(ys) + 1), 0.0, 1.0)
            for q in readers.get(key, []):
                row(ys + [p, q], [1.0] * (len(ys) + 1) + [-1.0], 0.0, np.inf)
    # a re-run record with no residual of its own is in a segment only for a re-run
    # reader (pruning): x[i] <= Σ x[q] over the records that may re-run reading it
    owners = {int(p) for p in kprod[[k in first for k in keys]]} if K else set()
    for i in range(n) if flags.pruned and early_runs else ():
        if can_rerun[i] and i not in owners:
            qs = sorted({q for o in recs[i].outputs for q in readers.get(o.id, [])})
            row([i] + qs, [1.0] + [-1.0] * len(qs), -np.inf, 0.0)
    # runs: monotone, by the need, and a segment's records (adjacent re-run records)
    # run at the same point
    for i, (start, f, c) in win.items():
        for t in range(start, f):
            row([c + t - start, z_col(i, t + 1)], [1.0, -1.0], -np.inf, 0.0)  # type: ignore[list-item]
    for i in win:
        for o in recs[i].outputs:
            for q in readers.get(o.id, []):
                if q not in win:
                    continue
                lo = max(win[i][0], win[q][0])
                for t in range(lo, max(win[i][1], win[q][1])):
                    a, b = z_col(i, t), z_col(q, t)
                    if a is None or b is None or (a == i and b == q):
                        continue
                    row([a, b, i, q], [1.0, -1.0, 1.0, 1.0], -np.inf, 2.0)
                    row([b, a, i, q], [1.0, -1.0, 1.0, 1.0], -np.inf, 2.0)


def _support_rows(L: Layout, rows: list[Row], flags: Flags) -> None:
    """A record runs before its need only with its segment (balls of `SUPPORT_LAYERS`)."""
    row = functools.partial(_add_row, rows)
    adj, need, win, z_col = L.adj, L.need, L.win, L.z_col
    # a record runs before its need only with its segment, through a re-run neighbour
    # that has run by then (a segment runs at its first need: a record alone, at its own)

    def boundary(ball: set[int]) -> set[int]:
        return {j for a in ball for j in adj.get(a, ()) if need[j] > 0} - ball

    def zc_or_x(j: int, t: int) -> int:
        c = z_col(j, t)
        return j if c is None else c

    for i, (start, f, c) in win.items():
        for t in range(start, f):
            # balls around i through records needed only after t: i's segment, run by t,
            # leaves each through a record of its boundary (it holds one needed by t)
            ball = {i}
            for layer in range(flags.support_layers + 1):
                edge = boundary(ball)
                inner = {j for j in edge if need[j] > t}
                while layer == flags.support_layers and inner:  # the last: the whole component
                    ball |= inner
                    edge = boundary(ball)
                    inner = {j for j in edge if need[j] > t}
                nb = sorted({zc_or_x(j, t) for j in edge})
                row([c + t - start] + nb, [1.0] + [-1.0] * len(nb), -np.inf, 0.0)
                if not inner:
                    break
                ball |= inner


def _hold_rows(L: Layout, rows: list[Row]) -> None:
    """``r`` along re-run neighbours; ``h``, ``g``, ``c`` and the pairs' claims."""
    row = functools.partial(_add_row, rows)
    before, win, adj, run_col, holds, hbytes, ycol_of, ycols, n, early, opts = (
        L.before, L.win, L.adj, L.run_col, L.holds, L.hbytes, L.ycol_of, L.ycols, L.n, L.early,
        L.opts,
    )  # fmt: skip
    shadows, claims = L.shadows, L.claims
    # r: a re-run record adjacent to one whose segment has run by t is in that segment
    rcols = {c for i, c0 in before.items() for c in range(c0, c0 + win[i][0] - 1)}
    for a in sorted(adj):
        for p in sorted(adj[a]):
            if a not in before and p not in before:
                continue
            for t in range(
                1, max(win[a][0] if a in before else 1, win[p][0] if p in before else 1)
            ):
                ca, cp = run_col(a, t), run_col(p, t)
                if ca is None or cp is None or (ca not in rcols and cp not in rcols):
                    continue
                if cp != p:  # R(p, t) >= R(a, t) + x[p] - 1 (R(p, t) = x[p]: nothing to say)
                    row([cp, ca, p], [1.0, -1.0, -1.0], -1.0, np.inf)
    for hcol, k, _, zq in holds:
        big = float(hbytes[k].max())
        ys = ycol_of[k]
        co = [-float(hbytes[k, ycols[c - n][1]]) for c in ys]
        for q, zc in zq:
            row([hcol, q, zc] + ys, [1.0, -big, big] + co, -big, np.inf)
    for gcol, k, _, zq in early:
        big = float(opts.copied[k].max())
        ys = ycol_of[k]
        co = [-float(opts.copied[k, ycols[c - n][1]]) for c in ys]
        for _, zc in zq:
            row([gcol, zc] + ys, [1.0, -big] + co, -big, np.inf)
    for ccol, hcol, k, q, coef, rc in shadows:  # c >= h; c >= the pair's bytes
        ys = ycol_of[k]
        big = float(coef.max())
        row([ccol, hcol], [1.0, -1.0], 0.0, np.inf)
        cs, co = [ccol, q] + ys, [1.0, -big] + [-coef[ycols[c - n][1]] for c in ys]
        if rc is not None:
            cs, co = cs + [rc], co + [big]
        row(cs, co, -big, np.inf)
    for hcol, k, q, coef in claims:
        ys = ycol_of[k]
        big = float(coef.max())
        row([hcol, q] + ys, [1.0, -big] + [-coef[ycols[c - n][1]] for c in ys], -big, np.inf)


def point_bytes(L: Layout, prefetch: int) -> np.ndarray:
    """(points, columns): modelled bytes at each point per unit of each column."""
    T, ncol, ycols, keys, last, first, n, opts, kprod, full, win, z_col, before = (
        L.T, L.ncol, L.ycols, L.keys, L.last, L.first, L.n, L.opts, L.kprod, L.full, L.win,
        L.z_col, L.before,
    )  # fmt: skip
    holds, early = L.holds, L.early
    mem = np.zeros((T, ncol))
    for j, (k, m) in enumerate(ycols):
        key = keys[k]
        lv = last.get(key, 0)
        mem[: lv + 1, n + j] += opts.stored[k, m]
        if key in first:
            uv = max(1, first[key] - prefetch)
            mem[uv : lv + 1, n + j] += opts.copied[k, m]
    for k, key in enumerate(keys):
        if key in first and not isinstance(key, tuple):
            p = int(kprod[k])
            mem[first[key] : last[key] + 1, p] += full[k]
            for t in range(win[p][0] if p in win else first[key], first[key]):
                mem[t, z_col(p, t)] += full[k]  # from its run on
            for t in range(1, win[p][0]) if p in before else ():
                mem[t, before[p] + t - 1] += full[k]  # run before its window
    for hcol, _, span_t, _ in holds + early:
        mem[span_t.start : span_t.stop, hcol] += 1.0
    return mem


def base_rows(L: Layout, rows: list[Row], prefetch: int) -> tuple[np.ndarray, list[dict]]:
    """``base`` (what any segment run at a point finds held) with its rows ``b[t] =
    base[t]``, the constant column's row and the member pairs' path rows; and each
    key's terms of ``base`` (column -> bytes per point), which the run rows replace."""
    row = functools.partial(_add_row, rows)
    T, ncol, K, ycols, keys, last, first, n, opts, kprod, full, run_col = (
        L.T, L.ncol, len(L.keys), L.ycols, L.keys, L.last, L.first, L.n, L.opts, L.kprod,
        L.full, L.run_col,
    )  # fmt: skip
    early, holds, shadows, b0, one, pairs, paths = (
        L.early, L.holds, L.shadows, L.b0, L.one, L.pairs, L.paths,
    )  # fmt: skip
    # Segment runs. base[t]: what any run at t finds held, every value by itself: kept
    # values used at t or later (their copies made by t - 1), outputs of runs by t - 1
    # still to be used.
    base = np.zeros((T, ncol))
    kterm: list[dict[int, np.ndarray]] = [{} for _ in range(K)]  # key -> its base terms
    for j, (k, m) in enumerate(ycols):
        key = keys[k]
        lv = last.get(key, 0)
        vec = np.zeros(T)
        vec[1 : lv + 1] = opts.stored[k, m]
        if key in first:
            vec[max(2, first[key] - prefetch + 1) : lv + 1] += opts.copied[k, m]
        kterm[k][n + j] = vec
    for k, key in enumerate(keys):
        if key in first and not isinstance(key, tuple):
            p = int(kprod[k])
            for t in range(1, last[key] + 1):
                zc = run_col(p, t - 1)
                if zc is not None and t >= 2:
                    kterm[k].setdefault(zc, np.zeros(T))[t] += full[k]
    for gcol, k, span_t, _ in early:  # a copy held at t - 1 is held at a run at t
        vec = np.zeros(T)
        vec[span_t.start + 1 : min(span_t.stop + 1, T)] = 1.0
        kterm[k][gcol] = vec
    for hcol, k, span_t, _ in holds:  # a reader that has not run by t runs after t
        vec = np.zeros(T)
        vec[span_t.start : span_t.stop] = 1.0
        kterm[k][hcol] = vec
    for ccol, hcol, k, _, _, _ in shadows:  # the run rows see c, the points h
        kterm[k][ccol] = kterm[k].pop(hcol)
    for k in range(K):
        for zc, vec in kterm[k].items():
            base[:, zc] += vec
    for t in range(1, T):
        nz = np.nonzero(base[t])[0]
        row([b0 + t] + nz.tolist(), [1.0] + (-base[t, nz]).tolist(), 0.0, 0.0)
    if one >= 0:
        row([one], [1.0], 1.0, 1.0)
    for aq, sc in pairs.items():  # s[a, q] >= Σ_{j on a path, a..q} x[j] - (|path| - 1)
        for pth in paths[aq]:
            row([sc] + pth, [1.0] + [-1.0] * len(pth), 1.0 - len(pth), np.inf)

    return base, kterm


def _switch(L: Layout, i: int, t: int) -> list[tuple[int, float]]:
    """Record ``i``'s switch ``Δ[i, t] = z[i, t] - z[i, t - 1]`` as (column, sign) terms
    (known only inside its window; none where it cannot switch at ``t``)."""
    z_col = L.z_col
    a, b = z_col(i, t), (z_col(i, t - 1) if t >= 2 else -1)
    if a is None or b is None or a == b:
        return []
    return [(a, 1.0)] + ([(b, -1.0)] if b >= 0 else [])


def run_rows(L: Layout, rows: list[Row], kterm: list[dict], flags: Flags) -> list[Run]:
    """The run rows (bytes at a record's step of a segment run), and the ``m`` rows."""
    runs = _step_runs(L, kterm)
    _prefix_runs(L, rows, kterm, runs, flags)
    _last_runs(L, runs)
    return runs


def _step_runs(L: Layout, kterm: list[dict]) -> list[Run]:
    """One row per (t, q): if q's segment runs at t, at q's step of it: base[t] less q's
    inputs, plus q's inputs and outputs (full bytes: a kept input is unpacked then) and
    the residuals its re-run parents produced before (kept to the segment's end).
    A record's switch Δ[q, t] = z[q, t] - z[q, t - 1] (known only inside its window)."""
    win, recs, kidx, full, producer, first, T, b0, ycol_of, pairs, one, inputs_at, held_at = (
        L.win, L.recs, L.kidx, L.full, L.producer, L.first, L.T, L.b0, L.ycol_of, L.pairs, L.one,
        L.inputs_at, L.held_at,
    )  # fmt: skip
    switch = functools.partial(_switch, L)
    runs: list[Run] = []
    for q in win:
        ins = {v.id for v in recs[q].inputs if isinstance(v, Var) and v.id in kidx}
        own = sum(device_nbytes(o) for o in recs[q].outputs) + sum(int(full[kidx[v]]) for v in ins)
        parents = {
            producer[v]: [o for o in recs[producer[v]].outputs if o.id in first and o.id not in ins]
            for v in ins
            if producer[v] in win
        }
        for t in range(1, T):
            dq = switch(q, t)
            if not dq:
                continue
            terms: dict[int, float] = {b0 + t: 1.0}
            for vid in ins:
                for zc, vec in kterm[kidx[vid]].items():
                    terms[zc] = terms.get(zc, 0.0) - vec[t]
            for zc, sign in dq:
                terms[zc] = terms.get(zc, 0.0) + sign * own
            for p, ws in parents.items():
                for zc, sign in switch(p, t):
                    terms[zc] = terms.get(zc, 0.0) + sign * sum(device_nbytes(w) for w in ws)
            cols = np.array([zc for zc, a in terms.items() if a != 0.0], np.int64)
            runs.append((t, cols, np.array([terms[zc] for zc in cols])))
            for src, got in inputs_at.get(q, {}).items():
                # per member a: its inputs, kept (a segment input: held through the run
                # at its stored bytes and copy, at least its full bytes) in place of their
                # base terms: full_u·(Σ_m y[u, m] + Δ[q, t] + s[a, q] − 2)
                more = dict(terms)
                for vid in got:
                    ku = kidx[vid]
                    for zc, vec in kterm[ku].items():
                        more[zc] = more.get(zc, 0.0) - vec[t]
                    for yc in ycol_of[ku]:
                        more[yc] = more.get(yc, 0.0) + full[ku]
                    for zc, sign in dq:
                        more[zc] = more.get(zc, 0.0) + sign * full[ku]
                    more[pairs[(src, q)]] = more.get(pairs[(src, q)], 0.0) + full[ku]
                    more[one] = more.get(one, 0.0) - 2.0 * full[ku]
                cols = np.array([zc for zc, a in more.items() if a != 0.0], np.int64)
                runs.append((t, cols, np.array([more[zc] for zc in cols])))
            if q not in held_at:
                continue
            # again with the members: bytes·(Δ[q, t] + s[a, q] (+ x[reader]) − 1 (− 1)),
            # ≤ 0 unless q runs at t with a (and the reader) in its segment (a second
            # row: the terms < 0 would weaken the first)
            for vb, src, reader in held_at[q]:
                for zc, sign in dq:
                    terms[zc] = terms.get(zc, 0.0) + sign * vb
                terms[pairs[(src, q)]] = terms.get(pairs[(src, q)], 0.0) + vb
                if reader is not None:
                    terms[reader] = terms.get(reader, 0.0) + vb
                terms[one] = terms.get(one, 0.0) - vb * (1 if reader is None else 2)
            cols = np.array([zc for zc, a in terms.items() if a != 0.0], np.int64)
            runs.append((t, cols, np.array([terms[zc] for zc in cols])))
    return runs


def _prefix_runs(
    L: Layout, rows: list[Row], kterm: list[dict], runs: list[Run], flags: Flags
) -> None:
    """The ``m`` rows, and one more run row per (t, q) with ``m[q]`` where a member with
    residuals is beyond `MEMBER_DEPTH` (nearer ones ``s`` counts)."""
    row = functools.partial(_add_row, rows)
    switch = functools.partial(_switch, L)
    prefix, adj, most, res, win, recs, kidx, full, T, b0, one, producer, first, can_rerun = (
        L.prefix, L.adj, L.most, L.res, L.win, L.recs, L.kidx, L.full, L.T, L.b0, L.one,
        L.producer, L.first, L.can_rerun,
    )  # fmt: skip
    # m[q] >= m[p] + res_p - (most_p + res_p)·(2 - x[p] - x[q]) for re-run neighbours
    # p < q (one segment: its members before p, and p, are members before q)
    for q, mc in prefix.items():
        for p in sorted(adj.get(q, ())):
            big = most.get(p, 0) + res.get(p, 0)
            if p > q or big <= 0:
                continue
            cs, co = [mc, p, q], [1.0, -float(big), -float(big)]
            if p in prefix:
                cs, co = cs + [prefix[p]], co + [-1.0]
            row(cs, co, float(res.get(p, 0) - 2 * big), np.inf)
    # Per (t, q): q's step of its segment run at t, with m[q]: base[t] less q's inputs,
    # plus q's inputs and outputs, plus m[q] - most_q·(1 - Δ[q, t]), less full_v·x[p]
    # for an input v of q that is a residual of a re-run p (counted in m[q] then)
    for q, mc in prefix.items():
        if q not in win or not _far_member(q, adj, res, flags.member_depth):
            continue  # (every member with residuals is within MEMBER_DEPTH: s counts it)
        ins = {v.id for v in recs[q].inputs if isinstance(v, Var) and v.id in kidx}
        own = sum(device_nbytes(o) for o in recs[q].outputs) + sum(int(full[kidx[v]]) for v in ins)
        for t in range(1, T):
            dq = switch(q, t)
            if not dq:
                continue
            terms = {b0 + t: 1.0, mc: 1.0, one: -float(most[q])}
            for vid in ins:
                for zc, vec in kterm[kidx[vid]].items():
                    terms[zc] = terms.get(zc, 0.0) - vec[t]
                p = producer[vid]
                if vid in first and can_rerun[p]:
                    terms[p] = terms.get(p, 0.0) - float(full[kidx[vid]])
            for zc, sign in dq:
                terms[zc] = terms.get(zc, 0.0) + sign * (own + most[q])
            cols = np.array([zc for zc, a in terms.items() if a != 0.0], np.int64)
            runs.append((t, cols, np.array([terms[zc] for zc in cols])))


def _last_runs(L: Layout, runs: list[Run]) -> None:
    """Per point where two or more records with residuals may switch: the last run's."""
    switch = functools.partial(_switch, L)
    one, recs, first, win, T, b0 = L.one, L.recs, L.first, L.win, L.T, L.b0
    # The last run at t: base[t] and the residuals of every segment run at t (the
    # earlier ones' held, the last one's at its end)
    if one >= 0:
        # (every record of the window, re-run or not: ``res`` above has the re-run ones)
        win_res = {i: sum(device_nbytes(o) for o in recs[i].outputs if o.id in first) for i in win}
        for t in range(1, T):
            terms = {b0 + t: 1.0}
            movers = [i for i in win if win_res[i] and switch(i, t)]
            for i in movers:
                for zc, sign in switch(i, t):
                    terms[zc] = terms.get(zc, 0.0) + sign * win_res[i]
            if len(movers) > 1:
                cols = np.array([zc for zc, a in terms.items() if a != 0.0], np.int64)
                runs.append((t, cols, np.array([terms[zc] for zc in cols])))


def _far_member(q: int, adj: dict, res: dict, member_depth: int) -> bool:
    """Whether a re-runnable record before ``q`` with residuals is more than
    ``member_depth`` (`MEMBER_DEPTH`) re-runnable neighbours away from ``q`` (or only that far)."""
    depth = {q: 0}
    todo = [q]
    while todo:
        a = todo.pop(0)
        for j in adj.get(a, ()):
            if j not in depth:
                depth[j] = depth[a] + 1
                todo.append(j)
    return any(a < q and res.get(a, 0) > 0 and d > member_depth for a, d in depth.items())
