"""Anomaly mode's error messages: the record that produced the first NaN/Inf, its source
line, the records that fed it and the loop step it ran in (`message`), and `_Report`, the
host side of one pass's checks, which finds the first failed check and raises
`tg.AnomalyError` with that message."""

from __future__ import annotations

import os
import pdb
import sys
from collections.abc import Sequence

import jax

from tapegrad.anomaly.log import current_log, event, origins, summarize_all
from tapegrad.anomaly.probes import NAN, AnomalyMode, Site, first_bad, locate
from tapegrad.core.jax_compat import PACKAGE_DIR
from tapegrad.core.tape import Record, Tape, Var, custom_vjp_name, function_name
from tapegrad.errors import AnomalyError

__all__ = [
    "describe_record",
    "feeding_chain",
    "message",
    "post_mortem",
    "producers_of",
    "record_label",
]


def producers_of(tape: Tape) -> dict[int, Record]:
    return {o.id: r for r in tape.records for o in r.outputs}


def record_label(rec: Record) -> str:
    """How a message names a record: ``Function 'MyFunc'`` for a `tg.Function` (PyTorch
    names the Function), else its primitive, ``'log'``."""
    fn = function_name(rec.params) if rec.primitive == "custom_vjp_call" else None
    return f"'{rec.primitive}'" if fn is None else f"Function '{fn}'"


def describe_record(r: Record) -> str:
    outs = " ".join(f"{o}:{o.aval}" for o in r.outputs)
    ins = " ".join(str(i) for i in r.inputs)
    params = r.params_str()
    if len(params) > 48:  # too long to read; a custom_vjp keeps its function's name
        params = f"[name={custom_vjp_name(r.params)}]" if r.primitive == "custom_vjp_call" else ""
    return f"#{r.index} {outs} = {r.primitive}{params} {ins}".rstrip()


def feeding_chain(
    rec: Record, producers: dict[int, Record], depth: int = 3, limit: int = 6
) -> list[str]:
    """The records that produced ``rec``'s inputs, breadth first, a few steps back."""
    lines: list[str] = []
    seen, frontier = {rec.index}, [rec]
    for _ in range(depth):
        nxt = []
        for r in frontier:
            for i in r.inputs:
                p = producers.get(i.id) if isinstance(i, Var) else None
                if p is not None and p.index not in seen:
                    seen.add(p.index)
                    nxt.append(p)
        for p in sorted(nxt, key=lambda r: -r.index):
            if len(lines) == limit:
                lines.append("    ...")
                return lines
            lines.append(f"    {describe_record(p).ljust(40)}  at {p.source}")
        frontier = nxt
    return lines


def _what(code: int) -> str:
    return "NaN" if code == NAN else "Inf"


def _loop_lines(path: Sequence[tuple[Site, int]]) -> list[str]:
    lines = []
    for loop, t in path:
        rec = loop.record
        assert rec is not None
        if rec.primitive == "cond":
            lines.append(f"Inside branch {t} of 'cond' (record #{rec.index}) at {rec.source}.")
        else:
            lines.append(
                f"Inside step {t} (from 0) of {rec.trip_count} of '{rec.primitive}' "
                f"(record #{rec.index}) at {rec.source}; the record numbers above are the "
                "loop body's."
            )
    return lines


def message(
    site: Site,
    code: int,
    producers: dict[int, Record],
    mode: AnomalyMode,
    traced: bool,
    path: Sequence[tuple[Site, int]] = (),
) -> str:
    if path:
        producers = path[-1][0].producers
        text = message(site, code, producers, mode, traced)
        first, _, rest = text.partition("\n")
        return "\n".join([first, *_loop_lines(path), rest])
    bad = _what(code)
    var = f"{site.var}:{site.var.aval}" if isinstance(site.var, Var) else str(site.var)
    lines: list[str]
    if site.kind == "input":
        lines = [
            f"{bad} in the function's input {site.label} ({var}), before any record ran.",
            "What to do: check the values passed to the transform.",
        ]
    elif site.kind == "cotangent":
        lines = [
            f"{bad} in the cotangent passed to vjp_fn for output {site.label} ({var}).",
            "What to do: check the cotangent (it is not produced by tapegrad).",
        ]
    elif site.kind == "forward":
        rec = site.record
        assert rec is not None  # forward and backward sites always carry their record
        fn = function_name(rec.params) if rec.primitive == "custom_vjp_call" else None
        lines = [
            f"{bad} in the output of {record_label(rec)} (record #{rec.index}) at "
            f"{rec.source}: its output {site.index} ({var}).",
            f"It is the first record whose output has {bad}: the function's inputs and "
            "every earlier record's outputs passed the same check.",
            f"Forward record: {describe_record(rec)}",
        ]
        chain = feeding_chain(rec, producers)
        if chain:
            lines += ["The records that fed it:", *chain]
        where_ = f"{fn}.forward, called" if fn is not None else f"'{rec.primitive}'"
        lines.append(
            f"What to do: look at the inputs of {where_} at {rec.source}; the usual "
            "causes are log/sqrt/pow of a negative or zero value, 0/0, inf - inf, or an "
            "overflow. If a jnp.where discards these values on purpose, check backward only: "
            "tg.detect_anomaly(forward=False)."
        )
    else:
        rec = site.record
        assert rec is not None  # forward and backward sites always carry their record
        fn = function_name(rec.params) if rec.primitive == "custom_vjp_call" else None
        lines = [
            f"backward of {record_label(rec)} (record #{rec.index}) returned {bad} values in "
            f"its {site.index}th output: the cotangent of its input {site.index} ({var}).",
            f"Forward record: {describe_record(rec)}   at {rec.source}",
            "It is the first VJP rule in this backward pass to return "
            f"{bad}; the cotangents it received passed the same check.",
        ]
        chain = feeding_chain(rec, producers)
        if chain:
            lines += ["The forward records that fed it:", *chain]
        if fn is not None:
            lines.append(
                f"What to do: {fn}.backward returned it for the Function called at "
                f"{rec.source}, from finite cotangents: check what {fn}.backward computes for "
                f"input {site.index} from ctx.saved_tensors (log, sqrt or a division at 0, or "
                "0 * inf); tg.gradcheck compares it with finite differences."
            )
        else:
            lines.append(
                f"What to do: the derivative of '{rec.primitive}' is not finite at the values "
                f"it saw at {rec.source} (e.g. log, sqrt or pow at 0, or 0 * inf in the chain "
                "rule). Guard the argument, not only the result: "
                "jnp.where(ok, f(jnp.where(ok, x, 1.0)), 0.0), or add an epsilon."
            )
    if traced:
        lines.append(
            "(Checked under a jax trace: raised from a host callback when the compiled call ran.)"
        )
    return "\n".join(lines)


class _Report:
    """The host side of one pass's checks: raise at the first failed check, or (with
    ``halt=False``) log every origin and go on. ``operands``: (phase, record index) ->
    (names, values) the observer kept eagerly; ``bad``: value keys found non-finite by
    the passes over this tape so far (shared with the observer)."""

    def __init__(
        self,
        sites: Sequence[Site],
        producers: dict[int, Record],
        mode: AnomalyMode,
        operands: dict | None = None,
        bad: set | None = None,
    ):
        self.sites, self.producers, self.mode = tuple(sites), producers, mode
        self.operands = operands if operands is not None else {}
        self.bad = bad if bad is not None else set()

    def _operands(self, site: Site, path) -> tuple | None:
        if path or site.record is None or site.kind not in ("forward", "backward"):
            return None
        got = self.operands.get((site.kind, site.record.index))
        return None if got is None else summarize_all(*got)

    def __call__(self, codes, traced: bool = True) -> None:
        if not self.mode.halt:
            self._log(codes, traced)
            return
        hit = first_bad(codes, sum(s.size for s in self.sites), self.mode)
        if hit is not None:
            k, code = hit
            site, path = locate(self.sites, k)
            operands = None if traced else self._operands(site, path)
            text = message(site, code, self.producers, self.mode, traced, path)
            if operands:
                text += "\nIts operands:\n" + "\n".join(f"    {o}" for o in operands)
            err = AnomalyError(text, site.record, operands)
            if self.mode.post_mortem and not traced:
                post_mortem(err)
            raise err

    def _log(self, codes, traced: bool) -> None:
        found, bad = origins(self.sites, codes, self.mode, self.bad)
        self.bad |= bad
        log = current_log(self.mode.log)
        if log is None:
            return
        for site, code, path in found:
            operands = None if traced else self._operands(site, path)
            text = message(site, code, self.producers, self.mode, traced, path)
            log.events.append(event(site, code, path, text, operands))


def post_mortem(err: AnomalyError) -> None:
    """Open pdb in the first caller frame outside tapegrad and jax, with ``anomaly`` (the
    error: its ``.record`` and ``.operands``) among its locals."""
    frame = sys._getframe(1)
    while frame is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
    print(err, file=sys.stderr)
    print(
        "tapegrad: post-mortem at the call that ran the failing record; the error is "
        "`anomaly` (anomaly.record, anomaly.operands). `c` continues and raises it.",
        file=sys.stderr,
    )
    if frame is None:
        return
    debugger = pdb.Pdb()
    debugger.reset()
    frame.f_locals["anomaly"] = err  # pdb reads this dict as the frame's locals
    debugger.set_trace(frame)


_PKG = PACKAGE_DIR + os.sep
_JAX = os.path.dirname(os.path.abspath(jax.__file__)) + os.sep


def _internal(path: str) -> bool:
    return path.startswith((_PKG, _JAX)) or path.startswith("<frozen")
