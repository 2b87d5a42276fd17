"""Every input form `jax.grad` accepts works under every built-in policy: Python floats
and ints, numpy arrays and scalars (float32 and float64), weakly typed values, and
pytrees (dict, tuple, list, None leaves) of them. Gradients equal `jax.grad`'s, with the
same structure and dtypes: exactly for lossless policies, within the rounding of the
format for compressing ones. A fixed set of cases: the same every run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapegrad as tg
from tapegrad import policies as P


def loss(params, x, k):
    """Reads every leaf of ``params`` (but the None) and mixes them with ``x``; ``k`` is a
    non-differentiated multiplier (an int where the case says so)."""
    b, c = params["bc"]
    h = jnp.tanh(x * params["w"] + b)
    return jnp.sum(jnp.sin(h) * c) * k + jnp.sum(h**2) + jnp.sum(jnp.exp(x * 0.5))


# (params, x, k): every value well-conditioned (|tanh's argument| < 1), so compressed
# residuals perturb the gradient by about the format's rounding.
CASES = {
    "python": ({"w": 0.7, "bc": (0.1, 0.3), "none": None}, 0.4, 2),
    "python-int-k": ({"w": 0.5, "bc": [-0.2, 1.0], "none": None}, -0.3, 3),
    "numpy": (
        {
            "w": np.array([0.7, -0.4, 0.2], np.float32),
            "bc": [np.array([0.1, 0.0, -0.1], np.float32), np.linspace(0.2, 0.6, 3)],  # f64
            "none": None,
        },
        np.array([0.4, 0.5, -0.6], np.float32),
        np.int32(2),
    ),
    "numpy-scalars": (
        {"w": np.float32(0.7), "bc": (np.float64(0.1), np.float32(0.3)), "none": None},
        np.float64(0.4),
        np.float32(1.5),
    ),
    "weak": (
        {"w": jnp.asarray(0.7), "bc": (jnp.asarray(0.1), 0.3), "none": None},
        jnp.arange(3.0) * 0.2,
        1.5,
    ),
    "mixed": (
        {
            "w": jnp.array([0.7, -0.4, 0.2]),
            "bc": [0.1, np.array([[0.3], [0.5]], np.float32)],
            "none": None,
        },
        np.linspace(-0.5, 0.5, 6).reshape(2, 3),
        jnp.float32(0.5),
    ),
}


class CopyAll:
    """A custom policy: a copy of whatever it is given (no inputs, by default)."""

    def pack(self, value, info):
        return jnp.copy(value)

    def unpack(self, packed, info):
        return packed


class CopyAllInputsToo(CopyAll):
    inputs = True


def _never(rec):
    return False  # recompute everything that can be


def _dots(rec):
    return rec.primitive == "dot_general" or rec.primitive == "mul"


# name -> (policy, tolerance on the relative gradient error; 0 = lossless)
POLICIES = {
    "save": (P.save(), 0),
    "offload": (P.offload(), 0),
    "offload-inputs": (P.offload(inputs=True), 0),
    "bf16": (P.compress(jnp.bfloat16), 2e-2),
    "bf16-inputs": (P.compress(jnp.bfloat16, inputs=True), 2e-2),
    "int8-inputs": (P.compress("int8", inputs=True), 3e-2),
    "route": (
        P.route(
            lambda i: P.offload(inputs=True) if i.is_input else P.compress(jnp.float16, inputs=True)
        ),
        3e-3,
    ),
    "budget": (P.budget(bytes=1 << 20), 0),
    "budget-bf16": (P.budget(bytes=1 << 20, base=P.compress(jnp.bfloat16, inputs=True)), 2e-2),
    "hooks": (P.hooks(lambda a: a, lambda a: a), 0),
    "hooks-copy": (P.hooks(jnp.copy, jnp.asarray, inputs=False), 0),
    "selective-recompute": (tg.selective(_never), 0),
    "selective-offload": (tg.selective(_dots, base=P.offload(inputs=True)), 0),
    "scan_checkpoint": (P.scan_checkpoint(), 0),
    "custom": (CopyAll(), 0),
    "custom-inputs": (CopyAllInputsToo(), 0),
}


def _check(got, want, tol, what):
    assert jax.tree.structure(got) == jax.tree.structure(want), what
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.shape(a) == np.shape(b) and jnp.result_type(a) == jnp.result_type(b), (
            what,
            np.shape(a),
            jnp.result_type(a),
            np.shape(b),
            jnp.result_type(b),
        )
    ga = np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in jax.tree.leaves(got)])
    gb = np.concatenate([np.ravel(np.asarray(b, np.float64)) for b in jax.tree.leaves(want)])
    if tol == 0:
        np.testing.assert_allclose(ga, gb, rtol=1e-5, atol=1e-6, err_msg=what)
    else:
        err = np.linalg.norm(ga - gb) / np.linalg.norm(gb)
        assert err < tol, (what, err)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(POLICIES))
def test_gradients_equal_jax_for_every_input_form(name, case):
    params, x, k = CASES[case]
    policy, tol = POLICIES[name]
    want = jax.grad(loss, argnums=(0, 1))(params, x, k)
    got = tg.grad(loss, argnums=(0, 1), policy=policy)(params, x, k)
    _check(got, want, tol, f"{name} on {case}")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", ["save", "bf16-inputs", "route"])
def test_same_under_jit(name, case):
    params, x, k = CASES[case]
    policy, tol = POLICIES[name]
    want = jax.grad(loss, argnums=(0, 1))(params, x, k)
    got = jax.jit(tg.grad(loss, argnums=(0, 1), policy=policy))(params, x, k)
    _check(got, want, tol, f"{name} on {case} under jit")


@pytest.mark.parametrize("case", ["python", "numpy-scalars", "weak"])
def test_value_and_grad_and_saved_tensors_hooks(case):
    params, x, k = CASES[case]
    shapes = []
    want_v, want_g = jax.value_and_grad(loss, argnums=(0, 1))(params, x, k)
    with tg.saved_tensors_hooks(lambda a: (shapes.append(jnp.shape(a)), a)[1], lambda a: a):
        v, g = tg.value_and_grad(loss, argnums=(0, 1))(params, x, k)
    _check(g, want_g, 0, case)
    np.testing.assert_allclose(v, want_v, rtol=1e-6)
    assert shapes  # the hooks ran, and got arrays (a Python scalar input included)


def test_an_int_input_to_differentiate_is_refused_as_jax_does():
    params, x, _ = CASES["python"]
    with pytest.raises(TypeError, match="int"):
        jax.grad(loss, argnums=1)(params, 1, 2)
    with pytest.raises(TypeError, match="int"):
        tg.grad(loss, argnums=1, policy=P.compress(jnp.bfloat16))(params, 1, 2)
