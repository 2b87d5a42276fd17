"""Whole models: tapegrad's gradients against jax.grad.

An MLP, a pre-LN transformer block, a small conv net and a scan RNN, each in
float32 and float64, with parameters as pytrees; then the pytree, has_aux,
argnums and value_and_grad plumbing of the transforms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_grads_match,
    assert_trees_close,
    assert_value_and_grad_match,
    assert_vjp_match,
    enable_x64,
    rand,
)
from jax import lax
from jax.flatten_util import ravel_pytree

import tapegrad as tg

DTYPES = ["float32", "float64"]


def _normal(key, shape, dtype, scale=1.0):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


# ---------------------------------------------------------------------------
# MLP: 4 tanh layers, params as a list of dicts.


def init_mlp(sizes, dtype, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(sizes) - 1)
    return [
        {"w": _normal(k, (m, n), dtype, 1 / np.sqrt(m)), "b": jnp.full((n,), 0.1, dtype)}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:])
    ]


def mlp(params, x):
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def mlp_loss(params, x, y):
    return jnp.mean((mlp(params, x) - y) ** 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mlp(dtype):
    with enable_x64(dtype == "float64"):
        params = init_mlp([6, 16, 16, 8, 3], dtype)
        assert len(params) == 4
        x = rand((5, 6), dtype, -1, 1, seed=1)
        y = rand((5, 3), dtype, -1, 1, seed=2)
        g = assert_grads_match(mlp_loss, params, x, y)
        assert isinstance(g, list) and set(g[0]) == {"w", "b"}
        assert_grads_match(mlp_loss, params, x, y, argnums=(0, 1))
        assert_vjp_match(mlp, params, x, seed=3)


# ---------------------------------------------------------------------------
# Pre-LN transformer block.


def layernorm(x, scale, bias, eps=1e-5):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + eps) * scale + bias


def attention(p, x, n_heads):
    t, d = x.shape[-2:]
    hd = d // n_heads

    def heads(z):  # (..., t, d) -> (..., h, t, hd)
        return jnp.swapaxes(z.reshape(*z.shape[:-1], n_heads, hd), -2, -3)

    q, k, v = heads(x @ p["wq"]), heads(x @ p["wk"]), heads(x @ p["wv"])
    logits = jnp.einsum("...htd,...hsd->...hts", q, k) / np.sqrt(hd)
    mask = jnp.tril(jnp.ones((t, t), bool))
    logits = jnp.where(mask, logits, -1e9)
    w = jax.nn.softmax(logits, axis=-1)
    o = jnp.einsum("...hts,...hsd->...htd", w, v)
    o = jnp.swapaxes(o, -2, -3).reshape(*x.shape)
    return o @ p["wo"]


def block(p, x, n_heads=2, approximate=True):
    h = x + attention(p["attn"], layernorm(x, *p["ln1"]), n_heads)
    m = layernorm(h, *p["ln2"])
    m = jax.nn.gelu(m @ p["mlp"]["w1"] + p["mlp"]["b1"], approximate=approximate)
    return h + m @ p["mlp"]["w2"] + p["mlp"]["b2"]


def init_block(d, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    s = 1 / np.sqrt(d)
    return {
        "ln1": (1 + _normal(ks[0], (d,), dtype, 0.1), _normal(ks[1], (d,), dtype, 0.1)),
        "attn": {
            n: _normal(k, (d, d), dtype, s) for n, k in zip(["wq", "wk", "wv", "wo"], ks[2:6])
        },
        "ln2": (jnp.ones((d,), dtype), jnp.zeros((d,), dtype)),
        "mlp": {
            "w1": _normal(ks[6], (d, 2 * d), dtype, s),
            "b1": jnp.zeros((2 * d,), dtype),
            "w2": _normal(ks[7], (2 * d, d), dtype, s),
            "b2": jnp.zeros((d,), dtype),
        },
    }


@pytest.mark.parametrize("approximate", [True, False], ids=["gelu_tanh", "gelu_erf"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_transformer_block(dtype, approximate):
    with enable_x64(dtype == "float64"):
        p = init_block(8, dtype)
        x = rand((2, 5, 8), dtype, -1, 1, seed=4)
        c = rand((2, 5, 8), dtype, -1, 1, seed=5)
        loss = lambda p, x: jnp.sum(block(p, x, approximate=approximate) * c)
        # float32: a block of ~50 ops with reductions over rows; jax and tapegrad
        # order some sums differently, so allow a few ulps of the largest entries.
        tol = dict(rtol=2e-5, atol=2e-5) if dtype == "float32" else {}
        assert_grads_match(loss, p, x, argnums=(0, 1), **tol)
        assert_vjp_match(lambda x: block(p, x, approximate=approximate), x, seed=6, **tol)


# ---------------------------------------------------------------------------
# Conv net: conv -> relu -> 2x2 average pool (reshape + mean) -> dense.


def convnet(p, x):  # x: NHWC
    y = lax.conv_general_dilated(
        x,
        p["k1"],
        window_strides=(1, 1),
        padding="SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    y = jax.nn.relu(y + p["b1"])
    y = lax.conv_general_dilated(
        y,
        p["k2"],
        window_strides=(2, 2),
        padding="VALID",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    y = jax.nn.relu(y)
    n, h, w, c = y.shape
    y = y.reshape(n, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))
    return y.reshape(n, -1) @ p["w"] + p["b"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_convnet(dtype):
    with enable_x64(dtype == "float64"):
        ks = jax.random.split(jax.random.PRNGKey(7), 3)
        p = {
            "k1": _normal(ks[0], (3, 3, 2, 4), dtype, 0.3),
            "b1": jnp.full((4,), 0.05, dtype),
            "k2": _normal(ks[1], (3, 3, 4, 4), dtype, 0.3),
            "w": _normal(ks[2], (2 * 2 * 4, 3), dtype, 0.3),
            "b": jnp.zeros((3,), dtype),
        }
        x = rand((2, 9, 9, 2), dtype, -1, 1, seed=8)
        labels = jnp.asarray([0, 2])
        loss = lambda p, x: (
            -jnp.mean(
                jnp.take_along_axis(jax.nn.log_softmax(convnet(p, x)), labels[:, None], axis=1)
            )
        )
        tape = tg.trace(loss)(p, x)
        convs = [r for r in tape.records if r.primitive == "conv_general_dilated"]
        assert len(convs) == 2 and all(r.rule in ("rule", "fallback") for r in convs)
        tol = dict(rtol=2e-5, atol=2e-6) if dtype == "float32" else {}  # conv sums reorder
        assert_grads_match(loss, p, x, argnums=(0, 1), **tol)


# ---------------------------------------------------------------------------
# RNN with lax.scan.


def rnn_loss(p, xs, h0):
    def step(h, x):
        h = jnp.tanh(h @ p["wh"] + x @ p["wx"] + p["b"])
        return h, jnp.sum(h**2)

    h, ys = lax.scan(step, h0, xs)
    return jnp.sum(ys) + jnp.sum(h @ p["wo"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rnn_scan(dtype):
    with enable_x64(dtype == "float64"):
        ks = jax.random.split(jax.random.PRNGKey(9), 4)
        p = {
            "wh": _normal(ks[0], (4, 4), dtype, 0.5),
            "wx": _normal(ks[1], (3, 4), dtype, 0.5),
            "b": jnp.zeros((4,), dtype),
            "wo": _normal(ks[2], (4, 2), dtype),
        }
        xs = rand((6, 3), dtype, -1, 1, seed=10)
        h0 = rand((4,), dtype, -1, 1, seed=11)
        assert any(r.primitive == "scan" for r in tg.trace(rnn_loss)(p, xs, h0).records)
        assert_grads_match(rnn_loss, p, xs, h0, argnums=(0, 1, 2))


# ---------------------------------------------------------------------------
# Pytrees, has_aux, argnums, value_and_grad.


def test_nested_pytrees():
    params = {
        "a": (jnp.arange(3.0), [jnp.ones((2, 2)), {"z": jnp.asarray(0.5)}]),
        "b": jnp.linspace(-1.0, 1.0, 4),
    }

    def f(p):
        (a, (m, d)) = p["a"]
        return jnp.sum(jnp.sin(a) * d["z"]) + jnp.sum(m @ m) * jnp.sum(p["b"] ** 2)

    g = assert_grads_match(f, params)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(params)


def test_pytree_with_unused_and_integer_leaves():
    """Unused float leaves get zeros; integer leaves need allow_int and get float0."""
    p = {"used": jnp.arange(3.0), "unused": jnp.ones(2), "n": jnp.asarray(3)}
    f = lambda p: jnp.sum(p["used"] ** 2) * p["n"]
    with pytest.raises(TypeError):
        tg.grad(f)(p)
    with pytest.raises(TypeError):
        jax.grad(f)(p)
    g = assert_grads_match(f, p, allow_int=True)
    np.testing.assert_array_equal(g["unused"], np.zeros(2))
    assert g["n"].dtype == jax.dtypes.float0


def test_tuple_output_vjp():
    x = rand((3,), "float32", -1, 1, seed=12)
    y = rand((2, 3), "float32", -1, 1, seed=13)
    f = lambda x, y: {"s": jnp.sum(x * y), "t": (jnp.exp(x), y.T @ y)}
    assert_vjp_match(f, x, y, seed=14)


@pytest.mark.parametrize("argnums", [0, 1, 2, (0,), (0, 2), (2, 0), (1, 2, 0), -1])
def test_argnums(argnums):
    with enable_x64():
        a = rand((3,), "float64", -1, 1, seed=15)
        b = {"k": rand((3, 3), "float64", -1, 1, seed=16)}
        c = rand((), "float64", 0.5, 1, seed=17)
        f = lambda a, b, c: jnp.sum(jnp.tanh(b["k"] @ a) * c) + c**3
        g = assert_grads_match(f, a, b, c, argnums=argnums)
        if isinstance(argnums, tuple):
            assert isinstance(g, tuple) and len(g) == len(argnums)
        assert_value_and_grad_match(f, a, b, c, argnums=argnums)


def test_has_aux():
    with enable_x64():
        params = init_mlp([4, 8, 2], "float64")
        x = rand((3, 4), "float64", -1, 1, seed=18)

        def f(params, x):
            out = mlp(params, x)
            return jnp.sum(out**2), {"out": out, "n": 3, "mean": jnp.mean(out)}

        (g, aux) = assert_grads_match(f, params, x, has_aux=True)
        assert aux["n"] == 3
        ((v, aux2), g2) = assert_value_and_grad_match(f, params, x, argnums=(0, 1), has_aux=True)
        np.testing.assert_allclose(v, jnp.sum(mlp(params, x) ** 2), rtol=1e-12)
        assert_vjp_match(f, params, x, has_aux=True, seed=19)


def test_value_and_grad():
    with enable_x64():
        params = init_mlp([3, 5, 5, 1], "float64")
        x = rand((4, 3), "float64", -1, 1, seed=20)
        y = rand((4, 1), "float64", -1, 1, seed=21)
        v, g = assert_value_and_grad_match(mlp_loss, params, x, y)
        np.testing.assert_allclose(v, mlp_loss(params, x, y), rtol=1e-12)


def test_kwargs_are_not_differentiated():
    x = rand((3,), "float32", -1, 1, seed=22)
    f = lambda x, scale=1.0: jnp.sum(jnp.sin(x) * scale)
    assert_trees_close(tg.grad(f)(x, scale=2.0), jax.grad(f)(x, scale=2.0))


def test_grad_of_grad_free_function_of_consts():
    """A function that closes over arrays (constants on the tape)."""
    w = rand((3, 3), "float32", -1, 1, seed=23)
    x = rand((3,), "float32", -1, 1, seed=24)
    assert_grads_match(lambda x: jnp.sum(jnp.tanh(w @ x) * w[0]), x)


def test_finite_differences_mlp():
    """An oracle independent of jax's AD: central differences in float64."""
    with enable_x64():
        params = init_mlp([3, 4, 2], "float64", seed=3)
        x = rand((2, 3), "float64", -1, 1, seed=25)
        y = rand((2, 2), "float64", -1, 1, seed=26)
        g = tg.grad(mlp_loss)(params, x, y)
        flat, unravel = ravel_pytree(params)
        gflat, _ = ravel_pytree(g)
        eps = 1e-6
        fd = np.array(
            [
                (
                    mlp_loss(unravel(flat.at[i].add(eps)), x, y)
                    - mlp_loss(unravel(flat.at[i].add(-eps)), x, y)
                )
                / (2 * eps)
                for i in range(flat.size)
            ]
        )
        np.testing.assert_allclose(gflat, fd, rtol=1e-6, atol=1e-8)
