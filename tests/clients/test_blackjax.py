"""blackjax: one HMC step and one MALA step whose log-density gradients come from
`tg.value_and_grad`, against the same steps with `jax.value_and_grad`.

blackjax takes a log-density and calls `jax.value_and_grad` on it itself; a
`jax.custom_vjp` whose forward is `tg.value_and_grad` hands it tapegrad's gradient (the
way a user brings their own gradient to a sampler). Each mode runs the step with that
gradient: eagerly, under `jax.jit`, under `offload()` and a `budget(...)`; the memory mode
checks `memory_report` of the log-density itself.
"""

from __future__ import annotations

import functools

import pytest

blackjax = pytest.importorskip("blackjax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from conftest import assert_trees_close  # noqa: E402

import tapegrad as tg  # noqa: E402
from tapegrad import policies as P  # noqa: E402

from ._zoo import Case, budget_of, check, matrix  # noqa: E402

K = jax.random.split(jax.random.key(0), 4)
X = jax.random.normal(K[0], (30, 3))
Y = (X @ jnp.array([1.0, -2.0, 0.5]) + 0.3 > 0).astype(jnp.float32)
POSITION = {"w": 0.1 * jax.random.normal(K[1], (3,)), "log_scale": jnp.float32(0.0)}


def logdensity(position):
    """A logistic regression's log posterior, with a learnt prior scale."""
    w, log_scale = position["w"], position["log_scale"]
    logits = X @ w
    loglik = jnp.sum(Y * logits - jnp.logaddexp(0.0, logits))
    logprior = -0.5 * jnp.sum((w / jnp.exp(log_scale)) ** 2) - w.size * log_scale
    return loglik + logprior - 0.5 * log_scale**2


def with_tapegrad_gradient(fn, policy):
    """``fn``, with its gradient computed by `tg.value_and_grad` under ``policy``."""

    @jax.custom_vjp
    def wrapped(x):
        return fn(x)

    def fwd(x):
        value, grad = tg.value_and_grad(fn, policy=policy)(x)
        return value, grad

    def bwd(grad, g):
        return (jax.tree.map(lambda d: g * d, grad),)

    wrapped.defvjp(fwd, bwd)
    return wrapped


SAMPLERS = {
    "hmc": lambda fn: blackjax.hmc(
        fn, step_size=0.05, inverse_mass_matrix=jnp.ones(4), num_integration_steps=5
    ),
    "mala": lambda fn: blackjax.mala(fn, step_size=0.01),
}


def one_step(name: str, fn, jit: bool):
    sampler = SAMPLERS[name](fn)
    step = lambda key, position: sampler.step(key, sampler.init(position))
    if jit:
        step = jax.jit(step)
    return step(K[2], POSITION)


@functools.cache
def reference(name: str):
    return one_step(name, logdensity, jit=True)


def policy_of(mode: str):
    if mode == "offload":
        return P.offload()
    if mode == "budget":
        # A tape of a few hundred bytes cannot be halved: the budget is save()'s peak.
        # Not offload: allowed it, the planner's search spends ~15 s on this 14-record
        # tape (planner/search.py anneal_joint) before it keeps save()'s plan.
        allow = ("save", "recompute")
        return budget_of(Case(logdensity, (POSITION,), budget_fraction=1.0, allow=allow))
    return None


@pytest.mark.parametrize("name, mode", matrix(tuple(SAMPLERS)))
def test_one_step_matches_jax(name, mode):
    if mode == "memory":
        check(Case(logdensity, (POSITION,)), "memory")
        return
    fn = with_tapegrad_gradient(logdensity, policy_of(mode))
    state, info = one_step(name, fn, jit=mode == "jit")
    ref_state, ref_info = reference(name)
    assert_trees_close(state, ref_state, rtol=1e-5, atol=1e-6)
    # Eagerly, blackjax's info holds Python numbers where jit's has arrays.
    info = jax.tree.map(jnp.asarray, info)
    assert_trees_close(info, ref_info, rtol=1e-5, atol=1e-6)
    assert bool(info.is_accepted)  # the step moved: its position depends on the gradient
