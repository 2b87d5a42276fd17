"""``detect_anomaly(halt=False)``: every origin of a NaN/Inf, none of its copies; the
operands of the failing record; ``post_mortem=True``.

Oracles: programs whose origins are known by construction (which line makes the first
NaN, which rule's derivative is infinite), numpy's own counts for operand summaries,
and ``jax.grad`` for the gradient the run still returns.
"""

from __future__ import annotations

import inspect
import pdb
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapegrad as tg

warnings.filterwarnings("ignore", "tapegrad anomaly detection is enabled")


def _line(fn, text: str) -> int:
    src, first = inspect.getsourcelines(fn)
    return first + next(i for i, s in enumerate(src) if text in s)


def two_origins(x):
    a = jnp.log(x)  # forward origin: log of a negative number
    c = a * 2.0 + 1.0  # copies of it
    b = x * 0.0
    d = jnp.sqrt(b)  # backward origin: sqrt's derivative at 0 is infinite
    return jnp.sum(c) + jnp.sum(d)


X = jnp.array([-1.0, 2.0, 3.0])


def _where(e) -> tuple:
    return (e.phase, e.kind, e.primitive, int(e.source.split(":")[1].split()[0]))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_every_origin_and_no_copy(jit):
    grad = tg.grad(two_origins)
    with tg.detect_anomaly(check_inf=True, halt=False) as log:
        g = (jax.jit(grad) if jit else grad)(X)
        jax.block_until_ready(g)
    assert isinstance(log, tg.AnomalyLog)
    assert [_where(e) for e in log.events] == [
        ("forward", "NaN", "log", _line(two_origins, "jnp.log(x)")),
        ("backward", "Inf", "sqrt", _line(two_origins, "jnp.sqrt(b)")),
    ]
    assert all(e.step is None for e in log.events)
    # it ran to the end: the gradient is jax's, NaN and Inf included
    np.testing.assert_array_equal(np.asarray(g), np.asarray(jax.grad(two_origins)(X)))
    if jit:
        assert all(e.operands is None for e in log.events)  # values stay in the program
    else:
        (op,) = log.events[0].operands
        assert (op.shape, op.nan, op.inf, op.min, op.max) == ((3,), 0, 0, -1.0, 3.0)
    text = str(log)
    assert "2 origin(s)" in text and "log" in text and "sqrt" in text
    assert "<table" in log._repr_html_()


def test_nan_only_by_default_and_a_clean_run_logs_nothing():
    with tg.detect_anomaly(halt=False) as log:
        tg.grad(two_origins)(X)
    # Inf is not checked by default: the NaN backward makes first is mul's (inf * 0)
    assert [(e.primitive, e.phase) for e in log.events] == [("log", "forward"), ("mul", "backward")]

    def clean(x):
        return jnp.sum(jnp.log(x) * jnp.sqrt(x))

    with tg.detect_anomaly(check_inf=True, halt=False) as log:
        g = tg.grad(clean)(jnp.array([1.0, 2.0, 3.0]))
    assert log.events == [] and "no NaN or Inf" in str(log)
    np.testing.assert_allclose(g, jax.grad(clean)(jnp.array([1.0, 2.0, 3.0])), rtol=1e-6)


def test_two_independent_forward_origins():
    def f(x, y):
        a = jnp.log(x)
        b = jnp.arcsin(y)  # independent of a
        return jnp.sum(a * b)

    with tg.detect_anomaly(halt=False) as log:
        tg.grad(f)(jnp.array([-1.0, 1.0]), jnp.array([2.0, 0.5]))
    assert [(e.primitive, e.phase) for e in log.events] == [("log", "forward"), ("asin", "forward")]


def test_inside_a_scan_every_step_and_the_carry_passed_on():
    def h(x):
        def step(c, xi):
            c = c + jnp.log(xi)  # NaN at steps 2 and 4; the carry keeps step 2's
            return c * 1.0, c

        _, ys = jax.lax.scan(step, 0.0, x)
        return jnp.sum(ys)

    with tg.detect_anomaly(halt=False) as log:
        tg.grad(h)(jnp.array([1.0, 2.0, -1.0, 3.0, -2.0]))
    # log at step 4 is an origin of its own (its input is finite); the adds and muls of
    # steps 2-4 that read the NaN carry are copies
    assert [(e.primitive, e.step, e.phase) for e in log.events] == [
        ("log", (2,), "forward"),
        ("log", (4,), "forward"),
    ]
    assert "step 2" in log.events[0].message


def test_a_scan_of_a_non_finite_input_is_a_copy():
    def h(x):
        y = jnp.log(x)  # the origin

        def step(c, yi):
            return c + jnp.sin(yi), None

        c, _ = jax.lax.scan(step, 0.0, y)
        return c

    with tg.detect_anomaly(halt=False) as log:
        tg.grad(h)(jnp.array([1.0, -1.0, 2.0]))
    assert [(e.primitive, e.step) for e in log.events] == [("log", None)]


def test_a_halting_error_carries_the_record_and_its_operands():
    def f(x, y):
        return jnp.sum(jnp.log(x * y))

    x = jnp.array([1.0, -2.0, 1e30, 4.0])
    y = jnp.array([1.0, 1.0, 1e30, jnp.nan])
    with pytest.raises(tg.AnomalyError) as info, tg.detect_anomaly(check_inf=True):
        tg.grad(f)(x, jnp.array([1.0, 1.0, 1e30, 1.0]))
    err = info.value
    assert err.record.primitive == "mul"  # 1e30 * 1e30 overflows: the first Inf
    a, b = err.operands
    assert (a.shape, a.inf, a.nan, a.min) == ((4,), 0, 0, -2.0)
    assert (b.inf, b.nan, b.min) == (0, 0, 1.0)
    assert a.max == pytest.approx(1e30, rel=1e-6) and b.max == pytest.approx(1e30, rel=1e-6)
    assert "Its operands:" in str(err)
    with pytest.raises(tg.AnomalyError) as info, tg.detect_anomaly():
        tg.grad(f)(jnp.array([1.0, 2.0, 3.0, 4.0]), y)  # y (not differentiated) has a NaN
    a, b = info.value.operands
    assert info.value.record.primitive == "mul" and (a.nan, b.nan) == (0, 1)


def test_post_mortem_opens_pdb_in_the_callers_frame(monkeypatch):
    seen = {}

    def fake_set_trace(self, frame=None):
        seen["frame"] = frame
        seen["anomaly"] = frame.f_locals.get("anomaly")

    monkeypatch.setattr(pdb.Pdb, "set_trace", fake_set_trace)
    with pytest.raises(tg.AnomalyError) as info, tg.detect_anomaly(post_mortem=True):
        tg.grad(two_origins)(X)
    assert seen["frame"].f_code.co_name == "test_post_mortem_opens_pdb_in_the_callers_frame"
    assert seen["anomaly"] is info.value
    assert seen["anomaly"].record.primitive == "log"


def test_vjp_fn_called_later_logs_into_its_block():
    with tg.detect_anomaly(check_inf=True, halt=False) as log:
        _, vjp_fn = tg.vjp(two_origins, X)
        vjp_fn(jnp.ones(()))
    assert [e.phase for e in log.events] == ["forward", "backward"]


@pytest.mark.parametrize("n", [4, 4096, 262_144])
def test_a_nan_in_a_large_array_is_found(n):
    """XLA's CPU reduce-max drops NaNs in large arrays: the check must not rely on it."""

    def f(x):
        return jnp.sum(jnp.sqrt(x - 1.0))  # NaN where x < 1

    x = jnp.ones(n).at[n // 3].set(0.0)
    with pytest.raises(tg.AnomalyError, match="NaN in the output of 'sqrt'"), tg.detect_anomaly():
        tg.grad(f)(x)
    with pytest.raises(tg.AnomalyError, match="NaN in the output of 'sqrt'"), tg.detect_anomaly():
        tg.grad(f)(jnp.zeros(n))  # every element NaN
