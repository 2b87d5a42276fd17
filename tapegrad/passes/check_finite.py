"""Insert a NaN/Inf check after every record: the tape form of anomaly detection."""

from __future__ import annotations

import dataclasses

from tapegrad.anomaly import detect as _anomaly
from tapegrad.core.tape import Record, Tape, Var, frozen_params

__all__ = ["check_finite", "CheckFinite"]


class CheckFinite:
    """The "primitive" of a check record: it takes the checked values and outputs nothing.

    Eagerly it raises `tg.AnomalyError` at once; under a trace it stages a
    `jax.debug.callback` that raises when the compiled call runs.
    """

    name = "check_finite"
    multiple_results = True
    effectful = True  # dce keeps it although it has no outputs anyone uses

    def bind(self, *values, sites, producers, mode):
        codes = [_anomaly.code_of(x, mode) for x in values]
        _anomaly.emit(sites, codes, producers, mode)
        return []

    def __repr__(self) -> str:
        return "check_finite"


CHECK_FINITE = CheckFinite()


def check_finite(tape: Tape, *, check_nan: bool = True, check_inf: bool = True) -> Tape:
    """A check record after every record with floating outputs (and one for the inputs).

    ```python
    tg.grad(f, passes=[tg.passes.check_finite])(x)     # raises tg.AnomalyError on NaN/Inf
    tg.grad(f, passes=[functools.partial(tg.passes.check_finite, check_inf=False)])(x)
    ```
    Unlike ``anomaly=True`` (one host transfer per pass), each check is its own
    host check or callback: simple, visible on the printed tape, and slower.
    Backward is not checked here (it has no records); use ``anomaly=True`` for that.
    """
    mode = _anomaly.AnomalyMode(check_nan=check_nan, check_inf=check_inf)
    what = mode.what
    producers: dict[int, Record] = {}  # filled below, once the records have their final index
    out: list[Record] = []

    def add_check(values: list[Var], sites: list, of: str, source_info=None) -> None:
        out.append(
            Record(
                len(out),
                "check_finite",
                tuple(values),
                (),
                frozen_params({"for": what, "of": of}),
                prim=CHECK_FINITE,
                source_info=source_info,
                bind_params={"sites": tuple(sites), "producers": producers, "mode": mode},
            )
        )

    ins = [(k, v) for k, v in enumerate(tape.inputs) if _anomaly.checkable(v)]
    if ins:
        add_check(
            [v for _, v in ins],
            [_anomaly.Site("input", k, None, v, f"#{k}") for k, v in ins],
            "inputs",
        )
    new_index: dict[int, int] = {}
    for pos, rec in enumerate(tape.records):
        new_index[pos] = len(out)
        new = dataclasses.replace(rec, index=len(out)) if rec.index != len(out) else rec
        out.append(new)
        for o in new.outputs:
            producers[o.id] = new
        outs = [(k, o) for k, o in enumerate(new.outputs) if _anomaly.checkable(o)]
        if outs:
            add_check(
                [o for _, o in outs],
                [_anomaly.Site("forward", k, new, o) for k, o in outs],
                f"#{new.index} {new.primitive}",
                new.source_info,
            )
    segments = tuple(
        dataclasses.replace(s, records=tuple(new_index[k] for k in s.records))
        for s in tape.segments
    )
    return dataclasses.replace(tape, records=tuple(out), segments=segments)
