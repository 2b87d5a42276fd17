"""The public transforms: grad, value_and_grad, vjp, trace.

Each traces the function into a `Tape`, runs the forward interpreter, and
(for grad) runs the backward interpreter at once, releasing residuals as it
goes. Signatures follow jax's.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util

from tapegrad import passes as _passes
from tapegrad.anomaly import detect as _anomaly
from tapegrad.api.grad_hook import retained_keys
from tapegrad.core.residual_policy import is_plain, resolve_policy
from tapegrad.core.tape import Tape
from tapegrad.engine.checkpoint import plan_recompute
from tapegrad.engine.fused import run_grad
from tapegrad.engine.interpret import Residuals, backward, forward
from tapegrad.engine.loops import kinds  # noqa: F401  (registers the scan and cond record kinds)
from tapegrad.engine.trace import trace_flat

__all__ = ["grad", "value_and_grad", "vjp", "trace"]


def _is_array_leaf(x: Any) -> bool:
    return (
        isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex, bool))
        or hasattr(x, "__jax_array__")
        or isinstance(x, jax.core.Tracer)
    )


def _check_leaves(leaves, fun_name: str) -> None:
    for x in leaves:
        if not _is_array_leaf(x):
            raise TypeError(
                f"Argument {x!r} of type {type(x)} passed to {fun_name} is not a valid JAX type. "
                "Pass arrays (or pytrees of arrays); mark other arguments static with "
                "functools.partial or a closure."
            )


def _argnums_tuple(argnums: int | Sequence[int], n_args: int, fun_name: str) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums:
        raise ValueError(f"{fun_name}: argnums must not be empty.")
    for a in nums:
        if not isinstance(a, (int, np.integer)):
            raise TypeError(f"{fun_name}: argnums must be ints, got {a!r}.")
        if a >= n_args:  # TypeError, like jax: the caller passed too few arguments
            raise TypeError(
                f"{fun_name}: differentiating with respect to argnums={argnums} requires at "
                f"least {a + 1} positional arguments to be passed by the caller, but got only "
                f"{n_args}. Pass the differentiated arguments positionally (not by keyword), "
                f"or use argnums within range(0, {n_args})."
            )
        if a < -n_args:
            raise ValueError(
                f"{fun_name}: argnums={argnums} is out of range for a function called with "
                f"{n_args} positional argument(s). Pass argnums within range({-n_args}, "
                f"{n_args})."
            )
    out = tuple(int(a) % n_args for a in nums)
    if len(set(out)) != len(out):
        raise ValueError(
            f"{fun_name}: argnums={argnums} names an argument twice. Pass each argument index once."
        )
    return out


def _dtype_of(x):
    if type(x) is _ARRAY_IMPL and not x.weak_type:  # jnp.result_type costs ~13 us a leaf
        return x.dtype
    return jnp.result_type(x)


_ARRAY_IMPL = type(jnp.zeros(()))


def _check_input_dtype(x, allow_int: bool, holomorphic: bool, fun_name: str) -> None:
    dt = _dtype_of(x)
    if holomorphic:
        if not jnp.issubdtype(dt, jnp.complexfloating):
            raise TypeError(
                f"{fun_name} with holomorphic=True requires inputs with complex dtype, "
                f"but got {dt.name}."
            )
    if jnp.issubdtype(dt, jnp.inexact):
        return
    if not allow_int and (jnp.issubdtype(dt, jnp.integer) or jnp.issubdtype(dt, jnp.bool_)):
        raise TypeError(
            f"{fun_name} requires real- or complex-valued inputs (input dtype that is a sub-dtype "
            f"of np.inexact), but got {dt.name}. If you want to use Boolean- or integer-valued "
            "inputs, use vjp or set allow_int to True."
        )
    if not jnp.issubdtype(dt, jnp.integer) and not jnp.issubdtype(dt, jnp.bool_):
        raise TypeError(f"{fun_name} requires numerical-valued inputs, but got {dt.name}.")


def _zero_cotangent(x):
    return _zero_cotangent_spec(x)()


class _Traced:
    """A traced function: its tape and how to map flat values back to pytrees."""

    def __init__(
        self,
        fun: Callable,
        args: tuple,
        active_leaf: Callable[[int], bool],
        has_aux: bool,
        fun_name: str,
        policy: Any = None,
        passes: Any = None,
        anomaly: Any = None,
    ):
        flat, in_tree = tree_util.tree_flatten(args)
        _check_leaves(flat, fun_name)
        self.in_tree = in_tree
        self.flat = flat
        trees: dict[str, Any] = {}

        def flat_fun(*leaves):
            out = fun(*tree_util.tree_unflatten(in_tree, leaves))
            if has_aux:
                if not (isinstance(out, (tuple, list)) and len(out) == 2):
                    raise TypeError(
                        f"{fun_name} with has_aux=True requires the function to return a pair "
                        f"(output, aux), but it returned {type(out).__name__}"
                        f"{_length_note(out)}."
                    )
                out, aux = out
            else:
                aux = None
            out_flat, trees["out"] = tree_util.tree_flatten(out)
            aux_flat, trees["aux"] = tree_util.tree_flatten(aux)
            trees["n_out"] = len(out_flat)
            # Like jax.vjp / jax.grad(has_aux=True), a leaf that is not traced (a Python
            # int, a closed-over array) comes back as the very object the function returned,
            # not as the typed literal or constant that make_jaxpr turns it into.
            trees["untraced"] = {
                k: x
                for k, x in enumerate(out_flat + aux_flat)
                if not isinstance(x, jax.core.Tracer)
            }
            return out_flat + aux_flat

        # jax names the traced function in its errors (a leaked tracer, a value needed
        # concretely): name the user's function, keep the flat signature for arg names.
        flat_fun.__signature__ = inspect.signature(flat_fun)  # type: ignore[attr-defined]
        flat_fun.__wrapped__ = _user_function(fun)  # type: ignore[attr-defined]
        active = [active_leaf(i) for i in range(len(flat))]
        with _anomaly.leak_check(anomaly, _user_function(fun)):
            tape = trace_flat(
                flat_fun,
                flat,
                active,
                diff_outputs=lambda n: [True] * trees["n_out"] + [False] * (n - trees["n_out"]),
                in_tree=in_tree,
                out_tree_fn=lambda: trees["out"],
                owner=_user_function(fun),
            )
        self.unplanned: Tape = _passes.run(_passes.check_rules(tape), passes)
        self.policy = policy
        self.out_tree = trees["out"]
        self.aux_tree = trees["aux"]
        self.n_out = trees["n_out"]
        self.untraced = trees["untraced"]

    @functools.cached_property
    def tape(self) -> Tape:
        """The tape planned for the policy: what is recomputed, and from which values."""
        return _passes.check_effects(plan_recompute(self.unplanned, self.policy))

    def restore(self, flat_out: list) -> list:
        """The flat outputs, with untraced leaves replaced by the objects returned."""
        if not self.untraced:
            return flat_out
        return [self.untraced.get(k, v) for k, v in enumerate(flat_out)]


def _length_note(out: Any) -> str:
    return f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""


def _user_function(fun: Callable) -> Callable:
    """The function the user wrote, under partials and wrappers (for jax's error messages)."""
    for _ in range(16):
        if isinstance(fun, functools.partial):
            fun = fun.func
        elif getattr(fun, "__wrapped__", None) is not None:
            fun = fun.__wrapped__  # type: ignore[attr-defined]
        else:
            break
    return fun


def _leaf_owners(args: tuple) -> list[int]:
    owners = []
    for i, a in enumerate(args):
        owners += [i] * len(tree_util.tree_leaves(a))
    return owners


def vjp(
    fun: Callable,
    *primals: Any,
    has_aux: bool = False,
    policy: Any = None,
    anomaly: Any = None,
    passes: Any = None,
    retain_residuals: bool = True,
):
    """Like `jax.vjp`: returns ``(out, vjp_fn)`` or ``(out, vjp_fn, aux)``.

    ``vjp_fn(ct)`` returns a tuple with one cotangent per primal. Residuals go
    through ``policy`` (default: the enclosing `tg.residual_policy`, else
    `tg.policies.save()`). With ``retain_residuals=False`` they are released
    during the first backward, and a second call raises. ``anomaly=True`` checks
    forward and backward for NaN (see `tg.detect_anomaly`); ``passes`` are tape
    passes (`tg.passes`) run on the traced tape.
    """
    pol = resolve_policy(policy)
    _anomaly.check_argument(anomaly)
    mode = _anomaly.resolve(anomaly)
    t = _Traced(fun, primals, lambda i: True, has_aux, "vjp", pol, passes, mode)
    obs = _anomaly.observer(mode, t.tape, t.in_tree)  # None when anomaly mode is off
    flat_out, res = forward(t.tape, t.flat, pol, observer=obs)
    if obs is not None:
        flat_out = obs.forward_done(t.flat, flat_out)
    returned = t.restore(flat_out)
    out = tree_util.tree_unflatten(t.out_tree, returned[: t.n_out])
    pullback = _Pullback(t, flat_out, obs, retain_residuals)
    # Like jax.vjp's, vjp_fn is a jax.tree_util.Partial whose leaves are the residuals:
    # it can be passed into a jitted function, returned from a custom_vjp fwd, nested.
    vjp_fn = tree_util.Partial(pullback, _SavedValues(res))

    if has_aux:
        aux = tree_util.tree_unflatten(t.aux_tree, returned[t.n_out :])
        return out, vjp_fn, aux
    return out, vjp_fn


class _SavedValues:
    """One forward's `Residuals` as a pytree whose leaves are the packed values.

    Called eagerly, `vjp_fn` hands backward this very object, which releases its values
    as it goes (``retain_residuals=False``); passed through a transform, the values are
    leaves and a copy is rebuilt around them."""

    __slots__ = ("res",)

    def __init__(self, res: Residuals):
        self.res = res


def _flatten_saved(s: _SavedValues):
    keys = tuple(s.res.store)
    return [s.res.store[k] for k in keys], (keys, _Frame(s.res))


def _unflatten_saved(aux, values) -> _SavedValues:
    keys, frame = aux
    old = frame.res
    res = Residuals(old.policy)
    for name in Residuals.__slots__:
        if name != "store":
            setattr(res, name, getattr(old, name))
    res.refs = dict(old.refs)
    res.store = dict(zip(keys, values))
    return _SavedValues(res)


class _Frame:
    """The residuals' bookkeeping (keys, refs, policy), compared by identity."""

    __slots__ = ("res",)

    def __init__(self, res: Residuals):
        self.res = res


tree_util.register_pytree_node(_SavedValues, _flatten_saved, _unflatten_saved)


class _Pullback:
    """The static part of `vjp`'s ``vjp_fn``: the tape and how to check a cotangent."""

    def __init__(self, t: _Traced, flat_out: list, obs: Any, retain: bool):
        self.tape, self.n_out, self.obs, self.retain = t.tape, t.n_out, obs, retain
        self.in_tree, self.out_tree = t.in_tree, t.out_tree
        self.out_avals = [(np.shape(o), _dtype_of(o)) for o in flat_out]
        self.in_zeros = [_zero_cotangent_spec(x) for x in t.flat]

    def __call__(self, saved: _SavedValues, ct: Any) -> tuple:
        ct_flat, ct_tree = tree_util.tree_flatten(ct)
        if ct_tree != self.out_tree:
            raise ValueError(  # ValueError, like jax
                f"vjp_fn: the cotangent has tree structure {ct_tree}, but the function's output "
                f"has {self.out_tree}. Pass a cotangent with the output's structure."
            )
        for c, (shape, want) in zip(ct_flat, self.out_avals):
            if np.shape(c) != shape:
                raise ValueError(
                    f"vjp_fn: cotangent shape {np.shape(c)} does not match the output's shape "
                    f"{shape}."
                )
            if jnp.issubdtype(want, jnp.inexact) and jax.typeof(c).dtype != want:
                raise ValueError(
                    f"vjp_fn: cotangent dtype {jax.typeof(c).dtype} does not match the output's "
                    f"dtype {want}. Pass a cotangent of the output's dtype."
                )
        bobs = self.obs.fresh() if self.obs is not None else None
        if bobs is not None:
            bobs.cotangents_in(ct_flat)
        in_cts = backward(
            self.tape,
            saved.res,
            list(ct_flat) + [None] * (len(self.out_avals) - self.n_out),
            retain=self.retain,
            observer=bobs,
        )
        if bobs is not None:
            in_cts = bobs.backward_done(in_cts)
        in_cts = [c if c is not None else z() for c, z in zip(in_cts, self.in_zeros)]
        return tuple(tree_util.tree_unflatten(self.in_tree, in_cts))


def _zero_cotangent_spec(x) -> Callable[[], Any]:
    """x's zero cotangent, made when called (float0 for integer inputs, as jax)."""
    shape, dt = np.shape(x), _dtype_of(x)
    if jnp.issubdtype(dt, jnp.inexact):
        return lambda: jnp.zeros(shape, dt)
    return lambda: np.zeros(shape, jax.dtypes.float0)


def value_and_grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    *,
    policy: Any = None,
    anomaly: Any = None,
    passes: Any = None,
    intermediates: Sequence[str] = (),
):
    """Like `jax.value_and_grad`, on tapegrad's tape and rules.

    ``intermediates=("h1", ...)`` also returns the cotangents of values tagged with
    `tg.name` (PyTorch's ``retain_grad``): the gradient becomes ``(grads, {name: ct})``.

    ``anomaly=True`` checks every record and VJP rule for NaN (`tg.detect_anomaly`);
    ``passes`` are tape passes (`tg.passes`) run on the traced tape.
    """
    single = isinstance(argnums, int)
    _anomaly.check_argument(anomaly)

    @functools.wraps(fun)
    def value_and_grad_f(*args, **kwargs):
        if kwargs:
            f = functools.partial(fun, **kwargs)
        else:
            f = fun
        nums = _argnums_tuple(argnums, len(args), "grad")
        for i in nums:
            for x in tree_util.tree_leaves(args[i]):
                if _is_array_leaf(x):
                    _check_input_dtype(x, allow_int, holomorphic, "grad")
        pol = resolve_policy(policy)
        # Like jax.grad, only the differentiated arguments are traced; the others
        # reach `fun` as they are (Python ints for loop bounds, strings, ...).
        dyn = tuple(args[i] for i in nums)

        def f_dyn(*d):
            full = list(args)
            for i, v in zip(nums, d):
                full[i] = v
            return f(*full)

        f_dyn.__wrapped__ = f  # for the function name in jax's errors
        mode = _anomaly.resolve(anomaly)
        t = _Traced(f_dyn, dyn, lambda i: True, has_aux, "grad", pol, passes, mode)
        # None when anomaly mode is off
        obs = _anomaly.observer(mode, t.tape if mode is not None else t.unplanned, t.in_tree)
        fused = None
        checked = False  # the output check and the named values, computed once
        if obs is None and is_plain(pol):
            # Nothing observes single records: try forward+backward as one compiled call.
            ydt = _check_grad_output(t, holomorphic)
            # One compiled call holds nothing between forward and backward: values
            # backward could rebuild are kept as they are (XLA plans that memory).
            whole = _passes.check_effects(plan_recompute(t.unplanned, pol, rebuild=False))
            capture = _named_vars(whole, intermediates)
            checked = True
            fused = run_grad(whole, t.flat, ydt, tuple(capture or ()))
        if fused is not None:
            flat_out, in_cts, captured = fused
            if capture:
                capture.update(zip(capture, captured))
        else:
            flat_out, res = forward(t.tape, t.flat, pol, observer=obs)
            if obs is not None:  # eagerly, a NaN in forward raises before backward runs
                obs.forward_done(t.flat, defer_traced=True)
            if not checked:
                ydt = _check_grad_output(t, holomorphic)
                capture = _named_vars(t.tape, intermediates)
            in_cts = backward(
                t.tape,
                res,
                [jnp.ones((), ydt)] + [None] * (len(flat_out) - 1),
                retain=False,
                observer=obs,
                capture=capture,
            )
        y = flat_out[0]
        if obs is not None:  # under a trace, ties the checks to the value and the gradients
            y, *in_cts = obs.backward_done([y, *in_cts])
        flat_out = t.restore([y] + list(flat_out[1:]))
        y = flat_out[0]
        in_cts = [c if c is not None else _zero_cotangent(x) for c, x in zip(in_cts, t.flat)]
        ct_args = tree_util.tree_unflatten(t.in_tree, in_cts)
        grads = ct_args[0] if single else tuple(ct_args)
        if intermediates:
            grads = (grads, _captured(t.tape, capture, intermediates))
        if has_aux:
            aux = tree_util.tree_unflatten(t.aux_tree, flat_out[1:])
            return (y, aux), grads
        return y, grads

    return value_and_grad_f


def _check_grad_output(t: _Traced, holomorphic: bool):
    """The output's dtype, after checking that it is a real (or, holomorphic, complex) scalar."""
    is_leaf = tree_util.treedef_is_leaf(t.out_tree)  # like jax, {"loss": x} is not a scalar
    shape = t.unplanned.outputs[0].shape if t.n_out == 1 else None
    if t.n_out != 1 or not is_leaf or shape != ():
        what = (
            f"Output had shape: {shape}"
            if t.n_out == 1 and is_leaf
            else f"Output was a pytree {t.out_tree} of {t.n_out} array(s)"
        )
        raise TypeError(
            f"Gradient only defined for scalar-output functions. {what}. Reduce the output "
            "to a scalar array (e.g. .sum()), return extra values with has_aux=True, or use "
            "tg.vjp."
        )
    ydt = t.unplanned.outputs[0].dtype
    if holomorphic and not jnp.issubdtype(ydt, jnp.complexfloating):
        raise TypeError(
            f"grad with holomorphic=True requires outputs with complex dtype, but got "
            f"{ydt.name}. Drop holomorphic=True for a real-valued output."
        )
    if not holomorphic and jnp.issubdtype(ydt, jnp.complexfloating):
        raise TypeError(
            "grad requires real-valued outputs (output dtype that is a sub-dtype of "
            f"np.floating), but got {ydt.name}. For holomorphic differentiation, pass "
            "holomorphic=True. For differentiating non-holomorphic functions involving "
            "complex outputs, use tg.vjp directly."
        )
    if not holomorphic and not jnp.issubdtype(ydt, jnp.floating):
        raise TypeError(
            "grad requires real-valued outputs (output dtype that is a sub-dtype of "
            f"np.floating), but got {ydt.name}. For differentiation of functions with "
            "integer outputs, use tg.vjp directly."
        )
    return ydt


def _named_vars(tape: Tape, names: Sequence[str]) -> dict[Any, Any] | None:
    """What backward captures for ``intermediates=names``: {capture key: None}, in the
    order of ``names`` (`retained_keys` says what each key is)."""
    if not names:
        return None
    found = retained_keys(tape)
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(
            f"intermediates={tuple(names)}: no value is tagged {missing} in this function "
            f'(tagged: {sorted(found) or "none"}). Tag a value with tg.name(x, "...").'
        )
    return {found[n][0]: None for n in names}


def _captured(tape: Tape, capture: dict[Any, Any], names: Sequence[str]) -> dict[str, Any]:
    found = retained_keys(tape)
    out = {}
    for n in names:
        key, v = found[n]
        ct = capture.get(key)
        out[n] = ct if ct is not None else jnp.zeros(v.shape, v.dtype)
    return out


def grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    *,
    policy: Any = None,
    anomaly: Any = None,
    passes: Any = None,
    intermediates: Sequence[str] = (),
):
    """Like `jax.grad`: the gradient of a scalar function, from tapegrad's tape.

    ```python
    g = tg.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w)))(w, x)
    ```
    """
    vg = value_and_grad(
        fun,
        argnums,
        has_aux,
        holomorphic,
        allow_int,
        policy=policy,
        anomaly=anomaly,
        passes=passes,
        intermediates=intermediates,
    )

    @functools.wraps(fun)
    def grad_f(*args, **kwargs):
        if has_aux:
            (_, aux), g = vg(*args, **kwargs)
            return g, aux
        return vg(*args, **kwargs)[1]

    return grad_f


def trace(
    fun: Callable,
    argnums: int | Sequence[int] | None = None,
    *,
    policy: Any = None,
    passes: Any = None,
):
    """Like `jax.make_jaxpr`, but returns tapegrad's `Tape`.

    Inputs in ``argnums`` (default: every float input) are treated as
    differentiated, which decides what each record saves; ``policy`` (e.g. a
    `tg.selective` policy) decides what is recomputed.
    """

    @functools.wraps(fun)
    def trace_f(*args):
        owners = _leaf_owners(args)
        nums = None if argnums is None else _argnums_tuple(argnums, len(args), "trace")
        return _Traced(
            fun,
            args,
            lambda i: nums is None or owners[i] in nums,
            False,
            "trace",
            resolve_policy(policy),
            passes,
        ).tape

    return trace_f
