"""Shape and layout rules (structural.py) against jax.vjp."""

import jax
import numpy as np
import pytest
from jax import lax

import tapegrad as tg

CASES = {
    "reshape": lambda x: lax.reshape(x, (6, 4)),
    "reshape_dimensions": lambda x: lax.reshape(x, (24,), dimensions=(2, 0, 1)),
    "squeeze": lambda x: lax.squeeze(x[:1], (0,)),
    "expand_dims": lambda x: lax.expand_dims(x, (1,)),
    "transpose": lambda x: lax.transpose(x, (2, 0, 1)),
    "broadcast_in_dim": lambda x: lax.broadcast_in_dim(x[:, :1], (5, 2, 3, 4), (1, 2, 3)),
    "reduce_sum": lambda x: lax.reduce_sum(x, (0, 2)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_structural_vjp_matches_jax(name):
    f = CASES[name]
    x = jax.random.normal(jax.random.key(0), (2, 3, 4))
    out, vjp_tg = tg.vjp(f, x)
    ref, vjp_jax = jax.vjp(f, x)
    ct = jax.random.normal(jax.random.key(1), ref.shape)
    np.testing.assert_allclose(out, ref)
    np.testing.assert_allclose(vjp_tg(ct)[0], vjp_jax(ct)[0], rtol=1e-6)
    tape = tg.trace(f)(x)
    assert all(r.rule == "rule" and r.saves == () for r in tape.records if r.in_backward)
