"""jax-md: force matching with a soft-sphere pair energy in a periodic box. The loss's
forces are ``-jax.grad`` of the energy w.r.t. positions; tapegrad differentiates the loss
(a second derivative of the energy) w.r.t. the potential's parameters and the positions.

Soft spheres, not Lennard-Jones: jax-md's `lennard_jones_pair` has a NaN gradient w.r.t.
``sigma`` under `jax.grad` itself (its self-pairs' ``sigma / 0``), so no oracle exists.
"""

from __future__ import annotations

import functools

import pytest

jax_md = pytest.importorskip("jax_md")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax_md import energy, space  # noqa: E402

from ._zoo import Case, check, matrix  # noqa: E402

# jax-md asks for float64 sums, which jax truncates to float32 without jax_enable_x64.
pytestmark = pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64")

BOX = 3.0
# Recompute's least peak is ~58% of save()'s: the budget is 70%.
BUDGET = dict(budget_fraction=0.7)


def force_matching() -> Case:
    displacement, _ = space.periodic(BOX)

    def pair_energy(params, positions):
        e = energy.soft_sphere_pair(
            displacement, sigma=params["sigma"], epsilon=params["epsilon"], alpha=2.0
        )
        return e(positions)

    def forces(params, positions):
        return -jax.grad(pair_energy, argnums=1)(params, positions)

    # Nine particles near a 3x3 lattice, and the forces of a "true" potential to match.
    lattice = jnp.stack(jnp.meshgrid(jnp.arange(3.0), jnp.arange(3.0)), -1).reshape(-1, 2)
    positions = lattice + 0.5 + 0.05 * jax.random.normal(jax.random.key(0), lattice.shape)
    target = jax.jit(forces)({"sigma": jnp.float32(1.0), "epsilon": jnp.float32(1.2)}, positions)
    params = {"sigma": jnp.float32(0.9), "epsilon": jnp.float32(1.0)}

    def loss(params, positions):
        return jnp.mean((forces(params, positions) - target) ** 2)

    return Case(loss, (params, positions), argnums=(0, 1), rtol=1e-4, atol=1e-6, **BUDGET)


CASES = {"soft_sphere-force_matching": force_matching}


@functools.cache
def case(name: str) -> Case:
    return CASES[name]()


XFAIL: dict = {}


SLOW: set = set()


@pytest.mark.parametrize("name, mode", matrix(tuple(CASES), XFAIL, SLOW, at_save="quick"))
def test_jax_md(name, mode):
    check(case(name), mode)
