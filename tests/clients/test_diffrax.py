"""diffrax: a neural ODE (an `eqx.nn.MLP` vector field, Tsit5) differentiated through
tapegrad, with constant and adaptive steps and diffrax's adjoints."""

from __future__ import annotations

import functools

import pytest

dfx = pytest.importorskip("diffrax")
eqx = pytest.importorskip("equinox")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ._zoo import PLANNER_ABOVE_SAVE, Case, check, matrix  # noqa: E402

TS = jnp.linspace(0.0, 2.0, 5)


def neural_ode(controller, adjoint, max_steps=256, budget_fraction=0.5) -> Case:
    mlp = eqx.nn.MLP(2, 2, 8, 1, activation=jnp.tanh, key=jax.random.key(0))
    params, static = eqx.partition(mlp, eqx.is_inexact_array)

    def vector_field(t, y, params):
        return eqx.combine(params, static)(y)

    def loss(params, y0):
        # The parameters travel as `args`: BacksolveAdjoint differentiates only them
        # (jax refuses a closed-over one).
        sol = dfx.diffeqsolve(
            dfx.ODETerm(vector_field),
            dfx.Tsit5(),
            0.0,
            2.0,
            0.05,
            y0,
            args=params,
            saveat=dfx.SaveAt(ts=TS),
            stepsize_controller=controller,
            adjoint=adjoint,
            max_steps=max_steps,
        )
        return jnp.sum(sol.ys**2)

    y0 = jnp.array([1.0, -0.5])
    return Case(loss, (params, y0), (0, 1), 1e-4, 1e-5, budget_fraction)


CASES = {
    # What backward holds is the adjoint's own checkpoints, kept by one custom_vjp: no
    # plan holds less than save() (adaptive: 1,368 B, the planner's least plan too).
    # (Before its residuals that are operands or outputs shared their keys, a 90% budget
    # "fit" at 1,548 B predicted and the run held 1,910 B.)
    "constant-recursive": lambda: neural_ode(
        dfx.ConstantStepSize(), dfx.RecursiveCheckpointAdjoint(checkpoints=16), budget_fraction=1.0
    ),
    "adaptive-recursive": lambda: neural_ode(
        dfx.PIDController(1e-4, 1e-6),
        dfx.RecursiveCheckpointAdjoint(checkpoints=16),
        budget_fraction=1.0,
    ),
    # BacksolveAdjoint keeps the final state only: no plan holds half of that.
    "adaptive-backsolve": lambda: neural_ode(
        dfx.PIDController(1e-4, 1e-6), dfx.BacksolveAdjoint(), budget_fraction=1.0
    ),
    # DirectAdjoint's nested bounded loops grow with max_steps: 64 covers the 40 steps.
    "constant-direct": lambda: neural_ode(dfx.ConstantStepSize(), dfx.DirectAdjoint(), 64),
}


@functools.cache
def case(name: str) -> Case:
    return CASES[name]()


# The planner's least peak is above save()'s measured one: 212 B for 208 B. An identity
# custom_jvp hands one array back as two outputs, both kept by the adjoint's custom_vjp:
# two residuals, one array under save(), two under a policy that packs each (offload's
# copies). They cannot share a key: under an outer jax.grad their tangents differ (the
# custom_jvp's rule, or stop_gradient's zero), so backward must read each its own. (233 B
# for 216 B before a custom_vjp's residuals that are its outputs or operands shared their
# keys and kept literals counted nothing.)
XFAIL = {
    ("adaptive-backsolve", "budget"): PLANNER_ABOVE_SAVE,
    ("adaptive-backsolve", "at_save"): PLANNER_ABOVE_SAVE,
    # Constant steps: the planner's least peak is 1,488 B, save()'s measured 1,487 B. Its
    # save() is 1,507 B: the same 4 B kept under two keys, and a cond's two branches
    # summed (16 B: what a jitted cond holds; eagerly the branch taken kept none).
    ("constant-recursive", "budget"): PLANNER_ABOVE_SAVE,
    ("constant-recursive", "at_save"): PLANNER_ABOVE_SAVE,
}


# Over ~10 s on one core: tapegrad's eager interpreter over diffrax's loops, and
# DirectAdjoint's nested loops under offload and the planner.
SLOW = {(name, "eager") for name in CASES} | {
    ("constant-direct", "offload"),
    ("constant-direct", "budget"),
}


@pytest.mark.parametrize("name, mode", matrix(tuple(CASES), XFAIL, SLOW, at_save="slow"))
def test_neural_ode(name, mode):
    check(case(name), mode)
