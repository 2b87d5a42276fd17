"""A picture of a tape: records as nodes, values as edges, what backward keeps marked.

``tape.graph()`` (registered into the tape's printers, as its text and HTML are) and
``memory_report(...).graph()`` return a `TapeGraph`: Graphviz DOT source that Graphviz's
``dot`` lays out as SVG. Each record is a box with its primitive, output type and the
user's ``file:line``, and one line per value it keeps for backward (bytes and decision:
save, offload, compress with its bits, recompute, rebuilt); the edges that carry a kept
value are drawn thick in the decision's colour. The function's inputs and outputs are
distinct shapes; checkpoint regions are dashed boxes; a loop or branch body is a box
labelled with its trip count. Long tapes fold as the text report does (a block repeated
many times shows its first and last copy and one node for the rest), then by source
line, so a drawing stays near `MAX_NODES` boxes whatever the tape's length.

``.svg()`` draws every body inline (collapsed to its loop's box when that would pass
`MAX_NODES`); in Jupyter the graph shows the top level with each body under its own
``<details>``, so bodies open and close without JavaScript.
"""

from __future__ import annotations

import shutil
import subprocess
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tapegrad.core.tape import Record, Tape, Var, aval_str, kind_of, register_printer
from tapegrad.display.common import _record_sig, fold_runs, human_bytes, short_source
from tapegrad.display.html import e

__all__ = ["MAX_NODES", "TapeGraph", "report_graph", "tape_graph"]

MAX_NODES = 150  # boxes one drawing aims to stay under, after folding

COLORS = {
    "save": "#2b6cb0",
    "offload": "#6b46c1",
    "compress": "#c05621",
    "recompute": "#2f855a",
    "rebuilt": "#0f766e",
}
_FONT = 'fontname="Helvetica"'


@dataclass(frozen=True)
class TapeGraph:
    """A tape drawn as a graph. ``dot()``: the Graphviz source; ``svg()``: the picture
    (needs Graphviz's ``dot`` program); ``save(path)``: ``.svg`` or ``.dot`` by suffix.
    ``nodes``: the boxes drawn; ``folded``: records drawn as part of a folded box."""

    source: str
    nodes: int
    records: int
    folded: int
    bodies: tuple[tuple[str, TapeGraph], ...] = ()
    _svg: dict = field(default_factory=dict, repr=False, compare=False)

    def dot(self) -> str:
        return self.source

    def svg(self) -> str:
        if "svg" not in self._svg:
            self._svg["svg"] = render_svg(self.source)
        return self._svg["svg"]

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.source if str(path).endswith(".dot") else self.svg())

    def __str__(self) -> str:
        return self.source

    def _repr_html_(self) -> str:
        try:
            pic = self.svg()
        except RuntimeError as err:
            pic = f"<p>{e(str(err))}</p><pre>{e(self.source)}</pre>"
        parts = [f'<div class="tg-graph">{_legend()}{pic}']
        for label, g in self.bodies:
            parts.append(f"<details><summary>{e(label)}</summary>{g._repr_html_()}</details>")
        return "".join(parts) + "</div>"


def render_svg(source: str) -> str:
    """SVG text of DOT ``source``, laid out by Graphviz's ``dot``."""
    exe = shutil.which("dot")
    if exe is None:
        raise RuntimeError(
            "drawing a tape needs Graphviz's `dot` program, which is not on PATH: install "
            "Graphviz (apt-get install graphviz, brew install graphviz or conda install "
            "graphviz). `graph.dot()` gives the DOT source without it."
        )
    r = subprocess.run([exe, "-Tsvg"], input=source, capture_output=True, text=True, timeout=120)
    if r.returncode:
        raise RuntimeError(f"Graphviz's dot failed: {r.stderr.strip()}")
    svg = r.stdout
    return svg[svg.index("<svg") :] if "<svg" in svg else svg


def _legend() -> str:
    keys = " ".join(
        f'<span style="color:{c};font-weight:bold">━ {k}</span>' for k, c in COLORS.items()
    )
    return f'<div style="font:12px Helvetica;margin:2px 0 6px">kept for backward: {keys}</div>'


# ------------------------------------------------------------------ decisions


@dataclass
class _Keeps:
    """What one box keeps: label lines, and the decision of each kept value's key."""

    lines: list[str]
    key_decision: dict[Any, str]
    node_decision: str | None  # a record rebuilt/recomputed in backward


def _tape_keeps(tape: Tape, rec: Record) -> _Keeps:
    recomputed = _recomputed(tape)
    lines, keys = [], {}
    for s in rec.saves:
        key = rec.residual_key(s)
        d = "recompute" if key in recomputed else "save"
        keys[key] = d
        lines.append(f"keeps {s} {aval_str(s.shape, s.dtype)} · {human_bytes(s.nbytes)} · {d}")
    if rec.bodies and rec.in_backward:
        n = kind_of(rec).residual_bytes(rec)
        if n:
            lines.append(f"bodies keep {human_bytes(n)} over all steps")
    return _Keeps(lines, keys, _node_decision(rec))


_RECOMPUTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _recomputed(tape: Tape) -> dict:
    got = _RECOMPUTED.get(tape)
    if got is None:
        got = _RECOMPUTED[tape] = tape.residual_keys()[1]
    return got


def _node_decision(rec: Record) -> str | None:
    if rec.decision != "recompute":
        return None
    return "recompute" if rec.region is not None else "rebuilt"


def _row_decision(row: Any) -> str:
    if row.planned:
        p = row.planned
        if "offload" in p:
            return "offload"
        if p not in ("save", ""):
            return "compress" if "recompute" not in p else "recompute"
        return "save"
    if row.host_bytes:
        return "offload"
    if row.compressed_bytes:
        return "compress"
    return "save"


def _report_keeps(tape: Tape, rec: Record, row: Any) -> _Keeps:
    base = _tape_keeps(tape, rec)
    if row is None:
        return _Keeps([], {}, base.node_decision)
    d = _row_decision(row)
    where = []
    if row.device_bytes:
        where.append(f"{human_bytes(row.device_bytes)} device")
    if row.host_bytes:
        where.append(f"{human_bytes(row.host_bytes)} host")
    if row.compressed_bytes:
        where.append(f"{human_bytes(row.compressed_bytes)} compressed")
    what = row.planned or d
    if row.bits:
        what += f" ({row.bits} bits)"
    steps = f" over {row.steps} steps" if row.steps > 1 else ""
    line = f"keeps {' + '.join(where) or '0 B'}{steps} · {what}"
    return _Keeps([line], {k: d for k in base.key_decision}, base.node_decision)


# ------------------------------------------------------------------ folding


@dataclass
class _Box:
    """One node: the records it stands for and how it is labelled."""

    recs: list[int]
    kind: str = "record"  # record | fold | line | rest
    repeats: int = 1
    period: int = 1


def _boxes(tape: Tape, budget: int) -> list[_Box]:
    """The boxes ``tape``'s records are drawn as, about ``budget`` of them at most: one
    per record; else a block repeated ≥ 3 times shows its first copy and one box for the
    rest; then consecutive records of one source line share a box; then consecutive
    boxes are chunked. A loop or branch record always keeps its own box."""
    recs = tape.records
    boxes = [_Box([i]) for i in range(len(recs))]
    if len(boxes) > budget:
        boxes = []
        sigs = [_record_sig(x) for x in recs]
        for start, p, r in fold_runs(sigs, _fold, max_period=FOLD_PERIOD):
            boxes += [_Box([start + k]) for k in range(p)]
            if r > 1:
                boxes.append(_Box(list(range(start + p, start + r * p)), "fold", r - 1, p))
    if len(boxes) > budget:
        size = -(-len(boxes) // budget)
        boxes = _merge(boxes, recs, lambda a, b: a.source == b.source != "<unknown>", size)
    if len(boxes) > budget:
        boxes = _merge(boxes, recs, lambda a, b: True, -(-len(boxes) // budget))
    return boxes


FOLD_PERIOD = 256  # longest repeated block folded (a transformer layer is ~70 records)


def _fold(p: int, r: int) -> bool:
    return r >= 3 and (r - 1) * p >= 2


def _merge(boxes: list[_Box], recs: tuple[Record, ...], same, size: int) -> list[_Box]:
    """Consecutive record boxes (no bodies) merged while ``same(last, next)`` holds, each
    merged box holding at most ``size`` of the boxes before."""
    out: list[_Box] = []
    held = 0
    for b in boxes:
        prev = out[-1] if out else None
        if (
            prev is not None
            and b.kind in ("record", "line")
            and prev.kind in ("record", "line")
            and not any(recs[i].bodies for i in b.recs + prev.recs)
            and same(recs[prev.recs[-1]], recs[b.recs[0]])
            and held < size
        ):
            prev.recs += b.recs
            prev.kind = "line"
            held += 1
        else:
            out.append(_Box(list(b.recs), b.kind, b.repeats, b.period))
            held = 1
    return out


# ------------------------------------------------------------------ drawing


class _Drawer:
    def __init__(self, rows: dict | None, inline: bool, budget: int):
        self.rows = rows  # None: a tape alone; else {(path, index): RecordMemory}
        self.inline = inline
        self.budget = budget
        self.lines: list[str] = []
        self.nodes = 0
        self.folded = 0
        self.records = 0
        self.bodies: list[tuple[str, Tape, tuple]] = []

    def node(self, name: str, label: str, **attrs: str) -> None:
        extra = "".join(f' {k}="{v}"' for k, v in attrs.items())
        self.lines.append(f"  {name} [label=<{label}>{extra}];")
        self.nodes += 1

    def keeps(self, tape: Tape, rec: Record, path: tuple) -> _Keeps:
        if self.rows is None:
            return _tape_keeps(tape, rec)
        return _report_keeps(tape, rec, self.rows.get((path, rec.index)))

    def tape(self, tape: Tape, path: tuple, budget: int) -> None:
        p = "n" + "_".join(map(str, path)) + "_" if path else "n"
        top = not path
        producer: dict[int, str] = {}
        kept, _ = tape.residual_keys()
        # Each kept value's decision is its first saver's (the record its bytes count on).
        keeps = [self.keeps(tape, rec, path) for rec in tape.records]
        key_decision: dict[Any, str] = {}
        for kp in keeps:
            for key, d in kp.key_decision.items():
                key_decision.setdefault(key, d)
        for k, v in enumerate(tape.inputs):
            name = f"{p}in{k}"
            producer[v.id] = name
            active = not tape.active_inputs or tape.active_inputs[k]
            what = ("input" if top else "in") + f" {k}"
            label = f"<b>{what}</b> {e(str(v))}: {e(v.aval)}"
            if not active:
                label += '<br/><font point-size="9">not differentiated</font>'
            if v.id in kept:
                held = "kept as it is (the caller holds it)" if top else "kept each step"
                label += f'<br/><font point-size="9">{held}</font>'
            self.node(name, label, shape="box", style="rounded,filled", fillcolor="#e6f4ea")
        const_ids = {v.id: v for v, _ in tape.consts}
        boxes = _boxes(tape, max(budget - len(tape.inputs) - len(tape.outputs), 8))
        self.records += len(tape.records)
        box_of: dict[int, str] = {}
        by_region: dict[Any, list[str]] = {}
        edge_style: dict[tuple[str, str], str] = {}
        for box in boxes:
            name = f"{p}r{box.recs[0]}"
            for i in box.recs:
                box_of[i] = name
            self._box(tape, box, name, path, [keeps[i] for i in box.recs])
            if box.kind != "record":
                self.folded += len(box.recs)
            region = tape.records[box.recs[0]].region
            by_region.setdefault(region, []).append(name)
            for i in box.recs:
                rec = tape.records[i]
                for o in rec.outputs:
                    producer[o.id] = name
                for u in rec.inputs:
                    if not isinstance(u, Var):
                        continue
                    src = producer.get(u.id)
                    if src is None and u.id in const_ids:
                        src = producer[u.id] = f"{p}c{u.id}"
                        self.node(
                            src,
                            f"const {e(u.aval)}",
                            shape="box",
                            fontsize="9",
                            style="rounded,filled",
                            fillcolor="#edf2f7",
                            color="#a0aec0",
                        )
                    if src is None or src == name:
                        continue
                    dec = key_decision.get(u.id)
                    prev = edge_style.get((src, name))
                    if prev is None or (dec and not prev):
                        edge_style[(src, name)] = dec or ""
        for region, names in by_region.items():
            if region is None:
                continue
            src = next((r.source for r in tape.regions if r.id == region), "")
            self.lines.append(
                f'  subgraph cluster_{p}g{region} {{ style="dashed,rounded"; color="#2f855a"; '
                f'label="checkpoint {e(short_source(src, 48))}"; fontsize=10; '
                + " ".join(names)
                + "; }"
            )
        for (src, dst), d in edge_style.items():
            if d:
                self.lines.append(f'  {src} -> {dst} [color="{COLORS[d]}", penwidth=2.2];')
            else:
                self.lines.append(f"  {src} -> {dst};")
        for k, out in enumerate(tape.outputs):
            name = f"{p}out{k}"
            aval = out.aval if isinstance(out, Var) else "literal"
            what = ("output" if top else "out") + f" {k}"
            self.node(
                name,
                f"<b>{what}</b> {e(aval)}",
                shape="box",
                style="rounded,filled",
                fillcolor="#fdebd3",
            )
            if isinstance(out, Var) and out.id in producer:
                self.lines.append(f"  {producer[out.id]} -> {name};")

    def _box(self, tape: Tape, box: _Box, name: str, path: tuple, keeps: list[_Keeps]) -> None:
        """Draw one box; ``keeps``: what each of its records keeps."""
        recs = [tape.records[i] for i in box.recs]
        rec = recs[0]
        src = e(short_source(rec.source, 44))
        if box.kind == "record":
            outs = " ".join(o.aval for o in rec.outputs[:2]) + (
                " …" if len(rec.outputs) > 2 else ""
            )
            head = f"<b>{e(_title(rec))}</b> {e(outs)}"
            lines = [ln for k in keeps for ln in k.lines]
        else:
            counts = Counter(r.primitive for r in recs)
            prims = ", ".join(f"{k} ×{n}" if n > 1 else k for k, n in counts.most_common(4))
            if len(counts) > 4:
                prims += ", …"
            if box.kind == "fold":
                head = f"<b>× {box.repeats} more of the {box.period} records above</b>"
            else:
                head = f"<b>{len(recs)} records</b>"
            head += f'<br/><font point-size="9">{e(prims)}</font>'
            total = sum(s.nbytes for r in recs for s in r.saves)
            lines = [f"keep {human_bytes(total)}"] if total else []
        label = head + f'<br/><font point-size="9" color="#555555">{src}</font>'
        for ln in lines[:4]:
            d = next((dd for dd in COLORS if dd in ln.rsplit("·", 1)[-1]), "save")
            label += f'<br/><font point-size="9" color="{COLORS[d]}">{e(ln)}</font>'
        if len(lines) > 4:
            label += f'<br/><font point-size="9">… {len(lines) - 4} more</font>'
        attrs = {"shape": "box", "style": "rounded"}
        nd = keeps[0].node_decision if box.kind == "record" else None
        if nd:
            attrs.update(style="rounded,dashed", color=COLORS[nd])
            label += f'<br/><font point-size="9" color="{COLORS[nd]}">{nd} in backward</font>'
        if box.kind != "record":
            attrs.update(style="rounded,filled", fillcolor="#f1f5f9")
        if rec.bodies and box.kind == "record":
            attrs.update(penwidth="2")
        self.node(name, label, **attrs)
        if rec.bodies and box.kind == "record":
            for b, body in enumerate(rec.bodies):
                blabel = _body_label(rec, b, len(body.records))
                sub = path + (rec.index, b)
                if self.inline:
                    self.lines.append(
                        f'  subgraph cluster_{name}_b{b} {{ label="{e(blabel)}"; fontsize=10; '
                        'style="rounded,filled"; fillcolor="#f8fafc"; color="#94a3b8";'
                    )
                    first = len(self.lines)
                    self.tape(body, sub, self.budget)
                    anchor = f"n{'_'.join(map(str, sub))}_in0" if body.inputs else None
                    self.lines.append("  }")
                    if anchor and first < len(self.lines):
                        self.lines.append(
                            f"  {name} -> {anchor} [style=dotted, arrowhead=none, "
                            f'lhead="cluster_{name}_b{b}"];'
                        )
                else:
                    self.bodies.append((blabel, body, sub))


def _title(rec: Record) -> str:
    if rec.primitive == "scan":
        return f"scan ×{rec.trip_count}"
    if rec.primitive == "cond":
        return f"cond · {len(rec.bodies)} branches"
    if rec.rule == "fallback":
        return f"{rec.primitive} (fallback)"
    return rec.primitive


def _body_label(rec: Record, b: int, n: int) -> str:
    src = short_source(rec.source, 40)
    if rec.primitive == "scan":
        return f"scan body ×{rec.trip_count} · {n} records · {src}"
    return f"cond branch {b} · {n} records · {src}"


def _draw(tape: Tape, rows: dict | None, inline: bool, budget: int, path: tuple = ()) -> TapeGraph:
    d = _Drawer(rows, inline, budget)
    d.tape(tape, path, budget)
    body = (
        '  graph [rankdir=TB, compound=true, nodesep=0.25, ranksep=0.3, fontname="Helvetica"];\n'
        f'  node [{_FONT}, fontsize=10, margin="0.08,0.04"];\n'
        '  edge [color="#9ca3af", arrowsize=0.6];\n'
    )
    source = "digraph tape {\n" + body + "\n".join(d.lines) + "\n}\n"
    subs = tuple((label, _draw(t, rows, False, budget, sub)) for label, t, sub in d.bodies)
    return TapeGraph(source, d.nodes, d.records, d.folded, subs)


def _count(tape: Tape) -> int:
    return len(tape.records) + sum(_count(b) for r in tape.records for b in r.bodies)


def _graph(tape: Tape, rows: dict | None, inline: bool | None, max_nodes: int) -> TapeGraph:
    if inline is None:  # bodies inline when the whole picture fits
        g = _draw(tape, rows, True, max_nodes)
        return g if g.nodes <= max_nodes * 1.2 else _draw(tape, rows, False, max_nodes)
    return _draw(tape, rows, inline, max_nodes)


def tape_graph(tape: Tape, *, bodies: bool | None = None, max_nodes: int = MAX_NODES) -> TapeGraph:
    """``tape.graph()``: the tape as a `TapeGraph`. ``bodies``: draw loop and branch bodies
    inside their record's box (True), as separate graphs (False), or inline when the
    whole picture stays near ``max_nodes`` boxes (None)."""
    return _graph(tape, None, bodies, max_nodes)


def _report_rows(rows: Any, path: tuple, out: dict) -> None:
    for row in rows:
        out[(path, row.index)] = row
        if row.body:
            by_branch: dict[int, list] = {}
            for r in row.body:
                if r.depth == row.depth + 1:
                    by_branch.setdefault(r.branch or 0, []).append(r)
            for b, rs in by_branch.items():
                _report_rows(rs, path + (row.index, b), out)


def report_graph(
    report: Any, *, bodies: bool | None = None, max_nodes: int = MAX_NODES
) -> TapeGraph:
    """``memory_report(...).graph()``: the report's tape with the policy's decisions and
    the bytes it measured per record (device, host, compressed)."""
    if report.tape is None:
        raise ValueError("this MemoryReport holds no tape to draw")
    rows: dict = {}
    _report_rows(report.records, (), rows)
    return _graph(report.tape, rows, bodies, max_nodes)


register_printer("graph", tape_graph)
