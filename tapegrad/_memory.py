"""`tg.memory_report`: where every residual lives, and how live residual bytes
rise through forward and fall through backward.

The report runs the forward interpreter for real (so the packed residuals are
the arrays the policy produced: their bytes and memory kinds are read off
them) and then replays backward's release order from the tape, counting the
device copies that unpacking brings back while a record needs them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax import tree_util

from tapegrad._checkpoint import segment_peak
from tapegrad._interpret import forward
from tapegrad._tape import Tape, as_dtype
from tapegrad.policies._base import is_plain, resolve_policy
from tapegrad.policies.budget import Budget, segment_flops

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
    tape: Tape | None = field(repr=False, default=None)
    # The same timeline split by where the bytes live: (device, host, compressed) per
    # step, summing to ``timeline``'s bytes. Compressed residuals count as compressed
    # wherever they live; unpacked copies and recomputed values count as device.
    timeline_kinds: tuple[tuple[int, int, int], ...] = field(repr=False, default=())
    # Residual bytes that are the tape's own inputs: the timeline's floor, which a
    # budget does not count.
    input_residual_bytes: int = 0
    # The planner's budget (activation bytes) when a `tg.policies.budget` chose the plan.
    budget_bytes: int | None = None
    # Flops backward spends recomputing (each recomputed record once, as the executor
    # runs them; `tg.policies.budget`'s own cost model), and the plan family the
    # planner chose ("chain DP", "cuts+dots_saveable", ...) when one ran.
    recompute_flops: float = 0.0
    plan: str | None = None

    def __str__(self) -> str:
        from tapegrad._display import report_text

        return report_text(self)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        from tapegrad._display import report_html

        return report_html(self)

    def plot(self, ax: Any = None, *, label: str | None = None, by_kind: bool = True) -> Any:
        """Live residual bytes over forward then backward, one line per memory kind.

        ```python
        fig, axs = plt.subplots(1, 2, figsize=(12, 3), sharey=True)
        tg.memory_report(loss, policy=P.save())(w, x).plot(ax=axs[0])
        tg.memory_report(loss, policy=P.offload())(w, x).plot(ax=axs[1])
        ```
        Draws a line per kind that holds bytes (``device``, ``host``, ``compressed``;
        plus ``total`` when there are several), a dashed vertical line where backward
        starts and, when a `tg.policies.budget` planned the tape, its budget as a
        horizontal line (raised by the inputs' own bytes, which budgets do not count).
        Returns the matplotlib ``Axes`` (``ax`` if given). ``label`` prefixes the legend.
        """
        try:
            import matplotlib.pyplot as plt
            from matplotlib.ticker import FuncFormatter
        except ImportError as e:
            raise ImportError(
                "MemoryReport.plot needs matplotlib, an optional dependency: pip install matplotlib"
            ) from e
        from tapegrad._display import clip, human_bytes

        if ax is None:
            _, ax = plt.subplots(figsize=(8, 3))
        xs = list(range(len(self.timeline)))
        prefix = f"{label}: " if label else ""
        kinds = (
            [
                (name, [k[i] for k in self.timeline_kinds])
                for i, name in enumerate(("device", "host", "compressed"))
            ]
            if by_kind
            else []
        )
        kinds = [(n, ys) for n, ys in kinds if any(ys)]
        if len(kinds) != 1:  # one kind is the total; several need the total beside them
            ax.plot(
                xs,
                [b for _, b in self.timeline],
                drawstyle="steps-post",
                lw=2,
                label=prefix + "total",
                gid="total",
            )
        for name, ys in kinds:
            ax.plot(
                xs,
                ys,
                drawstyle="steps-post",
                lw=1.2 if len(kinds) > 1 else 2,
                ls="-" if len(kinds) == 1 else "--",
                label=prefix + name,
                gid=name,
            )
        n_fwd = sum(1 for s, _ in self.timeline if s.startswith("fwd"))
        drawn = {(ln.get_gid(), tuple(ln.get_xdata())) for ln in ax.get_lines()}
        if ("backward", (n_fwd - 0.5,) * 2) not in drawn:  # once per Axes when overlaid
            ax.axvline(
                n_fwd - 0.5, color="gray", lw=0.8, ls="--", label="backward starts", gid="backward"
            )
        if self.budget_bytes is not None:
            note = (
                f" + {human_bytes(self.input_residual_bytes)} inputs"
                if self.input_residual_bytes
                else ""
            )
            ax.axhline(
                self.budget_bytes + self.input_residual_bytes,
                color="tab:red",
                lw=1,
                ls=":",
                label=f"{prefix}budget {human_bytes(self.budget_bytes)}{note}",
                gid="budget",
            )
        ax.yaxis.set_major_locator(_binary_locator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: human_bytes(v).replace(".0 ", " ")))
        ax.set_xlabel("tape step (forward records, then backward)")
        ax.set_ylabel("live residual bytes")
        if not ax.get_title():
            ax.set_title(clip(label or repr(self.policy), 60), fontsize="medium")
        top = max([b for _, b in self.timeline] + [1])
        if self.budget_bytes is not None:  # axhline does not widen the y range by itself
            top = max(top, self.budget_bytes + self.input_residual_bytes)
        ax.set_ylim(0, max(ax.get_ylim()[1], top * 1.05))
        ax.legend(fontsize="small")
        return ax


def _binary_locator() -> Any:
    """Ticks at round numbers of KiB / MiB / GiB rather than of bytes."""
    from matplotlib.ticker import MaxNLocator

    class BinaryLocator(MaxNLocator):
        def tick_values(self, vmin, vmax):
            unit = 1.0
            while max(abs(vmin), abs(vmax)) >= 1024 * unit and unit < 1024**3:
                unit *= 1024
            return super().tick_values(vmin / unit, vmax / unit) * unit

    return BinaryLocator(nbins=6, steps=[1, 2, 2.5, 5, 10])


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


def _saves_label(rec, keys, first_user) -> str:
    """What a row holds: the record's own saves, then outputs it is charged for because a
    later record keeps them (``out0→tanh``), or a recompute segment's input."""
    own = {rec.residual_key(s) for s in rec.saves}
    parts = [",".join(map(str, rec.saves))] if rec.saves else []
    for key in keys:
        if key in own:
            continue
        i = next((j for j, o in enumerate(rec.outputs) if o.id == key), None)
        user = first_user.get(key)
        parts.append(f"out{i}→#{user}" if i is not None and user is not None else "(segment input)")
    return ",".join(dict.fromkeys(parts)) or "(segment input)"


def report_from_run(tape: Tape, res, policy, args: Sequence[Any] = ()) -> MemoryReport:
    plain = is_plain(policy)
    producer = {o.id: rec.index for rec in tape.records for o in rec.outputs}
    input_ids = {v.id for v in tape.inputs} | {v.id for v, _ in tape.consts}
    seg_of = tape.residual_keys()[1] if tape.segments else {}

    # Which record a kept value is charged to: its producer, else its first user.
    owner: dict[Any, int] = {}
    first_user: dict[Any, str] = {}  # the primitive of the first record that keeps the value
    for rec in tape.records:
        for s_ in rec.saves:
            key = rec.residual_key(s_)
            owner.setdefault(key, producer.get(key, rec.index))
            first_user.setdefault(key, rec.primitive)
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
        rows.append(
            RecordMemory(
                rec.index,
                label,
                rec.source,
                _saves_label(rec, keys, first_user),
                dev,
                host,
                comp,
                orig,
            )
        )

    def compressed(key) -> bool:  # the same test as a row's compressed_bytes
        info = res.infos.get(key)
        return info is not None and any(dt != info.dtype for dt in _leaf_bytes(res.store[key])[2])

    kind_of = {k: ((0, 0, d + h) if compressed(k) else (d, h, 0)) for k, (d, h) in sizes.items()}
    lk = [0, 0, 0]  # live bytes by kind (device, host, compressed), mirroring ``live``

    def add_kind(key, sign=1):
        for i, b in enumerate(kind_of.get(key, (0, 0, 0))):
            lk[i] += sign * b

    timeline = []
    timeline_kinds = []
    live = sum(sum(sizes[k]) for k in sizes if isinstance(k, int) and k in input_ids)
    for k in sizes:
        if isinstance(k, int) and k in input_ids:
            add_kind(k)
    input_live = live
    for rec in tape.records:
        for key in by_rec.get(rec.index, ()):
            if not (isinstance(key, int) and key in input_ids):
                live += sum(sizes[key])
                add_kind(key)
        timeline.append((f"fwd {rec.index}", live))
        timeline_kinds.append((lk[0], lk[1], lk[2]))
    residual = live
    remaining = dict(res.refs)
    extra: dict[Any, int] = {}  # unpacked device copies and recomputed values, per key
    peak = live

    def release(key):
        nonlocal live
        remaining[key] -= 1
        if remaining[key] == 0:
            copy = extra.pop(key, 0)
            live -= sum(sizes.get(key, (0, 0))) + copy
            add_kind(key, -1)
            lk[0] -= copy

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
                    lk[0] += o.nbytes
                for i in seg.records:
                    r = tape.records[i]
                    for a in r.saves:
                        if a.kind == "aux" and r.residual_key(a) in seg_of:
                            extra[r.residual_key(a)] = a.nbytes
                            live += a.nbytes
                            lk[0] += a.nbytes
                for v in seg.inputs:
                    release(v.id)
            elif not plain and key in sizes:
                extra[key] = s_.nbytes  # the device copy unpack brings back
                live += s_.nbytes
                lk[0] += s_.nbytes
        peak = max(peak, live)
        for key in keys:
            release(key)
        timeline.append((f"bwd {rec.index}", live))
        timeline_kinds.append((lk[0], lk[1], lk[2]))
    dev_total = sum(d for d, _ in sizes.values())
    host_total = sum(h for _, h in sizes.values())
    arg_ids = {id(a) for a in args}
    input_total = sum(
        sum(sizes[k])
        for k in sizes
        if any(id(leaf) in arg_ids for leaf in tree_util.tree_leaves(res.store[k]))
    )
    planner = _planner_of(policy)
    return MemoryReport(
        policy,
        tuple(rows),
        residual,
        dev_total,
        host_total,
        peak,
        input_total,
        tuple(timeline),
        tape,
        tuple(timeline_kinds),
        input_live,
        planner.bytes if planner is not None else None,
        sum(segment_flops(tape, seg) for seg in tape.segments),
        planner.last.get("plan") if planner is not None else None,
    )


def _planner_of(policy: Any) -> Any:
    """The `tg.policies.budget` policy that planned the tape (it or one it wraps), or None."""
    for _ in range(8):  # wrappers keep the policy they wrap in ``base``
        if isinstance(policy, Budget):
            return policy
        policy = getattr(policy, "base", None)
    return None


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
