"""The rule registry: primitive name -> `Rule`.

A rule says, per differentiable input, which residuals its cotangent needs
(``"x0"`` = input 0, ``"y0"`` = output 0, ``"a0"`` = derived value 0) and how
to compute it. The tape's `Record.saves` is the union of the needs of the
inputs that are actually differentiated, so ``x * w`` with only ``w``
differentiated saves ``x`` alone.

Rules are written with jax ops, so backward is itself traceable: that is what
makes ``jax.jit(tg.grad(f))`` and ``tg.grad(tg.grad(f))`` work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from tapegrad.core.tape import Saved, Var

__all__ = [
    "Rule",
    "Res",
    "RULES",
    "NONDIFF",
    "defvjp",
    "deflinear",
    "defrule",
    "defnondiff",
    "lookup",
    "keeping_operands",
    "share_operands",
]

Ref = tuple[str, int]
# a ref to a value read only where it is positive: (kind, i, "positive")
PositiveRef = tuple[str, int, str]


def parse_ref(s: str) -> Ref:
    kind = {"x": "in", "y": "out", "a": "aux"}[s[0]]
    return (kind, int(s[1:]))


class Res:
    """What a rule sees in backward: saved values and every operand's shape/dtype.

    ``r.x[i]`` / ``r.y[j]`` / ``r.aux[k]`` are the saved input / output / derived
    values (``None`` where not saved); ``r.in_avals[i]`` and ``r.out_avals[j]``
    always give ``.shape`` and ``.dtype``.
    """

    __slots__ = ("x", "y", "aux", "in_avals", "out_avals", "record")

    def __init__(self, x, y, aux, in_avals, out_avals, record=None):
        self.x, self.y, self.aux = x, y, aux
        self.in_avals, self.out_avals = in_avals, out_avals
        self.record = record


@dataclass(frozen=True, slots=True)
class Rule:
    """A reverse-mode rule.

    saves(params, in_avals, out_avals, active) -> tuple of refs to keep.
    vjp(params, res, cts, active) -> one cotangent (or None) per input;
      ``cts`` has one entry per output, None where the output got no cotangent.
    derive(record, ins) -> (outs, derived values): replaces the plain bind in
      forward when the rule keeps values the primitive does not output.
    aux_avals(params, in_avals, out_avals, active) -> derived values' avals (objects with
      ``.shape`` and ``.dtype``, e.g. `jax.ShapeDtypeStruct`).
    """

    name: str
    saves: Callable[..., tuple[Ref, ...]]
    vjp: Callable[..., Sequence[Any]]
    derive: Callable[..., tuple[Sequence[Any], Any]] | None = None
    aux_avals: Callable[..., Sequence[tuple]] | None = None
    kind: str = "rule"
    # plain(params, in_avals, out_avals, active) -> refs to the values the rule can read
    # instead of its derived values (max's masks from its inputs x and y, relu's mask
    # from its output: ``x > 0`` is ``relu(x) > 0``), or None where it has no such form;
    # used when those values are kept anyway (`keeping_operands`); vjp then finds those
    # derived values None. A ref ``(kind, i, "positive")`` is read only where the value
    # (>= 0) is positive (relu's output: `Saved.reads_positive`).
    plain: Callable[..., tuple[Ref | PositiveRef, ...] | None] | None = None
    # links(params, active, out_useful) -> per input, whether a cotangent of the outputs
    # marked useful can reach it (None: every active input, when any output is useful).
    # An input it cannot reach gets a symbolic zero, decided when the tape is built, as
    # jax's linearize knows which tangents a custom_jvp rule reads (rules/custom_jvp.py).
    links: Callable[..., Sequence[bool]] | None = None
    # aliases(params, active) -> per derived value, the input ("in", i), output ("out",
    # j) or earlier derived value ("aux", k) it is the very array of when run, or None:
    # it then shares that value's residual key (`Record.aliases`), kept once.
    aliases: Callable[..., Sequence[tuple[str, int] | None]] | None = None


RULES: dict[str, Rule] = {}
# Primitives whose outputs carry no cotangent (their derivative is zero or
# undefined): comparisons, rounding, integer ops, stop_gradient, ...
NONDIFF: set[str] = set()


def lookup(name: str) -> Rule | None:
    return RULES.get(name)


def defrule(rule: Rule) -> Rule:
    RULES[rule.name] = rule
    return rule


def defnondiff(*names: str) -> None:
    NONDIFF.update(names)


def defvjp(
    name: str,
    *per_input: tuple[str, Callable] | None,
    single_out: bool = True,
    derive=None,
    aux_avals=None,
    plain=None,
) -> Rule:
    """Register per-input cotangent functions, HIPS-autograd style.

    Each entry is ``(needs, fn)``: ``needs`` is a space-separated string of refs
    (``"x1"``, ``"y0"``, ``""`` for none), ``fn(g, r, p)`` returns the input's
    cotangent from the output cotangent ``g`` (a tuple for multi-output
    primitives), the `Res` view ``r`` and the params ``p``. ``None`` marks an
    input that never gets a cotangent (e.g. an integer index).
    """
    needs = [tuple(parse_ref(s) for s in entry[0].split()) if entry else () for entry in per_input]
    fns = [entry[1] if entry else None for entry in per_input]

    def saves(p, in_avals, out_avals, active):
        refs: list[Ref] = []
        for i, a in enumerate(active):
            if a and i < len(needs):
                for ref in needs[i]:
                    if ref not in refs:
                        refs.append(ref)
        return tuple(refs)

    def vjp(p, r, cts, active):
        g = cts[0] if single_out else cts
        out = []
        for i, a in enumerate(active):
            fn = fns[i] if i < len(fns) else None
            out.append(fn(g, r, p) if (a and fn is not None) else None)
        return out

    return defrule(Rule(name, saves, vjp, derive, aux_avals, plain=plain))


def deflinear(name: str, *per_input: Callable | None) -> Rule:
    """A rule for a primitive that is linear in each input: saves nothing.

    Each entry is ``fn(g, r, p)``; ``r`` carries only avals.
    """
    return defvjp(name, *[("", fn) if fn is not None else None for fn in per_input])


def keeping_operands(rec):
    """``rec`` keeping the inputs or outputs its rule can read instead of its derived
    values (bit-packed masks), or None when it keeps no derived values or its rule has
    no such form. Callers decide when that is worth it: when those values are kept
    anyway (`share_operands`, `_rebuild.rebuilt_records`), or rebuilt in backward for
    free (`_rebuild.rebuilt_records`)."""
    rule = RULES.get(rec.primitive)
    if rule is None or rule.plain is None or not any(s.kind == "aux" for s in rec.saves):
        return None
    refs = rule.plain(rec.params, rec.inputs, rec.outputs, rec.active)
    if refs is None:
        return None
    saves = []
    for kind, i, *how in refs:
        v = rec.inputs[i] if kind == "in" else rec.outputs[i]
        if isinstance(v, Var):  # a literal lives in the program
            sharding = getattr(v, "sharding", None)
            positive = how == ["positive"]
            saves.append(Saved(kind, i, tuple(v.shape), v.dtype, sharding, positive))
    return dataclasses.replace(rec, saves=tuple(saves))


def share_operands(rec, free: AbstractSet[int]):
    """``rec`` keeping its inputs instead of values derived from them (bit-packed masks)
    when every such input is a literal or in ``free`` (values another record saves).
    Packed masks cost a bit per element; operands kept anyway cost nothing. Returns the
    record unchanged otherwise, and for a form reading an output (relu's mask).

    Blind to the policy: a lossy one would hand backward rounded operands, and masks read
    off them would be wrong. Only loop bodies use it; a function's own tape switches in
    `_rebuild.rebuilt_records`, where the policy is known."""
    plain = keeping_operands(rec)
    if plain is None or any(
        s.kind != "in" or rec.inputs[s.index].id not in free for s in plain.saves
    ):
        return rec
    return plain
