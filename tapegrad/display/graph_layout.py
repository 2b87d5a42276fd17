"""A layered (Sugiyama-style) layout of a `Graph`, in pure Python: where each box, cluster
and edge goes, for `tapegrad.display.graph_svg` to draw without Graphviz.

Tapes are DAGs — mostly chains, with fan-in (a record reading its inputs) and fan-out (a
value read by several records) — and their clusters (checkpoint regions, loop bodies) nest.
Each cluster is laid out first, on its own (`tapegrad.display.graph_layers`: ranks, order,
coordinates, edges), and then stands in its parent as one box, which may span several
ranks. An edge that enters or leaves a cluster does so through a *port* on the cluster's
top or bottom border: inside, the port is one more point of the cluster's layout and the
edge's piece from it is routed like any other, so no edge is drawn through a box. An edge's
route is its pieces joined, from the innermost cluster it leaves to the innermost it enters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tapegrad.display.graph_layers import Box, Item, Level, Link, Placed, Point, far
from tapegrad.display.graph_model import Cluster, Graph, Node

__all__ = ["Box", "Layout", "layout"]

PAD = 8.0  # a cluster's border to its contents
MARGIN = 4.0  # around the whole drawing


@dataclass
class Layout:
    """The drawing's size; each node's and cluster's box; where each cluster's label
    starts (left, top); each edge's route (points from its source to its target, in the
    order of ``Graph.edges``)."""

    width: float
    height: float
    nodes: dict[str, Box]
    clusters: dict[str, Box]
    labels: dict[str, Point]
    edges: list[list[Point]]


def layout(
    g: Graph,
    node_size: Callable[[Node], tuple[float, float]],
    label_size: Callable[[str], tuple[float, float]],
) -> Layout:
    """Lay ``g`` out; ``node_size``: a box's (width, height) for its label;
    ``label_size``: a cluster label's. Where a cluster has ports, twice: the first layout
    tells where each port's edge comes from (or goes to) outside, and the second orders
    the cluster's ports the same way, so those edges do not cross on the border."""
    first = _Layouter(g, node_size, label_size, {})
    lay = first.run()
    if not first.ports:
        return lay
    hints = {}
    for i, keys in enumerate(first.routes):
        for key in keys:
            if len(key) == 3 and lay.edges[i]:  # (cluster, "in" | "out", edge)
                hints[key] = lay.edges[i][0 if key[1] == "in" else -1][0]
    return _Layouter(g, node_size, label_size, hints).run()


class _Layouter:
    def __init__(self, g: Graph, node_size, label_size, hints: dict[tuple, float]):
        self.g = g
        self.hints = hints  # a port's outside end's x, by its piece's key
        self.node_size = node_size
        self.label_size = label_size
        self.by_name = {n.name: n for n in g.nodes}
        self.cluster: dict[str, Cluster] = {c.name: c for c in g.walk_clusters()}
        owner = {n: c.name for c in self.cluster.values() for n in c.nodes}
        parent: dict[str, str | None] = {c.name: None for c in g.clusters}
        for c in self.cluster.values():
            parent.update({sub.name: c.name for sub in c.clusters})

        def chain(name: str | None) -> list[Item]:
            out: list[Item] = []
            while name is not None:
                out.append(("c", name))
                name = parent[name]
            return out[::-1]

        # Every item's path from the top (itself last); each level's items in drawing order.
        self.path: dict[Item, list[Item]] = {("c", c): chain(c) for c in parent}
        first: dict[Item, int] = {}
        for i, n in enumerate(g.nodes):
            self.path[("n", n.name)] = p = chain(owner.get(n.name)) + [("n", n.name)]
            for it in p:
                first.setdefault(it, i)
        self.children: dict[str | None, list[Item]] = {}
        for it, p in self.path.items():
            self.children.setdefault(p[-2][1] if len(p) > 1 else None, []).append(it)
        for items in self.children.values():
            items.sort(key=lambda it: first.get(it, len(g.nodes)))
        # Each edge at the level where its ends part, with a port on each cluster it
        # crosses on the way (to the child the edge goes on to), and its route's pieces.
        self.links: dict[str | None, list[tuple[int, Item, Item]]] = {}
        self.ports: dict[str, dict[Item, Item]] = {}
        self.routes: list[list[tuple]] = []
        for i, d in enumerate(g.edges):
            p = self.path[("n", d.src)]
            q = self.path[("c", d.to_cluster)] if d.to_cluster else self.path[("n", d.dst)]
            k = 0
            while k < min(len(p), len(q)) - 1 and p[k] == q[k]:
                k += 1
            if p[k] != q[k]:
                self.links.setdefault(p[k - 1][1] if k else None, []).append((i, p[k], q[k]))
            outs, ins = p[k:-1], q[k:-1]
            for j, it in enumerate(outs):
                self.ports.setdefault(it[1], {})[("out", str(i))] = p[k + j + 1]
            for j, it in enumerate(ins):
                self.ports.setdefault(it[1], {})[("in", str(i))] = q[k + j + 1]
            self.routes.append(
                [(c[1], "out", i) for c in outs[::-1]] + [("e", i)] + [(c[1], "in", i) for c in ins]
            )

    def run(self) -> Layout:
        top = self.level(None)
        top.shift(MARGIN, MARGIN)
        edges = []
        for keys in self.routes:
            pts: list[Point] = []
            for key in keys:
                for pt in top.pieces.get(key, []):
                    if not pts or far(pts[-1], pt):
                        pts.append(pt)
            edges.append(pts)
        w, h = top.w + 2 * MARGIN, top.h + 2 * MARGIN
        return Layout(w, h, top.nodes, top.clusters, top.labels, edges)

    def level(self, cluster: str | None) -> Placed:
        """Lay out ``cluster``'s contents (the whole graph's for None), then its box."""
        items = list(self.children.get(cluster, []))
        subs: dict[str, Placed] = {}
        size: dict[Item, tuple[float, float]] = {}
        for it in items:
            if it[0] == "c":
                s = subs[it[1]] = self.level(it[1])
                size[it] = (s.w, s.h)
            else:
                size[it] = self.node_size(self.by_name[it[1]])

        def port_off(item: Item, port: Item) -> float:
            """Where ``port`` is on ``item``'s border, from its centre (0: not a cluster)."""
            if item[0] != "c" or port not in subs[item[1]].ports:
                return 0.0
            return subs[item[1]].ports[port] - size[item][0] / 2

        links = []
        for i, a, b in self.links.get(cluster, []):
            out_port, in_port = ("out", str(i)), ("in", str(i))
            links.append(Link(a, b, ("e", i), port_off(a, out_port), port_off(b, in_port)))
        if cluster is not None:
            ports = [
                ((cluster, p[0], int(p[1])), p, c) for p, c in self.ports.get(cluster, {}).items()
            ]
            for key, port, child in sorted(ports, key=lambda t: self.hints.get(t[0], 0.0)):
                size[port] = (0.0, 0.0)
                items.append(port)
                if port[0] == "in":
                    links.append(Link(port, child, key, 0.0, port_off(child, port)))
                else:
                    links.append(Link(child, port, key, port_off(child, port), 0.0))
        placed = Level(items, size, links).solve()
        for name, s in subs.items():
            at = placed.nodes.pop(name)
            s.shift(at.x, at.y)
            placed.nodes.update(s.nodes)
            placed.clusters.update(s.clusters)
            placed.labels.update(s.labels)
            placed.pieces.update(s.pieces)
        return placed if cluster is None else self._frame(cluster, placed)

    def _frame(self, cluster: str, placed: Placed) -> Placed:
        """``placed`` inside ``cluster``'s box: a label row on top, then the contents; a
        port's piece runs on to the border. The label goes where no port crosses it."""
        lw, lh = self.label_size(self.cluster[cluster].label)
        w = max(placed.w, lw) + 2 * PAD
        h = placed.h + lh + 3 * PAD
        dx, dy = (w - placed.w) / 2, lh + 2 * PAD
        placed.shift(dx, dy)
        crossing = []
        for port, x in list(placed.ports.items()):
            x += dx
            placed.ports[port] = x
            pts = placed.pieces.get((cluster, port[0], int(port[1])), [])
            if pts and port[0] == "in":
                pts.insert(0, (x, 0.0))
                crossing.append(x)
            elif pts:
                pts.append((x, h))
        at = PAD
        for x in sorted(crossing):
            if x - 4 < at + lw:
                at = max(at, x + 4)
        if at + lw > w - PAD:  # no room between the ports: widen the box to the right
            w = at + lw + PAD
        placed.labels[cluster] = (at, PAD)
        placed.w, placed.h = w, h
        placed.clusters[cluster] = Box(0.0, 0.0, w, h)
        return placed
