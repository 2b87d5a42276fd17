"""The benchmark models: the 8-layer and 32-layer tanh MLPs and a pre-LN transformer block."""

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


def transformer_block(p, x):
    b, t, d = x.shape
    nh = p["heads"]
    h = layernorm(x, *p["ln1"])
    q, k, v = jnp.split(h @ p["wqkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, nh, d // nh).transpose(0, 2, 1, 3) for a in (q, k, v))
    att = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(d // nh), axis=-1)
    o = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = x + o @ p["wo"]
    h = layernorm(x, *p["ln2"])
    x = x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return x


def transformer_loss(p, x):
    return jnp.mean(transformer_block(p, x) ** 2)


def split_static(p):
    """Transformer params without the static head count (so jax treats leaves as arrays)."""
    heads = p["heads"]
    arrays = {k: v for k, v in p.items() if k != "heads"}
    return arrays, heads
