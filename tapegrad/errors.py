"""The errors tapegrad raises.

Each is a `TapegradError` and also the matching built-in (`TypeError`,
`ValueError`, ...), so ``except ValueError`` keeps working. Messages name the
record and the user's source line, and say what to do.
"""

from __future__ import annotations

import jax

__all__ = [
    "ReverseModeError",
    "ClosedOverTracerError",
    "TapegradError",
    "NonDifferentiableError",
    "ResidualError",
    "HookError",
    "AnomalyError",
    "MissingRuleError",
    "EffectError",
    "TracerLeakError",
    "GradcheckError",
    "DtypeError",
    "InvalidTapeError",
    "ProcessMismatchError",
    "FunctionBackwardError",
    "OnceDifferentiableError",
    "FunctionGradShapeError",
]


class TapegradError(Exception):
    """Base class of every error tapegrad raises."""


class NonDifferentiableError(TapegradError, TypeError):
    """A primitive on the path to the output cannot be differentiated in reverse mode."""


class ReverseModeError(NonDifferentiableError, ValueError):
    """A primitive jax can differentiate forward but not in reverse (``while`` with a
    dynamic trip count). Also a ValueError, the type jax raises for the same code."""


class ClosedOverTracerError(ReverseModeError, jax.errors.UnexpectedTracerError):
    """A custom rule closes over a value traced inside the differentiated function, which
    only the trace that made it can differentiate. Also jax's ``UnexpectedTracerError``,
    what `jax.grad` raises for the same code."""

    def __init__(self, message: str):
        page = "https://docs.jax.dev/en/latest/errors.html#jax.errors.UnexpectedTracerError"
        TypeError.__init__(self, f"Encountered an unexpected tracer. {message}\nSee {page}")


class OnceDifferentiableError(NonDifferentiableError, RuntimeError):
    """A higher-order gradient through a `tg.Function` backward marked
    ``@tg.once_differentiable``. Also a RuntimeError, what PyTorch raises."""


class FunctionBackwardError(TapegradError, RuntimeError, TypeError):
    """A `tg.Function`'s backward returned the wrong number of gradients, a gradient for
    a non-array input, or something that is not an array. A RuntimeError, as in PyTorch
    (and a TypeError, what tapegrad raised before)."""


class FunctionGradShapeError(FunctionBackwardError, ValueError):
    """A `tg.Function`'s backward returned a gradient whose shape the input's does not
    broadcast to (PyTorch: "returned an invalid gradient ... expected shape")."""


class ResidualError(TapegradError, RuntimeError):
    """A residual is missing, released, deleted, or came back with the wrong shape/dtype."""


class HookError(TapegradError, RuntimeError):
    """A pack/unpack hook raised or misbehaved."""


class AnomalyError(TapegradError, FloatingPointError):
    """Anomaly detection found a NaN (or, with ``check_inf=True``, an Inf): in a record's
    output in forward, or in a cotangent a VJP rule returned in backward.

    Why `FloatingPointError` and not `RuntimeError` (PyTorch's choice): it is what jax's
    own ``jax_debug_nans`` raises and what ``np.seterr(all="raise")`` raises, so code that
    already catches NaN errors from jax or numpy catches tapegrad's too. Under `jax.jit`
    the check runs in a host callback, and jax re-raises it as its own runtime error
    (``jax.errors.JaxRuntimeError``, or `ValueError` from jax's C++ dispatch) whose
    message carries this error's text (the record and its source line).

    ``record``: the `Record` whose output (or VJP rule's output) failed the check;
    ``operands``: eagerly, summaries of what it read (`tapegrad.anomaly.log.Operand`:
    shape, dtype, NaN/Inf counts, min/max of the finite values), else None.
    """

    def __init__(self, message: str = "", record=None, operands=None):
        super().__init__(message)
        self.record = record
        self.operands = operands


class MissingRuleError(TapegradError, NotImplementedError):
    """A primitive on the differentiated path has no reverse-mode rule: neither a tapegrad
    rule nor a jax JVP rule to fall back on (a `NotImplementedError`, as jax raises)."""


class EffectError(TapegradError, NotImplementedError):
    """A side-effecting record (``io_callback``, ...) would run again when backward
    recomputes its checkpointed segment, and could return a different value than in
    forward (a `NotImplementedError`, as jax's ``checkpoint`` raises for effects)."""


class TracerLeakError(TapegradError, TypeError):
    """A value traced inside a tapegrad transform escaped it (stored in a global, a closure,
    a list), found by ``tg.detect_anomaly(check_leaks=True)`` (a `TypeError`, like jax's
    ``UnexpectedTracerError``)."""


class GradcheckError(TapegradError, RuntimeError):
    """`tg.gradcheck` / `tg.gradgradcheck` found analytical and numerical derivatives that
    differ (a `RuntimeError`, like PyTorch's ``GradcheckError``)."""


class DtypeError(TapegradError, TypeError):
    """An input's dtype is unsuitable for the operation, e.g. float32 inputs to
    `tg.gradcheck`, whose finite differences need float64."""


class InvalidTapeError(TapegradError, ValueError):
    """A tape pass returned something that is not a well-formed `Tape` (a value used
    before it is defined, records out of order, ...)."""


class ProcessMismatchError(TapegradError, ValueError):
    """In a multi-process run (``jax.process_count() > 1``), the processes would not
    run the same program: their budgets or cost models differ, so each would plan its
    own residuals and their collectives would wait on each other forever; or a process
    did not take part in an exchange the others made (it made other calls, in another
    order, or it died). Raised on every process, before anything runs."""


def where(record) -> str:
    """``'tanh' at file.py:12 (f)`` for error messages."""
    return f"'{record.primitive}' (record #{record.index}) at {record.source}"
