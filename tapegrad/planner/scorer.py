"""The save/recompute search's scorer: decision lists scored by the executor's own
schedule (`problem.estimate`, over the tape's `TapeIndex`), every score remembered with
the best fitting plan (least flops, then least peak) and the smallest peak seen; the
work limit the searches share (`WORK`); the hand-written policies' record classes
(`CLASSES`: which records a policy such as ``dots_saveable`` saves); and the tape's
per-record activation bytes that the candidate families, the stages and the joint
search read (`_activation_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import islice

from tapegrad.core.tape import Record, Tape, Var
from tapegrad.planner.index import TapeIndex
from tapegrad.planner.joint import Timeline
from tapegrad.rules.cheap import CHEAP

__all__ = ["Scorer", "CLASSES", "WORK", "MIN_SCORES"]


def _is_dot(rec: Record) -> bool:
    return rec.primitive in ("dot_general", "conv_general_dilated")


def _is_dot_no_batch(rec: Record) -> bool:
    if rec.primitive == "conv_general_dilated":
        return True
    if rec.primitive != "dot_general":
        return False
    (_, _), (lb, _) = rec.params["dimension_numbers"]
    return not lb


# Which records a class plan saves (jax.checkpoint_policies names, where one exists).
CLASSES: dict[str, Callable[[Record], bool]] = {
    "dots_saveable": _is_dot,
    "dots_with_no_batch_dims_saveable": _is_dot_no_batch,
    "save_all_but_cheap": lambda r: r.primitive not in CHEAP,
    "nothing_saveable": lambda r: False,
}


# The search's work limit: plans scored × records per plan. Scoring a plan of a
# 1,000-record tape takes ~2-3 ms of CPU, so ~200 plans keep planning under a second
# there (and at least `MIN_SCORES` plans on any tape); small tapes search in full.
WORK = 200_000
MIN_SCORES = 100


class Scorer:
    """Scores decision lists with `estimate`, remembering every score, the best
    fitting plan (least flops, then least peak) and the smallest peak seen."""

    def __init__(
        self,
        tape: Tape,
        fixed: Sequence[str | None],
        budget: int,
        limit: int | None = None,
        seg_flops: float = 0.0,
    ):
        self.tape = tape
        self.fixed = list(fixed)
        # the binding decisions (usually none): `with_fixed` runs on every neighbour a
        # descent tries, thousands per planning call
        self._bound = [(i, f) for i, f in enumerate(self.fixed) if f is not None]
        self.budget = budget
        self.n = len(tape.records)
        self.best: tuple[float, int, tuple[str, ...], str] | None = None
        self.by_family: dict[str, tuple[float, int, tuple[str, ...], str]] = {}
        self.floor: int | None = None
        self.floor_plan: tuple[str, ...] | None = None  # a plan with that peak
        self._seen: dict[tuple[str, ...], tuple[int, float]] = {}
        # Tape-only facts, computed once; scores every plan (`index`).
        self.index = TapeIndex(tape, seg_flops)
        self._memo: dict = self.index._seg_memo  # segment peaks and flops, shared
        self.scores = 0  # plans simulated (each O(records)): the search's work
        # How many plans the search may simulate: every family on small tapes; on big
        # ones a budget of record-simulations (`WORK`), spent in the order of
        # `save_recompute._save_recompute`, each family stopping when its share is spent.
        self.limit = limit if limit is not None else max(MIN_SCORES, WORK // max(self.n, 1))
        self._act: list[int] | None = None

    def activation(self) -> list[int]:
        """`_activation_bytes`' per-record bytes, computed once (the joint search asks
        for them at every descent)."""
        if self._act is None:
            self._act = _activation_bytes(self)[0]
        return self._act

    def left(self) -> int:
        """Simulations left of `limit`."""
        return self.limit - self.scores

    def with_fixed(self, dec: Iterable[str]) -> tuple[str, ...]:
        d = list(islice(dec, len(self.fixed)))
        for i, f in self._bound:
            if i < len(d):
                d[i] = f
        return tuple(d)

    def planned(self, dec: Sequence[str]) -> Tape:
        # The schedule (segments, `estimate`) reads decisions from ``dec`` and the
        # segments, never from Record.decision: no need to copy every record.
        return self.index.planned(dec)

    def timeline(self, dec: Sequence[str], prefetch: int = 0) -> Timeline:
        """`joint.timeline` of the tape planned with ``dec`` (binding decisions
        applied by the caller), over the index: the joint search's hot path."""
        return self.index.timeline(self.index.segments(dec), prefetch)

    def simulate(self, dec: Sequence[str], trace: dict | None = None):
        """`problem.simulate` of the tape planned with ``dec`` (binding decisions applied
        by the caller)."""
        self.scores += 1
        return self.index.simulate(dec, trace)

    def score(self, dec: Iterable[str], family: str = "") -> tuple[int, float]:
        """(peak, flops) of ``dec`` (binding decisions applied); updates best and floor."""
        d = self.with_fixed(dec)
        if d not in self._seen:
            self._seen[d] = self.simulate(d)[:2]
            peak, flops = self._seen[d]
            if self.floor is None or peak < self.floor:
                self.floor, self.floor_plan = peak, d
            if peak <= self.budget:
                if self.best is None or (flops, peak) < self.best[:2]:
                    self.best = (flops, peak, d, family)
                fam = self.by_family.get(family)
                if fam is None or (flops, peak) < fam[:2]:
                    self.by_family[family] = (flops, peak, d, family)
        return self._seen[d]

    def fits(self, dec: Iterable[str], family: str = "") -> bool:
        return self.score(dec, family)[0] <= self.budget


def _activation_bytes(sc: Scorer) -> tuple[list[int], list[int], dict[int, int], dict[int, int]]:
    """Per record: activation bytes kept under save-all, and bytes crossing the
    position after it; plus producer and last use of each value."""
    tape = sc.tape
    n = sc.n
    inputs = tape.caller_ids()
    kept0, _ = sc.planned(sc.with_fixed(["save"] * n)).residual_keys()
    producer = {o.id: r.index for r in tape.records for o in r.outputs}
    nbytes = {o.id: o.nbytes for r in tape.records for o in r.outputs}
    act = [0] * n
    for k, v in kept0.items():
        if isinstance(k, int) and k not in inputs and k in producer:
            act[producer[k]] += v.nbytes
    last_use: dict[int, int] = {}
    for r in tape.records:
        for u in r.inputs:
            if isinstance(u, Var):
                last_use[u.id] = r.index
    delta = [0] * (n + 1)
    for v, lu in last_use.items():
        if v in producer and lu > producer[v]:
            delta[producer[v]] += nbytes[v]
            delta[lu] -= nbytes[v]
    cross, run = [], 0
    for i in range(n):
        run += delta[i]
        cross.append(run)
    return act, cross, producer, last_use


def _spread(m: int) -> list[int]:
    """0..m-1 ordered coarse to fine (ends, middle, quarters, ...), so a search cut
    short by its work limit has still tried the whole range."""
    if m <= 2:
        return list(range(m))
    order, queue = [0, m - 1], [(0, m - 1)]
    while queue:
        nxt = []
        for lo, hi in queue:
            if hi - lo > 1:
                mid = (lo + hi) // 2
                order.append(mid)
                nxt += [(lo, mid), (mid, hi)]
        queue = nxt
    return order
