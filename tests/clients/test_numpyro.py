"""numpyro: models' potential energies (the negative log joint of unconstrained sites,
with the constraining transforms' log-Jacobians), from `numpyro.infer.util`'s
`initialize_model` and `potential_energy`, differentiated through tapegrad."""

from __future__ import annotations

import functools

import pytest

numpyro = pytest.importorskip("numpyro")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from numpyro.infer.util import initialize_model, potential_energy  # noqa: E402

from ._zoo import Case, check, matrix  # noqa: E402

# The eight schools: treatment effects and their standard errors.
Y = jnp.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SIGMA = jnp.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
# A tape of a few hundred bytes cannot be halved (the planner's least peak is above half):
# the budget is save()'s own peak, so the planner runs end to end and must keep it.
TINY = dict(rtol=1e-5, atol=1e-5, budget_fraction=1.0, allow=("save", "recompute"))


def eight_schools(sigma, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))  # positive: sampled as log(tau)
    with numpyro.plate("schools", sigma.shape[0]):
        theta = numpyro.sample("theta", dist.Normal(mu, tau))
        numpyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def eight_schools_initialize_model() -> Case:
    info = initialize_model(jax.random.key(0), eight_schools, model_args=(SIGMA, Y))
    # `param_info.z`: a point in the unconstrained space, drawn by numpyro's init strategy.
    return Case(info.potential_fn, (info.param_info.z,), **TINY)


def logistic_regression(x, y=None):
    w = numpyro.sample("w", dist.Normal(jnp.zeros(x.shape[1]), 1.0).to_event(1))
    scale = numpyro.sample("scale", dist.LogNormal(0.0, 1.0))
    b = numpyro.sample("b", dist.Normal(0.0, scale))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w + b), obs=y)


def logistic_regression_potential_energy() -> Case:
    k = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(k[0], (20, 3))
    y = (x @ jnp.array([1.0, -2.0, 0.5]) + 0.3 > 0).astype(jnp.float32)
    # Unconstrained values: `scale`'s is its log.
    params = {"w": jax.random.normal(k[1], (3,)), "scale": jnp.float32(-0.5), "b": jnp.float32(0.1)}

    def loss(params, x):
        return potential_energy(logistic_regression, (x, y), {}, params)

    return Case(loss, (params, x), argnums=(0, 1), **TINY)


CASES = {
    "eight_schools-initialize_model": eight_schools_initialize_model,
    "logistic_regression-potential_energy": logistic_regression_potential_energy,
}


@functools.cache
def case(name: str) -> Case:
    return CASES[name]()


XFAIL: dict = {}


SLOW: set = set()


@pytest.mark.parametrize("name, mode", matrix(tuple(CASES), XFAIL, SLOW))
def test_numpyro(name, mode):
    check(case(name), mode)
