"""The errors tapegrad raises.

Each is a `TapegradError` and also the matching built-in (`TypeError`,
`ValueError`, ...), so ``except ValueError`` keeps working. Messages name the
record and the user's source line, and say what to do.
"""

from __future__ import annotations

__all__ = ["TapegradError", "NonDifferentiableError", "ResidualError", "HookError"]


class TapegradError(Exception):
    """Base class of every error tapegrad raises."""


class NonDifferentiableError(TapegradError, TypeError):
    """A primitive on the path to the output cannot be differentiated in reverse mode."""


class ResidualError(TapegradError, RuntimeError):
    """A residual is missing, released, deleted, or came back with the wrong shape/dtype."""


class HookError(TapegradError, RuntimeError):
    """A pack/unpack hook raised or misbehaved."""


def where(record) -> str:
    """``'tanh' at file.py:12 (f)`` for error messages."""
    return f"'{record.primitive}' (record #{record.index}) at {record.source}"
