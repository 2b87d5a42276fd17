"""Tape passes: plain functions ``Tape -> Tape``.

A pass returns a new tape and leaves its input untouched (tapes are frozen).
Passes are how tapegrad checks and rewrites programs:

```python
tape = tg.trace(f)(x)
print(tg.passes.run(tape, [tg.passes.dce, tg.passes.check_finite]))
g = tg.grad(f, passes=[tg.passes.dce, tg.passes.check_finite])(x)
```

`tg.grad` / `tg.value_and_grad` / `tg.vjp` / `tg.trace` run ``passes=`` in order
on the tape they replay, right after tracing and before the recompute plan;
`run` validates the tape after each pass, so a pass that breaks it is named
at once. A pass with options is a partial: ``functools.partial(check_finite,
check_inf=False)``.

Shipped passes:

* `dce`: dead-record elimination (records whose outputs nothing uses).
* `check_finite`: insert a check after every record's outputs that raises
  `tg.AnomalyError` on NaN/Inf, naming the record and its source line.
* `validate`: the tape is well-formed (values defined before use, records in order).
* `check_rules`: every differentiated primitive has a reverse-mode rule
  (run on every traced tape: raises `tg.MissingRuleError` before any compute).
* `check_effects`: no side-effecting record is recomputed in backward (run on
  every tape after the recompute plan: raises `tg.EffectError`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tapegrad.core.tape import Tape
from tapegrad.errors import InvalidTapeError
from tapegrad.passes.check_finite import check_finite
from tapegrad.passes.checks import check_effects, check_rules, effects_of, validate
from tapegrad.passes.dce import dce

__all__ = [
    "Pass",
    "run",
    "dce",
    "check_finite",
    "validate",
    "check_rules",
    "check_effects",
    "effects_of",
]

Pass = Callable[[Tape], Tape]


def _name(pass_) -> str:
    fn = getattr(pass_, "func", pass_)  # functools.partial
    return getattr(fn, "__qualname__", getattr(fn, "__name__", repr(pass_)))


def run(tape: Tape, passes: Sequence[Pass] | None) -> Tape:
    """Apply ``passes`` in order; each result is checked with `validate`."""
    if not passes:
        return tape
    if callable(passes):
        passes = [passes]
    for p in passes:
        if not callable(p):
            raise TypeError(f"passes must be callables Tape -> Tape, got {p!r}.")
        try:
            out = p(tape)
        except Exception as e:
            e.add_note(f"tapegrad: raised by the tape pass {_name(p)}")
            raise
        if not isinstance(out, Tape):
            raise InvalidTapeError(
                f"the tape pass {_name(p)} returned {type(out).__name__}, not a Tape. A pass "
                "is a function Tape -> Tape: build the new tape with dataclasses.replace(tape, "
                "records=...) and return it."
            )
        validate(out, after=_name(p))
        tape = out
    return tape
