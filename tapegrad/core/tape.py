"""The explicit tape: frozen records of primitive applications.

A `Tape` is data. It is built once by `tg.trace` (or internally by `tg.grad`)
and never mutated; passes build new tapes. State that changes while a tape
runs (values, residual stores, cotangents) lives in the interpreter.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, cast

import jax
import numpy as np

from tapegrad.core import jax_compat as compat
from tapegrad.core.caches import LookupTable
from tapegrad.core.sizes import as_dtype, device_nbytes, itemsize, sharding_of

__all__ = [
    "Var",
    "Lit",
    "Saved",
    "Record",
    "Tape",
    "RecordKind",
    "register_kind",
    "kind_of",
    "register_printer",
    "is_differentiable_dtype",
    "custom_vjp_name",
    "function_name",
]


def _short_dtype(dtype: np.dtype) -> str:
    d = as_dtype(dtype)
    if not isinstance(d, np.dtype):
        return str(d)
    names = {"float": "f", "int": "i", "uint": "u", "complex": "c", "bool": "bool"}
    for long, short in names.items():
        if d.name.startswith(long):
            return d.name.replace(long, short, 1) if short != "bool" else "bool"
    return d.name


def aval_str(shape: tuple[int, ...], dtype: Any) -> str:
    return f"{_short_dtype(dtype)}[{','.join(map(str, shape))}]"


def _letters(n: int) -> str:
    s = ""
    n += 1
    while n:
        n, r = divmod(n - 1, 26)
        s = chr(ord("a") + r) + s
    return s


@dataclass(frozen=True, slots=True)
class Var:
    """A value on the tape: an input, a constant, or a record's output."""

    id: int
    shape: tuple[int, ...]
    dtype: np.dtype
    # The value's type-level sharding (``aval.sharding``) as traced; rules whose
    # backward must name an output sharding under Explicit mesh axes read it.
    sharding: Any = field(default=None, compare=False, repr=False)
    # Where the value lives on an Auto mesh when the tape runs eagerly, a concrete
    # sharding (`tapegrad.engine.placement`); sizes only, no rule reads it.
    placement: Any = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes one device holds: the shard's, where the value's type (Explicit axes) or
        placement (Auto axes) says it is sharded; else the whole value's."""
        return device_nbytes(self.shape, self.dtype, sharding_of(self))

    @property
    def global_nbytes(self) -> int:
        """Bytes of the whole value, over all devices' shards."""
        return math.prod(self.shape) * itemsize(self.dtype)

    @property
    def aval(self) -> str:
        return aval_str(self.shape, self.dtype)

    def __str__(self) -> str:
        return _letters(self.id)


@dataclass(frozen=True, slots=True, eq=False)
class Lit:
    """A literal operand (a constant scalar folded into the equation by jax)."""

    value: Any
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return 0  # literals live in the program, not in memory the tape owns

    def __str__(self) -> str:
        v = np.asarray(self.value)
        # a numpy scalar prints the shortest repr of its own precision (0.044715, not
        # float32's value widened to 0.044714998453855515)
        return f"{str(v[()]) if v.ndim == 0 else v}:{aval_str(self.shape, self.dtype)}"


@dataclass(frozen=True, slots=True)
class Saved:
    """One residual a record keeps for backward.

    `kind` is ``"in"`` (the record's `index`-th input), ``"out"`` (its output)
    or ``"aux"`` (a value derived in forward, e.g. a custom_vjp residual).
    """

    kind: str
    index: int
    shape: tuple[int, ...]
    dtype: np.dtype
    # The value's type-level sharding when it is a record's input or output (see Var).
    sharding: Any = field(default=None, compare=False, repr=False)
    # This record's backward reads only where the value (>= 0) is positive: relu's mask
    # ``x > 0`` read off its output ``relu(x)`` instead of kept. A lossy policy may keep
    # the value as it likes provided zeros stay zero and positives positive
    # (`compress(bits=...)` does, `_lowbit`'s zero-exact codes).
    reads_positive: bool = False
    # Its placement on an Auto mesh (see Var). Last: callers pass the fields above by
    # position.
    placement: Any = field(default=None, compare=False, repr=False)

    @property
    def ref(self) -> tuple[str, int]:
        return (self.kind, self.index)

    @property
    def nbytes(self) -> int:
        """Bytes one device holds (the shard's where its sharding is known, see Var)."""
        return device_nbytes(self.shape, self.dtype, sharding_of(self))

    def __str__(self) -> str:
        tag = {"in": "in", "out": "out", "aux": "aux"}[self.kind]
        return f"{tag}{self.index}"


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class Record:
    """One primitive application on the tape.

    Attributes:
      index: position on the tape.
      primitive: the jax primitive's name, e.g. ``"tanh"``.
      inputs, outputs: the `Var` / `Lit` operands and the result `Var`s.
      params: the equation's parameters (read-only).
      saves: the residuals this record keeps for backward (empty when the
        record takes no part in backward).
      active: per input, whether backward computes a cotangent for it.
      rule: ``"rule"`` (a tapegrad rule), ``"fallback"`` (jax.vjp of the single
        primitive, saving its inputs), or ``"none"`` (not in backward).
      decision: ``"save"`` (its outputs may be kept as residuals) or
        ``"recompute"`` (they are recomputed in backward from saved values).
      region: the checkpoint region (a `jax.checkpoint` / `tg.checkpoint` call)
        the record was inlined from, if any.
      names: names given to the record's output with `tg.name` / `checkpoint_name`.
      bodies: for a loop or branch record (``scan``, ``cond``), the sub-tapes it runs:
        a scan's body (run `trip_count` times), a cond's branches (one runs). Their
        records save per-step residuals, packed through the same residual policy.
    """

    index: int
    primitive: str
    inputs: tuple[Var | Lit, ...]
    outputs: tuple[Var, ...]
    params: Mapping[str, Any]
    saves: tuple[Saved, ...] = ()
    active: tuple[bool, ...] = ()
    rule: str = "none"
    decision: str = "save"
    region: int | None = None
    names: tuple[str, ...] = ()
    prim: Any = field(default=None, repr=False)
    source_info: Any = field(default=None, repr=False)
    bind_params: Any = field(default=None, repr=False)
    bodies: tuple[Tape, ...] = ()
    # A scan's checkpoint schedule: keep the carry every `schedule` steps and recompute
    # each segment's residuals in backward (0: keep every step's residuals).
    schedule: int = 0
    # A nested schedule's inner levels: the segment lengths a recomputed segment (and the
    # remainder) is itself checkpointed with, outermost first (() for one level).
    inner_schedule: tuple[int, ...] = ()
    # Binomial checkpointing (revolve): at most `snapshots` carries held at once, the
    # fewest forward steps re-run for that (0: not revolve; `schedule` is then 0).
    snapshots: int = 0
    # Per derived value (``aux`` residual): the value it is the very array of when run,
    # ``("in", i)`` / ``("out", j)`` / ``("aux", k)`` (`residual_key` shares that value's
    # key), ``("lit", k)`` for a constant (no array: `caller_ids`), or None; () where
    # none is (a custom_vjp's fwd returning an operand, its output, one residual twice
    # or a constant: `jax_compat.custom_vjp_residual_aliases`).
    aliases: tuple[tuple[str, int] | None, ...] = field(default=(), repr=False)

    @property
    def trip_count(self) -> int:
        """How many times a body runs per execution of this record (1 for a branch)."""
        return int(self.params.get("length", 1)) if self.primitive == "scan" else 1

    @property
    def source(self) -> str:
        """The user's source line that produced this record, ``file:line (function)``."""
        frame = compat.frame_of(self.source_info)
        if frame is None:
            return "<unknown>"
        file, line, fn = frame
        return f"{file}:{line} ({fn})"

    @property
    def short_source(self) -> str:
        frame = compat.frame_of(self.source_info)
        if frame is None:
            return "<unknown>"
        file, line, fn = frame
        return f"{file.rsplit('/', 1)[-1]}:{line} ({fn})"

    @property
    def saved_bytes(self) -> int:
        return sum(s.nbytes for s in self.saves)

    def residual_key(self, s: Saved) -> Any:
        """The key of one of this record's residuals: the `Var` id for an input or
        output (shared by every record saving that value), ``("aux", record, k)``
        for a derived value, the key of the value it is where it is one (`aliases`)."""
        kind, index = s.kind, s.index
        if kind == "aux":
            alias = self.aliases[index] if self.aliases else None
            if alias is None or alias[0] in ("aux", "lit"):
                return ("aux", self.index, index if alias is None else alias[1])
            kind, index = alias
            v = self.inputs[index] if kind == "in" else self.outputs[index]
            return v.id if isinstance(v, Var) else ("aux", self.index, s.index)
        v = self.inputs[index] if kind == "in" else self.outputs[index]
        return cast(Var, v).id  # a literal input is never saved (the program holds it)

    @property
    def in_backward(self) -> bool:
        return self.rule != "none"

    def params_str(self) -> str:
        s = " ".join(self.param_items())
        return f"[{s}]" if s else ""

    def param_items(self) -> list[str]:
        """The params as ``k=v`` strings; sub-programs and callables shown as ``…``."""
        items = []
        if self.primitive == "custom_vjp_call":  # show the function (tg.Function class) name
            items.append(f"name={custom_vjp_name(self.params)}")
        for k, v in self.params.items():
            if k in (
                "jaxpr",
                "call_jaxpr",
                "jvp_jaxpr_fun",
                "fwd_jaxpr_thunk",
                "bwd",
                "out_trees",
                "branches",
                "cond_jaxpr",
                "body_jaxpr",
                "_prim",
            ):
                v = "…"
            items.append(f"{k}={v}")
        return items

    def __str__(self) -> str:
        outs = " ".join(f"{o}:{o.aval}" for o in self.outputs)
        ins = " ".join(str(i) for i in self.inputs)
        line = f"{outs} = {self.primitive}{self.params_str()} {ins}"
        if self.saves:
            line += f"   saves[{','.join(map(str, self.saves))}]"
        if self.rule == "fallback":
            line += " (fallback)"
        if self.decision == "recompute":
            line += " (recompute)"
        return line


@dataclass(frozen=True, slots=True)
class Region:
    """A checkpointed call (`jax.checkpoint` / `tg.checkpoint`) inlined into the tape."""

    id: int
    policy: Any
    prevent_cse: bool
    source: str


@dataclass(frozen=True, slots=True)
class Segment:
    """Records recomputed together in backward, from saved boundary values.

    ``inputs`` are the values kept from forward (packed through the residual
    policy); ``outputs`` are the residual values the segment provides to
    backward; recomputation runs once, at the first backward use of any of them.
    ``compiled``: eagerly, backward runs the segment as one compiled call (a random
    draw rebuilt from its key), so only its inputs and outputs are ever live arrays.
    """

    id: int
    records: tuple[int, ...]
    inputs: tuple[Var, ...]
    outputs: tuple[Var, ...]
    prevent_cse: bool = True
    compiled: bool = False


def _forwarded(rec: Record) -> list[int | None]:
    """Per output of ``rec``: the input it is the very array of when run, or None."""
    if rec.primitive == "stop_gradient":
        return [0]
    if rec.primitive == "custom_jvp_call" and rec.rule == "none":
        return compat.forwarded_outputs(rec.params["call_jaxpr"].jaxpr)
    if rec.primitive == "custom_jvp_rule":  # its primal part, split from the rule
        primal = getattr(rec.params.get("rule"), "primal", None)
        if primal is not None:
            return compat.forwarded_outputs(primal.jaxpr)[: len(rec.outputs)]
    return []


_READERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CALLER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class Tape:
    """An immutable list of `Record`s, with the tape's inputs, constants and outputs.

    ``str(tape)`` prints one line per record; in Jupyter the tape renders as a table.
    """

    inputs: tuple[Var, ...]
    records: tuple[Record, ...]
    outputs: tuple[Var | Lit, ...]
    consts: tuple[tuple[Var, Any], ...] = ()
    active_inputs: tuple[bool, ...] = ()
    # Per input: whether backward can give it a cotangent (it reaches a differentiated
    # output through rules that pass one); an input that it cannot gets a symbolic zero.
    reached: tuple[bool, ...] = ()
    in_tree: Any = field(default=None, repr=False)
    out_tree: Any = field(default=None, repr=False)
    regions: tuple[Region, ...] = ()
    segments: tuple[Segment, ...] = ()

    @property
    def saved_bytes(self) -> int:
        """Bytes of distinct values kept from forward to backward (literals and constants
        excluded; values recomputed by checkpoint segments excluded, their inputs included)."""
        return sum(self.residual_vars().values())

    def residual_keys(self) -> tuple[dict[Any, Any], dict[Any, int]]:
        """``(kept, recomputed)``: residual key -> Var/Saved for the values packed in
        forward, and key -> segment id for the values recomputed in backward.

        A key is a `Var` id for inputs/outputs, ``("aux", record, k)`` for derived values.
        """
        recomputed: dict[Any, int] = {}
        for seg in self.segments:
            for v in seg.outputs:
                recomputed[v.id] = seg.id
            for i in seg.records:
                rec = self.records[i]
                for s in rec.saves:
                    if s.kind == "aux":
                        recomputed[rec.residual_key(s)] = seg.id
        kept: dict[Any, Any] = {}
        for rec in self.records:
            for s in rec.saves:
                key = rec.residual_key(s)
                if key not in recomputed:
                    kept.setdefault(
                        key,
                        s
                        if s.kind == "aux"
                        else (rec.inputs[s.index] if s.kind == "in" else rec.outputs[s.index]),
                    )
        for seg in self.segments:
            for v in seg.inputs:
                kept.setdefault(v.id, v)
                recomputed.pop(v.id, None)  # kept as a segment input: never recomputed
        return kept, recomputed

    def caller_ids(self) -> frozenset[Any]:
        """Residual keys of the values that are the caller's own arrays when the tape
        runs: its inputs and constants, outputs of records that hand one of them back as
        it is (`jax_compat.forwarded_outputs`: `stop_gradient`, `jnp.asarray`), and a
        custom_vjp's residuals that are its operands (`Record.aliases`) or constants.
        Keeping one costs backward no memory: the caller (or the program) holds it
        anyway. Computed once per tape."""
        got = _CALLER.get(self)
        if got is None:
            ids: set[Any] = {v.id for v in self.inputs} | {v.id for v, _ in self.consts}

            def held(i: int | None, rec: Record) -> bool:
                # a constant handed back is no array either (`stop_gradient(True)`)
                src = rec.inputs[i] if i is not None else None
                return type(src) is Lit or (isinstance(src, Var) and src.id in ids)

            # (a custom_vjp's residual that is its operand has the operand's key: `aliases`)
            for rec in self.records:
                ids.update(out.id for out, i in zip(rec.outputs, _forwarded(rec)) if held(i, rec))
                ids.update(
                    ("aux", rec.index, k)
                    for k, a in enumerate(rec.aliases)
                    if a and (a[0] == "lit" or (a[0] == "in" and type(rec.inputs[a[1]]) is Lit))
                )
            got = _CALLER[self] = frozenset(ids)
        return got

    def readers(self) -> dict[Any, tuple[tuple[Record, Saved], ...]]:
        """Residual key -> every ``(record, Saved)`` keeping that value, in forward order
        (`ResidualInfo.readers`). Computed once per tape."""
        got = _READERS.get(self)
        if got is None:
            acc: dict[Any, list] = {}
            for rec in self.records:
                for s in rec.saves:
                    acc.setdefault(rec.residual_key(s), []).append((rec, s))
            got = _READERS[self] = {k: tuple(v) for k, v in acc.items()}
        return got

    def residual_vars(self) -> dict[Any, int]:
        """Distinct values kept for backward and their bytes: a value saved by several
        records counts once; constants (owned by the tape) are not counted.

        A loop or branch record's per-step residuals are one entry, keyed
        ``("body", record index)`` like the interpreter's store: their bytes in all
        (`loop_residual_bytes`: one step's × the trip count, a carry saved as a step's
        input and the previous step's output once, nested loops multiplied; a cond's
        branches summed, the union a traced program holds). Under `save()`; a policy
        can keep more under ``jax.jit`` (carries stacked twice) or less (compress).
        """
        const_ids = {v.id for v, _ in self.consts}
        kept, _ = self.residual_keys()
        out = {k: v.nbytes for k, v in kept.items() if k not in const_ids}
        for rec in self.records:
            if rec.bodies and rec.in_backward:
                n = kind_of(rec).residual_bytes(rec)
                if n:
                    out[("body", rec.index)] = n
        return out

    @property
    def fallback_records(self) -> tuple[Record, ...]:
        return tuple(r for r in self.records if r.rule == "fallback")

    def __len__(self) -> int:
        return len(self.records)

    def __str__(self) -> str:
        return _print(self, "text")

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return _print(self, "html")

    def graph(self, **kwargs: Any) -> Any:
        """The tape drawn as a graph (`tapegrad.display.graph.TapeGraph`): records as boxes with
        their source lines, values as edges, each kept value's bytes and decision;
        ``.svg()`` draws it, and it renders in Jupyter. ``bodies``: loop bodies inside
        their box (True), apart (False) or when they fit (None); ``max_nodes``: boxes to
        fold down to; ``engine``: who lays it out, ``"dot"`` (Graphviz), ``"python"``
        (nothing to install) or ``"auto"`` (Graphviz when its ``dot`` is on PATH)."""
        fn = _PRINTERS.get("graph")
        if fn is None:
            raise RuntimeError(
                "import tapegrad to draw a tape (tapegrad.display.graph registers it)"
            )
        return fn(self, **kwargs)


def frozen_params(params: dict) -> Mapping[str, Any]:
    return MappingProxyType(dict(params))


# ------------------------------------------------------------------ registries
# Higher layers register into these tables on import (as jax's loops register their
# rules into ``ad``): this module computes nothing about loops and draws nothing itself.


@dataclass(frozen=True)
class RecordKind:
    """How a record with bodies (a loop or branch) runs, differentiates and is sized.

    ``forward(rec, ins, res, observer=None, **kw) -> (outputs, stored)`` runs it and packs
    its bodies' residuals through ``res`` (the enclosing `Residuals`);
    ``backward(rec, x, stored, gs, retain, observer=None) -> input cotangents``;
    ``residual_bytes(rec) -> int``: its bodies' residuals over all steps under `save()`.
    """

    forward: Callable[..., tuple[list, Any]]
    backward: Callable[..., list]
    residual_bytes: Callable[[Record], int]


_KINDS: dict[str, RecordKind] = {}


def register_kind(primitive: str, kind: RecordKind) -> None:
    """Records of ``primitive`` that carry bodies run through ``kind``."""
    _KINDS[primitive] = kind


def kind_of(rec: Record) -> RecordKind:
    """The registered kind of a record with bodies."""
    try:
        return _KINDS[rec.primitive]
    except KeyError:
        raise TypeError(
            f"no record kind is registered for '{rec.primitive}' records with bodies "
            "(import tapegrad, which registers scan and cond)"
        ) from None


_PRINTERS: dict[str, Callable[..., Any]] = {}


def register_printer(fmt: str, fn: Callable[..., Any]) -> None:
    """``fn(tape)`` prints a tape as ``fmt`` (``"text"``: ``str(tape)``; ``"html"``:
    Jupyter's ``_repr_html_``; ``"graph"``: ``tape.graph(**kw)``, a picture object)."""
    _PRINTERS[fmt] = fn


def _print(tape: Tape, fmt: str) -> str:
    fn = _PRINTERS.get(fmt)
    if fn is None:  # the report layer is not imported (never after ``import tapegrad``)
        return f"Tape({len(tape.records)} records, {len(tape.inputs)} inputs)"
    return fn(tape)


_DIFFERENTIABLE = LookupTable("trace.differentiable_dtype", max_entries=256)


def is_differentiable_dtype(dtype: Any) -> bool:
    # Asked for every value of every trace; jnp.issubdtype costs microseconds a call.
    try:
        return _DIFFERENTIABLE[dtype]
    except KeyError:
        return _DIFFERENTIABLE.remember(dtype, bool(jax.numpy.issubdtype(dtype, jax.numpy.inexact)))
    except TypeError:  # an unhashable dtype-like
        return bool(jax.numpy.issubdtype(dtype, jax.numpy.inexact))


def custom_vjp_name(params) -> str:
    """The name of a ``custom_vjp_call`` record's function, as jax's jaxpr printer shows it
    (``custom_vjp_call[name=LinearFn ...]``): a `tg.Function`'s class name, else the
    decorated function's name. ``custom_vjp_name(record.params)``."""
    debug = getattr(params["call_jaxpr"].jaxpr, "debug_info", None)
    return getattr(debug, "func_name", None) or "<custom_vjp>"


def function_name(params) -> str | None:
    """The class name of the `tg.Function` a ``custom_vjp_call`` record runs, else None
    (a plain `jax.custom_vjp`): errors then say "Function 'MyFunc'", as PyTorch's do."""
    return getattr(compat.custom_vjp_bwd_function(params), "_tg_function", None)
