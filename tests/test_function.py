"""`tg.Function`: PyTorch's autograd.Function protocol on jax.custom_vjp.

Every gradient is checked against an oracle: `jax.grad` of the same math written
with plain jax ops, or float64 finite differences. Seed 003's examples appear as
written there, with torch replaced by jax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, rand

import tapegrad as tg
from tapegrad import policies as P
from tapegrad.rules.control import custom_vjp_name

# ---------------------------------------------------------------------------
# Functions under test

CALLS: list = []  # what backward saw: (name, needs_input_grad)


class LinearFn(tg.Function):
    """The issue's example: new style, needs_input_grad, an optional bias."""

    @staticmethod
    def forward(x, w, b=None):
        return x @ w.T + (0 if b is None else b)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, b = inputs
        ctx.save_for_backward(x, w)

    @staticmethod
    def backward(ctx, g):
        CALLS.append(("LinearFn", ctx.needs_input_grad))
        x, w = ctx.saved_tensors
        gx = g @ w if ctx.needs_input_grad[0] else None
        gw = g.T @ x if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if ctx.needs_input_grad[2] else None
        return gx, gw, gb


class LinearFunctionOld(tg.Function):
    """Seed 003 §4.1: the old style, forward(ctx, ...)."""

    @staticmethod
    def forward(ctx, input, weight, bias=None):
        ctx.save_for_backward(input, weight, bias)
        output = input @ weight.T
        if bias is not None:
            output += jnp.broadcast_to(bias[None], output.shape)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output @ weight
        if ctx.needs_input_grad[1]:
            grad_weight = grad_output.T @ input
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_output.sum(0)
        return grad_input, grad_weight, grad_bias


class CustomReLU(tg.Function):
    """Seed 003 §6.1 (``grad_input[x < 0] = 0`` becomes ``.at[...]``)."""

    @staticmethod
    def forward(x):
        return jnp.clip(x, min=0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x,) = inputs
        ctx.save_for_backward(x)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        grad_input = jnp.where(x < 0, 0.0, grad_output)
        return grad_input


class CustomLinear(tg.Function):
    """Seed 003 §6.2: new style, saves a bias that may be None."""

    @staticmethod
    def forward(input, weight, bias=None):
        output = input @ weight.T
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight, bias = inputs
        ctx.save_for_backward(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_output @ weight
        grad_weight = grad_output.T @ input
        grad_bias = grad_output.sum(0) if bias is not None else None
        return grad_input, grad_weight, grad_bias


class CustomSquare(tg.Function):
    """Seed 003 §6.3: backward in jax ops, so it differentiates twice."""

    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x,) = inputs
        ctx.save_for_backward(x)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return 2 * x * grad_output


class RoundSTE(tg.Function):
    """A straight-through estimator: round in forward, identity in backward."""

    @staticmethod
    def forward(x):
        return jnp.round(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g


class OnceReLU(tg.Function):
    """Seed 003 §5: @once_differentiable."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return jnp.clip(x, min=0)

    @staticmethod
    @tg.once_differentiable
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return grad_output * (x > 0).astype(grad_output.dtype)


class OnceCube(tg.Function):
    """once_differentiable written above @staticmethod, on a function with a nonzero
    second derivative."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @tg.once_differentiable
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


def _x_w_b(dtype=jnp.float32):
    return rand((4, 3), dtype, seed=1), rand((5, 3), dtype, seed=2), rand((5,), dtype, seed=3)


def _linear(x, w, b=None):
    return x @ w.T + (0 if b is None else b)


def _loss_of(fn):
    return lambda x, w, b: jnp.sum(jnp.tanh(fn(x, w, b)) ** 2)


# ---------------------------------------------------------------------------
# Gradients against jax.grad of the same math


@pytest.mark.parametrize(
    "fn", [LinearFn, LinearFunctionOld, CustomLinear], ids=lambda c: c.__name__
)
@pytest.mark.parametrize("argnums", [(0, 1, 2), 0, 1, (1, 2)], ids=str)
def test_linear_functions_match_jax_grad(fn, argnums):
    x, w, b = _x_w_b()
    want = jax.grad(_loss_of(_linear), argnums)(x, w, b)
    assert_trees_close(tg.grad(_loss_of(fn.apply), argnums)(x, w, b), want)
    assert_trees_close(jax.grad(_loss_of(fn.apply), argnums)(x, w, b), want)


@pytest.mark.parametrize("grad", [tg.grad, jax.grad], ids=["tg.grad", "jax.grad"])
@pytest.mark.parametrize(
    "argnums,needs",
    [((0, 1, 2), (True, True, True)), (1, (False, True, False)), ((0, 2), (True, False, True))],
    ids=str,
)
def test_needs_input_grad_follows_the_differentiated_inputs(grad, argnums, needs):
    x, w, b = _x_w_b()
    CALLS.clear()
    grad(_loss_of(LinearFn.apply), argnums)(x, w, b)
    assert CALLS == [("LinearFn", needs)]


def test_needs_input_grad_under_vjp_and_for_non_float_inputs():
    class Scale(tg.Function):
        @staticmethod
        def forward(ctx, x, n, k):
            return x * n * k

        @staticmethod
        def backward(ctx, g):
            CALLS.append(("Scale", ctx.needs_input_grad))
            return g * 2 * 3, None, None

    x = rand((3,))
    CALLS.clear()
    _, vjp_fn = tg.vjp(lambda x: Scale.apply(x, jnp.int32(2), 3.0), x)
    assert_trees_close(vjp_fn(jnp.ones(3)), (jnp.full(3, 6.0),))
    _, vjp_fn = jax.vjp(lambda x: Scale.apply(x, jnp.int32(2), 3.0), x)
    assert_trees_close(vjp_fn(jnp.ones(3)), (jnp.full(3, 6.0),))
    # the int32 array is an input (needs no grad); the Python float is static
    assert CALLS == [("Scale", (True, False, False))] * 2


def test_needs_input_grad_false_for_an_input_cut_by_stop_gradient():
    x, w, b = _x_w_b()
    CALLS.clear()
    f = lambda x, w, b: jnp.sum(LinearFn.apply(jax.lax.stop_gradient(x), w, b))
    for grad in (tg.grad, jax.grad):
        grad(f, (0, 1))(x, w, b)
    assert CALLS == [("LinearFn", (False, True, False))] * 2


@pytest.mark.parametrize("grad", [tg.grad, jax.grad], ids=["tg.grad", "jax.grad"])
def test_jitted_function_differentiated_wrt_different_inputs_in_turn(grad):
    # jax reuses the cached jaxpr of a jitted function (one ctx per traced call), so
    # needs_input_grad becomes the union of the patterns seen; gradients stay exact.
    x, w, b = _x_w_b()
    jf = jax.jit(_loss_of(LinearFn.apply))
    CALLS.clear()
    for argnums in (0, 1, 0, 2):
        assert_trees_close(
            grad(jf, argnums)(x, w, b), jax.grad(_loss_of(_linear), argnums)(x, w, b)
        )
    assert CALLS[0] == ("LinearFn", (True, False, False))
    assert all(needs[argnums] for (_, needs), argnums in zip(CALLS, (0, 1, 0, 2)))


def test_old_style_without_bias_gets_three_needs_and_returns_three_grads():
    x, w, _ = _x_w_b()
    f = lambda x, w: jnp.sum(jnp.sin(LinearFunctionOld.apply(x, w)))
    want = jax.grad(lambda x, w: jnp.sum(jnp.sin(_linear(x, w))), (0, 1))(x, w)
    assert_trees_close(tg.grad(f, (0, 1))(x, w), want)
    assert_trees_close(jax.grad(f, (0, 1))(x, w), want)


def test_keyword_arguments_and_defaults_bind_like_forward():
    x, w, b = _x_w_b()
    f = lambda x, w, b: jnp.sum(LinearFn.apply(x, w=w, b=b) ** 2)
    want = jax.grad(lambda x, w, b: jnp.sum(_linear(x, w, b) ** 2), (0, 1, 2))(x, w, b)
    assert_trees_close(tg.grad(f, (0, 1, 2))(x, w, b), want)


# ---------------------------------------------------------------------------
# Seed 003's examples


@pytest.mark.parametrize("grad", [tg.grad, jax.grad], ids=["tg.grad", "jax.grad"])
def test_seed_custom_relu(grad):
    x = rand((5,), seed=4)
    got = grad(lambda x: jnp.sum(CustomReLU.apply(x)))(x)
    assert_trees_close(got, jax.grad(lambda x: jnp.sum(jax.nn.relu(x)))(x))


@pytest.mark.parametrize("grad", [tg.grad, jax.grad], ids=["tg.grad", "jax.grad"])
def test_seed_custom_linear_y_sum_backward(grad):
    x, w, b = rand((4, 3), seed=5), rand((5, 3), seed=6), rand((5,), seed=7)
    got = grad(lambda x, w, b: CustomLinear.apply(x, w, b).sum(), (0, 1, 2))(x, w, b)
    assert_trees_close(got, jax.grad(lambda x, w, b: _linear(x, w, b).sum(), (0, 1, 2))(x, w, b))


@pytest.mark.parametrize(
    "outer,inner",
    [(tg.grad, tg.grad), (jax.grad, jax.grad), (jax.grad, tg.grad), (tg.grad, jax.grad)],
    ids=["tg-tg", "jax-jax", "jax-tg", "tg-jax"],
)
def test_seed_custom_square_double_backward(outer, inner):
    x = jnp.float32(3.0)
    assert float(inner(CustomSquare.apply)(x)) == 6.0  # dy/dx = 2x
    assert float(outer(inner(CustomSquare.apply))(x)) == 2.0  # d2y/dx2 = 2


def test_python_scalar_argument_under_jax_grad():
    # jax.grad(f)(3.0) hands custom_vjp's rules a Python-scalar literal: forward and
    # save_for_backward still see arrays.
    assert float(jax.grad(CustomSquare.apply)(3.0)) == 6.0
    assert float(jax.grad(jax.grad(CustomSquare.apply))(3.0)) == 2.0
    assert float(tg.grad(CustomSquare.apply)(3.0)) == 6.0


@pytest.mark.parametrize("grad", [tg.grad, jax.grad], ids=["tg.grad", "jax.grad"])
def test_straight_through_estimator_for_rounding(grad):
    x = jnp.array([0.2, 1.7, -2.4, 3.5])
    f = lambda x: jnp.sum(RoundSTE.apply(x) * jnp.arange(1.0, 5.0))
    ste = lambda x: jnp.sum((x + jax.lax.stop_gradient(jnp.round(x) - x)) * jnp.arange(1.0, 5.0))
    assert_trees_close(RoundSTE.apply(x), jnp.round(x))
    assert_trees_close(grad(f)(x), jax.grad(ste)(x))
    assert_trees_close(grad(f)(x), jnp.arange(1.0, 5.0))  # not round's zero derivative


# ---------------------------------------------------------------------------
# Double backward against float64 finite differences


def test_double_backward_matches_float64_finite_differences(x64):
    v = jnp.array([0.3, -1.2, 0.7], jnp.float64)
    f = lambda x: jnp.sum(jnp.sin(CustomSquare.apply(x)) * jnp.exp(x / 3))
    hvp = lambda x: jnp.vdot(tg.grad(f)(x), v)  # a Hessian-vector product, a scalar
    x = jnp.array([0.4, -0.9, 1.3], jnp.float64)
    got = tg.grad(hvp)(x)
    eps = 1e-5
    fd = np.array([(hvp(x + eps * e) - hvp(x - eps * e)) / (2 * eps) for e in np.eye(3)])
    np.testing.assert_allclose(np.asarray(got), fd, rtol=1e-7, atol=1e-8)
    ref = jax.jacrev(jax.grad(lambda x: jnp.sum(jnp.sin(x * x) * jnp.exp(x / 3))))(x) @ v
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(
        np.asarray(jax.grad(lambda x: jnp.vdot(jax.grad(f)(x), v))(x)),
        np.asarray(ref),
        rtol=1e-10,
        atol=1e-12,
    )


def test_first_order_gradient_matches_float64_finite_differences(x64):
    x, w, b = _x_w_b(jnp.float64)
    f = _loss_of(LinearFn.apply)
    gw = tg.grad(f, 1)(x, w, b)
    eps = 1e-6
    for idx in [(0, 0), (2, 1), (4, 2)]:
        e = jnp.zeros_like(w).at[idx].set(eps)
        fd = (f(x, w + e, b) - f(x, w - e, b)) / (2 * eps)
        np.testing.assert_allclose(float(gw[idx]), float(fd), rtol=1e-7, atol=1e-9)


# ---------------------------------------------------------------------------
# jax transforms


def test_works_under_jit_forward_and_gradients():
    x, w, b = _x_w_b()
    f = _loss_of(LinearFn.apply)
    want = jax.grad(_loss_of(_linear), (0, 1, 2))(x, w, b)
    assert_trees_close(jax.jit(LinearFn.apply)(x, w, b), _linear(x, w, b))
    assert_trees_close(jax.jit(jax.grad(f, (0, 1, 2)))(x, w, b), want)
    assert_trees_close(jax.jit(tg.grad(f, (0, 1, 2)))(x, w, b), want)
    assert_trees_close(
        jax.jit(tg.grad(tg.grad(CustomSquare.apply)))(jnp.float32(3.0)), jnp.float32(2.0)
    )


def test_works_under_vmap_forward_and_gradients():
    x, w, b = _x_w_b()
    xs = jnp.stack([x, 2 * x, -x])
    f = _loss_of(LinearFn.apply)
    assert_trees_close(
        jax.vmap(LinearFn.apply, (0, None, None))(xs, w, b),
        jax.vmap(_linear, (0, None, None))(xs, w, b),
    )
    want = jax.vmap(jax.grad(_loss_of(_linear), 1), (0, None, None))(xs, w, b)
    assert_trees_close(jax.vmap(jax.grad(f, 1), (0, None, None))(xs, w, b), want)
    assert_trees_close(jax.vmap(tg.grad(f, 1), (0, None, None))(xs, w, b), want)
    # gradient of a vmapped Function (batched residuals and cotangents)
    g = lambda w: jnp.sum(jax.vmap(LinearFn.apply, (0, None, None))(xs, w, b) ** 2)
    h = lambda w: jnp.sum(jax.vmap(_linear, (0, None, None))(xs, w, b) ** 2)
    assert_trees_close(tg.grad(g)(w), jax.grad(h)(w), rtol=1e-5, atol=1e-5)
    assert_trees_close(jax.grad(g)(w), jax.grad(h)(w), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Pytrees, several outputs, static arguments, non-array ctx state


class Affine(tg.Function):
    """A dict of parameters in, two outputs out."""

    @staticmethod
    def forward(params, x):
        y = x @ params["w"] + params["b"]
        return jnp.tanh(y), y

    @staticmethod
    def setup_context(ctx, inputs, output):
        params, x = inputs
        t, _ = output
        ctx.save_for_backward(params["w"], x, t)

    @staticmethod
    def backward(ctx, gt, gy):
        w, x, t = ctx.saved_tensors
        gpre = gt * (1 - t**2) + gy
        return {"w": x.T @ gpre, "b": gpre.sum(0)}, gpre @ w.T


def _affine(params, x):
    y = x @ params["w"] + params["b"]
    return jnp.tanh(y), y


@pytest.mark.parametrize("grad", [tg.grad, jax.grad], ids=["tg.grad", "jax.grad"])
def test_pytree_inputs_and_several_outputs(grad):
    params = {"w": rand((3, 4), seed=8), "b": rand((4,), seed=9)}
    x = rand((2, 3), seed=10)
    loss = lambda fn: lambda p, x: jnp.sum(fn(p, x)[0] * 2) + jnp.sum(fn(p, x)[1] ** 2)
    want = jax.grad(loss(_affine), (0, 1))(params, x)
    assert_trees_close(grad(loss(Affine.apply), (0, 1))(params, x), want)
    only_t = lambda fn: lambda p, x: jnp.sum(fn(p, x)[0])  # the second output gets no cotangent
    assert_trees_close(grad(only_t(Affine.apply))(params, x), jax.grad(only_t(_affine))(params, x))


class ScaleAct(tg.Function):
    """Static arguments: a Python float, a string, a callable; ctx attributes."""

    @staticmethod
    def forward(ctx, x, scale, mode, act):
        ctx.scale, ctx.mode = scale, mode
        ctx.save_for_backward(x)
        y = act(x) * scale
        return y if mode == "plain" else 2 * y

    @staticmethod
    def backward(ctx, g):
        CALLS.append(("ScaleAct", ctx.needs_input_grad))
        (x,) = ctx.saved_tensors
        k = ctx.scale * (1 if ctx.mode == "plain" else 2)
        return g * k * (1 - jnp.tanh(x) ** 2), None, None, None


@pytest.mark.parametrize("jit", [False, True])
def test_static_arguments_reach_forward_and_ctx_as_python_values(jit):
    x = rand((4,), seed=11)
    f = lambda x: jnp.sum(ScaleAct.apply(x, 1.5, "double", jnp.tanh) ** 2)
    ref = lambda x: jnp.sum((2 * 1.5 * jnp.tanh(x)) ** 2)
    CALLS.clear()
    for grad in (tg.grad, jax.grad):
        g = jax.jit(grad(f)) if jit else grad(f)
        assert_trees_close(g(x), jax.grad(ref)(x))
    assert CALLS == [("ScaleAct", (True, False, False, False))] * 2


# ---------------------------------------------------------------------------
# mark_non_differentiable, set_materialize_grads


class MaxWithIndex(tg.Function):
    """Returns (max, argmax); the integer index is marked non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        i = jnp.argmax(x)
        ctx.mark_non_differentiable(i)
        ctx.save_for_backward(x, i)
        return x[i], i

    @staticmethod
    def backward(ctx, g_max, g_idx):
        CALLS.append(("MaxWithIndex", (g_idx.dtype, g_idx.shape)))
        x, i = ctx.saved_tensors
        return jnp.zeros_like(x).at[i].set(g_max)


@pytest.mark.parametrize("mode", ["tg.grad", "jax.grad", "jit", "vmap"])
def test_mark_non_differentiable_integer_output(mode):
    x = jnp.array([1.0, 5.0, 2.0, -3.0])

    def f(x):
        m, i = MaxWithIndex.apply(x)
        return m * 3.0 + i

    ref = lambda x: jnp.max(x) * 3.0
    CALLS.clear()
    if mode == "vmap":
        xs = jnp.stack([x, -x])
        got, want = jax.vmap(jax.grad(f))(xs), jax.vmap(jax.grad(ref))(xs)
    else:
        g = {"tg.grad": tg.grad(f), "jax.grad": jax.grad(f), "jit": jax.jit(tg.grad(f))}[mode]
        got, want = g(x), jax.grad(ref)(x)
    assert_trees_close(got, want)
    # backward receives a zero cotangent of the output's own (integer) type for the index
    assert CALLS and all(dt == jnp.int32 and shape == () for _, (dt, shape) in CALLS)


class MinMax(tg.Function):
    """Two float outputs; the second is marked non-differentiable."""

    @staticmethod
    def forward(x):
        return jnp.min(x), jnp.max(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x,) = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(x, output[0])

    @staticmethod
    def backward(ctx, g_min, g_max):
        CALLS.append(("MinMax", float(jnp.sum(jnp.abs(g_max)))))
        x, lo = ctx.saved_tensors
        return jnp.where(x == lo, g_min, 0.0)


@pytest.mark.parametrize("grad", [tg.grad, jax.grad], ids=["tg.grad", "jax.grad"])
def test_mark_non_differentiable_float_output_gets_no_cotangent(grad):
    x = jnp.array([1.0, -5.0, 2.0])
    CALLS.clear()

    def f(x):
        lo, hi = MinMax.apply(x)
        return lo + 10 * hi

    got = grad(f)(x)
    assert_trees_close(got, jnp.array([0.0, 1.0, 0.0]))  # the max's 10x is dropped
    assert CALLS == [("MinMax", 0.0)]  # and backward saw a zero cotangent for it


def _sin_cos(materialize):
    class SinCos(tg.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_materialize_grads(materialize)
            ctx.save_for_backward(x)
            return jnp.sin(x), jnp.cos(x)

        @staticmethod
        def backward(ctx, g_sin, g_cos):
            CALLS.append(("SinCos", g_sin is None, g_cos is None))
            (x,) = ctx.saved_tensors
            out = jnp.zeros_like(x)
            if g_sin is not None:
                out = out + g_sin * jnp.cos(x)
            if g_cos is not None:
                out = out - g_cos * jnp.sin(x)
            return out

    return SinCos


@pytest.mark.parametrize("grad", [tg.grad, jax.grad], ids=["tg.grad", "jax.grad"])
@pytest.mark.parametrize("materialize", [True, False])
def test_set_materialize_grads(grad, materialize):
    fn = _sin_cos(materialize)
    x = rand((3,), seed=12)
    CALLS.clear()
    assert_trees_close(grad(lambda x: jnp.sum(fn.apply(x)[0]))(x), jnp.cos(x))
    assert_trees_close(grad(lambda x: jnp.sum(fn.apply(x)[1]))(x), -jnp.sin(x))

    def both_outputs(x):
        s, c = fn.apply(x)
        return jnp.sum(s * c)

    both = grad(both_outputs)(x)
    assert_trees_close(both, jnp.cos(2 * x), rtol=1e-5, atol=1e-6)
    none = not materialize
    assert CALLS == [("SinCos", False, none), ("SinCos", none, False), ("SinCos", False, False)]


# ---------------------------------------------------------------------------
# once_differentiable


@pytest.mark.parametrize("grad", [tg.grad, jax.grad], ids=["tg.grad", "jax.grad"])
def test_once_differentiable_first_order_is_fine(grad):
    x = rand((5,), seed=13)
    assert_trees_close(
        grad(lambda x: jnp.sum(OnceReLU.apply(x) * x))(x),
        jax.grad(lambda x: jnp.sum(jax.nn.relu(x) * x))(x),
    )
    assert_trees_close(grad(lambda x: jnp.sum(OnceCube.apply(x)))(x), 3 * x**2)
    assert_trees_close(jax.jit(grad(lambda x: jnp.sum(OnceCube.apply(x))))(x), 3 * x**2)


@pytest.mark.parametrize(
    "outer,inner",
    [(tg.grad, tg.grad), (jax.grad, jax.grad), (jax.grad, tg.grad), (tg.grad, jax.grad)],
    ids=["tg-tg", "jax-jax", "jax-tg", "tg-jax"],
)
def test_once_differentiable_raises_on_double_backward(outer, inner):
    with pytest.raises(
        tg.NonDifferentiableError, match=r"OnceCube\.backward .*once_differentiable"
    ):
        outer(inner(OnceCube.apply))(jnp.float32(2.0))


def test_once_differentiable_does_not_raise_when_backward_is_not_differentiated():
    # the outer grad differentiates w.r.t. y only, which does not reach OnceCube's backward
    f = lambda x, y: jnp.sum(OnceCube.apply(x)) * 1.0 + jnp.sum(y**2)
    got = tg.grad(lambda y, x: jnp.sum(tg.grad(f, 1)(x, y)))(jnp.ones(2), jnp.ones(2))
    assert_trees_close(got, jnp.full(2, 2.0))


# ---------------------------------------------------------------------------
# Residuals: policies, tape, memory_report


def _packs_and_unpacks(f, *args, argnums=0):
    log = []

    def pack(a):
        log.append(("pack", a.shape))
        return a

    def unpack(a):
        log.append(("unpack", a.shape))
        return a

    with tg.saved_tensors_hooks(pack, unpack):
        g = tg.grad(f, argnums)(*args)
    return g, log


def test_saved_tensors_go_through_saved_tensors_hooks():
    x, w, b = _x_w_b()
    f = lambda x, w, b: jnp.sum(LinearFn.apply(x, w, b))  # reduce_sum saves nothing
    g, log = _packs_and_unpacks(f, x, w, b, argnums=(0, 1, 2))
    assert_trees_close(g, jax.grad(lambda x, w, b: jnp.sum(_linear(x, w, b)), (0, 1, 2))(x, w, b))
    assert sorted(log) == sorted(
        [("pack", x.shape), ("pack", w.shape), ("unpack", x.shape), ("unpack", w.shape)]
    )


def test_saved_none_is_not_a_residual():
    x, w, _ = _x_w_b()
    f = lambda x, w: jnp.sum(CustomLinear.apply(x, w))  # saves (x, w, None)
    _, log = _packs_and_unpacks(f, x, w, argnums=(0, 1))
    assert [k for k, _ in log].count("pack") == 2 and [k for k, _ in log].count("unpack") == 2


def test_compress_policy_applies_to_function_residuals():
    x, w, b = _x_w_b()
    f = lambda w: jnp.sum(LinearFn.apply(x, w, b) ** 2)
    exact = tg.grad(f)(w)
    got = tg.grad(f, policy=P.compress(jnp.bfloat16))(w)
    rel = float(jnp.linalg.norm(got - exact) / jnp.linalg.norm(exact))
    assert 0 < rel < 2e-2  # the saved x was really stored in bfloat16


def test_route_policy_can_pick_residuals_by_function_name():
    x, w, b = _x_w_b()
    seen = []

    def by_name(info):
        if info.primitive == "custom_vjp_call":
            seen.append((custom_vjp_name(info.record.params), info.shape))
        return P.save()

    f = lambda w: jnp.sum(jnp.sin(LinearFn.apply(x, w, b)))
    assert_trees_close(
        tg.grad(f, policy=P.route(by_name))(w),
        jax.grad(lambda w: jnp.sum(jnp.sin(_linear(x, w, b))))(w),
    )
    # route asks by_name when each residual is packed and again when it is unpacked
    assert sorted(seen) == sorted(2 * [("LinearFn", x.shape), ("LinearFn", w.shape)])


def test_tape_shows_one_named_record_with_the_saved_tensors():
    x, w, b = _x_w_b()
    tape = tg.trace(lambda x, w, b: jnp.sum(LinearFn.apply(x, w, b)))(x, w, b)
    recs = [r for r in tape.records if r.primitive == "custom_vjp_call"]
    assert len(recs) == 1
    rec = recs[0]
    assert custom_vjp_name(rec.params) == "LinearFn"
    assert [(s.kind, s.shape) for s in rec.saves] == [("aux", x.shape), ("aux", w.shape)]
    assert "test_function.py" in rec.source  # the user's apply line, not tapegrad's
    assert "name=LinearFn" in str(jax.make_jaxpr(LinearFn.apply)(x, w, b))


def test_memory_report_lists_the_function_residuals():
    x, w, b = _x_w_b()
    rep = tg.memory_report(lambda x, w, b: jnp.sum(LinearFn.apply(x, w, b)), argnums=(0, 1, 2))(
        x, w, b
    )
    rows = [r for r in rep.records if r.primitive == "LinearFn"]  # shown by the Function's name
    assert len(rows) == 1
    assert rows[0].bytes == x.nbytes + w.nbytes
    assert "test_function.py" in rows[0].source
    rec = rep.tape.records[rows[0].index]
    assert custom_vjp_name(rec.params) == "LinearFn"


# ---------------------------------------------------------------------------
# Gradient shape/dtype handling


class BiasAsFullGrad(tg.Function):
    """Returns the bias gradient un-reduced, (4, 5) for a (5,) bias: summed down,
    as in PyTorch; and a float64-free weak-typed scalar for the scale."""

    @staticmethod
    def forward(x, b, s):
        return (x + b) * s

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, b, s = inputs
        ctx.save_for_backward(x, b, s)

    @staticmethod
    def backward(ctx, g):
        x, b, s = ctx.saved_tensors
        return g * s, g * s, g * (x + b)


@pytest.mark.parametrize("grad", [tg.grad, jax.grad], ids=["tg.grad", "jax.grad"])
def test_broadcastable_gradients_are_summed_to_the_input_shape(grad):
    x, b, s = rand((4, 5), seed=14), rand((5,), seed=15), jnp.float32(1.5)
    f = lambda fn: lambda x, b, s: jnp.sum(jnp.sin(fn(x, b, s)))
    got = grad(f(BiasAsFullGrad.apply), (0, 1, 2))(x, b, s)
    assert_trees_close(got, jax.grad(f(lambda x, b, s: (x + b) * s), (0, 1, 2))(x, b, s))


# ---------------------------------------------------------------------------
# Misuse: clear errors


def _bad(backward, forward=None):
    class Bad(tg.Function):
        @staticmethod
        def forward(ctx, x, w, scale=2.0):
            ctx.save_for_backward(x, w)
            return x * w * scale

    Bad.backward = staticmethod(backward)
    if forward is not None:
        Bad.forward = staticmethod(forward)
    return Bad


@pytest.mark.parametrize("grad", [tg.grad, jax.grad], ids=["tg.grad", "jax.grad"])
def test_wrong_number_of_gradients_raises_naming_the_function(grad):
    Bad = _bad(lambda ctx, g: (g, g))  # 2 gradients for 3 inputs
    x = rand((3,))
    with pytest.raises(
        TypeError,
        match=r"Bad\.backward returned 2 gradient\(s\), but Bad\.forward "
        r"takes 3 input\(s\) \(x, w, scale\)",
    ):
        grad(lambda x: jnp.sum(Bad.apply(x, x)))(x)


def test_trailing_none_gradients_are_allowed():
    Bad = _bad(
        lambda ctx, g: (
            g * ctx.saved_tensors[1] * 2.0,
            g * ctx.saved_tensors[0] * 2.0,
            None,
            None,
            None,
        )
    )
    x, w = rand((3,), seed=1), rand((3,), seed=2)
    assert_trees_close(tg.grad(lambda x: jnp.sum(Bad.apply(x, w)))(x), w * 2.0)


@pytest.mark.parametrize("grad", [tg.grad, jax.grad], ids=["tg.grad", "jax.grad"])
def test_wrong_gradient_shape_raises_with_both_shapes(grad):
    Bad = _bad(lambda ctx, g: (g[:2], g, None))
    x = rand((3,))
    with pytest.raises(
        ValueError,
        match=r"Bad\.backward returned a gradient of shape \(2,\) for "
        r"input 0 \('x'\) of shape \(3,\)",
    ):
        grad(lambda x: jnp.sum(Bad.apply(x, x)))(x)


def test_gradient_for_a_static_input_raises():
    Bad = _bad(lambda ctx, g: (g, g, 1.0))
    with pytest.raises(
        TypeError,
        match=r"gradient for input 2 \('scale'\), which is not an array "
        r"\(a float\); return None",
    ):
        tg.grad(lambda x: jnp.sum(Bad.apply(x, x)))(rand((3,)))


def test_wrong_gradient_structure_for_a_pytree_input_raises():
    class BadTree(tg.Function):
        @staticmethod
        def forward(ctx, p):
            return p["a"] * p["b"]

        @staticmethod
        def backward(ctx, g):
            return ({"a": g},)  # missing "b"

    p = {"a": rand((2,)), "b": rand((2,))}
    with pytest.raises(
        TypeError,
        match=r"BadTree\.backward returned a gradient for input 0 \('p'\) "
        "with structure",
    ):
        tg.grad(lambda p: jnp.sum(BadTree.apply(p)))(p)


def test_instantiating_a_function_raises_and_points_to_apply():
    with pytest.raises(TypeError, match=r"call LinearFn\.apply\(\.\.\.\)"):
        LinearFn()


def test_calling_forward_directly_runs_plain_forward_without_the_custom_backward():
    # Not an error (as in PyTorch): forward is an ordinary function. It is not
    # recorded as a Function, so differentiating it uses jax's own derivative.
    x = jnp.array([0.2, 1.7])
    assert_trees_close(RoundSTE.forward(x), jnp.round(x))
    assert_trees_close(tg.grad(lambda x: jnp.sum(RoundSTE.forward(x)))(x), jnp.zeros(2))
    assert_trees_close(tg.grad(lambda x: jnp.sum(RoundSTE.apply(x)))(x), jnp.ones(2))


def test_missing_backward_or_forward_raises():
    class NoBackward(tg.Function):
        @staticmethod
        def forward(ctx, x):
            return x

    class NoForward(tg.Function):
        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(
        NotImplementedError, match="NoBackward must define a static method backward"
    ):
        NoBackward.apply(jnp.ones(2))
    with pytest.raises(NotImplementedError, match="NoForward must define a static method forward"):
        NoForward.apply(jnp.ones(2))


def test_new_style_forward_without_setup_context_gets_a_hint():
    class Forgot(tg.Function):
        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    with pytest.raises(
        TypeError, match=r"Forgot has no setup_context, so its forward is old-style"
    ):
        Forgot.apply(jnp.ones(2))


@pytest.mark.parametrize("grad", [tg.grad, jax.grad], ids=["tg.grad", "jax.grad"])
def test_storing_an_array_on_ctx_raises(grad):
    class Stash(tg.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.x = x  # should be ctx.save_for_backward(x)
            return jnp.sin(x)

        @staticmethod
        def backward(ctx, g):
            return g * jnp.cos(ctx.x)

    with pytest.raises(TypeError, match=r"Stash: ctx\.x holds a jax array.*save_for_backward"):
        grad(lambda x: jnp.sum(Stash.apply(x)))(rand((2,)))


def test_save_for_backward_rejects_non_arrays():
    class SaveFloat(tg.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x, 2.0)
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(
        TypeError,
        match=r"SaveFloat: ctx\.save_for_backward accepts arrays or None, "
        r"but argument 1 is a float",
    ):
        tg.grad(lambda x: jnp.sum(SaveFloat.apply(x)))(rand((2,)))


def test_mark_non_differentiable_of_a_non_output_raises():
    class MarkInput(tg.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_non_differentiable(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    with pytest.raises(
        ValueError,
        match=r"MarkInput: ctx\.mark_non_differentiable got a value that "
        "is not an output",
    ):
        tg.grad(lambda x: jnp.sum(MarkInput.apply(x)))(rand((2,)))


def test_saved_tensors_in_forward_and_mark_dirty_raise():
    class Early(tg.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return ctx.saved_tensors[0]

        @staticmethod
        def backward(ctx, g):
            return g

    class Dirty(tg.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_dirty(x)
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(
        RuntimeError, match=r"Early: ctx\.saved_tensors is available in backward only"
    ):
        Early.apply(jnp.ones(2))
    with pytest.raises(TypeError, match=r"Dirty: ctx\.mark_dirty has no meaning in jax"):
        Dirty.apply(jnp.ones(2))


def test_argument_mixing_arrays_and_python_values_raises():
    with pytest.raises(
        TypeError,
        match=r"LinearFn\.apply: argument 0 \('x'\) mixes arrays and "
        "non-array values",
    ):
        LinearFn.apply((jnp.ones((2, 3)), 1.0), jnp.ones((5, 3)))


def test_memory_report_names_the_function():
    class Sq(tg.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    rep = tg.memory_report(lambda x: jnp.sum(Sq.apply(jnp.sin(x))))(jnp.ones(4))
    # the value Sq keeps is sin's output, charged to sin (its producer) and named for Sq
    assert any(r.primitive == "sin" and "out0→#Sq" in r.saves for r in rep.records)
    assert rep.peak_beyond_inputs_bytes == 16
    assert "name=Sq" in str(tg.trace(lambda x: jnp.sum(Sq.apply(x)))(jnp.ones(4)))


# ---------------------------------------------------------------------------
# once_differentiable: a double backward through the incoming cotangent (issue 13)


class OnceRoundSTE(tg.Function):
    """Straight-through rounding: the forward's own derivative (jnp.round's) is 0, so
    only the Function's rule connects the cotangent of its backward to the input."""

    @staticmethod
    def forward(ctx, x):
        return jnp.round(x)

    @staticmethod
    @tg.once_differentiable
    def backward(ctx, g):
        return g


_ORDERS = [(tg.grad, tg.grad), (jax.grad, tg.grad), (tg.grad, jax.grad), (jax.grad, jax.grad)]


@pytest.mark.parametrize("outer,inner", _ORDERS, ids=["tg-tg", "jax-tg", "tg-jax", "jax-jax"])
def test_once_differentiable_raises_when_the_cotangent_is_differentiated(outer, inner):
    # PyTorch raises here; the second derivative used to come back as 0.0.
    f = lambda x: OnceRoundSTE.apply(x) ** 2
    with pytest.raises(tg.NonDifferentiableError) as info:
        outer(inner(f))(jnp.float32(1.3))
    msg = str(info.value)
    assert "OnceRoundSTE.backward" in msg and "@tg.once_differentiable" in msg
    assert "Remove @once_differentiable" in msg


@pytest.mark.parametrize("grad", [tg.grad, jax.grad], ids=["tg.grad", "jax.grad"])
def test_once_differentiable_first_order_straight_through(grad):
    # d/dx sum(round(x)**2 * w) with the straight-through rule: 2 * round(x) * w.
    x = jnp.array([1.3, -0.6, 2.5, 0.2])
    w = jnp.array([1.0, 2.0, 3.0, 4.0])
    got = grad(lambda x: jnp.sum(OnceRoundSTE.apply(x) ** 2 * w))(x)
    np.testing.assert_allclose(got, [2.0, -4.0, 12.0, 0.0])
    got = jax.jit(grad(lambda x: jnp.sum(OnceRoundSTE.apply(x) * w)))(x)
    np.testing.assert_allclose(got, w)


def test_once_differentiable_value_of_inner_grad_differentiated_only_through_forward():
    # The outer gradient reads the inner value, not the inner gradient: no backward of
    # RoundSTE is differentiated, so nothing raises, and round's own derivative (0) is used.
    def value(x):
        v, _ = tg.value_and_grad(lambda x: jnp.sum(OnceRoundSTE.apply(x) * x))(x)
        return v

    x = jnp.array([1.3, -0.6])
    np.testing.assert_allclose(tg.grad(value)(x), jnp.round(x))
    np.testing.assert_allclose(jax.grad(value)(x), jnp.round(x))
