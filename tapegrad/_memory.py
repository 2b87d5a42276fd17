"""`tg.memory_report`: where every residual lives, and how live residual bytes
rise through forward and fall through backward.

The report runs the forward interpreter for real (so the packed residuals are
the arrays the policy produced: their bytes and memory kinds are read off
them) and then replays backward's release order from the tape, counting the
device copies that unpacking brings back while a record needs them.
"""

from __future__ import annotations

import functools
import html
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
from jax import tree_util

from tapegrad._checkpoint import segment_peak
from tapegrad._interpret import forward
from tapegrad._tape import Tape, as_dtype
from tapegrad.policies._base import is_plain, resolve_policy

__all__ = ["MemoryReport", "RecordMemory", "memory_report"]


@dataclass(frozen=True, slots=True)
class RecordMemory:
    """What one record keeps: bytes by where they live (distinct values, first saver)."""

    index: int
    primitive: str
    source: str
    saves: str
    device_bytes: int
    host_bytes: int
    compressed_bytes: int  # bytes stored in a dtype other than the residual's own
    original_bytes: int  # bytes the residuals would take unpacked

    @property
    def bytes(self) -> int:
        return self.device_bytes + self.host_bytes


@dataclass(frozen=True)
class MemoryReport:
    """Residual memory of one forward/backward under a policy.

    * ``residual_bytes``: total packed residual bytes held at the end of forward;
    * ``device_bytes`` / ``host_bytes``: the same, split by memory kind;
    * ``input_bytes``: the part of it that *is* the function's own inputs (kept
      as they are, so alive anyway);
    * ``peak_bytes``: peak of live residual bytes (packed + unpacked device copies)
      over forward and backward;
    * ``timeline``: ``(step, live bytes)`` after each record, forward then backward.
    """

    policy: Any
    records: tuple[RecordMemory, ...]
    residual_bytes: int
    device_bytes: int
    host_bytes: int
    peak_bytes: int
    input_bytes: int
    timeline: tuple[tuple[str, int], ...] = field(repr=False)
    tape: Tape = field(repr=False, default=None)

    def __str__(self) -> str:
        lines = [f"memory_report(policy={self.policy!r}): {self.residual_bytes:,} residual bytes "
                 f"({self.device_bytes:,} device, {self.host_bytes:,} host; "
                 f"{self.input_bytes:,} are the inputs themselves), peak {self.peak_bytes:,}"]
        lines.append(f"{'#':>4} {'primitive':<18} {'saves':<12} {'device':>12} {'host':>12} "
                     f"{'compressed':>11}  source")
        for r in self.records:
            src = r.source.rsplit("/", 1)[-1]
            lines.append(f"{r.index:>4} {r.primitive[:18]:<18} {r.saves[:12]:<12} "
                         f"{r.device_bytes:>12,} {r.host_bytes:>12,} {r.compressed_bytes:>11,}  "
                         f"{src[:24]}")
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{r.index}</td><td><b>{html.escape(r.primitive)}</b></td>"
            f"<td>{html.escape(r.saves)}</td><td style='text-align:right'>{r.device_bytes:,}</td>"
            f"<td style='text-align:right'>{r.host_bytes:,}</td>"
            f"<td style='text-align:right'>{r.compressed_bytes:,}</td>"
            f"<td><code>{html.escape(r.source.rsplit('/', 1)[-1])}</code></td></tr>"
            for r in self.records)
        return (f"<table class='tapegrad-memory'><caption>policy {html.escape(repr(self.policy))}: "
                f"{self.residual_bytes:,} B residuals ({self.device_bytes:,} device, "
                f"{self.host_bytes:,} host), peak {self.peak_bytes:,} B</caption>"
                "<tr><th>#</th><th>primitive</th><th>saves</th><th>device B</th><th>host B</th>"
                f"<th>compressed B</th><th>source</th></tr>{rows}</table>")

    def plot(self, ax=None):
        """Live residual bytes over the forward and backward timeline (needs matplotlib)."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as e:  # pragma: no cover - optional dependency
            raise ImportError("MemoryReport.plot needs matplotlib: pip install matplotlib") from e
        if ax is None:
            _, ax = plt.subplots(figsize=(8, 3))
        ys = [b for _, b in self.timeline]
        n_fwd = sum(1 for s, _ in self.timeline if s.startswith("fwd"))
        ax.plot(range(len(ys)), ys, drawstyle="steps-post", label=repr(self.policy))
        ax.axvline(n_fwd - 0.5, color="gray", lw=0.5, ls="--")
        ax.set_xlabel("record (forward, then backward)")
        ax.set_ylabel("live residual bytes")
        ax.legend()
        return ax


def _leaf_bytes(packed) -> tuple[int, int, list]:
    """(device bytes, host bytes, dtypes) of the arrays inside a packed residual."""
    dev = host = 0
    dtypes = []
    for leaf in tree_util.tree_leaves(packed):
        if not hasattr(leaf, "nbytes") or not hasattr(leaf, "dtype"):
            continue
        kind = getattr(getattr(leaf, "sharding", None), "memory_kind", None) or "device"
        if "host" in kind:
            host += leaf.nbytes
        else:
            dev += leaf.nbytes
        dtypes.append(as_dtype(leaf.dtype))
    return dev, host, dtypes


def report_from_run(tape: Tape, res, policy, args: Sequence[Any] = ()) -> MemoryReport:
    plain = is_plain(policy)
    producer = {o.id: rec.index for rec in tape.records for o in rec.outputs}
    input_ids = {v.id for v in tape.inputs} | {v.id for v, _ in tape.consts}
    seg_of = tape.residual_keys()[1] if tape.segments else {}

    # Which record a kept value is charged to: its producer, else its first user.
    owner: dict[Any, int] = {}
    for rec in tape.records:
        for s_ in rec.saves:
            key = rec.residual_key(s_)
            owner.setdefault(key, producer.get(key, rec.index))
    for seg in tape.segments:
        for v in seg.inputs:
            owner.setdefault(v.id, producer.get(v.id, seg.records[0]))
    sizes = {key: _leaf_bytes(packed)[:2] for key, packed in res.store.items()}
    const_ids = {v.id for v, _ in tape.consts}
    for k in const_ids:
        sizes.pop(k, None)  # constants belong to the tape, not to the residuals

    rows = []
    by_rec: dict[int, list] = {}
    for key in sizes:
        by_rec.setdefault(owner.get(key, -1), []).append(key)
    for rec in tape.records:
        keys = by_rec.get(rec.index)
        if not keys:
            continue
        dev = host = comp = orig = 0
        for key in keys:
            d, h, dts = _leaf_bytes(res.store[key])
            info = res.infos.get(key)
            want = info.dtype if info is not None else None
            dev, host = dev + d, host + h
            orig += info.nbytes if info is not None else d + h
            if want is not None and any(dt != want for dt in dts):
                comp += d + h
        label = rec.primitive
        if label == "custom_vjp_call":  # show a tg.Function / custom_vjp by its name
            from tapegrad.rules.control import custom_vjp_name
            label = custom_vjp_name(rec.params)
        rows.append(RecordMemory(rec.index, label, rec.source,
                                 ",".join(map(str, rec.saves)) or "(segment input)",
                                 dev, host, comp, orig))

    timeline = []
    live = sum(sum(sizes[k]) for k in sizes if isinstance(k, int) and k in input_ids)
    for rec in tape.records:
        for key in by_rec.get(rec.index, ()):
            if not (isinstance(key, int) and key in input_ids):
                live += sum(sizes[key])
        timeline.append((f"fwd {rec.index}", live))
    residual = live
    remaining = dict(res.refs)
    extra: dict[Any, int] = {}  # unpacked device copies and recomputed values, per key
    peak = live

    def release(key):
        nonlocal live
        remaining[key] -= 1
        if remaining[key] == 0:
            live -= sum(sizes.get(key, (0, 0))) + extra.pop(key, 0)

    for rec in reversed(tape.records):
        if rec.rule == "none":
            continue
        keys = res.keys.get(rec.index, ())
        for s_, key in zip(rec.saves, keys):
            if key in extra:
                continue
            if key not in res.store and key in seg_of:
                seg = tape.segments[seg_of[key]]
                transient = segment_peak(tape, seg)
                if not plain:
                    transient += sum(v.nbytes for v in seg.inputs)
                peak = max(peak, live + transient)
                for o in seg.outputs:
                    extra[o.id] = o.nbytes
                    live += o.nbytes
                for i in seg.records:
                    r = tape.records[i]
                    for a in r.saves:
                        if a.kind == "aux" and r.residual_key(a) in seg_of:
                            extra[r.residual_key(a)] = a.nbytes
                            live += a.nbytes
                for v in seg.inputs:
                    release(v.id)
            elif not plain and key in sizes:
                extra[key] = s_.nbytes  # the device copy unpack brings back
                live += s_.nbytes
        peak = max(peak, live)
        for key in keys:
            release(key)
        timeline.append((f"bwd {rec.index}", live))
    dev_total = sum(d for d, _ in sizes.values())
    host_total = sum(h for _, h in sizes.values())
    arg_ids = {id(a) for a in args}
    input_total = sum(sum(sizes[k]) for k in sizes
                      if any(id(leaf) in arg_ids for leaf in tree_util.tree_leaves(res.store[k])))
    return MemoryReport(policy, tuple(rows), residual, dev_total, host_total, peak, input_total,
                        tuple(timeline), tape)


def memory_report(fun: Callable, argnums: int | Sequence[int] = 0, *, policy: Any = None):
    """Measure where ``fun``'s residuals live under ``policy``.

    ```python
    rep = tg.memory_report(loss, policy=tg.policies.offload())(params, x)
    rep.device_bytes, rep.host_bytes, rep.peak_bytes
    ```
    Runs eagerly (the point is to look at real arrays).
    """
    from tapegrad._transforms import _argnums_tuple, _leaf_owners, _Traced

    @functools.wraps(fun)
    def report_f(*args):
        pol = resolve_policy(policy)
        nums = _argnums_tuple(argnums, len(args), "memory_report")
        owners = _leaf_owners(args)
        t = _Traced(fun, args, lambda i: owners[i] in nums, False, "memory_report", pol)
        _, res = forward(t.tape, t.flat, pol)
        jax.block_until_ready(list(res.store.values()))
        return report_from_run(t.tape, res, pol, t.flat)

    return report_f
