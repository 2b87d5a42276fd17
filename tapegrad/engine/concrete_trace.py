"""A jaxpr recorded from a concrete run, for functions with Python control flow on values.

`jax.make_jaxpr` traces abstractly, so ``if x > 0:`` or ``while err > tol:`` raise a
`jax.errors.ConcretizationTypeError` there, while `jax.grad` (not under `jit`) runs on
concrete values and takes the branch. When the inputs are concrete, tapegrad does the
same: `record_jaxpr` runs the function under a jax Trace whose tracers carry their
concrete values (as jax's own JVPTrace does eagerly), binds each primitive on those
values, and records the equation. The jaxpr it returns is the straight-line program that
ran — the branch taken, the loop unrolled as many times as it ran — and becomes a tape
like any other: same records, rules, policies, memory report and anomaly passes.

Higher-order primitives need nothing special: ``jit``, ``scan``, ``cond``, ``checkpoint``
trace their bodies abstractly (as they do under `jax.grad`) and are recorded as one
equation. A ``custom_jvp``/``custom_vjp`` function is recorded from its run too; its
rule (``jvp`` or ``fwd``) is traced abstractly as jax does, and recorded from a run
when it branches on values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from tapegrad.core import jax_compat as compat

__all__ = ["record_jaxpr", "is_concrete"]

# Effects without outputs (jax.debug.print/callback): recorded, not run, so that they run
# once, in the forward that replays the recording.
_RUN_ONCE = frozenset({"debug_callback", "debug_print"})


def is_concrete(values: Sequence[Any]) -> bool:
    """Whether every value has a concrete value (arrays, or tracers of an eager trace)."""
    return all(compat.to_concrete_value(x) is not None for x in values)


class _Tracer(compat.Tracer):
    __slots__ = ("cval", "jvar")  # not `var`: a Tracer has .var() (variance)

    def __init__(self, trace: _Trace, val: Any, var: Any):
        super().__init__(trace, compat.typeof(val))
        self.cval = val
        self.jvar = var

    def to_concrete_value(self):
        return compat.to_concrete_value(self.cval)


class _Trace(compat.Trace):
    """Binds each primitive on concrete values (under ``parent``) and records it."""

    def __init__(self, parent: Any, outer: _Trace | None = None):
        super().__init__()
        self.parent = parent
        self.outer = outer  # the trace whose record this one is part of (a custom call's body)
        self.requires_low = False
        self.finished = False
        self.eqns: list = []
        self.constvars: list = []
        self.consts: list = []
        self._const_of: dict[int, Any] = {}

    # -- values and atoms
    def _mine(self, x: Any) -> bool:
        return isinstance(x, _Tracer) and x._trace is self

    def value(self, x: Any) -> Any:
        t: _Trace | None = self
        while isinstance(x, _Tracer) and t is not None:
            if x._trace is t:
                return x.cval
            t = t.outer
        return x

    def atom(self, x: Any) -> Any:
        if self._mine(x):
            return x.jvar
        if isinstance(x, compat.SCALARS):
            return compat.Literal(x, compat.typeof(x))
        var = self._const_of.get(id(x))
        if var is None:  # a closed-over array (kept alive by self.consts, so ids stay unique)
            var = self._const_of[id(x)] = compat.Var(compat.typeof(x))
            self.constvars.append(var)
            self.consts.append(x)
        return var

    def _emit(self, prim, ins: list, out_vals: list, params: dict) -> list[_Tracer]:
        outs = [_Tracer(self, v, compat.Var(compat.typeof(v))) for v in out_vals]
        src = compat.current_source_info()
        self.eqns.append(
            compat.new_jaxpr_eqn(ins, [o.jvar for o in outs], prim, params, frozenset(), src)
        )
        return outs

    # -- jax's Trace interface
    def process_primitive(self, prim, tracers, params):
        if self.finished:
            raise _escaped(prim)
        ins = [self.atom(t) for t in tracers]
        vals = [self.value(t) for t in tracers]
        if prim.name in _RUN_ONCE:  # no outputs: printed by the tape's own forward, once
            return self._emit(prim, ins, [], params)
        avals = tuple(compat.typeof(v) for v in vals)
        out = prim.bind_with_trace(self.parent, vals, avals, params)
        outs = self._emit(prim, ins, list(out) if prim.multiple_results else [out], params)
        return outs if prim.multiple_results else outs[0]

    def _record_call(self, fun, tracers) -> tuple[Any, list, list]:
        """A custom call's body recorded from its run: (closed jaxpr, const atoms, outputs)."""
        sub = _Trace(self.parent, outer=self)
        name = getattr(fun.debug_info, "func_name", None) or "recorded"
        vals = [self.value(t) for t in tracers]
        jaxpr, consts, outs = _record(sub, fun.call_wrapped, vals, name)
        closed = compat.ClosedJaxpr(compat.convert_constvars_jaxpr(jaxpr), ())
        return closed, consts, outs

    def _recorder(self, vals: list) -> Callable:
        """``record(fun, extra)``: a custom rule recorded on these values (plus zeros)."""

        def record(fun, extra_avals):
            extra = [np.zeros(a.shape, a.dtype) for a in extra_avals]
            sub = _Trace(self.parent, outer=self)
            jaxpr, consts, _ = _record(sub, fun, [*vals, *extra])
            return jaxpr, consts

        return record

    def process_custom_jvp_call(self, prim, fun, jvp, tracers, *, symbolic_zeros):
        closed, consts, out_vals = self._record_call(fun, tracers)
        vals = [self.value(t) for t in tracers]
        thunk = compat.custom_jvp_thunk(
            jvp, [compat.typeof(v) for v in vals], self._recorder(vals), _lower
        )
        ins = [self.atom(c) for c in consts] + [self.atom(t) for t in tracers]
        params = dict(
            call_jaxpr=closed,
            jvp_jaxpr_fun=thunk,
            num_consts=len(consts),
            symbolic_zeros=symbolic_zeros,
        )
        return self._emit(prim, ins, out_vals, params)

    def process_custom_vjp_call(self, prim, fun, fwd, bwd, tracers, *, out_trees, symbolic_zeros):
        closed, consts, out_vals = self._record_call(fun, tracers)
        vals = [self.value(t) for t in tracers]
        thunk = compat.custom_vjp_thunk(fwd, [compat.typeof(v) for v in vals], self._recorder(vals))
        n = len(consts)

        def out_trees_():
            out_tree, res_tree, input_fwds = out_trees()
            return out_tree, res_tree, [f if f is None else f + n for f in input_fwds]

        ins = [self.atom(c) for c in consts] + [self.atom(t) for t in tracers]
        params = dict(
            call_jaxpr=closed,
            fwd_jaxpr_thunk=thunk,
            num_consts=n,
            bwd=bwd,
            out_trees=out_trees_,
            symbolic_zeros=symbolic_zeros,
        )
        return self._emit(prim, ins, out_vals, params)


def _record(
    trace: _Trace, fun: Callable, vals: Sequence[Any], name: str = "recorded"
) -> tuple[Any, list, list]:
    tracers = [_Tracer(trace, v, compat.Var(compat.typeof(v))) for v in vals]
    with compat.set_current_trace(trace):
        outs = fun(*tracers)
    out_atoms = [trace.atom(o) for o in outs]
    out_vals = [trace.value(o) for o in outs]
    jaxpr = compat.new_jaxpr(
        trace.constvars, [t.jvar for t in tracers], out_atoms, trace.eqns, name
    )
    # Not invalidated: a custom_jvp rule that closes over a recorded value is traced
    # later, and jax lifts a tracer of a valid trace as a constant (`_lower` takes its
    # value). Any other use of a leaked tracer raises (`process_primitive`).
    trace.finished = True
    return jaxpr, trace.consts, out_vals


def _lower(c: Any) -> Any:
    # One level: under an outer trace the value is that trace's tracer (still traced).
    return c.cval if isinstance(c, _Tracer) else c


def _escaped(prim) -> Exception:
    return jax.errors.UnexpectedTracerError(
        f"A value recorded while tapegrad ran a function with Python control flow was used "
        f"after that run ended (by '{prim}'): the function stored it outside (a global, an "
        "attribute, a list it returned through a side channel). Return values instead."
    )


def record_jaxpr(fun: Callable, args: Sequence[Any]) -> Any:
    """``ClosedJaxpr`` of ``fun(*args)`` recorded from a concrete run (see the module doc)."""
    vals = [x if isinstance(x, (jax.Array, compat.Tracer)) else jax.numpy.asarray(x) for x in args]
    with compat.take_current_trace() as parent:
        jaxpr, consts, _ = _record(_Trace(parent), fun, vals)
    return compat.ClosedJaxpr(jaxpr, consts)
