"""A tape graph's SVG read back, whichever engine drew it: Graphviz's ``dot`` and the
Python back end both write one ``<g class="node|edge|cluster">`` per element, titled by
the node's name, ``src->dst`` or the cluster's name. Boxes are read from the element's
``rect``, ``path`` or ``polygon``; text lines are the ``<text>`` elements of one baseline."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

NS = "{http://www.w3.org/2000/svg}"


@dataclass
class Shape:
    box: tuple[float, float, float, float]  # x0, y0, x1, y1
    fill: str | None
    stroke: str | None
    width: float
    dashed: bool
    lines: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@dataclass
class Drawing:
    nodes: dict[str, Shape]
    edges: dict[tuple[str, str], Shape]
    clusters: dict[str, Shape]
    size: tuple[float, float]


def _box(el: ET.Element) -> tuple[float, float, float, float]:
    if el.tag == NS + "rect":
        x, y = float(el.get("x", 0)), float(el.get("y", 0))
        return x, y, x + float(el.get("width", 0)), y + float(el.get("height", 0))
    nums = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", el.get("d") or el.get("points", ""))]
    xs, ys = nums[0::2], nums[1::2]
    return min(xs), min(ys), max(xs), max(ys)


def _shape(g: ET.Element) -> Shape:
    el = next(c for c in g if c.tag in (NS + "rect", NS + "path", NS + "polygon"))
    lines: dict[float, str] = {}
    for t in g.iter(NS + "text"):
        y = round(float(t.get("y", 0)), 1)
        lines[y] = lines.get(y, "") + "".join(t.itertext())
    return Shape(
        _box(el),
        el.get("fill"),
        el.get("stroke"),
        float(el.get("stroke-width", 1)),
        bool(el.get("stroke-dasharray")),
        [lines[y] for y in sorted(lines)],
    )


def read(svg: str) -> Drawing:
    root = ET.fromstring(svg)
    nodes, edges, clusters = {}, {}, {}
    for g in root.iter(NS + "g"):
        kind = g.get("class")
        title = g.find(NS + "title")
        if kind not in ("node", "edge", "cluster") or title is None:
            continue
        name = title.text or ""
        if kind == "node":
            nodes[name] = _shape(g)
        elif kind == "edge":
            src, dst = name.split("->")
            edges[(src, dst)] = _shape(g)
        else:
            clusters[name] = _shape(g)
    vb = [float(v) for v in root.get("viewBox", "0 0 0 0").split()]
    return Drawing(nodes, edges, clusters, (vb[2], vb[3]))


def overlap(a, b, tol: float = 0.5) -> bool:
    return a[0] < b[2] - tol and b[0] < a[2] - tol and a[1] < b[3] - tol and b[1] < a[3] - tol


def inside(a, b, tol: float = 0.5) -> bool:
    """Box ``a`` within box ``b``."""
    return a[0] >= b[0] - tol and a[1] >= b[1] - tol and a[2] <= b[2] + tol and a[3] <= b[3] + tol
