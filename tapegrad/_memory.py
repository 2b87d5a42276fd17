"""`tg.memory_report`: where every residual lives, and how live residual bytes
rise through forward and fall through backward.

The report runs the forward interpreter for real (so the packed residuals are
the arrays the policy produced: their bytes and memory kinds are read off
them) and then replays backward's release order from the tape, counting the
device copies that unpacking brings back while a record needs them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax import tree_util

from tapegrad._checkpoint import segment_peak
from tapegrad._display_report import report_html, report_text
from tapegrad._interpret import forward
from tapegrad._loop_common import _Stored
from tapegrad._loop_records import forwarded_ids, loop_bytes, schedule_costs
from tapegrad._loop_schedule import _Segmented
from tapegrad._memory_plot import plot_plan, plot_report
from tapegrad._memory_unseen import (
    UnseenBackward,
    unseen_backwards,
    unseen_notes,
    vjp_residual_bytes,
)
from tapegrad._policy import is_plain, resolve_policy, resolve_prefetch
from tapegrad._tape import Record, Tape, array_nbytes, as_dtype, custom_vjp_name
from tapegrad._transforms import _argnums_tuple, _leaf_owners, _Traced
from tapegrad.planner import Budget, segment_flops
from tapegrad.policies._lowbit import LowBit, residual_name
from tapegrad.policies.compress import Compress

__all__ = ["MemoryReport", "RecordMemory", "UnseenBackward", "memory_report", "vjp_residual_bytes"]


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
    # A record inside a loop or branch body: its bytes are summed over the ``steps`` body
    # runs whose residuals are held (a scan's trip count, times enclosing loops'); 1 at
    # the top level. ``depth`` counts the enclosing bodies, ``branch`` is the cond
    # branch (None elsewhere).
    steps: int = 1
    depth: int = 0
    branch: int | None = None
    # For a loop/branch record: the rows of its body records (all branches, in order).
    # The record's own bytes include theirs (and its own saves, kept once).
    body: tuple[RecordMemory, ...] = ()
    # A checkpointed scan's carries (kept every `schedule` steps), in its bytes too.
    checkpoint_bytes: int = 0
    # When a `tg.policies.budget` planned the tape: what it chose for the residuals
    # charged to this row ("save", "offload", "bf16", "int8"; several joined by "+") and
    # the seconds its cost model predicts they add to a step.
    planned: str = ""
    planned_seconds: float = 0.0
    # Under `compress(bits="auto")`: the bit widths its residuals were packed at, read
    # off the packed values ("2", "4+8"; the dtype's own width for one kept as it is).
    bits: str = ""

    @property
    def bytes(self) -> int:
        return self.device_bytes + self.host_bytes

    @property
    def step_bytes(self) -> int:
        """Bytes one body run holds (``bytes`` / ``steps``; ``bytes`` at the top level)."""
        return self.bytes // max(self.steps, 1)

    @property
    def body_bytes(self) -> int:
        """Bytes of the body rows (over all steps); 0 for a record without a body."""
        return sum(r.bytes for r in self.body)

    def walk(self):
        """This row, then its body rows (recursively), depth first."""
        yield self
        for r in self.body:
            yield from r.walk()


@dataclass(frozen=True)
class MemoryReport:
    """Residual memory of one forward/backward under a policy.

    The headline is what backward holds *beyond* the function's inputs (which the
    caller holds anyway, whatever is saved):

    * ``beyond_inputs_bytes``: residual bytes held at the end of forward that are not
      the caller's own arrays: what a forward/backward adds to the caller's memory;
    * ``peak_beyond_inputs_bytes``: the peak of that over forward and backward
      (unpacked copies, recomputed values and `unseen` estimates included);
    * ``input_bytes``: residuals that *are* the function's own inputs, kept as they
      are (a policy leaves them alone unless told ``inputs=True``);
    * ``residual_bytes``: the two together, every packed residual byte held at the end
      of forward; ``device_bytes`` / ``host_bytes``: the same, split by memory kind;
    * ``peak_bytes``: peak of live residual bytes (packed + unpacked device copies)
      over forward and backward, the inputs included;
    * ``timeline``: ``(step, live bytes)`` after each record, forward then backward
      (a loop record's backward adds a ``"bwd i step"`` point: its stored steps plus
      one step's unpacked copies, under a policy that unpacks);
    * ``records``: one row per record keeping residuals. A loop/branch record's row
      counts its per-step residuals over every step held (read off the arrays the run
      stacked or kept per step; eagerly a cond holds the branch taken), and lists its
      body records' rows in ``row.body`` (``rows()`` walks them all);
    * ``unseen``: records whose backward runs `jax.vjp`, with an estimate of the
      residuals jax makes inside it (counted in the peaks as a transient while that
      record's backward runs), and ``notes``, one line per such source line.

    Values sharded over several devices (``devices`` > 1) count the bytes one device
    holds: an array its shard (a replicated array all of it), a value the report
    estimates from its type its shard under Explicit mesh axes, else all of it.
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
    # What the report cannot see, one line each: records whose backward runs jax.vjp
    # (fallback rules, custom_jvp calls), with the estimate of their internal residuals.
    notes: tuple[str, ...] = ()
    peak_beyond_inputs_bytes: int = 0
    unseen: tuple[UnseenBackward, ...] = ()
    # Devices the measured arrays are spread over. With more than one, every byte count
    # is per device: an array counts its shard's bytes (a replicated one, all of them),
    # which is what must fit in one device's memory.
    devices: int = 1
    # When a `tg.policies.budget` planned the tape: per kept residual key, its decision
    # (mechanism, device bytes, predicted seconds: `Budget.decisions`, the planner's
    # ``last["residuals"]``); the peak the planner predicted (device activation bytes);
    # the same peak as this report measures it (device and compressed bytes beyond the
    # inputs' own residuals); the predicted seconds of recomputation and of the
    # mechanisms (None when no planner ran or its cost model was not used).
    decisions: dict | None = field(repr=False, default=None)
    planned_peak_bytes: int | None = None
    measured_device_peak_bytes: int | None = None
    planned_seconds: float | None = None
    # Under `compress(bits="auto")`: residual name (`BitAllocation.bits`'s) -> the bits
    # it was packed at in this run, and their average over the values packed (a loop
    # body's times its trip count), against the policy's ``budget_bits``.
    bits: dict[str, int] | None = field(repr=False, default=None)
    average_bits: float | None = None
    budget_bits: float | None = None
    # When a budget planned the tape: its predicted schedule, ``(point, device bytes of
    # activations)`` at the end of forward ("forward"), at each recomputation
    # ("recompute") and during each record's backward ("bwd i"), and the same points as
    # this run measured them (`plot_plan` draws both).
    planned_timeline: tuple[tuple[str, int], ...] | None = field(repr=False, default=None)
    measured_plan_timeline: tuple[tuple[str, int], ...] | None = field(repr=False, default=None)

    @property
    def beyond_inputs_bytes(self) -> int:
        """Residual bytes held after forward that are not the caller's own arrays."""
        return self.residual_bytes - self.input_bytes

    @property
    def unseen_bytes(self) -> int:
        """The largest estimate among `unseen` (their backwards run one at a time)."""
        return max((u.bytes for u in self.unseen), default=0)

    def rows(self):
        """Every row, body rows after their loop/branch record's row (depth first)."""
        for r in self.records:
            yield from r.walk()

    def __str__(self) -> str:
        return report_text(self)

    __repr__ = __str__

    def _repr_html_(self) -> str:
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
        return plot_report(self, ax, label, by_kind)

    def plot_plan(self, ax: Any = None) -> Any:
        """A budget's predicted schedule against this run's: device bytes of activations
        at the end of forward, at each recomputation and during each record's backward
        (`planned_timeline`, `measured_plan_timeline`), with the budget.

        ```python
        pol = tg.policies.budget(bytes=..., allow=("save", "recompute", "offload"))
        tg.memory_report(loss, policy=pol)(w, x).plot_plan()
        ```
        Returns the matplotlib ``Axes``.
        """
        return plot_plan(self, ax)


def _leaf_bytes(packed) -> tuple[int, int, list]:
    """(device bytes, host bytes, dtypes) of the arrays inside a packed residual."""
    dev = host = 0
    dtypes = []
    for leaf in tree_util.tree_leaves(packed):
        if not hasattr(leaf, "nbytes") or not hasattr(leaf, "dtype"):
            continue
        kind = getattr(getattr(leaf, "sharding", None), "memory_kind", None) or "device"
        if "host" in kind:
            host += array_nbytes(leaf)
        else:
            dev += array_nbytes(leaf)
        dtypes.append(as_dtype(leaf.dtype))
    return dev, host, dtypes


# Bytes of residuals, as a list: device, host, compressed on device, compressed on host
# (both already in the first two), and what they would take unpacked.
_Acc = list


def _measure(packed, info, runs: int = 1, seen: set[int] | None = None) -> _Acc:
    """The bytes of one packed residual; ``runs`` is how many body runs it stacks
    (``info`` describes one run's value). Arrays already in ``seen`` (a loop step's carry
    shared with the step before) count nothing; the ones counted are added to it."""
    d = h = 0
    dts = []
    new = 0
    for leaf in tree_util.tree_leaves(packed):
        if not hasattr(leaf, "nbytes") or not hasattr(leaf, "dtype"):
            continue
        dts.append(as_dtype(leaf.dtype))
        if seen is not None:
            if id(leaf) in seen:
                continue
            seen.add(id(leaf))
        new += 1
        kind = getattr(getattr(leaf, "sharding", None), "memory_kind", None) or "device"
        if "host" in kind:
            h += array_nbytes(leaf)
        else:
            d += array_nbytes(leaf)
    if dts and not new:
        return [0] * 5  # all shared with a value counted already
    comp = info is not None and any(dt != info.dtype for dt in dts)
    orig = info.nbytes * runs if info is not None else d + h
    return [d, h, d if comp else 0, h if comp else 0, orig]


def _note_bits(packed, info, key, by_key: dict, named: dict) -> None:
    """Note the bits a floating residual was packed at: a `LowBit`'s, or the dtype's own
    width for one kept as it is (an input kept as it is: none)."""
    if info is None:
        return
    if isinstance(packed, LowBit):
        bits = packed.bits
    elif info.is_input or not jax.numpy.issubdtype(info.dtype, jax.numpy.floating):
        return
    else:
        dts = {as_dtype(leaf.dtype) for leaf in tree_util.tree_leaves(packed)}
        if dts != {info.dtype}:
            return  # packed some other way (a cast, int8)
        bits = info.dtype.itemsize * 8
    # A set: eagerly, a scan step's carry input shares the step before's packed output
    # (packed at that residual's width), all but the first step's.
    by_key.setdefault(key, set()).add(bits)
    values = int(math.prod(info.shape)) * info.trip_count
    named.setdefault(residual_name(info), (bits, values))


def _add(acc: _Acc, more: _Acc) -> _Acc:
    for i, v in enumerate(more):
        acc[i] += v
    return acc


def _is_body_key(key) -> bool:
    return type(key) is tuple and len(key) == 2 and key[0] == "body"


def _is_loop_store(x) -> bool:
    return isinstance(x, (_Stored, _Segmented))


class _Body:
    """The per-step residuals one loop/branch record held in a real run, measured off
    its `_Stored` (or a checkpointed scan's `_Segmented`), summed over every body run
    (each branch of a cond apart). ``seen``: ids of the arrays counted so far."""

    def __init__(self, rec: Record, seen: set[int], named: dict | None = None):
        n = len(rec.bodies)
        self.rec = rec
        self.seen = seen
        # Under compress(bits="auto") (``named`` given, shared with the whole report): bit
        # widths read off the packed values, per branch by key, and by residual name with
        # the values each packs.
        self.bits: list[dict[Any, set[int]]] = [{} for _ in range(n)]
        self.named = named
        self.keys: list[dict[Any, _Acc]] = [{} for _ in range(n)]
        self.nested: list[dict[int, _Body]] = [{} for _ in range(n)]
        self.runs = [0] * n  # body runs whose residuals are held, per branch
        self.checkpoints = [0] * 5  # a checkpointed scan's carries (no record's residual)

    def add(self, stored: Any, mult: int = 1, length: int | None = None) -> None:
        """Measure one `_Stored`; ``mult`` is how many runs each of its leaves already
        stacks (a body inside a stacked scan holds one row per outer step); ``length``
        the steps a scan's `_Stored` holds (its trip count unless told)."""
        rec = self.rec
        if isinstance(stored, _Segmented):  # the carry every k steps, then the remainder
            _add(self.checkpoints, _measure(stored.checkpoints, None, mult, self.seen))
            self.add(stored.rem, mult, stored.rem_length)
            return
        if stored.steps is not None:  # one Residuals per step (Python loop, concrete cond)
            b = stored.branch or 0
            for r in stored.steps:
                if r is not None:
                    self.runs[b] += mult
                    self._add_store(b, r.store, r.infos, mult)
        elif stored.values is not None:  # stacked (scan) or a union over branches (switch)
            if rec.primitive == "cond":
                for b in range(len(rec.bodies)):
                    self.runs[b] += mult
                    vals = dict(zip(stored.keys[b], stored.values[b]))
                    self._add_store(b, vals, stored.skel[b].infos, mult)
            else:
                runs = mult * (rec.trip_count if length is None else length)
                self.runs[0] += runs
                vals = dict(zip(stored.keys, stored.values))
                self._add_store(0, vals, stored.skel.infos, runs)
                # A carry saved as a step's input is the step before's saved output, but
                # for the first step's: the initial carry, kept beside the stack.
                firsts = {k_in: init for k_in, _, init in getattr(stored, "shifted", ())}
                self._add_store(0, firsts, stored.skel.infos, mult)

    def _add_store(self, b: int, store: dict, infos: dict, mult: int) -> None:
        body = self.rec.bodies[b]
        fwd = forwarded_ids(self.rec)
        consts = {v.id: c for v, c in body.consts}
        for key, packed in store.items():
            if key in fwd:
                continue  # kept once by the record itself (its own saves)
            if _is_body_key(key) and _is_loop_store(packed):
                j = key[1]
                nb = self.nested[b].setdefault(j, _Body(body.records[j], self.seen, self.named))
                nb.add(packed, mult)
                continue
            if key in consts and packed is consts[key]:
                continue  # the body's constant itself, owned by the tape
            acc = _measure(packed, infos.get(key), mult, self.seen)
            _add(self.keys[b].setdefault(key, [0] * 5), acc)
            if self.named is not None:
                _note_bits(packed, infos.get(key), key, self.bits[b], self.named)

    def sizes(self, b: int) -> dict[Any, _Acc]:
        """Branch ``b``'s residual key -> bytes over all runs (nested bodies as one key)."""
        out = dict(self.keys[b])
        for j, nb in self.nested[b].items():
            out[("body", j)] = nb.total()
        return out

    def total(self) -> _Acc:
        acc = list(self.checkpoints)
        for b in range(len(self.keys)):
            for a in self.sizes(b).values():
                _add(acc, a)
        return acc


def _arrays(x) -> list:
    """The arrays inside packed residuals, loop bodies' per-step residuals included."""
    out: list = []
    if isinstance(x, _Segmented):
        return _arrays(x.checkpoints) + _arrays(x.rem)
    if isinstance(x, _Stored):
        if x.steps is not None:
            for r in x.steps:
                if r is not None:
                    out.extend(_arrays(list(r.store.values())))
        if x.values is not None:
            out.extend(_arrays(x.values))
        out.extend(_arrays([init for _, _, init in getattr(x, "shifted", ())]))
        return out
    for leaf in tree_util.tree_leaves(x, is_leaf=_is_loop_store):
        if _is_loop_store(leaf):
            out.extend(_arrays(leaf))
        elif isinstance(leaf, jax.Array):
            out.append(leaf)
    return out


def _saves_label(rec, keys, first_user, skip=frozenset()) -> str:
    """What a row holds: the record's own saves (less ``skip``: in a body, what the loop
    record keeps once), then outputs it is charged for because a later record keeps them
    (``out0→tanh``), a recompute segment's input, or a loop record's per-step residuals
    (``body``)."""
    saves = [s for s in rec.saves if rec.residual_key(s) not in skip]
    own = {rec.residual_key(s) for s in saves}
    parts = [",".join(map(str, saves))] if saves else []
    for key in keys:
        if key in own:
            continue
        if _is_body_key(key):
            parts.append("body")
            continue
        i = next((j for j, o in enumerate(rec.outputs) if o.id == key), None)
        user = first_user.get(key)
        parts.append(f"out{i}→#{user}" if i is not None and user is not None else "(segment input)")
    return ",".join(dict.fromkeys(parts)) or "(segment input)"


def _owners(tape: Tape, keys) -> tuple[dict[int, list], dict[Any, str]]:
    """(record index -> the kept keys charged to it, key -> its first saver's primitive).
    A value is charged to its producer, else to its first saver; a loop record's
    per-step residuals to the loop record."""
    producer = {o.id: rec.index for rec in tape.records for o in rec.outputs}
    owner: dict[Any, int] = {}
    first_user: dict[Any, str] = {}  # the primitive of the first record that keeps the value
    for rec in tape.records:
        for s_ in rec.saves:
            key = rec.residual_key(s_)
            owner.setdefault(key, producer.get(key, rec.index))
            first_user.setdefault(key, rec.primitive)
        if rec.bodies:
            owner[("body", rec.index)] = rec.index
    for seg in tape.segments:
        for v in seg.inputs:
            owner.setdefault(v.id, producer.get(v.id, seg.records[0]))
    by_rec: dict[int, list] = {}
    for key in keys:
        by_rec.setdefault(owner.get(key, -1), []).append(key)
    return by_rec, first_user


def _rows(
    tape: Tape,
    sizes: dict[Any, _Acc],
    bodies: dict[int, _Body],
    steps: int = 1,
    depth: int = 0,
    branch: int | None = None,
    skip=frozenset(),
    bits: dict | None = None,
) -> list[RecordMemory]:
    """One row per record of ``tape`` that is charged residuals; loop/branch records'
    rows carry their bodies' rows; ``bits`` (key -> bit width) fills their bits column."""
    by_rec, first_user = _owners(tape, sizes)
    skip = frozenset(skip)
    rows = []
    for rec in tape.records:
        keys = by_rec.get(rec.index)
        if not keys:
            continue
        acc = [0] * 5
        for key in keys:
            _add(acc, sizes[key])
        body: tuple[RecordMemory, ...] = ()
        bm = bodies.get(rec.index)
        if bm is not None:
            body = tuple(
                row
                for b in range(len(rec.bodies))
                for row in _rows(
                    rec.bodies[b],
                    bm.sizes(b),
                    bm.nested[b],
                    bm.runs[b],
                    depth + 1,
                    b if rec.primitive == "cond" else None,
                    forwarded_ids(rec),
                    bm.bits[b] if bits is not None else None,
                )
            )
        label = rec.primitive
        if label == "custom_vjp_call":  # show a tg.Function / custom_vjp by its name
            label = custom_vjp_name(rec.params)
        rows.append(
            RecordMemory(
                rec.index,
                label,
                rec.source,
                _saves_label(rec, keys, first_user, skip),
                acc[0],
                acc[1],
                acc[2] + acc[3],
                acc[4],
                steps,
                depth,
                branch,
                body,
                sum(bm.checkpoints[:2]) if bm is not None else 0,
                bits="+".join(map(str, sorted(set().union(*(bits.get(k, ()) for k in keys)))))
                if bits is not None
                else "",
            )
        )
    return rows


def _step_transient(rec: Record) -> int:
    """Device bytes one step of a loop/branch record's backward unpacks on top of the
    stored residuals (non-`save` policies): the step's residuals and its slices of the
    scanned inputs, plus the deepest nested body's own step (a cond: its largest branch)."""
    best = 0
    for body in rec.bodies:
        kept, _ = body.residual_keys()
        skip = {v.id for v, _ in body.consts}
        nc = rec.params["num_consts"] if rec.primitive == "scan" else len(body.inputs)
        skip |= {v.id for v in body.inputs[:nc]}  # consts/operands: the record's own saves
        n = sum(v.nbytes for k, v in kept.items() if k not in skip)
        inner = [_step_transient(r) for r in body.records if r.bodies and r.in_backward]
        n += max(inner, default=0)
        best = max(best, n)
    return best


def _segment_transient(rec: Record) -> int:
    """Bytes a checkpointed scan's backward recomputes at a time: one segment's residuals
    (a nested schedule: its inner levels' carries too) on top of what forward kept."""
    c = schedule_costs(rec)
    if c is None:
        return 0
    extra = c.peak_carries - c.carries
    return dataclasses.replace(loop_bytes(rec), steps=c.peak_steps, checkpoints=extra).total


def report_from_run(tape: Tape, res, policy, args: Sequence[Any] = ()) -> MemoryReport:
    plain = is_plain(policy)
    input_ids = {v.id for v in tape.inputs} | {v.id for v, _ in tape.consts}
    seg_of = tape.residual_keys()[1] if tape.segments else {}
    const_ids = {v.id for v, _ in tape.consts}

    # Bytes per kept key, read off the packed values; a loop record's per-step residuals
    # are one key, measured (with its bodies' rows) off its _Stored.
    sizes_acc: dict[Any, _Acc] = {}
    bodies: dict[int, _Body] = {}
    seen: set[int] = set()
    # Under compress(bits="auto"): the bit widths read off the packed values.
    auto = _auto_of(policy)
    bits: dict[Any, set[int]] = {}
    named: dict[str, tuple[int, int]] | None = {} if auto is not None else None
    for key, packed in res.store.items():
        if key in const_ids:
            continue  # constants belong to the tape, not to the residuals
        if not (_is_body_key(key) and _is_loop_store(packed)):
            sizes_acc[key] = _measure(packed, res.infos.get(key), 1, seen)
            if named is not None:
                _note_bits(packed, res.infos.get(key), key, bits, named)
    for key, packed in res.store.items():  # loops last: what they share is counted once
        if _is_body_key(key) and _is_loop_store(packed):
            bm = bodies[key[1]] = _Body(tape.records[key[1]], seen, named)
            bm.add(packed)
            sizes_acc[key] = bm.total()
    rows = _rows(tape, sizes_acc, bodies, bits=bits if auto is not None else None)
    by_rec, _ = _owners(tape, sizes_acc)
    sizes = {k: a[0] + a[1] for k, a in sizes_acc.items()}
    # by kind (device, host, compressed): compressed residuals count as compressed
    # wherever they live
    kind_of = {k: (a[0] - a[2], a[1] - a[3], a[2] + a[3]) for k, a in sizes_acc.items()}
    lk = [0, 0, 0]  # live bytes by kind (device, host, compressed), mirroring ``live``

    def add_kind(key, sign=1):
        for i, b in enumerate(kind_of.get(key, (0, 0, 0))):
            lk[i] += sign * b

    # Bytes of each kept value that are the caller's own arrays (an input kept as it is,
    # a loop's initial carry): alive before the call and after it, whatever is saved.
    arg_ids = {id(a) for a in args}
    caller: dict[Any, int] = {}
    for k in sizes:
        v = res.store[k]
        if _is_loop_store(v):
            n = sum(array_nbytes(a) for a in _arrays(v) if id(a) in arg_ids)
        else:
            n = sizes[k] if any(id(x) in arg_ids for x in tree_util.tree_leaves(v)) else 0
        if n:
            caller[k] = n
    unseen = unseen_backwards(tape)
    unseen_at: dict[int, int] = {}  # top-level record -> largest estimate run within it
    for at, u in unseen:
        unseen_at[at] = max(unseen_at.get(at, 0), u.bytes)

    timeline = []
    timeline_kinds = []
    live = sum(sizes[k] for k in sizes if isinstance(k, int) and k in input_ids)
    caller_live = sum(caller.get(k, 0) for k in sizes if isinstance(k, int) and k in input_ids)
    for k in sizes:
        if isinstance(k, int) and k in input_ids:
            add_kind(k)
    input_live = live
    # The schedule as a budget's planner sees it (`planner.joint.Timeline`): device and
    # compressed bytes of activations (the tape's own inputs not counted) at the end of
    # forward, at each recomputation and during each record's backward.
    inp = {k for k in sizes if isinstance(k, int) and k in input_ids}
    inp_lk = sum(kind_of[k][0] + kind_of[k][2] for k in inp)
    plan_points: list[tuple[str, int]] = []
    for rec in tape.records:
        for key in by_rec.get(rec.index, ()):
            if not (isinstance(key, int) and key in input_ids):
                live += sizes[key]
                caller_live += caller.get(key, 0)
                add_kind(key)
        timeline.append((f"fwd {rec.index}", live))
        timeline_kinds.append((lk[0], lk[1], lk[2]))
    residual = live
    plan_points.append(("forward", lk[0] + lk[2] - inp_lk))
    remaining = dict(res.refs)
    extra: dict[Any, int] = {}  # unpacked device copies and recomputed values, per key

    def _moved(key) -> bool:
        # Unpacking makes a device copy only of what packing moved to host or shrank; a
        # residual kept as it is on device (a budget's "save") unpacks to itself.
        a = sizes_acc.get(key)
        return a is None or bool(a[1] or a[2] or a[3])

    peak = live
    peak_beyond = live - caller_live

    def reach(total: int) -> None:
        nonlocal peak, peak_beyond
        peak = max(peak, total)
        peak_beyond = max(peak_beyond, total - caller_live)

    def release(key):
        nonlocal live, caller_live, inp_lk
        remaining[key] -= 1
        if remaining[key] == 0:
            copy = extra.pop(key, 0)
            live -= sizes.get(key, 0) + copy
            caller_live -= caller.get(key, 0)
            add_kind(key, -1)
            lk[0] -= copy
            if key in inp:
                inp_lk -= kind_of[key][0] + kind_of[key][2] + copy

    def unpack_copy(key, s_) -> None:
        nonlocal live, inp_lk
        extra[key] = s_.nbytes  # the device copy unpack brings back
        live += s_.nbytes
        lk[0] += s_.nbytes
        if key in inp:
            inp_lk += s_.nbytes

    def copies(key) -> bool:
        return not plain and key in sizes and caller.get(key, 0) < sizes[key] and _moved(key)

    order = [r for r in reversed(tape.records) if r.rule != "none"]
    prefetch = 0 if plain else resolve_prefetch(policy, tape)
    for n, rec in enumerate(order):
        keys = res.keys.get(rec.index, ())
        # What backward brings back early for the next records (`offload`'s prefetch).
        for nxt in order[n + 1 : n + 1 + prefetch]:
            for s_, key in zip(nxt.saves, res.keys.get(nxt.index, ())):
                if key not in extra and key in res.store and copies(key):
                    unpack_copy(key, s_)
        for s_, key in zip(rec.saves, keys):
            if key in extra:
                continue
            if key not in res.store and key in seg_of:
                seg = tape.segments[seg_of[key]]
                transient = segment_peak(tape, seg)
                for v in seg.inputs:  # unpacked for the segment, released after it
                    if v.id not in extra and v.id in res.store and copies(v.id):
                        unpack_copy(v.id, v)
                reach(live + transient)
                plan_points.append(("recompute", lk[0] + lk[2] - inp_lk + transient))
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
            elif copies(key):
                unpack_copy(key, s_)
        if ("body", rec.index) in sizes:
            # A loop's stacked residuals stay until its backward ends; each step unpacks
            # its own residuals (device copies) on top of them, and a checkpointed scan
            # recomputes one segment's residuals first.
            # jax.vjp inside a body record's backward runs one step at a time too.
            step = (0 if plain else _step_transient(rec)) + _segment_transient(rec)
            step += max(unseen_at.get(rec.index, 0), 0)
            if step:
                reach(live + step)
                timeline.append((f"bwd {rec.index} step", live + step))
                timeline_kinds.append((lk[0] + step, lk[1], lk[2]))
        elif unseen_at.get(rec.index, 0) > 0:
            # jax.vjp's residuals for this record, made and freed inside its backward.
            est = unseen_at[rec.index]
            reach(live + est)
            timeline.append((f"bwd {rec.index} jax.vjp", live + est))
            timeline_kinds.append((lk[0] + est, lk[1], lk[2]))
        reach(live)
        plan_points.append((f"bwd {rec.index}", lk[0] + lk[2] - inp_lk))
        for key in keys:
            release(key)
        timeline.append((f"bwd {rec.index}", live))
        timeline_kinds.append((lk[0], lk[1], lk[2]))
    dev_total = sum(a[0] for a in sizes_acc.values())
    host_total = sum(a[1] for a in sizes_acc.values())
    input_total = sum(caller.values())
    planner = _planner_of(policy)
    decisions = planner.decisions(tape) if planner is not None else None
    if decisions is not None:
        rows = [_with_decisions(r, by_rec.get(r.index, ()), decisions) for r in rows]
    measured_dev = (
        max((d + c for d, _, c in timeline_kinds), default=0) - input_live
        if planner is not None
        else None
    )
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
        unseen_notes([u for _, u in unseen]),
        peak_beyond,
        tuple(u for _, u in unseen),
        _devices(list(res.store.values()) + list(args)),
        decisions,
        planner.last.get("peak_bytes") if planner is not None else None,
        measured_dev,
        planner.last.get("time_s") if planner is not None else None,
        {n: b for n, (b, _) in named.items()} if named is not None else None,
        _average_bits(named, auto),
        auto.budget_bits if auto is not None else None,
        planned_timeline=planner.last.get("timeline") if planner is not None else None,
        measured_plan_timeline=tuple(plan_points) if planner is not None else None,
    )


def _auto_of(policy: Any) -> Any:
    """The `compress(bits="auto")` policy packing the residuals (it or one it wraps)."""
    for _ in range(8):
        if isinstance(policy, Compress):
            return policy if policy.bits == "auto" else None
        policy = getattr(policy, "base", None)
    return None


def _average_bits(named: dict | None, auto: Any) -> float | None:
    """Bits a value over the residuals the allocation budgets (all it packed, when it
    has none), as packed in this run."""
    if auto is None or named is None:
        return None
    alloc = getattr(auto, "allocation", None)
    fixed = {r.name for r in alloc.rows if r.fixed} if alloc is not None else set()
    got = [bv for n, bv in named.items() if n not in fixed]
    n = sum(v for _, v in got)
    return sum(b * v for b, v in got) / n if n else None


def _with_decisions(row: RecordMemory, keys: Any, decisions: dict) -> RecordMemory:
    """``row`` with the planner's decisions for the residual keys charged to it."""
    got = [decisions[k] for k in keys if k in decisions]
    if not got:
        return row
    names = "+".join(dict.fromkeys(m for m, _, _ in got))
    return dataclasses.replace(row, planned=names, planned_seconds=sum(t for _, _, t in got))


def _devices(values: Any) -> int:
    n = 1
    for leaf in tree_util.tree_leaves(values):
        n = max(n, len(getattr(getattr(leaf, "sharding", None), "device_set", ())))
    return n


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
    rep.beyond_inputs_bytes, rep.peak_beyond_inputs_bytes  # what backward adds
    rep.input_bytes, rep.device_bytes, rep.host_bytes, rep.peak_bytes
    ```
    Runs eagerly (the point is to look at real arrays). The headline is what backward
    holds beyond the function's inputs, which the caller holds anyway; records whose
    backward runs `jax.vjp` are listed in ``rep.unseen`` with an estimate of what jax
    makes inside it.
    """

    @functools.wraps(fun)
    def report_f(*args):
        pol = resolve_policy(policy)
        nums = _argnums_tuple(argnums, len(args), "memory_report")
        owners = _leaf_owners(args)
        t = _Traced(fun, args, lambda i: owners[i] in nums, False, "memory_report", pol)
        _, res = forward(t.tape, t.flat, pol)
        jax.block_until_ready(_arrays(list(res.store.values())))
        return report_from_run(t.tape, res, pol, t.flat)

    return report_f
