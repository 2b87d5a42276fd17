"""jax's custom_vjp / custom_jvp protocol under `tg.grad`/`tg.vjp`, as jax implements it.

Each function below follows an example from jax's documentation (symbolic zeros,
``nondiff_argnums``, ``closure_convert``, ``custom_gradient``, integer inputs) and is
differentiated eagerly, under `jax.jit`, under `jax.vmap` and to second order. Oracle:
`jax.grad`/`jax.vjp` on the same function.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import tree_util

import tapegrad as tg

SEEN: dict[str, list] = {"perturbed": [], "ct": []}


@jax.custom_vjp
def sin_times(x, y):
    return jnp.sin(x) * y


def _st_fwd(x, y):  # symbolic_zeros=True: CustomVJPPrimal with .value and .perturbed
    SEEN["perturbed"].append((bool(x.perturbed), bool(y.perturbed)))
    return sin_times(x.value, y.value), (x.value, y.value, x.perturbed, y.perturbed)


def _st_bwd(res, g):
    x, y, px, py = res
    return (jnp.cos(x) * g * y if px else None, jnp.sin(x) * g if py else None)


sin_times.defvjp(_st_fwd, _st_bwd, symbolic_zeros=True)


@jax.custom_vjp
def two_outputs(x):
    return x * 2.0, x * 3.0


def _to_bwd(_, g):
    a, b = g
    SEEN["ct"].append(tuple(type(c).__name__ for c in g))
    out = 0.0
    if type(a).__name__ != "SymbolicZero":
        out = out + 2.0 * a
    if type(b).__name__ != "SymbolicZero":
        out = out + 3.0 * b
    return (out,)


two_outputs.defvjp(lambda x: (two_outputs(x.value), None), _to_bwd, symbolic_zeros=True)


@jax.custom_vjp
def scale_by_int(x, n):
    return x * n


scale_by_int.defvjp(lambda x, n: (x * n, n), lambda n, g: (g * n, None))  # None for the int


@jax.custom_gradient
def square_custom_grad(x):
    return x**2, lambda g: (g * 10.0 * x,)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def apply_fn(fn, x):
    return fn(x)


apply_fn.defvjp(lambda fn, x: (fn(x), x), lambda fn, x, g: (g * jax.grad(fn)(x),))


def closure_converted(w, x):
    def inner(x):
        return jnp.sin(w * x)

    fn, consts = jax.closure_convert(inner, x)

    @partial(jax.custom_vjp, nondiff_argnums=(0,))
    def call(fn, x, *consts):
        return fn(x, *consts)

    def call_fwd(fn, x, *consts):
        return fn(x, *consts), (x, consts)

    def call_bwd(fn, res, g):
        x, consts = res
        return jax.vjp(fn, x, *consts)[1](g)

    call.defvjp(call_fwd, call_bwd)
    return jnp.sum(call(fn, x, *consts))


@jax.custom_jvp
def mul_sz(x, y):
    return x * y


@mul_sz.defjvp
def _mul_sz_jvp(primals, tangents):
    x, y = primals
    tx, ty = tangents
    out = jnp.zeros_like(x * y)
    if type(tx).__name__ != "SymbolicZero":
        out = out + tx * y
    if type(ty).__name__ != "SymbolicZero":
        out = out + ty * x
    return x * y, out


mul_sz.defjvp(_mul_sz_jvp, symbolic_zeros=True)


CASES = {
    "symbolic_zeros x": (lambda x, y: sin_times(x, y), 0),
    "symbolic_zeros y": (lambda x, y: sin_times(x, y), 1),
    "symbolic_zeros both": (lambda x, y: sin_times(x, y), (0, 1)),
    "symbolic zero cotangent": (lambda x, y: two_outputs(x)[0] * y, 0),
    "custom_gradient": (lambda x, y: square_custom_grad(x) * y, 0),
    "nondiff_argnums": (lambda x, y: apply_fn(jnp.sin, x) * y, 0),
    "closure_convert": (closure_converted, (0, 1)),
    "custom_jvp symbolic_zeros": (lambda x, y: mul_sz(x, y), (0, 1)),
}
TRANSFORMS = {
    "eager": lambda g: g,
    "jit": jax.jit,
    "vmap": jax.vmap,
}


def _close(got, want):
    for a, b in zip(tree_util.tree_leaves(got), tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", TRANSFORMS)
@pytest.mark.parametrize("case", CASES)
def test_first_order(case, how):
    f, argnums = CASES[case]
    wrap = TRANSFORMS[how]
    x, y = (jnp.array([0.3, 1.1]), jnp.array([2.0, -1.0])) if how == "vmap" else (0.7, 1.5)
    _close(wrap(tg.grad(f, argnums))(x, y), wrap(jax.grad(f, argnums))(x, y))


@pytest.mark.parametrize("case", CASES)
def test_second_order(case):
    f, argnums = CASES[case]
    first = 0 if argnums == (0, 1) else argnums
    tg2 = tg.grad(lambda x, y: tg.grad(f, first)(x, y), first)
    jx2 = jax.grad(lambda x, y: jax.grad(f, first)(x, y), first)
    _close(tg2(0.7, 1.5), jx2(0.7, 1.5))


def test_perturbed_flags_follow_argnums():
    SEEN["perturbed"].clear()
    tg.grad(sin_times, 1)(0.7, 1.5)
    assert SEEN["perturbed"][-1] == (False, True)
    tg.grad(sin_times, (0, 1))(0.7, 1.5)
    assert SEEN["perturbed"][-1] == (True, True)


def test_symbolic_zero_cotangent_reaches_bwd():
    SEEN["ct"].clear()
    tg.grad(lambda x: two_outputs(x)[0])(1.0)
    assert SEEN["ct"][-1][1] == "SymbolicZero"  # the unused output has no cotangent


@pytest.mark.parametrize("n", [3, np.int32(3), jnp.int32(3)], ids=["int", "np", "jnp"])
def test_integer_input_gets_float0_and_bwd_may_return_python_scalars(n):
    # bwd returns g * n: a Python float when both are Python numbers (a past bug read
    # it as "no cotangent" and returned 0).
    got = tg.vjp(scale_by_int, 2.0, n)[1](1.0)
    want = jax.vjp(scale_by_int, 2.0, n)[1](1.0)
    np.testing.assert_allclose(got[0], want[0])
    assert got[1].dtype == jax.dtypes.float0
    g = tg.grad(scale_by_int, (0, 1), allow_int=True)(2.0, n)
    np.testing.assert_allclose(g[0], 3.0)
    assert g[1].dtype == jax.dtypes.float0
