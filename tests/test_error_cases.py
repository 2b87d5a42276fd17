"""Everything that can go wrong raises a clear error, never a wrong gradient.

Each error is a `tg.TapegradError` and the matching built-in, names the record and
its source line where there is one, and says what to do. (Errors for bad arguments
to the transforms are in test_errors.py.)
"""

from __future__ import annotations

import builtins
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback
from jax.extend.core import Primitive
from jax.interpreters import mlir

import tapegrad as tg
from tapegrad import errors

THIS_FILE = os.path.basename(__file__)

pytestmark = pytest.mark.filterwarnings("ignore:tapegrad anomaly detection is enabled")


def line_of(marker: str) -> str:
    with open(__file__) as fh:
        for i, line in enumerate(fh, 1):
            if line.rstrip().endswith(marker):
                return f"{THIS_FILE}:{i}"
    raise AssertionError(marker)


# ---------------------------------------------------------------- the error classes


@pytest.mark.parametrize(
    "name, builtin",
    [
        ("AnomalyError", FloatingPointError),
        ("MissingRuleError", NotImplementedError),
        ("EffectError", NotImplementedError),
        ("TracerLeakError", TypeError),
        ("GradcheckError", RuntimeError),
        ("DtypeError", TypeError),
        ("InvalidTapeError", ValueError),
        ("ResidualError", RuntimeError),
        ("NonDifferentiableError", TypeError),
        ("HookError", RuntimeError),
    ],
)
def test_every_error_is_a_tapegrad_error_and_a_builtin(name, builtin):
    cls = getattr(tg, name)
    assert cls is getattr(errors, name) and name in errors.__all__ and name in tg.__all__
    assert issubclass(cls, tg.TapegradError) and issubclass(cls, builtin)
    assert getattr(builtins, builtin.__name__) is builtin


# ---------------------------------------------------------------- no reverse-mode rule

_calls = []
double_p = Primitive("double_no_rule")
double_p.def_impl(lambda x: _calls.append(1) or x * 2)
double_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(double_p, mlir.lower_fun(lambda x: x * 2, multiple_results=False))


def uses_primitive_without_rule(x):
    y = jnp.sin(x)
    return jnp.sum(double_p.bind(y))  # NO-RULE


def test_primitive_without_any_reverse_rule():
    _calls.clear()
    with pytest.raises(tg.MissingRuleError) as ei:
        tg.grad(uses_primitive_without_rule)(jnp.ones(3))
    msg = str(ei.value)
    assert "'double_no_rule'" in msg and line_of("# NO-RULE") in msg
    assert "tg.rules.defvjp" in msg and "custom_vjp" in msg  # what to do
    assert _calls == []  # raised from the tape, before forward ran
    with pytest.raises(NotImplementedError):  # jax's own type for the same problem
        jax.grad(uses_primitive_without_rule)(jnp.ones(3))
    with pytest.raises(tg.MissingRuleError):
        jax.jit(tg.grad(uses_primitive_without_rule))(jnp.ones(3))
    with pytest.raises(tg.MissingRuleError):
        tg.vjp(uses_primitive_without_rule, jnp.ones(3))
    # Not differentiated through it: fine.
    f = lambda w, x: jnp.sum(w * uses_primitive_without_rule(x))
    np.testing.assert_allclose(tg.grad(f)(2.0, jnp.ones(3)), jax.grad(f)(2.0, jnp.ones(3)))


# ---------------------------------------------------------------- residuals


def saves_its_input(x):
    return jnp.sin(x)  # SAVES-INPUT


def test_residual_deleted_before_backward():
    x = jnp.linspace(0.0, 1.0, 3)
    _, vjp_fn = tg.vjp(saves_its_input, x)
    x.delete()
    with pytest.raises(tg.ResidualError) as ei:
        vjp_fn(jnp.ones(3))
    msg = str(ei.value)
    assert "'sin'" in msg and line_of("# SAVES-INPUT") in msg
    assert "deleted" in msg and "jnp.copy" in msg


def test_residual_donated_before_backward():
    x = jnp.linspace(0.0, 1.0, 3)
    _, vjp_fn = tg.vjp(saves_its_input, x)
    jax.jit(lambda a: a + 1.0, donate_argnums=0)(x)
    if not x.is_deleted():
        pytest.skip("this backend does not donate buffers")
    with pytest.raises(tg.ResidualError, match="donated"):
        vjp_fn(jnp.ones(3))


def test_second_backward_after_release():
    _, vjp_fn = tg.vjp(saves_its_input, jnp.ones(3), retain_residuals=False)
    vjp_fn(jnp.ones(3))
    with pytest.raises(tg.ResidualError, match="second time.*retain_residuals=True"):
        vjp_fn(jnp.ones(3))
    _, vjp_fn = tg.vjp(saves_its_input, jnp.ones(3))  # retained by default: fine
    np.testing.assert_array_equal(vjp_fn(jnp.ones(3))[0], vjp_fn(jnp.ones(3))[0])


# ---------------------------------------------------------------- hooks


@pytest.mark.parametrize(
    "bad_unpack, what",
    [
        (lambda a: a[:1], "shape"),
        (lambda a: a.astype(jnp.float16), "dtype"),
        (lambda a: a.T, "shape"),
    ],
    ids=["shape", "dtype", "transposed"],
)
def test_hook_returning_wrong_shape_or_dtype(bad_unpack, what):
    x = jnp.ones((2, 3))
    with tg.saved_tensors_hooks(lambda a: a, bad_unpack):
        _, vjp_fn = tg.vjp(saves_its_input, x)
    with pytest.raises(tg.ResidualError) as ei:
        vjp_fn(jnp.ones((2, 3)))
    msg = str(ei.value)
    assert "'sin'" in msg and line_of("# SAVES-INPUT") in msg
    assert "float32[2, 3]" in msg and "unpack must return" in msg


@pytest.mark.parametrize("where", ["pack", "unpack"])
def test_hook_that_raises_keeps_its_error_and_names_the_residual(where):
    def boom(a):
        raise KeyError(f"{where} failed")

    ok = lambda a: a  # noqa: E731
    policy = tg.policies.hooks(boom if where == "pack" else ok, boom if where == "unpack" else ok)
    with pytest.raises(KeyError) as ei:  # the user's own exception, not a wrapper
        _, vjp_fn = tg.vjp(saves_its_input, jnp.ones(3), policy=policy)
        vjp_fn(jnp.ones(3))
    notes = "\n".join(ei.value.__notes__)
    assert f".{where} for residual" in notes and "'sin'" in notes
    assert line_of("# SAVES-INPUT") in notes


# ---------------------------------------------------------------- tracer leaks

_leaked = []


def leaks_its_input(x):
    _leaked.append(x)  # LEAK
    return jnp.sum(x**2)


def test_tracer_leak_names_the_user_function():
    _leaked.clear()
    tg.grad(leaks_its_input)(jnp.ones(3))
    with pytest.raises(jax.errors.UnexpectedTracerError) as ei:
        _leaked[0] + 1.0
    msg = str(ei.value)
    assert "leaks_its_input" in msg and THIS_FILE in msg  # not tapegrad's internal flat_fun
    assert "flat_fun" not in msg
    _leaked.clear()


def test_tracer_leak_caught_at_the_source_with_check_leaks():
    _leaked.clear()
    with tg.set_detect_anomaly(True, check_leaks=True):
        with pytest.raises(tg.TracerLeakError) as ei:
            tg.grad(leaks_its_input)(jnp.ones(3))
    msg = str(ei.value)
    assert "leaks_its_input" in msg and "has_aux=True" in msg and "_leaked" in msg
    _leaked.clear()
    with tg.set_detect_anomaly(True, check_leaks=True):  # a clean function passes
        np.testing.assert_allclose(tg.grad(lambda x: jnp.sum(x**2))(jnp.ones(2)), 2.0)


# ---------------------------------------------------------------- non-differentiable inputs


def test_non_differentiable_inputs():
    with pytest.raises(TypeError, match="allow_int"):
        tg.grad(lambda n: jnp.sum(n * 2.0))(jnp.arange(3))
    # Through a non-differentiable operation: zero, like jax (not an error, not garbage).
    f = lambda x: jnp.sum(jnp.round(x) + jax.lax.stop_gradient(x) * x)  # noqa: E731
    x = jnp.array([0.3, 1.7])
    np.testing.assert_array_equal(tg.grad(f)(x), jax.grad(f)(x))
    with pytest.raises(tg.DtypeError, match="no floating-point input"):
        tg.gradcheck(lambda n: n * 2, (np.arange(3),))


# ---------------------------------------------------------------- side effects and recompute


def _noise_source():
    state = {"n": 0}

    def draw():
        state["n"] += 1
        return np.float32(state["n"])  # a different value on every call

    return draw, state


def noisy_layer(draw, x):
    n = io_callback(draw, jax.ShapeDtypeStruct((), jnp.float32))  # EFFECT
    return jnp.sin(x * n)


def test_side_effect_recomputed_in_checkpoint_is_refused():
    draw, state = _noise_source()
    f = lambda x: jnp.sum(tg.checkpoint(lambda x: noisy_layer(draw, x))(x) ** 2)  # noqa: E731
    with pytest.raises(tg.EffectError) as ei:
        tg.grad(f)(jnp.ones(3))
    msg = str(ei.value)
    assert "'io_callback'" in msg and line_of("# EFFECT") in msg
    assert "wrong" in msg and "CheckpointPolicy.ALWAYS" in msg  # why, and what to do
    assert isinstance(ei.value, NotImplementedError)
    assert state["n"] == 0  # refused before forward ran
    with pytest.raises(NotImplementedError):  # jax refuses the same program
        jax.grad(f)(jnp.ones(3))


def test_side_effect_recomputed_by_a_selective_policy_is_refused_unless_saved():
    draw, state = _noise_source()
    f = lambda x: jnp.sum(noisy_layer(draw, x) ** 2)  # noqa: E731
    never = tg.selective(lambda r: tg.CheckpointPolicy.NEVER)
    with pytest.raises(tg.EffectError):
        tg.grad(f, policy=never)(jnp.ones(3))
    save_callbacks = tg.selective(
        lambda r: (
            tg.CheckpointPolicy.ALWAYS
            if r.primitive == "io_callback"
            else tg.CheckpointPolicy.NEVER
        )
    )
    x = jnp.array([0.1, 0.2, 0.3])
    got = tg.grad(f, policy=save_callbacks)(x)
    n = state["n"]  # the value forward saw: the callback ran once per forward
    want = jax.grad(lambda x: jnp.sum(jnp.sin(x * n) ** 2))(x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert state["n"] == 1


def test_python_side_effects_run_once_per_call_and_recompute_replays_the_tape():
    calls = []

    def f(x):
        calls.append(1)  # Python runs at trace time only; recompute replays records
        return jnp.sum(jnp.tanh(x * len(calls)) ** 2)

    never = tg.selective(lambda r: tg.CheckpointPolicy.NEVER)
    x = jnp.array([0.1, 0.4])
    got = tg.grad(f, policy=never)(x)
    assert len(calls) == 1
    np.testing.assert_allclose(got, jax.grad(lambda x: jnp.sum(jnp.tanh(x) ** 2))(x), rtol=1e-6)


def test_debug_prints_may_be_recomputed(capsys):
    def layer(x):
        jax.debug.print("layer")
        return jnp.sin(x)

    f = lambda x: jnp.sum(tg.checkpoint(layer)(x) ** 2)  # noqa: E731
    x = jnp.array([0.5, 1.0])
    np.testing.assert_allclose(tg.grad(f)(x), jax.grad(f)(x), rtol=1e-6)
