"""What a tape graph draws, as data: boxes with styled label lines, edges, clusters.

`tapegrad.display.graph` describes a tape once, as a `Graph`; each back end renders that
one description: `to_dot` writes it as Graphviz source (for Graphviz's ``dot``, when it
is installed) and `tapegrad.display.graph_svg` lays it out and writes SVG in Python.
Neither back end decides what is drawn, only where.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from tapegrad.display.html import e

__all__ = ["Cluster", "Edge", "Graph", "Node", "Span", "dot_svg", "to_dot"]

BLACK = "#000000"


@dataclass(frozen=True, slots=True)
class Span:
    """A run of label text in one style (``size`` in points)."""

    text: str
    bold: bool = False
    size: float = 10.0
    color: str | None = None


Line = tuple[Span, ...]


@dataclass(frozen=True, slots=True)
class Node:
    """A box: its label lines, fill, border colour, dashed or not, border width."""

    name: str
    lines: tuple[Line, ...]
    fill: str | None = None
    border: str | None = None
    dashed: bool = False
    width: float = 1.0


@dataclass(frozen=True, slots=True)
class Edge:
    """``src -> dst``; ``to_cluster``: the edge ends at that cluster's border (Graphviz's
    ``lhead``), as the dotted link from a loop record to its body does."""

    src: str
    dst: str
    color: str | None = None
    width: float = 1.0
    dotted: bool = False
    arrow: bool = True
    to_cluster: str | None = None


@dataclass(frozen=True, slots=True)
class Cluster:
    """A box around nodes: ``nodes`` are its direct members (by name), ``clusters`` the
    clusters nested in it."""

    name: str
    label: str
    nodes: tuple[str, ...]
    clusters: tuple[Cluster, ...] = ()
    border: str = BLACK
    dashed: bool = False
    fill: str | None = None


@dataclass(frozen=True, slots=True)
class Graph:
    """Every node (in drawing order), every edge, and the outermost clusters."""

    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    clusters: tuple[Cluster, ...] = ()

    def walk_clusters(self):
        """Every cluster, outermost first."""
        todo = list(self.clusters)
        while todo:
            c = todo.pop(0)
            yield c
            todo.extend(c.clusters)


# ------------------------------------------------------------------ Graphviz


def _label(lines: tuple[Line, ...]) -> str:
    out = []
    for line in lines:
        runs = []
        for s in line:
            t = e(s.text)
            if s.bold:
                t = f"<b>{t}</b>"
            attrs = (f' point-size="{s.size:g}"' if s.size != 10 else "") + (
                f' color="{s.color}"' if s.color else ""
            )
            runs.append(f"<font{attrs}>{t}</font>" if attrs else t)
        out.append("".join(runs))
    return "<br/>".join(out)


def _node_dot(n: Node) -> str:
    style = "rounded" + (",filled" if n.fill else "") + (",dashed" if n.dashed else "")
    attrs = f' shape="box" style="{style}"'
    if n.fill:
        attrs += f' fillcolor="{n.fill}"'
    if n.border:
        attrs += f' color="{n.border}"'
    if n.width != 1:
        attrs += f' penwidth="{n.width:g}"'
    return f"  {n.name} [label=<{_label(n.lines)}>{attrs}];"


def _edge_dot(d: Edge) -> str:
    attrs = []
    if d.color:
        attrs.append(f'color="{d.color}"')
    if d.width != 1:
        attrs.append(f"penwidth={d.width:g}")
    if d.dotted:
        attrs.append("style=dotted")
    if not d.arrow:
        attrs.append("arrowhead=none")
    if d.to_cluster:
        attrs.append(f'lhead="{d.to_cluster}"')
    return f"  {d.src} -> {d.dst}" + (f" [{', '.join(attrs)}]" if attrs else "") + ";"


def _cluster_dot(c: Cluster, nodes: dict[str, Node], out: list[str]) -> None:
    style = "rounded" + (",filled" if c.fill else "") + (",dashed" if c.dashed else "")
    head = f'  subgraph {c.name} {{ style="{style}"; color="{c.border}"; '
    if c.fill:
        head += f'fillcolor="{c.fill}"; '
    out.append(head + f'label="{e(c.label)}"; fontsize=10;')
    out.extend(_node_dot(nodes[n]) for n in c.nodes)
    for sub in c.clusters:
        _cluster_dot(sub, nodes, out)
    out.append("  }")


def to_dot(g: Graph) -> str:
    """``g`` as Graphviz DOT source: each node declared in its innermost cluster."""
    nodes = {n.name: n for n in g.nodes}
    inside = {name for c in g.walk_clusters() for name in c.nodes}
    out = [
        "digraph tape {",
        '  graph [rankdir=TB, compound=true, nodesep=0.25, ranksep=0.3, fontname="Helvetica"];',
        '  node [fontname="Helvetica", fontsize=10, margin="0.08,0.04"];',
        '  edge [color="#9ca3af", arrowsize=0.6];',
    ]
    out.extend(_node_dot(n) for n in g.nodes if n.name not in inside)
    for c in g.clusters:
        _cluster_dot(c, nodes, out)
    out.extend(_edge_dot(d) for d in g.edges)
    return "\n".join(out) + "\n}\n"


def dot_svg(source: str) -> str:
    """SVG text of DOT ``source``, laid out by Graphviz's ``dot``."""
    exe = shutil.which("dot")
    if exe is None:
        raise RuntimeError(
            "engine='dot' needs Graphviz's `dot` program, which is not on PATH: install "
            "Graphviz (apt-get install graphviz, brew install graphviz or conda install "
            "graphviz), or draw without it: graph(engine='python')."
        )
    r = subprocess.run([exe, "-Tsvg"], input=source, capture_output=True, text=True, timeout=120)
    if r.returncode:
        raise RuntimeError(f"Graphviz's dot failed: {r.stderr.strip()}")
    svg = r.stdout
    return svg[svg.index("<svg") :] if "<svg" in svg else svg
