"""gradcheck's contracts, ported from PyTorch's TestAutograd gradcheck tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import tapegrad as tg

from ._torch import torch

FAST = pytest.mark.parametrize("fast_mode", [False, True], ids=["slow", "fast"])


def _x(n=3):
    return np.random.default_rng(0).standard_normal(n)


@FAST
def test_backward_not_multiplied_by_grad_output_fails(fast_mode):
    """test_gradcheck_backward_mul_by_grad_output: a hook ``g + 1e-2`` passes the
    Jacobian check at atol=1e-1, and fails the zero-cotangent check (a correct backward
    of a zero cotangent is zero)."""
    f = lambda x: tg.hook(x * 1.0, lambda g: g + 1e-2)
    with pytest.raises(tg.GradcheckError, match="backward not multiplied by grad_output"):
        tg.gradcheck(f, (_x(),), atol=1e-1, fast_mode=fast_mode)
    assert not tg.gradcheck(f, (_x(),), atol=1e-1, fast_mode=fast_mode, raise_exception=False)
    # a hook that scales passes: the derivative it claims is checked, and it is wrong
    scaled = lambda x: tg.hook(x * 1.0, lambda g: g * (1 + 1e-4))
    assert tg.gradcheck(scaled, (_x(),), atol=1e-1, fast_mode=fast_mode)


@FAST
def test_a_custom_function_whose_backward_adds_a_constant_fails(fast_mode):
    class AddsOne(tg.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            return g * 2.0 + 1e-2

    with pytest.raises(tg.GradcheckError, match="backward not multiplied by grad_output"):
        tg.gradcheck(AddsOne.apply, (_x(),), atol=1e-1, fast_mode=fast_mode)


@FAST
def test_no_outputs_at_all_passes(fast_mode):
    """test_gradcheck_check_no_differentiable_outputs: ``gradcheck(lambda x: (), (x,))``
    is True."""
    assert tg.gradcheck(lambda x: (), (_x(),), fast_mode=fast_mode)
    assert tg.gradcheck(lambda x: jnp.argmax(x), (_x(),), fast_mode=fast_mode)  # integers


@FAST
def test_no_differentiable_output_whose_value_moves_fails(fast_mode):
    """The same test's other half: no differentiable output, but the numerical gradient
    is not zero. (A detached float output, PyTorch's ``torch.tensor([x])``, is a
    differentiable output with a zero derivative here, so it fails as a mismatch.)"""
    moves = lambda x: jnp.floor(x * 1e9).astype(jnp.int64)
    with pytest.raises(tg.GradcheckError, match="Numerical gradient for function expected"):
        tg.gradcheck(moves, (_x(),), fast_mode=fast_mode)
    with pytest.raises(tg.GradcheckError, match="mismatch for output 0"):
        tg.gradcheck(lambda x: lax.stop_gradient(x), (_x(),), fast_mode=fast_mode)


@FAST
def test_mismatch_names_the_output(fast_mode):
    """test_gradcheck_jacobian_mismatch's message: 'Jacobian mismatch for output 1 with
    respect to input 0', in fast mode as in slow mode."""
    f = lambda x: (x * 2.0, tg.hook(x * 1.0, lambda g: g * 1.1))
    with pytest.raises(tg.GradcheckError, match=r"mismatch for output 1 with respect to input 0"):
        tg.gradcheck(f, (_x(),), fast_mode=fast_mode)
    assert tg.gradcheck(lambda x: (x * 2.0, jnp.sin(x)), (_x(),), fast_mode=fast_mode)


def test_gradcheck_contracts_as_torch():
    t = torch()
    x = t.ones(1, dtype=t.float64, requires_grad=True)

    def fn2(x):
        y = x.clone()
        y.register_hook(lambda g: g + 1e-2)
        return y

    for fast_mode in (False, True):
        with pytest.raises(RuntimeError, match="backward not multiplied by grad_output"):
            t.autograd.gradcheck(fn2, (x,), atol=1e-1, fast_mode=fast_mode)
        assert t.autograd.gradcheck(lambda x: (), (x,), fast_mode=fast_mode)
        with pytest.raises(RuntimeError, match="Numerical gradient for function expected"):
            t.autograd.gradcheck(lambda x: t.tensor([x.detach()]), (x,), fast_mode=fast_mode)
