"""Records that carry a sub-program, and the generic fallback.

* The fallback saves a record's inputs and, in backward, takes `jax.vjp` of
  that single primitive: nothing jax can differentiate fails. It is used for
  the long tail and marked ``rule="fallback"`` on the record.
* A ``custom_jvp_call`` is normally replaced at trace time by a ``custom_jvp_rule``
  record (rules/custom_jvp.py: its JVP rule linearized and transposed once, keeping
  only the rule's residuals). One whose rule cannot be split that way is
  differentiated like the fallback, which still honours the user's JVP rule:
  `jax.vjp` linearizes the custom rule and transposes it, never the primal.
* ``custom_vjp_call`` runs the user's ``fwd`` in forward, keeps its residuals
  (through the residual policy, as ``aux`` values) and calls the user's ``bwd``.
* ``remat2`` (``jax.checkpoint``) saves only its inputs and recomputes its body
  in backward: that *is* checkpointing.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from tapegrad.core import jax_compat as compat
from tapegrad.core.tape import Lit, custom_vjp_name  # noqa: F401  (documented here: tg.rules.control.custom_vjp_name)
from tapegrad.errors import where
from tapegrad.rules._registry import Rule, defrule


def _bind(rec, ins):
    out = rec.prim.bind(*ins, **rec.bind_params)
    return list(out) if rec.prim.multiple_results else [out]


def _zero_ct(aval):
    if jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact):
        return jax.numpy.zeros(aval.shape, aval.dtype)
    return np.zeros(aval.shape, jax.dtypes.float0)


def _save_var_inputs(p, ins, outs, active):
    return tuple(("in", i) for i, v in enumerate(ins) if not isinstance(v, Lit))


def primitive_vjp(rec, vals: list, idx: list[int], outs: list[int] | None = None):
    """`jax.vjp` of ``rec``'s primitive in its inputs ``idx``, the others fixed at ``vals``,
    of its outputs ``outs`` (default: all): what the generic rule runs in backward (and
    `memory_report` estimates abstractly)."""

    def f(*act):
        full = list(vals)
        for i, v in zip(idx, act):
            full[i] = v
        ys = _bind(rec, full)
        return ys if outs is None else [ys[k] for k in outs]

    return jax.vjp(f, *[vals[i] for i in idx])


def _vjp_of_primitive(p, r, cts, active):
    rec = r.record
    vals = [r.x[i] if r.x[i] is not None else rec.inputs[i].value for i in range(len(rec.inputs))]
    idx = [i for i, a in enumerate(active) if a]
    # Only the outputs that received a cotangent: jax then holds the others as symbolic
    # zeros, as its own reverse mode does (a custom_vjp's bwd sees a SymbolicZero there).
    outs = [k for k, c in enumerate(cts) if c is not None]
    _, f_vjp = primitive_vjp(rec, vals, idx, outs)
    in_cts = f_vjp([cts[k] for k in outs])
    out: list[Any] = [None] * len(rec.inputs)
    for i, c in zip(idx, in_cts):
        # A custom rule may return a Python scalar (``lambda g: (2.,)``), as jax allows.
        out[i] = jax.numpy.asarray(c) if isinstance(c, compat.SCALARS) else c
    return out


FALLBACK = Rule("<fallback>", _save_var_inputs, _vjp_of_primitive, kind="fallback")
defrule(Rule("custom_jvp_call", _save_var_inputs, _vjp_of_primitive, kind="custom_jvp"))
defrule(Rule("remat2", _save_var_inputs, _vjp_of_primitive, kind="checkpoint"))
defrule(Rule("checkpoint", _save_var_inputs, _vjp_of_primitive, kind="checkpoint"))


# custom_vjp_call: the user's fwd/bwd.
def _cvjp_avals(p, ins, outs, active):
    n = p["num_consts"]
    if any(active[:n]):
        return []
    return _cvjp_res_avals(p, ins, active)


def _cvjp_res_avals(p, ins, active):
    res_avals, input_fwds = compat.custom_vjp_residual_avals(dict(p), list(active))
    it = iter(res_avals)
    # jax's input_fwds already count the call's leading constants (pe's out_trees_).
    return [next(it) if f is None else ins[f] for f in input_fwds]


def _cvjp_saves(p, ins, outs, active):
    n = p["num_consts"]
    if any(active[:n]):
        return ()
    return tuple(("aux", k) for k in range(len(_cvjp_res_avals(p, ins, active))))


def _cvjp_aliases(p, active):
    return compat.custom_vjp_residual_aliases(dict(p), list(active))


def _cvjp_derive(rec, ins):
    return compat.custom_vjp_forward(dict(rec.params), list(ins), list(rec.active))


def _cvjp_vjp(p, r, cts, active):
    rec = r.record
    n = p["num_consts"]
    if any(active[:n]):
        raise TypeError(
            f"{where(rec)}: a custom_vjp function closes over a value being "
            "differentiated. Pass it as an explicit argument of the custom_vjp function "
            "(jax raises the same CustomVJPException)."
        )
    full_cts = [c if c is not None else _missing_ct(p, o) for c, o in zip(cts, rec.outputs)]
    in_cts = compat.custom_vjp_backward(dict(p), list(r.aux), full_cts)
    return [None] * n + list(in_cts)


def _missing_ct(p, aval):
    # jax's contract for custom_vjp(..., symbolic_zeros=True): an output that received no
    # cotangent reaches the user's bwd as a SymbolicZero, not as a zero array, so the bwd
    # can tell "no cotangent" from "zero cotangent" (tg.Function's
    # ctx.set_materialize_grads(False) relies on it).
    if p.get("symbolic_zeros"):
        return jax.custom_derivatives.SymbolicZero.from_primal_value(
            jax.ShapeDtypeStruct(aval.shape, aval.dtype)
        )
    return _zero_ct(aval)


defrule(
    Rule(
        "custom_vjp_call",
        _cvjp_saves,
        _cvjp_vjp,
        derive=_cvjp_derive,
        aux_avals=_cvjp_avals,
        aliases=_cvjp_aliases,
        kind="custom_vjp",
    )
)


# while: jax has no reverse mode for a dynamic trip count.
def _while_error(rec):
    return (
        f"Reverse-mode differentiation does not work for lax.while_loop or lax.fori_loop "
        f"with dynamic start/stop values: {where(rec)}. Use lax.scan, or fori_loop with "
        "static (Python int) start/stop values."
    )


defrule(Rule("while", lambda *a: (), lambda *a: (), kind="error"))
WHILE_ERROR = _while_error
