"""What the loop and branch record kinds share: the per-step residual store (`_Stored`),
windows over scanned inputs, and one step's run through the interpreter (`_body_forward`,
`_body_backward`: the same forward and backward every tape runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tapegrad.core.tape import Record, Tape, is_differentiable_dtype
from tapegrad.engine.interpret import Residuals, backward, forward


class _Stored:
    """The per-step residuals of one loop/branch record's forward.

    ``skel`` is a body `Residuals` without values (infos, policy); ``keys``
    the order of the per-step values; ``values`` their stacked (scan) or union (switch)
    values, or ``steps``: one `Residuals` per step (Python-loop mode, concrete cond).
    """

    __slots__ = ("skel", "keys", "values", "steps", "branch", "shifted")

    def __init__(self, skel=None, keys=None, values=None, steps=None, branch=None, shifted=()):
        self.skel, self.keys, self.values, self.steps, self.branch = (
            skel,
            keys,
            values,
            steps,
            branch,
        )
        # (carry-in key, carry-out key, initial carry): the carry a step saves is the
        # previous step's saved output, so only the outputs are stacked (see _carry_pairs).
        self.shifted = shifted


class _Static:
    """Pytree metadata that never tells two traces apart: the branches of a
    ``lax.switch`` (and its ``eval_shape``) trace a nested record's skeleton separately,
    and the skeletons hold equal structure in different objects."""

    __slots__ = ("v",)

    def __init__(self, v):
        self.v = v

    def __eq__(self, other) -> bool:
        return type(other) is _Static

    def __hash__(self) -> int:
        return 0


# A nested loop's residuals leave the enclosing step as a pytree: its values are leaves.
jax.tree_util.register_pytree_node(
    _Stored,
    lambda s: (
        (s.values, [init for _, _, init in s.shifted]),
        _Static((s.skel, s.keys, s.steps, s.branch, [k[:2] for k in s.shifted])),
    ),
    lambda a, c: _Stored(
        a.v[0], a.v[1], c[0], a.v[2], a.v[3], tuple((*k, i) for k, i in zip(a.v[4], c[1]))
    ),
)


def _concrete(vals: Sequence[Any]) -> bool:
    return not any(isinstance(v, jax.core.Tracer) for v in vals)


def _coerce(vals: Sequence[Any], vars_) -> list:
    """Body outputs as arrays of the body's declared types (lax.scan checks carries)."""
    out = []
    for v, var in zip(vals, vars_):
        a = jnp.asarray(v)
        if a.dtype != var.dtype and jnp.issubdtype(var.dtype, jnp.number):
            a = a.astype(var.dtype)
        out.append(a)
    return out


def _body_forward(
    body: Tape, args, res, rec: Record, fwd: frozenset[int], child=None, step: Any = 0
):
    """One step (``step``: its index, an int or a traced uint32) or branch of ``rec``."""

    loops, steps = res.loops + (rec,), res.steps + (step,)
    return forward(body, args, res.policy, loops=loops, steps=steps, forwarded=fwd, observer=child)


def _body_backward(body: Tape, r, cts, retain: bool, child=None) -> list:

    return backward(body, r, cts, retain=retain, observer=child)


def _clone(skel, store: dict):

    r = Residuals(skel.policy)
    r.store = store
    r.infos = skel.infos
    r.input_ids, r.plain, r.raw, r.loops = skel.input_ids, skel.plain, skel.raw, skel.loops
    return r


def _child(observer, body: Tape):
    """An anomaly observer for one step of ``body`` (None when anomaly mode is off)."""
    return observer.child(body) if observer is not None else None


def _codes(child):
    return child.step_codes() if child is not None else jnp.zeros((0,), jnp.float32)


def _zeros(var):
    return jnp.zeros(var.shape, var.dtype)


def _active_carries(rec: Record) -> list[bool]:
    """Which carries pass a cotangent from step to step (active and differentiable)."""
    body, nc = rec.bodies[0], rec.params["num_consts"]
    return [
        body.active_inputs[nc + j] and is_differentiable_dtype(body.inputs[nc + j].dtype)
        for j in range(rec.params["num_carry"])
    ]


def _input_cts(rec: Record, acc: list, ct_c: list, c_act: list, ct_xs: list) -> list:
    """A scan record's input cotangents: accumulated consts, the initial carries', the
    scanned inputs'; None for inputs that get none."""
    nc, nk = rec.params["num_consts"], rec.params["num_carry"]
    cts = [*acc, *ct_c, *ct_xs]
    return [
        c if rec.active[i] and (not nc <= i < nc + nk or c_act[i - nc]) else None
        for i, c in enumerate(cts)
    ]


def _add(a, c):
    if a is None or c is None:
        return a
    return lax.add(a, c.astype(a.dtype) if c.dtype != a.dtype else c)


def _stack_cts(cts: list, var) -> Any:
    per = [c if c is not None else jnp.zeros(var.shape[1:], var.dtype) for c in cts]
    return jnp.stack(per) if per else jnp.zeros((0,) + var.shape[1:], var.dtype)


def _flip(vals: Sequence[Any]) -> list:
    """Scanned values in the order a reverse scan runs its steps (None stays None)."""
    return [None if v is None else jnp.flip(v, 0) for v in vals]


class _Window:
    """Steps ``start`` to ``start + length`` of a scanned input (or a ys cotangent), counted
    in the order the scan runs them (``rev``: it runs ``base`` last to first). A nested
    schedule hands its segments windows, not slices: only the innermost segment, and one
    step at a time of a plain forward run, are ever copied out of ``base``."""

    __slots__ = ("base", "start", "length", "rev")

    def __init__(self, base, start, length: int, rev: bool):
        self.base, self.start, self.length, self.rev = base, start, length, rev

    def take(self, start, size: int) -> _Window:
        return _Window(self.base, self.start + start, size, self.rev)

    def step(self, t):
        """Step ``t`` (may be traced) of the window."""
        i = self.start + t
        i = self.base.shape[0] - 1 - i if self.rev else i
        return lax.dynamic_index_in_dim(self.base, i, keepdims=False)

    def array(self):
        if not self.rev:
            return lax.dynamic_slice_in_dim(self.base, self.start, self.length)
        end = self.base.shape[0] - self.start - self.length
        return jnp.flip(lax.dynamic_slice_in_dim(self.base, end, self.length), 0)


def _window(v, rev: bool):
    """A scanned input as a window of all its steps (None and windows pass through)."""
    if v is None or isinstance(v, _Window):
        return v
    return _Window(v, 0, v.shape[0], rev)


def _arrays(vals: Sequence[Any]) -> list:
    return [v.array() if isinstance(v, _Window) else v for v in vals]


def _leaves(vals: Sequence[Any]) -> list:
    """The arrays behind ``vals`` (a window's base and start), for `_concrete`."""
    return [x for v in vals for x in ((v.base, v.start) if isinstance(v, _Window) else (v,))]


def _ct_or_zeros(c, shape, dtype):
    return c if c is not None else jnp.zeros(shape, dtype)
