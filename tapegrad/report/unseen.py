"""What `tg.memory_report` cannot see, and its estimate of it: records whose backward runs
`jax.vjp` (a fallback rule, a custom_jvp call that could not be split, a checkpoint call)
make residuals inside that call and free them before it returns. The estimate is the
bytes of the residuals `jax.vjp` keeps for the record's primitive on the record's avals,
found abstractly (`jax.make_jaxpr`), less the record's own inputs (which it saves itself).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax import tree_util

from tapegrad.core import jax_compat as compat
from tapegrad.core.tape import Lit, Record, Tape, itemsize
from tapegrad.display.common import short_source
from tapegrad.rules.control import primitive_vjp

__all__ = ["UnseenBackward", "vjp_residual_bytes", "unseen_backwards", "unseen_notes"]


@dataclass(frozen=True, slots=True)
class UnseenBackward:
    """A record whose backward runs `jax.vjp` (a fallback rule, a custom_jvp call that
    could not be split, a checkpoint call): jax makes and frees residuals inside that
    call, out of the report's sight. ``bytes`` is an estimate of them, from jax's own
    residual shapes for the record's primitive (`vjp_residual_bytes`), for one run;
    ``steps`` is how many body runs a record inside a loop is differentiated for (one
    at a time)."""

    index: int
    primitive: str
    source: str
    rule: str
    bytes: int
    steps: int = 1
    where: str = ""  # "" at the top level, else " (in #3's body)" and the like


# Rules whose backward runs jax.vjp on the record's primitive: the residuals jax keeps
# inside that call are made and freed within the record's backward, out of our sight.
_OPAQUE_RULES = ("fallback", "custom_jvp", "checkpoint")


def _aval_bytes(aval: Any) -> int:
    shape = getattr(aval, "shape", ())
    return math.prod(shape) * itemsize(aval.dtype)


def vjp_residual_bytes(rec: Record) -> int:
    """Bytes of the residuals `jax.vjp` keeps for one run of ``rec``'s primitive, less
    the record's own inputs (it saves those itself, and the report counts them): what
    the backward of a record that runs `jax.vjp` (rule ``fallback``, ``custom_jvp``,
    ``checkpoint``) materializes on top of what the report sees. Found abstractly, from
    `jax.make_jaxpr` of the same `jax.vjp` call the rule makes, on the record's avals:
    the output variables of the residual pytree that are not input variables."""
    var_pos = [i for i, v in enumerate(rec.inputs) if not isinstance(v, Lit)]
    active = [i for i, a in enumerate(rec.active) if a and i in var_pos]

    def residuals(*vals):
        full: list[Any] = [v.value if isinstance(v, Lit) else None for v in rec.inputs]
        for i, x in zip(var_pos, vals):
            full[i] = x
        _, vjp_fn = primitive_vjp(rec, full, active)
        return tree_util.tree_leaves(vjp_fn)

    avals = [jax.ShapeDtypeStruct(rec.inputs[i].shape, rec.inputs[i].dtype) for i in var_pos]
    jaxpr = jax.make_jaxpr(residuals)(*avals).jaxpr
    inputs = set(jaxpr.invars) | set(jaxpr.constvars)
    seen: set[Any] = set()
    total = 0
    for v in jaxpr.outvars:
        if isinstance(v, compat.Literal):  # a constant jax keeps (a fresh array eagerly)
            total += _aval_bytes(v.aval)
        elif v not in inputs and v not in seen:
            seen.add(v)
            total += _aval_bytes(v.aval)
    return total


def unseen_backwards(tape: Tape) -> list[tuple[int, UnseenBackward]]:
    """Every record (bodies included) whose backward runs jax.vjp, with its estimate,
    each beside the index of the top-level record it runs in (itself, or its loop)."""
    out: list[tuple[int, UnseenBackward]] = []
    cache: dict[Any, int] = {}

    def estimate(rec: Record) -> int:
        try:
            key: Any = (
                rec.primitive,
                tuple((v.shape, str(v.dtype), isinstance(v, Lit)) for v in rec.inputs),
                rec.active,
                hash(tuple(sorted(rec.params.items()))),
            )
        except TypeError:  # unhashable params (sub-programs): no sharing
            key = ("record", id(rec))
        if key not in cache:
            try:
                cache[key] = vjp_residual_bytes(rec)
            except Exception:  # jax cannot say abstractly: -1 means unknown
                cache[key] = -1
        return cache[key]

    def visit(t: Tape, where: str, steps: int, top: int | None) -> None:
        for rec in t.records:
            at = rec.index if top is None else top
            if rec.rule in _OPAQUE_RULES:
                u = UnseenBackward(
                    rec.index, rec.primitive, rec.source, rec.rule, estimate(rec), steps, where
                )
                out.append((at, u))
            for b, body in enumerate(rec.bodies):
                part = f"branch {b}" if rec.primitive == "cond" else "body"
                visit(
                    body,
                    f" (in #{rec.index}'s {part}{where.replace(' (in', ',')})",
                    steps * rec.trip_count,
                    at,
                )

    visit(tape, "", 1, None)
    return out


def unseen_notes(unseen: Sequence[UnseenBackward]) -> tuple[str, ...]:
    """One note per (primitive, source line) whose backward the report cannot see into."""
    groups: dict[tuple[str, str], list[UnseenBackward]] = {}
    for u in unseen:
        src = short_source(u.source, 60)
        groups.setdefault((u.primitive, src), []).append(u)
    notes = []
    for (prim, src), us in groups.items():
        who = [f"#{u.index}{u.where}" for u in us]
        shown = ", ".join(who[:3]) + (f" and {len(who) - 3} more" if len(who) > 3 else "")
        sizes = sorted({u.bytes for u in us})
        if sizes[0] < 0:
            what = "an unknown amount of residuals (jax could not say abstractly)"
        else:
            top = f"{sizes[-1]:,}" if len(sizes) == 1 else f"{sizes[0]:,}–{sizes[-1]:,}"
            each = " each" if len(us) > 1 else ""
            what = (
                f"about {top} B of residuals{each}, from jax.vjp's residual shapes "
                "(counted in the peak while it runs)"
            )
        notes.append(f"backward of {prim} {shown} at {src} runs jax.vjp: it makes {what}")
    return tuple(notes)
