"""Equal equations are one record (`_trace._cse_key`): jax's tracing keeps ``(x - mu)``
written twice as two equations, which eagerly are two arrays kept for backward."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
from conftest import assert_trees_close, rand

import tapegrad as tg


def layernorm(x):
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5)


def loss(w, x):
    return jnp.sum(jnp.tanh(layernorm(x @ w)) ** 2)


def _live() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


def test_a_repeated_expression_is_one_record_and_kept_once():
    w, x = rand((16, 32), seed=0), rand((8, 16), seed=1)
    tape = tg.trace(loss, argnums=(0, 1))(w, x)
    assert [r.primitive for r in tape.records].count("sub") == 1
    assert_trees_close(tg.grad(loss, argnums=(0, 1))(w, x), jax.grad(loss, argnums=(0, 1))(w, x))
    # Held for backward: one (x - mu), not two (measured from live arrays).
    before = _live()
    out, vjp_fn = tg.vjp(loss, w, x)
    held = _live() - before - out.nbytes
    del out, vjp_fn
    assert held == tape.saved_bytes - w.nbytes - x.nbytes, (held, tape.saved_bytes)
    before = _live()
    out, vjp_fn = jax.vjp(loss, w, x)
    jax_held = _live() - before - out.nbytes
    del out, vjp_fn
    assert held < jax_held, (held, jax_held)


def test_top_level_literals_are_never_merged_across_calls():
    """The tape cache swaps literal values per call: two literals equal in one call
    (c1 == c2) must not become one record that a later call (c1 != c2) reuses."""
    x = rand((5,), seed=2)
    for c1, c2 in ((2.0, 2.0), (2.0, 3.0), (3.0, 2.0), (2.0, 2.0)):

        def f(x, c1=c1, c2=c2):
            return jnp.sum(jnp.sin(x * c1) * jnp.cos(x * c2))

        assert_trees_close(tg.grad(f)(x), jax.grad(f)(x))


def test_effects_and_copies_are_not_merged():
    seen = []

    def f(x):
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), x)
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), x)
        a = jnp.copy(x)
        b = jnp.copy(x)
        return jnp.sum(a * b)

    x = rand((3,), seed=3)
    tape = tg.trace(f)(x)
    prims = [r.primitive for r in tape.records]
    assert prims.count("debug_callback") == 2, prims
    assert prims.count("copy_p") + prims.count("copy") != 1, prims
    assert_trees_close(tg.grad(f)(x), jax.grad(f)(x))
