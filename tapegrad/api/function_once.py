"""`tg.once_differentiable`: a `Function` backward that raises when differentiated again,
and the identity "ties" that make an outer differentiation see the dependences it needs
to raise (`_tie_outputs`, used by the custom_vjp's forward in `tapegrad.api.function`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util

from tapegrad.api.function_ctx import FunctionCtx, _is_array, _is_jax_value
from tapegrad.errors import OnceDifferentiableError

__all__ = ["once_differentiable"]


def once_differentiable(fn: Callable) -> Callable:
    """Mark a `Function`'s ``backward`` as not differentiable itself.

    The backward runs on values that carry no derivative (so it may use ops jax
    cannot differentiate), and asking for a second-order gradient through it
    (`tg.grad(tg.grad(f))`, `jax.jacrev(jax.grad(f))`, ...) raises
    `tg.OnceDifferentiableError` (a `tg.NonDifferentiableError` and a RuntimeError)
    instead of silently returning a wrong (zero) result.

    ```python
    class MyRelu(tg.Function):
        ...
        @staticmethod
        @tg.once_differentiable
        def backward(ctx, g):
            x, = ctx.saved_tensors
            return g * (x > 0)
    ```
    """
    if isinstance(fn, staticmethod):  # written above @staticmethod
        return staticmethod(once_differentiable(fn.__func__))

    @functools.wraps(fn)
    def wrapper(ctx: FunctionCtx, *grads: Any):
        name = ctx._tg_name
        saved = ctx._tg_saved
        deps = (saved, grads)
        stop = functools.partial(tree_util.tree_map, jax.lax.stop_gradient)
        ctx._tg_saved = stop(saved)
        try:
            out = fn(ctx, *stop(grads))
        finally:
            ctx._tg_saved = saved
        leaves, treedef = tree_util.tree_flatten(out)
        idx = [k for k, x in enumerate(leaves) if _is_array(x)]
        if not idx:
            return out
        guarded = _once_barrier(name)(tuple(leaves[k] for k in idx), deps)
        for k, g in zip(idx, guarded):
            leaves[k] = g
        return tree_util.tree_unflatten(treedef, leaves)

    wrapper._tg_once_differentiable = True  # type: ignore[attr-defined]
    return wrapper


def _tie_outputs(out: Any, ctx: FunctionCtx, inputs: list) -> Any:
    """``out``, with each differentiable output tied to the perturbed ``inputs``.

    As in PyTorch, every output of a Function depends on its differentiable inputs. Under
    an outer differentiation jax sees the forward's own computation instead, which may
    cut the dependence (``jnp.round`` in a straight-through estimator has derivative 0):
    the cotangents later fed to the once-differentiable backward would then look
    constant, and a double backward through it would silently give 0 instead of
    raising. The tie is the identity with a zero derivative w.r.t. ``inputs``: values and
    gradients are unchanged, but an outer transformation sees the dependence.
    """
    deps = [x for x in inputs if _is_jax_value(x) and jnp.issubdtype(x.dtype, jnp.inexact)]
    leaves, treedef = tree_util.tree_flatten(out)
    idx = [
        k
        for k, x in enumerate(leaves)
        if k not in ctx._tg_marked and _is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    if not deps or not idx:
        return out
    avals = tuple((np.shape(d), jnp.result_type(d)) for d in deps)
    tied = _tie(avals, tuple(leaves[k] for k in idx), tuple(deps))
    for k, t in zip(idx, tied):
        leaves[k] = t
    return tree_util.tree_unflatten(treedef, leaves)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tie(avals: tuple, outs: tuple, deps: tuple) -> tuple:
    return outs


def _tie_fwd(avals, outs, deps):
    return outs, None


def _tie_bwd(avals, _, ct):
    return ct, tuple(jnp.zeros(shape, dt) for shape, dt in avals)


_tie.defvjp(_tie_fwd, _tie_bwd)


def _once_barrier(name: str):
    """Identity on ``outs`` that raises when differentiated through ``deps``."""

    def barrier(outs, deps):
        return outs

    def fwd(outs, deps):
        return outs, None

    def bwd(_, ct):
        raise OnceDifferentiableError(
            "trying to differentiate twice a function that was marked with "
            f"@once_differentiable: {name}.backward is decorated with @tg.once_differentiable, "
            "so it cannot be differentiated, but a higher-order gradient through it was "
            "requested. Remove @once_differentiable and write backward with differentiable "
            "jax ops to support double backward."
        )

    barrier.__name__ = barrier.__qualname__ = f"{name}.backward[once_differentiable]"
    f = jax.custom_vjp(barrier)
    f.defvjp(fwd, bwd)
    return f
