"""``lax.platform_dependent`` keeps only the lowering platform's branch, backward too.

A platform_dependent is a cond whose index is a ``platform_index`` and whose params
carry ``branches_platforms``; jax lowers only the branch of the platform it compiles
for, so the other branches never need to compile there (a TPU kernel on CPU, say).
tapegrad's forward and backward of that cond must keep that: on CPU the compiled
program holds the cpu branch (a dot) and neither the forward nor the backward of the
default branch (a scan: a ``while`` in the HLO).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from conftest import assert_trees_close, rand
from jax import lax

import tapegrad as tg


def dot_impl(x):
    return jnp.dot(x, x)


def scan_impl(x):
    """The same value as `dot_impl`, with a loop and per-step residuals of its own."""
    return lax.scan(lambda c, xi: (c + xi * xi, None), jnp.zeros((), x.dtype), x)[0]


def pd(x):
    return lax.platform_dependent(x, cpu=dot_impl, default=scan_impl)


def f(x):
    return jnp.sin(pd(x))


def whiles(g, *args) -> int:
    """How many loops the lowered program of ``g`` holds."""
    return jax.jit(g).lower(*args).as_text().count("stablehlo.while")


def assert_grad_matches_jax(g, *args):
    want = jax.grad(g)(*args)
    assert_trees_close(tg.grad(g)(*args), want)
    assert_trees_close(jax.jit(tg.grad(g))(*args), want)


def test_platform_dependent_grad_matches_jax():
    assert_grad_matches_jax(f, rand((5,), seed=1))


def test_platform_dependent_backward_keeps_only_the_cpu_branch():
    x = rand((5,), seed=1)
    hlo = jax.jit(tg.grad(f)).lower(x).as_text()
    assert "stablehlo.while" not in hlo  # neither the scan nor its backward
    assert "dot_general" in hlo
    assert "while" not in jax.jit(tg.grad(f)).lower(x).compile().as_text()
    # Lowered for another platform, the program is the default branch's alone.
    tpu = jax.jit(tg.grad(f)).trace(x).lower(lowering_platforms=("tpu",)).as_text()
    assert "stablehlo.while" in tpu
    assert "dot_general" not in tpu


def test_platform_dependent_in_a_scan_body():
    xs = rand((3, 4), seed=2)

    def g(xs, impl=pd):
        c, ys = lax.scan(lambda c, x: (c + jnp.sin(impl(x * c)), impl(x)), 1.0, xs)
        return c + jnp.sum(ys)

    assert_grad_matches_jax(g, xs)
    # As many loops as the same program written with the cpu branch alone.
    assert whiles(tg.grad(g), xs) == whiles(tg.grad(lambda xs: g(xs, dot_impl)), xs)


def test_platform_dependent_in_a_cond_branch():
    x = rand((4,), seed=3)

    def g(x, p, impl=pd):
        return jnp.sum(lax.cond(p > 0, lambda x: jnp.cos(impl(x)) * x, jnp.tanh, x))

    for p in (1.0, -1.0):
        assert_trees_close(tg.grad(g)(x, p), jax.grad(g)(x, p))
        assert_trees_close(jax.jit(tg.grad(g))(x, p), jax.grad(g)(x, p))
    assert (
        whiles(tg.grad(g), x, 1.0) == 0 == whiles(tg.grad(lambda x, p: g(x, p, dot_impl)), x, 1.0)
    )


def test_platform_dependent_second_order():
    x = rand((5,), seed=4)
    h = lambda x: jnp.sum(tg.grad(f)(x) ** 2)
    want = jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2))(x)
    assert_trees_close(jax.jit(tg.grad(h))(x), want, rtol=1e-5, atol=1e-5)
    assert whiles(tg.grad(h), x) == 0
