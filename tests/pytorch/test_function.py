"""PyTorch's own contracts for ``torch.autograd.Function``, ported to `tg.Function`.

Each test follows one test of PyTorch's ``test/test_autograd.py`` (class TestAutograd),
named in its docstring. Every test asserts against an oracle that needs no torch
(`jax.grad`, float64 finite differences, hand-derived numbers), eagerly and under
`jax.jit`; where torch is installed, some also compare with torch itself. Where
tapegrad differs by design, the test pins tapegrad's behaviour and
docs/from_pytorch.md ("Function and checkpoint: what differs by design") names it.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapegrad as tg

EAGER_AND_JIT = [pytest.param(lambda f: f, id="eager"), pytest.param(jax.jit, id="jit")]
GRADS = [pytest.param(tg.grad, id="tg.grad"), pytest.param(jax.grad, id="jax.grad")]


def _xy(shape=(5, 5), seed=0):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, shape), jax.random.normal(ky, shape)


def _close(a, b, rtol=1e-5, atol=1e-6):
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------
# test_hook_none: forward runs once, with the right needs_input_grad


class NoneGradientFunction(tg.Function):
    calls: list = []

    @staticmethod
    def forward(ctx, x, y):
        NoneGradientFunction.calls.append(ctx.needs_input_grad)
        assert ctx.needs_input_grad[0]
        assert not ctx.needs_input_grad[1]
        return x, y

    @staticmethod
    def backward(ctx, grad_x, grad_y):
        return grad_x, None


@pytest.mark.parametrize("wrap", EAGER_AND_JIT)
@pytest.mark.parametrize("grad", GRADS)
def test_hook_none_forward_runs_once_with_needs_input_grad(grad, wrap):
    """TestAutograd.test_hook_none: forward asserts needs_input_grad == (True, False),
    and runs once per differentiated call (tg.grad used to run it twice, first with
    (False, False))."""
    x, y = _xy()

    def loss(x, y):
        rx, ry = NoneGradientFunction.apply(x, y)
        return jnp.sum(rx + ry)

    NoneGradientFunction.calls.clear()
    g = wrap(grad(loss))(x, y)
    assert NoneGradientFunction.calls == [(True, False)]
    np.testing.assert_allclose(g, jnp.ones_like(x))  # d sum(x + y) / dx


def test_hook_none_once_per_call_of_tg_vjp_and_value_and_grad():
    """TestAutograd.test_hook_none, through tg.vjp (every input differentiated) and
    tg.value_and_grad: one forward per call."""
    calls = []

    class Mul(tg.Function):
        @staticmethod
        def forward(ctx, x, y):
            calls.append(ctx.needs_input_grad)
            ctx.save_for_backward(x, y)
            return x * y

        @staticmethod
        def backward(ctx, g):
            x, y = ctx.saved_tensors
            return g * y, g * x

    x, y = _xy((3,))
    out, vjp_fn = tg.vjp(lambda x, y: Mul.apply(x, y), x, y)
    assert calls == [(True, True)]
    _close(vjp_fn(jnp.ones(3)), (y, x))
    calls.clear()
    v, g = tg.value_and_grad(lambda x, y: jnp.sum(Mul.apply(x, y)), argnums=1)(x, y)
    assert calls == [(False, True)]
    _close((v, g), (jnp.sum(x * y), x))


def test_hook_none_needs_input_grad_is_forward_activity():
    """TestAutograd.test_hook_none: needs_input_grad[i] is requires_grad of input i. An
    input computed from the differentiated argument needs a gradient, one computed only
    from constants (or cut by stop_gradient) does not; forward still runs once."""
    calls = []

    class Pair(tg.Function):
        @staticmethod
        def forward(ctx, a, b, c):
            calls.append(ctx.needs_input_grad)
            return a + b + c

        @staticmethod
        def backward(ctx, g):
            return g, g, g

    x, y = _xy((3,))

    def loss(x):
        return jnp.sum(Pair.apply(jnp.sin(x) * 2.0, jnp.cos(y), jax.lax.stop_gradient(x)))

    want = jax.grad(loss)(x)
    for wrap in (lambda f: f, jax.jit):
        calls.clear()
        _close(wrap(tg.grad(loss))(x), want)
        assert calls == [(True, False, False)]


def test_hook_none_vmap_and_second_order():
    """TestAutograd.test_hook_none under jax.vmap of tg.grad, and tg.grad of tg.grad
    (the backward written with jax ops, so it differentiates again): forward once,
    gradients equal jax.grad's."""
    calls = []

    class Sin(tg.Function):
        @staticmethod
        def forward(ctx, x):
            calls.append(ctx.needs_input_grad)
            ctx.save_for_backward(x)
            return jnp.sin(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * jnp.cos(x)

    x = jnp.linspace(-1.0, 1.0, 4)
    f = lambda x: jnp.sum(Sin.apply(x))  # noqa: E731
    ref = lambda x: jnp.sum(jnp.sin(x))  # noqa: E731
    _close(
        jax.vmap(tg.grad(f))(jnp.stack([x, 2 * x])), jax.vmap(jax.grad(ref))(jnp.stack([x, 2 * x]))
    )
    assert calls == [(True,)]
    calls.clear()
    second = tg.grad(lambda x: jnp.sum(tg.grad(f)(x)))(x)
    _close(second, -jnp.sin(x))
    assert calls == [(True,)]


# ---------------------------------------------------------------------------
# test_function, test_once_differentiable (PyTorch's _function_test)


class MyFunction(tg.Function):
    @staticmethod
    def forward(ctx, tensor1, pyscalar, tensor2):
        ctx.pyscalar = pyscalar
        ctx.save_for_backward(tensor1, tensor2)
        return tensor1 + pyscalar * tensor2 + tensor1 * tensor2

    @staticmethod
    def backward(ctx, grad_output):
        var1, var2 = ctx.saved_tensors
        assert isinstance(var1, jax.Array) and isinstance(var2, jax.Array)
        return (
            grad_output + grad_output * var2,
            None,
            grad_output * ctx.pyscalar + grad_output * var1,
        )


class MyOnceFunction(MyFunction):
    @staticmethod
    @tg.once_differentiable
    def backward(ctx, grad_output):
        t1, t2 = ctx.saved_tensors
        return (grad_output + grad_output * t2, None, grad_output * ctx.pyscalar + grad_output * t1)


@pytest.mark.parametrize("wrap", EAGER_AND_JIT)
@pytest.mark.parametrize("cls", [MyFunction, MyOnceFunction], ids=["function", "once"])
def test_function(cls, wrap):
    """TestAutograd.test_function and test_once_differentiable (_function_test):
    x.grad == y + 1, y.grad == x + 2 for ``x + 2 * y + x * y``."""
    x, y = _xy()
    gx, gy = wrap(tg.grad(lambda x, y: jnp.sum(cls.apply(x, 2, y)), (0, 1)))(x, y)
    _close(gx, y + 1)
    _close(gy, x + 2)


def test_function_double_backward():
    """TestAutograd.test_function: x.grad has a grad_fn (create_graph=True); here the
    gradient differentiates again: d/dy sum(dL/dx) = d/dy sum(1 + y) = 1."""
    x, y = _xy()
    dx = lambda x, y: tg.grad(lambda x, y: jnp.sum(MyFunction.apply(x, 2, y)))(x, y)  # noqa: E731
    _close(tg.grad(lambda x, y: jnp.sum(dx(x, y)), 1)(x, y), jnp.ones_like(y))
    _close(jax.jit(tg.grad(lambda x, y: jnp.sum(dx(x, y)), 1))(x, y), jnp.ones_like(y))


def test_once_differentiable_double_backward_raises():
    """TestAutograd.test_once_differentiable: the gradient of a once_differentiable
    backward cannot be differentiated; PyTorch raises RuntimeError ("trying to
    differentiate twice a function that was marked with @once_differentiable")."""
    x, y = _xy()
    dx = lambda x, y: tg.grad(lambda x, y: jnp.sum(MyOnceFunction.apply(x, 2, y)))(x, y)  # noqa: E731
    for outer in (tg.grad, jax.grad):
        with pytest.raises(RuntimeError, match="differentiate twice a function that was marked"):
            outer(lambda x, y: jnp.sum(dx(x, y)), 1)(x, y)
    with pytest.raises(tg.NonDifferentiableError):
        tg.grad(lambda x, y: jnp.sum(dx(x, y)), 1)(x, y)


def test_function_matches_torch():
    """TestAutograd.test_function, the same numbers from torch itself (skipped without
    torch)."""
    torch = pytest.importorskip("torch")

    class TorchFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t1, s, t2):
            ctx.s = s
            ctx.save_for_backward(t1, t2)
            return t1 + s * t2 + t1 * t2

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            return g + g * b, None, g * ctx.s + g * a

    x, y = (np.asarray(v, np.float64) for v in _xy())
    tx = torch.tensor(x, requires_grad=True)
    ty = torch.tensor(y, requires_grad=True)
    TorchFn.apply(tx, 2, ty).sum().backward()
    gx, gy = tg.grad(lambda x, y: jnp.sum(MyFunction.apply(x, 2, y)), (0, 1))(
        jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
    )
    _close(gx, tx.grad.numpy(), rtol=1e-5, atol=1e-5)
    _close(gy, ty.grad.numpy(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# test_custom_function_non_tensor_inputs_outputs, test_custom_function_no_tensors


class NonTensorFunction(tg.Function):
    seen: list = []

    @staticmethod
    def forward(ctx, t1, t2, scale, t3):
        t4 = (t1 + t2 * t3) * scale
        t5 = (t1 * t2 + t3) * scale
        ctx.scale = scale
        ctx.save_for_backward(t1, t2, t3)
        return scale, t4, None, True, t5, "bar", t1

    @staticmethod
    @tg.once_differentiable
    def backward(ctx, *grads):
        NonTensorFunction.seen.append(len(grads))
        assert len(grads) == 7
        assert grads[0] is None and grads[2] is None and grads[3] is None and grads[5] is None
        scale = ctx.scale
        var1, var2, var3 = ctx.saved_tensors
        return (
            grads[1] * scale + grads[4] * var2 * scale + grads[6],
            grads[1] * var3 * scale + grads[4] * var1 * scale,
            None,
            grads[1] * var2 * scale + grads[4] * scale,
        )


def _non_tensor_loss(apply):
    def loss(t1, t2, t3):
        res = apply(t1, t2, 3, t3)
        assert res[0] == 3 and type(res[0]) is int
        assert res[2] is None and res[3] is True and res[5] == "bar"
        return jnp.sum(res[1]) + jnp.sum(res[4]) + jnp.sum(res[6])

    return loss


def _plain(t1, t2, scale, t3):
    return scale, (t1 + t2 * t3) * scale, None, True, (t1 * t2 + t3) * scale, "bar", t1


def _uniform3(n=10):
    return tuple(jax.random.uniform(jax.random.key(i), (n,)) for i in range(3))


def test_custom_function_non_tensor_inputs_outputs_pass_through():
    """TestAutograd.test_custom_function_non_tensor_inputs_outputs: the values forward
    returns come back untouched: an int, None, True, "bar", and arrays."""
    t1, t2, t3 = _uniform3()
    res = NonTensorFunction.apply(t1, t2, 3, t3)
    assert res[0] == 3 and type(res[0]) is int
    assert res[2] is None and res[3] is True and res[5] == "bar"
    _close(res[1], (t1 + t2 * t3) * 3)
    _close(res[4], (t1 * t2 + t3) * 3)
    _close(res[6], t1)


@pytest.mark.parametrize("wrap", EAGER_AND_JIT)
@pytest.mark.parametrize("grad", GRADS)
def test_custom_function_non_tensor_inputs_outputs_grads(grad, wrap):
    """TestAutograd.test_custom_function_non_tensor_inputs_outputs: backward receives 7
    cotangents (None for the non-array outputs); t1, t2 and t3's gradients equal
    jax.grad of the same computation without a Function."""
    t1, t2, t3 = _uniform3()
    NonTensorFunction.seen.clear()
    got = wrap(grad(_non_tensor_loss(NonTensorFunction.apply), (0, 1, 2)))(t1, t2, t3)
    _close(got, jax.grad(_non_tensor_loss(_plain), (0, 1, 2))(t1, t2, t3))
    assert NonTensorFunction.seen == [7]


def test_custom_function_non_tensor_inputs_outputs_vmap():
    """TestAutograd.test_custom_function_non_tensor_inputs_outputs under jax.vmap."""
    t1, t2, t3 = (jnp.stack([t, 2 * t]) for t in _uniform3())
    g = jax.vmap(tg.grad(_non_tensor_loss(NonTensorFunction.apply), (0, 1)))(t1, t2, t3)
    _close(g, jax.vmap(jax.grad(_non_tensor_loss(_plain), (0, 1)))(t1, t2, t3))


def test_custom_function_non_tensor_inputs_outputs_gradcheck(x64):
    """TestAutograd.test_custom_function_non_tensor_inputs_outputs: gradcheck of the
    array outputs (float64 finite differences)."""
    t1, t2, t3 = (np.asarray(t, np.float64) for t in _uniform3(4))

    def foo(t1, t2, t3):
        res = NonTensorFunction.apply(t1, t2, 3, t3)
        return res[1], res[4], res[6]

    assert tg.gradcheck(foo, (t1, t2, t3))


def test_grad_wrt_a_non_array_argument_raises_type_error_like_jax():
    """TestAutograd.test_custom_function_non_tensor_inputs_outputs: in PyTorch a
    non-tensor input simply gets no grad. In jax a transform differentiated w.r.t. a
    string raises TypeError; tg.grad does the same."""
    t1, t2, t3 = _uniform3()

    def f(t1, s):
        return jnp.sum(NonTensorFunction.apply(t1, t2, 3, t3)[1])

    with pytest.raises(TypeError, match="not a valid JAX type"):
        tg.grad(f, 1)(t1, "bar")
    with pytest.raises(TypeError):
        jax.grad(f, 1)(t1, "bar")
    _close(tg.grad(f)(t1, "bar"), jax.grad(f)(t1, "bar"))  # a string elsewhere is fine


class NoTensors(tg.Function):
    @staticmethod
    def forward(ctx, t1, t2, scale, t3):
        t4 = (t1 + t2 * t3) * scale
        t5 = (t1 * t2 + t3) * scale
        return scale, t4, None, True, t5, "bar", t1

    @staticmethod
    @tg.once_differentiable
    def backward(ctx, *args):
        return (args[0], args[1], None, args[2])


def test_custom_function_no_tensors():
    """TestAutograd.test_custom_function_no_tensors: Python numbers in, Python numbers
    out; no custom_vjp, no array."""
    t1, t2, t3, scale = 0.25, 0.5, 0.75, 4
    res = NoTensors.apply(t1, t2, scale, t3)
    assert res == (scale, (t1 + t2 * t3) * scale, None, True, (t1 * t2 + t3) * scale, "bar", t1)
    assert type(res[1]) is float


def test_custom_function_no_tensors_under_jit():
    """TestAutograd.test_custom_function_no_tensors inside a jitted function: the
    Python values still pass through untouched while it traces."""

    @jax.jit
    def f(x):
        res = NoTensors.apply(0.25, 0.5, 4, 0.75)
        assert res[5] == "bar" and type(res[1]) is float
        return x * res[1]

    np.testing.assert_allclose(f(jnp.ones(2)), (0.25 + 0.5 * 0.75) * 4)


# ---------------------------------------------------------------------------
# materialize_grads, mark_non_differentiable, returns_input, too_many_grads, ...


class TwoOut(tg.Function):
    @staticmethod
    def forward(ctx, x, materialize):
        ctx.set_materialize_grads(materialize)
        return x * 2.0, x * 3.0

    @staticmethod
    def backward(ctx, g0, g1):
        TwoOut.seen = (g0, g1)
        return 2.0 * g0 + (0.0 if g1 is None else 3.0 * g1), None


def test_materialize_grads():
    """TestAutograd.test_materialize_grads: an output that got no gradient reaches
    backward as zeros."""
    x = jnp.arange(3.0)
    g = tg.grad(lambda x: jnp.sum(TwoOut.apply(x, True)[0]))(x)
    _close(g, 2.0 * jnp.ones(3))
    np.testing.assert_array_equal(TwoOut.seen[1], jnp.zeros(3))


@pytest.mark.parametrize("grad", GRADS)
def test_dont_materialize_grads(grad):
    """TestAutograd.test_dont_materialize_grads: with set_materialize_grads(False) it
    reaches backward as None."""
    x = jnp.arange(3.0)
    g = grad(lambda x: jnp.sum(TwoOut.apply(x, False)[0]))(x)
    _close(g, 2.0 * jnp.ones(3))
    assert TwoOut.seen[1] is None


@pytest.mark.parametrize("wrap", EAGER_AND_JIT)
def test_mark_non_differentiable(wrap):
    """TestAutograd.test_mark_non_differentiable: a mask marked non-differentiable;
    ``x`` masked with it differentiates to the mask's complement."""

    class Mask(tg.Function):
        @staticmethod
        def forward(ctx, x):
            output = x > 0
            ctx.mark_non_differentiable(output)
            return output

        @staticmethod
        def backward(ctx, grad_output):
            return jnp.zeros_like(grad_output, jnp.float32)

    x, _ = _xy()
    g = wrap(tg.grad(lambda x: jnp.sum(jnp.where(Mask.apply(x), 0.0, x))))(x)
    _close(g, jnp.where(x > 0, 0.0, 1.0))


@pytest.mark.parametrize("wrap", EAGER_AND_JIT)
@pytest.mark.parametrize("grad", GRADS)
def test_mark_non_differentiable_mixed(grad, wrap):
    """TestAutograd.test_mark_non_differentiable_mixed: grad_a is zero, grad_b one;
    x.grad is ones, even though the loss also uses the marked output."""

    class Mixed(tg.Function):
        @staticmethod
        def forward(ctx, x):
            a, b = x + 1, x + 2
            ctx.mark_non_differentiable(a)
            return a, b

        @staticmethod
        def backward(ctx, grad_a, grad_b):
            Mixed.seen = (grad_a, grad_b)
            return grad_b

    x, _ = _xy()

    def loss(x):
        a, b = Mixed.apply(x)
        return jnp.sum(b) + jnp.sum(a * 5.0)

    _close(wrap(grad(loss))(x), jnp.ones_like(x))


def test_mark_non_differentiable_none():
    """TestAutograd.test_mark_non_differentiable_none: backward returns None; ``r * x``
    still differentiates through ``x`` (r is a constant): the gradient is r = x * x."""

    class Clone(tg.Function):
        @staticmethod
        def forward(ctx, x):
            output = x + 0.0
            ctx.mark_non_differentiable(output)
            return output

        @staticmethod
        def backward(ctx, grad_output):
            return None

    x, _ = _xy()
    g = tg.grad(lambda x: jnp.sum(Clone.apply(x * x) * x))(x)
    _close(g, x * x)


@pytest.mark.parametrize("shape", [(1,), ()])
def test_function_returns_input(shape):
    """TestAutograd.test_function_returns_input: forward returns its input; backward
    doubles the gradient."""

    class Identity(tg.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    v = jnp.ones(shape)
    for wrap in (lambda f: f, jax.jit):
        np.testing.assert_allclose(wrap(tg.grad(lambda v: jnp.sum(Identity.apply(v))))(v), 2.0)


def test_function_returns_undefined_tensor():
    """TestAutograd.test_function_returns_undefined_tensor: backward returns None.
    PyTorch leaves x.grad undefined (None); a jax transform returns zeros, as jax.grad
    does for an unused input (a difference by design)."""

    class NoGrad(tg.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return None

    x = jnp.ones(1)
    for f in (lambda x: jnp.sum(NoGrad.apply(x)), lambda x: jnp.sum(NoGrad.apply(x**2))):
        np.testing.assert_array_equal(tg.grad(f)(x), jnp.zeros(1))
        np.testing.assert_array_equal(jax.grad(f)(x), jnp.zeros(1))


def test_too_many_grads():
    """TestAutograd.test_too_many_grads: extra trailing None gradients are allowed."""

    class MyFn(tg.Function):
        @staticmethod
        def forward(ctx, foo):
            return foo

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output, None, None

    x, _ = _xy()
    np.testing.assert_allclose(tg.grad(lambda x: jnp.sum(MyFn.apply(x)))(x), jnp.ones_like(x))


@pytest.mark.parametrize("grad", GRADS)
def test_return_duplicate(grad):
    """TestAutograd.test_return_duplicate: an output returned twice; ``a + b`` has the
    gradient 4 (PyTorch also asserts ``a is b``: under jax the two outputs are two
    arrays, a difference by design); gradgradcheck's second order too."""

    class DoubleDuplicate(tg.Function):
        @staticmethod
        def forward(ctx, x):
            output = x * 2
            return output, output

        @staticmethod
        def backward(ctx, grad1, grad2):
            return grad1 * 2 + grad2 * 2

    def fn(x):
        a, b = DoubleDuplicate.apply(x)
        return a + b

    x, _ = _xy((3,))
    np.testing.assert_allclose(grad(lambda x: jnp.sum(fn(x)))(x), 4.0 * jnp.ones(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert tg.gradcheck(fn, (np.asarray(x, np.float64),))
        assert tg.gradgradcheck(fn, (np.asarray(x, np.float64),))


def test_setup_context_when_forward_has_default_args():
    """TestAutograd.test_setup_context_when_forward_has_default_args: a new-style
    forward with a default argument, as staticmethods and as classmethods; the
    gradient of x**3 and x**8 at 2 is 12 and 1024."""

    class PowFunction(tg.Function):
        @staticmethod
        def forward(x, y=3):
            return jnp.power(x, y)

        @staticmethod
        def setup_context(ctx, inputs, output):
            x, y = inputs
            ctx.save_for_backward(x)
            ctx.y = y

        @staticmethod
        def backward(ctx, gO):
            (x,) = ctx.saved_tensors
            y = ctx.y
            return gO * y * jnp.power(x, y - 1), None

    class PowFunctionWithClassmethod(tg.Function):
        @classmethod
        def forward(cls, x, y=3):
            return jnp.power(x, y)

        @classmethod
        def setup_context(cls, ctx, inputs, output):
            x, y = inputs
            ctx.save_for_backward(x)
            ctx.y = y

        @classmethod
        def backward(cls, ctx, gO):
            (x,) = ctx.saved_tensors
            y = ctx.y
            return gO * y * jnp.power(x, y - 1), None

    x = jnp.asarray(2.0)
    for Fn in (PowFunction, PowFunctionWithClassmethod):
        np.testing.assert_allclose(tg.grad(Fn.apply)(x), 12.0)
        np.testing.assert_allclose(tg.grad(lambda x: Fn.apply(x, 8))(x), 1024.0)
        np.testing.assert_allclose(jax.jit(tg.grad(lambda x: Fn.apply(x, 8)))(x), 1024.0)


# ---------------------------------------------------------------------------
# Bad input: PyTorch's error classes and messages


def _bad(backward):
    class Bad(tg.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

    Bad.backward = staticmethod(backward)
    return Bad


@pytest.mark.parametrize("grad", GRADS)
def test_invalid_gradients(grad):
    """TestAutograd.test_invalid_gradients: a gradient of the wrong shape raises
    RuntimeError "expected shape" (tapegrad's is also a ValueError), naming the line."""
    Bad = _bad(lambda ctx, g: jnp.ones(10))
    x = jnp.ones((5, 5))
    with pytest.raises(RuntimeError, match=r"expected shape compatible with \[5, 5\]") as e:
        grad(lambda x: jnp.sum(Bad.apply(x)))(x)
    assert isinstance(e.value, (tg.FunctionGradShapeError, ValueError))
    assert "test_function.py" in str(e.value)


def test_incorrect_number_of_gradients_raises_runtime_error():
    """TestAutograd (incorrect number of gradients, test_custom_function_error family):
    PyTorch: RuntimeError "returned an incorrect number of gradients (expected 1, got
    2)"."""
    Bad = _bad(lambda ctx, g: (g, g))
    with pytest.raises(RuntimeError, match=r"incorrect number of gradients \(expected 1, got 2\)"):
        tg.grad(lambda x: jnp.sum(Bad.apply(x)))(jnp.ones(3))


def test_gradient_for_a_non_tensor_input_raises_runtime_error():
    """TestAutograd.test_custom_function_non_tensor_inputs_outputs' contract: a gradient
    for a non-array input: PyTorch raises RuntimeError "returned a gradient different
    than None at position 2, but the corresponding forward input was not a Variable"."""

    class Scale(tg.Function):
        @staticmethod
        def forward(ctx, x, s):
            return x * s

        @staticmethod
        def backward(ctx, g):
            return g, g

    with pytest.raises(RuntimeError, match="gradient different than None at position 2"):
        tg.grad(lambda x: jnp.sum(Scale.apply(x, 2.0)))(jnp.ones(3))


def test_non_array_gradient_raises_runtime_error():
    """TestAutograd (backward returning a str): PyTorch raises RuntimeError "expected
    Variable or None (got str)"."""
    Bad = _bad(lambda ctx, g: "a")
    with pytest.raises(RuntimeError, match=r"expected an array or None \(got str\)"):
        tg.grad(lambda x: jnp.sum(Bad.apply(x)))(jnp.ones(3))


def test_save_for_backward_of_a_non_array_raises_type_error():
    """TestAutograd (save_for_backward of a non-tensor): TypeError, as PyTorch's "can
    only save variables"."""

    class SaveStr(tg.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward("a")
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(TypeError, match="save_for_backward accepts arrays or None"):
        tg.grad(lambda x: jnp.sum(SaveStr.apply(x)))(jnp.ones(3))


def test_missing_forward_or_backward_raise_not_implemented():
    """TestAutograd (a Function without forward / backward): NotImplementedError."""

    class NoBackward(tg.Function):
        @staticmethod
        def forward(ctx, x):
            return x

    class NoForward(tg.Function):
        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(NotImplementedError):
        NoBackward.apply(jnp.ones(2))
    with pytest.raises(NotImplementedError):
        NoForward.apply(jnp.ones(2))


def test_forward_mode_is_refused():
    """TestAutograd's forward-AD Function tests (jvp, save_for_forward): PyTorch raises
    NotImplementedError without a jvp; a tg.Function is a custom_vjp, which jax cannot
    differentiate in forward mode (a difference by design)."""
    x = jnp.ones(3)
    with pytest.raises(TypeError):
        jax.jvp(lambda x: MyFunction.apply(x, 2, x), (x,), (x,))
