"""Two residual reports side by side: a `MemoryReport` (tapegrad, under some policy)
beside a `JaxResiduals` (plain `jax.vjp`) or another `MemoryReport`.

Rows are matched by source line and primitive: a `MemoryReport` row counts its own
bytes (a loop row without its body rows, which come as rows of their own); a
`JaxResiduals` row that is one of the function's inputs (or a constant) is matched at the first
operation reading it, where tapegrad charges an input it saves. Each side's column sums
to that side's total. Reads the reports by their attributes only, so that the report
modules can call it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tapegrad.display.common import (
    _SRC,
    WIDTH,
    clip,
    human_bytes,
    short_source,
)
from tapegrad.display.html import (
    cell,
    e,
    header,
    page,
    stat,
    width,
)
from tapegrad.display.memory import report_decision

__all__ = ["Compared", "ComparedRow", "Comparison", "Totals", "compare"]


@dataclass(frozen=True, slots=True)
class Compared:
    """One report's bytes at one (source line, primitive): ``rows`` of its rows, by
    where they live (compressed bytes are among device and host), and how they are kept."""

    rows: int
    device_bytes: int
    host_bytes: int
    compressed_bytes: int
    decision: str

    @property
    def bytes(self) -> int:
        return self.device_bytes + self.host_bytes


@dataclass(frozen=True, slots=True)
class ComparedRow:
    """A source line and primitive, with each side's bytes there (None: none kept)."""

    source: str
    primitive: str
    left: Compared | None
    right: Compared | None

    @property
    def difference(self) -> int:
        """Right's bytes less left's."""
        return (self.right.bytes if self.right else 0) - (self.left.bytes if self.left else 0)


@dataclass(frozen=True, slots=True)
class Totals:
    """One report's totals: every residual byte held after forward, by kind, and how
    many of them are the caller's own inputs."""

    label: str
    bytes: int
    device_bytes: int
    host_bytes: int
    compressed_bytes: int
    inputs_bytes: int

    @property
    def beyond_inputs_bytes(self) -> int:
        return self.bytes - self.inputs_bytes


@dataclass(frozen=True)
class Comparison:
    """Two reports side by side (`compare`): ``rows`` matched by source line and
    primitive, ``left`` / ``right`` each report's totals."""

    rows: tuple[ComparedRow, ...]
    left: Totals
    right: Totals

    def __str__(self) -> str:
        return _text(self)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return _html(self)


def _line_of(source: str) -> str:
    """``file:line`` of a ``file:line (function)`` source (the function name dropped:
    one line, whatever a frame called it)."""
    m = _SRC.match(source)
    return f"{m.group(1)}:{m.group(2)}" if m is not None else source


def _is_memory_report(rep: Any) -> bool:
    return hasattr(rep, "records") and hasattr(rep, "residual_bytes")


def _entries(rep: Any) -> list[tuple[str, str, str, int, int, int]]:
    """(line, primitive, source, device, host, compressed) per row of ``rep``."""
    out = []
    if _is_memory_report(rep):
        for r in rep.rows():
            dev = r.device_bytes - sum(x.device_bytes for x in r.body)
            host = r.host_bytes - sum(x.host_bytes for x in r.body)
            comp = r.compressed_bytes - sum(x.compressed_bytes for x in r.body)
            if dev or host:
                out.append((_line_of(r.source), r.primitive, r.source, dev, host, comp))
        return out
    for r in rep.rows:
        prim = r.read_by or r.primitive  # an input or constant: where it is read
        out.append((_line_of(r.source), prim, r.source, r.device_bytes, r.host_bytes, 0))
    return out


def _totals(rep: Any) -> Totals:
    if _is_memory_report(rep):
        return Totals(
            f"tapegrad {rep.policy!r}",
            rep.residual_bytes,
            rep.device_bytes,
            rep.host_bytes,
            sum(r.compressed_bytes for r in rep.records),
            rep.input_bytes,
        )
    return Totals("jax.vjp", rep.total_bytes, rep.device_bytes, rep.host_bytes, 0, rep.inputs_bytes)


def _group(entries) -> dict[tuple[str, str], tuple[str, Compared]]:
    acc: dict[tuple[str, str], list] = {}
    for line, prim, src, dev, host, comp in entries:
        a = acc.setdefault((line, prim), [src, 0, 0, 0, 0])
        a[1] += 1
        a[2] += dev
        a[3] += host
        a[4] += comp
    out = {}
    for key, (src, n, dev, host, comp) in acc.items():
        c = Compared(n, dev, host, comp, "")
        out[key] = (src, Compared(n, dev, host, comp, report_decision(c)))
    return out


def compare(a: Any, b: Any) -> Comparison:
    """``a`` beside ``b``, each a `MemoryReport` or a `JaxResiduals`.

    ```python
    mine = tg.memory_report(loss, policy=tg.policies.offload())(params, x)
    print(mine.compare(tg.jax_residuals(loss)(params, x)))
    ```
    One row per source line and primitive that either keeps residuals at, with each
    side's bytes (device, host, compressed) and how it keeps them, and both totals.
    """
    left, right = _group(_entries(a)), _group(_entries(b))
    rows = []
    for key in _merged(list(left), list(right)):
        src = (left.get(key) or right[key])[0]
        lv, rv = left.get(key), right.get(key)
        rows.append(ComparedRow(src, key[1], lv[1] if lv else None, rv[1] if rv else None))
    ta, tb = _totals(a), _totals(b)
    if ta.label == tb.label:
        ta = Totals(ta.label + " (a)", *_fields(ta))
        tb = Totals(tb.label + " (b)", *_fields(tb))
    return Comparison(tuple(rows), ta, tb)


def _merged(a: list, b: list) -> list:
    """``a``'s keys in order, each of ``b``'s others placed after the key ``b`` has
    before it (so both programs' orders are kept where they agree)."""
    out = list(a)
    at = -1
    for k in b:
        if k in out:
            at = out.index(k)
        else:
            at += 1
            out.insert(at, k)
    return out


def _fields(t: Totals) -> tuple[int, ...]:
    return (t.bytes, t.device_bytes, t.host_bytes, t.compressed_bytes, t.inputs_bytes)


# ------------------------------------------------------------------ pictures


def _side_text(c: Compared | None) -> str:
    if c is None:
        return f"{'—':>11} {'':<9}"
    return f"{c.bytes:>11,} {clip(c.decision, 9):<9}"


def _total_lines(cmp: Comparison) -> list[str]:
    """Both totals, aligned under the bytes columns, with their difference."""
    a, b = cmp.left, cmp.right
    out = []
    for label, x, y in (
        ("total", a.bytes, b.bytes),
        ("  beyond the inputs", a.beyond_inputs_bytes, b.beyond_inputs_bytes),
        ("  the inputs themselves", a.inputs_bytes, b.inputs_bytes),
        ("  on device", a.device_bytes, b.device_bytes),
        ("  on host", a.host_bytes, b.host_bytes),
        ("  compressed (of those)", a.compressed_bytes, b.compressed_bytes),
    ):
        if label.startswith("  on host") and not (x or y):
            continue
        if label.startswith("  compressed") and not (x or y):
            continue
        out.append(f"{label:<39} {x:>11,} {'':<9}  {y:>11,} {'':<9} {y - x:>+12,}")
    return out


def _text(cmp: Comparison) -> str:
    la, lb = clip("(a) " + cmp.left.label, 21), clip("(b) " + cmp.right.label, 21)
    lines = [
        clip(f"compare: (a) {cmp.left.label}  |  (b) {cmp.right.label}", WIDTH),
        clip(
            f"  held beyond the inputs: (a) {cmp.left.beyond_inputs_bytes:,} B  |  "
            f"(b) {cmp.right.beyond_inputs_bytes:,} B",
            WIDTH,
        ),
        f"{'':<39} {la:<21}  {lb:<21}",
        f"{'source':<26} {'primitive':<12} {'bytes':>11} {'decision':<9}  "
        f"{'bytes':>11} {'decision':<9} {'b − a':>12}",
    ]
    for r in cmp.rows:
        lines.append(
            f"{short_source(r.source, 26):<26} {clip(r.primitive, 12):<12} "
            f"{_side_text(r.left)}  {_side_text(r.right)} {r.difference:>+12,}"
        )
    lines.extend(_total_lines(cmp))
    return "\n".join(clip(line, WIDTH) for line in lines)


_SIDE = (
    ("rows", "n", 5),
    ("decision", "", 9),
    ("device B", "n", 12),
    ("host B", "n", 11),
    ("compressed B", "n", 12),
)


def _cols(cmp: Comparison) -> tuple[tuple[str, str, int], ...]:
    return (
        (("source", "", 30), ("primitive", "", 14))
        + tuple((f"{t} (a)", c, w) for t, c, w in _SIDE)
        + tuple((f"{t} (b)", c, w) for t, c, w in _SIDE)
        + (("b − a", "n", 12),)
    )


def _side_cells(c: Compared | None) -> str:
    if c is None:
        return "".join(cell("—", "n" if k else "") for _, k, _ in _SIDE)
    return (
        cell(c.rows, "n", c.rows)
        + cell(c.decision, "d-" + c.decision.split("+")[-1])
        + cell(f"{c.device_bytes:,}", "n", c.device_bytes)
        + cell(f"{c.host_bytes:,}", "n", c.host_bytes)
        + cell(f"{c.compressed_bytes:,}", "n", c.compressed_bytes)
    )


def _html(cmp: Comparison) -> str:
    cols = _cols(cmp)
    colgroup, thead = header(cols, sortable=True)
    body = "".join(
        "<tr>"
        + cell(short_source(r.source, 30), title=r.source)
        + cell(r.primitive)
        + _side_cells(r.left)
        + _side_cells(r.right)
        + cell(f"{r.difference:+,}", "n", r.difference)
        + "</tr>"
        for r in cmp.rows
    )
    foot = (
        "<tr>"
        + cell("total")
        + cell("")
        + "".join(
            cell(len([r for r in cmp.rows if getattr(r, side)]), "n")
            + cell("")
            + cell(f"{t.device_bytes:,}", "n", t.device_bytes)
            + cell(f"{t.host_bytes:,}", "n", t.host_bytes)
            + cell(f"{t.compressed_bytes:,}", "n", t.compressed_bytes)
            for side, t in (("left", cmp.left), ("right", cmp.right))
        )
        + cell(f"{cmp.right.bytes - cmp.left.bytes:+,}", "n")
        + "</tr>"
    )
    table = (
        f'<table class="tapegrad-compare" {width(cols)}>{colgroup}{thead}'
        f"<tbody>{body}</tbody><tfoot>{foot}</tfoot></table>"
    )
    totals = []
    for side, t in (("a", cmp.left), ("b", cmp.right)):
        totals += [
            stat(f"({side})", t.label, f"{side}_label"),
            stat(
                f"({side}) beyond the inputs",
                t.beyond_inputs_bytes,
                f"{side}_beyond_inputs_bytes",
                human_bytes(t.beyond_inputs_bytes),
            ),
            stat(f"({side}) inputs", t.inputs_bytes, f"{side}_inputs_bytes"),
            stat(f"({side}) residual bytes", t.bytes, f"{side}_bytes", human_bytes(t.bytes)),
        ]
    note = (
        '<div style="opacity:.7;margin-top:4px">'
        + e(
            "rows matched by source line and primitive; an input jax keeps is matched at "
            "the first operation reading it"
        )
        + "</div>"
    )
    return page("tg-compare", totals, table, note)
