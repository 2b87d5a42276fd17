"""Dead-record elimination."""

from __future__ import annotations

import dataclasses

from tapegrad.core.tape import Record, Tape, Var
from tapegrad.passes.checks import effects_of

__all__ = ["dce"]


def dce(tape: Tape) -> Tape:
    """Drop the records whose outputs nothing uses, and the constants only they used.

    `jax.make_jaxpr` keeps every equation the function ran, so ``y = jnp.sin(x);
    return x * 2`` puts ``sin`` on the tape; forward would compute it and throw it
    away. Records with side effects (prints, callbacks, tapegrad's checks) and
    records without outputs are kept. Such dead records never take part in backward
    (their outputs reach no output), so the gradient is unchanged.
    """
    needed = {o.id for o in tape.outputs if isinstance(o, Var)}
    in_segment = {k for seg in tape.segments for k in seg.records}
    for seg in tape.segments:
        needed.update(v.id for v in seg.inputs)
        needed.update(v.id for v in seg.outputs)
    keep = [False] * len(tape.records)
    for pos in range(len(tape.records) - 1, -1, -1):
        rec = tape.records[pos]
        if (
            pos in in_segment
            or not rec.outputs
            or any(o.id in needed for o in rec.outputs)
            or effects_of(rec)
        ):
            keep[pos] = True
            needed.update(i.id for i in rec.inputs if isinstance(i, Var))
    new_index: dict[int, int] = {}
    records: list[Record] = []
    for pos, rec in enumerate(tape.records):
        if keep[pos]:
            new_index[pos] = len(records)
            records.append(
                rec if rec.index == len(records) else dataclasses.replace(rec, index=len(records))
            )
    consts = tuple((v, c) for v, c in tape.consts if v.id in needed)
    segments = tuple(
        dataclasses.replace(seg, records=tuple(new_index[k] for k in seg.records))
        for seg in tape.segments
    )
    return dataclasses.replace(tape, records=tuple(records), consts=consts, segments=segments)
