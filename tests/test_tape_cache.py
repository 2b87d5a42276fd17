"""Eagerly, a program traced again with the same structure reuses its tape (records,
activity, saves), with the new call's closed-over arrays swapped in. Oracle: jax.grad
on every call, so a stale constant or literal would show as a wrong gradient."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import tapegrad as tg
from tapegrad.engine import trace as _trace

X = jnp.array([0.3, -1.2, 0.7])


def _close(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_same_program_reuses_the_records():
    f = lambda x: jnp.sum(jnp.tanh(x) ** 2)
    t1, t2 = tg.trace(f)(X), tg.trace(f)(X + 1.0)
    assert t1.records is t2.records


def test_closed_over_arrays_are_swapped_in():
    for k in range(4):
        w = jnp.arange(3.0) + k  # a new closed-over array each call, same structure
        f = lambda x: jnp.sum(jnp.sin(x * w) ** 2)
        _close(tg.grad(f)(X), jax.grad(f)(X))
        assert tg.trace(f)(X).consts[0][1] is w


def test_changed_python_scalars_give_their_own_gradient():
    for c in (0.5, 2.0, -3.0):
        f = lambda x: jnp.sum(jnp.tanh(x * c) ** 2)
        _close(tg.grad(f)(X), jax.grad(f)(X))


def test_a_different_function_keeps_its_own_lines():
    def first(x):
        return jnp.sum(jnp.sin(x))

    def second(x):
        return jnp.sum(jnp.sin(x))

    assert "first" in tg.trace(first)(X).records[0].source
    assert "second" in tg.trace(second)(X).records[0].source


def test_activity_is_part_of_the_key():
    f = lambda x, y: jnp.sum(jnp.sin(x) * y)
    _close(tg.grad(f, 0)(X, X), jax.grad(f, 0)(X, X))
    _close(tg.grad(f, 1)(X, X), jax.grad(f, 1)(X, X))


def test_bounded_and_cleared():
    for n in range(1, 6):
        tg.grad(lambda x: jnp.sum(x[:n] ** 2))(jnp.ones(8))
    assert 0 < len(_trace._TAPES) <= _trace._TAPES.max_entries
    tg.clear_caches()
    assert len(_trace._TAPES) == 0


def test_a_new_literal_reuses_the_tape_with_its_value():
    tapes = []
    for c in (0.5, 2.0, -3.0):
        f = lambda x: jnp.sum(jnp.tanh(x * c) ** 2)
        tapes.append(tg.trace(f)(X))
        _close(tg.grad(f)(X), jax.grad(f)(X))
    mul = [r for r in tapes[0].records if r.primitive == "mul"][0].index
    assert [float(t.records[mul].inputs[1].value) for t in tapes] == [0.5, 2.0, -3.0]
    assert tapes[0].records[mul + 1] is tapes[2].records[mul + 1]  # no literal: shared


def test_relu_and_jitted_calls_are_cached():
    g = jax.jit(lambda x: jnp.sin(x) * 2.0)
    for f in (lambda x: jnp.sum(jax.nn.relu(x) ** 2), lambda x: jnp.sum(g(x) ** 2)):
        assert tg.trace(f)(X).records is tg.trace(f)(X - 1.0).records
        _close(tg.grad(f)(X - 0.5), jax.grad(f)(X - 0.5))


@partial(jax.custom_jvp, nondiff_argnums=(1,))
def _scaled(x, k):
    return x * k


@_scaled.defjvp
def _scaled_jvp(k, primals, tangents):
    return _scaled(primals[0], k), tangents[0] * (k + 1.0)  # a rule unlike the function


def test_a_custom_jvp_static_argument_keys_its_rule():
    for k in (2.0, 3.0, 2.0):
        f = lambda x: jnp.sum(_scaled(x, k) ** 2)
        _close(tg.grad(f)(X), jax.grad(f)(X))
