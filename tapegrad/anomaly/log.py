"""Anomaly mode that keeps going: every origin of a NaN/Inf, not only the first.

``with tg.detect_anomaly(halt=False) as log:`` runs to the end and collects, in
``log.events``, every *origin*: a check that failed while everything it was computed from
passed — in forward, a record whose output is non-finite while all its inputs are finite;
in backward, a VJP rule that returns a non-finite cotangent while the cotangents it
received and the values it read from forward (its inputs and outputs) are finite. The
copies downstream of an origin are not events. Inside a loop every step is examined in
the order it ran, a scan's non-finite carry passed on to the next step as a non-finite
input, and the event names its step.

Eagerly, each event (and a halting `AnomalyError`) carries `Operand` summaries of the
record's operands — its inputs in forward, the cotangents it received in backward:
shape, dtype, NaN and Inf counts, the min and max of the finite values. Under `jax.jit`
the values live inside the compiled program and only the checks reach the host, so
``operands`` is None there.
"""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from tapegrad.anomaly.probes import INF, NAN, AnomalyMode, Site, codes_of
from tapegrad.core.tape import Record, Var

__all__ = ["AnomalyEvent", "AnomalyLog", "Operand", "origins", "summarize"]


@dataclasses.dataclass(frozen=True)
class Operand:
    """One operand of a record, summarized on the host."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nan: int
    inf: int
    min: float | None  # of the finite values (None: none is finite)
    max: float | None

    def __str__(self) -> str:
        rng = (
            "no finite value" if self.min is None else f"finite in [{self.min:.4g}, {self.max:.4g}]"
        )
        return f"{self.name}: {self.dtype}{list(self.shape)}  NaN {self.nan}  Inf {self.inf}  {rng}"


def summarize(name: str, x: Any) -> Operand:
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.inexact):
        lo = hi = None
        if a.size:
            lo, hi = float(a.min()), float(a.max())
        return Operand(name, a.shape, str(a.dtype), 0, 0, lo, hi)
    a = a.astype(np.float64) if a.dtype.itemsize < 4 or a.dtype.kind == "V" else a
    nan, inf = int(np.isnan(a).sum()), int(np.isinf(a).sum())
    fin = a[np.isfinite(a)]
    lo, hi = (float(fin.min()), float(fin.max())) if fin.size else (None, None)
    return Operand(name, a.shape, str(np.asarray(x).dtype), nan, inf, lo, hi)


def summarize_all(names: Sequence[str], values: Sequence[Any]) -> tuple[Operand, ...] | None:
    try:
        return tuple(summarize(n, v) for n, v in zip(names, values) if v is not None)
    except Exception:  # noqa: BLE001 - a tracer, a deleted array: no summary
        return None


@dataclasses.dataclass(frozen=True)
class AnomalyEvent:
    """One origin of a non-finite value.

    kind: "NaN" or "Inf"; phase: "forward" or "backward"; primitive and source
    (``file:line (function)``) of the record (``"input"`` / ``"cotangent"`` for a value
    passed in); step: the loop steps it ran in, outermost first (None outside loops);
    index: the record's output (forward) or input (backward) that failed; operands:
    summaries of what the record read (eagerly; None under jit); message: the full text
    a halting `AnomalyError` would carry.
    """

    kind: str
    phase: str
    primitive: str
    source: str
    step: tuple[int, ...] | None
    record: Record | None
    index: int
    operands: tuple[Operand, ...] | None
    message: str

    def __str__(self) -> str:
        return self.message


_COLS = ("#", "phase", "kind", "primitive", "record", "step", "source")


class AnomalyLog:
    """The events `detect_anomaly(halt=False)` collected, in the order found.

    ``log.events`` is a list of `AnomalyEvent`; ``print(log)`` shows them as a table, and
    in Jupyter the log renders as an HTML table.
    """

    def __init__(self) -> None:
        self.events: list[AnomalyEvent] = []

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[AnomalyEvent]:
        return iter(self.events)

    def __bool__(self) -> bool:
        return True

    def _rows(self) -> list[tuple[str, ...]]:
        rows: list[tuple[str, ...]] = []
        for n, e in enumerate(self.events):
            rec = "" if e.record is None else f"#{e.record.index}"
            step = "" if e.step is None else ",".join(map(str, e.step))
            rows.append((str(n), e.phase, e.kind, e.primitive, rec, step, e.source))
        return rows

    def __str__(self) -> str:
        if not self.events:
            return "AnomalyLog: no NaN or Inf found"
        rows = [_COLS, *self._rows()]
        w = [max(len(r[i]) for r in rows) for i in range(len(_COLS) - 1)]
        lines = [
            "  ".join(c.ljust(w[i]) for i, c in enumerate(r[:-1])) + "  " + r[-1] for r in rows
        ]
        return f"AnomalyLog: {len(self.events)} origin(s)\n" + "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{c}</th>" for c in _COLS)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
            for r in self._rows()
        )
        return (
            f'<table class="tapegrad-anomaly-log"><thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>"
        )


# Logs of the `with detect_anomaly(halt=False)` blocks open now, innermost last: a check
# staged under jax.jit reports into the block that runs the compiled call, not the one
# that traced it (jax may reuse the compiled program).
_OPEN: list[AnomalyLog] = []


def current_log(fallback: AnomalyLog | None) -> AnomalyLog | None:
    return _OPEN[-1] if _OPEN else fallback


# ------------------------------------------------------------------ origins


def _key(kind: str, v: Any) -> tuple | None:
    return (kind, v.id) if isinstance(v, Var) else None


def origins(
    sites: Sequence[Site], probes: Any, mode: AnomalyMode, bad_before: set | None = None
) -> tuple[list[tuple[Site, int, list[tuple[Site, int]]]], set]:
    """``([(site, code, loop path)], bad keys)``: the failed checks among ``sites`` (whose
    flat ``probes`` these are) that are origins. ``bad_before``: keys found bad in an
    earlier pass over the same tape (forward's, when this is backward)."""
    n = sum(s.size for s in sites)
    c = codes_of(probes, mode).reshape(-1, n)
    per = np.where((c == NAN).any(axis=0), NAN, c.max(axis=0)) if c.size else np.zeros(0, np.int8)
    bad = set(bad_before or ())
    return _scan(sites, list(per), bad, []), bad


def _scan(sites, codes, bad: set, path) -> list:
    """Walk ``sites`` in order with their ``codes`` (a flat list consumed from the front)."""
    found: list = []
    loops_reported: set[int] = set()
    for s in sites:
        if s.kind == "loop":
            found += _loop(s, codes, bad, path, loops_reported)
            continue
        code = int(codes.pop(0))
        if not code:
            continue
        rec = s.record
        if s.kind in ("input", "forward"):
            k = _key("fwd", s.var)
            reads = [] if rec is None else [_key("fwd", u) for u in rec.inputs]
        elif s.kind == "cotangent":
            k, reads = _key("ct", s.var), []
        else:  # backward: the cotangent of rec's input
            k = _key("ct", s.var)
            assert rec is not None
            reads = [_key("ct", o) for o in rec.outputs]
            reads += [_key("fwd", u) for u in (*rec.inputs, *rec.outputs)]
        upstream = any(r in bad for r in reads if r is not None)
        if k is not None:
            bad.add(k)
        if upstream:
            continue
        if rec is not None and rec.index in loops_reported:
            continue  # the loop's own output: its body's origin was reported
        found.append((s, code, path))
    return found


def _phase(sites) -> str:
    """ "fwd" for a forward pass's sites, "ct" for a backward pass's."""
    for s in sites:
        if s.kind == "loop":
            return _phase(s.body)
        return "ct" if s.kind in ("backward", "cotangent") else "fwd"
    return "fwd"


def _loop(s: Site, codes: list, bad: set, path, loops_reported: set) -> list:
    """The origins inside a loop site, step by step (in the order the steps ran). A
    scan's carry found non-finite in one step is non-finite where the next step reads
    it; the loop's own operands non-finite make every value inside a copy."""
    rec = s.record
    phase = _phase(s.body)
    per_step = sum(b.size for b in s.body)
    outer: list = []
    if rec is not None:  # what the loop record reads: its operands; in backward also its
        # cotangents and, as its residuals, its outputs
        outer = [_key("fwd", u) for u in rec.inputs]
        if phase == "ct":
            outer += [_key(kind, o) for o in rec.outputs for kind in ("ct", "fwd")]
    upstream = any(r in bad for r in outer if r is not None)
    found: list = []
    carried: set = set()
    hit = False
    for t in s.steps:
        step = [codes.pop(0) for _ in range(per_step)]
        inner_bad = set(carried)
        if any(step):
            hit = True
            if not upstream:
                found += _scan(s.body, step, inner_bad, path + [(s, t)])
        carried = _carries(rec, phase, inner_bad)
    if found and rec is not None:
        loops_reported.add(rec.index)
    if hit and rec is not None and phase == "fwd":
        bad.update(("fwd", o.id) for o in rec.outputs)
    return found


def _carries(rec: Record | None, phase: str, inner_bad: set) -> set:
    """The keys of a scan body's carry inputs (forward) or carry outputs' cotangents
    (backward) that the next step receives non-finite."""
    if rec is None or rec.primitive != "scan" or not rec.bodies:
        return set()
    body = rec.bodies[0]
    nc, nk = int(rec.params.get("num_consts", 0)), int(rec.params.get("num_carry", 0))
    out = set()
    for k in range(nk):
        if nc + k >= len(body.inputs) or k >= len(body.outputs):
            break
        i, o = body.inputs[nc + k], body.outputs[k]
        if phase == "fwd" and _key("fwd", o) in inner_bad:
            out.add(("fwd", i.id))
        if phase == "ct" and _key("ct", i) in inner_bad and isinstance(o, Var):
            out.add(("ct", o.id))
    return out


def event(site: Site, code: int, path, text: str, operands) -> AnomalyEvent:
    rec = site.record
    phase = "backward" if site.kind in ("backward", "cotangent") else "forward"
    if rec is None:
        primitive, source = site.kind, f"argument {site.label}"
    else:
        primitive, source = rec.primitive, rec.source
    step = tuple(t for _, t in path) or None
    kind = "NaN" if code == NAN else "Inf" if code == INF else "?"
    return AnomalyEvent(kind, phase, primitive, source, step, rec, site.index, operands, text)
