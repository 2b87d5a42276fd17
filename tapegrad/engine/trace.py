"""jaxpr -> Tape.

Tracing uses jax's own tracer (`jax.make_jaxpr`); this module converts the
`ClosedJaxpr` into tapegrad's frozen records, inlines nested ``jit`` calls,
and decides, per record, what it saves for backward:

* *active* values depend on a differentiated input (forward reachability);
* *useful* values reach a differentiated output (backward reachability);
* a record takes part in backward when an active input of it feeds a useful
  output, and then saves exactly what its rule needs for those inputs.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

import jax
import numpy as np

from tapegrad.core import jax_compat as compat
from tapegrad.core.keys import NoKey, value_key
from tapegrad.core.tape import (
    Lit,
    Record,
    Region,
    Saved,
    Tape,
    Var,
    as_dtype,
    is_differentiable_dtype,
)
from tapegrad.engine.activity import marking_active
from tapegrad.engine.concrete_trace import is_concrete, record_jaxpr
from tapegrad.engine.loops.saves import outer_saves
from tapegrad.engine.placement import constrained, place
from tapegrad.engine.tape_cache import _TAPES, param_key, tape_key, with_values
from tapegrad.errors import ClosedOverTracerError, ReverseModeError
from tapegrad.rules import FALLBACK, NONDIFF, WHILE_ERROR, lookup
from tapegrad.rules.custom_jvp import ClosesOverTracer, call_name, expand_custom_jvp

__all__ = ["trace_flat", "is_differentiable_dtype"]


class _Raw:
    """A record before analysis (mutable only while this module builds it)."""

    __slots__ = ("prim", "name", "params", "inputs", "outputs", "source_info", "region", "names")

    def __init__(self, prim, name, params, inputs, outputs, source_info, region=None, names=()):
        self.prim, self.name, self.params = prim, name, params
        self.inputs, self.outputs, self.source_info = inputs, outputs, source_info
        self.region, self.names = region, names


class _Builder:
    def __init__(self):
        self.counter = itertools.count()
        self.raws: list[_Raw] = []
        self.top_lits: list[Lit] = []  # the top-level jaxpr's literals, in reading order
        self.consts: list[tuple[Var, Any]] = []
        self.regions: list[Region] = []
        self.computed: dict[Any, list[Var | Lit]] = {}  # equal equations merged (`_cse_key`)

    def new_var(self, aval) -> Var:
        return Var(
            next(self.counter),
            tuple(aval.shape),
            as_dtype(aval.dtype),
            getattr(aval, "sharding", None),
        )

    def convert(
        self,
        jaxpr,
        consts: Sequence[Any],
        in_vals: Sequence[Var | Lit],
        region: int | None = None,
        caller: Any = None,
        top: bool = False,
    ) -> list[Var | Lit]:
        """Append ``jaxpr``'s equations as raws; ``caller`` is the source info of the call
        being inlined, for equations whose own has no user frame (a cached ``jit`` trace).
        ``top``: the traced program itself, whose literals are listed in `top_lits`."""
        env: dict[Any, Var | Lit] = {}
        for v, c in zip(jaxpr.constvars, consts):
            var = self.new_var(v.aval)
            self.consts.append((var, c))
            env[v] = var
        for v, x in zip(jaxpr.invars, in_vals):
            env[v] = x

        def read(v):
            if isinstance(v, compat.Literal):
                aval = v.aval
                lit = Lit(v.val, tuple(aval.shape), as_dtype(aval.dtype))
                if top:
                    self.top_lits.append(lit)
                return lit
            return env[v]

        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            src = eqn.source_info
            if caller is not None and compat.frame_of(src) is None:
                src = caller
            if name in compat.INLINE_CALLS:
                sub = compat.sub_jaxpr(eqn.params)
                assert sub is not None  # every INLINE_CALLS primitive carries its callee
                in_s, out_s = compat.call_shardings(eqn.params)
                ins = self.constrain(ins, sub.jaxpr.invars, in_s, eqn.params, src, region)
                outs = self.convert(sub.jaxpr, sub.consts, ins, region, src)
                outs = self.constrain(outs, eqn.outvars, out_s, eqn.params, src, region)
                for v, o in zip(eqn.outvars, outs):
                    env[v] = o
                continue
            if name == "custom_jvp_call":  # differentiated by its rule, linearized
                sub = expand_custom_jvp(eqn.params, [v.aval for v in eqn.invars], eqn.source_info)
                if sub is not None:
                    outs = self.convert(sub.jaxpr, sub.consts, ins, region, src)
                    for v, o in zip(eqn.outvars, outs):
                        env[v] = o
                    continue
            special = name in _SPECIAL
            remat = compat.remat_parts(name, eqn.params) if special else None
            if remat is not None:
                # A checkpointed call is inlined: its records are visible on the tape,
                # tagged with their region, whose policy decides what is recomputed.
                body, policy, prevent_cse = remat
                rid = len(self.regions)
                self.regions.append(Region(rid, policy, prevent_cse, frame_str(src)))
                outs = self.convert(body.jaxpr, body.consts, ins, rid, src)
                for v, o in zip(eqn.outvars, outs):
                    env[v] = o
                continue
            names: tuple[str, ...] = ()
            cp_name = compat.checkpoint_name_of(name, eqn.params) if special else None
            if cp_name is not None:
                name, names = "name", (cp_name,)
            same = _cse_key(eqn, name, ins, region, names, top)
            if same is not None and same in self.computed:
                for v, o in zip(eqn.outvars, self.computed[same]):
                    env[v] = o
                continue
            outs = [self.new_var(v.aval) for v in eqn.outvars]
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
            if same is not None:
                self.computed[same] = list(outs)
            params = compat.eqn_params(name, eqn.params)
            self.raws.append(_Raw(eqn.primitive, name, params, ins, outs, src, region, names))
        return [read(v) for v in jaxpr.outvars]

    def constrain(self, vals, jvars, shardings, params, src, region) -> list[Var | Lit]:
        """``vals`` through a sharding_constraint record wherever the inlined call names a
        concrete sharding: the call's in/out shardings stay on the tape, so values and,
        through the constraint's rule, cotangents are placed as jax places them (its
        transpose of a jit gives input cotangents the in_shardings, output cotangents
        the out_shardings). ``jvars``: the call's variables there, for the avals."""
        out = list(vals)
        for k, (x, v, s) in enumerate(zip(vals, jvars, shardings)):
            p = None if s is None else compat.constraint_params(s, v.aval, params)
            if p is None:
                continue
            y = self.new_var(v.aval)
            prim = compat.sharding_constraint_p
            self.raws.append(_Raw(prim, "sharding_constraint", p, [x], [y], src, region))
            out[k] = y
        return out


# Equations never merged with an equal one: copies and transfers (a second copy may be
# meant to be one), barriers, and XLA's stateful random numbers.
_NO_CSE = frozenset({"copy", "copy_p", "device_put", "optimization_barrier", "rng_uniform", "name"})


def _cse_key(eqn, name: str, ins: Sequence[Var | Lit], region, names, top: bool) -> Any:
    """A key equal for two equations that compute the same values (the same primitive
    and parameters on the same operands), or None. jax's tracing does not merge them:
    ``(x - mu)`` written twice in a layer norm is two equations, and eagerly two arrays
    kept for backward; on the tape it is one record (XLA would merge them under jit).
    Top-level literals are left out: the tape cache swaps their values per call, so an
    equality that held for one call's values may not hold for the next."""
    if eqn.effects or name in _NO_CSE:
        return None
    ops: list[Any] = []
    for i in ins:
        if isinstance(i, Var):
            ops.append(i.id)
        elif top:
            return None
        else:
            try:
                ops.append(("lit", value_key(np.asarray(i.value)[()]), i.shape, i.dtype))
            except (NoKey, TypeError, ValueError):
                return None
    try:
        params = tuple([(k, param_key(p)) for k, p in eqn.params.items()])
        key = (eqn.primitive, name, params, tuple(ops), region, names)
        hash(key)
    except (NoKey, TypeError, ValueError):
        return None
    return key


# The equations that may be a checkpoint or a checkpoint_name, in either remat spelling.
_SPECIAL = compat.REMAT_NAMES | {"call_hi_primitive", "name"}


def frame_str(source_info) -> str:
    frame = compat.frame_of(source_info)
    return "<unknown>" if frame is None else f"{frame[0]}:{frame[1]} ({frame[2]})"


def _rule_for(raw: _Raw):
    rule = lookup(raw.name)
    return rule if rule is not None else FALLBACK


def trace_flat(
    flat_fun: Callable,
    flat_args: Sequence[Any],
    active_inputs: Sequence[bool],
    diff_outputs: Callable[[int], Sequence[bool]] | Sequence[bool] | None = None,
    in_tree: Any = None,
    out_tree_fn: Callable[[], Any] | None = None,
    owner: Any = None,
    recorded: bool = False,
) -> Tape:
    """Trace ``flat_fun(*flat_args)`` into a `Tape`.

    ``active_inputs[i]`` says whether input i is differentiated;
    ``diff_outputs`` whether each output receives a cotangent (default: all).
    ``owner`` (the user's function) lets a later call with the same program reuse the
    tape built for this one (`_TAPES`); its records name that function's lines.
    ``recorded``: build the tape from a concrete run (`tapegrad.engine.concrete_trace`), not
    a trace.
    """
    closed = None
    if not recorded:
        try:
            # marking_active: a tg.Function traced here learns which inputs need a gradient.
            closed = jax.make_jaxpr(marking_active(flat_fun, active_inputs))(*flat_args)
        except compat.NEEDS_CONCRETE:
            # Python control flow on values (`if x > 0:`): jax.grad runs such a function
            # on concrete values, and so do we when the inputs are concrete (not under jit).
            if not is_concrete(flat_args):
                raise
            recorded = True
    if closed is None:  # outside the except: an error while recording is the only one shown
        closed = record_jaxpr(flat_fun, flat_args)
    n_out = len(closed.jaxpr.outvars)
    diff = (
        [True] * n_out
        if diff_outputs is None
        else list(diff_outputs(n_out) if callable(diff_outputs) else diff_outputs)
    )
    out_tree = out_tree_fn() if out_tree_fn is not None else None
    lits: list = []
    key = tape_key(closed, active_inputs, diff, in_tree, out_tree, owner, lits)
    cached = _TAPES.get(key) if key is not None else None
    if cached is not None:
        tape, old_lits, has_constraint = cached
        return place(with_values(tape, closed.consts, old_lits, lits), flat_args, has_constraint)
    try:
        tape, top_lits = _build(closed, active_inputs, diff, in_tree, out_tree, top=True)
    except ClosesOverTracer as e:
        if recorded or not is_concrete(flat_args):
            raise ClosedOverTracerError(_closure_message(e)) from None
        # Recorded, the rule closes over concrete values instead of a finished trace's.
        return trace_flat(
            flat_fun, flat_args, active_inputs, diff, in_tree, out_tree_fn, None, True
        )
    except compat.NEEDS_CONCRETE:
        # A custom_vjp's fwd branching on values (`if x > 0:`) is traced only here, where
        # its residuals are counted: jax.grad runs it eagerly, and so does the recording.
        if recorded or not is_concrete(flat_args):
            raise
        return trace_flat(
            flat_fun, flat_args, active_inputs, diff, in_tree, out_tree_fn, None, True
        )
    if key is not None:
        if len(top_lits) == len(lits) and all(
            o.shape == tuple(n.aval.shape) for o, n in zip(top_lits, lits)
        ):  # the same literals, read in the same order
            template = with_values(tape, [None] * len(tape.consts), [], [])
            _TAPES.put(key, (template, top_lits, constrained(tape)))
    return place(tape, flat_args)  # after the cache: placements follow the arguments


def _closure_message(e: ClosesOverTracer) -> str:
    return (
        f"The JVP rule of the custom_jvp function '{e.args[0]}' closes over a value computed "
        "inside the differentiated function. tapegrad differentiates such a rule only "
        "eagerly (concrete inputs, not under jax.jit, jax.vmap or an outer tg.grad), and "
        "only when that value does not depend on the differentiated inputs (the rule gives "
        "no tangent for it). Pass the value to the custom_jvp function as an argument (or "
        "use jax.closure_convert) and give its tangent in the rule."
    )


def tape_from_jaxpr(
    closed,
    active_inputs: Sequence[bool],
    diff_outputs: Any = None,
    in_tree: Any = None,
    out_tree: Any = None,
) -> Tape:
    """Convert a `ClosedJaxpr` into a `Tape` (see `trace_flat`)."""
    return _build(closed, active_inputs, diff_outputs, in_tree, out_tree)[0]


def _build(
    closed, active_inputs, diff_outputs, in_tree, out_tree, top: bool = False
) -> tuple[Tape, list[Lit]]:
    """`tape_from_jaxpr`, and the top-level literals of the tape in reading order.
    ``top``: the function's own tape, whose inputs the caller holds (a loop body's are
    per-step values)."""
    b = _Builder()
    in_vars = [b.new_var(v.aval) for v in closed.jaxpr.invars]
    outs = b.convert(closed.jaxpr, closed.consts, in_vars, top=True)

    n_out = len(outs)
    if diff_outputs is None:
        diff = [True] * n_out
    elif callable(diff_outputs):
        diff = list(diff_outputs(n_out))
    else:
        diff = list(diff_outputs)

    # Forward: which values depend on a differentiated input.
    active: set[int] = {
        v.id for v, a in zip(in_vars, active_inputs) if a and is_differentiable_dtype(v.dtype)
    }
    body_act: dict[int, list[bool]] = {}  # loop/branch raw -> its bodies' active inputs
    _propagate(b.raws, active, body_act)

    # Backward: which active values reach a differentiated output.
    useful: set[int] = {
        o.id for o, d in zip(outs, diff) if d and isinstance(o, Var) and o.id in active
    }
    acts, structured = _reach_back(b.raws, active, useful, body_act)
    records = _records(b.raws, acts, structured)

    # Records keep their masks here. Planning with the policy switches a record to the
    # value its masks are read off where that value is kept anyway and comes back
    # unchanged (`_rebuild.rebuilt_records`; in a loop body `_rebuild.shared_in_body`): a
    # mask read off a rounded operand would be wrong.
    tape = Tape(
        inputs=tuple(in_vars),
        records=tuple(records),
        outputs=tuple(outs),
        consts=tuple(b.consts),
        active_inputs=tuple(bool(a) for a in active_inputs),
        reached=tuple(v.id in useful for v in in_vars),
        in_tree=in_tree,
        out_tree=out_tree,
        regions=tuple(b.regions),
    )
    return tape, b.top_lits


def _reach_back(
    raws: Sequence[_Raw], active: set[int], useful: set[int], body_act: dict[int, list[bool]]
) -> tuple[dict[int, tuple[bool, ...]], dict[int, Record]]:
    """Backward reachability: add to ``useful`` every active value a cotangent of a useful
    one reaches; (each differentiated raw's active inputs, the loop/branch records built)."""
    # A record's input is differentiated only where a cotangent of a useful output
    # reaches it through the record's own rule (`Rule.links`; a loop's or branch's body):
    # an input that only a structurally zero cotangent would reach is not, and neither is
    # whatever computes it (symbolic zeros, decided once, here: nothing is kept for it).
    acts: dict[int, tuple[bool, ...]] = {}
    structured: dict[int, Record] = {}
    for k in range(len(raws) - 1, -1, -1):
        raw = raws[k]
        out_useful = [o.id in useful for o in raw.outputs]
        if not any(out_useful):
            continue
        act = [isinstance(i, Var) and i.id in active for i in raw.inputs]
        if not any(act):
            continue
        if raw.name in STRUCTURED:
            rec_k = _structured_record(k, raw, tuple(act), body_act[k], active, useful)
            structured[k], act = rec_k, list(rec_k.active)
        else:
            links = _rule_for(raw).links
            if links is not None:
                reach = links(raw.params, act, out_useful)
                act = [a and r for a, r in zip(act, reach)]
        if any(act):
            acts[k] = tuple(act)
            for i, a in zip(raw.inputs, act):
                if a:
                    useful.add(i.id)
    return acts, structured


def _records(
    raws: Sequence[_Raw], acts: dict[int, tuple[bool, ...]], structured: dict[int, Record]
) -> list[Record]:
    """The tape's records: each differentiated raw (``acts``: its active inputs) with
    what its rule saves for them, the others with nothing."""
    records = []
    for k, raw in enumerate(raws):
        # A read-only view, not a copy: jax never mutates an equation's params, and
        # get_bind_params returns them as they are for plain primitives (call-like ones copy).
        params = MappingProxyType(raw.params)
        bind_params = compat.bind_params(raw.prim, raw.params)
        ins, outs_k = tuple(raw.inputs), tuple(raw.outputs)
        if k not in acts:
            records.append(
                Record(
                    k,
                    raw.name,
                    ins,
                    outs_k,
                    params,
                    region=raw.region,
                    names=raw.names,
                    prim=raw.prim,
                    source_info=raw.source_info,
                    bind_params=bind_params,
                )
            )
            continue
        act_in = acts[k]
        if raw.name in ("custom_jvp_rule", "custom_jvp_call"):
            _check_no_closed_over_tangent(raw, act_in)
        if raw.name in STRUCTURED:
            records.append(structured[k])
            continue
        rule = _rule_for(raw)
        if rule.kind == "error":
            raise _reverse_mode_error(k, raw, rule, params, act_in)
        refs = rule.saves(params, ins, outs_k, act_in)
        aux = list(rule.aux_avals(params, ins, outs_k, act_in)) if rule.aux_avals else []
        saves = []
        for kind, idx in refs:
            if kind == "in":
                v = raw.inputs[idx]
                if isinstance(v, Lit):
                    continue  # literals live in the program; backward reads them there
            elif kind == "out":
                v = raw.outputs[idx]
            else:
                v = aux[idx]
            saves.append(
                Saved(kind, idx, tuple(v.shape), as_dtype(v.dtype), getattr(v, "sharding", None))
            )
        records.append(
            Record(
                k,
                raw.name,
                ins,
                outs_k,
                params,
                saves=tuple(saves),
                active=act_in,
                rule=rule.kind,
                region=raw.region,
                names=raw.names,
                prim=raw.prim,
                source_info=raw.source_info,
                bind_params=bind_params,
                aliases=tuple(rule.aliases(params, act_in)) if rule.aliases and aux else (),
            )
        )
    return records


def _reverse_mode_error(
    k: int, raw: _Raw, rule: Any, params: Any, act_in: tuple[bool, ...]
) -> ReverseModeError:
    """The error for a raw no rule differentiates in reverse mode (a while loop's)."""
    rec = Record(
        k,
        raw.name,
        tuple(raw.inputs),
        tuple(raw.outputs),
        params,
        active=act_in,
        rule=rule.kind,
        prim=raw.prim,
        source_info=raw.source_info,
    )
    return ReverseModeError(WHILE_ERROR(rec))


def _check_no_closed_over_tangent(raw: _Raw, act_in: tuple[bool, ...]) -> None:
    """Raise where a custom_jvp's closed-over operands are differentiated: its rule gives
    no tangent for what it closes over (jax 0.11 passes such a value to the call as a
    leading operand; jax.grad raises there too)."""
    is_rule = raw.name == "custom_jvp_rule"
    nc = (raw.params["rule"].call_params if is_rule else raw.params)["num_consts"]
    if any(act_in[:nc]):
        err = ClosesOverTracer(raw.params["name"] if is_rule else call_name(raw.params))
        raise ClosedOverTracerError(f"{_closure_message(err)} ({frame_str(raw.source_info)})")


STRUCTURED = frozenset({"scan", "cond"})


def _propagate(raws: Sequence[_Raw], active: set[int], body_act: dict[int, list[bool]]) -> None:
    """Add to ``active`` every raw output that depends on an active value; for loop and
    branch raws, record (by raw position) the activity of their bodies' inputs."""
    for k, raw in enumerate(raws):
        if raw.name in NONDIFF:
            continue
        in_act = [isinstance(i, Var) and i.id in active for i in raw.inputs]
        if not any(in_act):
            continue
        if raw.name in STRUCTURED:
            out_act, body_act[k] = _structured_activity(raw, in_act)
        else:
            out_act = [True] * len(raw.outputs)
        for o, a in zip(raw.outputs, out_act):
            if a and is_differentiable_dtype(o.dtype):
                active.add(o.id)


def _out_activity(closed, in_act: Sequence[bool]) -> list[bool]:
    """Which outputs of a closed jaxpr depend on its active inputs."""
    b = _Builder()
    in_vars = [b.new_var(v.aval) for v in closed.jaxpr.invars]
    outs = b.convert(closed.jaxpr, closed.consts, in_vars)
    active = {v.id for v, a in zip(in_vars, in_act) if a and is_differentiable_dtype(v.dtype)}
    _propagate(b.raws, active, {})
    return [isinstance(o, Var) and o.id in active for o in outs]


def _structured_activity(raw: _Raw, in_act: list[bool]) -> tuple[list[bool], list[bool]]:
    """(outputs' activity, the body's inputs' activity) of a scan or cond."""
    p = raw.params
    if raw.name == "cond":
        ops = in_act[1:]
        out = [False] * len(raw.outputs)
        for br in p["branches"]:
            out = [a or b for a, b in zip(out, _out_activity(br, ops))]
        return out, list(ops)
    # scan: a carry is active if its initial value is, or if the body makes it so (fixpoint).
    nc, nk = p["num_consts"], p["num_carry"]
    act = list(in_act)
    while True:
        out = _out_activity(p["jaxpr"], act)
        carry = [a or o for a, o in zip(act[nc : nc + nk], out[:nk])]
        if carry == act[nc : nc + nk]:
            return carry + out[nk:], act
        act[nc : nc + nk] = carry


def _body_reach(raw: _Raw, bodies: tuple[Tape, ...]) -> list[bool]:
    """Which inputs of a scan or cond a cotangent can reach through its bodies: a cond's
    operand that no branch differentiates, a scan's const or scanned input its body does
    not, a carry its body does not (after at least one step) gets a symbolic zero."""
    if raw.name == "cond":
        return [True] + [any(b.reached[j] for b in bodies) for j in range(len(raw.inputs) - 1)]
    nc, nk = raw.params["num_consts"], raw.params["num_carry"]
    reach = list(bodies[0].reached)
    if int(raw.params["length"]) == 0:  # no step: the carries' cotangents pass straight through
        reach[nc : nc + nk] = [True] * nk
    return reach


def _structured_record(k, raw: _Raw, act_in, body_act, active, useful) -> Record:
    p = raw.params
    out_diff = [o.id in useful for o in raw.outputs]
    if raw.name == "cond":
        bodies = tuple(tape_from_jaxpr(br, body_act, out_diff) for br in p["branches"])
    else:
        nc, nk = p["num_consts"], p["num_carry"]
        # Every active carry receives a cotangent from the next step.
        body_diff = [o.id in active for o in raw.outputs[:nk]] + out_diff[nk:]
        body_diff[:nk] = [a or d for a, d in zip(body_act[nc : nc + nk], body_diff[:nk])]
        bodies = (tape_from_jaxpr(p["jaxpr"], body_act, body_diff),)
    act_in = tuple(a and r for a, r in zip(act_in, _body_reach(raw, bodies)))
    rec = Record(
        k,
        raw.name,
        tuple(raw.inputs),
        tuple(raw.outputs),
        MappingProxyType(raw.params),
        active=act_in,
        rule="loop" if raw.name == "scan" else "branch",
        region=raw.region,
        names=raw.names,
        prim=raw.prim,
        source_info=raw.source_info,
        bind_params=compat.bind_params(raw.prim, raw.params),
        bodies=bodies,
    )
    return dataclasses.replace(rec, saves=outer_saves(rec))
