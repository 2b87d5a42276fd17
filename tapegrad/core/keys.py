"""Structural cache keys: a plain parameter value, a small array, a sub-jaxpr, keyed by
what it computes, never by object identity (`NoKey` when no key is sound). The compiled
paths (`tapegrad.engine.fused`), the rule caches (`tapegrad.rules.custom_jvp`) and the tape
cache (`tapegrad.engine.trace`) key their entries with these.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

__all__ = ["NoKey", "array_key", "jaxpr_key", "value_key"]


class NoKey(Exception):
    """The tape holds something whose identity, not value, would key the cache."""


_PLAIN = (str, type(None))


# Placement params of a nested jit inside a sub-jaxpr (a custom_jvp call's body): jax
# hashes and compares these by value.
# PRNGImpl: a random_wrap's key implementation (a named tuple of module functions and
# names, hashed by them, as jax's own jit cache keys it). FT*: jax 0.11's FlatTree, a
# scan's operand groups (``ft_in``/``ft_out``; its leaves are None), compared by value.
_JAX_VALUES = frozenset(
    {"UnspecifiedValue", "Mesh", "AbstractMesh", "NamedSharding", "PartitionSpec", "PRNGImpl"}
    | {"FTTuple", "FTPyTree", "FTSingleton", "FTDict"}
)


_NUMBERS = (int, bool)


def value_key(v: Any) -> Any:
    """A hashable key of a plain parameter value; raises `NoKey` when none is sound."""
    t = type(v)
    if t in _PLAIN:
        return v
    if t in _NUMBERS:
        return (t, v)  # 1 == True == 1.0 in a dict key; keep the type
    if t is float:
        return (t, v.hex())  # -0.0 == 0.0 and nan != nan as floats
    if isinstance(v, np.dtype) or isinstance(v, enum.Enum):
        return v
    if isinstance(v, np.generic):
        return (t, v.tobytes())
    if t.__name__ in _JAX_VALUES:  # compared by value, as jax's own jit cache keys them
        return (t, v)
    if isinstance(v, tuple):  # namedtuples too (dimension numbers)
        return (t, tuple(value_key(x) for x in v))
    if t is complex:
        return (t, repr(v))
    if isinstance(v, (Jaxpr, ClosedJaxpr)):  # cond branches, scan bodies, scatter combiners
        return jaxpr_key(v)
    fused_key = getattr(v, "fused_key", None)  # a rule's own structure (custom_jvp_rule)
    if fused_key is not None:
        return (t, fused_key())
    raise NoKey


def array_key(value: Any) -> tuple:
    a = np.asarray(value)
    if a.size > 16:
        raise NoKey
    return (str(a.dtype), a.shape, a.tobytes())


def jaxpr_key(j: Any) -> tuple:
    """A structural key of a sub-jaxpr: equal keys, same function (no constants allowed:
    those are values, which the key must not hold)."""
    if isinstance(j, ClosedJaxpr):
        if j.consts:
            raise NoKey
        j = j.jaxpr
    if j.constvars or j.effects:
        raise NoKey
    ids: dict[Any, int] = {}

    def define(v) -> str:
        ids[v] = len(ids)
        return str(v.aval)

    def use(v) -> Any:
        if isinstance(v, Literal):
            return ("lit", array_key(v.val), str(v.aval))
        return ids[v]

    ins = tuple(define(v) for v in j.invars)
    eqns = tuple(
        (
            e.primitive,
            tuple((k, value_key(p)) for k, p in e.params.items() if not _unused(e, k)),
            tuple(use(v) for v in e.invars),
            tuple(define(v) for v in e.outvars),
        )
        for e in j.eqns
    )
    return ("jaxpr", ins, eqns, tuple(use(v) for v in j.outvars))


def _unused(eqn: Any, param: str) -> bool:
    """A param the compiled call never runs: a custom_jvp call's JVP rule is used only by
    a differentiation of the call, and nothing differentiates inside the compiled
    forward+backward (its backward is the tape's own; `custom_jvp_rule` records carry
    the rule traced into jaxprs, keyed in full)."""
    return param == "jvp_jaxpr_fun" and eqn.primitive.name == "custom_jvp_call"
