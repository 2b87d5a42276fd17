"""``custom_jvp`` calls, differentiated by their JVP rule linearized and transposed.

jax differentiates a ``custom_jvp`` function (``jax.nn.relu``, ``jax.nn.softplus``,
a user's ``@jax.custom_jvp``) in reverse mode by linearizing its JVP rule and
transposing the linear part: the rule, never the primal implementation, defines
the derivative. tapegrad does the same once, at trace time:

* the rule is traced (``jvp(primals, tangents)``) and split by data dependence into
  a *primal part* (every equation that does not read a tangent: the outputs and
  the values the tangents are multiplied by, masked with, ...) and a *linear part*
  (the equations that read a tangent);
* the linear part is transposed (`jax.linear_transpose`) into a jaxpr from the
  residuals and output cotangents to the input cotangents;
* the call becomes one ``custom_jvp_rule`` record whose forward runs the primal part
  and keeps its residuals, and whose backward runs the transposed jaxpr.

Residuals are exactly what the linear part reads: ``jax.nn.relu`` keeps a bool mask
(``x > 0``), not ``x``, bit-packed (rules/_bits.py: 1 bit per element). A residual
that is one of the call's inputs or outputs is saved as that input/output
(``in``/``out``), shared with every other record that saves the same value; the
others are derived values (``aux``). A residual that does not depend on the inputs
(``relu``'s zeros) is recomputed in backward, not kept.
All of them go through the residual policy like any other.

The record's forward evaluates the primal part with ordinary jax operations, so an
outer transformation (``jax.jit``, ``jax.vmap``, ``tg.grad`` of ``tg.grad``) sees the
rule's own computation, as it does under jax.

A call whose rule cannot be split this way (a rule closing over a traced value, an
effect, a tangent part jax cannot transpose) keeps the generic ``custom_jvp`` rule
of rules/control.py, which calls `jax.vjp` of the whole call in backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tapegrad.core import jax_compat as compat
from tapegrad.core.keys import array_key, value_key
from tapegrad.rules._bits import mask_aval, pack_mask, unpack_mask
from tapegrad.rules._linear import Linear, Unsplittable, jitted, linear_for, pruned, reached
from tapegrad.rules._registry import PositiveRef, Ref, Rule, defrule

__all__ = ["ClosesOverTracer", "expand_custom_jvp", "custom_jvp_rule_p"]


class _TapeOnly(compat.Primitive):
    """A primitive that exists only on tapes: binding it evaluates it directly.

    The forward interpreter binds a record's primitive; under an outer trace
    (``jax.jit``, ``tg.grad`` of ``tg.grad``) that must leave the jax operations it
    stands for in the outer jaxpr, not an equation jax cannot interpret.
    """

    multiple_results = True

    def __init__(self, name: str, impl):
        super().__init__(name)
        self._impl = impl

    def bind(self, *args, **params):
        return self._impl(*args, **params)


def _call(*args, rule: Expansion, name: str):
    # Not in backward: the call as jax wrote it (an outer differentiation still
    # sees a custom_jvp_call and uses its rule).
    return compat.bind_custom_jvp_call(args, rule.call_params)


custom_jvp_rule_p = _TapeOnly("custom_jvp_rule", _call)


@dataclass(frozen=True, eq=False)
class Expansion:
    """One call's split rule: its primal part and where each residual comes from."""

    primal: Any  # ClosedJaxpr: primal operands -> (outputs, derived residuals)
    refs: tuple[Ref, ...]  # per residual: ("in", i) / ("out", j) / ("aux", k)
    linear: Linear
    call_params: Any  # the custom_jvp_call's own params (bound when not in backward)
    # Per derived residual: (output j, comparison, literal) when it equals
    # ``comparison(outputs[j], literal)`` (relu's mask ``x > 0`` is ``relu(x) > 0``),
    # else None. See `_plain`.
    from_output: tuple[Any, ...] = ()

    def __repr__(self) -> str:
        return "…"

    def fused_key(self) -> tuple:
        """A structural key for `_fused` (one compiled forward+backward per structure):
        what a record's forward and backward run -- the primal part, the residuals'
        sources, the transposed linear part -- all jaxprs traced once from the user's
        rule, so no user code runs in backward. Raises `_keys.NoKey` when a part holds
        constants (values must not be baked into a compiled call)."""
        lin = self.linear
        outs = tuple(
            None if f is None else (f[0], f[1].name, array_key(f[2])) for f in self.from_output
        )
        return (
            "custom_jvp_rule",
            value_key(self.primal),
            self.refs,
            value_key(lin.lt),
            lin.n_res,
            lin.tangent_of,
            lin.ct_of,
            self.call_params["num_consts"],
            outs,
        )


def call_name(params) -> str:
    debug = getattr(params["call_jaxpr"].jaxpr, "debug_info", None)
    return getattr(debug, "func_name", None) or "<custom_jvp>"


def expand_custom_jvp(params, in_avals: Sequence[Any], source_info: Any = None):
    """A one-equation ``ClosedJaxpr`` standing for a ``custom_jvp_call`` equation,
    whose record is differentiated by the call's JVP rule; None to keep the call.

    ``params`` are the equation's params, ``in_avals`` its operands' avals.
    """
    nc = params["num_consts"]
    primal_avals = list(in_avals[nc:])
    diff = [_differentiable(a) for a in primal_avals]
    out_avals = params["call_jaxpr"].out_avals
    if not any(diff) or not any(_differentiable(a) for a in out_avals):
        return None
    if params["call_jaxpr"].effects:
        return None
    try:
        jaxpr, consts, out_zeros = compat.custom_jvp_jaxpr(dict(params), [not d for d in diff])
    except jax.errors.UnexpectedTracerError as e:
        raise ClosesOverTracer(call_name(params)) from e
    except Exception:
        # The rule fails to trace. jax would raise when differentiating; so does the
        # generic rule, in backward, with jax's message.
        return None
    tracers = [c for c in consts if isinstance(c, jax.core.Tracer)]
    if any(not compat.trace_is_alive(c) for c in tracers):
        raise ClosesOverTracer(call_name(params))  # of the function's own, finished trace
    if jaxpr.effects or tracers:
        # The rule closes over a value of an enclosing trace (an outer jit), alive while
        # backward runs inside it: the generic rule re-binds the call there.
        return None
    try:
        exp = _split(jaxpr, consts, out_zeros, nc, diff, len(out_avals))
    except Unsplittable:
        return None
    exp = Expansion(exp.primal, exp.refs, exp.linear, dict(params), exp.from_output)
    invars = [compat.Var(a) for a in in_avals]
    outvars = [compat.Var(a) for a in out_avals]
    eqn = compat.new_jaxpr_eqn(
        invars,
        outvars,
        custom_jvp_rule_p,
        {"name": call_name(params), "rule": exp},
        frozenset(),
        source_info,
    )
    return compat.ClosedJaxpr(compat.new_jaxpr([], invars, outvars, [eqn], "custom_jvp_rule"), [])


def _differentiable(aval) -> bool:
    return bool(jnp.issubdtype(aval.dtype, jnp.inexact))


class ClosesOverTracer(Exception):
    """A custom_jvp rule closes over a value traced with the function (``y`` in
    ``def rule(...): ... * y`` defined inside it): it can only be evaluated inside that
    trace. Eagerly the tape is recorded from a run instead (`tapegrad.engine.concrete_trace`)."""


def _flatten(jaxpr, env: dict, eqns: list) -> list:
    """Append ``jaxpr``'s equations to ``eqns`` with nested jit calls inlined (so data
    dependence is seen per primitive); returns its outputs. ``env`` maps its inputs."""

    def read(v):
        return v if isinstance(v, compat.Literal) else env[v]

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if eqn.primitive.name in compat.INLINE_CALLS:
            sub = compat.sub_jaxpr(eqn.params)
            if sub is None or sub.consts:
                raise Unsplittable
            sub_env = dict(zip(sub.jaxpr.invars, ins))
            outs = _flatten(sub.jaxpr, sub_env, eqns)
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
            continue
        outs = [compat.Var(v.aval) for v in eqn.outvars]
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
        eqns.append(eqn.replace(invars=ins, outvars=outs))
    return [read(v) for v in jaxpr.outvars]


def _split(jaxpr, consts, out_zeros, nc: int, diff: list[bool], n_out: int) -> Expansion:
    """Split a traced JVP rule into its primal part and its transposed linear part."""
    n_p = len(diff)
    # The constants' variables lead (jax 0.11 lists a recorded rule's as plain invars).
    every = [*jaxpr.constvars, *jaxpr.invars]
    cvars, ins = every[: len(consts)], every[len(consts) :]
    primals = [compat.Var(v.aval) for v in ins[:n_p]]
    tangents = [compat.Var(v.aval) for v in ins[n_p:]]
    constvars = [compat.Var(v.aval) for v in cvars]
    env = dict(zip(ins, primals + tangents)) | dict(zip(cvars, constvars))
    eqns: list = []
    outs = _flatten(jaxpr, env, eqns)
    pouts, touts = outs[:n_out], outs[n_out:]

    # Data dependence: on a tangent (the linear part) and on a primal operand.
    on_t = set(tangents)
    on_x = set(primals)
    linear, in_linear = [], set()
    for eqn in eqns:
        ins = [v for v in eqn.invars if not isinstance(v, compat.Literal)]
        if any(v in on_t for v in ins):
            on_t.update(eqn.outvars)
            linear.append(eqn)
            in_linear.add(id(eqn))
        elif any(v in on_x for v in ins):
            on_x.update(eqn.outvars)
    if any(v in on_t for v in pouts if not isinstance(v, compat.Literal)):
        raise Unsplittable  # a primal output depends on a tangent: not a JVP rule

    # The call outputs whose tangent the rule computes from the input tangents
    # (a tangent that reads no tangent is zero, or the rule is not linear).
    nz_out = [j for j, z in enumerate(out_zeros) if not z]
    ct_of, lin_outs = [], []
    for j, t in zip(nz_out, touts):
        if not isinstance(t, compat.Literal) and t in on_t:
            ct_of.append(j)
            lin_outs.append(t)
    if not lin_outs:
        raise Unsplittable

    # Residuals: what the linear part reads that is not a tangent. One that does not
    # depend on the primal operands (zeros, iota, a constant of the rule) is
    # recomputed in backward instead of kept.
    residuals: list = []
    for eqn in linear:
        for v in eqn.invars:
            if isinstance(v, compat.Literal) or v in on_t or v in residuals:
                continue
            residuals.append(v)
    kept = [v for v in residuals if v in on_x]
    recomputed = [v for v in residuals if v not in on_x]

    # Where each kept residual comes from: an operand, an output, or derived.
    refs: list[Ref] = []
    derived: list = []
    for v in kept:
        if v in primals:
            refs.append(("in", nc + primals.index(v)))
        elif any(v is p for p in pouts):
            refs.append(("out", next(j for j, p in enumerate(pouts) if p is v)))
        else:
            refs.append(("aux", len(derived)))
            derived.append(v)

    const_vals = dict(zip(constvars, consts))
    known = [e for e in eqns if id(e) not in in_linear]
    primal_eqns = _needed(known, pouts + derived)
    pconst = _used_consts(primal_eqns, pouts + derived, constvars)
    primal = compat.ClosedJaxpr(
        compat.new_jaxpr(pconst, primals, pouts + derived, primal_eqns, "custom_jvp primal"),
        [const_vals[c] for c in pconst],
    )

    pre = _needed(known, recomputed)
    lin_eqns = pre + linear
    lconst = _used_consts(lin_eqns, lin_outs, constvars)
    nz_in = [i for i, d in enumerate(diff) if d]
    lin = compat.ClosedJaxpr(
        compat.new_jaxpr(lconst, kept + tangents, lin_outs, lin_eqns, "custom_jvp linear"),
        [const_vals[c] for c in lconst],
    )
    alts = tuple(_from_output(v, known, pouts) for v in derived)
    return Expansion(primal, tuple(refs), linear_for(lin, len(kept), nz_in, ct_of), None, alts)


# A mask ``x > c`` equals ``max(x, c) > c`` (and ``x < c`` equals ``min(x, c) < c``), NaN
# included (both sides False): so relu's mask can be read off relu's output.
_MASK_OF = {"gt": "max", "lt": "min"}


def _from_output(v, eqns: list, pouts: list) -> Any:
    """``(j, comparison, literal)`` when derived residual ``v`` is ``comparison(x, c)``
    and output j is ``max``/``min`` of the same ``x`` and ``c``; else None."""
    made = {o: e for e in eqns for o in e.outvars}
    e = made.get(v)
    if e is None or e.primitive.name not in _MASK_OF or len(e.invars) != 2:
        return None
    x, c = e.invars
    if isinstance(x, compat.Literal) or not isinstance(c, compat.Literal):
        return None
    for j, p in enumerate(pouts):
        pe = _unwrap(made.get(p)) if not isinstance(p, compat.Literal) else None
        if pe is None or pe.primitive.name != _MASK_OF[e.primitive.name]:
            continue
        a, b = pe.invars
        lit = b if a is x else a if b is x else None
        if isinstance(lit, compat.Literal) and _same_literal(lit, c):
            return (j, e.primitive, c.val)
    return None


def _unwrap(eqn):
    """The one equation a call computes (``relu``'s ``custom_jvp_call`` of ``jit`` of
    ``max``), with the call's operands; the equation itself if not a call; None if a
    call does more than one thing."""
    for _ in range(8):
        if eqn is None:
            return None
        name = eqn.primitive.name
        if name != "custom_jvp_call" and name not in compat.INLINE_CALLS:
            return eqn
        sub = compat.sub_jaxpr(eqn.params)
        if sub is None or sub.consts or len(sub.jaxpr.eqns) != 1:
            return None
        inner = sub.jaxpr.eqns[0]
        if list(sub.jaxpr.outvars) != list(inner.outvars):
            return None
        env = dict(zip(sub.jaxpr.invars, eqn.invars))
        ops = [v if isinstance(v, compat.Literal) else env.get(v) for v in inner.invars]
        if any(v is None for v in ops):
            return None
        eqn = inner.replace(invars=ops, outvars=eqn.outvars)
    return None


def _same_literal(a, b) -> bool:
    va, vb = np.asarray(a.val), np.asarray(b.val)
    return a.aval == b.aval and va.shape == vb.shape and bool(np.all(va == vb))


def _needed(eqns: list, wanted: list) -> list:
    """The equations of ``eqns`` that ``wanted`` depends on, in order."""
    need = {v for v in wanted if not isinstance(v, compat.Literal)}
    keep = []
    for eqn in reversed(eqns):
        if any(v in need for v in eqn.outvars):
            keep.append(eqn)
            need.update(v for v in eqn.invars if not isinstance(v, compat.Literal))
    keep.reverse()
    return keep


def _used_consts(eqns: list, outs: list, constvars: list) -> list:
    used = {v for e in eqns for v in e.invars if not isinstance(v, compat.Literal)}
    used |= {v for v in outs if not isinstance(v, compat.Literal)}
    return [c for c in constvars if c in used]


def _active_tangents(exp: Expansion, active: Sequence[bool]) -> tuple[bool, ...]:
    nc = exp.call_params["num_consts"]
    return tuple(bool(active[nc + i]) for i in exp.linear.tangent_of)


def _links(p, active, out_useful) -> list[bool]:
    # The consts keep their activity: differentiating one is an error (`_trace`).
    exp: Expansion = p["rule"]
    nc = exp.call_params["num_consts"]
    reach = list(active[:nc]) + [False] * (len(active) - nc)
    for i, a in zip(exp.linear.tangent_of, reached(exp.linear, [True] * len(active), out_useful)):
        reach[nc + i] = a
    return reach


def _saves(p, ins, outs, active) -> tuple[Ref, ...]:
    exp: Expansion = p["rule"]
    act = _active_tangents(exp, active)
    if not any(act):
        return ()
    _, res, _ = pruned(exp.linear, act)
    return tuple(dict.fromkeys(exp.refs[k] for k in res))


def _plain(p, ins, outs, active) -> tuple[Ref | PositiveRef, ...] | None:
    """What the record keeps when every derived residual it keeps is read off an output
    (`Expansion.from_output`: relu's mask ``x > 0`` off ``relu(x)``); None when one is
    not. Taken only where that output is kept anyway, unchanged (`keeping_operands`)."""
    exp: Expansion = p["rule"]
    refs: dict[Ref, bool] = {}  # -> read only where positive (relu's ``y > 0``, y >= 0)
    for kind, k in _saves(p, ins, outs, active):
        positive = False
        if kind == "aux":
            alt = exp.from_output[k] if k < len(exp.from_output) else None
            if alt is None:
                return None
            kind, k = "out", alt[0]
            positive = alt[1].name == "gt" and np.ndim(alt[2]) == 0 and alt[2] == 0
        refs[(kind, k)] = refs.get((kind, k), True) and positive
    return tuple((*ref, "positive") if pos else ref for ref, pos in refs.items())


def _is_mask(aval) -> bool:
    return np.dtype(aval.dtype) == np.bool_


def _aux_avals(p, ins, outs, active) -> list:
    # A derived mask (relu's ``x > 0``) is kept bit-packed (rules/_bits.py).
    exp: Expansion = p["rule"]
    n_out = len(outs)
    avals = [v.aval for v in exp.primal.jaxpr.outvars[n_out:]]
    return [mask_aval(a.shape, getattr(a, "sharding", None)) if _is_mask(a) else a for a in avals]


def _derive(rec, ins):
    exp: Expansion = rec.params["rule"]
    nc = exp.call_params["num_consts"]
    vals = compat.eval_closed_jaxpr(exp.primal, *ins[nc:])
    # An output the rule gives as a literal comes back as a Python/numpy scalar.
    vals = [
        v if isinstance(v, (jax.Array, jax.core.Tracer)) else jnp.asarray(v, o.aval.dtype)
        for v, o in zip(vals, exp.primal.jaxpr.outvars)
    ]
    n_out = len(rec.outputs)
    kept = {s.index for s in rec.saves if s.kind == "aux"}
    aux = [
        (pack_mask(v) if _is_mask(o.aval) else v) if k in kept else None
        for k, (v, o) in enumerate(zip(vals[n_out:], exp.primal.jaxpr.outvars[n_out:]))
    ]
    return vals[:n_out], aux


def _vjp(p, r, cts, active):
    exp: Expansion = p["rule"]
    if p.get("mask_in_pool"):
        # relu before a max-pool that applies its mask (`_rebuild._relu_into_pool`): the
        # cotangent is already 0 wherever the mask is
        nc = exp.call_params["num_consts"]
        return [cts[0] if i == nc and a else None for i, a in enumerate(active)]
    lin = exp.linear
    act = reached(lin, _active_tangents(exp, active), [g is not None for g in cts])
    out: list[Any] = [None] * len(active)
    if not any(act):
        return out
    jaxpr, res_used, cts_used = pruned(lin, act)
    args = [_residual(r, exp, exp.refs[k]) for k in res_used]
    for k in cts_used:
        j = lin.ct_of[k]
        g = cts[j]
        args.append(g if g is not None else jnp.zeros(r.out_avals[j].shape, r.out_avals[j].dtype))
    if all(isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) for a in args):
        in_cts = jitted(lin, act)(*args)  # eagerly: one dispatch, compiled once per structure
    else:
        in_cts = compat.eval_closed_jaxpr(jaxpr, *args)
    nc = exp.call_params["num_consts"]
    for i, ct in zip((i for i, a in zip(lin.tangent_of, act) if a), in_cts):
        out[nc + i] = ct
    return out


def _residual(r, exp: Expansion, ref: Ref):
    kind, i = ref
    if kind == "in":
        return r.x[i]
    if kind == "out":
        return r.y[i]
    if i >= len(r.aux) or r.aux[i] is None:  # read off the output kept instead (`_plain`)
        j, compare, lit = exp.from_output[i]
        y = r.y[j]
        return compare.bind(y, jnp.asarray(lit, y.dtype))
    aval = exp.primal.jaxpr.outvars[len(r.out_avals) + i].aval
    return unpack_mask(r.aux[i], aval.shape) if _is_mask(aval) else r.aux[i]


defrule(
    Rule(
        "custom_jvp_rule",
        _saves,
        _vjp,
        derive=_derive,
        aux_avals=_aux_avals,
        kind="linearized",
        plain=_plain,
        links=_links,
    )
)
