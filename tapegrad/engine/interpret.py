"""The forward and backward interpreters over a `Tape`.

forward: bind each record's primitive on jax arrays (or tracers), pack the
residuals its rule declared through the residual policy, and drop every
value at its last use.

backward: walk the records in reverse; a record whose outputs received no
cotangent does no work (symbolic zeros). Each residual is unpacked when its
record runs and, unless the caller retains them, released right after, so
memory falls during backward as in PyTorch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

import jax
import numpy as np
from jax import lax

from tapegrad.core import jax_compat as compat
from tapegrad.core.caches import BoundedCache
from tapegrad.core.keys import NoKey, value_key
from tapegrad.core.residual_policy import SAVE, is_plain, resolve_prefetch
from tapegrad.core.tape import Lit, Record, Saved, Segment, Tape, Var, kind_of
from tapegrad.engine.backward_schedule import schedule
from tapegrad.engine.residuals import Residuals, _pack, _saved_values, _unpack, tie_to
from tapegrad.errors import ResidualError, where
from tapegrad.rules import FALLBACK, Res, lookup

__all__ = ["Residuals", "forward", "backward", "run_segment"]


def _bind(rec: Record, ins: list) -> list:
    out = rec.prim.bind(*ins, **rec.bind_params)
    return list(out) if rec.prim.multiple_results else [out]


def _run(rec: Record, ins: list) -> tuple[Sequence[Any], Any]:
    """Evaluate one record: (outputs, derived residuals or None)."""
    if rec.rule != "none":
        rule = lookup(rec.primitive) or FALLBACK
        if rule.derive is not None:
            return rule.derive(rec, ins)
    return _bind(rec, ins), None


# Eager backward: a rule is a few jax ops; dispatching them one by one costs
# ~20-80 µs each, while one jitted call of the whole rule (cached per primitive,
# params and shapes) costs about one dispatch. So eagerly each rule runs as one
# compiled call; under a trace (jit, vmap, grad of grad) rules are traced inline.
# A literal operand (``x * lr`` with a Python float ``lr``) is an argument of the
# compiled rule, never part of its key: a value that changes on every step (a
# learning-rate or temperature schedule) reuses the same executable. No rule reads a
# literal's value at trace time (they compute with it like any operand).
_RULE_JIT = BoundedCache("interpret.rule_jit", max_entries=2048)


def _param_key(v: Any) -> Any:
    # Structural where possible (a scatter's update_jaxpr is a new object on every trace).
    try:
        return value_key(v)
    except NoKey:
        return v


def _operand_key(i: Var | Lit) -> tuple:
    if type(i) is Lit and not isinstance(i.dtype, np.dtype):
        raise TypeError("a literal of an extended dtype")  # keyed by nothing: run op by op
    # Explicit-axis shardings are part of the type, and rules read them.
    return (i.shape, str(i.dtype), type(i) is Lit, compat.explicit_sharding(i))


def _rule_key(rec: Record, x, y, aux, gs):
    try:
        key = (
            rec.primitive,
            tuple((k, _param_key(v)) for k, v in sorted(rec.params.items())),
            rec.active,
            tuple(_operand_key(i) for i in rec.inputs),
            tuple((o.shape, str(o.dtype), compat.explicit_sharding(o)) for o in rec.outputs),
            tuple(v is not None and type(i) is not Lit for v, i in zip(x, rec.inputs)),
            tuple(v is not None for v in y),
            len(aux),
            tuple(g is not None for g in gs),
        )
        hash(key)
    except TypeError:
        return None
    return key


def _is_concrete(vals) -> bool:
    for v in vals:
        if v is not None and not isinstance(v, jax.Array) or isinstance(v, jax.core.Tracer):
            return False
    return True


def _apply_rule(rule, rec: Record, x, y, aux, gs) -> list:
    """Input cotangents (fitted to each input's shape and dtype), None where none."""
    # A Python scalar cotangent (``vjp_fn(7.)``) stays one until a rule needs an array.
    gs = [jax.numpy.asarray(g) if isinstance(g, compat.SCALARS) else g for g in gs]
    if (
        rule.kind == "rule"
        and _is_concrete(gs)
        and _is_concrete(y)
        and _is_concrete(aux)
        and _is_concrete(v for v, i in zip(x, rec.inputs) if type(i) is not Lit)
    ):
        key = _rule_key(rec, x, y, aux, gs)
        if key is not None:
            fn = _RULE_JIT.get(key)
            if fn is None:
                fn = _RULE_JIT.put(key, jax.jit(functools.partial(_rule_body, rule, rec)))
            xs = [
                np.asarray(i.value, i.dtype) if type(i) is Lit else v for v, i in zip(x, rec.inputs)
            ]
            return fn(xs, y, aux, gs)
    return _rule_body(rule, rec, x, y, aux, gs)


def _rule_body(rule, rec: Record, x, y, aux, gs) -> list:
    # Literals come as arguments (compiled) or are read from the record (traced inline).
    x = [i.value if type(i) is Lit and v is None else v for v, i in zip(x, rec.inputs)]
    in_cts = rule.vjp(rec.params, Res(x, y, aux, rec.inputs, rec.outputs, rec), gs, rec.active)
    return [
        _fit(ct, inp, rec, i) if (a and ct is not None) else None
        for i, (inp, a, ct) in enumerate(zip(rec.inputs, rec.active, in_cts))
    ]


def _placed(rec: Record, res: Residuals) -> Record:
    """``rec`` with the placements its forward saw: a device_put traced abstractly has no
    ``srcs``, which jax's eager transpose reads off the concrete operands."""
    srcs = res.sources.get(rec.index)
    if srcs is None or srcs == tuple(rec.params["srcs"]):
        return rec
    return dataclasses.replace(rec, params=MappingProxyType({**rec.params, "srcs": srcs}))


def _boundary_consumers(tape: Tape) -> dict[int, tuple[Record, int]]:
    """Segment input var id -> (a consuming record, input index)."""
    out: dict[int, tuple[Record, int]] = {}
    for seg in tape.segments:
        for v in seg.inputs:
            if v.id in out:
                continue
            for r in (tape.records[k] for k in seg.records):
                if any(isinstance(u, Var) and u.id == v.id for u in r.inputs):
                    idx = next(
                        j for j, u in enumerate(r.inputs) if isinstance(u, Var) and u.id == v.id
                    )
                    out[v.id] = (r, idx)
                    break
    return out


def _last_uses(tape: Tape) -> dict[int, int]:
    """Var id -> the index of the last record reading it (past the end: an output)."""
    last_use: dict[int, int] = {}
    for rec in tape.records:
        for i in rec.inputs:
            if isinstance(i, Var):
                last_use[i.id] = rec.index
    for o in tape.outputs:
        if isinstance(o, Var):
            last_use[o.id] = len(tape.records)
    return last_use


def _keep_boundary(res: Residuals, boundary: dict, var_id: int, value: Any) -> None:
    """Keep a segment's input (``boundary``: `_boundary_consumers`) when forward makes it,
    packed as the first record of the segment that reads it would save it."""
    store = res.store
    if var_id in store:
        return
    rec, i = boundary[var_id]
    u = rec.inputs[i]
    store[var_id] = (
        value
        if res.plain or var_id in res.raw
        else _pack(res, rec, var_id, Saved("in", i, u.shape, u.dtype), value, segment_input=True)
    )


def forward(
    tape: Tape,
    args: Sequence[Any],
    policy: Any = SAVE,
    observer: Any = None,
    consts: Sequence[Any] | None = None,
    *,
    loops: tuple = (),
    steps: tuple = (),
    forwarded: frozenset = frozenset(),
) -> tuple[list, Residuals]:
    """Run the tape forward; returns (flat outputs, residuals).

    ``observer.forward_record(record, ins, outs)``, if given, sees every record's
    values right after it runs (anomaly checks plug in here). ``consts``, if given,
    replaces the values of the tape's constants (same order). A loop body runs with
    ``loops`` (the enclosing loop records), ``steps`` (its step in each) and
    ``forwarded`` (residual keys the loop record keeps itself, stored unpacked).
    """
    env: dict[int, Any] = {v.id: x for v, x in zip(tape.inputs, args)}
    const_vals = [c for _, c in tape.consts] if consts is None else consts
    for (v, _), c in zip(tape.consts, const_vals):
        env[v.id] = c

    last_use = _last_uses(tape)
    res = Residuals(policy)
    plain = res.plain = is_plain(policy)
    res.raw, res.loops, res.steps = forwarded, loops, steps
    if not plain:
        # A loop body's inputs are per-step values (carries, slices), not the caller's arrays.
        ins_ids = frozenset(v.id for v in tape.inputs) if not loops else frozenset()
        res.input_ids = ins_ids | {v.id for v, _ in tape.consts}
        res.readers = tape.readers()
    store = res.store
    if tape.segments:
        _, recomputed = tape.residual_keys()
        boundary = _boundary_consumers(tape)
    else:
        recomputed, boundary = {}, {}
    for v in list(tape.inputs) + [c for c, _ in tape.consts]:
        if v.id in boundary:
            _keep_boundary(res, boundary, v.id, env[v.id])

    for rec in tape.records:
        ins = [env[i.id] if isinstance(i, Var) else i.value for i in rec.inputs]
        # A loop keeps its per-step residuals (unless it is recomputed in backward).
        loop = bool(rec.bodies) and rec.rule != "none" and rec.decision != "recompute"
        if loop:
            outs, body_res = kind_of(rec).forward(rec, ins, res, observer)
            derived: Any = None
            store[("body", rec.index)] = body_res
        else:
            outs, derived = _run(rec, ins)  # type: ignore[assignment]
        if observer is not None:
            observer.forward_record(rec, ins, outs)
        if rec.primitive == "device_put" and rec.rule != "none":
            res.sources[rec.index] = compat.device_put_sources(rec.params, ins)
        for o, val in zip(rec.outputs, outs):
            env[o.id] = val
            if o.id in boundary:
                _keep_boundary(res, boundary, o.id, val)
        if rec.saves:
            for s in rec.saves:
                key = rec.residual_key(s)
                if key in store or key in recomputed:
                    continue
                if s.kind == "in":
                    value = ins[s.index]
                elif s.kind == "out":
                    value = outs[s.index]
                else:
                    value = derived[s.index]
                if plain or key in forwarded:
                    store[key] = value
                else:
                    store[key] = _pack(res, rec, key, s, value)
        for i in rec.inputs:
            if isinstance(i, Var) and last_use.get(i.id) == rec.index:
                env.pop(i.id, None)
    outs = [env[o.id] if isinstance(o, Var) else o.value for o in tape.outputs]
    return outs, res


def _unbroadcast(ct, shape):
    """Sum a cotangent down to ``shape`` (scalar literals broadcast in jaxprs)."""
    if not shape:
        return ct.sum() if ct.ndim else ct
    lead = ct.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and ct.shape[lead + i] != 1
    )
    if axes:
        ct = ct.sum(axis=axes, keepdims=False)
    return ct.reshape(shape)


def _fit(ct, var, rec: Record, i: int):
    if ct.shape != var.shape:
        try:
            ok = np.broadcast_shapes(var.shape, ct.shape) == tuple(ct.shape)
        except ValueError:
            ok = False
        if not ok and compat.bwd_checks_disabled():
            return ct  # the user turned jax's check of custom bwd rules off: as jax, pass it on
        if not ok:
            raise ResidualError(
                f"internal: backward of {where(rec)} returned a cotangent of shape "
                f"{ct.shape} for input {i} of shape {var.shape}"
            )
        ct = _unbroadcast(ct, var.shape)
    if ct.dtype != var.dtype:
        ct = ct.astype(var.dtype)
    return ct


def run_segment(records: Sequence[Record], wanted: set[Any], vals: dict[Any, Any], res) -> dict:
    """Run a recompute segment's records forward from ``vals`` (its input values, by var
    id; consumed), freeing intermediates at their last use. Returns what backward wants
    of it: the outputs and derived residuals whose keys are in ``wanted``, and each
    loop's per-step residuals. The one runner for both eager paths: record by record,
    or traced into one compiled call (`run_compiled_segment`)."""
    out: dict[Any, Any] = {}
    last: dict[int, int] = {}
    for n, rec in enumerate(records):
        for u in rec.inputs:
            if isinstance(u, Var):
                last[u.id] = n
    for n, rec in enumerate(records):
        ins = [vals[u.id] if isinstance(u, Var) else u.value for u in rec.inputs]
        if rec.bodies and rec.rule != "none":
            outs, out[("body", rec.index)] = kind_of(rec).forward(rec, ins, res)
            derived: Any = None
        else:
            outs, derived = _run(rec, ins)  # type: ignore[assignment]
        for o, val in zip(rec.outputs, outs):
            if o.id in wanted:
                out[o.id] = val
            if o.id in last:
                vals[o.id] = val
        for s in rec.saves:
            if s.kind == "aux" and rec.residual_key(s) in wanted:
                out[rec.residual_key(s)] = derived[s.index]
        del ins, outs, derived
        for u in rec.inputs:  # free intermediates at their last use
            if isinstance(u, Var) and last.get(u.id) == n:
                vals.pop(u.id, None)
    return out


# How a compiled segment becomes one call: registered by the fused path
# (`tapegrad.engine.fused.segment_call`, which runs `run_segment` under ``jax.jit``).
_SEGMENT_CALL: list[Callable[[Tape, Segment], Any]] = []


def register_segment_call(fn: Callable[[Tape, Segment], Any]) -> None:
    _SEGMENT_CALL[:] = [fn]


def run_compiled_segment(tape: Tape, seg: Segment, vals: dict[Any, Any]) -> dict | None:
    """`run_segment` as one compiled call (cached by the segment's structure), for a
    ``compiled`` segment run eagerly; None when it cannot be keyed soundly."""
    fn = _SEGMENT_CALL[0](tape, seg) if _SEGMENT_CALL else None
    if fn is None:
        return None
    return fn([vals[v.id] for v in seg.inputs])


# Tests only (``tests/test_schedule.py``): a list that backward appends (tape, event,
# key) to for its unpacks, recomputations, rule runs and releases, to check them
# against `engine.backward_schedule`.
_TAP: list | None = None


def backward(
    tape: Tape,
    res: Residuals,
    out_cts: Sequence[Any],
    retain: bool = True,
    observer: Any = None,
    capture: dict[Any, Any] | None = None,
) -> list:
    """Cotangents of the tape's inputs (None where an input gets none).

    ``observer.backward_record(record, cts, in_cts)``, if given, sees each rule's
    output cotangents and the input cotangents it returned.

    Each residual is unpacked once per backward, at its first use, and its
    unpacked value is dropped after its last use. With ``retain=False`` the
    packed residuals are released as well, and a second backward raises.
    """
    if res.released:
        raise ResidualError(
            "Trying to run backward through the tape a second time, but its residuals "
            "were released after the first backward. Use tg.vjp(..., "
            "retain_residuals=True) (the default) to call vjp_fn more than once."
        )
    run = _Backward(tape, res, retain, observer, capture)
    for o, ct in zip(tape.outputs, out_cts):
        if ct is not None and isinstance(o, Var):
            run.accum(o, ct)
    for step in run.sched.steps:
        run.step(step)
    if not retain:
        res.released = True
    return [run.cts.get(v.id) for v in tape.inputs]


class _Backward:
    """One backward run over a tape: the schedule (`engine.backward_schedule`) executed
    step by step, with the cotangents, the residuals unpacked or recomputed so far and
    the uses each has left."""

    __slots__ = (
        "tape",
        "res",
        "store",
        "plain",
        "retain",
        "observer",
        "capture",
        "sched",
        "remaining",
        "unpacked",
        "recomputed",
        "seg_of",
        "trigger",
        "cts",
    )

    def __init__(self, tape: Tape, res: Residuals, retain: bool, observer: Any, capture: Any):
        self.tape, self.res, self.retain = tape, res, retain
        self.observer, self.capture = observer, capture
        self.store = res.store
        self.plain = plain = res.plain
        self.sched = sched = schedule(tape, 0 if plain else resolve_prefetch(res.policy, tape))
        self.remaining = dict(sched.uses)  # uses left in this backward, per residual
        self.unpacked: dict[Any, Any] = {}
        self.recomputed: dict[Any, Any] = {}
        self.seg_of = sched.recomputed
        self.trigger: list = []  # the cotangents of the record being processed
        self.cts: dict[int, Any] = {}

    def accum(self, var: Var | Lit, ct: Any) -> None:
        cts = self.cts
        prev = cts.get(var.id)  # type: ignore[union-attr]
        cts[var.id] = ct if prev is None else lax.add(prev, ct)  # type: ignore[union-attr]

    def release(self, key) -> None:
        left = self.remaining[key] - 1
        self.remaining[key] = left
        if left == 0:
            if _TAP is not None:
                _TAP.append((self.tape, "release", key))
            self.unpacked.pop(key, None)
            self.recomputed.pop(key, None)
            if not self.retain:
                self.store.pop(key, None)
                self.res.origins.pop(key, None)

    def unpack(self, rec, key, s):
        if _TAP is not None:
            _TAP.append((self.tape, "unpack", key))
        v = self.unpacked[key] = _unpack(self.res, rec, key, s, self.trigger)
        return v

    def get(self, rec, key, s):
        v = self.recomputed.get(key)
        if v is not None:
            return v
        if key not in self.store:
            sid = self.seg_of.get(key)
            if sid is None:
                raise ResidualError(f"residual {s} of {where(rec)} is missing")
            self.recompute(self.tape.segments[sid])
            return self.recomputed[key]
        if self.plain:
            return _unpack(self.res, rec, key, s)
        v = self.unpacked.get(key)
        return self.unpack(rec, key, s) if v is None else v

    def recompute(self, seg: Segment) -> None:
        """Re-run a segment forward from its saved inputs, keeping what backward needs."""
        tape = self.tape
        ev = self.sched.recomputes[seg.id]
        vals: dict[Any, Any] = {}
        for v, rec0 in zip(seg.inputs, ev.readers):
            vals[v.id] = self.get(rec0, v.id, Saved("in", 0, v.shape, v.dtype))
        if _TAP is not None:
            _TAP.append((tape, "recompute", seg.id))
        if seg.prevent_cse and any(isinstance(x, jax.core.Tracer) for x in vals.values()):
            # Under a trace, XLA's CSE would merge the recomputation with the forward
            # computation; the barrier (tied to this backward step's cotangents, so it
            # cannot be hoisted into forward) keeps it a real recomputation.
            ids = list(vals)
            vals = dict(zip(ids, tie_to(tuple(vals[i] for i in ids), self.trigger)))
        wanted = {k for k, _ in ev.held}
        out = None
        if seg.compiled and _is_concrete(vals.values()):
            out = run_compiled_segment(tape, seg, vals)
        if out is None:
            out = run_segment([tape.records[k] for k in seg.records], wanted, vals, self.res)
        self.recomputed.update(out)
        del out, vals
        for v in seg.inputs:
            self.release(v.id)

    def step(self, step: Any) -> None:
        """One record's backward: its rule (or loop) on its output cotangents, when any
        came, then the releases the schedule puts after it."""
        rec, keys = step.record, step.keys
        cts, capture, trigger = self.cts, self.capture, self.trigger
        gs = [cts.pop(o.id, None) for o in rec.outputs]
        if capture is not None:  # retained intermediate cotangents (tg.grad(intermediates=))
            for o, g in zip(rec.outputs, gs):
                if o.id in capture:
                    capture[o.id] = g
        trigger[:] = [g for g in gs if g is not None]
        # Start bringing the next records' residuals back now: jax dispatch is
        # asynchronous, so the copies overlap the compute of the records between
        # (the schedule's prefetch depth: `planner.cost.prefetch_depth` for offload's "auto").
        for ev in step.prefetch:
            if ev.key not in self.unpacked and ev.key in self.store:
                self.unpack(ev.record, ev.key, ev.saved)
        if trigger:
            self._run(rec, keys, gs)
        del gs
        trigger.clear()
        for key in keys:
            self.release(key)

    def _run(self, rec: Record, keys: Any, gs: list) -> None:
        x, y, aux = _saved_values(rec, rec.saves, keys, self.get)
        stored = None
        if rec.bodies:
            stored = self.store.get(("body", rec.index))
            if stored is None:  # a recomputed loop: re-run it (its segment) first
                stored = self.recomputed.pop(("body", rec.index), None)
                if stored is None:
                    seg = next(g for g in self.tape.segments if rec.index in g.records)
                    self.recompute(seg)
                    stored = self.recomputed.pop(("body", rec.index))
        # The cotangents as this step's barriers handed them back (`tie_to`).
        tied = iter(self.trigger)
        gs = [None if g is None else next(tied) for g in gs]
        if rec.bodies:
            in_cts = kind_of(rec).backward(rec, x, stored, gs, self.retain, self.observer)
        else:
            rule = lookup(rec.primitive) or FALLBACK
            in_cts = _apply_rule(rule, _placed(rec, self.res), x, y, aux, gs)
        if self.observer is not None:
            self.observer.backward_record(rec, gs, in_cts)
        if _TAP is not None:
            _TAP.append((self.tape, "run", rec.index))
        del x, y, aux, gs
        capture = self.capture
        if capture is not None:  # a retained cotangent after a tg.hook (retained_keys)
            for j, ct in enumerate(in_cts):
                if ("in", rec.index, j) in capture:
                    capture["in", rec.index, j] = ct
        for inp, ct in zip(rec.inputs, in_cts):
            if ct is not None:
                self.accum(inp, ct)
            del ct
        # Not held into the next record's step: its recomputation would find this
        # record's cotangents still alive (a summed one twice: its part and the sum).
        del in_cts
