"""`tg.vjp`'s ``vjp_fn`` is a `jax.tree_util.Partial`, as `jax.vjp`'s: its leaves are the
residual arrays, so it passes into `jax.jit`, out of a custom_vjp ``fwd`` and into
another vjp. Oracle: `jax.vjp` on the same function."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import live_bytes_by_kind
from jax import tree_util

import tapegrad as tg

X = jnp.array([0.3, 1.2, -0.7])
CT = jnp.array([1.0, -2.0, 0.5])


def f(x):
    return jnp.tanh(x) * jnp.sin(x)


def _ref(ct=CT):
    return jax.vjp(f, X)[1](ct)[0]


def test_vjp_fn_is_a_partial_whose_leaves_are_the_residuals():
    _, vjp_fn = tg.vjp(f, X)
    assert isinstance(vjp_fn, tree_util.Partial)
    leaves = tree_util.tree_leaves(vjp_fn)
    tape = tg.trace(f)(X)
    assert sum(x.nbytes for x in leaves) == tape.saved_bytes
    np.testing.assert_allclose(vjp_fn(CT)[0], _ref(), rtol=1e-6)


@pytest.mark.parametrize(
    "policy", [tg.policies.save(), tg.policies.offload()], ids=["save", "offload"]
)
def test_vjp_fn_passes_into_jit(policy):
    _, vjp_fn = tg.vjp(f, X, policy=policy)
    got = jax.jit(lambda fn, ct: fn(ct))(vjp_fn, CT)[0]
    np.testing.assert_allclose(got, _ref(), rtol=1e-5)
    # another cotangent, the same compiled program
    again = jax.jit(lambda fn, ct: fn(ct))(vjp_fn, 2 * CT)[0]
    np.testing.assert_allclose(again, _ref(2 * CT), rtol=1e-5)


@jax.custom_vjp
def g(x):
    return f(x)


def _g_fwd(x):
    return tg.vjp(f, x)  # (y, vjp_fn): the vjp_fn is the residual


def _g_bwd(vjp_fn, ct):
    return vjp_fn(ct)


g.defvjp(_g_fwd, _g_bwd)


@pytest.mark.parametrize("outer", ["jax.grad", "tg.grad", "jit(jax.grad)"])
def test_vjp_fn_as_a_custom_vjp_residual(outer):
    loss = lambda x: jnp.sum(g(x) * CT)
    d = {
        "jax.grad": jax.grad,
        "tg.grad": tg.grad,
        "jit(jax.grad)": lambda h: jax.jit(jax.grad(h)),
    }[outer]
    np.testing.assert_allclose(d(loss)(X), _ref(), rtol=1e-5)


def test_nested_vjp_of_a_vjp_fn():
    _, vjp_fn = tg.vjp(f, X)
    _, inner = tg.vjp(lambda c: vjp_fn(c)[0], CT)
    _, jax_fn = jax.vjp(f, X)
    _, jax_inner = jax.vjp(lambda c: jax_fn(c)[0], CT)
    ones = jnp.ones(3)
    np.testing.assert_allclose(inner(ones)[0], jax_inner(ones)[0], rtol=1e-6)


def test_tree_map_over_the_residuals():
    _, vjp_fn = tg.vjp(f, X)
    doubled = tree_util.tree_map(lambda r: r, vjp_fn)  # rebuilt from its leaves
    np.testing.assert_allclose(doubled(CT)[0], _ref(), rtol=1e-6)


def test_retain_residuals_false_still_releases_after_one_call():
    _, vjp_fn = tg.vjp(f, X, retain_residuals=False)
    np.testing.assert_allclose(vjp_fn(CT)[0], _ref(), rtol=1e-6)
    assert tree_util.tree_leaves(vjp_fn) == []  # released during the first backward
    with pytest.raises(tg.errors.ResidualError, match="second time"):
        vjp_fn(CT)


def test_a_jitted_vjp_keeps_nothing_once_its_vjp_fn_is_gone():
    """jax's dispatch cache keeps the treedef of a jitted function's first outputs; the
    vjp_fn's aux data holds the residuals' bookkeeping, not their values, so what
    ``del vjp_fn`` frees is freed while the jitted function lives on."""
    step = jax.jit(lambda x: tg.vjp(f, x))
    xs = (X, 2 * X)  # the first call fills the cache, the second runs from it
    before = live_bytes_by_kind()
    for x in xs:
        out, vjp_fn = step(x)
        np.testing.assert_allclose(vjp_fn(CT)[0], jax.vjp(f, x)[1](CT)[0], rtol=1e-5)
        del out, vjp_fn
        assert live_bytes_by_kind() == before
