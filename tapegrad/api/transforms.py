"""The public transforms: grad, value_and_grad, vjp, trace.

Each traces the function into a `Tape`, runs the forward interpreter, and
(for grad) runs the backward interpreter at once, releasing residuals as it
goes. Signatures follow jax's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util

from tapegrad import passes as _passes
from tapegrad.anomaly import detect as _anomaly
from tapegrad.api.grad_hook import retained_keys
from tapegrad.api.traced import (
    Traced,
    argnums_tuple,
    is_array_leaf,
    leaf_owners,
)
from tapegrad.core.jax_compat import ArrayImpl
from tapegrad.core.residual_policy import is_plain, resolve_policy
from tapegrad.core.tape import Tape
from tapegrad.engine.checkpoint import plan_recompute
from tapegrad.engine.fused import can_fuse, run_grad
from tapegrad.engine.interpret import Residuals, backward, forward

__all__ = ["grad", "value_and_grad", "vjp", "trace"]


def _dtype_of(x):
    if type(x) is _ARRAY_IMPL and not x.weak_type:  # jnp.result_type costs ~13 us a leaf
        return x.dtype
    return jnp.result_type(x)


_ARRAY_IMPL = ArrayImpl  # not type(jnp.zeros(())): importing must not start jax's backend


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
    t = Traced(fun, primals, lambda i: True, has_aux, "vjp", pol, passes, mode)
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
    res = _without_values(frame.res)
    res.store = dict(zip(keys, values))
    return _SavedValues(res)


def _without_values(old: Residuals) -> Residuals:
    res = Residuals(old.policy)
    for name in Residuals.__slots__:
        if name != "store":
            setattr(res, name, getattr(old, name))
    return res


class _Frame:
    """The residuals' bookkeeping (infos, policy), compared by identity.

    Without their values: a treedef holds its aux data, and jax keeps some treedefs (a
    jitted function's dispatch cache keeps its first call's output treedef), so a frame
    holding the store would keep that call's residuals alive as long as the jitted
    function, after its ``vjp_fn`` is gone."""

    __slots__ = ("res",)

    def __init__(self, res: Residuals):
        self.res = _without_values(res)


tree_util.register_pytree_node(_SavedValues, _flatten_saved, _unflatten_saved)


class _Pullback:
    """The static part of `vjp`'s ``vjp_fn``: the tape and how to check a cotangent."""

    def __init__(self, t: Traced, flat_out: list, obs: Any, retain: bool):
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
        nums = argnums_tuple(argnums, len(args), "grad")
        for i in nums:
            for x in tree_util.tree_leaves(args[i]):
                if is_array_leaf(x):
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
        t = Traced(f_dyn, dyn, lambda i: True, has_aux, "grad", pol, passes, mode)
        # None when anomaly mode is off
        obs = _anomaly.observer(mode, t.tape if mode is not None else t.unplanned, t.in_tree)
        fused = None
        checked = False  # the output check and the named values, computed once
        if obs is None and is_plain(pol) and can_fuse(t.unplanned, t.flat):
            # Nothing observes single records, and no trace is around: try forward and
            # backward as one compiled call (planned for it alone).
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


def _check_grad_output(t: Traced, holomorphic: bool):
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
        owners = leaf_owners(args)
        nums = None if argnums is None else argnums_tuple(argnums, len(args), "trace")
        return Traced(
            fun,
            args,
            lambda i: nums is None or owners[i] in nums,
            False,
            "trace",
            resolve_policy(policy),
            passes,
        ).tape

    return trace_f
