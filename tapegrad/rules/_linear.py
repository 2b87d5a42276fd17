"""The linear part of a split custom_jvp rule, transposed once per structure: `Linear`
(``cts_in = lt(*residuals, *cts_out)``), which cotangent inputs each of its outputs
reads (a tangent no cotangent reaches is a symbolic zero), and its pruned and compiled
forms per pattern of active inputs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from tapegrad.core import jax_compat as compat
from tapegrad.core.caches import BoundedCache, array_bytes
from tapegrad.core.keys import NoKey, jaxpr_key

__all__ = ["Linear", "Unsplittable", "jitted", "linear_for", "pruned", "reached"]


@dataclass(frozen=True, eq=False)
class Linear:
    """The transposed linear part of a rule: ``cts_in = lt(*residuals, *cts_out)``.

    Shared by every trace of a call with the same structure (see `_LINEAR`), so its
    compiled forms are reused from one ``tg.grad`` call to the next.
    """

    lt: Any  # ClosedJaxpr
    n_res: int
    tangent_of: tuple[int, ...]  # primal operand (after the consts) of each lt output
    ct_of: tuple[int, ...]  # call output of each cotangent lt input
    # Per lt output, the cotangent inputs (positions in ct_of) it reads: where none of
    # them has a cotangent, that operand's cotangent is a symbolic zero.
    reads: tuple[tuple[int, ...], ...] = ()
    # Per pattern of active inputs: the pruned jaxpr and its compiled form (at most
    # 2**inputs patterns; freed with the Linear when `_LINEAR` evicts it).
    pruned: dict = field(default_factory=dict, repr=False)
    jitted: dict = field(default_factory=dict, repr=False)


class Unsplittable(Exception):
    pass


# Transposing costs a trace of the linear part (~1 ms); a training loop traces the
# same calls on every step, so the result is kept per structure. Bounded by entries
# and by the bytes of the constants the transposed rules hold; a `Linear` also owns
# its pruned and compiled forms, so evicting it releases those too.
_LINEAR = BoundedCache("custom_jvp.linear", max_entries=512, max_bytes=256 << 20)


def linear_for(lin, n_res: int, nz_in: list[int], ct_of: list[int]) -> Linear:
    key = _structure_key(lin, n_res, nz_in, ct_of)
    found = _LINEAR.get(key) if key is not None else None
    if found is not None:
        return found
    lt = _transpose(lin, n_res)
    out = Linear(lt, n_res, tuple(nz_in), tuple(ct_of), _reads(lt, n_res, len(ct_of)))
    if key is not None:
        _LINEAR.put(key, out, array_bytes(out.lt.consts))
    return out


def _structure_key(lin, n_res: int, nz_in: list[int], ct_of: list[int]) -> Any:
    try:
        key = (jaxpr_key(lin), n_res, tuple(nz_in), tuple(ct_of))
        hash(key)
    except (NoKey, TypeError, ValueError):
        return None
    return key


def _reads(lt, n_res: int, n_cts: int) -> tuple[tuple[int, ...], ...]:
    """Per output of the transposed rule, the cotangent inputs it depends on."""
    n_out = len(lt.jaxpr.outvars)
    reads = []
    for i in range(n_out):
        _, used = compat.dce_jaxpr(lt.jaxpr, [o == i for o in range(n_out)])
        reads.append(tuple(k for k in range(n_cts) if used[n_res + k]))
    return tuple(reads)


def _transpose(lin, n_res: int):
    res_avals = [v.aval for v in lin.jaxpr.invars[:n_res]]
    t_avals = [v.aval for v in lin.jaxpr.invars[n_res:]]
    ct_avals = [v.aval.to_tangent_aval() for v in lin.jaxpr.outvars]

    def lt(*args):
        res, cts = args[:n_res], args[n_res:]
        f = functools.partial(compat.eval_closed_jaxpr, lin, *res)
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in t_avals]
        return list(jax.linear_transpose(f, *specs)(list(cts)))

    try:
        return jax.make_jaxpr(lt)(*res_avals, *ct_avals)
    except Exception as e:  # not linear in the tangents, or a primitive jax cannot transpose
        raise Unsplittable from e


def reached(lin: Linear, act: Sequence[bool], has_ct: Sequence[bool]) -> tuple[bool, ...]:
    """``act`` (per lt output) narrowed to the tangents a cotangent reaches: ``has_ct``
    says, per call output, whether it has one (jax's linearize sees the same zeros: a
    tangent the rule's output tangents do not read gets none)."""
    return tuple(a and any(has_ct[lin.ct_of[k]] for k in r) for a, r in zip(act, lin.reads))


def pruned(linear: Linear, act: tuple[bool, ...]) -> tuple[Any, tuple[int, ...], tuple[int, ...]]:
    """The transposed jaxpr computing only the active inputs' cotangents:
    ``(jaxpr, residuals it reads, cotangents it reads)``."""
    found = linear.pruned.get(act)
    if found is None:
        jaxpr, used = compat.dce_jaxpr(linear.lt.jaxpr, list(act))
        closed = compat.ClosedJaxpr(jaxpr, linear.lt.consts)
        res = tuple(k for k in range(linear.n_res) if used[k])
        cts = tuple(k for k in range(len(linear.ct_of)) if used[linear.n_res + k])
        found = linear.pruned[act] = (closed, res, cts)
    return found


def jitted(linear: Linear, act: tuple[bool, ...]):
    fn = linear.jitted.get(act)
    if fn is None:
        closed = pruned(linear, act)[0]
        fn = linear.jitted[act] = jax.jit(functools.partial(compat.eval_closed_jaxpr, closed))
    return fn
