"""Tensor hooks and retained gradients, ported from PyTorch's TestAutograd.

PyTorch runs the hooks registered on one tensor in registration order, and a retained
gradient (``retain_grad``) sees the gradient after all of them. tapegrad's
``tg.hook(y, h1, h2)`` runs h1 then h2; chained ``tg.hook`` calls compose as functions
(the outer wrapper first); `tg.name` anywhere in a chain of hooks retains the cotangent
after every hook of the chain.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapegrad as tg

from ._torch import torch

MODES = ["tg.grad", "jax.grad", "jit tg.grad", "jit jax.grad"]


def _grad(mode, f):
    g = {"tg.grad": tg.grad, "jax.grad": jax.grad}[mode.removeprefix("jit ")](f)
    return jax.jit(g) if mode.startswith("jit") else g


def plus_one(g):
    return g + 1


def times_two(g):
    return g * 2


@pytest.mark.parametrize("mode", MODES)
def test_hooks_on_one_value_run_in_registration_order(mode):
    """test_prehook_ordering: ``b.register_hook(g + 1); b.register_hook(g * 2)`` gives
    ``a.grad == (1 + 1) * 2 == 4``, the hooks logged in the order they were registered."""
    log = []

    def logged(k, fn):
        def hook(g):
            log.append(k)
            return fn(g)

        return hook

    f = lambda a: jnp.sum(tg.hook(a * 1.0, logged(1, plus_one), logged(2, times_two)))
    np.testing.assert_allclose(_grad(mode, f)(jnp.array(1.0)), 4.0)  # (1 + 1) * 2
    assert log == [1, 2]


def test_several_hooks_under_vmap_and_second_order():
    f = lambda a: jnp.sum(tg.hook(a**2, plus_one, times_two))
    xs = jnp.array([1.0, 2.0, 3.0])
    # d/da = (1 + 1) * 2 * 2a = 8a (the hooks act on the cotangent 1 of a**2)
    np.testing.assert_allclose(jax.vmap(tg.grad(f))(xs), 8.0 * xs)
    np.testing.assert_allclose(jax.vmap(jax.grad(f))(xs), 8.0 * xs)
    np.testing.assert_allclose(jax.grad(tg.grad(f))(jnp.array(2.0)), 8.0)


@pytest.mark.parametrize("mode", MODES)
def test_chained_hooks_compose_as_functions(mode):
    """The by-design difference to test_prehook_ordering: ``tg.hook(tg.hook(b, h1), h2)``
    wraps b twice, and backward meets the outer wrapper (h2) first: (1 * 2) + 1 == 3."""
    f = lambda a: jnp.sum(tg.hook(tg.hook(a * 1.0, plus_one), times_two))
    np.testing.assert_allclose(_grad(mode, f)(jnp.array(1.0)), 3.0)


def _retained(order):
    def f(a):
        b = a * 1.0
        for step in order:
            b = tg.name(b, "b") if step == "retain" else tg.hook(b, times_two)
        return jnp.sum(b * 1.0)

    return f


CASES = [
    (("hook", "retain", "hook"), 4.0),  # PyTorch: retain_grad sees both hooks
    (("retain", "hook"), 2.0),
    (("hook", "retain"), 2.0),  # PyTorch: also after a hook registered before it
    (("retain",), 1.0),
]


@pytest.mark.parametrize("order,want", CASES, ids=["-".join(c[0]) for c in CASES])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_retained_gradient_sees_every_hook_of_the_value(order, want, jit):
    """test_retains_grad_can_always_observe_tensor_prehook: ``b.register_hook(g * 2);
    b.retain_grad(); b.register_hook(g * 2)`` gives ``b.grad == 4``; with the retain
    first and one hook, 2."""
    g = tg.grad(_retained(order), intermediates=("b",))
    g = jax.jit(g) if jit else g
    grad, inter = g(jnp.array(1.0))
    np.testing.assert_allclose(inter["b"], want)
    hooks = order.count("hook")
    np.testing.assert_allclose(grad, 2.0**hooks)  # the gradient itself: every hook once


def test_retained_gradient_with_a_pytree_hook_and_has_aux():
    def f(a):
        d = tg.hook({"s": jnp.sin(a), "c": jnp.cos(a)}, lambda ct: {"s": ct["s"] * 3, "c": ct["c"]})
        s = tg.name(d["s"], "s")
        return jnp.sum(s + d["c"]), 0.0

    a = jnp.array([0.1, 0.2])
    (g, inter), _ = tg.grad(f, has_aux=True, intermediates=("s",))(a)
    np.testing.assert_allclose(inter["s"], 3.0)  # the hook on the pytree: the s leaf x 3
    np.testing.assert_allclose(g, 3 * jnp.cos(a) - jnp.sin(a), rtol=1e-6)


def test_hook_changes_only_the_uses_of_the_value_it_returns():
    """By design: ``tg.hook`` wraps a value; uses of the unwrapped value are not hooked
    (in PyTorch, a tensor's hook sees the gradient of every use)."""

    def f(a):
        b = jnp.sin(a)
        return jnp.sum(tg.hook(b, times_two) + b)

    a = jnp.array(0.3)
    np.testing.assert_allclose(tg.grad(f)(a), 3 * jnp.cos(a), rtol=1e-6)  # 2 cos + cos


def test_hook_ordering_and_retain_as_torch():
    t = torch()
    a = t.tensor(1.0, requires_grad=True)
    b = a.clone()
    b.register_hook(plus_one)
    b.register_hook(times_two)
    b.backward()
    got = tg.grad(lambda a: jnp.sum(tg.hook(a * 1.0, plus_one, times_two)))(jnp.array(1.0))
    np.testing.assert_allclose(got, a.grad.item())

    for order, want in CASES:
        a = t.tensor(1.0, requires_grad=True)
        b = a.clone()
        for step in order:
            b.retain_grad() if step == "retain" else b.register_hook(times_two)
        b.clone().backward()
        _, inter = tg.grad(_retained(order), intermediates=("b",))(jnp.array(1.0))
        np.testing.assert_allclose(inter["b"], b.grad.item())
        assert b.grad.item() == want
