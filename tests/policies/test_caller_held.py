"""Values the caller holds cost backward nothing, in the planner as in `memory_report`
(`Tape.caller_ids`): a value a record hands back as the very array it was given
(`stop_gradient`, an identity custom_jvp such as lineax's `_asarray`) and a custom_vjp residual that
is its operand. Then a budget at save()'s own measured peak is feasible, as it must be:
saving everything meets it by definition."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import tapegrad as tg
from tapegrad import policies as P


@jax.custom_vjp
def scaled_sin(x, w):
    return jnp.sin(x) * w


def _fwd(x, w):
    return jnp.sin(x) * w, (x, w)  # both residuals are the operands themselves


def _bwd(res, g):
    x, w = res
    return g * jnp.cos(x) * w, jnp.sum(g * jnp.sin(x))


scaled_sin.defvjp(_fwd, _bwd)


def stop_gradient_operand(a, b):
    return jnp.sum(jnp.tanh(lax.stop_gradient(a) * b))  # mul keeps stop_gradient(a): a


@jax.custom_jvp
def identity(x):  # lineax's `_asarray`: an identity with its own JVP rule
    return x


identity.defjvp(lambda primals, tangents: (primals[0], tangents[0]))


def custom_jvp_identity_operand(a, b):
    return jnp.sum(jnp.tanh(identity(a) * b))


def custom_vjp_operands(a, b):
    return jnp.sum(jnp.tanh(scaled_sin(a, b[0])))


CASES = [stop_gradient_operand, custom_jvp_identity_operand, custom_vjp_operands]
A, B = jnp.linspace(0.1, 1.0, 16), jnp.linspace(-1.0, 1.0, 16)


@pytest.mark.parametrize("f", CASES, ids=lambda f: f.__name__)
def test_values_the_caller_holds_are_free_in_the_plan(f):
    tape = tg.trace(f, argnums=(0, 1))(A, B)
    free = tape.caller_ids()
    inputs = {v.id for v in tape.inputs}
    # something beyond the inputs themselves is the caller's array, or a derived value
    # (a custom_vjp's residual) is an input's very array and has its key (`aliases`)
    shared = {r.residual_key(s) for r in tape.records for s in r.saves if s.kind == "aux"}
    assert free > inputs or shared & inputs
    kept = tape.residual_vars()
    beyond = sum(n for k, n in kept.items() if k not in free)
    rep = tg.memory_report(f, (0, 1))(A, B)
    # what the planner counts is what memory_report measures beyond the inputs
    assert beyond == rep.device_bytes - rep.input_bytes


@pytest.mark.parametrize("f", CASES, ids=lambda f: f.__name__)
def test_a_budget_at_saves_own_peak_is_feasible(f):
    rep = tg.memory_report(f, (0, 1))(A, B)
    for allow in (("save", "recompute"), ("save", "recompute", "offload")):
        pol = P.budget(bytes=rep.peak_beyond_inputs_bytes, allow=allow)
        got = tg.grad(f, (0, 1), policy=pol)(A, B)
        for g, want in zip(got, jax.grad(f, (0, 1))(A, B)):
            np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)
        assert pol.last["peak_bytes"] <= rep.peak_beyond_inputs_bytes
