"""Arguments checked where they are given, ported from PyTorch's TestCheckpoint (test_utils)
and TestSelectiveActivationCheckpoint (test_autograd)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapegrad as tg

from ._torch import torch


def _chain():
    return [jnp.sin, jnp.tanh, lambda x: x * 2.0]


def test_checkpoint_sequential_takes_one_input():
    """test_checkpoint_sequential_deprecated_multiple_args: a second input raises
    TypeError (it is not taken as ``policy``)."""
    a, b = jnp.ones(3), jnp.ones(3)
    with pytest.raises(TypeError, match="takes 3 positional arguments .* but 4 were given"):
        tg.checkpoint_sequential(_chain(), 1, a, b)
    with pytest.raises(TypeError, match="policy= by keyword"):
        tg.checkpoint_sequential(_chain(), 2, a, None)


def test_checkpoint_sequential_policy_by_keyword():
    P = tg.CheckpointPolicy
    sac = tg.selective(lambda r: P.ALWAYS if r.primitive == "sin" else P.PREFER_RECOMPUTE)
    f = lambda x: jnp.sum(tg.checkpoint_sequential(_chain(), 2, x, policy=sac))
    x = jnp.linspace(-1.0, 1.0, 4)
    want = jax.grad(lambda x: jnp.sum(jnp.tanh(jnp.sin(x)) * 2.0))(x)
    np.testing.assert_allclose(tg.grad(f)(x), want, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(f))(x), want, rtol=1e-6)


@pytest.mark.parametrize("bad", [2, None, "dot_general"])
def test_selective_refuses_a_non_function_when_built(bad):
    """test_bad_inputs (TestSelectiveActivationCheckpoint): a policy that is not a
    function raises TypeError at ``create_selective_checkpoint_contexts(2)``, not at
    first use."""
    with pytest.raises(TypeError, match="tg.selective\\(fn\\): fn must be a function"):
        tg.selective(bad)


def test_argument_errors_as_torch():
    t = torch()
    from torch.utils.checkpoint import checkpoint_sequential, create_selective_checkpoint_contexts

    with pytest.raises(TypeError, match="policy_fn_or_list must be either a function"):
        create_selective_checkpoint_contexts(2)

    class Two(t.nn.Module):
        def forward(self, a, b):
            return a, b

    a = t.randn(1, 4, requires_grad=True)
    b = t.randn(1, 4, requires_grad=True)
    with pytest.raises(TypeError):
        checkpoint_sequential(t.nn.Sequential(Two()), 1, a, b, use_reentrant=False)
