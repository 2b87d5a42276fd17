"""optimistix: root finding, least squares and minimisation, differentiated through
tapegrad by optimistix's implicit adjoint (the gradient with respect to ``args``)."""

from __future__ import annotations

import functools

import pytest

optx = pytest.importorskip("optimistix")

import jax.numpy as jnp  # noqa: E402

from ._zoo import Case, check, matrix  # noqa: E402

TOL = dict(rtol=1e-6, atol=1e-6)
A = jnp.array([[1.0, 0.2], [0.3, 1.5], [0.1, -0.4], [2.0, 0.0]])
B = jnp.array([1.0, 2.0, -1.0, 0.5])
# A tape of a few hundred bytes cannot be halved (the planner's least peak is above half):
# the budget is save()'s own peak, so the planner runs end to end and must keep it.
TINY = dict(budget_fraction=1.0, allow=("save", "recompute", "offload"))


def root_find() -> Case:
    def loss(a):
        fn = lambda y, a: y**3 + a * y - 1.0
        sol = optx.root_find(fn, optx.Newton(**TOL), jnp.ones(3), args=a)
        return jnp.sum(sol.value**2)

    return Case(loss, (jnp.array([1.0, 2.0, 0.5]),), rtol=1e-4, atol=1e-5, **TINY)


def least_squares(solver) -> Case:
    def loss(a, b):
        fn = lambda x, args: jnp.tanh(args[0] @ x) - 0.5 * args[1]
        sol = optx.least_squares(fn, solver, jnp.zeros(2), args=(a, b))
        return jnp.sum(sol.value**2)

    return Case(loss, (A, B), argnums=(0, 1), rtol=1e-4, atol=1e-5, **TINY)


def minimise() -> Case:
    def loss(c):
        fn = lambda x, c: jnp.sum((x - c) ** 2) + 0.1 * jnp.sum(x**4)
        sol = optx.minimise(fn, optx.BFGS(**TOL), jnp.zeros(3), args=c)
        return jnp.sum(jnp.sin(sol.value))

    return Case(loss, (jnp.array([1.0, 2.0, 0.5]),), rtol=1e-4, atol=1e-5, **TINY)


CASES = {
    "root_find-newton": root_find,
    "least_squares-gauss_newton": lambda: least_squares(optx.GaussNewton(**TOL)),
    "least_squares-levenberg_marquardt": lambda: least_squares(optx.LevenbergMarquardt(**TOL)),
    "minimise-bfgs": minimise,
}


@functools.cache
def case(name: str) -> Case:
    return CASES[name]()


XFAIL: dict = {}


SLOW = {("minimise-bfgs", "budget"), ("root_find-newton", "budget")}


@pytest.mark.parametrize("name, mode", matrix(tuple(CASES), XFAIL, SLOW))
def test_implicit_adjoint(name, mode):
    check(case(name), mode)
