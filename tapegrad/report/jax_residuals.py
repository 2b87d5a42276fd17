"""`tg.jax_residuals`: what plain `jax.vjp` keeps for backward, attributed.

The bytes are the arrays `jax.vjp` really holds: it runs eagerly and measures the
leaves of its ``vjp_fn``, each distinct array once, inputs included.

Which equation made each one comes from the same `jax.vjp` traced abstractly
(`jax.make_jaxpr`, as jax's own ``saved_residuals`` does): the traced call returns
``vjp_fn``'s leaves as its jaxpr's outputs, each one of the function's inputs, a
constant, a literal, or made by an equation (its primitive and the user's source line).
Calls tapegrad inlines (``jit``, ``checkpoint``) are looked into, as are the
``reduce_precision`` a ``checkpoint_name`` adds and the ``device_put`` an offloading
policy adds; a stacked ``scan`` output is charged to the body equation making one step
of it. An input or constant is placed at the first equation reading it (where tapegrad
charges an input it saves). The pictures are in `tapegrad.display.jax_residuals`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax import tree_util

from tapegrad.api.traced import argnums_tuple
from tapegrad.core import jax_compat as compat
from tapegrad.core.sizes import array_nbytes, as_dtype
from tapegrad.display.common import clip
from tapegrad.display.jax_residuals import jax_residuals_html, jax_residuals_text
from tapegrad.engine.trace import frame_str
from tapegrad.report.compare import Comparison, compare

__all__ = ["JaxResidual", "JaxResiduals", "jax_residuals"]


@dataclass(frozen=True, slots=True)
class JaxResidual:
    """One array `jax.vjp` keeps for backward.

    ``primitive`` is the primitive whose output it is (``"input"`` for one of the
    function's own arrays, ``"constant"`` / ``"literal"`` for what the function closes
    over), ``source`` the user's line that made it (for an input: the line of the first
    operation reading it, ``read_by``; a constant's too). ``what`` says more (``argument ws[1]``,
    ``named 'act'``, ``carry``), ``where`` the calls it was made in (``scan ×200`` for a
    stacked scan output: ``steps`` body runs of it). ``leaves``: the leaves of ``vjp_fn``
    holding this array (each array is counted once).
    """

    index: int
    primitive: str
    source: str
    shape: tuple[int, ...]
    dtype: Any
    device_bytes: int
    host_bytes: int
    is_input: bool = False
    what: str = ""
    where: str = ""
    steps: int = 1
    leaves: int = 1
    read_by: str = ""

    @property
    def bytes(self) -> int:
        return self.device_bytes + self.host_bytes

    @property
    def compressed_bytes(self) -> int:
        """Always 0: jax keeps residuals in their own dtype."""
        return 0


@dataclass(frozen=True)
class JaxResiduals:
    """What `jax.vjp` keeps for backward, one row per distinct residual array.

    * ``total_bytes``: bytes of the distinct arrays among ``vjp_fn``'s leaves, the
      function's own inputs included; ``device_bytes`` / ``host_bytes`` split it by
      memory kind (a ``jax.checkpoint`` policy may offload);
    * ``inputs_bytes``: those that are the caller's own arrays (kept as they are);
      ``beyond_inputs_bytes``: the rest, what a forward/backward adds to the caller's
      memory (`MemoryReport.beyond_inputs_bytes` is the same measure under tapegrad);
    * ``rows``: one `JaxResidual` per distinct array, in ``vjp_fn``'s leaf order;
    * ``notes``: what could not be attributed, and why.

    Values sharded over several devices count the shard one device holds; on a
    multi-process run's global arrays (``processes`` > 1), one of this process's devices
    (its local shards), each process reporting its own.
    """

    fun: str
    argnums: tuple[int, ...]
    rows: tuple[JaxResidual, ...]
    total_bytes: int
    inputs_bytes: int
    device_bytes: int
    host_bytes: int
    leaves: int
    notes: tuple[str, ...] = ()
    devices: int = 1
    processes: int = 1

    @property
    def beyond_inputs_bytes(self) -> int:
        """Residual bytes that are not the caller's own arrays."""
        return self.total_bytes - self.inputs_bytes

    def compare(self, other: Any) -> Comparison:
        """This report beside ``other`` (a `MemoryReport` or another `JaxResiduals`),
        rows matched by source line and primitive (`MemoryReport.compare`)."""
        return compare(self, other)

    def __str__(self) -> str:
        return jax_residuals_text(self)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return jax_residuals_html(self)


# ------------------------------------------------------------------ attribution


@dataclass(frozen=True, slots=True)
class _Origin:
    """Where one residual comes from: the primitive that made it (``input``,
    ``constant``, ``literal`` for none), the user's line, what more to say of it, the
    calls it was made in and the body runs it stacks; for an input or constant, the
    primitive first reading it (``read_by``, at ``source``)."""

    primitive: str
    source: str
    what: str = ""
    where: str = ""
    steps: int = 1
    read_by: str = ""


_UNKNOWN = _Origin("?", "")
_CARRY, _XS = "carry", "scanned input"


class _Scope:
    """One jaxpr being looked into: its producers, what its invars are outside, the
    calls around it and the source to fall back on (the call's own line)."""

    def __init__(self, jaxpr, parent=None, inputs=None, where="", steps=1, caller=""):
        self.jaxpr = jaxpr
        self.parent = parent
        self.inputs: dict[Any, Any] = inputs or {}
        self.where = where
        self.steps = steps
        self.caller = caller
        self.producers = {v: (eqn, k) for eqn in jaxpr.eqns for k, v in enumerate(eqn.outvars)}

    def source(self, eqn) -> str:
        return (
            self.caller if compat.frame_of(eqn.source_info) is None else frame_str(eqn.source_info)
        )

    def child(self, eqn, inner, where: str, steps: int = 1, inputs=None) -> _Scope:
        ins = inputs if inputs is not None else dict(zip(inner.invars, eqn.invars))
        wh = f"{self.where} › {where}" if self.where else where
        return _Scope(inner, self, ins, wh, self.steps * steps, self.source(eqn))


def _callee(eqn) -> tuple[Any, str] | None:
    """A call equation's body (a Jaxpr) and how to name it, when it is one tapegrad
    inlines (jit, checkpoint, closed_call)."""
    name = eqn.primitive.name
    remat = compat.remat_parts(name, eqn.params)
    if remat is not None:
        return remat[0].jaxpr, "checkpoint"
    if name in compat.INLINE_CALLS:
        sub = compat.sub_jaxpr(eqn.params)
        if sub is not None:
            label = f"jit '{eqn.params['name']}'" if "name" in eqn.params else name
            return sub.jaxpr, label
    return None


def _resolve(scope: _Scope, v: Any, names: Sequence[str], top: _Scope) -> _Origin:
    """Where residual ``v`` of ``scope``'s jaxpr comes from."""
    moved = ""  # a device_put on the way (a checkpoint policy offloading it)

    def made(prim: str, src: str, what: str = "", at: _Scope | None = None, read_by=""):
        at = scope if at is None else at  # the scope whose calls and steps it is made in
        what = ", ".join(x for x in (what, moved) if x)
        return _Origin(prim, src, what, at.where, at.steps, read_by)

    for _ in range(10_000):  # a chain through calls and look-through equations
        if isinstance(v, compat.Literal):
            return made("literal", scope.caller, "literal")
        if v in scope.producers:
            eqn, k = scope.producers[v]
            name = eqn.primitive.name
            if name == "reduce_precision":  # jax's checkpoint_name adds one; look through
                v = eqn.invars[0]
                continue
            if name == "device_put":  # offloaded by a checkpoint policy: who made it
                dsts = eqn.params.get("devices") or ()
                d = dsts[k] if k < len(dsts) else None
                dst = getattr(d, "memory_kind", None) or getattr(d, "name", None)
                moved = f"moved to {dst.lower()}" if isinstance(dst, str) else "moved"
                v = eqn.invars[k]
                continue
            named = compat.checkpoint_name_of(name, eqn.params)
            if named is not None:
                return made("name", scope.source(eqn), f"named '{named}'")
            call = _callee(eqn)
            if call is not None:
                scope = scope.child(eqn, call[0], call[1])
                v = call[0].outvars[k]
                continue
            if name == "scan":
                params = compat.eqn_params(name, eqn.params)
                nc, ncar, n = params["num_consts"], params["num_carry"], params["length"]
                body = params["jaxpr"].jaxpr
                if k < ncar:  # the final carry: the scan's own output
                    return made("scan", scope.source(eqn), "final carry")
                ins = {bv: ov for bv, ov in zip(body.invars[:nc], eqn.invars[:nc])}
                ins.update({bv: _CARRY for bv in body.invars[nc : nc + ncar]})
                ins.update({bv: _XS for bv in body.invars[nc + ncar :]})
                scope = scope.child(eqn, body, f"scan ×{n:,}", n, ins)
                v = body.outvars[k]
                continue
            return made(name, scope.source(eqn))
        if v in scope.inputs:
            outer = scope.inputs[v]
            if outer is _CARRY or outer is _XS:  # a step's carry or slice, stacked
                return made("scan", scope.caller, outer, scope.parent)
            v, scope = outer, scope.parent
            continue
        if scope is top and v in scope.jaxpr.invars:
            i = scope.jaxpr.invars.index(v)
            prim, src = _first_reader(top, v)
            return made("input", src, f"argument {names[i]}", read_by=prim)
        if v in scope.jaxpr.constvars:  # closed over: placed at its first reader, too
            prim, src = _first_reader(scope, v)
            return made("constant", src or scope.caller, "constant", read_by=prim)
        return _UNKNOWN
    return _UNKNOWN


def _first_reader(scope: _Scope, v: Any) -> tuple[str, str]:
    """(primitive, source) of the first equation reading ``v`` (inside the calls tapegrad
    inlines), where tapegrad would charge the input it saves."""
    for eqn in scope.jaxpr.eqns:
        if not any(x is v for x in eqn.invars if not isinstance(x, compat.Literal)):
            continue
        call = _callee(eqn)
        if call is not None:
            i = next(i for i, x in enumerate(eqn.invars) if x is v)
            inner = scope.child(eqn, call[0], call[1])
            got = _first_reader(inner, call[0].invars[i])
            if got[0]:
                return got
        return eqn.primitive.name, scope.source(eqn)
    return "", ""


def _arg_names(fun: Callable, args: tuple) -> list[str]:
    """A name per leaf of ``args``: the parameter's name and the leaf's path in it."""
    try:
        params = [
            p.name
            for p in inspect.signature(fun).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    names = []
    for i, a in enumerate(args):
        base = params[i] if i < len(params) else f"args[{i}]"
        for path, _ in tree_util.tree_flatten_with_path(a)[0]:
            names.append(base + tree_util.keystr(path))
    return names


def _vjp_leaves(fun, args, nums, has_aux) -> tuple[Any, Any, list]:
    """``jax.vjp`` of ``fun`` in ``args[nums]``: (output, vjp_fn, vjp_fn's leaves)."""
    diff = [args[i] for i in nums]

    def partial(*d):
        full = list(args)
        for i, x in zip(nums, d):
            full[i] = x
        return fun(*full)

    got = jax.vjp(partial, *diff, has_aux=has_aux)
    return got[0], got[1], tree_util.tree_leaves(got[1])


def _cotangent(out: Any) -> Any:
    def ct(o):
        dt = jax.numpy.result_type(o)
        if not jax.numpy.issubdtype(dt, jax.numpy.inexact):
            dt = jax.dtypes.float0
        return jax.ShapeDtypeStruct(np.shape(o), dt)

    return tree_util.tree_map(ct, out)


def _trace_vjp(fun, args, nums, has_aux, names) -> tuple[Any, list[str]]:
    """The jaxpr of the same `jax.vjp`, whose outputs are ``vjp_fn``'s leaves, and the
    name of each of its inputs (the arrays among ``args``' leaves; the rest stay as
    they are)."""
    leaves, tree = tree_util.tree_flatten(args)
    dyn = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))]

    def traced(*vals):
        full = list(leaves)
        for i, x in zip(dyn, vals):
            full[i] = x
        return _vjp_leaves(fun, tree_util.tree_unflatten(tree, full), nums, has_aux)[2]

    closed = jax.make_jaxpr(traced)(*[leaves[i] for i in dyn])
    return closed.jaxpr, [names[i] for i in dyn]


def _type_of(x: Any) -> tuple:
    return tuple(x.shape), as_dtype(x.dtype)


def _origins(jaxpr: Any, names: list[str], leaves: list) -> tuple[list[_Origin], str]:
    """An origin per leaf: jaxpr outputs matched to the eager leaves in order, by
    shape and dtype; a note when some could not be matched."""
    top = _Scope(jaxpr)
    out: list[_Origin] = []
    outvars = list(jaxpr.outvars)
    j = 0
    missed = 0
    for leaf in leaves:
        want = _type_of(leaf)
        k = j
        while k < len(outvars) and _type_of(outvars[k].aval) != want:
            k += 1
        if k == len(outvars):
            out.append(_UNKNOWN)
            missed += 1
            continue
        out.append(_resolve(top, outvars[k], names, top))
        j = k + 1
    # A literal has no equation: jax made it beside the residuals around it (vjp_fn's
    # leaves come in the order the forward made them), so it takes their line.
    for i, o in enumerate(out):
        if o.primitive == "literal" and not o.source:
            near = [x for x in out[:i][::-1] + out[i + 1 :] if x.source and x.primitive != "input"]
            if near:
                out[i] = dataclasses.replace(o, source=near[0].source, where=near[0].where)
    note = (
        f"{missed} of vjp_fn's leaves matched no output of jax.vjp traced abstractly: "
        "listed without their source"
        if missed
        else ""
    )
    return out, note


# ------------------------------------------------------------------ measuring


def _array_key(x: Any) -> Any:
    """What makes two leaves the same array: their buffers (one per shard)."""
    try:
        shards = getattr(x, "addressable_shards", None)
        if shards is not None and len(shards) > 1:
            return ("buffers", tuple(s.data.unsafe_buffer_pointer() for s in shards))
        return ("buffer", x.unsafe_buffer_pointer())
    except Exception:  # noqa: BLE001  (numpy arrays, deleted buffers: by identity)
        return ("id", id(x))


def _is_array(x: Any) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "shape") and hasattr(x, "nbytes")


def jax_residuals(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False):
    """What plain `jax.vjp` keeps for backward, one row per residual array.

    ```python
    jr = tg.jax_residuals(loss)(params, x)
    jr.total_bytes          # the distinct arrays among jax.vjp's vjp_fn leaves
    jr.beyond_inputs_bytes  # less the function's own inputs
    print(jr)               # source line, primitive, shape, dtype and bytes per residual
    tg.memory_report(loss)(params, x).compare(jr)  # beside tapegrad's, line by line
    ```
    Runs `jax.vjp` eagerly (the bytes are the arrays it holds, each counted once), then
    traces the same call abstractly to say which equation made each residual. Works
    under `jax.checkpoint` (its policies and names decide what jax keeps) and
    `jax.jit`. On a multi-process run's global arrays every process must call it (it
    runs jax.vjp on them). A function jax cannot differentiate raises jax's own error:
    `jax.vjp`'s, or, when only backward fails (a ``while_loop``), the one tracing
    backward raises.
    """

    @functools.wraps(fun)
    def residuals_f(*args):
        nums = argnums_tuple(argnums, len(args), "jax_residuals")
        out, vjp_fn, leaves = _vjp_leaves(fun, args, nums, has_aux)
        jax.eval_shape(vjp_fn, _cotangent(out))  # what jax cannot run backward raises here
        names = _arg_names(fun, args)
        notes = []
        arrays = [x for x in leaves if _is_array(x)]
        try:
            jaxpr, dyn_names = _trace_vjp(fun, args, nums, has_aux, names)
            found, note = _origins(jaxpr, dyn_names, arrays)
            if note:
                notes.append(note)
        except Exception as err:  # noqa: BLE001  (value-dependent Python control flow)
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            found = [_UNKNOWN] * len(arrays)
            notes.append(
                "jax could not trace the function abstractly "
                f"({type(err).__name__}: {clip(first, 80)}): residuals listed without "
                "their source"
            )
        return _report(fun, nums, args, leaves, arrays, found, tuple(notes))

    return residuals_f


def _report(fun, nums, args, leaves, arrays, found, notes) -> JaxResiduals:
    inputs = {_array_key(x) for x in tree_util.tree_leaves(args) if _is_array(x)}
    rows: dict[Any, JaxResidual] = {}
    devices = processes = 1
    for i, (x, o) in enumerate(zip(arrays, found)):
        key = _array_key(x)
        if key in rows:
            r = rows[key]
            rows[key] = dataclasses.replace(r, leaves=r.leaves + 1)
            continue
        kind = getattr(getattr(x, "sharding", None), "memory_kind", None) or "device"
        nbytes = array_nbytes(x)
        devs = getattr(getattr(x, "sharding", None), "device_set", ())
        devices = max(devices, len(devs))
        processes = max(processes, len({getattr(d, "process_index", 0) for d in devs}))
        is_input = key in inputs
        prim, what = o.primitive, o.what
        if is_input and prim != "input":  # one of the caller's arrays, passed through
            prim, what = "input", "argument" + (f" ({what})" if what else "")
        elif prim == "input" and not is_input:  # jax's own copy (of a numpy input)
            prim, what = "input copy", f"copy of {what}"
        rows[key] = JaxResidual(
            i,
            prim,
            o.source,
            tuple(x.shape),
            as_dtype(x.dtype),
            0 if "host" in kind else nbytes,
            nbytes if "host" in kind else 0,
            is_input,
            what,
            o.where,
            o.steps,
            1,
            o.read_by,
        )
    out = tuple(rows.values())
    name = getattr(fun, "__name__", None) or type(fun).__name__
    return JaxResiduals(
        name,
        nums,
        out,
        sum(r.bytes for r in out),
        sum(r.bytes for r in out if r.is_input),
        sum(r.device_bytes for r in out),
        sum(r.host_bytes for r in out),
        len(leaves),
        notes,
        devices,
        processes,
    )
