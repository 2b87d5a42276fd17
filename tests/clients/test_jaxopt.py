"""jaxopt: implicit differentiation (``implicit_diff=True``) of an L-BFGS solution and of
a fixed point, w.r.t. a hyperparameter, differentiated through tapegrad. jaxopt's
`custom_root` is a `jax.custom_vjp` whose backward solves the optimality conditions'
linear system; tapegrad records it as one call and runs that backward."""

from __future__ import annotations

import functools

import pytest

jaxopt = pytest.importorskip("jaxopt")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ._zoo import Case, check, matrix  # noqa: E402

K = jax.random.split(jax.random.key(0), 3)
X = jax.random.normal(K[0], (12, 4))
Y = X @ jnp.array([1.0, -1.0, 0.5, 2.0]) + 0.1 * jax.random.normal(K[1], (12,))
X_VAL, Y_VAL = X[:4] + 0.1, Y[:4]
# A tape of a few hundred bytes cannot be halved (the planner's least peak is above half):
# the budget is save()'s own peak, so the planner runs end to end and must keep it.
TINY = dict(rtol=1e-4, atol=1e-5, budget_fraction=1.0, allow=("save", "recompute"))


def lbfgs_ridge() -> Case:
    """Validation error of ridge regression's weights, w.r.t. the log of its penalty."""

    def objective(w, log_lam, x, y):
        return jnp.mean((x @ w - y) ** 2) + jnp.exp(log_lam) * jnp.sum(w**2)

    solver = jaxopt.LBFGS(
        fun=objective, tol=1e-6, maxiter=100, linesearch="backtracking", implicit_diff=True
    )

    def loss(log_lam, x):
        w = solver.run(jnp.zeros(4), log_lam, x, Y).params
        return jnp.mean((X_VAL @ w - Y_VAL) ** 2)

    return Case(loss, (jnp.float32(-1.0), X), argnums=(0, 1), **TINY)


def fixed_point() -> Case:
    """A contraction's fixed point ``z = tanh(W z + b)``, w.r.t. ``W`` and ``b``."""

    def step(z, w, b):
        return jnp.tanh(w @ z + b)

    solver = jaxopt.FixedPointIteration(
        fixed_point_fun=step, tol=1e-7, maxiter=200, implicit_diff=True
    )

    def loss(w, b):
        return jnp.sum(jnp.sin(solver.run(jnp.zeros(4), w, b).params))

    w = 0.3 * jax.random.normal(K[2], (4, 4))
    return Case(loss, (w, jnp.array([0.1, -0.2, 0.3, 0.0])), argnums=(0, 1), **TINY)


CASES = {"lbfgs-ridge": lbfgs_ridge, "fixed_point_iteration": fixed_point}


@functools.cache
def case(name: str) -> Case:
    return CASES[name]()


# A budget at save()'s peak (44 B) is met: the solver's fwd keeps its solution, the
# call's own output, which the planner once counted twice (60 B).
XFAIL: dict = {}


SLOW: set = set()


@pytest.mark.parametrize("name, mode", matrix(tuple(CASES), XFAIL, SLOW))
def test_implicit_diff(name, mode):
    check(case(name), mode)
