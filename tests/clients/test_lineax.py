"""lineax: `linear_solve` with LU, Cholesky and CG on a positive-definite operator,
differentiated through tapegrad with respect to the matrix and the right-hand side."""

from __future__ import annotations

import functools

import pytest

lx = pytest.importorskip("lineax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ._zoo import Case, check, matrix  # noqa: E402


def solve(solver, tags=()) -> Case:
    m = jax.random.normal(jax.random.key(0), (4, 4))
    spd = m @ m.T + 4.0 * jnp.eye(4)

    def loss(a, b):
        op = lx.MatrixLinearOperator(a, tags)
        return jnp.sum(jnp.tanh(lx.linear_solve(op, b, solver).value))

    # A tape of ~100 bytes cannot be halved (the planner's least peak is above half):
    # the budget is save()'s own peak, so the planner runs end to end and must keep it.
    return Case(
        loss,
        (spd, jnp.arange(4.0)),
        argnums=(0, 1),
        budget_fraction=1.0,
        allow=("save", "recompute", "offload"),
    )


CASES = {
    "lu": lambda: solve(lx.LU()),
    "cholesky": lambda: solve(lx.Cholesky(), lx.positive_semidefinite_tag),
    "cg": lambda: solve(lx.CG(rtol=1e-6, atol=1e-6), lx.positive_semidefinite_tag),
}


@functools.cache
def case(name: str) -> Case:
    return CASES[name]()


XFAIL: dict = {}
SLOW = {("lu", "budget"), ("cholesky", "budget")}


@pytest.mark.parametrize("name, mode", matrix(tuple(CASES), XFAIL, SLOW))
def test_linear_solve(name, mode):
    check(case(name), mode)
