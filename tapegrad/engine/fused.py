"""Eager `grad` as one compiled call, when that cannot change what the user sees.

Eagerly, the interpreter dispatches every forward primitive and every backward
rule on its own; each dispatch costs tens of microseconds, which dominates
small and medium models. `run_grad` runs the forward and backward interpreters
of a tape under one `jax.jit` instead, cached by the tape's *structure*.

Why this is sound (no jit-like staleness): the user's function is still traced
on every call (`jax.make_jaxpr` runs, so a changed closure, global or Python
branch shows up as a different tape), and the cache key holds everything the
interpreters read from the tape: every record's primitive, parameters,
operands, shapes, dtypes, saves, active inputs and rule. Values are never part
of the key: constants (closed-over arrays) and literals (``x * lr`` with a Python
float ``lr``, in the tape or in a loop's body) are arguments of the compiled call,
not baked into it, so a learning-rate schedule reuses one program. A loop or
branch record is keyed by its body tapes, which the interpreters run; any other
sub-jaxpr (a scatter's combiner) is keyed by its structure, literal values
included, and must have no constants. Two tapes with equal keys therefore run
the same computation on the arguments given. A tape whose parameters are not plain
values (callbacks, the user functions of a custom_jvp/custom_vjp or tg.hook,
effects) has no key and runs the per-record path, so user Python code in
backward keeps seeing concrete arrays once per call. (A field added to
`Record` that the interpreters read must be added to `grad_key`.)

It is used only when nothing needs to observe individual records: the plain
`save()` policy (or a wrapper of it) with nothing recomputed, no anomaly
observer, concrete (non-traced) arguments. A structure is compiled at its
third sighting, so one-off calls pay no compilation.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

from tapegrad.core.caches import BoundedCache
from tapegrad.core.keys import NoKey, value_key
from tapegrad.core.residual_policy import SAVE
from tapegrad.core.tape import Lit, Record, Tape, Var
from tapegrad.engine import interpret as _interpret
from tapegrad.engine.interpret import backward, forward, run_segment
from tapegrad.rules import FALLBACK, lookup

__all__ = ["can_fuse", "grad_key", "run_grad", "segment_call"]


def _operand_key(i: Any) -> Any:
    if type(i) is Var:
        return i.id
    if not isinstance(i.dtype, np.dtype):
        raise NoKey  # a literal of an extended dtype
    return ("lit", i.shape, i.dtype)  # its value is an argument, not part of the key


def _runs_bodies(rec: Record) -> bool:
    """The interpreters run this record's body tapes (never its params' jaxprs)."""
    return bool(rec.bodies) and rec.rule != "none"


def _is_program(v: Any) -> bool:
    return isinstance(v, (Jaxpr, ClosedJaxpr)) or (
        isinstance(v, tuple) and bool(v) and all(isinstance(b, (Jaxpr, ClosedJaxpr)) for b in v)
    )


# Records are immutable: a record's key is computed once (a cached tape hands the same
# records to every call of its program; only records whose literals changed are new).
# A loop record's key is not kept: its bodies' rules are looked up anew.
_RECORD_KEYS: weakref.WeakKeyDictionary[Record, tuple] = weakref.WeakKeyDictionary()


def _record_key(rec: Record) -> tuple:
    rule = lookup(rec.primitive) if rec.rule != "none" else None
    hit = _RECORD_KEYS.get(rec)
    if hit is not None and hit[0] is rule:  # a redefined rule is a new key
        if hit[1] is None:
            raise NoKey
        return hit[1]
    try:
        key = _compute_record_key(rec, rule)
    except NoKey:
        _RECORD_KEYS[rec] = (rule, None)
        raise
    if not _runs_bodies(rec):
        _RECORD_KEYS[rec] = (rule, key)
    return key


def _compute_record_key(rec: Record, rule: Any) -> tuple:
    prim = rec.prim
    if prim is None or getattr(prim, "effectful", False):
        raise NoKey
    if rec.rule == "none" and rec.primitive == "custom_jvp_rule":
        raise NoKey  # not in backward: it binds the user's custom_jvp call as written
    bodies = _runs_bodies(rec)
    return (
        prim,
        rec.primitive,
        tuple(
            (k, "<body>" if bodies and _is_program(v) else value_key(v))
            for k, v in rec.params.items()
        ),
        tuple(_operand_key(i) for i in rec.inputs),
        tuple(_var_key(o) for o in rec.outputs),
        tuple((s.kind, s.index, s.shape, s.dtype) for s in rec.saves),
        rec.active,
        rec.rule,
        rec.decision,
        rec.names,
        rec.schedule,
        rec.inner_schedule,
        rec.snapshots,
        rule if rule is not None else (FALLBACK if rec.rule == "fallback" else None),
        tuple(_tape_key(b) for b in rec.bodies) if bodies else (),
    )


def _tape_key(tape: Tape) -> tuple:
    if tape.consts and any(c is not None for _, c in tape.consts):
        raise NoKey  # a body's constants would be baked in
    return (
        tuple(_var_key(v) for v in tape.inputs),
        tuple(_record_key(r) for r in tape.records),
        tuple(_operand_key(o) for o in tape.outputs),
        tape.active_inputs,
    )


def _lits_of(tape: Tape, out: list) -> list:
    """Every literal the interpreters read running ``tape``, in a fixed order."""
    for rec in tape.records:
        out.extend(i for i in rec.inputs if type(i) is Lit)
        if _runs_bodies(rec):
            for b in rec.bodies:
                _lits_of(b, out)
    out.extend(o for o in tape.outputs if type(o) is Lit)
    return out


def _with_lits(tape: Tape, vals: Iterator[Any]) -> Tape:
    """``tape`` with its literals' values taken from ``vals`` (in `_lits_of`'s order)."""

    def sub(i):
        return Lit(next(vals), i.shape, i.dtype) if type(i) is Lit else i

    recs = []
    for rec in tape.records:
        ins = tuple(sub(i) for i in rec.inputs)
        bodies = tuple(_with_lits(b, vals) for b in rec.bodies) if _runs_bodies(rec) else rec.bodies
        recs.append(dataclasses.replace(rec, inputs=ins, bodies=bodies))
    return dataclasses.replace(
        tape, records=tuple(recs), outputs=tuple(sub(o) for o in tape.outputs)
    )


def _var_key(v: Var) -> tuple:
    mesh = getattr(getattr(v, "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty:
        raise NoKey  # rules read a value's mesh sharding; eager arrays have none
    # PRNG keys (extended dtypes, e.g. a dropout's) by name: jax.jit takes them as
    # arguments like any array
    return (v.id, v.shape, v.dtype if isinstance(v.dtype, np.dtype) else str(v.dtype))


def _has_segments(tape: Tape) -> bool:
    # A body's plan (which records recompute) is not in its record's params.
    return bool(tape.segments) or any(_has_segments(b) for r in tape.records for b in r.bodies)


def grad_key(tape: Tape, extra: tuple = ()) -> tuple | None:
    """A hashable key equal for two tapes exactly when the interpreters would run the
    same computation on them; None when the tape cannot be keyed soundly."""
    if _has_segments(tape):
        return None
    try:
        return (
            tuple(_var_key(v) for v in tape.inputs),
            tuple(_var_key(v) for v, _ in tape.consts),
            tuple(_record_key(r) for r in tape.records),
            tuple(_operand_key(o) for o in tape.outputs),
            tape.active_inputs,
            extra,
        )
    except (NoKey, TypeError, ValueError):
        return None


# Bounded, least recently used out first: a training loop repeats one or two
# structures, while a test suite or a sweep sees many once (counted, never compiled).
# Neither holds arrays: a compiled entry keeps the tape's structure only.
_SEEN = BoundedCache("fused.seen", max_entries=256)


_COMPILED = BoundedCache("fused.compiled", max_entries=32)


_COMPILE_AT = 3  # sightings of a structure before it is compiled


def _is_concrete(vals: Sequence[Any]) -> bool:
    for v in vals:
        if isinstance(v, jax.core.Tracer):
            return False
    return True


def _compiled_for(key: tuple, tape: Tape, ct_dtype: Any, capture_ids: tuple) -> Any:
    fn = _COMPILED.get(key)
    if fn is not None:
        return fn
    n = _SEEN.pop(key, 0) + 1
    if n < _COMPILE_AT:
        _SEEN[key] = n
        return None
    # Keep the structure only: the first call's constants are not held alive.
    bare = dataclasses.replace(
        tape, consts=tuple((v, None) for v, _ in tape.consts), in_tree=None, out_tree=None
    )
    fn = _COMPILED[key] = jax.jit(_grad_body(bare, ct_dtype, capture_ids))
    return fn


def _grad_body(tape: Tape, ct_dtype: Any, capture_ids: tuple):
    passthrough = {v.id for v in tape.inputs} | {v.id for v, _ in tape.consts}

    def body(args, consts, lits):
        t = _with_lits(tape, iter(lits))
        outs, res = forward(t, args, SAVE, consts=consts)
        n = len(t.outputs)
        capture = dict.fromkeys(capture_ids) if capture_ids else None
        ct = jax.numpy.ones((), ct_dtype)
        in_cts = backward(t, res, [ct] + [None] * (n - 1), retain=False, capture=capture)
        # Literal outputs and outputs that are inputs/constants are filled in by the caller,
        # as the per-record path returns them: the very objects, not jit-made copies.
        computed = [
            v if type(o) is Var and o.id not in passthrough else None
            for o, v in zip(t.outputs, outs)
        ]
        captured = [capture[i] for i in capture_ids] if capture_ids else []
        return computed, in_cts, captured

    return body


def can_fuse(tape: Tape, args: Sequence[Any]) -> bool:
    """Whether `run_grad` may run ``tape`` on ``args`` as one compiled call: not under a
    trace (jit, vmap or an outer grad trace the per-record path instead)."""
    return _is_concrete(args) and _is_concrete([c for _, c in tape.consts])


def run_grad(
    tape: Tape, args: Sequence[Any], ct_dtype: Any, capture_ids: tuple = ()
) -> tuple[list, list, list] | None:
    """``(flat outputs, input cotangents, captured cotangents)`` of the tape's first output,
    from one compiled call; None when the per-record path must run instead."""
    if not can_fuse(tape, args):
        return None
    consts = [c for _, c in tape.consts]
    key = grad_key(tape, (np.dtype(ct_dtype), capture_ids))
    if key is None:
        return None
    fn = _compiled_for(key, tape, ct_dtype, capture_ids)
    if fn is None:
        return None
    lits = [np.asarray(i.value, i.dtype) for i in _lits_of(tape, [])]
    computed, in_cts, captured = fn(list(args), consts, lits)
    env = {v.id: x for v, x in zip(tape.inputs, args)}
    env.update((v.id, c) for v, c in tape.consts)
    outs = []
    for o, v in zip(tape.outputs, computed):
        if not isinstance(o, Var):
            outs.append(o.value)
        elif o.id in env:
            outs.append(env[o.id])
        else:
            outs.append(v)
    return outs, list(in_cts), list(captured)


# A compiled recompute segment (`Segment.compiled`: a random draw rebuilt from its key).
# Eagerly, backward would run it op by op and hold the draw's bits and floats while it
# rebuilds the mask; one compiled call holds its inputs and outputs only (XLA fuses the
# draw into the mask). Keyed by structure like `run_grad`'s calls (records, operands,
# shapes, dtypes; literals are arguments), so a training loop compiles each segment
# once. Compiled at its first sighting: what it saves in memory must hold on every call.
_SEGMENTS = BoundedCache("fused.segments", max_entries=256)


def _input_key(v: Var) -> tuple:
    # A segment's inputs include keys (extended dtypes), which jax.jit takes as arguments.
    mesh = getattr(getattr(v, "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty:
        raise NoKey
    return (v.shape, str(v.dtype))


def _local_record_key(rec: Record, num: Callable[[int], int]) -> tuple:
    """`_record_key` with the record's operand and output ids renumbered by ``num``."""
    k = _record_key(rec)
    ops = tuple(num(i.id) if type(i) is Var else o for i, o in zip(rec.inputs, k[3]))
    outs = tuple((num(o[0]),) + o[1:] for o in k[4])
    return k[:3] + (ops, outs) + k[5:]


def segment_call(tape: Tape, seg: Any) -> Any:
    """``fn(input values) -> {output id: value}``: `_interpret.run_segment` of ``seg`` as
    one compiled call, or None when the segment cannot be keyed soundly."""
    records = tuple(tape.records[k] for k in seg.records)
    if any(_runs_bodies(r) or any(s.kind == "aux" for s in r.saves) for r in records):
        return None  # wanted beyond its outputs: the per-record path provides it
    sub = Tape(seg.inputs, records, seg.outputs)
    # Values renumbered in order of appearance: the same layer's rebuild at another
    # depth of the network (other value ids, same computation) shares one executable.
    local: dict[int, int] = {}

    def num(i: int) -> int:
        return local.setdefault(i, len(local))

    try:
        key = (
            tuple((num(v.id),) + _input_key(v) for v in seg.inputs),
            tuple(_local_record_key(r, num) for r in records),
            tuple(num(o.id) for o in seg.outputs),
        )
        hash(key)
    except (NoKey, TypeError, ValueError):
        return None
    fn = _SEGMENTS.get(key)
    if fn is None:
        fn = _SEGMENTS.put(key, jax.jit(_segment_body(sub, seg.outputs)))
    lits = [np.asarray(i.value, i.dtype) for i in _lits_of(sub, [])]
    # The executable may have been traced on another segment of this structure: its
    # outputs come back in order, named by this segment's ids.
    return lambda vals: dict(zip((o.id for o in seg.outputs), fn(vals, lits)))


def _segment_body(sub: Tape, outputs: Sequence[Var]):
    ids = [o.id for o in outputs]
    wanted = set(ids)

    def body(vals, lits):
        t = _with_lits(sub, iter(lits))
        out = run_segment(t.records, wanted, {v.id: x for v, x in zip(t.inputs, vals)}, None)
        return [out[i] for i in ids]

    return body


_interpret.register_segment_call(segment_call)
