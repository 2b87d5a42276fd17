"""Where a tape's values live on an Auto mesh: the sharding each value gets when the tape
runs eagerly, so that the planner sizes a value per device as `tg.memory_report`
measures it (`tapegrad.core.sizes`).

On Explicit mesh axes a value's type carries its sharding; on Auto axes it does not
(``P(None, ...)``): XLA chooses. Eagerly the choice is made op by op: each record's
primitive is compiled for its operands' shardings and XLA's propagation picks the
output's. So this module asks XLA the same question, without data: each record is
lowered and compiled for ``ShapeDtypeStruct``\\ s with its operands' shardings (cached
per primitive, parameters and shardings, so a stack of equal layers compiles each op
once), and its outputs' shardings are read off the executable. Propagation rules of
our own (keep the operand's sharding through an elementwise op or a reshape...) would
be wrong: XLA shards ``x[data, None] + y[data, model]`` as ``[data, model]`` and a
reshape merging two sharded dimensions keeps only one of them.

Where nothing is known, a value has no placement and counts whole (an upper bound):
under ``jax.jit`` the arguments are tracers whose Auto-axis types say nothing (and jit
reuses one trace for arguments sharded differently, so no plan may depend on how they
are), except downstream of a ``with_sharding_constraint`` naming a concrete sharding;
a loop or branch record's outputs, and a derived (``aux``) residual, count whole too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from tapegrad.core import jax_compat as compat
from tapegrad.core.caches import BoundedCache
from tapegrad.core.keys import NoKey, value_key
from tapegrad.core.tape import Lit, Record, Saved, Tape, Var

__all__ = ["constrained", "place"]

# The value is whole on every device it is on (replicated, on one device, a numpy
# array or a constant): its placement stays None, and it counts whole, exactly.
_WHOLE = "whole"

_OUT_SHARDINGS = BoundedCache("placement.out_shardings", max_entries=4096)


def constrained(tape: Tape) -> bool:
    """Whether a record of ``tape`` names a concrete sharding (`place`'s ``constrained``:
    a fact of the records alone, which a tape cache keeps with its tape)."""
    return any(_constraint(r) is not None for r in tape.records)


def place(tape: Tape, flat_args: Sequence[Any], constrained_: bool | None = None) -> Tape:
    """``tape`` with each value's `Var.placement` where XLA shards it when the tape runs
    eagerly on ``flat_args`` (the tape itself when no value is known to be sharded).
    ``constrained_``: `constrained(tape)`, when the caller has it already."""
    known: dict[int, Any] = {}
    for v, x in zip(tape.inputs, flat_args):
        known[v.id] = _arg_sharding(v, x)
    for v, c in tape.consts:
        known[v.id] = _arg_sharding(v, c)
    if not any(_sharded(s) for s in known.values()) and not (
        constrained(tape) if constrained_ is None else constrained_
    ):
        return tape
    for rec in tape.records:
        outs = _outputs(rec, [known.get(i.id) if type(i) is Var else _WHOLE for i in rec.inputs])
        for o, s in zip(rec.outputs, outs):
            known[o.id] = s
    placed = {k: s for k, s in known.items() if _sharded(s)}
    return _with_placements(tape, placed) if placed else tape


def _sharded(s: Any) -> bool:
    return s is not None and s is not _WHOLE


def _arg_sharding(v: Var, x: Any) -> Any:
    """A tape input's or constant's sharding from its value: a concrete array's (None
    under a trace: unknown), or `_WHOLE`. Explicit-axis types need no placement."""
    if compat.explicit_sharding(v) is not None or isinstance(x, jax.core.Tracer):
        return None
    s = getattr(x, "sharding", None)
    if not isinstance(x, jax.Array) or s is None or len(s.device_set) <= 1:
        return _WHOLE
    if s.is_fully_replicated:
        return _WHOLE
    return s if isinstance(getattr(s, "mesh", None), jax.sharding.Mesh) else None


def _constraint(rec: Record) -> Any:
    """The concrete sharding a sharding_constraint record names, else None."""
    if rec.primitive != "sharding_constraint":
        return None
    s = rec.params.get("sharding")
    if isinstance(s, jax.sharding.NamedSharding) and isinstance(s.mesh, jax.sharding.Mesh):
        return _WHOLE if s.is_fully_replicated else s
    return None


def _outputs(rec: Record, ins: list) -> list:
    """Per output of ``rec``: its sharding, `_WHOLE`, or None (unknown)."""
    n = len(rec.outputs)
    named = _constraint(rec)
    if named is not None:
        return [named] * n
    if rec.bodies or rec.prim is None or any(s is None for s in ins):
        return [None] * n
    if not any(_sharded(s) for s in ins):
        return [_WHOLE] * n  # XLA keeps an op on whole operands whole
    mesh = next(s.mesh for s in ins if _sharded(s) and hasattr(s, "mesh"))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shardings = [whole if s is _WHOLE else s for s, i in zip(ins, rec.inputs) if type(i) is Var]
    key = _key(rec, shardings)
    got = _OUT_SHARDINGS.get(key) if key is not None else None
    if got is None:
        got = _compiled_out_shardings(rec, shardings, n)
        if key is not None:
            _OUT_SHARDINGS.put(key, got)
    return list(got)


def _key(rec: Record, shardings: list) -> Any:
    try:
        key = (
            rec.primitive,
            tuple((k, value_key(v)) for k, v in sorted(rec.params.items())),
            tuple(
                (i.shape, str(i.dtype), np.asarray(i.value).tobytes())
                if type(i) is Lit
                else (i.shape, str(i.dtype))
                for i in rec.inputs
            ),
            tuple(shardings),
        )
        hash(key)
    except (NoKey, TypeError, ValueError):
        return None
    return key


def _compiled_out_shardings(rec: Record, shardings: list, n: int) -> tuple:
    """The output shardings XLA gives ``rec``'s primitive on operands so sharded, as
    eager dispatch compiles it (`_WHOLE` where replicated; None where it cannot say)."""

    def run(*xs):
        it = iter(xs)
        args = [i.value if type(i) is Lit else next(it) for i in rec.inputs]
        return rec.prim.bind(*args, **rec.bind_params)

    structs = [
        jax.ShapeDtypeStruct(i.shape, i.dtype, sharding=s)
        for i, s in zip((i for i in rec.inputs if type(i) is Var), shardings)
    ]
    try:
        outs = jax.jit(run).lower(*structs).compile().output_shardings
    except Exception:  # noqa: BLE001 -- whatever XLA cannot compile alone counts whole
        return (None,) * n
    leaves = outs if isinstance(outs, (list, tuple)) else [outs]
    if len(leaves) != n:
        return (None,) * n
    return tuple(_WHOLE if s.is_fully_replicated else s for s in leaves)


def _with_placements(tape: Tape, placed: dict[int, Any]) -> Tape:
    """``tape`` with these values' placements (their Vars and the Saved reading them)."""
    new: dict[int, Var] = {}

    def var(v):
        if type(v) is not Var or v.id not in placed:
            return v
        got = new.get(v.id)
        if got is None:
            got = new[v.id] = dataclasses.replace(v, placement=placed[v.id])
        return got

    def saved(rec: Record, s: Saved) -> Saved:
        src = {"in": rec.inputs, "out": rec.outputs}.get(s.kind)
        v = src[s.index] if src is not None and s.index < len(src) else None
        if type(v) is not Var or v.id not in placed or tuple(v.shape) != tuple(s.shape):
            return s
        return dataclasses.replace(s, placement=placed[v.id])

    records = tuple(
        dataclasses.replace(
            r,
            inputs=tuple(var(i) for i in r.inputs),
            outputs=tuple(var(o) for o in r.outputs),
            saves=tuple(saved(r, s) for s in r.saves),
        )
        for r in tape.records
    )
    segments = tuple(
        dataclasses.replace(
            g, inputs=tuple(var(v) for v in g.inputs), outputs=tuple(var(v) for v in g.outputs)
        )
        for g in tape.segments
    )
    return dataclasses.replace(
        tape,
        inputs=tuple(var(v) for v in tape.inputs),
        records=records,
        outputs=tuple(var(v) for v in tape.outputs),
        consts=tuple((var(v), c) for v, c in tape.consts),
        segments=segments,
    )
