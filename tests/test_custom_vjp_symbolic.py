"""custom_vjp rules as jax calls them, under both of jax's custom_vjp implementations
(``jax_custom_vjp3`` off: ``custom_vjp_call``; on: ``call_hi_primitive``): symbolic
zeros where an output gets no cotangent, Python scalars and float0 from a bwd rule,
constants the call closes over, a fwd branching on values, and jax's errors.
Oracle: `jax.vjp` / `jax.grad` on the same function.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapegrad as tg


@pytest.fixture(params=[False, True], ids=["custom_vjp_call", "vjp3"])
def vjp3(request):
    old = jax.config.jax_custom_vjp3
    jax.config.update("jax_custom_vjp3", request.param)
    yield request.param
    jax.config.update("jax_custom_vjp3", old)


def _two_outputs(seen):
    @jax.custom_vjp
    def f(x, y):
        return x * y, x + y

    def fwd(x, y):
        seen.append(("perturbed", bool(x.perturbed), bool(y.perturbed)))
        return f(x.value, y.value), (x.value, y.value)

    def bwd(res, g):
        x, y = res
        g1, g2 = g
        zero = jax.custom_derivatives.SymbolicZero
        seen.append(("zero", type(g1) is zero, type(g2) is zero))
        g1 = 0.0 if type(g1) is zero else g1
        g2 = 0.0 if type(g2) is zero else g2
        return g1 * y + g2, g1 * x + g2

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    return f


@pytest.mark.parametrize("wrap", ["eager", "jit", "vmap"])
def test_bwd_sees_a_symbolic_zero_where_an_output_has_no_cotangent(vjp3, wrap):
    def run(vjp, seen):
        f = _two_outputs(seen)
        g = lambda x: f(x, 3.0)[0]  # noqa: E731
        x = jnp.float32(2.0)
        if wrap == "vmap":
            g, x = jax.vmap(g), jnp.arange(3.0)
        pullback = lambda x: vjp(g, x)[1](jnp.ones_like(x))  # noqa: E731
        return (jax.jit(pullback) if wrap == "jit" else pullback)(x)

    want_seen: list = []
    seen: list = []
    want = run(jax.vjp, want_seen)
    got = run(tg.vjp, seen)
    np.testing.assert_allclose(got[0], want[0])
    assert ("zero", False, True) in want_seen
    assert set(seen) == set(want_seen)


def test_bwd_returning_python_scalars_and_float0(vjp3):
    @jax.custom_vjp
    def f(x, n):
        return x

    f.defvjp(lambda x, n: (x, None), lambda _, g: (2.0, np.zeros((), jax.dtypes.float0)))
    want = jax.grad(f, argnums=(0, 1), allow_int=True)(2.0, 3)
    got = tg.grad(f, argnums=(0, 1), allow_int=True)(2.0, 3)
    np.testing.assert_allclose(got[0], want[0])
    assert got[1].dtype == want[1].dtype == jax.dtypes.float0


def test_closure_convert_with_constants_not_differentiated(vjp3):
    # The call closes over `s` (a constant of the traced program): jax counts it among
    # the operands its residual forwarding indexes.
    def cos_after(fn, x):
        converted, aux = jax.closure_convert(fn, x)
        return _cos_after(converted, x, *aux)

    @partial(jax.custom_vjp, nondiff_argnums=(0,))
    def _cos_after(fn, x, *args):
        return jnp.cos(fn(x, *args))

    def fwd(fn, x, *args):
        return _cos_after(fn, x, *args), (x, args)

    def rev(fn, res, g):
        x, args = res
        return (17.0 * x, *[42.0 * a for a in args])

    _cos_after.defvjp(fwd, rev)

    def solve(c, s, x):
        return cos_after(lambda x: jnp.sum(s * (x - c) ** 2), x)

    c, s, x = 2 * jnp.ones(2), 3 * jnp.ones(2), jnp.ones(2)
    want = jax.grad(solve, argnums=(0, 2))(c, s, x)
    got = tg.grad(solve, argnums=(0, 2))(c, s, x)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b)


def test_fwd_with_python_control_flow_runs_eagerly(vjp3):
    @jax.custom_vjp
    def f(x):
        return jax.lax.cond(x > 0, jnp.sin, jnp.cos, x)

    def f_fwd(x):
        return (jnp.sin(x), x) if x > 0 else (jnp.cos(x), x)

    f.defvjp(f_fwd, lambda x, g: (2 * g,) if x > 0 else (3 * g,))
    for x in (2.0, -2.0):
        want = jax.value_and_grad(f)(x)
        got = tg.value_and_grad(f)(x)
        np.testing.assert_allclose(got, want)


def test_bwd_shape_checks_disabled_pass_the_cotangent_on_as_jax(vjp3):
    @jax.custom_vjp
    def foo(x, y):
        return x

    foo.defvjp(lambda x, y: (x, None), lambda _, g: (jnp.zeros(3), jnp.zeros(3)))
    loss = lambda x, y: foo(x, y).sum()  # noqa: E731
    with jax.disable_bwd_checks(True) if hasattr(jax, "disable_bwd_checks") else _disabled():
        want = jax.grad(loss, 1)(jnp.ones(3), jnp.ones(4))
        got = tg.grad(loss, 1)(jnp.ones(3), jnp.ones(4))
    np.testing.assert_array_equal(got, want)


def _disabled():
    from jax._src import config

    return config.disable_bwd_checks(True)


def test_custom_jvp_rule_closing_over_a_differentiated_value_raises_jax_error():
    def f(x):
        @jax.custom_jvp
        def g(y):
            return x + y

        g.defjvp(lambda primals, tangents: (g(x), 2 * primals[0]))
        return g(1.0)

    with pytest.raises(jax.errors.UnexpectedTracerError):
        jax.grad(f)(3.0)
    with pytest.raises(jax.errors.UnexpectedTracerError, match="unexpected tracer.*closes over"):
        tg.grad(f)(3.0)
