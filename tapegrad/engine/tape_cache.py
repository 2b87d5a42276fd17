"""The tape cache: a training loop traces the same program on every step, so a built
tape is kept per program *structure* (`tape_key`: its equations and avals) and reused
with the call's own closed-over arrays and literal values swapped in (`with_values`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Sequence
from typing import Any

import numpy as np

from tapegrad.core import jax_compat as compat
from tapegrad.core.caches import BoundedCache
from tapegrad.core.keys import NoKey, value_key
from tapegrad.core.tape import Lit, Tape

__all__ = ["param_key", "tape_key", "with_values"]


# Building a tape costs ~20 us per record (records, activity, what each saves); a training
# loop traces the same program on every step, so the tape is kept per program *structure*
# (its equations and avals): the call's closed-over arrays and its literals' values (a
# learning rate, a temperature) are swapped in, never part of the key.
_TAPES = BoundedCache("trace.tapes", max_entries=256)


def tape_key(closed, active, diff, in_tree, out_tree, owner, lits: list) -> Any:
    """The program's structure, or None when it holds something only identity could key
    (a custom_jvp rule, a callback, a nested constant) or has effects. Appends the
    program's top-level literals to ``lits``, whose values the key leaves out."""
    if owner is None or closed.jaxpr.effects:
        return None
    owner = getattr(owner, "__code__", owner)  # a lambda re-made per call: same code
    try:
        structure = _structure(closed.jaxpr, lits)
        return _Hashed((owner, structure, tuple(active), tuple(diff), in_tree, out_tree))
    except (NoKey, TypeError, ValueError):
        return None


class _Hashed:
    """A key hashed once: a big tuple is hashed anew on every dict operation (~0.1 ms
    for a few hundred equations), and a cache lookup makes several."""

    __slots__ = ("key", "hash")

    def __init__(self, key: tuple):
        self.key, self.hash = key, hash(key)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return type(other) is _Hashed and other.hash == self.hash and other.key == self.key


def _structure(j, lits: list | None) -> tuple:
    """Equations and avals of a jaxpr. Top level (``lits`` a list): constants and
    literals by aval only, the literals appended to ``lits``. Nested (``lits`` None, a
    jit's or a loop body's jaxpr): literals by value, no constants. Avals are compared as
    objects (shape, dtype, weak type, sharding): printing them costs more than building
    the tape."""
    if lits is None and j.constvars:
        raise NoKey
    ids: dict[Any, int] = {}
    for v in j.constvars:
        ids[v] = len(ids)
    for v in j.invars:
        ids[v] = len(ids)

    def use(v) -> Any:
        if type(v) is compat.Literal:
            if lits is None:
                return ("lit", value_key(np.asarray(v.val)[()]), v.aval)
            lits.append(v)
            return ("lit", v.aval)
        return ids[v]

    eqns = []
    for e in j.eqns:
        ins = tuple([use(v) for v in e.invars])
        for v in e.outvars:
            ids[v] = len(ids)
        if e.primitive.name == "custom_jvp_call":
            params = _custom_jvp_key(e.params)
        else:
            params = tuple([(k, param_key(p)) for k, p in e.params.items()])
        eqns.append((e.primitive, params, ins, tuple([v.aval for v in e.outvars])))
    return (
        tuple([v.aval for v in j.constvars]),
        tuple([v.aval for v in j.invars]),
        tuple(eqns),
        tuple([use(v) for v in j.outvars]),
    )


_NUMERIC = (bool, int, float, complex, np.generic, np.ndarray)


_FUNCTIONS = (types.FunctionType, types.MethodType, functools.partial)


def param_key(v: Any) -> Any:
    """A parameter: nested jaxprs by structure, numbers by type and value (`value_key`),
    jax's own parameter objects (shardings, layouts, enums) by their equality."""
    if isinstance(v, compat.ClosedJaxpr):
        if v.consts:
            raise NoKey
        return ("closed", _structure(v.jaxpr, None))
    if isinstance(v, compat.Jaxpr):
        return ("jaxpr", _structure(v, None))
    if type(v) is tuple:
        return ("tuple", tuple([param_key(x) for x in v]))
    try:
        return value_key(v)
    except NoKey:
        if isinstance(v, _NUMERIC) or isinstance(v, _FUNCTIONS):
            raise  # numbers need their type and exact value; functions differ per trace
        hash(v)
        return (type(v), v)


def _custom_jvp_key(params) -> tuple:
    """A ``custom_jvp_call`` by its function's structure and its rule: the user's rule
    function (an identity, as `jax.jit` keys a function) and the static arguments jax
    bound to it. Closures jax creates per trace (output stores) are not part of it."""
    parts = compat.custom_jvp_rule_parts(params)
    if parts is None:
        raise NoKey
    fn, transforms = parts
    statics = []
    for gen, args in transforms:
        key = []
        for a in args:
            wrapped, v = compat.unhashable_value(a)
            if wrapped:
                key.append(("static", value_key(v)))
            elif getattr(a, "__name__", None) == "<lambda>":
                continue  # jax's per-trace accessor of the rule's output treedef
            else:
                hash(a)
                key.append(a)
        statics.append((gen, tuple(key)))
    return (
        ("call_jaxpr", param_key(params["call_jaxpr"])),
        ("rule", fn, tuple(statics)),
        ("num_consts", params["num_consts"]),
        ("symbolic_zeros", params["symbolic_zeros"]),
    )


def with_values(tape: Tape, consts: Sequence[Any], old: list[Lit], new: list) -> Tape:
    """``tape`` with these constant values, and literal ``old[i]`` reading ``new[i].val``."""
    changes: dict[str, Any] = {}
    if tape.consts:
        changes["consts"] = tuple((v, c) for (v, _), c in zip(tape.consts, consts))
    swap = {id(o): Lit(n.val, o.shape, o.dtype) for o, n in zip(old, new)}
    if swap:

        def lits(ops):
            return tuple(swap.get(id(i), i) if type(i) is Lit else i for i in ops)

        changes["records"] = tuple(
            dataclasses.replace(r, inputs=lits(r.inputs))
            if any(id(i) in swap for i in r.inputs)
            else r
            for r in tape.records
        )
        changes["outputs"] = lits(tape.outputs)
    return dataclasses.replace(tape, **changes) if changes else tape
