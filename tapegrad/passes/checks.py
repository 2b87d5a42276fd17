"""Checking passes: they return the tape unchanged or raise an error naming the record.

`check_rules` runs on every traced tape and `check_effects` on every planned
tape (both cost a loop over the records); `validate` runs after every pass.
"""

from __future__ import annotations

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Primitive

from tapegrad.core.caches import BoundedCache
from tapegrad.core.tape import Tape, Var
from tapegrad.errors import EffectError, InvalidTapeError, MissingRuleError, where

__all__ = ["validate", "check_rules", "check_effects", "effects_of"]


def _jax_has_jvp(prim) -> bool:
    from jax.interpreters import ad  # the public alias of jax's JVP rule table

    table = getattr(ad, "primitive_jvps", None)
    return table is None or prim in table


def check_rules(tape: Tape) -> Tape:
    """Raise `MissingRuleError` for a differentiated record whose primitive has no
    reverse-mode rule: no tapegrad rule, and no jax JVP rule for the fallback to use.

    Without this check the fallback's ``jax.vjp`` would fail in backward, after the
    whole forward ran, with jax's "Differentiation rule for 'p' not implemented",
    which does not say where the primitive is.
    """
    for rec in tape.records:
        # Only plain primitives: jax dispatches call-like primitives (subclasses) elsewhere.
        if rec.rule == "fallback" and type(rec.prim) is Primitive and not _jax_has_jvp(rec.prim):
            raise MissingRuleError(
                f"{where(rec)} has no reverse-mode rule: tapegrad has no rule for "
                f"'{rec.primitive}' and jax has no JVP rule to fall back on. Give it one: "
                f"tg.rules.defvjp('{rec.primitive}', ('x0', lambda g, r, p: ...)) for tapegrad, "
                "jax.interpreters.ad.defjvp for jax, or wrap the computation in jax.custom_vjp. "
                "If the value needs no gradient, wrap it in jax.lax.stop_gradient."
            )
    return tape


# Effects jax allows inside recomputed (checkpointed) code: printing twice is harmless.
_HARMLESS = ("DebugEffect",)
_EFFECTS_CACHE = BoundedCache("checks.effects", max_entries=1024)  # primitive -> effects


def _has_subprograms(params) -> bool:
    return any(
        isinstance(v, (Jaxpr, ClosedJaxpr))
        or (isinstance(v, tuple) and v and isinstance(v[0], (Jaxpr, ClosedJaxpr)))
        for v in params.values()
    )


def effects_of(rec) -> tuple:
    """The side effects of one record (empty for pure primitives).

    Asks the primitive's abstract evaluation, which reports effects; cached per
    primitive when its parameters carry no sub-program.
    """
    prim = rec.prim
    if getattr(prim, "effectful", False):  # tapegrad's own check records
        return ("check",)
    if prim is None:
        return ()
    cacheable = not _has_subprograms(rec.params)
    found = _EFFECTS_CACHE.get(prim) if cacheable else None
    if found is not None:
        return found
    try:
        avals = [jax.core.ShapedArray(i.shape, i.dtype) for i in rec.inputs]
        out = prim.abstract_eval(*avals, **dict(rec.params))
        effs = tuple(out[1]) if isinstance(out, tuple) and len(out) == 2 else ()
    except Exception:
        effs = ("unknown",) if "callback" in rec.primitive else ()
    if cacheable:
        _EFFECTS_CACHE.put(prim, effs)
    return effs


def _harmful(effs) -> list[str]:
    names = [e if isinstance(e, str) else type(e).__name__ for e in effs]
    return [n for n in names if n not in _HARMLESS and n != "check"]


def check_effects(tape: Tape) -> Tape:
    """Raise `EffectError` if backward would re-run a side-effecting record.

    A recomputed ``io_callback`` (random numbers from the host, a counter, a file read)
    can return something else the second time, and backward would then differentiate a
    program that never ran: a wrong gradient, silently. jax's ``checkpoint`` refuses
    effects for the same reason. Debug prints/callbacks are allowed (running twice is
    harmless).
    """
    for seg in tape.segments:
        for k in seg.records:
            rec = tape.records[k]
            bad = _harmful(effects_of(rec))
            if bad:
                raise EffectError(
                    f"{where(rec)} has a side effect ({', '.join(bad)}) and would run again in "
                    "backward, when its recomputed segment is replayed; its second result may "
                    "differ from the first and the gradient would be wrong. Move it out of the "
                    "checkpointed function (tg.checkpoint / jax.checkpoint), or make the policy "
                    "save it, e.g. tg.selective(lambda r: tg.CheckpointPolicy.ALWAYS if "
                    f"r.primitive == '{rec.primitive}' else ...)."
                )
    return tape


def validate(tape: Tape, after: str | None = None) -> Tape:
    """Raise `InvalidTapeError` unless the tape is well formed: records numbered in order,
    every value defined once and before its use, outputs and segments pointing at real
    values and records. Returns the tape unchanged."""
    by = f" (after the pass {after})" if after else ""

    def fail(msg: str):
        raise InvalidTapeError(
            f"invalid tape{by}: {msg}. A pass must keep the tape in "
            "program order and renumber records (Record.index) it moves."
        )

    defined = {v.id for v in tape.inputs} | {v.id for v, _ in tape.consts}
    for pos, rec in enumerate(tape.records):
        if rec.index != pos:
            fail(f"record '{rec.primitive}' at position {pos} has index {rec.index}")
        for i in rec.inputs:
            if isinstance(i, Var) and i.id not in defined:
                fail(f"{where(rec)} uses {i} before it is defined")
        for o in rec.outputs:
            if o.id in defined:
                fail(f"{where(rec)} defines {o}, which is already defined")
            defined.add(o.id)
    for out in tape.outputs:
        if isinstance(out, Var) and out.id not in defined:
            fail(f"the tape's output {out} is not defined by any record or input")
    n = len(tape.records)
    for seg in tape.segments:
        if any(not 0 <= k < n for k in seg.records):
            fail(f"segment {seg.id} refers to records {seg.records} of a tape of {n}")
    return tape
