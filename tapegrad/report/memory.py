"""`tg.memory_report`: where every residual lives, and how live residual bytes
rise through forward and fall through backward.

The report runs the forward interpreter for real (so the packed residuals are
the arrays the policy produced: their bytes and memory kinds are read off
them) and then replays backward's release order from the tape, counting the
device copies that unpacking brings back while a record needs them.

`tapegrad.report.accounting` measures the packed residuals, `tapegrad.report.timeline`
replays their lifetimes, `tapegrad.report.fields` builds the rows and fields; this
module holds the report itself and `memory_report`, the public entry.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from tapegrad.api.traced import Traced, argnums_tuple, leaf_owners
from tapegrad.core.residual_policy import resolve_policy
from tapegrad.core.tape import Tape
from tapegrad.display.graph import report_graph
from tapegrad.display.memory import report_html, report_text
from tapegrad.display.plot import plot_plan, plot_report
from tapegrad.engine.interpret import forward
from tapegrad.report.accounting import _arrays
from tapegrad.report.compare import Comparison, compare
from tapegrad.report.fields import RecordMemory, report_fields
from tapegrad.report.notes import policy_notes, warn_once
from tapegrad.report.unseen import UnseenBackward, vjp_residual_bytes

__all__ = ["MemoryReport", "RecordMemory", "UnseenBackward", "memory_report", "vjp_residual_bytes"]


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
      one step's unpacked copies, under a policy that unpacks; a recomputed segment a
      ``"bwd i recompute"`` point, while it runs);
    * ``records``: one row per record keeping residuals. A loop/branch record's row
      counts its per-step residuals over every step held (read off the arrays the run
      stacked or kept per step; eagerly a cond holds the branch taken), and lists its
      body records' rows in ``row.body`` (``rows()`` walks them all);
    * ``unseen``: records whose backward runs `jax.vjp`, with an estimate of the
      residuals jax makes inside it (counted in the peaks as a transient while that
      record's backward runs), and ``notes``, one line per such source line.

    Values sharded over several devices (``devices`` > 1) count the bytes one device
    holds: an array its shard (a replicated array all of it), a value the report
    estimates from its type its shard under Explicit mesh axes, else all of it. In a
    multi-process run (global arrays over ``processes`` > 1 processes), the bytes are
    those of one of *this* process's devices, read off its local shards: each process
    reports its own (on an even sharding, the same figures everywhere).
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
    # When a policy asked to move, compress or recompute residuals changed no byte (an
    # offload() of a program whose residuals are all its inputs, a selective predicate
    # that matched nothing, a budget above save()'s bytes): one line each
    # (`tapegrad.report.notes`); memory_report also warns once per policy object.
    policy_notes: tuple[str, ...] = ()
    # Processes whose devices those arrays span (a multi-process run's global arrays):
    # with more than one, the bytes are one of this process's devices', each process
    # reporting its own shards.
    processes: int = 1

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

    def compare(self, other: Any) -> Comparison:
        """This report beside ``other`` (another `MemoryReport`, or `tg.jax_residuals`'s
        report of what plain ``jax.vjp`` keeps), rows matched by source line and
        primitive, with each side's decision and device/host/compressed bytes and totals;
        text and HTML."""
        return compare(self, other)

    def graph(self, **kwargs: Any) -> Any:
        """The tape drawn with this report's decisions and bytes per record (`TapeGraph`;
        ``bodies``, ``max_nodes`` and ``engine`` as `Tape.graph`)."""
        return report_graph(self, **kwargs)

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


def report_from_run(tape: Tape, res, policy, args: Sequence[Any] = ()) -> MemoryReport:
    """The report of a forward run of ``tape`` on ``args`` whose kept residuals are ``res``."""
    return MemoryReport(**report_fields(tape, res, policy, args))


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
    makes inside it. On values sharded over devices, bytes are per device; on a
    multi-process run's global arrays, per device of this process (its local shards),
    and every process must call it, as it runs the forward on the global arrays.
    """

    @functools.wraps(fun)
    def report_f(*args):
        pol = resolve_policy(policy)
        nums = argnums_tuple(argnums, len(args), "memory_report")
        owners = leaf_owners(args)
        t = Traced(fun, args, lambda i: owners[i] in nums, False, "memory_report", pol)
        _, res = forward(t.tape, t.flat, pol)
        jax.block_until_ready(_arrays(list(res.store.values())))
        rep = report_from_run(t.tape, res, pol, t.flat)
        notes = policy_notes(pol, t.tape, t.unplanned, rep)
        if notes:
            warn_once(pol, notes)
            rep = dataclasses.replace(rep, policy_notes=notes)
        return rep

    return report_f
