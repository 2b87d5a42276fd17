"""`tg.passes.check_finite`: a check record after every record with floating outputs,
raising `tg.AnomalyError` at the first NaN/Inf with the record's source line, eagerly
and under jit; a clean program's gradient is unchanged."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.passes import check_finite, dce, validate

THIS_FILE = os.path.basename(__file__)


def line_of(marker: str) -> str:
    with open(__file__) as fh:
        for i, line in enumerate(fh, 1):
            if line.rstrip().endswith(marker):
                return f"{THIS_FILE}:{i}"
    raise AssertionError(marker)


def f(x):
    y = jnp.sin(x) + 2.0
    z = jnp.log(y - 2.5)  # LOG-LINE
    return jnp.sum(z * z)


def g(x):
    return jnp.sum(jnp.log(x) * 2.0)  # INF-LINE


def test_inserts_one_check_per_record_with_float_outputs():
    def h(x, n):
        return jnp.sum(jnp.sin(x) * n), jnp.argmax(x)  # argmax: an integer output

    tape = tg.trace(h, argnums=0)(jnp.ones(3), 2.0)
    out = check_finite(tape)
    validate(out)
    checks = [r for r in out.records if r.primitive == "check_finite"]
    floating = [
        r for r in tape.records if any(jnp.issubdtype(o.dtype, jnp.inexact) for o in r.outputs)
    ]
    assert len(checks) == len(floating) + 1  # + the inputs
    assert out.records[0].primitive == "check_finite" and out.records[0].params["of"] == "inputs"
    assert "check_finite" in str(out)  # visible on the printed tape
    assert all(r.primitive != "check_finite" for r in tape.records)  # input untouched
    # Each check follows its record and checks exactly that record's floating outputs.
    for k, r in enumerate(out.records):
        if r.primitive == "check_finite" and k > 0:
            prev = out.records[k - 1]
            assert [v.id for v in r.inputs] == [
                o.id for o in prev.outputs if jnp.issubdtype(o.dtype, jnp.inexact)
            ]


def test_clean_gradient_is_unchanged():
    x = jnp.full((5,), 1.2)  # sin(1.2) + 2 - 2.5 > 0: the log is finite
    got = tg.grad(f, passes=[check_finite])(x)
    np.testing.assert_allclose(got, jax.grad(f)(x), rtol=1e-6)
    np.testing.assert_allclose(
        jax.jit(tg.grad(f, passes=[check_finite]))(x), jax.grad(f)(x), rtol=1e-6
    )


def test_nan_raises_naming_the_record_and_line():
    x = jnp.array([1.2, -1.0])  # sin(-1) + 2 - 2.5 < 0: log of a negative value
    with pytest.raises(tg.AnomalyError) as ei:
        tg.grad(f, passes=[check_finite])(x)
    msg = str(ei.value)
    assert msg.startswith("NaN in the output of 'log'")
    assert f"{line_of('# LOG-LINE')} (f)" in msg
    assert "= sub" in msg  # the chain that fed it


def test_inf_is_checked_by_default_and_can_be_left_out():
    x = jnp.array([0.0, 1.0])
    with pytest.raises(tg.AnomalyError, match=r"^Inf in the output of 'log'") as ei:
        tg.grad(g, passes=[check_finite])(x)
    assert line_of("# INF-LINE") in str(ei.value)
    nan_only = functools.partial(check_finite, check_inf=False)
    got = tg.grad(g, passes=[nan_only])(x)  # -inf forward, inf gradient: no NaN
    np.testing.assert_array_equal(got, jax.grad(g)(x))


def test_nan_input_is_reported_as_an_input():
    with pytest.raises(tg.AnomalyError, match="input #0"):
        tg.grad(g, passes=[check_finite])(jnp.array([np.nan, 1.0]))


def test_under_jit_raises_when_the_compiled_call_runs():
    step = jax.jit(tg.grad(f, passes=[check_finite]))
    step(jnp.full((2,), 1.2))
    with pytest.raises((RuntimeError, ValueError)) as ei:  # jax's wrapping of the callback error
        jax.block_until_ready(step(jnp.array([1.2, -1.0])))
    assert "NaN in the output of 'log'" in str(ei.value)
    assert line_of("# LOG-LINE") in str(ei.value)


def test_dce_keeps_the_checks_and_vjp_accepts_passes():
    tape = dce(check_finite(tg.trace(f)(jnp.ones(2))))
    assert any(r.primitive == "check_finite" for r in tape.records)
    with pytest.raises(tg.AnomalyError):
        tg.vjp(f, jnp.array([-1.0]), passes=[check_finite, dce])
