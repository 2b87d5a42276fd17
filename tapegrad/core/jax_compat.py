"""Every use of jax internals lives here, so a jax upgrade touches one file.

Public jax names are preferred everywhere else; what remains below has no
public spelling in jax 0.10 (source frames, evaluating a custom_vjp's
forward thunk, recognising checkpoint/name under both remat settings, the
jax.distributed client whose key-value store processes exchange plans through).

jax 0.10 and 0.11 are both supported. What 0.11 changed, and where it is met:
scan's operand counts became a FlatTree (`eqn_params`, `bind_params`); a
custom_vjp's flattened backward returns ``(cotangents, logs)``
(`custom_vjp_backward`); ``ClosedJaxpr`` is ``Jaxpr``, whose constvars without
attached values are plain leading invars (`tapegrad.rules.custom_jvp._split`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax._src import array as _array  # the concrete array type, without making one
from jax._src import core as _core
from jax._src import distributed as _distributed  # no public accessor for the client
from jax._src import source_info_util as _siu  # no public API for user frames
from jax._src.interpreters import batching as _batching
from jax.extend import core as jex_core
from jax.extend.core import primitives as jex_prims

Literal = jex_core.Literal
Var = jex_core.Var
ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
Primitive = jex_core.Primitive
new_jaxpr_eqn = jex_core.new_jaxpr_eqn

# The package's own folder: frames inside it are tapegrad's, not the user's.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Make jax (and us) treat tapegrad's own frames as library frames, so the
# "user frame" of a record is the user's line even for records emitted by
# tapegrad's rules (e.g. when differentiating tg.grad itself).
_siu.register_exclusion(PACKAGE_DIR + os.sep)
_siu.register_inclusion(os.path.join(PACKAGE_DIR, "__main__.py"))  # the demo is user code

# Primitives whose sub-jaxpr is inlined into the tape.
INLINE_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})
REMAT_NAMES = frozenset({"remat2", "checkpoint", "remat"})

name_p = jex_prims.name_p
remat_p = jex_prims.remat_p
custom_jvp_call_p = jex_prims.custom_jvp_call_p
custom_vjp_call_p = jex_prims.custom_vjp_call_p


def frame_of(source_info: Any) -> tuple[str, int, str] | None:
    """The innermost user frame of an equation's source_info, as (file, line, function)."""
    if source_info is None:
        return None
    frame = _siu.user_frame(source_info.traceback)
    if frame is None:
        return None
    return frame.file_name, frame.start_line, frame.function_name


def current_source_info() -> Any:
    return _siu.current()


def sub_jaxpr(params: dict) -> ClosedJaxpr | None:
    """The callee of an inlinable call equation, as a ClosedJaxpr."""
    jaxpr = params.get("jaxpr", params.get("call_jaxpr"))
    if jaxpr is None:
        return None
    if isinstance(jaxpr, ClosedJaxpr):
        return jaxpr
    return ClosedJaxpr(jaxpr, ())


def hi_primitive_kind(params: dict) -> str | None:
    """Under ``jax_remat3``, checkpoint and checkpoint_name are ``call_hi_primitive``
    equations whose ``_prim`` is a RematTraced / CheckpointName instance."""
    prim = params.get("_prim")
    if prim is None:
        return None
    return type(prim).__name__


def eqn_params(name: str, params: Any) -> Any:
    """An equation's params as the tape keeps them. jax 0.11's scan groups its operands
    in a FlatTree (``ft_in``: consts, carries, xs) where jax 0.10 counted them; its
    records get jax 0.10's ``num_consts`` and ``num_carry`` as well, so every reader
    of a scan record works under both. `bind_params` drops them again."""
    if name != "scan" or "ft_in" not in params:
        return params
    consts, carry, _ = params["ft_in"].unpack()
    return {**params, "num_consts": len(consts), "num_carry": len(carry)}


def bind_params(prim: Any, params: Any) -> Any:
    """The params to bind ``prim`` with: jax's own, without what `eqn_params` added."""
    if "ft_in" in params:
        params = {k: v for k, v in params.items() if k not in ("num_consts", "num_carry")}
    return prim.get_bind_params(params)


def remat_parts(name: str, params: dict):
    """``(body ClosedJaxpr, jax policy, prevent_cse)`` of a checkpoint equation, else None.

    Handles both spellings: ``remat2`` (default) and, under ``jax_remat3``,
    ``call_hi_primitive`` with a ``RematTraced`` instance.
    """
    if name == "remat2":
        return sub_jaxpr(params), params.get("policy"), bool(params.get("prevent_cse", True))
    if name == "call_hi_primitive" and hi_primitive_kind(params) == "RematTraced":
        prim = params["_prim"]
        return prim.jaxpr, prim.policy, True
    return None


def checkpoint_name_of(name: str, params: dict) -> str | None:
    """The name of a ``checkpoint_name`` equation (both spellings), else None."""
    if name == "name":
        return params.get("name")
    if name == "call_hi_primitive" and hi_primitive_kind(params) == "CheckpointName":
        return params["_prim"].params["name"]
    return None


def policy_says_save(policy, prim, in_avals, params) -> bool:
    """Apply a ``jax.checkpoint_policies`` policy to one equation.

    jax policies return a bool or a ``Saveable`` / ``Recompute`` / ``Offloadable``
    marker; anything but ``Recompute``/False means "may be saved".
    """
    if policy is None:
        return False
    out = policy(prim, *in_avals, **params)
    if isinstance(out, bool):
        return out
    return type(out).__name__ != "RecomputeType" and out is not _pe_recompute()


def _pe_recompute():
    from jax._src.interpreters import partial_eval as pe  # the Recompute marker

    return pe.Recompute


def custom_vjp_forward(params: dict, args: list, active: list[bool]):
    """Run a ``custom_vjp_call``'s user forward; returns (outputs, residuals).

    Mirrors jax's own JVP of custom_vjp_call (jax/_src/interpreters/ad.py):
    the forward thunk is specialised on which inputs carry tangents.
    """
    num_consts = params["num_consts"]
    consts, primals = args[:num_consts], args[num_consts:]
    fwd_jaxpr, fwd_consts = params["fwd_jaxpr_thunk"].call_wrapped(*active[num_consts:])
    res_and_out = _core.eval_jaxpr(fwd_jaxpr, fwd_consts, *primals)
    _, res_tree, input_fwds = params["out_trees"]()
    # The fwd jaxpr is memoized per perturbation pattern while out_trees keeps the
    # last traced one, so count residuals from the jaxpr itself.
    num_res_out = len(res_and_out) - len(params["call_jaxpr"].out_avals)
    res_out, outs = res_and_out[:num_res_out], res_and_out[num_res_out:]
    it = iter(res_out)
    # input_fwds index all the call's operands, its leading constants included, as in
    # jax's JVP of the call (``primals_in[f]`` in ad.py's process_custom_vjp_call).
    res = [next(it) if f is None else args[f] for f in input_fwds]
    del consts
    return list(outs), res


def custom_vjp_backward(params: dict, res: list, cts: list) -> list:
    """Call a ``custom_vjp_call``'s user backward; symbolic zeros become None."""
    out = params["bwd"].call_wrapped(*res, *cts)
    if _BWD_WITH_LOGS:  # jax >= 0.11: the flat backward returns (cotangents, logs)
        out, _ = out
    # A Python or numpy scalar is a cotangent (``g * n`` with an int ``n``), as in jax.
    return [
        (jax.numpy.asarray(c) if isinstance(c, SCALARS) else c) if _is_array_like(c) else None
        for c in out
    ]


def custom_vjp_bwd_function(params: dict) -> Any:
    """The Python function a ``custom_vjp_call``'s backward wraps (jax's ``WrappedFun.f``)."""
    return getattr(params.get("bwd"), "f", None)


def bwd_checks_disabled() -> bool:
    """Whether ``jax.config.disable_bwd_checks`` is on: jax then passes a custom bwd rule's
    cotangents on whatever their shape (no public reader of that config state)."""
    from jax._src import config as _config

    return bool(_config.disable_bwd_checks.value)


# jax 0.11 added ``defvjp_with_logs``; from then on a custom_vjp's flattened backward
# returns ``(cotangents, logs)`` rather than the cotangents alone.
_BWD_WITH_LOGS = hasattr(jax.custom_vjp, "defvjp_with_logs")


def custom_vjp_residual_aliases(params: dict, active: list[bool]) -> list[tuple[str, int] | None]:
    """Per residual of a ``custom_vjp_call``'s fwd, the value it is the very array of when
    run: ``("in", i)``, the call's operand ``i`` (jax's ``input_fwds``, or a fwd jaxpr
    output that is one of its inputs); ``("out", j)``, the call's output ``j`` (jaxopt's
    implicit-diff solvers keep the solution so); ``("aux", k)``, an earlier residual
    ``k`` (a fwd returning one array twice); ``("lit", k)``, a constant of the fwd
    jaxpr (no array); or None."""
    num_consts = params["num_consts"]
    fwd_jaxpr, _ = params["fwd_jaxpr_thunk"].call_wrapped(*active[num_consts:])
    _, _, input_fwds = params["out_trees"]()
    num_res_out = len(fwd_jaxpr.outvars) - len(params["call_jaxpr"].out_avals)
    res_vars, out_vars = fwd_jaxpr.outvars[:num_res_out], fwd_jaxpr.outvars[num_res_out:]
    from_in = iter(forwarded_outputs(fwd_jaxpr)[:num_res_out])
    rest = iter(res_vars)
    first: dict[Any, int] = {}
    out: list[tuple[str, int] | None] = []
    for k, f in enumerate(input_fwds):
        if f is not None:
            out.append(("in", f))
            continue
        v, i = next(rest), next(from_in)
        if i is not None:
            out.append(("in", num_consts + i))
        elif not isinstance(v, jex_core.Var):
            out.append(("lit", k))  # a constant: the program holds it, no array does
        elif v in first:
            out.append(("aux", first[v]))
        elif any(v is o for o in out_vars):
            out.append(("out", next(j for j, o in enumerate(out_vars) if v is o)))
        else:
            first[v] = k
            out.append(None)
    return out


def custom_vjp_residual_avals(params: dict, active: list[bool]) -> tuple[list, Any]:
    num_consts = params["num_consts"]
    fwd_jaxpr, _ = params["fwd_jaxpr_thunk"].call_wrapped(*active[num_consts:])
    _, res_tree, input_fwds = params["out_trees"]()
    num_res_out = len(fwd_jaxpr.outvars) - len(params["call_jaxpr"].out_avals)
    outs = [v.aval for v in fwd_jaxpr.outvars][:num_res_out]
    return outs, input_fwds


def custom_jvp_jaxpr(params: dict, in_zeros: list[bool]) -> tuple[Jaxpr, list, list[bool]]:
    """The JVP rule of a ``custom_jvp_call``, traced: ``(jaxpr, consts, out_zeros)``.

    The jaxpr takes the call's primal operands (not its ``num_consts`` leading
    constants) and then one tangent per primal whose ``in_zeros`` entry is False;
    it returns the primal outputs and one tangent per output whose ``out_zeros``
    entry is False. jax's own JVP of the call uses the same thunk
    (``lift_jvp`` in jax/_src/custom_derivatives.py).
    """
    jaxpr, consts, out_zeros = params["jvp_jaxpr_fun"].call_wrapped(*in_zeros)
    return jaxpr, list(consts), list(out_zeros)


def bind_custom_jvp_call(args, params: dict) -> list:
    """Apply a ``custom_jvp_call`` equation's primitive to ``args``."""
    prim = custom_jvp_call_p
    return list(prim.bind(*args, **prim.get_bind_params(params)))


def dce_jaxpr(jaxpr: Jaxpr, used_outputs: list[bool]) -> tuple[Jaxpr, list[bool]]:
    """jax's dead-code elimination: ``(jaxpr keeping used_outputs, used inputs)``.

    It looks inside calls (a ``pjit`` whose outputs are partly used is pruned),
    which an equation-level pass cannot.
    """
    from jax._src.interpreters import partial_eval as pe  # no public DCE

    new, used = pe.dce_jaxpr(jaxpr, list(used_outputs), instantiate=False)
    return new, list(used)


# Equations whose output is, when run, the very array an operand is: eagerly, binding
# stop_gradient returns its operand, and a custom_jvp call runs its call_jaxpr, whose
# forwarded outputs are its inputs (`jnp.asarray`'s identity rule); under jit XLA keeps
# one buffer for both.
def forwarded_outputs(jaxpr: Jaxpr) -> list[int | None]:
    """Per output of ``jaxpr``: the index of the input it is the very array of when
    run, or None."""
    of: dict[Any, int] = {v: i for i, v in enumerate(jaxpr.invars)}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "stop_gradient":
            fwd: list[int | None] = [0]
        elif eqn.primitive.name == "custom_jvp_call":
            fwd = forwarded_outputs(eqn.params["call_jaxpr"].jaxpr)
        else:
            continue
        for out, i in zip(eqn.outvars, fwd):
            src = eqn.invars[i] if i is not None else None
            if isinstance(src, jex_core.Var) and src in of:
                of[out] = of[src]
    return [of.get(v) if isinstance(v, jex_core.Var) else None for v in jaxpr.outvars]


def new_jaxpr(constvars, invars, outvars, eqns, name: str) -> Jaxpr:
    """A jaxpr assembled from existing equations (which keep their variables)."""
    debug = jex_core.DebugInfo("tapegrad", name, None, None)
    return Jaxpr(constvars, invars, outvars, eqns, debug_info=debug)


SCALARS = (int, float, complex, np.generic)  # Python and numpy scalars (bool is an int)


def batches_concrete(x: Any) -> bool:
    """Whether ``x`` is concrete data, or a tracer that only batches it (an eager
    `jax.vmap`): nothing differentiates it and nothing stages it. No public API tells a
    `BatchTracer` over arrays from one over a trace."""
    while isinstance(x, _batching.BatchTracer):
        x = x.val
    return not isinstance(x, jax.core.Tracer)


def _is_array_like(x: Any) -> bool:
    return (
        isinstance(x, (jax.Array, _core.Tracer, *SCALARS))
        or hasattr(x, "__jax_array__")
        or (hasattr(x, "shape") and hasattr(x, "dtype") and not type(x).__name__.endswith("Zero"))
    )


def eval_closed_jaxpr(closed: ClosedJaxpr, *args):
    return jex_core.jaxpr_as_fun(closed)(*args)


def explicit_sharding(var: Any) -> Any:
    """The traced sharding of a tape value whose mesh has Explicit axes, else None.

    Under Explicit axes the sharding is part of the type, and ops whose result
    sharding is ambiguous (a dot_general contracting a sharded dimension) need
    ``out_sharding``; everywhere else None keeps jax's default propagation.
    """
    s = getattr(var, "sharding", None)
    mesh = getattr(s, "mesh", None)
    if mesh is None or mesh.empty:
        return None
    if not any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return None
    return s


# ----------------------------------------------------------- recording a concrete run
# `tapegrad.engine.concrete_trace` builds a jaxpr from a concrete run, for functions with
# Python control flow on values: a jax Trace whose tracers carry concrete values, as jax's
# JVPTrace does.
Trace = _core.Trace
Tracer = _core.Tracer
set_current_trace = _core.set_current_trace
take_current_trace = _core.take_current_trace
typeof = _core.typeof
to_concrete_value = _core.to_concrete_value

# What jax raises when tracing needs a concrete value (`if x > 0`, `int(n)`, `range(n)`).
NEEDS_CONCRETE = (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError)


def _pe():
    from jax._src.interpreters import partial_eval as pe  # no public tracing of a WrappedFun

    return pe


def convert_constvars_jaxpr(jaxpr: Jaxpr) -> Jaxpr:
    return _pe().convert_constvars_jaxpr(jaxpr)


def custom_jvp_thunk(jvp: Any, in_avals: list, record: Any, lower: Any = None) -> Any:
    """A ``custom_jvp_call``'s ``jvp_jaxpr_fun``, as `DynamicJaxprTrace` builds it.

    The rule is traced abstractly, like jax; where it needs concrete values (Python
    control flow on the primals), ``record(fun, tangent_avals)`` records it from a run.
    ``lower`` maps each constant the rule closes over (a recorded value: its value).
    """
    import jax.extend.linear_util as lu
    from jax._src.util import partition_list

    pe = _pe()
    tangent_avals = [a.to_tangent_aval() for a in in_avals]

    @pe._memoize
    def thunk(*in_zeros):
        for store in jvp.stores:
            store and store.reset()
        nz, zero_avals = partition_list(in_zeros, tangent_avals)
        jvp_, out_zeros = pe._jvp_jaxpr_zeros(jvp, in_zeros, tuple(zero_avals))
        try:
            fun = jvp_.with_unknown_names()
            jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(fun, (*in_avals, *nz))
        except NEEDS_CONCRETE:
            for store in jvp.stores:
                store and store.reset()
            jvp_, out_zeros = pe._jvp_jaxpr_zeros(jvp, in_zeros, tuple(zero_avals))
            jaxpr, consts = record(jvp_.call_wrapped, nz)
        if lower is not None:  # the recording's tracers a rule closes over: their values
            consts = [lower(c) for c in consts]
        return jaxpr, consts, out_zeros()

    return lu.wrap_init(thunk, debug_info=jvp.debug_info)


def custom_vjp_thunk(fwd: Any, in_avals: list, record: Any) -> Any:
    """A ``custom_vjp_call``'s ``fwd_jaxpr_thunk``, as `DynamicJaxprTrace` builds it
    (abstract tracing first, ``record(fun, ())`` from a run where that needs values)."""
    import jax.extend.linear_util as lu

    pe = _pe()

    @pe._memoize
    def thunk(*zeros):
        for store in fwd.stores:
            store and store.reset()
        fwd_ = pe._interleave_fun(fwd.with_unknown_names(), zeros)
        try:
            jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(fwd_, in_avals)
        except NEEDS_CONCRETE:
            for store in fwd.stores:
                store and store.reset()
            fwd_ = pe._interleave_fun(fwd.with_unknown_names(), zeros)
            jaxpr, consts = record(fwd_.call_wrapped, ())
        return jaxpr, consts

    return lu.wrap_init(thunk, debug_info=fwd.debug_info)


def custom_jvp_rule_parts(params: dict) -> tuple[Any, list] | None:
    """``(rule function, [(transformation, static args), ...])`` behind a traced
    ``custom_jvp_call``'s ``jvp_jaxpr_fun``: what decides its rule, for a structural key;
    None where jax's closure layout is not the one read here (then nothing is cached)."""
    try:
        memo = params["jvp_jaxpr_fun"].f
        thunk = next(
            c.cell_contents
            for c in memo.__closure__
            if getattr(c.cell_contents, "__name__", "") == "jvp_jaxpr_thunk"
        )
        cells = dict(zip(thunk.__code__.co_freevars, (c.cell_contents for c in thunk.__closure__)))
        jvp = cells["jvp"]
        return jvp.f, [(gen, args) for gen, args in jvp.transforms]
    except (AttributeError, KeyError, StopIteration, TypeError, ValueError):
        return None


def unhashable_value(x: Any) -> tuple[bool, Any]:
    """``(True, value)`` for jax's ``Unhashable`` wrapper of a static argument."""
    if type(x).__name__ == "Unhashable" and hasattr(x, "val"):
        return True, x.val
    return False, x


def trace_is_alive(tracer: Any) -> bool:
    """Whether a tracer belongs to the trace running now (an enclosing jit), not to one
    that has finished (jax leaves a finished make_jaxpr trace valid)."""
    trace = getattr(tracer, "_trace", None)
    with take_current_trace() as current:
        return trace is current and (trace is None or trace.is_valid())


# ----------------------------------------------------------- forward activity
# A value staged by jax.make_jaxpr knows the equation that produced it (its ``parent``,
# whose ``in_tracers`` are its operands): enough to tell, while tracing, whether it
# depends on a given input. No public spelling; where the layout differs, None (unknown).


def staging_trace(x: Any) -> Any:
    """The make_jaxpr trace staging ``x`` (a ``DynamicJaxprTracer``), else None."""
    if type(x).__name__ != "DynamicJaxprTracer":
        return None
    return getattr(x, "_trace", None)


def trace_of(x: Any) -> Any:
    """The trace a tracer belongs to."""
    return getattr(x, "_trace", None)


def parent_trace(trace: Any) -> Any:
    """The trace that was current when ``trace`` was made (None at the bottom)."""
    return getattr(trace, "parent_trace", None)


def staged_var(x: Any) -> Any:
    """The jaxpr variable a staged tracer stands for (its identity while tracing)."""
    return getattr(x, "val", x)


def staged_primitive(x: Any) -> str | None:
    """The name of the primitive whose equation produced the staged tracer ``x``."""
    prim = getattr(getattr(x, "parent", None), "primitive", None)
    return getattr(prim, "name", None)


def staged_operands(x: Any) -> list | None:
    """The operands of the equation that produced the staged tracer ``x``: [] for an input
    or a constant of its trace, None when this jax's tracers do not say."""
    if not hasattr(x, "parent"):
        return None
    parent = x.parent
    if parent is None:
        return []
    ins = getattr(parent, "in_tracers", None)
    return None if ins is None else list(ins)


# ----------------------------------------------------------- placement
# jax's transposes move cotangents between placements: a jit's (`_pjit_transpose`) gives
# its outputs' cotangents the jit's out_shardings and its inputs' cotangents its
# in_shardings; device_put's (`_device_put_transpose`) sends a cotangent back to where
# the value came from. The tape keeps both (`tapegrad.rules.structural`).
device_put_p = jex_prims.device_put_p
sharding_constraint_p = jex_prims.sharding_constraint_p


def call_shardings(params: dict) -> tuple[tuple, tuple]:
    """(in, out) shardings of an inlined call: each a concrete `Sharding`, or None where
    the call leaves it to propagation (UNSPECIFIED, AUTO) or is no jit at all."""

    def concrete(shardings) -> tuple:
        return tuple(s if isinstance(s, jax.sharding.Sharding) else None for s in shardings)

    return concrete(params.get("in_shardings", ())), concrete(params.get("out_shardings", ()))


def constraint_params(sharding: Any, aval: Any, params: dict) -> dict | None:
    """Params of a sharding_constraint of a value of type ``aval`` to ``sharding``, for a
    jit with ``params``; None where no constraint is needed. A value typed on a mesh with
    Explicit axes carries its sharding in its type: jax's with_sharding_constraint leaves
    such a value as it is, and so do we. Outside any mesh context (a value typed on no
    mesh) it is constrained physically, as the jit's own shardings do, on the mesh's
    devices as Auto axes: typing it on the Explicit mesh would clash with the avals
    downstream, which carry no mesh."""
    ctx_mesh = params.get("ctx_mesh", jax.sharding.get_abstract_mesh())
    mesh = getattr(sharding, "mesh", None)
    if isinstance(mesh, jax.sharding.Mesh) and jax.sharding.AxisType.Explicit in mesh.axis_types:
        if not aval.sharding.mesh.empty or not ctx_mesh.empty:
            return None
        auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
        mesh = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=auto)
        sharding = sharding.update(mesh=mesh)
    return {
        "sharding": sharding,
        "layout": None,
        "context_mesh": ctx_mesh,
        "unconstrained_dims": frozenset(),
    }


def device_put_sources(params: Any, ins: Sequence[Any]) -> tuple:
    """device_put's ``srcs``, filled in as jax's `device_put` does from the operands it
    sees (`_infer_src_sharding`): a concrete array's sharding, host memory for a traced
    value that lives there. The tape was traced abstractly, so its ``srcs`` lack them."""
    out = []
    for src, x in zip(params["srcs"], ins):
        # An abstract-mesh source is the traced operand's type (Explicit axes in a mesh
        # context): jax, eager, would have read the concrete array's sharding instead.
        abstract = isinstance(getattr(src, "mesh", None), jax.sharding.AbstractMesh)
        if (
            (src is None or abstract)
            and isinstance(x, jax.Array)
            and not isinstance(x, _core.Tracer)
        ):
            src = x.sharding
        elif src is None and getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host:
            src = jax.memory.Space.Host
        out.append(src)
    return tuple(out)


def device_put_back(cts: Sequence[Any], params: Any) -> list:
    """device_put's transpose: each cotangent goes to its operand's source (``srcs``).
    A donated operand is not donated back (jax raises there); every copy back copies."""
    sems = tuple(type(c).ALWAYS_COPY for c in params["copy_semantics"])
    return list(
        device_put_p.bind(
            *cts, devices=tuple(params["srcs"]), srcs=tuple(params["devices"]), copy_semantics=sems
        )
    )


def distributed_client() -> Any:
    """`jax.distributed`'s client (its coordinator's key-value store), or None when
    `jax.distributed.initialize` has not run. No public accessor in jax 0.10;
    `jax.experimental.multihost_utils` reads the same global."""
    return _distributed.global_state.client


# The type of every concrete jax array. ``type(jnp.zeros(()))`` would name it too, but
# making an array starts jax's backend, and `jax.distributed.initialize` must run before
# that: importing tapegrad must not.
ArrayImpl = _array.ArrayImpl
