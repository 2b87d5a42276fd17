"""The `Budget` policy and `budget()`: choose, per record, save or recompute (and, per
kept residual, offload or compress where allowed) so that the peak of live residual
bytes stays under a budget at the least predicted cost.

The planner is a tape pass. It respects binding decisions (``ALWAYS`` /
``NEVER`` from a `tg.selective` base, and the policies of `jax.checkpoint`
regions) and treats ``PREFER_*`` as hints. Peak memory and recompute cost are
estimated statically from the tape (shapes, dtypes; flops from shapes), by
replaying the same save/release/recompute schedule the interpreter follows
(`problem.estimate`).

Budgets count *activation* residuals: values kept for backward that are not
the function's own inputs (those are alive anyway, whatever is saved).

Search (see `Budget.plan`): keep the hints if they fit; on a chain, the exact
dynamic program (`chain`); on other tapes, the same program over layers (`stages`);
on any tape, the hand-written policies' own decisions (dots saved, ...), cut plans in
the style of Chen et al.'s sublinear checkpointing alone and combined with them, and
greedy search (`families`, `save_recompute`). Every candidate is scored by
`estimate`, the executor's own schedule, so the choice is never worse than a
candidate it tried. With offload or compress allowed, `joint_plan` completes the
candidates with per-residual mechanisms and searches by predicted step time.
Records with side effects (io_callback, any effect `passes.check_effects` rejects)
are never recomputed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tapegrad.core.processes import check_same
from tapegrad.core.residual_policy import SAVE, declared, is_exact, resolve_prefetch
from tapegrad.core.tape import Record, Tape
from tapegrad.engine.checkpoint import CheckpointPolicy as P
from tapegrad.planner import candidates as C
from tapegrad.planner import joint
from tapegrad.planner.cost import ERROR_CLASSES, MECHANISMS, default_costs, device_nbytes
from tapegrad.planner.ilp import mechanisms as ilp_mechanisms
from tapegrad.planner.joint_plan import plan_joint
from tapegrad.planner.problem import (
    BudgetError,
    _from_canonical,
    _keep_effects,
    _to_canonical,
    structure_key,
)
from tapegrad.planner.save_recompute import _save_recompute
from tapegrad.policies._lowbit import LowBit
from tapegrad.policies.compress import Compress, Int8, Int8Blocks
from tapegrad.policies.loops import LoopPlan, choose_loop_schedule
from tapegrad.policies.offload import Offload

__all__ = ["Budget", "budget", "BudgetError"]


class Budget:
    """A residual policy whose tape plan keeps the activation peak under ``bytes``."""

    def __init__(
        self,
        bytes: int,
        base: Any = None,
        allow: Sequence[str] = ("save", "recompute"),
        max_error: str | None = None,
        costs: Any = None,
        key: Any = None,
    ):
        if bytes < 0:
            raise ValueError(f"budget: bytes must be >= 0, got {bytes}")
        self.bytes = int(bytes)
        self.base = SAVE if base is None else base
        self.allow, self.max_error = _check_allow(allow, max_error)
        self.costs = costs
        self.key = key  # stochastic rounding's, for the low-bit formats
        # Per-residual mechanisms beside save/recompute: offload, and the compress
        # formats whose error class max_error admits.
        self.mechanisms = _mechanisms(self.allow, self.max_error)
        # Not a plain policy once residuals may be moved or shrunk (see _base.is_plain).
        self.packs = bool(self.mechanisms)
        # Values backward rebuilds (`_rebuild.rebuilt_records`) are part of the plan; a
        # rebuild from a compressed operand errs within the class max_error admits.
        self.exact = is_exact(self.base)
        self.last: dict[str, Any] = {}
        # Plans by tape structure: tg.grad, memory_report and jit of one function
        # trace the same tape; planning it once keeps tracing cheap. Bounded.
        self._plans: dict[tuple, tuple[list[str], dict[str, Any], dict, dict]] = {}
        # The mechanism of each residual of the tape planned last (residual key -> name).
        self._mech: dict[Any, str] = {}
        self._res_canon: dict[Any, tuple[str, int, float]] = {}
        self._impl: dict[str, Any] = {}
        # What every process agreed to plan with (`_check_processes`), last time.
        self._agreed: dict[str, Any] | None = None

    @property
    def prefetch(self) -> int | str:
        """How many records ahead backward brings offloaded residuals back: the depth
        the last plan was made with (`cost.prefetch_depth`, or less where the deeper
        copies would not fit the budget)."""
        if "offload" in self.mechanisms:
            return int(self.last.get("prefetch", 1))
        return declared(self.base, "prefetch", 0)

    def _mechanism(self, name: str) -> Any:
        impl = self._impl.get(name)
        if impl is None:
            impl = {
                "offload": lambda: Offload(),
                "bf16": lambda: Compress(jnp.bfloat16),
                "int8": lambda: Compress("int8"),
                "4-bit": lambda: Compress(bits=4, key=self.key),
                "2-bit": lambda: Compress(bits=2, key=self.key),
            }[name]()
            self._impl[name] = impl
        return impl

    def pack(self, value, info):
        if self.packs and not info.loops:
            mech = self._mech.get(info.record.residual_key(info.saved), "save")
            if mech != "save":
                return self._mechanism(mech).pack(value, info)
        return self.base.pack(value, info)

    def unpack(self, packed, info):
        if self.packs and not info.loops:
            mech = _packed_by(packed, info, self.base)
            if mech is not None:
                return self._mechanism(mech).unpack(packed, info)
        return self.base.unpack(packed, info)

    def loop_segment(self, rec: Record) -> Any:
        """A checkpoint schedule (`policies.loops.LoopPlan`) for a scan whose per-step
        residuals, over all its steps, do not fit the budget: among keep-every-step,
        one level every k steps, nested levels, the halving schedule and binomial
        (revolve) schedules, the one re-running the fewest forward steps whose predicted
        backward peak fits (`choose_loop_schedule`, by `_loops.schedule_costs`).
        (Loops are scheduled on their own: the tape plan does not yet trade a loop's
        bytes against the records around it.)"""
        if rec.primitive != "scan" or rec.trip_count < 4:
            return LoopPlan()
        self._check_processes()
        return choose_loop_schedule(rec, self.bytes)

    def _costs(self) -> Any:
        return self.costs if self.costs is not None else default_costs()

    def plan_fields(self) -> dict[str, Any]:
        """What a plan depends on beside the tape: the budget, the mechanisms, the cost
        model's figures and the searches' work limits (`candidates`), by name."""
        fields: dict[str, Any] = {
            "bytes": self.bytes,
            "allow": list(self.allow),
            "max_error": self.max_error,
            "base": type(self.base).__qualname__,
            "highspy": ilp_mechanisms.available(),
        }
        costs = self._costs()
        for f in dataclasses.fields(costs):
            fields[f"costs.{f.name}"] = getattr(costs, f.name)
        for name in C.__all__:
            v = getattr(C, name)
            fields[f"candidates.{name}"] = list(v) if isinstance(v, tuple) else v
        return fields

    def _check_processes(self) -> None:
        """In a multi-process run, every process must plan the same tape the same way,
        or their programs (and collectives) would not match: compare `plan_fields`
        across processes, once per set of figures (`core.processes.check_same`)."""
        if jax.process_count() <= 1:
            return
        fields = self.plan_fields()
        if fields == self._agreed:
            return
        check_same(
            "tg.policies.budget",
            fields,
            "Give every process the same budget(bytes=...), allow= and max_error=, and the "
            "same cost model: call tg.policies.calibrate() on every process (it measures on "
            "process 0 and shares the figures) or on none, or pass the same "
            "budget(costs=CostModel(...)) everywhere.",
        )
        self._agreed = fields

    def plan(
        self, tape: Tape, fixed: Sequence[str | None], rebuilt: AbstractSet[int] = frozenset()
    ) -> list[str]:
        """Decisions for every record; ``fixed[i]`` is a binding decision or None;
        ``rebuilt``: records backward can rebuild from operands kept anyway
        (`_rebuild.rebuilt_records`), hinted "recompute" where free.

        1. Records with side effects are kept ("save"): recomputing them would run
           the effect again (`passes.check_effects` would reject the plan).
        2. If the hints (PREFER_x means x; unannotated means save) fit, keep them.
        3. Otherwise score candidates with `estimate` (the executor's schedule) and
           keep the fitting one with the least recompute flops: the exact chain
           program when the tape is a chain (`chain`), else the same
           program over layers (`stages`); the hand-written policies'
           decisions, cut plans alone and combined with them, ratio plans, a greedy
           descent on small tapes, then a greedy refinement of the best
           (`families`, `save_recompute`).
        ``self.last`` says what was chosen: peak bytes, flops, the winning family.
        """
        self._check_processes()
        fixed = _keep_effects(tape, fixed)
        choose = declared(self.base, "choose")

        def hint(r: Record) -> Any:
            if r.index in rebuilt:
                return P.PREFER_RECOMPUTE
            return choose(r) if choose is not None else None

        hints = [hint(r) if f is None else None for r, f in zip(tape.records, fixed)]
        key = (structure_key(tape, fixed), tuple(hints))
        if key in self._plans:
            dec, self.last, canon, self._res_canon = self._plans[key]
            self._mech = _from_canonical(tape, canon)
            return list(dec)
        if self.mechanisms:
            chosen, canon = self._plan_joint(tape, fixed, hints)
        else:
            if "recompute" not in self.allow:  # e.g. allow=("save", "compress"), lossless
                fixed = [f or "save" for f in fixed]
            costs = self._costs()
            sc, best = _save_recompute(
                tape,
                fixed,
                hints,
                self.bytes,
                lambda: (
                    C._joint_ilp_candidate(tape, fixed, self, costs)
                    if "recompute" in self.allow
                    else []
                ),
                seg_flops=costs.segment_flops(),
                least=True,
            )
            if best is None:
                raise BudgetError(
                    f"no save/recompute plan found that keeps activation residuals under "
                    f"{self.bytes:,} bytes; the smallest peak among the plans tried is "
                    f"{sc.floor:,} bytes. Raise the budget to at least that, or make a "
                    "finer-grained program (e.g. tg.checkpoint per layer) so less must be "
                    "held at once."
                )
            flops, peak, chosen, family = best
            segs = sc.index.segments(chosen)
            kept = sc.index.residual_keys(segs)[0]
            tl = sc.timeline(chosen, resolve_prefetch(self, tape))
            self.last = {
                "peak_bytes": peak,
                # the flops themselves: the objective adds `segment_s` per segment
                "recompute_flops": flops - len(segs) * sc.index.seg_flops,
                "recompute_segments": len(segs),
                "plan": family,
                "plans_scored": sc.scores,
                "residuals": {
                    k: ("save", device_nbytes(v), 0.0)
                    for k, v in kept.items()
                    if k not in sc.index.free
                },
                "timeline": tuple(
                    zip(tl.labels, joint.live_bytes(tl, tl.full, np.zeros_like(tl.full)).tolist())
                ),
            }
            canon = {}
        self._mech = _from_canonical(tape, canon)
        # Each kept residual's (mechanism, device bytes, predicted seconds), by names that
        # survive re-tracing: `memory_report` shows them on its own trace (`decisions`).
        self._res_canon = _to_canonical(tape, self.last.get("residuals", {}))
        if len(self._plans) >= 8:
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = (list(chosen), self.last, canon, self._res_canon)
        return list(chosen)

    def decisions(self, tape: Tape) -> dict[Any, tuple[str, int, float]]:
        """Residual key of ``tape`` (a trace of the function planned last) -> (mechanism:
        "save" / "offload" / "bf16" / "int8", device bytes, predicted seconds it adds)."""
        return _from_canonical(tape, self._res_canon)

    def _plan_joint(self, tape: Tape, fixed: list, hints: list) -> tuple[tuple, dict]:
        """`joint_plan.plan_joint`: the plan with mechanisms (a benchmark wraps this)."""
        return plan_joint(self, tape, fixed, hints)

    def __repr__(self) -> str:
        return f"budget(bytes={self.bytes:,}, base={self.base!r})"


_KNOWN = ("save", "recompute", "offload", "compress")

# max_error -> its level: `ERROR_CLASSES`' order, lossless (or None) first
_ERRORS: dict[str | None, int] = {None: 0} | {c: i for i, c in enumerate(ERROR_CLASSES)}


def _check_allow(allow: Sequence[str], max_error: str | None) -> tuple[tuple[str, ...], Any]:
    if isinstance(allow, str):
        allow = (allow,)
    allow = tuple(allow)
    bad = [a for a in allow if a not in _KNOWN]
    if bad or "save" not in allow:
        raise ValueError(
            f"budget: allow must name some of {_KNOWN}, 'save' among them; got {allow!r}."
        )
    if max_error not in _ERRORS:
        raise ValueError(
            "budget: max_error must be None (lossless), 'bf16', 'int8', '4-bit' or "
            f"'2-bit'; got {max_error!r}."
        )
    return allow, max_error


def _mechanisms(allow: tuple[str, ...], max_error: str | None) -> tuple[str, ...]:
    out = []
    if "offload" in allow:
        out.append("offload")
    if "compress" in allow:
        level = _ERRORS[max_error]
        out += [
            m for m, c in MECHANISMS.items() if m not in ("save", "offload") and _ERRORS[c] <= level
        ]
    return tuple(out)


def _packed_by(packed: Any, info: Any, base: Any) -> str | None:
    """Which mechanism packed ``packed`` (None: the base policy did): compress formats
    and host memory say so themselves, so unpack needs no lookup that a later plan
    of another tape could have replaced."""

    if isinstance(packed, (Int8, Int8Blocks)):
        return "int8"
    if isinstance(packed, LowBit):
        return f"{packed.bits}-bit"
    if not isinstance(packed, jax.Array):
        return None
    if isinstance(packed, jax.core.Tracer):
        space = getattr(jax.typeof(packed), "memory_space", None)
        on_host = space is not None and "host" in str(space).lower()
    else:
        on_host = "host" in str(getattr(packed.sharding, "memory_kind", "") or "")
    if on_host:
        return "offload"
    if base is SAVE and np.dtype(packed.dtype) != np.dtype(info.dtype):
        return "bf16"
    return None


def budget(
    bytes: int,
    base: Any = None,
    *,
    allow: Sequence[str] = ("save", "recompute"),
    max_error: str | None = None,
    costs: Any = None,
    key: Any = None,
) -> Budget:
    """Let the planner choose, per residual, how to keep activation residuals under
    ``bytes`` (device bytes, per device) at the least predicted step time.

    ```python
    tg.grad(loss, policy=tg.policies.budget(bytes=64 << 20))(params, x)
    tg.grad(loss, policy=tg.policies.budget(
        bytes=64 << 20, allow=("save", "recompute", "offload", "compress"), max_error="bf16"
    ))(params, x)
    ```
    ``allow`` names the mechanisms it may use: ``"save"`` (always), ``"recompute"``
    (re-run records in backward), ``"offload"`` (host memory between forward and
    backward, `tg.policies.offload`), ``"compress"`` (`tg.policies.compress`, in the
    formats whose error ``max_error`` admits: None = lossless only, so none;
    ``"bf16"``; ``"int8"``, which admits bf16 too; ``"4-bit"`` and ``"2-bit"``,
    `compress(bits=...)`'s stochastic rounding with the noise drawn from ``key=`` (an
    int seed or a `jax.random.key`, default seed 0: pass a fresh one each step, as to
    `compress`)). Each costs predicted time by
    ``costs`` (a `tg.policies.CostModel`; default: `tg.policies.calibrate`'s figures
    once measured, else per-backend defaults). ``base`` is the residual policy for
    what is saved; a `tg.selective` base makes its ALWAYS/NEVER binding and its
    PREFER_* hints. Records with side effects are never chosen for recompute. A
    budget no plan meets raises `BudgetError` naming the least peak found.
    """
    return Budget(bytes, base, allow, max_error, costs, key)
