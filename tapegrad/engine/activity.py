"""Forward activity while tapegrad traces a function: does a value depend on an input
being differentiated?

`trace_flat` traces the user's function once with `jax.make_jaxpr` and knows the
activity of every record only afterwards, from the finished tape. A `tg.Function`
needs it earlier: PyTorch runs ``forward`` once, with ``ctx.needs_input_grad`` saying
which inputs require grad, and a forward may branch on it. So, while `trace_flat` is
tracing, `forward_activity(x)` answers for a value ``x`` of that trace by following
the equations that produced it back to the function's inputs (jax's staged tracers
keep their producing equation), memoized per variable.

A value from outside the trace (a closure, an undifferentiated argument, an enclosing
jit's or vmap's tracer) is a constant for it: inactive. The answer is `UNKNOWN` for a
value staged in a trace nested inside it (the body of a jit, scan or checkpoint, whose
inputs are that body's own) and where this jax's tracers do not say; a caller then
assumes a float value is active. `TRANSFORMED`: a tracer of a transformation applied
inside the traced function (an inner `jax.grad` or `jax.vmap`), whose own rules decide.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from tapegrad.core import jax_compat as compat
from tapegrad.core.tape import is_differentiable_dtype
from tapegrad.rules import NONDIFF

__all__ = [
    "ACTIVE",
    "INACTIVE",
    "TRANSFORMED",
    "UNKNOWN",
    "forward_activity",
    "marking_active",
    "tracing_activity",
]


def _differentiable(x: Any) -> bool:
    return is_differentiable_dtype(getattr(x, "dtype", None))


class _Activity:
    """One `trace_flat` call's make_jaxpr trace and what is known of its values."""

    def __init__(self, trace: Any, active: Sequence[Any]):
        self.trace = trace
        self.known: dict[int, bool] = {}
        self.keep: list = []  # the variables keyed by id: alive as long as their ids are used
        for x in active:
            self._set(x, True)

    def _set(self, x: Any, value: bool) -> None:
        var = compat.staged_var(x)
        self.known[id(var)] = value
        self.keep.append(var)

    def _get(self, x: Any) -> bool | None:
        return self.known.get(id(compat.staged_var(x)))

    def of(self, x: Any) -> str:
        if not isinstance(x, jax.core.Tracer):
            return INACTIVE  # a constant
        trace = compat.trace_of(x)
        if trace is not self.trace:
            return self._relation(trace, x)
        stack = [x]
        while stack:
            t = stack[-1]
            if self._get(t) is not None:
                stack.pop()
                continue
            ops = compat.staged_operands(t)
            if ops is None:
                return UNKNOWN
            if ops and (compat.staged_primitive(t) in NONDIFF or not _differentiable(t)):
                self._set(t, False)  # stop_gradient, comparisons, integers: no cotangent
                stack.pop()
                continue
            ours = [o for o in ops if compat.trace_of(o) is self.trace]
            if len(ours) != len(ops):
                return UNKNOWN  # an operand staged elsewhere: not ours to judge
            pending = [o for o in ours if self._get(o) is None]
            if pending:
                stack.extend(pending)
                continue
            self._set(t, any(self._get(o) for o in ours))
            stack.pop()
        return ACTIVE if self._get(x) else INACTIVE

    def _relation(self, trace: Any, x: Any) -> str:
        """A tracer of another trace: one made inside ours (a nested jit, scan or
        checkpoint body; an inner jax.grad or jax.vmap), or one from outside, a constant
        for this trace (an enclosing jit's, vmap's or tg.grad's value)."""
        t = compat.parent_trace(trace)
        for _ in range(1000):
            if t is None:
                return INACTIVE
            if t is self.trace:
                return UNKNOWN if compat.staging_trace(x) is not None else TRANSFORMED
            t = compat.parent_trace(t)
        return UNKNOWN


_ACTIVITY: contextvars.ContextVar[_Activity | None] = contextvars.ContextVar(
    "tapegrad_activity", default=None
)


def tracing_activity() -> bool:
    """Whether a `trace_flat` trace is being built (by this thread or task) right now."""
    return _ACTIVITY.get() is not None


# What `forward_activity` says of a value.
ACTIVE = "active"  # it depends on a differentiated input
INACTIVE = "inactive"  # it does not (a constant, an undifferentiated input, a value from outside)
UNKNOWN = "unknown"  # staged in a trace nested in this one (a jit, scan or checkpoint body)
TRANSFORMED = "transformed"  # a tracer of a transformation inside this trace (jax.grad, vmap)


def forward_activity(x: Any) -> str | None:
    """Whether ``x`` depends on an input the running `trace_flat` differentiates: one of
    `ACTIVE`, `INACTIVE`, `UNKNOWN`, `TRANSFORMED`; None when no trace runs."""
    state = _ACTIVITY.get()
    return None if state is None else state.of(x)


def marking_active(fun: Callable, active_inputs: Sequence[bool]) -> Callable:
    """``fun``, which, run by `jax.make_jaxpr`, records which of its inputs are active, so
    that `forward_activity` can answer while it runs."""

    @functools.wraps(fun)  # jax's errors and debug info name the user's function
    def marked(*args):
        trace = compat.staging_trace(args[0]) if args else None
        state = None
        if trace is not None:
            state = _Activity(trace, [a for a, on in zip(args, active_inputs) if on])
        token = _ACTIVITY.set(state)
        try:
            return fun(*args)
        finally:
            _ACTIVITY.reset(token)

    return marked
