"""Anomaly detection: find the first record that produced a NaN (or an Inf).

```python
with tg.detect_anomaly():                 # or tg.grad(f, anomaly=True)
    tg.grad(lambda x: jnp.sum(jnp.log(x ** 2)))(jnp.zeros(3))
# AnomalyError: backward of 'integer_pow' (record #0) returned NaN values in its 0th
# output: the cotangent of its input 0 (a:f32[3]).
# Forward record: #0 b:f32[3] = integer_pow[y=2] a   at f.py:2 (<lambda>) ...
```

It is an *observer* of the interpreters (`_interpret.forward` / `backward` call
it after every record and every VJP rule): forward checks each record's
outputs, backward each cotangent a rule returns, and the first one that
fails is reported with the record, its source line, and the records that
fed it, like PyTorch's ``detect_anomaly`` ("Function 'LogBackward0' returned
nan values in its 0th output" plus the forward traceback).

How it stays cheap: each check is one jitted ``max(abs(x))`` and ``any(isnan(x))``
on device (NaN if ``x`` has a NaN, inf if it has an Inf), giving one float per
value; those of a whole forward (or backward) pass travel to the host
together, once per pass. Eagerly they are fetched
and checked at the end of the pass (forward before backward starts). Under a
trace (`jax.jit`, `jax.vmap`, an outer `jax.grad`) they feed one host
callback per pass, inside a ``lax.cond`` so that it is only called when a
check failed, and it raises when the compiled call runs.

Why a callback and not `checkify`: a `checkify.check` inside a plain
``jax.jit(tg.grad(f))`` is refused at trace time ("Cannot abstractly evaluate
a checkify.check which was not functionalized") unless the user also wraps the
function in ``checkify.checkify`` and calls ``err.throw()``; a callback works
under a plain ``jax.jit``, ``vmap`` and nested ``grad`` and moves only one
float per checked value to the host. Why `jax.pure_callback` tied to the outputs rather
than `jax.debug.callback`: see `_stage`. The price of callbacks: jax re-raises
an error from a callback as its own runtime error whose message carries the
`AnomalyError`'s text (``jax.errors.JaxRuntimeError``, a `RuntimeError`, from
jax's Python dispatch, e.g. a first call; a plain `ValueError` from its C++
fast path on later calls), so under jit ``except tg.AnomalyError`` does not
catch it; and a check whose outputs the program never uses is removed with them.

When anomaly mode is off, the transforms pass no observer: nothing is
computed, nothing is staged, the compiled program is unchanged.

This module holds the switches (`detect_anomaly`, `set_detect_anomaly`, a transform's
``anomaly=`` argument) and the tracer-leak check; the mode and the probes are in
`tapegrad.anomaly.probes`, the messages in `tapegrad.anomaly.messages`, the observer
and the staged check in `tapegrad.anomaly.observer`.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import jax

from tapegrad.anomaly.log import _OPEN, AnomalyEvent, AnomalyLog, Operand
from tapegrad.anomaly.observer import AnomalyObserver, emit, observer  # noqa: F401

# The checks, the observer and `emit` live in their own modules; the interpreters'
# callers (`_transforms`) and `passes.check_finite` reach them through this module.
from tapegrad.anomaly.probes import AnomalyMode, Site, checkable, code_of  # noqa: F401
from tapegrad.core.jax_compat import PACKAGE_DIR
from tapegrad.errors import TracerLeakError

__all__ = [
    "AnomalyEvent",
    "AnomalyLog",
    "AnomalyMode",
    "Operand",
    "detect_anomaly",
    "set_detect_anomaly",
    "is_anomaly_enabled",
    "AnomalyObserver",
]


_MODE: contextvars.ContextVar[AnomalyMode | None] = contextvars.ContextVar(
    "tapegrad_anomaly", default=None
)
_WARNED = False

WARNING = (
    "tapegrad anomaly detection is enabled: every record's outputs and every "
    "cotangent are checked for {what}. This slows forward and backward (eagerly "
    "most: one check per record; see bench/anomaly_bench.py); use it to debug, "
    "not to train."
)


def _user_stacklevel() -> int:
    """The stacklevel of the first frame outside tapegrad (so the warning names the user's line)."""
    pkg = PACKAGE_DIR + os.sep
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(pkg):
        frame, level = frame.f_back, level + 1
    return level


def _warn_enabled(mode: AnomalyMode) -> None:
    """Warn once per process, as PyTorch warns when anomaly mode is turned on."""
    global _WARNED
    if not _WARNED:
        _WARNED = True
        warnings.warn(WARNING.format(what=mode.what), UserWarning, stacklevel=_user_stacklevel())


class detect_anomaly(contextlib.ContextDecorator):
    """Check every record and VJP rule for NaN inside the ``with`` block (or decorated function).

    ```python
    with tg.detect_anomaly():
        g = tg.grad(loss)(params, x)          # AnomalyError names the first bad record
    with tg.detect_anomaly(check_inf=True):   # Inf too (sqrt at 0, log at 0)
        g = jax.jit(tg.grad(loss))(params, x)
    with tg.detect_anomaly(halt=False) as log:  # run to the end, collect every origin
        g = tg.grad(loss)(params, x)
    print(log)                                # a table of log.events
    ```
    ``halt=False``: no error; every origin of a NaN/Inf — a record whose outputs are
    non-finite while its inputs are finite (in backward: a rule returning a non-finite
    cotangent while the cotangents it received and its forward values are finite) —
    becomes an `AnomalyEvent` in the `AnomalyLog` the ``with`` statement binds.
    ``post_mortem=True``: when halting eagerly, open pdb in the frame that called the
    transform, with the error as ``anomaly`` (``anomaly.record``, ``anomaly.operands``).
    Scopes nest and are restored on exit, also when the body raises (a contextvar). The
    ``with`` statement binds the `AnomalyLog` (``halt=False``) or the `AnomalyMode`.
    """

    def __init__(
        self,
        check_nan: bool = True,
        *,
        check_inf: bool = False,
        forward: bool = True,
        check_leaks: bool = False,
        halt: bool = True,
        post_mortem: bool = False,
    ):
        self.log = None if halt else AnomalyLog()
        self.mode = AnomalyMode(
            check_nan, check_inf, forward, check_leaks, halt, post_mortem, self.log
        )
        self._tokens: list = []
        _warn_enabled(self.mode)

    def __enter__(self) -> Any:
        self._tokens.append(_MODE.set(self.mode))
        if self.log is not None:
            _OPEN.append(self.log)
            return self.log
        return self.mode

    def __exit__(self, *exc) -> None:
        _MODE.reset(self._tokens.pop())
        if self.log is not None and self.log in _OPEN:
            _OPEN.remove(self.log)


class set_detect_anomaly:
    """Turn anomaly detection on or off now; as a context manager, restore the previous
    setting on exit (PyTorch's ``torch.autograd.set_detect_anomaly``).

    ```python
    tg.set_detect_anomaly(True)               # from here on, in this thread / task
    with tg.set_detect_anomaly(False):        # off inside, restored after
        ...
    ```
    """

    def __init__(
        self,
        mode: bool,
        check_nan: bool = True,
        *,
        check_inf: bool = False,
        forward: bool = True,
        check_leaks: bool = False,
    ):
        new = AnomalyMode(check_nan, check_inf, forward, check_leaks) if mode else None
        if new is not None:
            _warn_enabled(new)
        self._token = _MODE.set(new)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        _MODE.reset(self._token)


def is_anomaly_enabled() -> bool:
    """Whether anomaly detection is on in the current context."""
    return _MODE.get() is not None


def resolve(anomaly: Any) -> AnomalyMode | None:
    """The mode a transform uses: its ``anomaly=`` argument, else the enclosing scope."""
    if anomaly is None:
        return _MODE.get()
    if anomaly is False:
        return None
    if anomaly is True:
        return AnomalyMode()
    if isinstance(anomaly, AnomalyMode):
        return anomaly
    raise TypeError(f"anomaly= must be True, False, None or a tg.AnomalyMode, got {anomaly!r}.")


def check_argument(anomaly: Any) -> None:
    """Validate (and warn for) a transform's ``anomaly=`` argument when the transform is built."""
    mode = resolve(anomaly) if anomaly is not None else None
    if mode is not None:
        _warn_enabled(mode)


@contextlib.contextmanager
def leak_check(mode: AnomalyMode | None, fun: Any) -> Iterator[None]:
    """Trace under ``jax.checking_leaks()`` when ``mode.check_leaks``; a leak becomes a
    `TracerLeakError` naming the user's function."""
    if mode is None or not mode.check_leaks:
        yield
        return
    try:
        with jax.checking_leaks():
            yield
    except Exception as e:  # jax raises a plain Exception("Leaked trace ...")
        if type(e) is not Exception or not str(e).startswith("Leaked"):
            raise
        name = getattr(fun, "__qualname__", getattr(fun, "__name__", repr(fun)))
        raise TracerLeakError(
            f"a value traced inside a tapegrad transform of {name} escaped the function: it "
            "was stored where it outlives the trace (a global, a list, an attribute). Using it "
            "later raises jax's UnexpectedTracerError. Return the value instead (for a value "
            "that is not differentiated, use has_aux=True).\njax's report:\n" + str(e)
        ) from e
