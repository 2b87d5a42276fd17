"""PyTorch's own contracts for ``torch.utils.checkpoint`` (non-reentrant), ported to
`tg.checkpoint`, and its anomaly mode naming a Function.

Each test follows one test of PyTorch's ``test/test_utils.py`` (TestCheckpoint) or
``test/test_autograd.py`` (TestNestedCheckpoint, TestAutograd), named in its docstring.
The oracle is `jax.grad` of the same function without checkpointing (and torch where
installed), eagerly and under `jax.jit`.
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


def _close(a, b, rtol=1e-5, atol=1e-6):
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol)


def foo(t1, t2, scale, t3):
    t4 = (t1 + t2 * t3) * scale
    t5 = (t1 * t2 + t3) * scale
    return scale, t4, None, True, t5, "bar", t1


def _uniform3(n=10):
    return tuple(jax.random.uniform(jax.random.key(i), (n,)) for i in range(3))


def _loss(f):
    def loss(t1, t2, t3):
        res = f(t1, t2, 3, t3)
        assert res[0] == 3 and type(res[0]) is int
        assert res[2] is None and res[3] is True and res[5] == "bar"
        return jnp.sum(res[1]) + jnp.sum(res[4]) + jnp.sum(res[6])

    return loss


def test_checkpoint_non_tensor_inputs_outputs_pass_through():
    """TestCheckpoint.test_checkpoint_non_tensor_inputs_outputs: the int, None, True and
    "bar" come back untouched (jax.checkpoint rejects the string)."""
    t1, t2, t3 = _uniform3()
    res = tg.checkpoint(foo)(t1, t2, 3, t3)
    assert res[0] == 3 and type(res[0]) is int
    assert res[2] is None and res[3] is True and res[5] == "bar"
    _close(res[1], (t1 + t2 * t3) * 3)
    _close(res[4], (t1 * t2 + t3) * 3)
    _close(res[6], t1)


@pytest.mark.parametrize("wrap", EAGER_AND_JIT)
@pytest.mark.parametrize("grad", GRADS)
def test_checkpoint_non_tensor_inputs_outputs_grads(grad, wrap):
    """TestCheckpoint.test_checkpoint_non_tensor_inputs_outputs: the gradients equal
    those of the function run without checkpoint."""
    t1, t2, t3 = _uniform3()
    got = wrap(grad(_loss(tg.checkpoint(foo)), (0, 1, 2)))(t1, t2, t3)
    _close(got, jax.grad(_loss(foo), (0, 1, 2))(t1, t2, t3))


def test_checkpoint_non_tensor_inputs_outputs_matches_torch():
    """TestCheckpoint.test_checkpoint_non_tensor_inputs_outputs against torch's own
    checkpoint (skipped without torch)."""
    torch = pytest.importorskip("torch")
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    t1, t2, t3 = (np.asarray(t, np.float64) for t in _uniform3())
    a, b = (torch.tensor(t, requires_grad=True) for t in (t1, t2))
    res = torch_checkpoint(foo, a, b, 3, torch.tensor(t3), use_reentrant=False)
    torch.autograd.backward([res[1].sum(), res[4].sum(), res[6].sum()])
    got = tg.grad(_loss(tg.checkpoint(foo)), (0, 1))(
        *(jnp.asarray(t, jnp.float32) for t in (t1, t2, t3))
    )
    _close(got, (a.grad.numpy(), b.grad.numpy()), rtol=1e-5, atol=1e-5)


def test_checkpoint_no_tensors():
    """TestCheckpoint.test_checkpoint_no_tensors: Python numbers in and out."""
    t1, t2, t3, scale = 0.25, 0.5, 0.75, 4
    res = tg.checkpoint(foo)(t1, t2, scale, t3)
    assert res == (scale, (t1 + t2 * t3) * scale, None, True, (t1 * t2 + t3) * scale, "bar", t1)
    assert type(res[1]) is float


def _c(fn):
    def wrapped(*args, **kwargs):
        return tg.checkpoint(fn)(*args, **kwargs)

    return wrapped


def _fn(k, a, b, f):
    return f(k * a * jnp.exp(b)), 1


@pytest.mark.parametrize("wrap", EAGER_AND_JIT)
@pytest.mark.parametrize("grad", GRADS)
def test_nested_checkpoint_non_tensor_inputs_and_outputs(grad, wrap):
    """TestNestedCheckpoint.test_nested_checkpoint_non_tensor_inputs_and_outputs: a
    function argument (``torch.sin`` there, ``jnp.sin`` here) and an int result through
    three nested checkpoints; gradients equal the plain function's."""
    k, a, b = (jnp.asarray([v]) for v in (0.3, -0.5, 0.2))
    out, one = _c(_c(_c(_fn)))(k, a, b, jnp.sin)
    assert one == 1 and type(one) is int
    _close(out, _fn(k, a, b, jnp.sin)[0])
    got = wrap(grad(lambda k, a, b: jnp.sum(_c(_c(_c(_fn)))(k, a, b, jnp.sin)[0]), (0, 1, 2)))(
        k, a, b
    )
    _close(got, jax.grad(lambda k, a, b: jnp.sum(_fn(k, a, b, jnp.sin)[0]), (0, 1, 2))(k, a, b))


@pytest.mark.parametrize("nest", [1, 2, 3])
def test_nested_checkpoint_second_order(nest):
    """TestNestedCheckpoint.test_nested_checkpoint (its double-backward cases): the
    gradient of a gradient through nested checkpoints equals jax's, and finite
    differences in float64."""

    def f(x):
        return jnp.sin(jnp.exp(x) * x)

    g = f
    for _ in range(nest):
        g = _c(g)
    x = jnp.linspace(-1.0, 1.0, 3)
    second = tg.grad(lambda x: jnp.sum(tg.grad(lambda x: jnp.sum(g(x)))(x)))(x)
    _close(second, jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(f(x)))(x)))(x))


def test_checkpoint_static_argnums_and_kwargs():
    """TestCheckpoint.test_checkpoint_kwargs (non-reentrant checkpoint takes kwargs):
    a keyword array argument is differentiated, a keyword string passes through."""

    def block(x, *, w, act):
        assert act == "tanh"
        return jnp.tanh(x @ w)

    x = jnp.ones((2, 3))
    w = jnp.linspace(0.0, 1.0, 12).reshape(3, 4)
    loss = lambda w, f: jnp.sum(f(x, w=w, act="tanh") ** 2)  # noqa: E731
    _close(tg.grad(loss)(w, tg.checkpoint(block)), jax.grad(loss)(w, block))
    _close(
        tg.grad(lambda w: jnp.sum(tg.checkpoint(lambda x, n: x * n, static_argnums=1)(w, 3)))(w),
        3.0 * jnp.ones_like(w),
    )


def test_checkpoint_sequential():
    """TestCheckpoint.test_checkpoint_sequential: checkpoint_sequential over a chain of
    layers, for several segment counts, equals the unsegmented chain's gradient."""
    ws = [jnp.full((3, 3), 0.1 * (i + 1)) + jnp.eye(3) for i in range(4)]
    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)

    def loss(ws, segments):
        fs = [lambda h, w=w: jnp.tanh(h @ w) for w in ws]
        if segments is None:
            h = x
            for f in fs:
                h = f(h)
            return jnp.sum(h**2)
        return jnp.sum(tg.checkpoint_sequential(fs, segments, x) ** 2)

    want = jax.grad(loss)(ws, None)
    for segments in (1, 2, 4, "sqrt"):
        _close(tg.grad(loss)(ws, segments), want)


# ---------------------------------------------------------------------------
# Anomaly mode names the Function (TestAutograd.test_anomaly_detect_nan)


class MyFunc(tg.Function):
    @staticmethod
    def forward(ctx, inp):
        ctx.save_for_backward(inp)
        return inp * 2.0

    @staticmethod
    def backward(ctx, gO):
        (inp,) = ctx.saved_tensors
        # NaN from the saved value, as PyTorch's test returns gO * nan: a constant NaN
        # would let XLA fold the check's tie away under jit.
        return gO * jnp.sqrt(-inp)


def _nan_loss(x):
    return jnp.sum(MyFunc.apply(x))


def test_anomaly_detect_nan_names_the_function_eagerly():
    """TestAutograd.test_anomaly_detect_nan: PyTorch says "Function 'MyFuncBackward'
    returned nan values in its 0th output"; tapegrad names the Function and the line."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(tg.AnomalyError) as e:
            tg.grad(_nan_loss, anomaly=True)(jnp.ones(3))
    msg = str(e.value)
    assert "backward of Function 'MyFunc' (record #0) returned NaN values in its 0th output" in msg
    assert "MyFunc.backward" in msg and "test_checkpoint.py" in msg
    assert "custom_vjp_call" not in msg.splitlines()[0]


def test_anomaly_detect_nan_names_the_function_under_jit():
    """TestAutograd.test_anomaly_detect_nan under jax.jit: raised when the compiled call
    runs, with the same message."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises((RuntimeError, ValueError)) as e:
            jax.block_until_ready(jax.jit(tg.grad(_nan_loss, anomaly=True))(jnp.ones(3)))
    assert "backward of Function 'MyFunc' (record #0) returned NaN values" in str(e.value)


def test_anomaly_forward_nan_names_the_function():
    """TestAutograd.test_anomaly_detect_nan (forward side): a NaN output of the Function
    names it too."""

    class LogFn(tg.Function):
        @staticmethod
        def forward(ctx, x):
            return jnp.log(x)

        @staticmethod
        def backward(ctx, g):
            return g

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(tg.AnomalyError, match="NaN in the output of Function 'LogFn'"):
            tg.grad(lambda x: jnp.sum(LogFn.apply(x)), anomaly=True)(-jnp.ones(2))
