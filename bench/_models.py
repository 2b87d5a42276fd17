"""The benchmark models: the 8-layer and 32-layer tanh MLPs and a pre-LN transformer block;
for the loop bench an RNN and a stack of residual blocks, both as ``lax.scan``, an 8-layer
ReLU MLP and the transformer block with a ReLU MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mlp_params(key, depth: int, width: int):
    keys = jax.random.split(key, depth)
    return [jax.random.normal(k, (width, width)) / jnp.sqrt(width) for k in keys]


def mlp_loss(params, x):
    h = x
    for w in params:
        h = jnp.tanh(h @ w)
    return jnp.mean(h**2)


def layernorm(x, g, b, eps=1e-5):
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * g + b


def transformer_params(key, d: int = 128, heads: int = 4, ff: int = 512):
    ks = jax.random.split(key, 6)
    s = 1 / jnp.sqrt(d)
    return {
        "ln1": (jnp.ones(d), jnp.zeros(d)),
        "ln2": (jnp.ones(d), jnp.zeros(d)),
        "wqkv": jax.random.normal(ks[0], (d, 3 * d)) * s,
        "wo": jax.random.normal(ks[1], (d, d)) * s,
        "w1": jax.random.normal(ks[2], (d, ff)) * s,
        "b1": jnp.zeros(ff),
        "w2": jax.random.normal(ks[3], (ff, d)) / jnp.sqrt(ff),
        "b2": jnp.zeros(d),
        "heads": heads,
    }


def transformer_block(p, x, act=jax.nn.gelu):
    b, t, d = x.shape
    nh = p["heads"]
    h = layernorm(x, *p["ln1"])
    q, k, v = jnp.split(h @ p["wqkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, nh, d // nh).transpose(0, 2, 1, 3) for a in (q, k, v))
    att = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(d // nh), axis=-1)
    o = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = x + o @ p["wo"]
    h = layernorm(x, *p["ln2"])
    x = x + act(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return x


def transformer_loss(p, x):
    return jnp.mean(transformer_block(p, x) ** 2)


def transformer_relu_loss(p, x):
    """The same block with a ReLU MLP (``jax.nn.relu``, a custom_jvp function)."""
    return jnp.mean(transformer_block(p, x, act=jax.nn.relu) ** 2)


def split_static(p):
    """Transformer params without the static head count (so jax treats leaves as arrays)."""
    heads = p["heads"]
    arrays = {k: v for k, v in p.items() if k != "heads"}
    return arrays, heads


# ------------------------------------------------------------------- loop models


def relu_mlp_loss(params, x):
    """Straight-line ReLU MLP (``jax.nn.relu``); use with `mlp_params`."""
    h = x
    for w in params:
        h = jax.nn.relu(h @ w)
    return jnp.mean(h**2)


def rnn_params(key, width: int = 128, d_in: int = 128):
    kw, ku = jax.random.split(key)
    return {
        "w": jax.random.normal(kw, (width, width)) / jnp.sqrt(width),
        "u": jax.random.normal(ku, (d_in, width)) / jnp.sqrt(d_in),
    }


def rnn_loss(p, xs):
    """``h = tanh(h @ w + x @ u)`` over ``xs`` (steps, batch, d_in) with ``lax.scan``;
    the loss is the mean of the final state squared plus the mean of every state."""
    w, u = p["w"], p["u"]

    def step(h, x):
        h = jnp.tanh(h @ w + x @ u)
        return h, h

    h0 = jnp.zeros((xs.shape[1], w.shape[0]), xs.dtype)
    h, ys = jax.lax.scan(step, h0, xs)
    return jnp.mean(h**2) + jnp.mean(ys)


def stack_params(key, depth: int, width: int):
    """Stacked weights of ``depth`` residual blocks, scanned over as ``xs``."""
    k1, k2 = jax.random.split(key)
    s = 1 / jnp.sqrt(width)
    return {
        "w1": jax.random.normal(k1, (depth, width, width)) * s,
        "w2": jax.random.normal(k2, (depth, width, width)) * s / jnp.sqrt(depth),
    }


def _stack_loss(p, x, act):
    def block(h, w):
        return h + act(h @ w[0]) @ w[1], None

    h, _ = jax.lax.scan(block, x, (p["w1"], p["w2"]))
    return jnp.mean(h**2)


def stack_tanh_loss(p, x):
    """``h = h + tanh(h @ w1) @ w2`` per layer, layers as one ``lax.scan``."""
    return _stack_loss(p, x, jnp.tanh)


def stack_relu_loss(p, x):
    """`stack_tanh_loss` with ``jax.nn.relu``."""
    return _stack_loss(p, x, jax.nn.relu)
