"""Cotangents of named intermediates (PyTorch's retain_grad), seed 004's worked example."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapegrad as tg


def seed_004(ws, inp):
    w1, w2, w3 = ws
    l1 = tg.name(inp * w1, "l1")
    l2 = l1 + w2
    l3 = l1 * w3
    l4 = tg.name(l2 * l3, "l4")
    return jnp.mean(l4)


def test_seed_004_retained_gradients():
    ws = (jnp.array(2.0), jnp.array(3.0), jnp.array(4.0))
    inp = jnp.ones((2, 2))
    grads, inter = tg.grad(seed_004, intermediates=("l1", "l4"))(ws, inp)
    np.testing.assert_allclose(inter["l4"], np.full((2, 2), 0.25))  # as the seed prints
    np.testing.assert_allclose(inter["l1"], np.full((2, 2), 7.0))
    # the gradient itself is unchanged, and equals jax's
    for a, b in zip(grads, jax.grad(seed_004)(ws, inp)):
        np.testing.assert_allclose(a, b)
    np.testing.assert_allclose(grads[1], 8.0)  # w2's gradient, the seed's "sum of the broadcast"


def test_intermediates_under_jit_and_unknown_name():
    ws = (jnp.array(2.0), jnp.array(3.0), jnp.array(4.0))
    inp = jnp.ones((2, 2))
    _, inter = jax.jit(tg.grad(seed_004, intermediates=("l1",)))(ws, inp)
    np.testing.assert_allclose(inter["l1"], np.full((2, 2), 7.0))
    with pytest.raises(ValueError, match="tagged"):
        tg.grad(seed_004, intermediates=("nope",))(ws, inp)
