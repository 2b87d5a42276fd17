"""The anomaly observer the interpreters call (`_interpret.forward` / `backward`, once per
record and per VJP rule), and `emit`, which checks a pass's probes now (concrete values)
or stages one host callback that checks them when the compiled call runs (traced
values), tied to the outputs so that it is not removed as dead code."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, tree_util

from tapegrad.anomaly.messages import _Report, producers_of
from tapegrad.anomaly.probes import AnomalyMode, Site, checkable, code_of, flat_codes
from tapegrad.core.tape import Record, Tape

__all__ = ["AnomalyObserver", "emit", "observer"]


def emit(
    sites: Sequence[Site],
    codes: list,
    producers: dict[int, Record],
    mode: AnomalyMode,
    values: Sequence[Any] = (),
    observer: AnomalyObserver | None = None,
) -> list:
    """Check ``codes`` now (concrete values) or stage a check that does (traced values).

    Returns ``values``: under a trace, tied to the staged check (see `_stage`), so
    the check runs whenever the compiled program computes them. ``observer``: the one
    whose pass this is (its kept operands and the values found bad so far).
    """
    values = list(values)
    if not codes:
        return values
    if observer is None:
        report = _Report(sites, producers, mode)
    else:
        report = _Report(sites, producers, mode, observer.operands, observer.bad)
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
        # Eagerly, what each record read, kept until its pass is checked (an error's or
        # an event's operands): (phase, record index) -> (names, values).
        self.operands: dict[tuple[str, int], tuple[list[str], list]] = {}
        self.bad: set = set()  # value keys found non-finite so far (forward, then backward)

    @property
    def producers(self) -> dict[int, Record]:
        if self._producers is None:
            self._producers = producers_of(self.tape)
        return self._producers

    def fresh(self) -> AnomalyObserver:
        """An observer for one more backward pass over the same tape (``vjp_fn`` calls)."""
        new = AnomalyObserver(self.mode, self.tape, self.input_labels)
        new._producers = self._producers
        new.bad = self.bad
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
            if _concrete(ins):
                self.operands[("forward", rec.index)] = ([str(u) for u in rec.inputs], ins)

    def backward_record(self, rec: Record, cts: list, in_cts: Sequence[Any]) -> None:
        for i, ct in enumerate(in_cts):
            if ct is not None and i < len(rec.inputs) and rec.active[i]:
                self._add(Site("backward", i, rec, rec.inputs[i]), ct)
        if _concrete(cts):
            names = [f"cotangent of {o}" for o in rec.outputs]
            self.operands[("backward", rec.index)] = (names, list(cts))

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
        outs = emit(self.sites, self.codes, self.producers, self.mode, outs, self)
        self.sites, self.codes, self.operands = [], [], {}
        return outs

    def cotangents_in(self, cts: Sequence[Any]) -> None:
        """The cotangents a caller passed to ``vjp_fn``, checked before any rule's output."""
        for k, (o, ct) in enumerate(zip(self.tape.outputs, cts)):
            if ct is not None:
                self._add(Site("cotangent", k, None, o, str(k)), ct)

    def backward_done(self, values: Sequence[Any] = ()) -> list:
        """Check what is pending (the deferred forward, then backward); returns ``values``
        (the gradients, tied to the check under a trace)."""
        values = emit(self.sites, self.codes, self.producers, self.mode, values, self)
        self.sites, self.codes, self.operands = [], [], {}
        return values


def _concrete(values: Sequence[Any]) -> bool:
    return not any(isinstance(v, jax.core.Tracer) for v in values)


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
