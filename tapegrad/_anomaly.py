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

How it stays cheap: each check is one fused ``max(abs(x))`` reduction on
device (NaN if ``x`` has a NaN, inf if it has an Inf), giving one float per
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
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import sys
import types
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, tree_util

from tapegrad._tape import Record, Tape, Var
from tapegrad.errors import AnomalyError, TracerLeakError

__all__ = [
    "AnomalyMode",
    "detect_anomaly",
    "set_detect_anomaly",
    "is_anomaly_enabled",
    "AnomalyObserver",
]


@dataclasses.dataclass(frozen=True)
class AnomalyMode:
    """What anomaly detection checks.

    check_nan: report NaN values (PyTorch's default).
    check_inf: report Inf values as well (``sqrt`` at 0 has an infinite derivative).
    forward: check every record's outputs in forward, not only cotangents in
      backward. Turn it off when a ``jnp.where`` discards NaNs on purpose.
    check_leaks: trace under ``jax.checking_leaks()`` and raise `TracerLeakError`
      when a traced value escapes the function (slow: a garbage collection per trace).
    """

    check_nan: bool = True
    check_inf: bool = False
    forward: bool = True
    check_leaks: bool = False

    def __post_init__(self):
        if not (self.check_nan or self.check_inf):
            raise ValueError(
                "anomaly detection needs check_nan=True or check_inf=True "
                "(otherwise it checks nothing)."
            )

    @property
    def what(self) -> str:
        return " or ".join(w for w, on in (("NaN", self.check_nan), ("Inf", self.check_inf)) if on)


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
    pkg = os.path.dirname(os.path.abspath(__file__)) + os.sep
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
    ```
    Scopes nest and are restored on exit, also when the body raises (a contextvar).
    """

    def __init__(
        self,
        check_nan: bool = True,
        *,
        check_inf: bool = False,
        forward: bool = True,
        check_leaks: bool = False,
    ):
        self.mode = AnomalyMode(check_nan, check_inf, forward, check_leaks)
        self._tokens: list = []
        _warn_enabled(self.mode)

    def __enter__(self) -> AnomalyMode:
        self._tokens.append(_MODE.set(self.mode))
        return self.mode

    def __exit__(self, *exc) -> None:
        _MODE.reset(self._tokens.pop())


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


# ---------------------------------------------------------------------------
# Checks: one float32 "probe" per checked value, computed on device.

OK, NAN, INF = 0, 1, 2


def _probe(x):
    """``max |x|`` as a float32 scalar: NaN if ``x`` has a NaN (XLA's max propagates NaN),
    +inf if it has an Inf and no NaN, finite otherwise.

    One fused reduction that reads ``x`` once; ``any(isnan(x))`` costs a boolean array and
    more kernels on CPU. A finite float64 maximum is reported as 0 so that the cast to
    float32 cannot overflow into a false Inf.
    """
    m = jnp.max(jnp.abs(x), initial=0)
    if jnp.dtype(m.dtype).itemsize > 4:
        m = jnp.where(jnp.isfinite(m), jnp.zeros((), m.dtype), m)
    return m.astype(jnp.float32)


_probe_jit = jax.jit(_probe)  # eagerly: one dispatch per checked value


def checkable(x) -> bool:
    dt = getattr(x, "dtype", None)
    return dt is not None and jnp.issubdtype(dt, jnp.inexact)


def code_of(x, mode: AnomalyMode):
    """The probe of one value (the mode is applied when probes become codes)."""
    if isinstance(x, jax.core.Tracer):
        return _probe(x)
    return _probe_jit(x)


def codes_of(probes, mode: AnomalyMode) -> np.ndarray:
    p = np.asarray(probes, np.float32)
    c = np.zeros(p.shape, np.int8)
    if mode.check_inf:
        c[np.isinf(p)] = INF
    if mode.check_nan:
        c[np.isnan(p)] = NAN
    return c


def first_bad(probes, n: int, mode: AnomalyMode) -> tuple[int, int] | None:
    """(site index, code) of the first failed check; ``probes`` may carry batch dims (vmap)."""
    c = codes_of(probes, mode).reshape(-1, n)
    per_site = np.where((c == NAN).any(axis=0), NAN, c.max(axis=0))
    bad = np.flatnonzero(per_site)
    return None if bad.size == 0 else (int(bad[0]), int(per_site[bad[0]]))


# ---------------------------------------------------------------------------
# Messages


def producers_of(tape: Tape) -> dict[int, Record]:
    return {o.id: r for r in tape.records for o in r.outputs}


def describe_record(r: Record) -> str:
    outs = " ".join(f"{o}:{o.aval}" for o in r.outputs)
    ins = " ".join(str(i) for i in r.inputs)
    params = r.params_str()
    params = params if len(params) <= 48 else ""
    return f"#{r.index} {outs} = {r.primitive}{params} {ins}".rstrip()


def feeding_chain(
    rec: Record, producers: dict[int, Record], depth: int = 3, limit: int = 6
) -> list[str]:
    """The records that produced ``rec``'s inputs, breadth first, a few steps back."""
    lines: list[str] = []
    seen, frontier = {rec.index}, [rec]
    for _ in range(depth):
        nxt = []
        for r in frontier:
            for i in r.inputs:
                p = producers.get(i.id) if isinstance(i, Var) else None
                if p is not None and p.index not in seen:
                    seen.add(p.index)
                    nxt.append(p)
        for p in sorted(nxt, key=lambda r: -r.index):
            if len(lines) == limit:
                lines.append("    ...")
                return lines
            lines.append(f"    {describe_record(p).ljust(40)}  at {p.source}")
        frontier = nxt
    return lines


@dataclasses.dataclass(frozen=True)
class Site:
    """One checked value: ``kind`` is "input" (a function input), "forward" (a record's
    output), "cotangent" (a cotangent passed to vjp_fn) or "backward" (the cotangent a
    record's VJP rule returned for one of its inputs)."""

    kind: str
    index: int
    record: Record | None = None
    var: Any = None
    label: str = ""
    # kind "loop": the checks of a loop/branch record's body, once per step; ``body`` are
    # one step's sites, ``steps`` the step indices in the order they ran.
    body: tuple[Site, ...] = ()
    steps: tuple[int, ...] = ()
    producers: Any = None

    @property
    def size(self) -> int:
        """How many probes this site stands for."""
        if self.kind != "loop":
            return 1
        return len(self.steps) * sum(s.size for s in self.body)


def locate(sites: Sequence[Site], k: int) -> tuple[Site, list[tuple[Site, int]]]:
    """The site of flat probe ``k`` and the loops (with their step) it sits in."""
    for s in sites:
        n = s.size
        if k < n:
            if s.kind != "loop":
                return s, []
            t, r = divmod(k, n // len(s.steps))
            sub, path = locate(s.body, r)
            return sub, [(s, s.steps[t])] + path
        k -= n
    raise IndexError(k)


def flat_codes(codes: Sequence[Any]):
    """One vector of probes: a loop's block of probes is flattened in place."""
    if not any(isinstance(c, jax.core.Tracer) for c in codes):
        return np.concatenate([np.ravel(np.asarray(c, np.float32)) for c in jax.device_get(codes)])
    return jnp.concatenate([jnp.ravel(c).astype(jnp.float32) for c in codes])


def _what(code: int) -> str:
    return "NaN" if code == NAN else "Inf"


def _loop_lines(path: Sequence[tuple[Site, int]]) -> list[str]:
    lines = []
    for loop, t in path:
        rec = loop.record
        assert rec is not None
        if rec.primitive == "cond":
            lines.append(f"Inside branch {t} of 'cond' (record #{rec.index}) at {rec.source}.")
        else:
            lines.append(
                f"Inside step {t} (from 0) of {rec.trip_count} of '{rec.primitive}' "
                f"(record #{rec.index}) at {rec.source}; the record numbers above are the "
                "loop body's."
            )
    return lines


def message(
    site: Site,
    code: int,
    producers: dict[int, Record],
    mode: AnomalyMode,
    traced: bool,
    path: Sequence[tuple[Site, int]] = (),
) -> str:
    if path:
        producers = path[-1][0].producers
        text = message(site, code, producers, mode, traced)
        first, _, rest = text.partition("\n")
        return "\n".join([first, *_loop_lines(path), rest])
    bad = _what(code)
    var = f"{site.var}:{site.var.aval}" if isinstance(site.var, Var) else str(site.var)
    lines: list[str]
    if site.kind == "input":
        lines = [
            f"{bad} in the function's input {site.label} ({var}), before any record ran.",
            "What to do: check the values passed to the transform.",
        ]
    elif site.kind == "cotangent":
        lines = [
            f"{bad} in the cotangent passed to vjp_fn for output {site.label} ({var}).",
            "What to do: check the cotangent (it is not produced by tapegrad).",
        ]
    elif site.kind == "forward":
        rec = site.record
        assert rec is not None  # forward and backward sites always carry their record
        lines = [
            f"{bad} in the output of '{rec.primitive}' (record #{rec.index}) at {rec.source}: "
            f"its output {site.index} ({var}).",
            f"It is the first record whose output has {bad}: the function's inputs and "
            "every earlier record's outputs passed the same check.",
            f"Forward record: {describe_record(rec)}",
        ]
        chain = feeding_chain(rec, producers)
        if chain:
            lines += ["The records that fed it:", *chain]
        lines.append(
            f"What to do: look at the inputs of '{rec.primitive}' at {rec.source}; the usual "
            "causes are log/sqrt/pow of a negative or zero value, 0/0, inf - inf, or an "
            "overflow. If a jnp.where discards these values on purpose, check backward only: "
            "tg.detect_anomaly(forward=False)."
        )
    else:
        rec = site.record
        assert rec is not None  # forward and backward sites always carry their record
        lines = [
            f"backward of '{rec.primitive}' (record #{rec.index}) returned {bad} values in "
            f"its {site.index}th output: the cotangent of its input {site.index} ({var}).",
            f"Forward record: {describe_record(rec)}   at {rec.source}",
            "It is the first VJP rule in this backward pass to return "
            f"{bad}; the cotangents it received passed the same check.",
        ]
        chain = feeding_chain(rec, producers)
        if chain:
            lines += ["The forward records that fed it:", *chain]
        lines.append(
            f"What to do: the derivative of '{rec.primitive}' is not finite at the values it saw "
            f"at {rec.source} (e.g. log, sqrt or pow at 0, or 0 * inf in the chain rule). Guard "
            "the argument, not only the result: jnp.where(ok, f(jnp.where(ok, x, 1.0)), 0.0), "
            "or add an epsilon."
        )
    if traced:
        lines.append(
            "(Checked under a jax trace: raised from a host callback when the compiled call ran.)"
        )
    return "\n".join(lines)


class _Report:
    """The host side of one pass's checks: find the first bad site and raise."""

    def __init__(self, sites: Sequence[Site], producers: dict[int, Record], mode: AnomalyMode):
        self.sites, self.producers, self.mode = tuple(sites), producers, mode

    def __call__(self, codes, traced: bool = True) -> None:
        hit = first_bad(codes, sum(s.size for s in self.sites), self.mode)
        if hit is not None:
            k, code = hit
            site, path = locate(self.sites, k)
            raise AnomalyError(message(site, code, self.producers, self.mode, traced, path))


def emit(
    sites: Sequence[Site],
    codes: list,
    producers: dict[int, Record],
    mode: AnomalyMode,
    values: Sequence[Any] = (),
) -> list:
    """Check ``codes`` now (concrete values) or stage a check that does (traced values).

    Returns ``values``: under a trace, tied to the staged check (see `_stage`), so
    the check runs whenever the compiled program computes them.
    """
    values = list(values)
    if not codes:
        return values
    report = _Report(sites, producers, mode)
    if not any(isinstance(c, jax.core.Tracer) for c in codes):
        report(flat_codes(codes), traced=False)
        return values
    probes = lax.stop_gradient(flat_codes(codes))  # under an outer jax.grad: no tangent
    bad = jnp.zeros((), bool)
    if mode.check_nan:
        bad = bad | jnp.any(jnp.isnan(probes))
    if mode.check_inf:
        bad = bad | jnp.any(jnp.isinf(probes))
    if not any(_tieable(v) for v in values):
        # Nothing to tie the check to: an effectful callback, which is never removed.
        jax.debug.callback(functools.partial(report, traced=True), probes)
        return values
    return _tie(_stage(report, bad, probes), values)


def _stage(report: _Report, bad, probes):
    """Under a trace: a host callback, called only when some check failed.

    Why `pure_callback` inside `lax.cond`, tied to the outputs, and not a plain
    `jax.debug.callback`: inside the cond the callback is not even called while
    every check passes, so no host round trip per call; and an effect-free
    program keeps XLA's scheduling freedom. (Any host callback still makes jax
    dispatch the compiled call through its Python path rather than its C++ fast
    path: a fixed ~0.5 ms per call on CPU, which is most of the jit overhead on
    the small benchmark MLP and negligible on large programs.)
    """

    def host(codes):
        report(codes, traced=True)
        return np.zeros((), np.int8)

    def call(f):
        return jax.pure_callback(
            host, jax.ShapeDtypeStruct((), jnp.int8), f, vmap_method="sequential"
        )

    return lax.cond(bad, call, lambda f: jnp.zeros((), jnp.int8), probes)


def _tieable(v) -> bool:
    return isinstance(v, jax.core.Tracer) and checkable(v) and np.size(v) > 0


def _tie(ok, values: list) -> list:
    """Make each floating output depend on ``ok`` (0 when the checks passed), so neither
    jax nor XLA drops the check as dead code (an optimization barrier would not do:
    XLA's CPU and GPU pipelines expand barriers before dead-code elimination). Element
    0 of each array is rewritten in place to itself (``select(ok == 0, x[0], nan)``):
    values are unchanged, and the cost is one scalar per output."""
    out = []
    for v in values:
        if _tieable(v):
            idx = (0,) * np.ndim(v)
            v = v.at[idx].set(lax.select(ok == 0, v[idx], jnp.full((), jnp.nan, v.dtype)))
        out.append(v)
    return out


# ---------------------------------------------------------------------------
# The observer


class AnomalyObserver:
    """Plugged into `_interpret.forward` / `backward` when anomaly mode is on.

    Collects one code per checked value; `forward_done` / `backward_done` check
    them (eagerly) or stage the check (under a trace).
    """

    def __init__(self, mode: AnomalyMode, tape: Tape, input_labels: Sequence[str] = ()):
        self.mode, self.tape = mode, tape
        self.input_labels = tuple(input_labels)
        self._producers: dict[int, Record] | None = None
        self.sites: list[Site] = []
        self.codes: list = []

    @property
    def producers(self) -> dict[int, Record]:
        if self._producers is None:
            self._producers = producers_of(self.tape)
        return self._producers

    def fresh(self) -> AnomalyObserver:
        """An observer for one more backward pass over the same tape (``vjp_fn`` calls)."""
        new = AnomalyObserver(self.mode, self.tape, self.input_labels)
        new._producers = self._producers
        return new

    def _add(self, site: Site, value) -> None:
        if checkable(value):
            self.sites.append(site)
            self.codes.append(code_of(value, self.mode))

    # -- called by the interpreters
    def child(self, body: Tape) -> AnomalyObserver:
        """An observer for one step of a loop (or a branch) running ``body``."""
        return AnomalyObserver(self.mode, body)

    def step_codes(self):
        """This (child) observer's probes as one vector, for a loop to stack per step."""
        return flat_codes(self.codes) if self.codes else jnp.zeros((0,), jnp.float32)

    def add_loop(self, rec: Record, child: AnomalyObserver, codes, steps: Sequence[int]) -> None:
        """The probes of a loop's steps (``codes[i]`` ran as step ``steps[i]``)."""
        if child.sites:
            site = Site("loop", rec.index, rec, None, "", tuple(child.sites), tuple(steps))
            self.sites.append(dataclasses.replace(site, producers=child.producers))
            self.codes.append(codes)

    def forward_record(self, rec: Record, ins: list, outs: list) -> None:
        if self.mode.forward:
            for k, (v, x) in enumerate(zip(rec.outputs, outs)):
                self._add(Site("forward", k, rec, v), x)

    def backward_record(self, rec: Record, cts: list, in_cts: Sequence[Any]) -> None:
        for i, ct in enumerate(in_cts):
            if ct is not None and i < len(rec.inputs) and rec.active[i]:
                self._add(Site("backward", i, rec, rec.inputs[i]), ct)

    # -- called by the transforms
    def forward_done(
        self, args: Sequence[Any], outs: Sequence[Any] = (), defer_traced: bool = False
    ) -> list:
        """Check the inputs and the forward pass; returns ``outs`` (tied to the check under a
        trace). Under a trace with ``defer_traced`` the codes wait for `backward_done`
        (one check for the whole program)."""
        outs = list(outs)
        if not self.mode.forward:
            self.sites, self.codes = [], []
            return outs
        sites, codes = [], []
        for k, (v, x) in enumerate(zip(self.tape.inputs, args)):
            if checkable(x):
                label = self.input_labels[k] if k < len(self.input_labels) else f"#{k}"
                sites.append(Site("input", k, None, v, label))
                codes.append(code_of(x, self.mode))
        self.sites, self.codes = sites + self.sites, codes + self.codes
        traced = any(isinstance(c, jax.core.Tracer) for c in self.codes)
        if defer_traced and traced:
            return outs
        outs = emit(self.sites, self.codes, self.producers, self.mode, outs)
        self.sites, self.codes = [], []
        return outs

    def cotangents_in(self, cts: Sequence[Any]) -> None:
        """The cotangents a caller passed to ``vjp_fn``, checked before any rule's output."""
        for k, (o, ct) in enumerate(zip(self.tape.outputs, cts)):
            if ct is not None:
                self._add(Site("cotangent", k, None, o, str(k)), ct)

    def backward_done(self, values: Sequence[Any] = ()) -> list:
        """Check what is pending (the deferred forward, then backward); returns ``values``
        (the gradients, tied to the check under a trace)."""
        values = emit(self.sites, self.codes, self.producers, self.mode, values)
        self.sites, self.codes = [], []
        return values


def observer(mode: AnomalyMode | None, tape: Tape, in_tree: Any = None) -> AnomalyObserver | None:
    """The observer for one transform call, or None when anomaly mode is off (zero cost)."""
    if mode is None:
        return None
    labels: list[str] = []
    if in_tree is not None:
        try:
            skeleton = tree_util.tree_unflatten(in_tree, list(range(in_tree.num_leaves)))
            paths = tree_util.tree_flatten_with_path(skeleton)[0]
            labels = [tree_util.keystr(p) for p, _ in paths]  # [argument index][path]
        except Exception:  # exotic pytrees: fall back to leaf numbers
            labels = []
    return AnomalyObserver(mode, tape, labels)
