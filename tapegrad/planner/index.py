"""The planner's scoring engine: `build_segments`, `problem.simulate` and the joint
planner's `timeline` for one tape and many decision lists, with everything that
depends only on the tape computed once.

The planner scores hundreds of plans of one tape. `_checkpoint.build_segments` and
`problem.simulate` rebuild, per plan, the producer of every value, each record's
residual keys, use counts, byte sizes; on a 1,000-record tape that was ~20 ms a plan.
`TapeIndex` holds those facts (integer record indices, value ids, sizes) and runs the
same algorithms over them: `segments(dec)` returns the very segments
`build_segments` returns, `simulate(dec)` the very (peak, flops, sizes) `simulate`
returns on the planned tape, `timeline(segs, prefetch)` the very `Timeline`
`joint.timeline` returns on it (``tests/policies/test_planner_fast.py``
checks all three on random plans of several tapes). Nothing here decides anything: it
only scores.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from tapegrad.core.tape import Segment, Tape, Var
from tapegrad.engine.checkpoint import active_segments
from tapegrad.planner.cost import device_nbytes, record_flops
from tapegrad.planner.joint import Timeline, pole_keys
from tapegrad.planner.problem import loops_held

__all__ = ["TapeIndex"]


class TapeIndex:
    """Tape-only facts for scoring many plans of ``tape``, and the scoring itself."""

    def __init__(self, tape: Tape, seg_flops: float = 0.0):
        self.tape = tape
        # each recomputed segment's fixed cost, in flops (`CostModel.segment_flops`)
        self.seg_flops = seg_flops
        recs = tape.records
        self.n = n = len(recs)
        self._values(recs)
        self.derives = [
            r.rule != "none" and (bool(r.bodies) or any(s.kind == "aux" for s in r.saves))
            for r in recs
        ]
        self.active = [r.rule != "none" for r in recs]
        self.has_aux = [any(s.kind == "aux" for s in r.saves) for r in recs]
        self.has_bodies = [bool(r.bodies) for r in recs]
        self._saves(recs)
        self.order = [i for i in range(n - 1, -1, -1) if self.active[i]]
        uses: dict[Any, int] = {}
        for i in range(n):
            if self.active[i]:
                for key in self.keys[i]:
                    uses[key] = uses.get(key, 0) + 1
        self.uses0 = uses
        self.free = tape.caller_ids()
        self._sizes(recs)
        self.flops = [record_flops(r) for r in recs]
        # loop record -> bytes of its per-step residuals while kept (`loops_held`)
        self.loop_bytes = {k[1]: b for k, b in loops_held(tape, ()).items()}
        self._seg_memo: dict[tuple, tuple[float, int]] = {}
        self._group_memo: dict[tuple[int, ...], tuple] = {}  # `_group`
        self._piece_memo: dict[tuple, tuple] = {}  # `_piece`
        self._poles: frozenset | None = None  # `pole_keys(tape)`, on the first timeline
        self._dev: dict[Any, int] = {}  # key -> `device_nbytes` of its Var / Saved
        self._bwd_labels = [f"bwd {i}" for i in range(n)]
        self._tl_memo: dict[tuple, Timeline] = {}  # (prefetch, segments) -> its timeline
        # `segments`: per record, the ids of its outputs some active record saves, and
        # whether recomputing it makes backward need it (those, or derived residuals)
        saved_out: list[set[int]] = [set() for _ in range(n)]
        for i in range(n):
            if self.active[i]:
                for vid, p in self.save_vars[i]:
                    saved_out[p].add(vid)
        self._saved_out = saved_out
        self._seeds = [
            bool(saved_out[i]) or (self.active[i] and (self.has_bodies[i] or self.has_aux[i]))
            for i in range(n)
        ]
        self._segs_memo: dict[tuple[int, ...], tuple[Segment, ...]] = {}  # needed -> segments
        self._segs_key: dict[int, tuple[int, ...]] = {}  # id of a memoised result -> its key
        self._sim_memo: dict[tuple[int, ...], tuple] = {}  # needed -> `simulate`'s result

    def _values(self, recs: Sequence[Any]) -> None:
        """Who makes each value and what each record reads: ``producer``, ``in_vars``,
        ``same_region_in``, ``in_prod``, ``out_ids``."""
        producer: dict[int, int] = {}
        for r in recs:
            for o in r.outputs:
                producer[o.id] = r.index
        self.producer = producer
        region = [r.region for r in recs]
        # per record: (id, Var, producer index or -1) of each Var input, in order
        self.in_vars: list[list[tuple[int, Var, int]]] = []
        self.same_region_in: list[list[int]] = []  # producers of inputs, same region
        for r in recs:
            ins = []
            same = []
            for u in r.inputs:
                if isinstance(u, Var):
                    p = producer.get(u.id, -1)
                    ins.append((u.id, u, p))
                    if p >= 0 and region[p] == r.region:
                        same.append(p)
            self.in_vars.append(ins)
            self.same_region_in.append(same)
        self.in_prod = [[p for _, _, p in ins if p >= 0] for ins in self.in_vars]
        self.out_ids = [[o.id for o in r.outputs] for r in recs]

    def _saves(self, recs: Sequence[Any]) -> None:
        """What each record keeps: ``save_vars`` (var id, producer) of each input/output
        save that is a produced Var, ``keys`` its residual keys in save order,
        ``aux_keys`` its derived ones, ``key_obj`` each key's Var / Saved, first seen
        (as `Tape.residual_keys`)."""
        producer = self.producer
        self.save_vars: list[list[tuple[int, int]]] = []
        self.keys: list[list[Any]] = []
        self.aux_keys: list[list[Any]] = []
        obj: dict[Any, Any] = {}
        for r in recs:
            sv, ks, ak = [], [], []
            for s in r.saves:
                key = r.residual_key(s)
                ks.append(key)
                if s.kind == "aux":
                    ak.append(key)
                    obj.setdefault(key, s)
                    continue
                v = r.inputs[s.index] if s.kind == "in" else r.outputs[s.index]
                obj.setdefault(key, v)
                if isinstance(v, Var) and v.id in producer:
                    sv.append((v.id, producer[v.id]))
            self.save_vars.append(sv)
            self.keys.append(ks)
            self.aux_keys.append(ak)
        self.key_obj = obj

    def _sizes(self, recs: Sequence[Any]) -> None:
        """``size``: bytes per residual key and per value (the caller's own: 0), and
        ``out_bytes``, every output's."""
        free = self.free
        size: dict[Any, int] = {}
        for key, v in self.key_obj.items():
            size[key] = 0 if key in free else v.nbytes
        for r in recs:
            for o in r.outputs:
                size.setdefault(o.id, o.nbytes)
            for u in r.inputs:
                if isinstance(u, Var) and u.id not in size:
                    size[u.id] = 0 if u.id in free else u.nbytes
        self.size = size
        self.out_bytes = {o.id: o.nbytes for r in recs for o in r.outputs}

    # -- build_segments -------------------------------------------------------------

    def segments(self, dec: Sequence[str]) -> tuple[Segment, ...]:
        """`_checkpoint.build_segments(tape, dec)`, over the index.

        The segments depend on ``dec`` only through the recomputed records some
        residual needs (`_needed`): plans that differ elsewhere (a record recomputed
        that nothing reads from backward) share one result, kept by that set (about
        half of a joint descent's plans)."""
        return self._keyed(dec)[1]

    def _keyed(self, dec: Sequence[str]) -> tuple[tuple[int, ...], tuple[Segment, ...]]:
        """(the recomputed records backward needs, sorted: what the segments depend on;
        ``dec``'s segments)."""
        key = tuple(sorted(self._needed(dec)))
        got = self._segs_memo.get(key)
        if got is None:
            got = self._segs_memo[key] = self._build(key) if key else ()
            self._segs_key[id(got)] = key
        return key, got

    def _needed(self, dec: Sequence[str]) -> set[int]:
        """The recomputed records backward needs: those whose outputs some active record
        saves or that derive residuals, and the recomputed records of their region they
        read from, transitively."""
        recompute = [d == "recompute" for d in dec]
        seeds = self._seeds
        stack = [i for i, r in enumerate(recompute) if r and seeds[i]]
        needed: set[int] = set()
        same_region_in = self.same_region_in
        while stack:
            i = stack.pop()
            if i in needed:
                continue
            needed.add(i)
            for p in same_region_in[i]:
                if recompute[p] and p not in needed:
                    stack.append(p)
        return needed

    def _build(self, needed_sorted: tuple[int, ...]) -> tuple[Segment, ...]:
        needed = set(needed_sorted)
        saved_out = self._saved_out
        wanted = {p: saved_out[p] for p in needed_sorted if saved_out[p]}
        same_region_in = self.same_region_in
        parent = {i: i for i in needed_sorted}

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for i in needed_sorted:
            for j in same_region_in[i]:
                if j in needed:
                    parent[find(i)] = find(j)
        groups: dict[int, list[int]] = {}
        for i in needed_sorted:
            groups.setdefault(find(i), []).append(i)
        groups_l = sorted(tuple(g) for g in groups.values())
        facts = [self._group(idxs) for idxs in groups_l]
        inputs_of = [f[0] for f in facts]
        has_aux = [f[1] for f in facts]
        # each group's wanted outputs, in order, once (`active_segments` asks each round)
        wanted_out = [f[2] for f in facts]

        def outputs(g: int, stored: set[int]) -> list[int]:
            return [o for o in wanted_out[g] if o not in stored]

        active, stored = active_segments(inputs_of, has_aux, wanted, outputs)
        pieces = [self._piece(groups_l[g], tuple(outputs(g, stored))) for g in sorted(active)]
        pruned = tuple(
            Segment(k, idxs, inputs, outs, prevent)
            for k, (_, outs, prevent, idxs, inputs) in enumerate(pieces)
        )
        kept = {v.id for seg in pruned for v in seg.inputs}
        provided = {o.id for seg in pruned for o in seg.outputs}
        if all(v in kept or v in provided for ws in wanted.values() for v in ws):
            return pruned
        return tuple(
            Segment(k, groups_l[g], piece[0], piece[1], piece[2])
            for k, (g, piece) in enumerate(zip(sorted(active), pieces))
        )

    def _group(self, idxs: tuple[int, ...]) -> tuple[dict[int, Var], bool, list[int]]:
        """A group of recomputed records' facts for `active_segments`, memoised (plans
        of one tape share most groups): its inputs (id -> Var, in order), whether it
        derives residuals, and the outputs backward wants of it, in order."""
        got = self._group_memo.get(idxs)
        if got is None:
            members = set(idxs)
            inputs: dict[int, Var] = {}
            for i in idxs:
                for vid, u, p in self.in_vars[i]:
                    if p not in members:
                        inputs.setdefault(vid, u)
            saved_out, out_ids = self._saved_out, self.out_ids
            wanted_out = [o for i in idxs for o in out_ids[i] if o in saved_out[i]]
            got = (inputs, any(self.derives[i] for i in idxs), wanted_out)
            self._group_memo[idxs] = got
        return got

    def _piece(self, idxs: tuple[int, ...], outs: tuple[int, ...]) -> tuple:
        """The segment of group ``idxs`` providing ``outs``, memoised: (its inputs, its
        output Vars, prevent_cse, and the records and inputs `_checkpoint._prune`
        keeps)."""
        mkey = (idxs, outs)
        got = self._piece_memo.get(mkey)
        if got is None:
            tape = self.tape
            region = tape.records[idxs[0]].region
            prevent = True
            if region is not None:
                prevent = next(r for r in tape.regions if r.id == region).prevent_cse
            out_vars = tuple(self._var(o) for o in outs)
            inputs = tuple(self._group(idxs)[0].values())
            kept, kept_in = self._pruned(Segment(0, idxs, inputs, out_vars, prevent))
            got = self._piece_memo[mkey] = (inputs, out_vars, prevent, kept, kept_in)
        return got

    def _var(self, vid: int) -> Var:
        r = self.tape.records[self.producer[vid]]
        return r.outputs[self.out_ids[r.index].index(vid)]

    def _pruned(self, seg: Segment) -> tuple[tuple[int, ...], tuple[Var, ...]]:
        """The records `_checkpoint._prune` keeps of ``seg``, and their inputs."""
        members = set(seg.records)
        keep: set[int] = set()
        stack = [self.producer[o.id] for o in seg.outputs]
        stack += [i for i in seg.records if self.derives[i]]
        while stack:
            i = stack.pop()
            if i in keep:
                continue
            keep.add(i)
            for p in self.in_prod[i]:
                if p in members:
                    stack.append(p)
        idxs = tuple(sorted(keep))
        inputs: dict[int, Var] = {}
        for i in idxs:
            for vid, u, p in self.in_vars[i]:
                if p not in keep:
                    inputs.setdefault(vid, u)
        return idxs, tuple(inputs.values())

    def planned(self, dec: Sequence[str]) -> Tape:
        """The tape with ``dec``'s segments (decisions are read from the segments)."""
        return dataclasses.replace(self.tape, segments=self.segments(dec))

    # -- simulate -------------------------------------------------------------------

    def segment_cost(self, seg: Segment) -> tuple[float, int]:
        """(flops, recomputation peak) of a segment (`segment_peak`), memoised."""
        mkey = (seg.records, tuple(o.id for o in seg.outputs))
        got = self._seg_memo.get(mkey)
        if got is None:
            keep = {o.id for o in seg.outputs}
            last: dict[int, int] = {}
            for k in seg.records:
                for vid, _, _ in self.in_vars[k]:
                    last[vid] = k
            live = peak = 0
            sizes: dict[int, int] = {}
            ob = self.out_bytes
            for k in seg.records:
                for o in self.out_ids[k]:
                    sizes[o] = ob[o]
                    live += ob[o]
                peak = max(peak, live)
                for vid, _, _ in self.in_vars[k]:
                    if last.get(vid) == k and vid in sizes and vid not in keep:
                        live -= sizes.pop(vid)
                for o in self.out_ids[k]:
                    if o not in last and o not in keep and o in sizes:
                        live -= sizes.pop(o)
            got = (sum(self.flops[i] for i in seg.records) + self.seg_flops, peak)
            self._seg_memo[mkey] = got
        return got

    def residual_keys(self, segs: Sequence[Segment]) -> tuple[dict[Any, Any], dict[Any, int]]:
        """`Tape.residual_keys` of the tape planned with ``segs``."""
        recomputed: dict[Any, int] = {}
        for seg in segs:
            for v in seg.outputs:
                recomputed[v.id] = seg.id
            for i in seg.records:
                for key in self.aux_keys[i]:
                    recomputed[key] = seg.id
        kept = {k: v for k, v in self.key_obj.items() if k not in recomputed}
        for seg in segs:
            for v in seg.inputs:
                kept.setdefault(v.id, v)
                recomputed.pop(v.id, None)
        return kept, recomputed

    def simulate(
        self, dec: Sequence[str] | None = None, trace: dict | None = None, segs: Any = None
    ) -> tuple[int, float, dict[Any, int]]:
        """`problem.simulate` of the tape planned with ``dec`` (or with ``segs``); without
        ``trace`` or ``segs``, memoised like `segments` (the sizes returned are shared:
        callers must not modify them)."""
        if segs is None:
            key, segs = self._keyed(dec or ["save"] * self.n)
            if trace is None:
                got = self._sim_memo.get(key)
                if got is None:
                    got = self._sim_memo[key] = self.simulate(trace=None, segs=segs)
                return got
        kept, seg_of = self.residual_keys(segs)
        allsize = self.size
        size = {k: allsize[k] for k in kept}
        loops = self._loops_kept(segs)
        live = sum(size.values()) + sum(loops.values())
        peak = live
        remaining = self._uses(segs)
        extra: dict[Any, int] = {}
        flops = 0.0
        done: set[int] = set()
        for i in self.order:
            keys = self.keys[i]
            for key in keys:
                if key in extra or key in size:
                    continue
                sid = seg_of.get(key)
                if sid is None or sid in done:
                    continue
                done.add(sid)
                seg = segs[sid]
                seg_flops, seg_peak = self.segment_cost(seg)
                flops += seg_flops
                peak = max(peak, live + seg_peak)
                if trace is not None:
                    trace[i] = max(trace.get(i, 0), live + seg_peak)
                for o in seg.outputs:
                    b = allsize[o.id]
                    extra[o.id] = b
                    live += b
                for j in seg.records:  # derived residuals it makes (a custom_vjp's)
                    for key in self.aux_keys[j]:
                        if key in seg_of and key not in extra:  # (not another's array)
                            extra[key] = b = self.key_obj[key].nbytes
                            live += b
                for v in seg.inputs:
                    k = v.id
                    remaining[k] -= 1
                    if remaining[k] == 0:
                        live -= size.get(k, 0) + extra.pop(k, 0)
            if live > peak:
                peak = live
            if trace is not None:
                trace[i] = max(trace.get(i, 0), live)
            for key in keys:
                remaining[key] -= 1
                if remaining[key] == 0:
                    live -= size.get(key, 0) + extra.pop(key, 0)
            live -= loops.get(i, 0)  # a loop's residuals: released after its backward
        return peak, flops, size

    def _loops_kept(self, segs: Sequence[Segment]) -> dict[int, int]:
        """`loop_bytes` of the loops ``segs`` do not recompute."""
        if not self.loop_bytes:
            return {}
        inside = {i for g in segs for i in g.records}
        return {i: b for i, b in self.loop_bytes.items() if i not in inside}

    # -- timeline -------------------------------------------------------------------

    def device_nbytes(self, key: Any, v: Any) -> int:
        """`cost.device_nbytes(v)` of the value ``v`` under residual key ``key``,
        memoised by key (every Var of one id has the same type)."""
        got = self._dev.get(key)
        if got is None:
            got = self._dev[key] = device_nbytes(v)
        return got

    def timeline(self, segs: Sequence[Segment], prefetch: int = 0) -> Timeline:
        """`joint.timeline` of the tape planned with ``segs`` (same `Timeline`,
        field by field). The joint search builds one per plan it completes, thousands
        per planning call: here keys, backward order, use counts, pole keys and device
        bytes come from the index instead of being re-derived from the tape. Plans whose
        decisions differ only where they build the same segments (recomputing a value
        nothing reads, say) share one timeline: about half of a joint descent's plans
        (615 distinct timelines of 1,352 on the bench's 58-record U-Net). The `Timeline`
        returned is shared, so callers must not modify it (none does)."""
        known = self._segs_key.get(id(segs))
        if known is not None and self._segs_memo.get(known) is segs:
            mkey: tuple = (prefetch, known)  # `segments`' own result, by what it depends on
        else:
            mkey = (
                prefetch,
                None,
                tuple(
                    (g.records, tuple(v.id for v in g.inputs), tuple(o.id for o in g.outputs))
                    for g in segs
                ),
            )
        got = self._tl_memo.get(mkey)
        if got is None:
            got = self._tl_memo[mkey] = self._timeline(segs, prefetch)
        return got

    def _timeline(self, segs: Sequence[Segment], prefetch: int) -> Timeline:
        kept, seg_of = self.residual_keys(segs)
        free = self.free
        keys = [k for k in kept if k not in free]
        idx = {k: i for i, k in enumerate(keys)}
        nbytes = self.device_nbytes
        full = np.array([nbytes(k, kept[k]) for k in keys], dtype=np.int64)
        K = len(keys)
        # plain lists while filling (numpy's scalar access is slow), arrays at the end
        release = [-1] * K
        unpack = [-1] * K
        loops = self._loops_kept(segs)
        held = sum(loops.values())  # bytes held whatever the mechanisms (loops, recomputed)
        fixed: list[int] = [held]  # point 0: the end of forward
        labels = ["forward"]
        remaining = self._uses(segs)
        extra: dict[Any, int] = {}
        flops = 0.0
        done: set[int] = set()

        # (`copy`: a kept value is present from the next point on; `drop`: a use ends,
        # and with the last one the value's bytes go; both inlined, the hot loop)
        order, keys_of, bwd = self.order, self.keys, self._bwd_labels
        get = idx.get
        for n, r in enumerate(order):
            pt = len(fixed)
            for nxt in order[n + 1 : n + 1 + prefetch]:
                for key in keys_of[nxt]:
                    i = get(key)  # a key not kept has no index: a no-op
                    if i is not None and unpack[i] < 0:
                        unpack[i] = pt
            rkeys = keys_of[r]
            for key in rkeys:
                if key in kept:
                    i = get(key)  # None: a free value (no index)
                    if i is not None and unpack[i] < 0:
                        unpack[i] = len(fixed)
                    continue
                if key in extra or key not in seg_of:
                    continue
                sid = seg_of[key]
                if sid in done:
                    continue
                done.add(sid)
                seg = segs[sid]
                seg_flops, seg_peak = self.segment_cost(seg)
                flops += seg_flops
                pt = len(fixed)
                for v in seg.inputs:
                    i = get(v.id)
                    if i is not None and unpack[i] < 0:
                        unpack[i] = pt
                fixed.append(held + seg_peak)
                labels.append("recompute")
                for o in seg.outputs:
                    extra[o.id] = b = nbytes(o.id, o)
                    held += b
                for j in seg.records:  # derived residuals it makes (a custom_vjp's)
                    for key in self.aux_keys[j]:
                        if key in seg_of and key not in extra:  # (not another's array)
                            extra[key] = b = nbytes(key, self.key_obj[key])
                            held += b
                for v in seg.inputs:
                    k = v.id
                    remaining[k] -= 1
                    if remaining[k] == 0:
                        held -= extra.pop(k, 0)
                        i = get(k)
                        if i is not None:
                            release[i] = pt
            fixed.append(held)
            labels.append(bwd[r])
            pt = len(fixed) - 1
            for key in rkeys:
                remaining[key] -= 1
                if remaining[key] == 0:
                    held -= extra.pop(key, 0)
                    i = get(key)
                    if i is not None:
                        release[i] = pt
            held -= loops.get(r, 0)
        rel = np.array(release, dtype=np.int64)
        rel[rel < 0] = len(fixed) - 1  # held to the end
        unp = np.array(unpack, dtype=np.int64)
        never = unp < 0
        unp[never] = rel[never] + 1
        if self._poles is None:
            self._poles = pole_keys(self.tape)
        poles = self._poles | {v.id for seg in segs for v in seg.inputs}
        kept_objs = [kept[k] for k in keys]
        fx = np.array(fixed, np.int64)
        return Timeline(keys, kept_objs, full, rel, unp, fx, flops, tuple(labels), poles)

    def _uses(self, segs: Sequence[Segment]) -> dict[Any, int]:
        """Uses per residual key in backward, with ``segs``' recomputations reading their
        inputs."""
        remaining = dict(self.uses0)
        for seg in segs:
            for v in seg.inputs:
                remaining[v.id] = remaining.get(v.id, 0) + 1
        return remaining
