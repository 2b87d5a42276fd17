"""Anomaly detection (`tg.detect_anomaly`, ``anomaly=True``): the first record that
produces a NaN (or an Inf) is named with its primitive, its value and the user's
source line, in forward and in backward, eagerly and under `jax.jit`; when off,
the compiled program is byte-for-byte the one without the feature.
"""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.anomaly import detect as _anomaly
from tapegrad.engine.checkpoint import plan_recompute
from tapegrad.engine.interpret import backward, forward
from tapegrad.engine.trace import trace_flat

THIS_FILE = os.path.basename(__file__)

pytestmark = pytest.mark.filterwarnings("ignore:tapegrad anomaly detection is enabled")


def line_of(marker: str) -> str:
    """``test_anomaly.py:<line>`` of the source line ending with ``marker``."""
    with open(__file__) as fh:
        for i, line in enumerate(fh, 1):
            if line.rstrip().endswith(marker):
                return f"{THIS_FILE}:{i}"
    raise AssertionError(marker)


# The programs. Each marked line is where the anomaly must be reported.


def log_of_shifted(x):
    y = x - 1.0  # SHIFT
    z = jnp.log(y)  # FWD-NAN
    return jnp.sum(z * 2.0)


def log_of_square(x):
    y = x**2  # SQUARE
    return jnp.sum(jnp.log(y))  # LOG-SQUARE


def sqrt_sum(x):
    return jnp.sum(jnp.sqrt(x))  # SQRT


def safe_log(x):
    # NaN in forward that the where discards (and the double-where keeps out of backward).
    ok = x > 0
    return jnp.sum(
        jnp.where(ok, jnp.log(jnp.where(ok, x, 1.0)), 0.0) + jnp.log(jnp.abs(x) - 5.0) * 0.0
    )


X0 = jnp.array([0.0, 1.0, 2.0])


# ---------------------------------------------------------------- forward


def test_forward_nan_names_record_line_and_chain():
    with pytest.raises(tg.AnomalyError) as ei:
        tg.grad(log_of_shifted, anomaly=True)(jnp.array([0.5, 2.0]))
    err = ei.value
    assert isinstance(err, FloatingPointError) and isinstance(err, tg.TapegradError)
    msg = str(err)
    assert msg.startswith("NaN in the output of 'log'")
    assert f"{line_of('# FWD-NAN')} (log_of_shifted)" in msg
    assert "its output 0 (c:f32[2])" in msg
    # The chain of records that fed it: the subtraction, with its own line.
    chain = msg.split("The records that fed it:")[1]
    assert "= sub" in chain and line_of("# SHIFT") in chain
    assert "What to do" in msg


def test_forward_inf_needs_check_inf():
    x = jnp.array([1.0, 2.0])  # log(x - 1) = -inf at 1: an Inf, not a NaN
    g = tg.grad(log_of_shifted, anomaly=True)(x)  # NaN checks only: no error
    np.testing.assert_array_equal(g, jax.grad(log_of_shifted)(x))
    with pytest.raises(tg.AnomalyError, match=r"^Inf in the output of 'log'") as ei:
        tg.grad(log_of_shifted, anomaly=tg.AnomalyMode(check_inf=True))(x)
    assert line_of("# FWD-NAN") in str(ei.value)


def test_forward_nan_in_input_is_reported_as_input():
    with pytest.raises(tg.AnomalyError, match=r"NaN in the function's input \[0\]\['w'\]"):
        tg.grad(lambda p: jnp.sum(p["w"] * 2.0), anomaly=True)({"w": jnp.array([1.0, np.nan])})


def test_forward_check_can_be_turned_off_for_intended_nans():
    x = jnp.array([-1.0, 0.5, 2.0])
    with pytest.raises(tg.AnomalyError, match="'log'"):
        tg.grad(safe_log, anomaly=True)(x)
    g = tg.grad(safe_log, anomaly=tg.AnomalyMode(forward=False))(x)
    np.testing.assert_allclose(g, jax.grad(safe_log)(x))


# ---------------------------------------------------------------- backward


def test_backward_nan_log_of_square_at_zero():
    # Forward is NaN-free (log(0) = -inf); backward: d log/dy = 1/0 = inf, then
    # integer_pow's rule computes inf * 2 * 0 = NaN -- PyTorch reports PowBackward0.
    with pytest.raises(tg.AnomalyError) as ei:
        tg.grad(log_of_square, anomaly=True)(X0)
    msg = str(ei.value)
    assert msg.startswith(
        "backward of 'integer_pow' (record #0) returned NaN values in its 0th "
        "output: the cotangent of its input 0 (a:f32[3])"
    ), msg
    assert f"{line_of('# SQUARE')} (log_of_square)" in msg  # the forward record's line


def test_backward_inf_reported_with_check_inf():
    # With Inf checks, forward's log(0) = -inf comes first ...
    with pytest.raises(tg.AnomalyError, match=r"^Inf in the output of 'log'"):
        tg.grad(log_of_square, anomaly=tg.AnomalyMode(check_inf=True))(X0)
    # ... and checking backward only, log's rule returns 1/0 = inf before integer_pow's NaN.
    with pytest.raises(tg.AnomalyError) as ei:
        tg.grad(log_of_square, anomaly=tg.AnomalyMode(check_inf=True, forward=False))(X0)
    msg = str(ei.value)
    assert msg.startswith("backward of 'log'") and "Inf values" in msg
    assert line_of("# LOG-SQUARE") in msg
    # The forward records that fed it: the square, with its line.
    assert "integer_pow" in msg.split("fed it:")[1] and line_of("# SQUARE") in msg


def test_sqrt_at_zero_forward_finite_backward_inf():
    x = jnp.array([0.0, 4.0])
    # NaN checks only (PyTorch's default): an infinite gradient is not an anomaly.
    g = tg.grad(sqrt_sum, anomaly=True)(x)
    np.testing.assert_array_equal(g, jax.grad(sqrt_sum)(x))
    assert np.isinf(g[0])
    with pytest.raises(tg.AnomalyError) as ei:
        tg.grad(sqrt_sum, anomaly=tg.AnomalyMode(check_inf=True))(x)
    msg = str(ei.value)
    assert msg.startswith("backward of 'sqrt' (record #0) returned Inf values in its 0th output")
    assert f"{line_of('# SQRT')} (sqrt_sum)" in msg


def test_vjp_checks_forward_at_call_and_backward_per_vjp_fn():
    with pytest.raises(tg.AnomalyError, match="NaN in the output of 'log'"):
        tg.vjp(log_of_shifted, jnp.array([0.5]), anomaly=True)
    out, vjp_fn = tg.vjp(log_of_square, X0, anomaly=True)
    with pytest.raises(tg.AnomalyError, match="backward of 'integer_pow'"):
        vjp_fn(jnp.ones(()))
    # A NaN cotangent from the caller is blamed on the caller, not on a rule.
    out, vjp_fn = tg.vjp(lambda x: jnp.sin(x), jnp.ones(2), anomaly=True)
    with pytest.raises(tg.AnomalyError, match="cotangent passed to vjp_fn"):
        vjp_fn(jnp.array([1.0, np.nan]))
    np.testing.assert_allclose(vjp_fn(jnp.ones(2))[0], jnp.cos(jnp.ones(2)))


def test_value_and_grad_and_clean_gradients_match_jax():
    f = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)
    w, x = jnp.ones((3, 2)) * 0.3, jnp.arange(6.0).reshape(2, 3) / 6
    got = tg.value_and_grad(f, argnums=(0, 1), anomaly=True)(w, x)
    want = jax.value_and_grad(f, argnums=(0, 1))(w, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)


# ---------------------------------------------------------------- under jax transforms


def _runtime_error_text(thunk) -> str:
    # jax re-raises a callback's error as jax.errors.JaxRuntimeError (Python dispatch, e.g.
    # a first call) or ValueError (its C++ fast path), carrying the AnomalyError's text.
    with pytest.raises((RuntimeError, ValueError)) as ei:
        jax.block_until_ready(thunk())
    return str(ei.value)


def test_under_jit_forward_raises_when_the_compiled_call_runs():
    g = jax.jit(tg.grad(log_of_shifted, anomaly=True))
    np.testing.assert_allclose(
        g(jnp.array([2.0, 3.0])), jax.grad(log_of_shifted)(jnp.array([2.0, 3.0]))
    )
    msg = _runtime_error_text(lambda: g(jnp.array([0.5, 2.0])))  # same compiled program
    assert "AnomalyError: NaN in the output of 'log'" in msg
    assert f"{line_of('# FWD-NAN')} (log_of_shifted)" in msg
    assert line_of("# SHIFT") in msg


def test_under_jit_backward_raises_naming_the_source():
    msg = _runtime_error_text(lambda: jax.jit(tg.grad(log_of_square, anomaly=True))(X0))
    assert "backward of 'integer_pow'" in msg and line_of("# SQUARE") in msg


def test_under_jit_the_check_survives_when_only_part_of_the_result_is_used():
    two = lambda x, w: jnp.sum(jnp.log((x * w) ** 2))  # noqa: E731
    only_dw = jax.jit(lambda x, w: tg.grad(two, argnums=(0, 1), anomaly=True)(x, w)[1])
    msg = _runtime_error_text(lambda: only_dw(X0, jnp.ones(3)))
    assert "backward of 'integer_pow'" in msg
    only_value = jax.jit(lambda x: tg.value_and_grad(log_of_shifted, anomaly=True)(x)[0])
    assert "NaN in the output of 'log'" in _runtime_error_text(lambda: only_value(X0))


def test_under_jit_vjp():
    def run(x):
        out, vjp_fn = tg.vjp(log_of_square, x, anomaly=True)
        return vjp_fn(jnp.ones(()))[0]

    msg = _runtime_error_text(lambda: jax.jit(run)(X0))
    assert "backward of 'integer_pow'" in msg


def test_under_vmap_and_outer_grad():
    xs = jnp.array([[1.0, 2.0, 3.0], [0.0, 1.0, 2.0]])
    with pytest.raises(Exception, match="backward of 'integer_pow'"):
        jax.block_until_ready(jax.vmap(tg.grad(log_of_square, anomaly=True))(xs))
    clean = xs[:1] + 1.0
    np.testing.assert_allclose(
        jax.vmap(tg.grad(log_of_square, anomaly=True))(clean),
        jax.vmap(jax.grad(log_of_square))(clean),
        rtol=1e-6,
    )
    h = lambda x: jnp.sum(tg.grad(lambda x: jnp.sum(jnp.sin(x) ** 2), anomaly=True)(x))
    x = jnp.array([0.3, 0.7])
    np.testing.assert_allclose(
        jax.grad(h)(x),
        jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(x)))(x),
        rtol=1e-6,
    )


# ---------------------------------------------------------------- zero cost when off


def _f(x):
    return jnp.sum(jnp.tanh(x) ** 2 * jnp.sin(x))


def _reference_grad(x):
    """The pipeline without anything anomaly detection or passes added: trace, plan,
    forward, backward."""
    tape = plan_recompute(trace_flat(lambda x: [_f(x)], [x], [True]), None)
    outs, res = forward(tape, [x])
    (ct,) = backward(tape, res, [jnp.ones((), outs[0].dtype)], retain=False)
    return ct


_reference_grad.__name__ = "_f"  # jax names the HLO module after the function


def test_off_compiles_to_the_same_hlo_as_without_the_feature():
    x = jnp.linspace(-1.0, 1.0, 8)
    without = jax.jit(_reference_grad).lower(x).as_text()
    assert jax.jit(tg.grad(_f)).lower(x).as_text() == without
    assert jax.jit(tg.grad(_f, anomaly=False)).lower(x).as_text() == without
    with tg.set_detect_anomaly(False):
        assert jax.jit(tg.grad(_f)).lower(x).as_text() == without
    with_anomaly = jax.jit(tg.grad(_f, anomaly=True)).lower(x).as_text()
    assert with_anomaly != without and "callback" in with_anomaly  # the test can see a difference
    np.testing.assert_array_equal(jax.jit(tg.grad(_f, anomaly=True))(x), jax.jit(tg.grad(_f))(x))


def test_off_passes_no_observer(monkeypatch):
    seen = []
    real = _anomaly.observer
    monkeypatch.setattr(
        _anomaly, "observer", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1]
    )
    tg.grad(_f)(jnp.ones(2))
    tg.vjp(_f, jnp.ones(2))
    assert seen == [None, None]


# ---------------------------------------------------------------- switching it on and off


def test_context_managers_nest_and_restore():
    assert not tg.is_anomaly_enabled()
    with tg.detect_anomaly():
        assert tg.is_anomaly_enabled()
        with pytest.raises(tg.AnomalyError):
            tg.grad(log_of_square)(X0)
        with tg.set_detect_anomaly(False):
            assert not tg.is_anomaly_enabled()
            tg.grad(log_of_square)(X0)  # NaN gradient, no error
        assert tg.is_anomaly_enabled()
        tg.grad(log_of_square, anomaly=False)(X0)  # the argument wins over the scope
    assert not tg.is_anomaly_enabled()
    with pytest.raises(ZeroDivisionError):
        with tg.detect_anomaly():
            _ = 1 / 0
    assert not tg.is_anomaly_enabled()  # restored when the body raises


def test_set_detect_anomaly_as_a_call_and_detect_anomaly_as_a_decorator():
    token = tg.set_detect_anomaly(True, check_inf=True)
    try:
        assert _anomaly.resolve(None) == tg.AnomalyMode(check_inf=True)
        with pytest.raises(tg.AnomalyError, match="Inf"):
            tg.grad(sqrt_sum)(jnp.array([0.0, 1.0]))
    finally:
        token.__exit__(None, None, None)
    assert not tg.is_anomaly_enabled()

    @tg.detect_anomaly()
    def run():
        return tg.grad(log_of_square)(X0)

    with pytest.raises(tg.AnomalyError):
        run()
    assert not tg.is_anomaly_enabled()


def test_bad_arguments():
    with pytest.raises(TypeError, match="anomaly="):
        tg.grad(_f, anomaly="yes")
    with pytest.raises(ValueError, match="checks nothing"):
        tg.detect_anomaly(check_nan=False)


def test_warns_once_when_enabled(monkeypatch):
    monkeypatch.setattr(_anomaly, "_WARNED", False)
    with pytest.warns(UserWarning, match="slows forward and backward") as rec:
        tg.detect_anomaly()
    assert rec[0].filename == __file__  # points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tg.detect_anomaly()  # once per process, as PyTorch's is per call site
        tg.grad(_f, anomaly=True)
