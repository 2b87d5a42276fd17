"""The joint ILP's model (`ilp_joint` solves it and decodes its plans): columns,
objective and rows of an integer program over per-record save/recompute and
per-residual mechanisms whose optimum is a lower bound on the predicted step time of
every plan the executor can run within the budget. Here: the formulation, why it is
a relaxation, `Model` and `build`, its switches (`WINDOW`, `SUPPORT_LAYERS`, ...); the
columns are numbered in `ilp_joint_columns` and the rows written in `ilp_joint_rows`.

The executor's segments (`_checkpoint.build_segments`: connected components of the
re-run records, each re-run once at backward's first need of any of its values) are
not linear in the decisions. This model is a relaxation of them, over the points
``0`` (the end of forward) and ``1..T-1`` (backward running each active record, in
backward order; `joint.timeline`'s record points):

* ``x[i]`` in {0, 1}: record ``i`` is re-run in backward (0 for a binding "save" and
  for records with side effects, which `problem._keep_effects` fixes to "save");
* ``y[v, m]`` in {0, 1}: value ``v`` (a residual key, or an input of a record that may
  be re-run) is kept from forward with mechanism ``m``; a residual is kept or its
  producer re-run: ``Σ_m y[v, m] + x[p(v)] = 1`` (an aux value likewise, with its
  record); a value a re-run record ``q`` reads is kept or produced by a re-run record:
  ``Σ_m y[v, m] + x[p(v)] ≥ x[q]`` (at most one of the two); a binding "recompute"
  record keeps none of its values;
* ``z[i, t]`` in {0, 1}: record ``i``, if re-run, has run by point ``t``. Its need
  ``F_i``: the first use of one of its residuals (outputs some record saves, aux
  values), or, for a record with none, the latest need of the re-run records reading
  it. ``z[i, t] = x[i]`` from ``F_i`` on (no column); columns for the ``WINDOW`` points
  before; earlier, not modelled. Rows: ``z[i, t] ≤ z[i, t + 1]``; for ``j`` reading
  ``i``'s output, ``|z[i, t] − z[j, t]| ≤ 2 − x[i] − x[j]``; support: for ``t < F_i``
  and a set ``B ∋ i`` of records whose needs are all after ``t`` (balls of radius 0..3
  around ``i`` through such records, then their whole connected component),
  ``z[i, t] ≤ Σ_{j ∈ ∂B} z[j, t]`` (``∂B``: the re-runnable records adjacent to ``B``
  and outside it, those with a need; ``x[j]`` where ``z[j, t]`` has no column);
* ``r[i, t]`` in [0, 1] for ``1 ≤ t < s_i`` (before ``i``'s window, first point
  ``s_i``): a lower limit on "``i``'s segment has run by ``t``". Write ``R(i, t)`` for
  ``r[i, t]``, ``z[i, t]`` or ``x[i]``, whichever ``t`` has. Rows, for re-runnable
  neighbours ``a``, ``p`` (one reads the other's output) where one of the two is an
  ``r``: ``R(p, t) ≥ R(a, t) + x[p] − 1`` (no upper limit: a monotone one made the
  58-record U-Net at 70% unsolved at 10 s);
* ``h[u, t] ≥ Σ_m stored[u, m]·y[u, m] − S_u·(1 − x[q] + z[q, t'])`` (bytes; ``S_u``
  its most stored bytes; with ``r``, ``stored + copy`` for a residual ``u``) for each
  ``q`` that may re-run reading ``u``, ``t < F_q``, ``t' = max(t, q's first column)``
  (``R(q, t)`` in place of ``z[q, t']`` where ``r`` has a column): ``u`` kept for
  ``q``'s run, past ``L_u``; before ``q``'s window also, for one pair per ``u`` and per
  ``q`` (``w`` a residual of ``q``), ``h[u, t] ≥ Σ_m min(stored[u, m],
  full_w)·y[u, m] − C·(1 − x[q])`` — or, with ``r``, in a column
  ``c[u, t]`` the run rows' base counts instead of ``h[u, t]``: ``c ≥ h[u, t]``,
  ``c ≥ Σ_m min(stored[u, m], full_w)·y[u, m] − C·(1 − x[q] + R(q, t − 1))``
  (``R(q, 0) = 0``);
* ``g[v, t] ≥ Σ_m copy[v, m]·y[v, m] − C_v·(1 − z[q, t])`` (bytes; ``C_v`` its most
  copy bytes) for each ``q`` that may re-run reading ``v``, ``1 ≤ t < U_v``, where
  ``z[q, t]`` is modelled: ``v``'s copy, made at ``q``'s run, before ``v``'s own first
  use;
* cost: ``Σ x[i]·flops_i / flops_per_s + Σ y[v, m]·seconds[v, m]``;
* bytes at point ``t``: a kept value, ``stored[v, m]`` over ``[0, L_v]`` and
  ``copy[v, m]`` over ``[U_v, L_v]`` (``L_v``: its last residual use, 0 when it has
  none; ``U_v``: its first residual use, ``prefetch`` records earlier); a residual
  ``w`` of ``p``, ``full_w·R(p, t)`` up to ``L_w``; ``h[u, t]`` past ``L_u``;
  ``g[v, t]`` before ``U_v``;
* bytes at a run at ``t``, per ``q`` whose ``Δ[q, t] = z[q, t] − z[q, t − 1]`` is
  modelled: ``base[t]`` (the kept values' stored bytes to ``L_v ≥ t``, their copies
  from ``U_v ≤ t − 1``, residuals ``full_w·R(p, t − 1)`` to ``L_w ≥ t``, ``h[u, t]``
  (``c[u, t]`` where it has one),
  ``g[v, t − 1]``) less the
  terms of ``q``'s inputs, ``+ Δ[q, t]·(bytes of q's outputs and inputs)`` ``+
  Σ Δ[p, t]·(p's residuals)`` over ``q``'s parents ``p`` (those not ``q``'s inputs)
  ``+ Σ bytes_v·(Δ[q, t] + s[a, q] − 1)`` over members' values ``v`` (below), less
  ``bytes_v·(1 − x[r])`` for one made by ``a`` that a later reader ``r > q`` reads
  (the constants on a column fixed to 1); again per member ``a`` within ``INPUT_DEPTH``
  neighbours (before or after ``q``), the first row with ``a``'s inputs ``u`` (not
  ``q``'s inputs or outputs, nor a nearer member's) at ``full_u·(Σ_m y[u, m] + Δ[q, t]
  + s[a, q] − 2)`` in place of their terms of ``base[t]``; and, per point ``t`` where
  two or more records with residuals may switch, ``base[t] + Σ_i Δ[i, t]·(i's
  residuals)``; every point and run row ``≤ budget``;
* ``s[a, q]`` in [0, 1], for re-runnable ``a < q`` within ``MEMBER_DEPTH`` neighbours
  of ``q`` (along re-runnable records) that make a value ``v`` not counted in ``q``'s
  run row otherwise: a residual of ``a``, or a value a later re-runnable reader
  ``r > q`` reads; and for ``a ≠ q`` within ``INPUT_DEPTH`` that read a value. Rows,
  per simple path ``a = p_0, ..., p_k = q`` of neighbours (``MEMBER_PATHS`` of them at
  most): ``s[a, q] ≥ Σ_i x[p_i] − k``;
* ``m[q]`` in ``[0, most_q]``, for a re-runnable ``q`` (``most_q``: the residual
  bytes of the re-runnable records before ``q`` in its connected component of
  re-runnable neighbours, > 0): a lower limit on the residual bytes of the members of
  ``q``'s segment before ``q``. Rows, for re-runnable neighbours ``p < q`` (``res_p``:
  the bytes of ``p``'s residuals, ``m[p] = 0`` where it has no column): ``m[q] ≥
  m[p] + res_p − (most_p + res_p)·(2 − x[p] − x[q])``. One more run row per ``(t, q)``
  with a modelled ``Δ[q, t]``, for a ``q`` with a re-runnable record before it with
  residuals more than ``MEMBER_DEPTH`` neighbours away (nearer ones ``s`` counts):
  ``base[t]`` less the terms of ``q``'s inputs, ``+
  Δ[q, t]·(bytes of q's outputs and inputs) + m[q] − most_q·(1 − Δ[q, t])``, less
  ``full_v·x[p]`` for each input ``v`` of ``q`` that is a residual of a re-runnable
  ``p``;
* pruning: a re-runnable record ``i`` none of whose outputs is a residual key:
  ``x[i] ≤ Σ x[q]`` over the records that may re-run reading its outputs (the bound's
  model only, with ``r``; `Budget`'s decoding does not have these rows nor ``m``).

Why every plan the executor runs is feasible here, at the same cost and no more bytes
(tapes without checkpoint regions or loop records: `build` returns None on others):
set ``x`` = the records of its segments, ``y`` = its kept keys (`Tape.residual_keys`)
with their mechanisms, ``z[i, t]`` and ``r[i, t]`` = [``i``'s segment has run by ``t``],
``h``, ``g`` and ``c`` at their lower limits, ``m[q]`` = the residual bytes of the
members of ``q``'s segment before ``q`` (0 if ``q`` is in none).

1. Logic. Without regions, the records a re-run record reads from, if re-run, are in
   its connected component, so in its segment (pruning keeps ancestors of outputs);
   what a segment reads from outside is a segment input, kept. A residual of a record
   outside every segment is kept (`residual_keys`); one inside is a segment output or
   an aux value recomputed with it. A binding "recompute" record's values are never
   kept. A segment runs at the first use of any of its recomputed values, so by
   ``F_i`` for each of its records with a residual; one without is in it through a
   re-run reader (pruning), so it runs by that reader's need. Adjacent re-run records
   are in one segment: equal ``z``. Support: the planner's segments (`build_segments`
   without free rebuilds or regions) are the connected components of the needed
   records (a needed record's re-run reader is needed, in its group; so no group's
   wanted value is another's input, every group is active, and pruning keeps all of
   it), so connected, and a record with no need (0) is in none. If ``i``'s segment
   ``C`` has run by ``t < F_i``, it ran at the first use of a residual of some
   ``m ∈ C``, so ``F_m ≤ t`` and ``m ∉ B``; a path from ``i`` to ``m`` inside ``C``
   leaves ``B`` through some ``j ∈ ∂B ∩ C``, whose ``z[j, t]`` (or ``x[j]`` ``≥`` it)
   is 1. ``r``: if ``R(a, t) = 1``, ``a``'s segment has run by ``t`` (so ``a`` is
   re-run); ``p``, re-run (``x[p] = 1``) and adjacent to ``a``, is in that segment, so
   ``R(p, t) = 1``. Pruning: a record of a segment is needed (`build_segments`: it
   provides a residual, or a needed record reads it), so one with no residual has a
   re-run reader (``x[q] = 1``). ``m``: at most ``most_q`` (the members before ``q``
   are re-runnable records of ``q``'s component); if ``x[p] = x[q] = 1`` the two
   neighbours are in one segment, whose members before ``p``, and ``p``, are members
   before ``q``: ``m[q] ≥ m[p] + res_p``; otherwise the right side is ``≤ m[p] −
   most_p ≤ 0``.
2. Cost. Segments are disjoint and each runs once: `simulate`'s flops are
   ``Σ_{i in a segment} flops_i``. Mechanism seconds are per kept key (`options` is
   computed here from the same shapes): equal. ``z`` and ``h`` cost nothing.
3. Bytes at record point ``t``, term by term, each at most what
   `joint.timeline` counts there. A kept key is released no earlier than its
   last residual use (``≥ L_v``) and unpacked no later than its first use less the
   prefetch (``≤ U_v``). A residual of a re-run record is a segment output, held
   (`Timeline.fixed`) from its segment's run to its last use. Aux values of re-run
   records count 0 here (the timeline does not hold them either). ``h[u, t] > 0``
   only if ``u`` is kept and a re-run reader's segment runs after ``t``: then ``u``
   (its producer not re-run) is that segment's input, held until it runs, with its
   stored bytes, and a residual with its copy too (made at ``U_u ≤ L_u``, released
   with ``u``); ``h`` starts past ``L_u``, where the stored and copy terms end. A pair's row,
   before ``q``'s window (where ``w`` is counted nowhere else): ``q``'s segment runs
   by ``F_w``; at ``t`` either it has not run and ``u`` is held, or it has and ``w``
   is held to ``L_w ≥ F_w > t``: at least the smaller. Each ``q`` (so each ``w``) is
   in one pair, and a ``w`` is recomputed, so no ``h`` of its own claims it.
   With ``r`` (its exact value, the segment's run): ``full_w·r[p, t]`` counts ``w``, a
   segment output, from its segment's run to ``L_w ≥ F_p > t``, at points before
   ``p``'s window, where no other term counts it; ``h[u, t]`` with ``R(q, t)`` is the
   row above with "``q``'s segment has not run by ``t``" read exactly; the pairs move
   to ``c``, which only the run rows see (step 4), since at a point ``w`` is now
   counted by ``r[q, t]`` once ``q``'s segment has run.
   ``g[v, t] > 0`` only if ``v`` is kept with copy bytes and a re-run reader's segment
   has run by ``t``: ``v`` (its producer not re-run) is that segment's input, copied
   at its run (`timeline`: ``copy`` of each segment input) and released no earlier
   than ``L_v ≥ U_v > t``; the copy term starts at ``U_v``, so nothing counts it twice.
4. Bytes at a run. If ``q``'s segment runs at ``t``, at ``q``'s step of it the run
   point holds: every ``base[t]`` term (kept values still to be used, copies already
   made, outputs of earlier runs still to be used: none of them the segment's own);
   ``q``'s inputs (a kept one at its stored bytes plus its copy, unpacked for the run:
   at least its full bytes; one recomputed, live at ``q``'s step), ``q``'s outputs,
   and the residuals of ``q``'s re-run parents (in the segment, earlier, kept to its
   end). If ``q`` does not run at ``t``, the row is ``base[t]`` (less some terms) and
   the residuals of segments running at ``t``: held at the last run at ``t``, or at
   point ``t − 1`` if none runs. ``h[u, t] > 0`` says a reader's segment runs after
   point ``t``, so ``u`` is held through every run at ``t`` (a residual's copy too,
   made by ``L_u ≤ t − 1``; a pair's ``h``: ``u``
   until its reader runs, ``w`` from then on, ``L_w > t``); a copy ``g[v, t − 1]``
   counts is held to ``L_v ≥ U_v ≥ t``. Both sit in ``v``'s (``u``'s) terms of
   ``base``, which a row for a ``q`` reading it subtracts before adding its full
   bytes. ``full_w·R(p, t − 1)``: ``w`` held from a run by ``t − 1`` to ``L_w ≥ t``.
   ``c[u, t]``: ``h[u, t]`` (above), or, if ``q`` is re-run, ``u`` kept and ``q``'s
   segment has not run by ``t − 1`` (so ``w`` is in no ``R`` term of ``base[t]``), it
   runs at ``t`` or later: at any run at ``t`` either it has not run yet and ``u``, its
   input, is held, or it has and ``w`` is (``L_w ≥ F_q > t``); ``q`` is in one pair,
   so no other ``c`` claims ``w``, and ``c`` replaces ``h[u, t]`` in ``base``.
   ``s[a, q]`` is set to [``a`` and ``q`` are in one segment]: a path of re-run
   neighbours is inside one connected component, so every path row holds. A member
   term is positive only if ``q``'s segment runs at ``t`` (``Δ[q, t] = 1``) with
   ``a`` in it (and ``r``, re-run and ``a``'s neighbour, too): the segment re-runs its
   records in forward order, so ``a < q`` has run by ``q``'s step, and
   `segment_peak` holds there every segment output made so far (``a``'s residual:
   a segment output, ``a`` re-run) and every value a later member still reads
   (``r > q``). Neither is in ``base[t]`` (``a``'s residuals count from
   ``R(a, t − 1) = 0``: ``a`` runs at ``t``; a value of a re-run record is not kept),
   nor ``q``'s inputs or outputs, nor its parents' residuals (left out of the terms).
   Otherwise the term is ``≤ 0``.
   A member's input ``u``: its term is positive only if ``q``'s segment runs at ``t``
   with ``a`` in it and ``u`` is kept (so its producer is not re-run): then ``u`` is a
   segment input, copied before the run and released after it (`timeline`), so held
   at every step at its stored bytes plus its copy, at least ``full_u``; the row drops
   ``u``'s terms of ``base[t]`` (``h``, ``c``, ``g`` and the rest are parts of those
   bytes), and ``u`` is none of ``q``'s inputs, outputs or members' values (those are
   made in the segment, so not kept). Otherwise the term is ``≤ 0``.
   The ``m`` row: if ``q``'s segment runs at ``t``, at ``q``'s step `segment_peak`
   holds every segment output made so far (kept to the end), so the residuals of
   every member ``a < q`` (``m[q]`` of them; none in ``base[t]``: ``R(a, t − 1) = 0``,
   and ``h``, ``c``, ``g`` count kept values only, held through the run), and
   ``q``'s inputs and outputs as in the first row; an input ``v`` of ``q`` that is a
   residual of a re-run ``p`` (``x[p] = 1``: a member before ``q``, in ``m[q]``) is
   counted once, less ``full_v·x[p]``. If ``q`` does not run at ``t`` the added terms
   are ``≤ 0`` (``m[q] ≤ most_q``): the row is ``≤ base[t]``.
   The row over every record switching at ``t``: at the last run at ``t`` the
   segments run before it at ``t`` hold their outputs (first used at ``t`` or later:
   no record's backward has run since), the last one holds all of its own at its last
   step (`segment_peak` keeps every output to the end), and ``base[t]`` is held as
   above; with no run at ``t`` it is ``base[t]``, held at ``t − 1``.

So the ILP's optimum ≤ the least predicted time of any executor plan within the
budget, and ``tests/policies/test_planner_ilp_joint.py`` checks the steps on random
plans (`Model.at_plan`): the logic rows hold, the objective equals, each point's and
each run row's modelled bytes are ≤ the executor's there. What the pruning rows and
``m`` closed, on U-Nets: without pruning a record with no residual and no re-run
reader (a broadcast, no flops) could be "re-run" at no cost, and its need (its
readers' latest) supported an early run of its neighbours' segment: on the 58-record
U-Net at 70% (25,216 bytes, copies one record ahead) the relaxation's optimum ran a
3-record segment at the run of another one, 4 points before its need, so its kept
input (1 KiB) was counted at neither run, 0.584 µs (the best plan known, 0.717, is now
the bound); without ``m`` a run row saw the residuals of members within
``MEMBER_DEPTH`` neighbours only: on the 22-record U-Net at 41% (1,689 bytes) the
relaxation's optimum re-ran a 7-record chain whose last step holds a residual (512
bytes) 5 neighbours back, 0.543 µs (now 0.640, the optimum). Where it is still loose:
a segment may run earlier than its first need when a re-run record needed by then is
next to a set of records needed later (the support rows do not ask for a re-run path
to it); runs more than
``WINDOW`` points before a need are seen only through ``r`` (no run row there, nor at
a window's first point); two segments running at one point see each other's
residuals only at the last run's end (not at their members' steps); a run row sees
one record's step (its inputs, outputs, the residuals of members before it along
chains of re-run neighbours ``p < q``, the values later members read of members within
``MEMBER_DEPTH`` neighbours, the kept inputs of one member within
``INPUT_DEPTH``, not the segment's other kept inputs: on the 69-record random DAG at
37% the relaxation's optimum runs a 4-record segment whose first member's kept inputs,
1 KiB, are held at its last member's step, 3 neighbours away; ``INPUT_DEPTH = 3``
counts them but doubles the nonzeros and stops that solve short at 100 s); ``g`` sees
a copy only from runs inside the reader's window (with ``R`` in place of ``z`` the
points there match the executor's, at 15% more columns and slower solves).
`ilp_joint.solve` reports the bound HiGHS proved even when it stops at its
time limit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from tapegrad.core.tape import Tape
from tapegrad.planner import joint
from tapegrad.planner.cost import CostModel
from tapegrad.planner.ilp.joint_columns import Flags, layout
from tapegrad.planner.ilp.joint_rows import Row, base_rows, logic_rows, point_bytes, run_rows

__all__ = ["Model", "build", "WINDOW"]

WINDOW: int | None = 8  # points before a need where runs are modelled, for the bound
SUPPORT_LAYERS = 3  # support rows per run column: balls of radius 0..3, then the component
MEMBER_DEPTH = 3  # run rows count the segment's members up to this many neighbours away
MEMBER_PATHS = 4  # paths (rows of s) per pair of records
INPUT_DEPTH = 1  # run rows count the inputs of members up to this many neighbours away
PRUNED = True  # rows: a re-run record without residuals has a re-run reader
PREFIX = True  # run rows count every member's residuals before q (m[q], chains of members)


@dataclasses.dataclass
class Model:
    """The relaxation's columns (``x`` per record, then ``y`` per (key, mechanism), then
    ``z`` per (record, point of its run window), then ``h`` per (kept value, point),
    then ``g`` per (kept value, point) before its first use),
    objective, bounds, logic rows and byte rows (one per point)."""

    n: int
    keys: list  # candidate kept values (residual keys)
    producer: np.ndarray  # record producing each key
    opts: joint.Options  # per key: stored / copy bytes and seconds per mechanism
    ycols: list  # (key index, mechanism column) of each y
    window: dict  # record -> (first z point s, its need F, column of z[i, s])
    holds: list  # per h: (column, key index, points, ((reader q, z column), ...))
    claims: list  # per pair row of an h: (column, key index, reader q, bytes per mechanism)
    order: list  # the record backward runs at each point 1..T-1
    cost: np.ndarray  # seconds per column
    upper: np.ndarray  # per column
    integer: np.ndarray  # per column
    rows: list  # (columns, coefficients, lower, upper)
    mem: np.ndarray  # (points, columns) bytes per unit of each column
    base: np.ndarray  # (points, columns): what a segment run at t finds held from t - 1
    runs: list  # (point t, columns, coefficients): bytes at a run at t (b[t] = base[t])
    budget: int
    early: list = dataclasses.field(default_factory=list)  # per g: (column, key, points, pairs)
    before: dict = dataclasses.field(default_factory=dict)  # record -> column of r[i, 1]
    shadows: list = dataclasses.field(default_factory=list)  # (c, h, key, q, bytes, r col)
    one: int = -1  # a column fixed to 1 (the run rows' constants), -1: none
    pairs: list = dataclasses.field(default_factory=list)  # (s column, a, q): one segment
    held: np.ndarray | None = None  # (keys, mechanisms): bytes an h counts (None: stored)
    prefix: dict = dataclasses.field(default_factory=dict)  # q -> column of m[q]
    resid: dict = dataclasses.field(default_factory=dict)  # record -> its residuals' bytes

    @property
    def columns(self) -> int:
        return len(self.cost)

    def at_plan(self, tape: Tape, choice: dict[Any, int]) -> np.ndarray:
        """The column values of an executor plan: ``tape`` planned (segments built),
        ``choice`` its kept keys' mechanism columns (`joint.COLUMNS`)."""
        z = np.zeros(self.columns)
        kept, seg_of = tape.residual_keys()
        run: dict[int, int] = {}  # segment -> the point it runs at (`timeline`'s rule)
        for t, i in enumerate(self.order, 1):
            rec = tape.records[i]
            for s in rec.saves:
                key = rec.residual_key(s)
                if key not in kept and key in seg_of:
                    run.setdefault(seg_of[key], t)
        never = 1 << 30
        ran = {i: run.get(seg.id, never) for seg in tape.segments for i in seg.records}
        for seg in tape.segments:
            z[list(seg.records)] = 1.0
        for i, (s, need, col) in self.window.items():
            for t in range(s, need):
                z[col + t - s] = float(ran.get(i, never) <= t)
        col = {kc: self.n + j for j, kc in enumerate(self.ycols)}
        held = self.opts.stored if self.held is None else self.held
        stored = np.zeros(len(self.keys))
        for k, key in enumerate(self.keys):
            if key in choice:
                z[col[(k, choice[key])]] = 1.0
                stored[k] = held[k, choice[key]]
        for i, c0 in self.before.items():
            for t in range(1, self.window[i][0]):
                z[c0 + t - 1] = float(ran.get(i, never) <= t)
        for hcol, k, _, qs in self.holds:
            big = held[k].max()
            z[hcol] = max([0.0] + [stored[k] + big * (z[q] - z[c] - 1.0) for q, c in qs])
        for gcol, k, _, qs in self.early:
            m = choice.get(self.keys[k])
            if m is not None:
                big = self.opts.copied[k].max()
                z[gcol] = max([0.0] + [self.opts.copied[k, m] - big * (1.0 - z[c]) for _, c in qs])
        for hcol, k, q, coef in self.claims:
            m = choice.get(self.keys[k])
            if m is not None:
                z[hcol] = max(z[hcol], coef[m] - coef.max() * (1.0 - z[q]))
        for ccol, hcol, k, q, coef, rc in self.shadows:
            m = choice.get(self.keys[k])
            ran_before = 0.0 if rc is None else z[rc]
            lift = -1.0 if m is None else coef[m] - coef.max() * (1.0 - z[q] + ran_before)
            z[ccol] = max(z[hcol], lift)
        if self.one >= 0:
            z[self.one] = 1.0
        seg_id = {i: seg.id for seg in tape.segments for i in seg.records}
        for sc, a, q in self.pairs:
            z[sc] = float(a in seg_id and seg_id.get(q) == seg_id[a])
        for seg in tape.segments:  # m[q]: its segment's members before q
            for q in seg.records:
                if q in self.prefix:
                    z[self.prefix[q]] = sum(self.resid.get(a, 0) for a in seg.records if a < q)
        b0 = self.columns - len(self.base) + 1
        z[b0:] = self.base[1:] @ z
        return z

    def peaks(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Modelled bytes at columns ``z``: at each point, and at each run row."""
        runs = [float(np.dot(co, z[cols])) for _, cols, co in self.runs]
        return self.mem @ z, np.array(runs)

    def check(self, z: np.ndarray, tol: float = 1e-6) -> tuple[bool, float, int]:
        """(logic rows and bounds hold, seconds, modelled peak bytes) at columns ``z``."""
        ok = bool(np.all(z >= -tol) and np.all(z <= self.upper + tol))
        for cols, coef, lo, hi in self.rows:
            v = float(np.dot(coef, z[cols]))
            ok = ok and lo - tol <= v <= hi + tol
        points, runs = self.peaks(z)
        return ok, float(self.cost @ z), int(np.round(max(points.max(), runs.max(initial=0))))


def build(
    tape: Tape,
    fixed: Sequence[str | None],
    budget: int,
    mechanisms: tuple[str, ...],
    costs: CostModel,
    prefetch: int = 0,
    window: int | None = WINDOW,
    early_runs: bool = True,
) -> Model | None:
    """The relaxation for ``tape`` at ``budget``; None on tapes with checkpoint regions
    or loop/branch records (outside the argument above). ``window``: how many points
    before its need a record's run is modelled (None: all). ``early_runs``: the columns
    ``r`` (a run's residuals before the window, propagated along re-run neighbours)."""
    flags = Flags(SUPPORT_LAYERS, MEMBER_DEPTH, MEMBER_PATHS, INPUT_DEPTH, PRUNED, PREFIX)
    L = layout(tape, fixed, mechanisms, costs, prefetch, window, early_runs, flags)
    if L is None:
        return None
    rows: list[Row] = []
    logic_rows(L, rows, early_runs, flags)
    mem = point_bytes(L, prefetch)
    base, kterm = base_rows(L, rows, prefetch)
    runs = run_rows(L, rows, kterm, flags)
    return Model(
        L.n, L.keys, L.kprod, L.opts, L.ycols, L.win, L.holds, L.claims, L.order, L.cost,
        L.upper, L.integer, rows, mem, base, runs, int(budget), L.early, L.before, L.shadows,
        L.one, [(sc, a, q) for (a, q), sc in L.pairs.items()], L.hbytes, L.prefix, L.res,
    )  # fmt: skip
