"""Sugiyama's four steps over one level of a layered drawing (`graph_layout` runs them on
each cluster's contents, a nested cluster standing in as one tall box):

1. **ranks**: longest path from the sources (cycles, which tapes do not have, are broken by
   reversing back edges), then each box moved within the ranks its edges allow towards the
   side with more edges — network simplex's objective (short edges) by coordinate descent,
   so an input sits just above the record that reads it, not at the top of the drawing;
2. **order** within ranks: barycentre sweeps down and up, an edge longer than one rank
   split into a dummy point per rank it passes and a box taller than a rank into a filler
   per rank it spans; the order with the fewest crossings is kept;
3. **x**: each point pulled to the weighted median of its neighbours, every rank solved
   exactly under its order and spacing (least squares under order constraints: pool-
   adjacent-violators), in sweeps down and up; long edges pull hardest, so they run
   straight, an input's edge weakest, so the chain it feeds stays straight; a filler sits
   exactly under its box, which keeps a tall box's column free;
4. **edges**: through their dummy points, vertical inside a rank's band (where a dummy's
   width is reserved) and curved between bands, so they never cross a box.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

__all__ = ["Box", "Level", "Link", "Placed", "far"]

NODESEP = 14.0  # between two boxes of one rank
EDGESEP = 7.0  # between an edge's dummy point and its neighbours
RANKSEP = 22.0  # between two ranks' bands
SWEEPS = 8  # ordering sweeps (down and up), and coordinate sweeps
SLOPE, MAX_BEND = 0.08, 60.0  # a gap's growth per unit its edges go sideways, at most

Point = tuple[float, float]
Item = tuple[str, str]  # ("n", node) | ("c", cluster) | ("in"/"out", edge index): a port


@dataclass(frozen=True, slots=True)
class Box:
    x: float  # left
    y: float  # top
    w: float
    h: float


@dataclass
class Placed:
    """A level laid out: boxes and edge pieces in its own coordinates; ``ports``: the x
    of each port on its border, by item."""

    w: float
    h: float
    nodes: dict[str, Box] = field(default_factory=dict)
    clusters: dict[str, Box] = field(default_factory=dict)
    labels: dict[str, Point] = field(default_factory=dict)
    pieces: dict[tuple, list[Point]] = field(default_factory=dict)
    ports: dict[Item, float] = field(default_factory=dict)

    def shift(self, dx: float, dy: float) -> None:
        for d in (self.nodes, self.clusters):
            for k, b in d.items():
                d[k] = Box(b.x + dx, b.y + dy, b.w, b.h)
        for name, (x, y) in self.labels.items():
            self.labels[name] = (x + dx, y + dy)
        for key, pts in self.pieces.items():
            self.pieces[key] = [(x + dx, y + dy) for x, y in pts]


@dataclass
class Link:
    """An edge between two items of one level; ``off_a``/``off_b``: where it meets each
    end, from the end's centre (a cluster's port, or a spread along a box's border)."""

    a: Item
    b: Item
    key: tuple
    off_a: float = 0.0
    off_b: float = 0.0
    reversed: bool = False


def far(p: Point, q: Point) -> bool:
    return abs(p[0] - q[0]) > 0.01 or abs(p[1] - q[1]) > 0.01


class Level:
    """Sugiyama's steps over one level's items (boxes, clusters as boxes, ports)."""

    def __init__(self, items: list[Item], size: dict[Item, tuple[float, float]], links):
        self.items = items
        self.size = size
        self.links: list[Link] = links
        self.idx = {it: k for k, it in enumerate(items)}

    def solve(self) -> Placed:
        if not self.items:
            return Placed(0.0, 0.0)
        self.break_cycles()
        self.assign_ranks()
        self.make_layers()
        self.order()
        self.spread_ports()
        self.place_x()
        return self.emit()

    # ---------------------------------------------------------------- ranks

    def break_cycles(self) -> None:
        succ: dict[int, list[Link]] = {k: [] for k in range(len(self.items))}
        for ln in self.links:
            succ[self.idx[ln.a]].append(ln)
        state = [0] * len(self.items)  # 0 new, 1 on the stack, 2 done
        for root in range(len(self.items)):
            if state[root]:
                continue
            stack = [(root, iter(succ[root]))]
            state[root] = 1
            while stack:
                v, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    state[v] = 2
                    stack.pop()
                    continue
                w = self.idx[nxt.b]
                if state[w] == 1:
                    nxt.reversed = True
                elif state[w] == 0:
                    state[w] = 1
                    stack.append((w, iter(succ[w])))
        for ln in self.links:
            if ln.reversed:
                ln.a, ln.b, ln.off_a, ln.off_b = ln.b, ln.a, ln.off_b, ln.off_a

    def assign_ranks(self) -> None:
        n = len(self.items)
        heights = [self.size[it][1] for it in self.items if it[0] == "n"]
        unit = (statistics.median(heights) if heights else 30.0) + RANKSEP
        self.span = [
            max(1, round((self.size[it][1] + RANKSEP) / unit)) if it[0] == "c" else 1
            for it in self.items
        ]
        preds: list[list[int]] = [[] for _ in range(n)]
        succs: list[list[int]] = [[] for _ in range(n)]
        for ln in self.links:
            a, b = self.idx[ln.a], self.idx[ln.b]
            preds[b].append(a)
            succs[a].append(b)
        kind = [it[0] for it in self.items]
        base = 1 if "in" in kind else 0
        indeg = [len(p) for p in preds]
        topo = [v for v in range(n) if not indeg[v]]
        for v in topo:
            for w in succs[v]:
                indeg[w] -= 1
                if not indeg[w]:
                    topo.append(w)
        rank = [0] * n
        for v in topo:
            if kind[v] == "in":
                continue
            rank[v] = max([rank[u] + self.span[u] for u in preds[v]], default=base)
        movable = [v for v in topo if kind[v] not in ("in", "out")]
        for _ in range(8):  # each box towards the side with more edges, within its range
            changed = False
            for v in movable[::-1] + movable:
                lo = max([rank[u] + self.span[u] for u in preds[v]], default=base)
                fixed = [rank[w] for w in succs[v] if kind[w] != "out"]
                hi = min(fixed) - self.span[v] if fixed else None
                up, down = len(preds[v]), len(fixed)
                if hi is None or up > down:
                    r = lo
                elif down > up:
                    r = hi
                else:
                    r = min(max(rank[v], lo), hi)
                if r != rank[v]:
                    rank[v], changed = r, True
            if not changed:
                break
        end = max((rank[v] + self.span[v] for v in movable), default=base)
        for v in range(n):
            if kind[v] == "out":
                rank[v] = end
        self.rank = rank
        self.nranks = max(rank[v] + self.span[v] for v in range(n))

    # ---------------------------------------------------------------- layers

    def make_layers(self) -> None:
        """Layer points: the items, a filler per further rank a tall item spans, a dummy per
        rank an edge passes; segments join points of consecutive ranks."""
        n = len(self.items)
        self.lrank = list(self.rank)
        self.width = [self.size[it][0] for it in self.items]
        self.kind = ["port" if it[0] in ("in", "out") else "item" for it in self.items]
        self.owner = list(range(n))
        self.up: list[list[tuple[int, float, float, float]]] = [[] for _ in range(n)]
        self.down: list[list[tuple[int, float, float, float]]] = [[] for _ in range(n)]
        bottom = list(range(n))
        for v in range(n):
            for k in range(1, self.span[v]):
                f = self._point(self.rank[v] + k, self.width[v], "filler", v)
                self._segment(bottom[v], f, 0.0, 0.0, 1e6)
                bottom[v] = f
        self.chains: list[list[int]] = []
        fed = {ln.b for ln in self.links}
        for ln in self.links:
            a, b = self.idx[ln.a], self.idx[ln.b]
            # an input's or a constant's edge pulls weakly: the chain it feeds stays straight
            w = 0.25 if self.kind[a] != "port" and ln.a not in fed else 1.0
            start = bottom[a]
            chain = [start]
            for r in range(self.lrank[start] + 1, self.rank[b]):
                chain.append(self._point(r, 0.0, "dummy", a))
            chain.append(b)
            for k in range(len(chain) - 1):
                u, v = chain[k], chain[k + 1]
                dummies = (self.kind[u] == "dummy") + (self.kind[v] == "dummy")
                weight = (w, 2.0, 8.0)[dummies]
                off_u = ln.off_a if k == 0 else 0.0
                off_v = ln.off_b if k == len(chain) - 2 else 0.0
                self._segment(u, v, off_u, off_v, weight)
            self.chains.append(chain)

    def _point(self, r: int, width: float, kind: str, owner: int) -> int:
        self.lrank.append(r)
        self.width.append(width)
        self.kind.append(kind)
        self.owner.append(owner)
        self.up.append([])
        self.down.append([])
        return len(self.lrank) - 1

    def _segment(self, u: int, v: int, off_u: float, off_v: float, weight: float) -> None:
        self.down[u].append((v, off_u, off_v, weight))
        self.up[v].append((u, off_u, off_v, weight))

    # ---------------------------------------------------------------- order

    def order(self) -> None:
        ranks: list[list[int]] = [[] for _ in range(self.nranks)]
        for p in range(len(self.lrank)):  # items in drawing order, then fillers, dummies
            ranks[self.lrank[p]].append(p)
        self.ranks = ranks
        self.pos = [0] * len(self.lrank)
        self._index()
        best, best_cross = [list(r) for r in ranks], self.crossings()
        for _ in range(SWEEPS):
            for down in (True, False):
                seq = range(1, len(ranks)) if down else range(len(ranks) - 2, -1, -1)
                for r in seq:
                    nb = self.up if down else self.down

                    def bary(p: int, nb=nb) -> float:
                        got = nb[p]
                        if not got:
                            return self.pos[p]
                        return sum(self.pos[q[0]] for q in got) / len(got)

                    ranks[r].sort(key=lambda p: (bary(p), self.pos[p]))
                    for k, p in enumerate(ranks[r]):
                        self.pos[p] = k
                c = self.crossings()
                if c < best_cross:
                    best, best_cross = [list(r) for r in ranks], c
        self.ranks = best
        self._index()

    def _index(self) -> None:
        for r in self.ranks:
            for k, p in enumerate(r):
                self.pos[p] = k

    def crossings(self) -> int:
        total = 0
        for r in self.ranks:
            segs = sorted((self.pos[u], self.pos[v]) for u in r for v, *_ in self.down[u])
            seen: list[int] = []  # lower ends so far, sorted: those above v cross it
            for _, v in segs:
                lo, hi = 0, len(seen)
                while lo < hi:
                    mid = (lo + hi) // 2
                    if seen[mid] <= v:
                        lo = mid + 1
                    else:
                        hi = mid
                total += len(seen) - lo
                seen.insert(lo, v)
        return total

    def spread_ports(self) -> None:
        """A box's edges meet its border spread out, in the order of their other ends."""
        for p in range(len(self.lrank)):
            if self.kind[p] != "item" or self.items[p][0] != "n":
                continue
            for nbs, above in ((self.down, False), (self.up, True)):
                lst = nbs[p]
                if len(lst) < 2:
                    continue
                step = min(16.0, self.width[p] * 0.6 / (len(lst) - 1))
                order = sorted(range(len(lst)), key=lambda k: self.pos[lst[k][0]])
                for rank_k, k in enumerate(order):
                    q, *rest = lst[k]
                    off = (rank_k - (len(lst) - 1) / 2) * step
                    self._set_off(p, q, off, above)

    def _set_off(self, p: int, q: int, off: float, above: bool) -> None:
        """The offset at ``p``'s end of its segment with ``q`` (``above``: q is above p)."""
        if above:
            self.up[p] = [(u, ou, off if u == q else ov, w) for u, ou, ov, w in self.up[p]]
            self.down[q] = [(v, ou, off if v == p else ov, w) for v, ou, ov, w in self.down[q]]
        else:
            self.down[p] = [(v, off if v == q else ou, ov, w) for v, ou, ov, w in self.down[p]]
            self.up[q] = [(u, off if u == p else ou, ov, w) for u, ou, ov, w in self.up[q]]

    # ---------------------------------------------------------------- x

    def _gap(self, a: int, b: int) -> float:
        thin = (self.kind[a] in ("dummy", "port")) + (self.kind[b] in ("dummy", "port"))
        return (self.width[a] + self.width[b]) / 2 + (NODESEP, EDGESEP, EDGESEP)[thin]

    def place_x(self) -> None:
        x = [0.0] * len(self.lrank)
        for r in self.ranks:
            at = 0.0
            for k, p in enumerate(r):
                if k:
                    at += self._gap(r[k - 1], p)
                x[p] = at
        self.x = x
        for _ in range(SWEEPS):
            self._sweep(True, "up")
            self._sweep(False, "down")
        for _ in range(2):
            self._sweep(True, "both")
            self._sweep(False, "both")
        self._sweep(True, "up")

    def _sweep(self, downwards: bool, use: str) -> None:
        seq = self.ranks if downwards else self.ranks[::-1]
        for r in seq:
            want, weight = [], []
            for p in r:
                if self.kind[p] == "filler":  # a tall box's column: exactly under it
                    want.append(self.x[self.up[p][0][0]])
                    weight.append(1e6)
                    continue
                cands: list[tuple[float, float]] = []
                if use in ("up", "both"):
                    cands += [(self.x[u] + ou - ov, w) for u, ou, ov, w in self.up[p]]
                if use in ("down", "both"):
                    cands += [(self.x[v] + ov - ou, w) for v, ou, ov, w in self.down[p]]
                if not cands:
                    want.append(self.x[p])
                    weight.append(0.05)
                else:
                    want.append(_weighted_median(cands))
                    weight.append(sum(w for _, w in cands))
            gaps = [self._gap(r[k - 1], r[k]) for k in range(1, len(r))]
            for p, v in zip(r, _isotonic(want, weight, gaps)):
                self.x[p] = v

    # ---------------------------------------------------------------- output

    def emit(self) -> Placed:
        left = min(self.x[p] - self.width[p] / 2 for p in range(len(self.lrank)))
        x = [v - left for v in self.x]
        width = max(x[p] + self.width[p] / 2 for p in range(len(self.lrank)))
        # A gap grows with how far its edges go sideways, so a long one curves, not lies flat.
        self.gaps = [RANKSEP] * self.nranks
        for u in range(len(self.lrank)):
            for v, ou, ov, _ in self.down[u]:
                r = self.lrank[u]
                dx = abs(x[v] + ov - x[u] - ou)
                self.gaps[r] = max(self.gaps[r], RANKSEP + min(SLOPE * dx, MAX_BEND))
        height = [0.0] * self.nranks
        for v, it in enumerate(self.items):
            if self.span[v] == 1:
                height[self.rank[v]] = max(height[self.rank[v]], self.size[it][1])
        tops = self._tops(height)
        for v in sorted(range(len(self.items)), key=lambda v: self.rank[v]):
            if self.span[v] > 1:
                last = self.rank[v] + self.span[v] - 1
                short = tops[self.rank[v]] + self.size[self.items[v]][1] - tops[last] - height[last]
                if short > 0:
                    height[last] += short
                    tops = self._tops(height)
        total = tops[-1] + height[-1] if self.nranks else 0.0
        sub = Placed(width, total)
        top = [0.0] * len(self.items)
        for v, it in enumerate(self.items):
            w, h = self.size[it]
            r = self.rank[v]
            top[v] = tops[r] + ((height[r] - h) / 2 if self.span[v] == 1 else 0.0)
            if it[0] in ("n", "c"):
                sub.nodes[it[1]] = Box(x[v] - w / 2, top[v], w, h)
            else:
                sub.ports[(it[0], it[1])] = x[v]
        for ln, chain in zip(self.links, self.chains):
            a, b = chain[0], chain[-1]
            ia = self.owner[a]
            pts: list[Point] = []
            xa = x[a] + self._off(a, chain[1], True)
            pts.append((xa, top[ia] + self.size[self.items[ia]][1]))
            pts.append((xa, tops[self.lrank[a]] + height[self.lrank[a]]))
            for d in chain[1:-1]:
                pts.append((x[d], tops[self.lrank[d]]))
                pts.append((x[d], tops[self.lrank[d]] + height[self.lrank[d]]))
            xb = x[b] + self._off(b, chain[-2], False)
            pts.append((xb, tops[self.rank[b]]))
            pts.append((xb, top[b]))
            clean = [pts[0]]
            for pt in pts[1:]:
                if far(clean[-1], pt):
                    clean.append(pt)
            sub.pieces[ln.key] = clean[::-1] if ln.reversed else clean
        return sub

    def _off(self, p: int, q: int, below: bool) -> float:
        if below:
            return next(ou for v, ou, _, _ in self.down[p] if v == q)
        return next(ov for u, _, ov, _ in self.up[p] if u == q)

    def _tops(self, height: list[float]) -> list[float]:
        tops, at = [], 0.0
        for h, gap in zip(height, self.gaps):
            tops.append(at)
            at += h + gap
        return tops


def _weighted_median(cands: list[tuple[float, float]]) -> float:
    cands = sorted(cands)
    half = sum(w for _, w in cands) / 2
    acc = 0.0
    for k, (v, w) in enumerate(cands):
        acc += w
        if abs(acc - half) < 1e-9 and k + 1 < len(cands):  # an even split: the middle
            return (v + cands[k + 1][0]) / 2
        if acc > half:
            return v
    return cands[-1][0]


def _isotonic(want: list[float], weight: list[float], gaps: list[float]) -> list[float]:
    """Positions closest to ``want`` (weighted least squares) keeping each one at least
    ``gaps[k-1]`` right of the one before: pool-adjacent-violators on the shifted values."""
    shift = [0.0]
    for g in gaps:
        shift.append(shift[-1] + g)
    blocks: list[list[float]] = []  # [sum w, sum w*y, count]
    for d, w, s in zip(want, weight, shift):
        blocks.append([w, w * (d - s), 1])
        while len(blocks) > 1 and (
            blocks[-2][1] * blocks[-1][0] > blocks[-1][1] * blocks[-2][0] + 1e-12
        ):
            w2, wy2, n2 = blocks.pop()
            blocks[-1][0] += w2
            blocks[-1][1] += wy2
            blocks[-1][2] += n2
    out: list[float] = []
    for w, wy, n in blocks:
        y = wy / w
        out.extend([y] * int(n))
    return [y + s for y, s in zip(out, shift)]
