"""`tg.gradcheck` / `tg.gradgradcheck`: correct derivatives pass, wrong ones fail with the
input index, the element, and both values; float32 is refused with the reason; the x64
setting is restored."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapegrad as tg

RNG = np.random.default_rng(0)
X = RNG.standard_normal((3, 4))  # numpy float64: usable without enabling x64
W = RNG.standard_normal((5, 4))
B = RNG.standard_normal(5)


def linear(x, w, b):
    return jnp.tanh(x @ w.T + b)


@jax.custom_vjp
def wrong_sin(x):
    return jnp.sin(x)


wrong_sin.defvjp(
    lambda x: (jnp.sin(x), x),
    lambda x, g: (g * jnp.cos(x) * jnp.where(jnp.arange(x.size).reshape(x.shape) == 2, 1.1, 1.0),),
)  # 10% off at element 2


@jax.custom_vjp
def sin_first_order_only(x):
    return jnp.sin(x)


# Right first derivative, but stop_gradient hides its own derivative: wrong second order.
sin_first_order_only.defvjp(
    lambda x: (jnp.sin(x), x), lambda x, g: (g * jax.lax.stop_gradient(jnp.cos(x)),)
)


@pytest.fixture(autouse=True)
def x64_is_restored():
    before = bool(jax.config.jax_enable_x64)
    yield
    assert bool(jax.config.jax_enable_x64) == before


def test_correct_gradients_pass():
    assert tg.gradcheck(linear, (X, W, B))
    assert tg.gradcheck(lambda x: jnp.sum(jnp.sin(x) ** 2), X)  # a single array is (x,)
    assert tg.gradcheck(linear, (X, W, B), fast_mode=True)


def test_pytrees_multiple_outputs_and_integer_arguments():
    def f(p, x, n):
        h = jnp.tanh(x @ p["w"]) * n
        return {"h": h, "s": jnp.sum(h**2), "idx": jnp.argmax(h)}  # argmax: not checked

    p = {"w": RNG.standard_normal((4, 2))}
    assert tg.gradcheck(f, (p, X, 3))
    assert tg.gradcheck(f, (p, X, 3), fast_mode=True)


def test_wrong_gradient_names_input_element_and_values():
    x = np.linspace(0.1, 1.0, 4)
    with pytest.raises(tg.GradcheckError) as ei:
        tg.gradcheck(lambda a, x: a * wrong_sin(x), (2.0, x))
    err = ei.value
    assert isinstance(err, RuntimeError) and isinstance(err, tg.TapegradError)
    msg = str(err)
    assert "with respect to input 1 (args[1])" in msg
    assert "element (2,) of the input" in msg and "element (2,) of the output" in msg
    ana = 2.0 * np.cos(x[2]) * 1.1
    num = 2.0 * np.cos(x[2])
    assert f"analytical (tapegrad): {ana:.6f}"[:30] in msg
    assert "numerical" in msg and f"{num:.6f}"[:7] in msg
    assert "1 of 16 elements differ" in msg
    assert tg.gradcheck(lambda a, x: a * wrong_sin(x), (2.0, x), raise_exception=False) is False


def test_fast_mode_catches_a_wrong_gradient():
    x = np.linspace(0.1, 1.0, 4)
    with pytest.raises(
        tg.GradcheckError, match=r"fast_mode.*input 0 \(args\[0\]\).*fast_mode=False"
    ):
        tg.gradcheck(wrong_sin, (x,), fast_mode=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, jnp.bfloat16])
def test_low_precision_is_refused_with_the_reason(dtype):
    x = np.ones(3, dtype)
    with pytest.raises(tg.DtypeError) as ei:
        tg.gradcheck(jnp.sin, (x,))
    msg = str(ei.value)
    assert isinstance(ei.value, TypeError)
    assert "input 0" in msg and "float64" in msg and "machine_eps / eps" in msg
    assert "allow_low_precision=True" in msg
    assert tg.gradcheck(jnp.sin, (x,), allow_low_precision=True)  # cast to float64


def test_float32_jax_array_refused_and_x64_restored_after_failure():
    with pytest.raises(tg.DtypeError):
        tg.gradcheck(jnp.sin, (jnp.ones(3),))
    with pytest.raises(tg.GradcheckError):
        tg.gradcheck(wrong_sin, (np.linspace(0.1, 1.0, 4),))
    # (the autouse fixture checks jax_enable_x64 is unchanged)


def test_complex_and_integer_only_inputs_are_refused():
    with pytest.raises(tg.DtypeError, match="complex"):
        tg.gradcheck(lambda z: jnp.abs(z), (np.ones(2, np.complex128),))
    with pytest.raises(tg.DtypeError, match="no floating-point input"):
        tg.gradcheck(lambda n: n * 2, (np.arange(3),))


def test_policy_is_checked_too():
    assert tg.gradcheck(linear, (X, W, B), policy=tg.selective(lambda r: tg.CheckpointPolicy.NEVER))


def test_gradgradcheck():
    assert tg.gradgradcheck(lambda x: jnp.sum(jnp.sin(x) ** 2), (X[0],))
    assert tg.gradgradcheck(linear, (X[:1], W[:2], B[:2]))
    assert tg.gradcheck(sin_first_order_only, (X[0],))  # first order is right ...
    with pytest.raises(tg.GradcheckError, match="gradgradcheck: Jacobian mismatch"):
        tg.gradgradcheck(sin_first_order_only, (X[0],))  # ... the second is not
    assert tg.gradgradcheck(sin_first_order_only, (X[0],), raise_exception=False) is False
