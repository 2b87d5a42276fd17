"""Control flow, checkpointing, custom derivatives and jax.nn edge cases vs jax.

Each function is differentiated by tapegrad and by jax.grad/jax.vjp; where
jax's answer at an edge is a convention (relu at 0, norm at 0, nan from an
unguarded sqrt) tapegrad must reproduce it, nan for nan.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_grads_match, assert_vjp_match, enable_x64, rand
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import tapegrad as tg

DTYPES = ["float32", "float64"]


@pytest.fixture(params=DTYPES)
def dtype(request):
    """Each test that takes ``dtype`` runs in float32 and in float64 (x64 on)."""
    with enable_x64(request.param == "float64"):
        yield request.param


# ---------------------------------------------------------------------------
# cond / switch


def test_cond(dtype):
    x = rand((4,), dtype, -1, 1, seed=1)
    w = rand((4,), dtype, -1, 1, seed=2)

    def f(x, w, flip):
        return jnp.sum(
            lax.cond(flip > 0, lambda a, b: jnp.sin(a) * b, lambda a, b: jnp.exp(a) + b * b, x, w)
        )

    for flip in (1.0, -1.0):
        assert_grads_match(f, x, w, jnp.asarray(flip, dtype), argnums=(0, 1))
    # Predicate computed from the differentiated input itself.
    g = lambda x: jnp.sum(lax.cond(jnp.sum(x) > 0, jnp.tanh, lambda z: z**3, x))
    assert_grads_match(g, x)
    assert_grads_match(g, -x)
    assert_vjp_match(
        lambda x, w: lax.cond(True, lambda: (x * w, jnp.sin(w)), lambda: (x, w)), x, w, seed=3
    )


def test_cond_with_pytree_operands_and_closure(dtype):
    p = {"a": rand((3,), dtype, -1, 1, seed=4), "b": (rand((), dtype, 0.5, 1, seed=5),)}
    c = rand((3,), dtype, -1, 1, seed=6)  # closed over: a constant of the branches

    def f(p, pred):
        out = lax.cond(
            pred, lambda q: {"y": q["a"] * q["b"][0] * c}, lambda q: {"y": jnp.cos(q["a"]) + c}, p
        )
        return jnp.sum(out["y"] ** 2)

    assert_grads_match(f, p, True)
    assert_grads_match(f, p, False)


@pytest.mark.parametrize("index", [0, 1, 2, 5, -1])
def test_switch(dtype, index):
    x = rand((2, 3), dtype, -1, 1, seed=7)
    branches = [jnp.sin, lambda z: z * z, lambda z: jnp.exp(z) * 0.5]
    f = lambda x, i: jnp.sum(lax.switch(i, branches, x))  # out-of-range indices are clamped
    assert_grads_match(f, x, index)
    assert_grads_match(f, x, jnp.asarray(index))


# ---------------------------------------------------------------------------
# scan / fori_loop / while_loop


def test_scan_pytree_carry_and_xs(dtype):
    xs = {"u": rand((5, 3), dtype, -1, 1, seed=8), "v": rand((5,), dtype, -1, 1, seed=9)}
    c0 = (rand((3,), dtype, -1, 1, seed=10), rand((), dtype, -1, 1, seed=11))
    w = rand((3, 3), dtype, -0.5, 0.5, seed=12)

    def f(c0, xs, w):
        def step(c, x):
            h, s = c
            h = jnp.tanh(h @ w + x["u"] * x["v"])
            s = s + jnp.sum(h) * x["v"]
            return (h, s), h * s

        (h, s), ys = lax.scan(step, c0, xs)
        return jnp.sum(ys) + s + jnp.sum(h**2)

    assert_grads_match(f, c0, xs, w, argnums=(0, 1, 2))


@pytest.mark.parametrize("reverse,unroll", [(False, 1), (True, 1), (False, 2), (True, 3)])
def test_scan_reverse_unroll(reverse, unroll):
    with enable_x64():
        xs = rand((6, 2), "float64", -1, 1, seed=13)
        f = lambda c, xs: jnp.sum(
            lax.scan(lambda c, x: (jnp.sin(c * x), c + x), c, xs, reverse=reverse, unroll=unroll)[1]
        )
        assert_grads_match(f, jnp.ones(2), xs, argnums=(0, 1))


def test_scan_without_xs():
    with enable_x64():
        f = lambda c: jnp.sum(
            lax.scan(lambda c, _: (c * 1.1 + jnp.sin(c), None), c, None, length=4)[0]
        )
        assert_grads_match(f, rand((3,), "float64", -1, 1, seed=14))


def test_fori_loop_static_bounds_is_scan(dtype):
    x = rand((3,), dtype, -1, 1, seed=15)
    f = lambda x: jnp.sum(lax.fori_loop(0, 4, lambda i, c: jnp.sin(c) * (i + 1.0), x))
    assert any(r.primitive == "scan" for r in tg.trace(f)(x).records)
    assert_grads_match(f, x)


def test_while_loop_forward_only(dtype):
    """A while_loop off the differentiated path is fine: value and grad match jax."""
    x = rand((3,), dtype, -1, 1, seed=16)
    y = rand((3,), dtype, 0.5, 1, seed=17)

    def f(x, y):
        z = lax.while_loop(lambda z: jnp.sum(z) < 20.0, lambda z: z * 2.0, y)
        n = lax.while_loop(lambda i: i < 5, lambda i: i + 1, 0)
        return jnp.sum(jnp.sin(x) * z) * n

    assert_grads_match(f, x, y, argnums=0)
    v, _ = tg.value_and_grad(f)(x, y)
    np.testing.assert_allclose(v, f(x, y), rtol=1e-6)


def _while_fun(x):
    return jnp.sum(lax.while_loop(lambda c: c[0] < 10.0, lambda c: c * 2.0, x + 2.0))


def _dynamic_fori_fun(x, n):
    # The bound is traced (it depends on x), so this is a while loop for jax too.
    n = n + (x[0] * 0).astype(jnp.int32)
    return jnp.sum(lax.fori_loop(0, n, lambda i, c: c * 1.5, x))


@pytest.mark.parametrize("how", ["grad", "value_and_grad", "vjp"])
def test_while_loop_differentiated_raises(how):
    x = jnp.ones(3)
    with pytest.raises(ValueError, match="while_loop"):  # jax refuses too
        jax.grad(_while_fun)(x)
    with pytest.raises(tg.NonDifferentiableError) as info:
        if how == "grad":
            tg.grad(_while_fun)(x)
        elif how == "value_and_grad":
            tg.value_and_grad(_while_fun)(x)
        else:
            tg.vjp(_while_fun, x)
    assert isinstance(info.value, TypeError)
    msg = str(info.value)
    assert "while_loop" in msg
    assert os.path.basename(__file__) in msg, msg  # points at the user's line


def test_fori_loop_dynamic_bounds_raises():
    with pytest.raises(ValueError, match="while_loop"):  # jax, when the bound is traced
        jax.jit(jax.grad(_dynamic_fori_fun))(jnp.ones(3), 4)
    with pytest.raises(tg.NonDifferentiableError) as info:
        tg.grad(_dynamic_fori_fun)(jnp.ones(3), 4)
    msg = str(info.value)
    assert "while_loop" in msg and os.path.basename(__file__) in msg, msg
    # Differentiating only something else is fine.
    f = lambda w, x, n: jnp.sum(w * _dynamic_fori_fun(x, n))
    assert_grads_match(f, jnp.arange(3.0), jnp.ones(3), 4)
    # A Python-int bound that is not differentiated is static for jax.grad, and
    # fori_loop then lowers to a scan: both differentiate it.
    g = lambda x, n: jnp.sum(lax.fori_loop(0, n, lambda i, c: jnp.sin(c) * 1.5, x))
    assert_grads_match(g, jnp.linspace(-1.0, 1.0, 3), 4)


# ---------------------------------------------------------------------------
# checkpoint / checkpoint_name


def test_checkpoint(dtype):
    x = rand((4,), dtype, -1, 1, seed=18)
    w = rand((4, 4), dtype, -1, 1, seed=19)
    body = jax.checkpoint(lambda x, w: jnp.sin(jnp.tanh(w @ x) * x))
    f = lambda x, w: jnp.sum(body(body(x, w), w) ** 2)
    assert_grads_match(f, x, w, argnums=(0, 1))
    assert_vjp_match(body, x, w, seed=20)


@pytest.mark.parametrize(
    "policy",
    [
        jax.checkpoint_policies.dots_saveable,
        jax.checkpoint_policies.nothing_saveable,
        jax.checkpoint_policies.everything_saveable,
        jax.checkpoint_policies.save_only_these_names("h"),
    ],
    ids=["dots_saveable", "nothing_saveable", "everything_saveable", "names"],
)
def test_checkpoint_policies(policy):
    with enable_x64():
        x = rand((3, 4), "float64", -1, 1, seed=21)
        w1 = rand((4, 5), "float64", -1, 1, seed=22)
        w2 = rand((5, 2), "float64", -1, 1, seed=23)

        @functools.partial(jax.checkpoint, policy=policy)
        def layer(x, w1, w2):
            h = checkpoint_name(jnp.tanh(x @ w1), "h")
            return jnp.sin(h @ w2)

        f = lambda x, w1, w2: jnp.sum(layer(x, w1, w2) ** 2)
        assert_grads_match(f, x, w1, w2, argnums=(0, 1, 2))


def test_checkpoint_static_argnums():
    with enable_x64():

        @functools.partial(jax.checkpoint, static_argnums=(1,))
        def f(x, n):
            for _ in range(n):
                x = jnp.sin(x) * 1.5
            return x

        assert_grads_match(lambda x: jnp.sum(f(x, 3)), rand((3,), "float64", -1, 1, seed=24))


def test_checkpoint_name(dtype):
    x = rand((3,), dtype, -1, 1, seed=25)
    f = lambda x: jnp.sum(jnp.sin(checkpoint_name(jnp.cos(x) * x, "mid")) ** 2)
    assert_grads_match(f, x)
    assert any(r.primitive == "name" for r in tg.trace(f)(x).records)


# ---------------------------------------------------------------------------
# custom_jvp


@jax.custom_jvp
def odd_sin(x):
    return jnp.sin(x)


@odd_sin.defjvp
def _odd_sin_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    # Deliberately not the derivative of sin: 3 cos(x) + 1.
    return jnp.sin(x), (3.0 * jnp.cos(x) + 1.0) * t


@jax.custom_jvp
def two_in(x, y):
    return x * y


two_in.defjvps(
    lambda t, ans, x, y: t * 10.0 * y,  # not d(xy)/dx = y
    lambda t, ans, x, y: t * jnp.cos(x),
)


def test_custom_jvp_uses_the_custom_rule(dtype):
    x = rand((4,), dtype, -1, 1, seed=26)
    f = lambda x: jnp.sum(odd_sin(x) * x)
    g = assert_grads_match(f, x)
    # Differentiating the primal would give cos(x) * x + sin(x): check we did not.
    honest = jax.grad(lambda x: jnp.sum(jnp.sin(x) * x))(x)
    assert not np.allclose(g, honest)
    np.testing.assert_allclose(g, (3 * np.cos(x) + 1) * x + np.sin(x), rtol=1e-5)
    # The rule is linearized at trace time (rules/custom_jvp.py), not re-run in backward.
    rec = [r for r in tg.trace(f)(x).records if r.primitive == "custom_jvp_rule"]
    assert rec and rec[0].rule == "linearized"


def test_custom_jvp_two_inputs(dtype):
    x = rand((3,), dtype, -1, 1, seed=27)
    y = rand((3,), dtype, -1, 1, seed=28)
    f = lambda x, y: jnp.sum(two_in(x, y) ** 2)
    assert_grads_match(f, x, y, argnums=(0, 1))
    assert_grads_match(f, x, y, argnums=1)
    assert_vjp_match(two_in, x, y, seed=29)


def test_custom_jvp_under_jit_and_vmap():
    with enable_x64():
        x = rand((2, 3), "float64", -1, 1, seed=30)
        f = lambda x: jnp.sum(jax.vmap(jax.jit(odd_sin))(x) ** 2)
        assert_grads_match(f, x)


# ---------------------------------------------------------------------------
# jax.nn / scipy edge cases


def test_relu_at_zero(dtype):
    x = jnp.asarray([0.0, -1.0, 1.0, 0.0], dtype)
    g = assert_grads_match(lambda x: jnp.sum(jax.nn.relu(x) * jnp.arange(1.0, 5.0, dtype=dtype)), x)
    np.testing.assert_array_equal(g, [0.0, 0.0, 3.0, 0.0])  # jax: relu'(0) = 0


@pytest.mark.parametrize(
    "fn",
    [
        jax.nn.softplus,
        jax.nn.silu,
        jax.nn.elu,
        jax.nn.leaky_relu,
        jax.nn.relu6,
        jax.nn.log_sigmoid,
        jax.nn.celu,
        jax.nn.selu,
        functools.partial(jax.nn.gelu, approximate=True),
        functools.partial(jax.nn.gelu, approximate=False),
    ],
    ids=[
        "softplus",
        "silu",
        "elu",
        "leaky_relu",
        "relu6",
        "log_sigmoid",
        "celu",
        "selu",
        "gelu_tanh",
        "gelu_erf",
    ],
)
def test_activations(dtype, fn):
    x = jnp.concatenate([rand((7,), dtype, -4, 4, seed=31), jnp.asarray([0.0, 6.0, -30.0], dtype)])
    c = rand((10,), dtype, -1, 1, seed=32)
    assert_grads_match(lambda x: jnp.sum(fn(x) * c), x)


@pytest.mark.parametrize("axis", [None, 0, 1, (0, 1)])
def test_logsumexp(dtype, axis):
    x = rand((3, 4), dtype, -3, 3, seed=33)
    x = x.at[0, 0].set(50.0)  # large value: the stable path matters
    c = rand((), dtype, 0.5, 1, seed=34)
    f = lambda x: jnp.sum(jax.scipy.special.logsumexp(x, axis=axis) * c)
    assert_grads_match(f, x)
    b = rand((3, 4), dtype, 0.1, 1, seed=35)
    assert_grads_match(
        lambda x, b: jnp.sum(jax.scipy.special.logsumexp(x, axis=axis, b=b)), x, b, argnums=(0, 1)
    )


def test_softmax_and_log_softmax(dtype):
    x = rand((3, 5), dtype, -3, 3, seed=36)
    c = rand((3, 5), dtype, -1, 1, seed=37)
    assert_grads_match(lambda x: jnp.sum(jax.nn.softmax(x, axis=-1) * c), x)
    assert_grads_match(lambda x: jnp.sum(jax.nn.log_softmax(x, axis=0) * c), x)


def test_norm_at_zero(dtype):
    z = jnp.zeros((3,), dtype)
    g = assert_grads_match(lambda x: jnp.linalg.norm(x), z)
    want = jax.grad(lambda x: jnp.linalg.norm(x))(z)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(want))  # jax's value here is nan
    assert_grads_match(lambda x: jnp.linalg.norm(x), rand((3,), dtype, -1, 1, seed=38))
    assert_grads_match(lambda x: jnp.linalg.norm(x, ord=1), rand((3,), dtype, -1, 1, seed=39))


def test_safe_where_sqrt(dtype):
    x = jnp.asarray([0.0, -1.0, 4.0, 0.25], dtype)

    def safe(x):
        pos = x > 0
        return jnp.sum(jnp.where(pos, jnp.sqrt(jnp.where(pos, x, 1.0)), 0.0))

    g = assert_grads_match(safe, x)
    assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_allclose(g, [0.0, 0.0, 0.25, 1.0], rtol=1e-6)

    def unsafe(x):  # the classic trap: nan at 0 from the untaken branch
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0))

    g = assert_grads_match(unsafe, x)
    assert np.isnan(np.asarray(g)).any()


# ---------------------------------------------------------------------------
# custom_vjp


@jax.custom_vjp
def clip_grad_sin(x):
    return jnp.sin(x)


def _cgs_fwd(x):
    return jnp.sin(x), jnp.cos(x)


def _cgs_bwd(cos_x, g):
    return (jnp.clip(g * cos_x, -0.1, 0.1),)  # deliberately clipped


clip_grad_sin.defvjp(_cgs_fwd, _cgs_bwd)


@jax.custom_vjp
def several(x, y, z):
    return x * y + jnp.sin(z), jnp.sum(x * z)


def _several_fwd(x, y, z):
    # Residuals are the inputs themselves, plus one computed value.
    return several(x, y, z), (x, y, z, jnp.cos(z))


def _several_bwd(res, cts):
    x, y, z, cz = res
    g1, g2 = cts
    return (g1 * y + g2 * z, 2.0 * g1 * x, g1 * cz + g2 * x)  # dy deliberately doubled


several.defvjp(_several_fwd, _several_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 2))
def scaled_pow(n, x, scale):
    return scale * x**n


def _sp_fwd(n, x, scale):
    return scaled_pow(n, x, scale), x


def _sp_bwd(n, scale, x, g):
    return (g * scale * n * x ** (n - 1) + 1.0,)  # +1: deliberately not the true derivative


scaled_pow.defvjp(_sp_fwd, _sp_bwd)


@jax.custom_vjp
def with_none_ct(x, y):
    return x * jnp.sum(y)


with_none_ct.defvjp(
    lambda x, y: (with_none_ct(x, y), (y,)), lambda res, g: (g * jnp.sum(res[0]), None)
)  # y gets a zero cotangent


def test_custom_vjp_simple(dtype):
    x = rand((5,), dtype, -2, 2, seed=40)
    f = lambda x: jnp.sum(clip_grad_sin(x) * 3.0)
    g = assert_grads_match(f, x)
    assert np.abs(np.asarray(g)).max() <= 0.1 + 1e-7
    rec = [r for r in tg.trace(f)(x).records if r.primitive == "custom_vjp_call"]
    assert rec and rec[0].rule == "custom_vjp"


def test_custom_vjp_several_inputs_outputs(dtype):
    x, y, z = (rand((3,), dtype, -1, 1, seed=s) for s in (41, 42, 43))

    def f(x, y, z):
        a, b = several(x, y, z)
        return jnp.sum(a**2) + b * 0.5

    assert_grads_match(f, x, y, z, argnums=(0, 1, 2))
    assert_vjp_match(several, x, y, z, seed=44)


def test_custom_vjp_non_differentiated_input(dtype):
    x, y, z = (rand((3,), dtype, -1, 1, seed=s) for s in (45, 46, 47))
    f = lambda x, y, z: jnp.sum(several(x, y, z)[0])
    assert_grads_match(f, x, y, z, argnums=0)
    assert_grads_match(f, x, y, z, argnums=(1,))
    assert_grads_match(f, x, y, z, argnums=(0, 2))
    # y is a constant of the traced function (closed over), not an argument.
    assert_grads_match(lambda x: jnp.sum(several(x, y, jnp.sin(x))[0]), x)


def test_custom_vjp_nondiff_argnums(dtype):
    x = rand((4,), dtype, 0.5, 1.5, seed=48)
    scale = 0.75  # nondiff_argnums must be static (non-tracer) values
    f = lambda x: jnp.sum(scaled_pow(3, jnp.tanh(x), scale))
    g = assert_grads_match(f, x)
    t = np.tanh(np.asarray(x, np.float64))
    np.testing.assert_allclose(g, (scale * 3 * t**2 + 1.0) * (1 - t**2), rtol=1e-5)


def test_custom_vjp_none_cotangent(dtype):
    x = rand((3,), dtype, -1, 1, seed=50)
    y = rand((2,), dtype, -1, 1, seed=51)
    f = lambda x, y: jnp.sum(with_none_ct(x, y) ** 2)
    gx, gy = assert_grads_match(f, x, y, argnums=(0, 1))
    np.testing.assert_array_equal(gy, np.zeros(2))


def test_custom_vjp_used_twice_and_under_jit(dtype):
    x = rand((4,), dtype, -2, 2, seed=52)
    f = lambda x: jnp.sum(jax.jit(clip_grad_sin)(clip_grad_sin(x) * 2.0))
    assert_grads_match(f, x)


# ---------------------------------------------------------------------------
# nested jit


def test_nested_jit(dtype):
    x = rand((3, 3), dtype, -1, 1, seed=53)

    @jax.jit
    def inner(a, b):
        return jnp.tanh(a @ b), jnp.sin(a)

    @functools.partial(jax.jit, static_argnums=(1,))
    def middle(a, k):
        u, v = inner(a, a.T)
        return u * k + jax.jit(jnp.exp)(v)

    f = lambda x: jnp.sum(middle(x, 3) ** 2)
    assert_grads_match(f, x)
    assert all(r.primitive not in ("jit", "pjit") for r in tg.trace(f)(x).records)
    assert_vjp_match(lambda x: middle(x, 2), x, seed=54)


def test_grad_under_jit():
    """tg.grad traced by jax.jit gives the same numbers as eager."""
    with enable_x64():
        x = rand((4,), "float64", -1, 1, seed=55)
        f = lambda x: jnp.sum(lax.cond(x[0] > 0, jnp.sin, jnp.cos, x) * odd_sin(x))
        np.testing.assert_allclose(jax.jit(tg.grad(f))(x), jax.grad(f)(x), rtol=1e-12)


# ---------------------------------------------------------------------------
# Combinations: custom rules, checkpoint and control flow inside each other.


@jax.custom_vjp
def _dict_in(d):
    return jnp.sin(d["a"]) * d["b"]


# Residuals hold None, a Python int and the (pytree) input itself.
_dict_in.defvjp(
    lambda d: (_dict_in(d), (None, d, 3)),
    lambda r, g: (
        {
            "a": g * jnp.cos(r[1]["a"]) * r[1]["b"] * r[2],
            "b": jnp.sum(g * jnp.sin(r[1]["a"]), axis=0),
        },
    ),
)


@jax.custom_vjp
def _out_as_res(x):
    return jnp.exp(x)


_out_as_res.defvjp(lambda x: (jnp.exp(x), jnp.exp(x)), lambda r, g: (g * r * 2.0,))


@jax.custom_vjp
def _with_int(x, n):
    return x * n, n


_with_int.defvjp(lambda x, n: (_with_int(x, n), n), lambda n, g: (g[0] * n, None))

COMBOS = {
    "custom_vjp_pytree_in_odd_residuals": lambda x, y: jnp.sum(_dict_in({"a": x, "b": y})),
    "custom_vjp_output_as_residual": lambda x, y: jnp.sum(_out_as_res(x) * y),
    "custom_vjp_int_in_and_out": lambda x, y: jnp.sum(_with_int(x, jnp.int32(3))[0] * y),
    "custom_vjp_in_scan": lambda x, y: jnp.sum(
        lax.scan(lambda c, _: (_out_as_res(c) * 0.1 + y, None), x, None, length=3)[0]
    ),
    "custom_jvp_in_cond": lambda x, y: jnp.sum(
        lax.cond(True, lambda a: odd_sin(a) * y, jnp.sin, x)
    ),
    "checkpoint_in_scan": lambda x, y: jnp.sum(
        lax.scan(jax.checkpoint(lambda c, yy: (jnp.sin(c) * yy, c)), x, jnp.stack([y, y, y]))[1]
    ),
    "scan_in_checkpoint": lambda x, y: jnp.sum(
        jax.checkpoint(
            lambda x: lax.scan(lambda c, _: (jnp.sin(c) * 1.1 + y, c), x, None, length=3)[1]
        )(x)
    ),
    "cond_in_jit": lambda x, y: jnp.sum(
        jax.jit(lambda x: lax.cond(x[0, 0] > 0, jnp.sin, jnp.cos, x))(x) * y
    ),
    "vmap_inside": lambda x, y: jnp.sum(jax.vmap(lambda r: jnp.tanh(r * y) @ y)(x)),
    "grad_of_jax_grad": lambda x, y: jnp.sum(
        jax.grad(lambda z: jnp.sum(jnp.tanh(z) * jnp.sin(z) * y))(x) ** 2
    ),
}


@pytest.mark.parametrize("name", sorted(COMBOS))
def test_combinations(name):
    with enable_x64():
        x = rand((2, 3), "float64", 0.2, 1.5, seed=60)
        y = rand((3,), "float64", -1, 1, seed=61)
        assert_grads_match(COMBOS[name], x, y, argnums=(0, 1))


def test_grad_of_tg_grad():
    """Second order through tapegrad twice (rules are written in jax ops)."""
    with enable_x64():
        x = rand((2, 3), "float64", 0.2, 1.5, seed=62)
        f = lambda x: jnp.sum(jnp.tanh(x) * jnp.sin(x) ** 2 / (1 + x * x))
        got = tg.grad(lambda x: jnp.sum(tg.grad(f)(x) ** 2))(x)
        want = jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2))(x)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
