"""Python control flow on values: eager `tg.grad` records the run, as `jax.grad` runs it.

Oracle: `jax.grad`/`jax.vjp` on the same function (which also runs eagerly on concrete
values). Under `jax.jit`/`jax.vmap` the error is jax's own.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_grads_match, assert_vjp_match

import tapegrad as tg

X = jnp.array([0.5, 1.5, -0.25])


def branchy(x):
    if x.sum() > 0:
        return jnp.sum(jnp.sin(x) ** 2)
    return jnp.sum(jnp.cos(x) * x)


def newton_sqrt(a):
    y = a
    for _ in range(50):
        y = y - (y * y - a) / (2 * y)
        if jnp.abs(y * y - a) < 1e-6:  # stops after a value-dependent number of steps
            break
    return y


def while_halving(x):
    n = 0
    while jnp.sum(x * x) > 1.0:
        x = x * 0.5
        n += 1
    return jnp.sum(jnp.tanh(x)) * n


def by_int(x):
    k = int(x[0] * 2) + 1  # a shape from a value
    return jnp.sum(jnp.exp(x[:k]))


@pytest.mark.parametrize("x", [X, -X])
def test_if_on_value_takes_the_branch_jax_takes(x):
    assert_grads_match(branchy, x)


@pytest.mark.parametrize("f", [newton_sqrt, while_halving], ids=["newton", "while"])
def test_value_dependent_loops(f):
    x = jnp.float32(2.0) if f is newton_sqrt else jnp.array([1.0, 2.0, 3.0])
    assert_grads_match(f, x)


def test_shape_from_value():
    assert_grads_match(by_int, jnp.array([1.2, 0.3, -0.4, 2.0]))


def test_vjp_and_value_and_grad_with_aux():
    def f(x):
        y = x * 2.0 if x[0] > 0 else x * 3.0
        return jnp.tanh(y), {"n": x[0] > 0}

    assert_vjp_match(lambda x: f(x)[0], X)
    (v, aux), g = tg.value_and_grad(lambda x: (jnp.sum(f(x)[0]), f(x)[1]), has_aux=True)(X)
    (v_ref, aux_ref), g_ref = jax.value_and_grad(
        lambda x: (jnp.sum(f(x)[0]), f(x)[1]), has_aux=True
    )(X)
    np.testing.assert_allclose(v, v_ref, rtol=1e-6)
    np.testing.assert_allclose(g, g_ref, rtol=1e-6)
    assert bool(aux["n"]) == bool(aux_ref["n"])


def test_the_tape_is_the_branch_that_ran_with_the_users_lines():
    tape = tg.trace(branchy)(X)
    prims = [r.primitive for r in tape.records]
    assert "sin" in prims and "cos" not in prims
    assert "cos" in [r.primitive for r in tg.trace(branchy)(-X).records]
    assert all("test_python_control_flow.py" in r.source for r in tape.records)


@pytest.mark.parametrize("order", ["tg-tg", "jax-tg"])
def test_second_order(order):
    outer = tg.grad if order == "tg-tg" else jax.grad
    got = outer(tg.grad(newton_sqrt))(jnp.float32(2.0))
    want = jax.grad(jax.grad(newton_sqrt))(jnp.float32(2.0))
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_under_jit_and_vmap_the_error_is_jaxs():
    with pytest.raises(jax.errors.TracerBoolConversionError):
        jax.jit(tg.grad(branchy))(X)
    with pytest.raises(jax.errors.TracerBoolConversionError):
        jax.vmap(tg.grad(lambda x: x**2 if x > 0 else x))(X)


@pytest.mark.parametrize(
    "policy",
    [
        tg.policies.save(),
        tg.policies.offload(),
        tg.policies.compress(jnp.bfloat16),
        tg.selective(lambda r: tg.CheckpointPolicy.PREFER_RECOMPUTE),
    ],
    ids=["save", "offload", "compress", "recompute"],
)
def test_policies_see_the_recorded_records(policy):
    def f(x):
        h = jnp.tanh(x) ** 2
        return jnp.sum(h * x) if x[0] > 0 else jnp.sum(h)

    got = tg.grad(f, policy=policy)(X)
    tol = 2e-2 if "compress" in repr(policy) else 1e-5
    np.testing.assert_allclose(got, jax.grad(f)(X), rtol=tol, atol=tol)


def test_memory_report_and_anomaly_name_the_line():
    def f(x):
        if x.sum() > 0:
            return jnp.sum(jnp.log(x - 1.0))  # NaN for x < 1
        return jnp.sum(x)

    report = tg.memory_report(f)(X)
    assert report.records  # the recorded records are counted
    with warnings.catch_warnings():  # "anomaly detection is enabled", once per process
        warnings.simplefilter("ignore")
        with pytest.raises(tg.errors.AnomalyError, match="log") as e:
            tg.grad(f, anomaly=True)(X)
    assert "test_python_control_flow.py" in str(e.value)


def test_debug_print_runs_once(capfd):
    def f(x):
        jax.debug.print("seen {}", x[0])
        return jnp.sum(x**2) if x[0] > 0 else jnp.sum(x)

    tg.grad(f)(X)
    jax.effects_barrier()
    assert capfd.readouterr().out.count("seen") == 1


# ----------------------------------------------- custom_jvp / custom_vjp that branch


@jax.custom_jvp
def signed_square(x):
    if x > 0:
        return x * x
    return -x * x


@signed_square.defjvp
def _signed_square_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    if x > 0:  # the rule branches on the primal too
        return signed_square(x), 2 * x * t
    return signed_square(x), -2 * x * t


@jax.custom_vjp
def odd_cube(x):
    return x**3 if x.sum() > 0 else -(x**3)


def _odd_cube_fwd(x):
    s = 1.0 if x.sum() > 0 else -1.0
    return s * x**3, (x, s)


def _odd_cube_bwd(res, g):
    x, s = res
    if g.sum() > 0:  # bwd runs on concrete cotangents
        return (s * 3 * x**2 * g,)
    return (s * 3 * x**2 * g,)


odd_cube.defvjp(_odd_cube_fwd, _odd_cube_bwd)


@pytest.mark.parametrize("x", [2.0, -2.0])
def test_custom_jvp_whose_function_and_rule_branch(x):
    assert_grads_match(lambda v: signed_square(v) * jnp.sin(v), jnp.float32(x))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_custom_vjp_whose_fwd_and_bwd_branch(sign):
    assert_grads_match(lambda v: jnp.sum(odd_cube(v) * v), sign * jnp.array([1.0, 2.0]))


def test_function_whose_forward_and_backward_branch():
    class Clip01(tg.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return jnp.clip(x, 0.0, 1.0) if x.sum() > 0 else x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            if x.sum() > 0:
                return g * ((x > 0) & (x < 1))
            return g

    g = tg.grad(lambda x: jnp.sum(Clip01.apply(x) * x))(jnp.array([0.5, 2.0]))
    np.testing.assert_allclose(g, [1.0, 1.0])  # d/dx[x*x]=2x*1 masked: 1.0; clip: 1.0*1
    g = tg.grad(lambda x: jnp.sum(Clip01.apply(x) * x))(jnp.array([-0.5, -2.0]))
    np.testing.assert_allclose(g, [-1.0, -4.0])  # identity branch: d/dx x*x = 2x


def test_array_methods_on_recorded_values():
    f = lambda x: x.var() + x.mean() if x.mean() > 0 else x.sum()
    assert_grads_match(f, X)


def test_a_value_leaked_from_a_recorded_run_raises_when_used():
    leaked = []

    def f(x):
        leaked.append(x * 2.0)
        return jnp.sum(x**2) if x[0] > 0 else jnp.sum(x)

    tg.grad(f)(X)
    with pytest.raises(jax.errors.UnexpectedTracerError):
        jnp.sin(leaked[-1])
