"""The Python back end of ``graph()``: a `Graph` laid out by
`tapegrad.display.graph_layout` and written as SVG, with nothing installed but tapegrad.

Text is measured with Helvetica's own character widths (Arial and Liberation Sans, what a
browser substitutes, share them), so a box fits its label without a font on the machine.
The SVG is shaped as Graphviz's is — one ``<g class="node">``, ``"edge"`` or ``"cluster"``
per element, each with its ``<title>`` (the node's name, ``src->dst``) — so both back ends'
pictures read, style and test alike.
"""

from __future__ import annotations

import html

from tapegrad.display.graph_layout import Box, layout
from tapegrad.display.graph_model import BLACK, Graph, Line, Node

__all__ = ["python_svg", "text_width"]

FONT = "Helvetica,Arial,sans-serif"
EDGE = "#9ca3af"
PAD_X, PAD_Y = 7.0, 4.0  # a box's border to its text
LABEL_SIZE = 10.0  # cluster labels

# Helvetica's advance widths (AFM, thousandths of an em) for ' ' (32) through '~' (126).
_REGULAR = (
    "278 278 355 556 556 889 667 191 333 333 389 584 278 333 278 278 556 556 556 556 556 "
    "556 556 556 556 556 278 278 584 584 584 556 1015 667 667 722 722 667 611 778 722 278 "
    "500 667 556 833 722 778 667 778 722 667 611 722 667 944 667 667 611 278 278 278 469 "
    "556 333 556 556 500 556 556 278 556 556 222 222 500 222 833 556 556 556 556 333 500 "
    "278 556 500 722 500 500 500 334 260 334 584"
)
_BOLD = (
    "278 333 474 556 556 889 722 238 333 333 389 584 278 333 278 278 556 556 556 556 556 "
    "556 556 556 556 556 333 333 584 584 584 611 975 722 722 722 722 667 611 778 722 278 "
    "556 722 611 833 722 778 667 778 722 667 611 722 667 944 667 667 611 333 278 333 584 "
    "556 333 556 611 556 611 556 333 611 611 278 278 556 278 889 611 611 611 611 389 556 "
    "333 611 556 778 556 556 500 389 280 389 584"
)
_WIDTHS = {
    False: dict(zip(map(chr, range(32, 127)), map(int, _REGULAR.split()))),
    True: dict(zip(map(chr, range(32, 127)), map(int, _BOLD.split()))),
}
_OTHER = {"·": 278, "×": 584, "…": 1000, "━": 1000, "→": 1000, "≤": 549}


def text_width(text: str, size: float = 10.0, bold: bool = False) -> float:
    table = _WIDTHS[bold]
    return size / 1000 * sum(table.get(ch) or _OTHER.get(ch, 600) for ch in text)


def _line_height(line: Line) -> float:
    return max((s.size for s in line), default=10.0) * 1.2 + 1


def node_size(n: Node) -> tuple[float, float]:
    w = max((sum(text_width(s.text, s.size, s.bold) for s in ln) for ln in n.lines), default=0.0)
    h = sum(_line_height(ln) for ln in n.lines)
    return w + 2 * PAD_X, max(h + 2 * PAD_Y, 20.0)


def label_size(text: str) -> tuple[float, float]:
    return text_width(text, LABEL_SIZE), LABEL_SIZE * 1.2


def python_svg(g: Graph) -> str:
    """SVG text of ``g``, laid out in Python."""
    lay = layout(g, node_size, label_size)
    out = [
        f'<svg width="{_n(lay.width)}pt" height="{_n(lay.height)}pt" '
        f'viewBox="0 0 {_n(lay.width)} {_n(lay.height)}" xmlns="http://www.w3.org/2000/svg">',
        f'<g class="graph" font-family="{FONT}" font-size="10">',
        '<rect width="100%" height="100%" fill="white"/>',
    ]
    for c in g.walk_clusters():
        b = lay.clusters[c.name]
        out.append(f'<g class="cluster"><title>{_x(c.name)}</title>')
        out.append(_rect(b, 6, c.fill or "none", c.border, 1.0, "5,2" if c.dashed else None))
        x, y = lay.labels[c.name]
        y += LABEL_SIZE * 0.86
        out.append(f'<text x="{_n(x)}" y="{_n(y)}">{_x(c.label)}</text></g>')
    for d, pts in zip(g.edges, lay.edges):
        out.append(_edge(d, pts))
    for n in g.nodes:
        out.append(_node(n, lay.nodes[n.name]))
    out.append("</g></svg>")
    return "\n".join(out) + "\n"


def _node(n: Node, b: Box) -> str:
    parts = [f'<g class="node"><title>{_x(n.name)}</title>']
    parts.append(
        _rect(b, 4, n.fill or "none", n.border or BLACK, n.width, "5,2" if n.dashed else None)
    )
    top = b.y + (b.h - sum(_line_height(ln) for ln in n.lines)) / 2
    cx = _n(b.x + b.w / 2)
    for ln in n.lines:
        lh = _line_height(ln)
        size = max(s.size for s in ln)
        base = top + (lh - 1 - size * 0.925) / 2 + size * 0.718 + 0.5
        runs = []
        for s in ln:
            attrs = (' font-weight="bold"' if s.bold else "") + (
                f' font-size="{s.size:g}"' if s.size != 10 else ""
            )
            attrs += f' fill="{s.color}"' if s.color else ""
            runs.append(f"<tspan{attrs}>{_x(s.text)}</tspan>" if attrs else _x(s.text))
        parts.append(
            f'<text x="{cx}" y="{_n(base)}" text-anchor="middle" xml:space="preserve">'
            + "".join(runs)
            + "</text>"
        )
        top += lh
    return "".join(parts) + "</g>"


def _edge(d, pts: list[tuple[float, float]]) -> str:
    color = d.color or EDGE
    stroke = f' stroke="{color}"' + (f' stroke-width="{d.width:g}"' if d.width != 1 else "")
    dash = ' stroke-dasharray="1,3"' if d.dotted else ""
    head = ""
    if d.arrow and len(pts) >= 2:
        (_, y0), (x1, y1) = pts[-2], pts[-1]
        sign = 1.0 if y1 >= y0 else -1.0
        length, half = (6.0, 2.4) if d.width <= 1.5 else (7.5, 3.2)
        length = min(length, abs(y1 - y0) * 0.9) if y1 != y0 else length
        base = y1 - sign * length
        pts = pts[:-1] + [(x1, base)]
        head = (
            f'<polygon fill="{color}"{stroke} points="{_n(x1)},{_n(y1)} {_n(x1 - half)},'
            f'{_n(base)} {_n(x1 + half)},{_n(base)}"/>'
        )
    path = [f"M{_n(pts[0][0])},{_n(pts[0][1])}"] if pts else []
    for (px, py), (qx, qy) in zip(pts, pts[1:]):
        if abs(px - qx) < 0.05:
            path.append(f"V{_n(qy)}")
        else:
            m = (qy - py) / 2
            path.append(f"C{_n(px)},{_n(py + m)} {_n(qx)},{_n(qy - m)} {_n(qx)},{_n(qy)}")
    title = f"{d.src}->{d.dst}"
    return (
        f'<g class="edge"><title>{_x(title)}</title>'
        f'<path fill="none"{stroke}{dash} d="{"".join(path)}"/>{head}</g>'
    )


def _rect(b: Box, r: float, fill: str, stroke: str, width: float, dash: str | None) -> str:
    extra = (f' stroke-width="{width:g}"' if width != 1 else "") + (
        f' stroke-dasharray="{dash}"' if dash else ""
    )
    return (
        f'<rect x="{_n(b.x)}" y="{_n(b.y)}" width="{_n(b.w)}" height="{_n(b.h)}" rx="{r:g}" '
        f'fill="{fill}" stroke="{stroke}"{extra}/>'
    )


def _n(v: float) -> str:
    s = f"{v:.1f}"
    return s[:-2] if s.endswith(".0") else s


def _x(s: str) -> str:
    return html.escape(s, quote=False)
