"""Bad input gets a clear error, of the type jax raises for the same misuse.

Each test runs the misuse through jax first, takes the built-in exception type
jax raises (``TypeError``, ``ValueError``), asserts tapegrad raises that type,
and checks tapegrad's message says what went wrong and what to do.
"""

from __future__ import annotations

import builtins
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import tapegrad as tg
from tapegrad import errors as tg_errors

THIS_FILE = os.path.basename(__file__)


def _builtin_base(exc_type: type) -> type:
    """The first built-in exception class in ``exc_type``'s MRO (jax subclasses TypeError)."""
    for cls in exc_type.__mro__:
        if getattr(builtins, cls.__name__, None) is cls and cls is not Exception:
            return cls
    return Exception


def raises_like_jax(tg_thunk, jax_thunk, *must_mention: str) -> BaseException:
    """Assert tapegrad raises the built-in type jax raises; return tapegrad's exception."""
    with pytest.raises(Exception) as jax_ei:
        jax_thunk()
    expected = _builtin_base(type(jax_ei.value))
    assert expected in (TypeError, ValueError), f"jax raised {type(jax_ei.value)}"
    with pytest.raises(expected) as tg_ei:
        tg_thunk()
    msg = str(tg_ei.value)
    for word in must_mention:
        assert word in msg, f"{word!r} not in tapegrad's message: {msg}"
    return tg_ei.value


def sq(x):
    return jnp.sum(x**2)


# ---------------------------------------------------------------- non-array arguments


@pytest.mark.parametrize(
    "bad, leaf_type",
    [("a string", "str"), (object(), "object"), ({"k": "v"}, "str")],
    ids=["str", "object", "dict_of_str"],
)
def test_non_array_argument_to_grad(bad, leaf_type):
    err = raises_like_jax(
        lambda: tg.grad(sq)(bad), lambda: jax.grad(sq)(bad), "not a valid JAX type"
    )
    assert f"<class '{leaf_type}'>" in str(err)  # names the offending type
    assert "static" in str(err) or "partial" in str(err)  # says what to do


@pytest.mark.parametrize("bad", ["a string", object()], ids=["str", "object"])
def test_non_array_argument_to_vjp(bad):
    raises_like_jax(
        lambda: tg.vjp(lambda x: x, bad), lambda: jax.vjp(lambda x: x, bad), "not a valid JAX type"
    )


def test_non_array_in_non_differentiated_argument_works_like_jax():
    f = lambda x, s: jnp.sum(x**2) * len(s)
    np.testing.assert_allclose(tg.grad(f)(jnp.ones(2), "abc"), jax.grad(f)(jnp.ones(2), "abc"))


# ---------------------------------------------------------------- integer / bool inputs


@pytest.mark.parametrize(
    "x",
    [3, jnp.arange(3), np.arange(3, dtype=np.int8), jnp.array([True, False])],
    ids=["py_int", "int32_array", "int8_numpy", "bool_array"],
)
def test_integer_or_bool_input_requires_allow_int(x):
    f = lambda x: jnp.sum(x * 1.0)
    raises_like_jax(lambda: tg.grad(f)(x), lambda: jax.grad(f)(x), "allow_int")


def test_integer_leaf_in_pytree_requires_allow_int():
    f = lambda p: jnp.sum(p["w"]) * p["n"]
    p = {"w": jnp.ones(3), "n": jnp.int32(2)}
    raises_like_jax(lambda: tg.grad(f)(p), lambda: jax.grad(f)(p), "allow_int")


def test_integer_input_not_differentiated_is_fine():
    f = lambda x, n: jnp.sum(x**2) * n
    got = tg.grad(f)(jnp.arange(3.0), jnp.int32(4))
    np.testing.assert_allclose(got, jax.grad(f)(jnp.arange(3.0), jnp.int32(4)))


@pytest.mark.parametrize(
    "x", [jnp.arange(3), jnp.array([True, False]), 5], ids=["int32_array", "bool_array", "py_int"]
)
def test_allow_int_gives_float0_zeros_like_jax(x):
    f = lambda x, y: jnp.sum(x * y)
    y = jnp.float32(1.5)
    gx, gy = tg.grad(f, argnums=(0, 1), allow_int=True)(x, y)
    jx, jy = jax.grad(f, argnums=(0, 1), allow_int=True)(x, y)
    assert np.asarray(jx).dtype == jax.dtypes.float0  # what jax does
    assert np.asarray(gx).dtype == jax.dtypes.float0
    assert np.shape(gx) == np.shape(jx) == np.shape(x)
    np.testing.assert_allclose(gy, jy)


def test_allow_int_float0_leaf_in_pytree():
    # The float0 gradient sits in the input's pytree structure, like jax's.
    f = lambda p: jnp.sum(p["w"] * p["n"])
    p = {"w": jnp.ones(3), "n": jnp.arange(3)}
    g = tg.grad(f, allow_int=True)(p)
    jg = jax.grad(f, allow_int=True)(p)
    assert jax.tree.structure(g) == jax.tree.structure(jg)
    assert np.asarray(g["n"]).dtype == jax.dtypes.float0
    np.testing.assert_allclose(g["w"], jg["w"])


# ---------------------------------------------------------------- argnums


def test_argnums_past_the_last_positional_argument():
    err = raises_like_jax(
        lambda: tg.grad(sq, argnums=2)(1.0), lambda: jax.grad(sq, argnums=2)(1.0), "argnums=2"
    )
    assert "positional" in str(err)


def test_argnums_tuple_out_of_range():
    f = lambda a, b: a * b
    raises_like_jax(
        lambda: tg.grad(f, argnums=(0, 3))(1.0, 2.0),
        lambda: jax.grad(f, argnums=(0, 3))(1.0, 2.0),
        "argnums=(0, 3)",
    )


def test_argnums_negative_out_of_range_is_value_error():
    err = raises_like_jax(
        lambda: tg.grad(sq, argnums=-2)(1.0), lambda: jax.grad(sq, argnums=-2)(1.0), "argnums=-2"
    )
    assert isinstance(err, ValueError)
    assert "range(" in str(err)  # says which argnums are valid


def test_argnums_out_of_range_value_and_grad():
    raises_like_jax(
        lambda: tg.value_and_grad(sq, argnums=1)(1.0),
        lambda: jax.value_and_grad(sq, argnums=1)(1.0),
        "argnums=1",
    )


def test_negative_argnums_in_range_works():
    f = lambda a, b: a * jnp.sin(b)
    np.testing.assert_allclose(tg.grad(f, argnums=-1)(2.0, 0.5), jax.grad(f, argnums=-1)(2.0, 0.5))


# ---------------------------------------------------------------- output checks


@pytest.mark.parametrize(
    "f",
    [jnp.sin, lambda x: (jnp.sum(x), jnp.sum(x)), lambda x: {"a": x.sum()}],
    ids=["vector", "tuple", "dict"],
)
def test_grad_of_non_scalar_output(f):
    x = jnp.ones(3)
    err = raises_like_jax(lambda: tg.grad(f)(x), lambda: jax.grad(f)(x), "scalar")
    assert "vjp" in str(err) or "sum" in str(err)  # says what to do


@pytest.mark.parametrize(
    "out",
    [lambda x: x**2, lambda x: (x**2, 1, 2), lambda x: [x**2]],
    ids=["bare", "triple", "singleton_list"],
)
@pytest.mark.parametrize("transform", ["grad", "value_and_grad", "vjp"])
def test_has_aux_requires_pair(out, transform):
    x = jnp.float32(1.0)
    tg_f = {
        "grad": lambda: tg.grad(out, has_aux=True)(x),
        "value_and_grad": lambda: tg.value_and_grad(out, has_aux=True)(x),
        "vjp": lambda: tg.vjp(out, x, has_aux=True),
    }[transform]
    jax_f = {
        "grad": lambda: jax.grad(out, has_aux=True)(x),
        "value_and_grad": lambda: jax.value_and_grad(out, has_aux=True)(x),
        "vjp": lambda: jax.vjp(out, x, has_aux=True),
    }[transform]
    err = raises_like_jax(tg_f, jax_f, "has_aux=True")
    assert "pair" in str(err) or "two-element" in str(err)


def test_complex_output_without_holomorphic():
    f = lambda x: x * (1.0 + 2.0j)
    err = raises_like_jax(lambda: tg.grad(f)(1.0), lambda: jax.grad(f)(1.0), "holomorphic=True")
    assert "vjp" in str(err)


def test_complex_input_and_output_without_holomorphic():
    f = lambda z: z**2
    raises_like_jax(
        lambda: tg.grad(f)(1.0 + 1.0j),
        lambda: jax.grad(f)(1.0 + 1.0j),
        "holomorphic=True",
        "complex64",
    )


def test_holomorphic_with_real_input():
    f = lambda z: z**2
    err = raises_like_jax(
        lambda: tg.grad(f, holomorphic=True)(1.0),
        lambda: jax.grad(f, holomorphic=True)(1.0),
        "holomorphic=True",
    )
    assert "complex" in str(err) and "float32" in str(err)


def test_holomorphic_with_real_output():
    f = lambda z: jnp.real(z) ** 2
    raises_like_jax(
        lambda: tg.grad(f, holomorphic=True)(1.0 + 2.0j),
        lambda: jax.grad(f, holomorphic=True)(1.0 + 2.0j),
        "holomorphic=True",
        "complex",
    )


def test_holomorphic_ok_matches_jax():
    f = lambda z: jnp.sin(z) * z
    z = jnp.complex64(0.3 + 0.7j)
    np.testing.assert_allclose(
        tg.grad(f, holomorphic=True)(z), jax.grad(f, holomorphic=True)(z), rtol=1e-5
    )


def test_integer_output():
    f = lambda x: jnp.int32(3) + jnp.round(x).astype(jnp.int32)
    err = raises_like_jax(lambda: tg.grad(f)(1.0), lambda: jax.grad(f)(1.0), "int32")
    assert "vjp" in str(err)
    assert "holomorphic" not in str(err)  # the advice fits integer outputs


# ---------------------------------------------------------------- vjp_fn cotangents


def _pytree_fun(x):
    return {"a": jnp.sin(x), "b": (x.sum(), jnp.cos(x))}


X3 = jnp.linspace(-1.0, 1.0, 3)


@pytest.mark.parametrize(
    "ct",
    [
        {"a": jnp.ones(3)},
        {"a": jnp.ones(3), "b": [jnp.float32(1.0), jnp.ones(3)]},
        (jnp.ones(3), jnp.float32(1.0), jnp.ones(3)),
        jnp.ones(3),
    ],
    ids=["missing_key", "list_for_tuple", "flat_tuple", "bare_array"],
)
def test_vjp_fn_cotangent_wrong_structure(ct):
    _, vjp_fn = tg.vjp(_pytree_fun, X3)
    _, jvjp_fn = jax.vjp(_pytree_fun, X3)
    err = raises_like_jax(lambda: vjp_fn(ct), lambda: jvjp_fn(ct), "structure")
    assert "Pass a cotangent" in str(err)


@pytest.mark.parametrize(
    "ct_a", [jnp.ones(4), jnp.ones((3, 1)), jnp.float32(1.0)], ids=["longer", "extra_dim", "scalar"]
)
def test_vjp_fn_cotangent_wrong_shape(ct_a):
    ct = {"a": ct_a, "b": (jnp.float32(1.0), jnp.ones(3))}
    _, vjp_fn = tg.vjp(_pytree_fun, X3)
    _, jvjp_fn = jax.vjp(_pytree_fun, X3)
    err = raises_like_jax(lambda: vjp_fn(ct), lambda: jvjp_fn(ct), "shape")
    assert str(tuple(np.shape(ct_a))) in str(err) and "(3,)" in str(err)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float16, jnp.bool_])
def test_vjp_fn_cotangent_wrong_dtype(dtype):
    _, vjp_fn = tg.vjp(jnp.sin, X3)
    _, jvjp_fn = jax.vjp(jnp.sin, X3)
    ct = jnp.ones(3, dtype)
    raises_like_jax(lambda: vjp_fn(ct), lambda: jvjp_fn(ct), "dtype", "float32")


def test_vjp_fn_accepts_what_jax_accepts():
    # Python floats and float64 numpy arrays canonicalise to float32, as in jax.
    out, vjp_fn = tg.vjp(lambda x: (jnp.sum(x**2), jnp.sin(x)), X3)
    _, jvjp_fn = jax.vjp(lambda x: (jnp.sum(x**2), jnp.sin(x)), X3)
    ct = (1.0, np.linspace(0.0, 1.0, 3))
    np.testing.assert_allclose(vjp_fn(ct)[0], jvjp_fn(ct)[0], rtol=1e-6)


# ---------------------------------------------------------------- while_loop


def _uses_while(x):
    return lax.while_loop(lambda c: c < 10.0, lambda c: c * 2.0, x)  # WHILE-MARKER


def _marker_line(marker: str) -> int:
    """Line number in this file of the source line ending with ``marker``."""
    with open(__file__) as fh:
        for i, line in enumerate(fh, 1):
            if line.rstrip().endswith(marker):
                return i
    raise AssertionError(marker)


def test_while_loop_is_non_differentiable_and_names_the_source_line():
    with pytest.raises(tg.NonDifferentiableError) as ei:
        tg.grad(_uses_while)(1.0)
    err = ei.value
    assert isinstance(err, TypeError)
    assert isinstance(err, ValueError)  # what jax raises for the same code
    assert isinstance(err, tg.TapegradError)
    msg = str(err)
    line = _marker_line("# WHILE-MARKER")
    assert f"{THIS_FILE}:{line}" in msg, msg
    assert "while" in msg
    assert "scan" in msg  # says what to use instead
    # jax refuses too, with a ValueError.
    with pytest.raises(ValueError, match="Reverse-mode differentiation does not work"):
        jax.grad(_uses_while)(1.0)


def test_fori_loop_with_traced_bounds_is_non_differentiable():
    def f(x, n):
        return lax.fori_loop(0, n, lambda i, c: c * 1.5, x)  # FORI-MARKER

    with pytest.raises(tg.NonDifferentiableError) as ei:
        jax.jit(tg.grad(f))(1.0, 3)
    assert f"{THIS_FILE}:{_marker_line('# FORI-MARKER')}" in str(ei.value)
    with pytest.raises(ValueError):
        jax.jit(jax.grad(f))(1.0, 3)


def test_while_loop_off_the_differentiated_path_is_fine():
    def f(x):
        n = lax.while_loop(lambda c: c < 5, lambda c: c + 2, 0)  # integer counter, no gradient
        return jnp.sum(jnp.sin(x)) * n

    x = jnp.linspace(0.0, 1.0, 4)
    np.testing.assert_allclose(tg.grad(f)(x), jax.grad(f)(x), rtol=1e-6)


def test_while_loop_in_vjp():
    with pytest.raises(tg.NonDifferentiableError) as ei:
        tg.vjp(_uses_while, 1.0)
    assert THIS_FILE in str(ei.value)


# ---------------------------------------------------------------- same failure as jax


def test_custom_vjp_closing_over_differentiated_value():
    def outer(x):
        @jax.custom_vjp
        def cv(y):
            return y * x

        cv.defvjp(lambda y: (y * x, None), lambda r, g: (g,))
        return cv(2.0)

    raises_like_jax(lambda: tg.grad(outer)(1.0), lambda: jax.grad(outer)(1.0))


def test_non_differentiated_arguments_stay_concrete_like_jax():
    f = lambda x, n: jnp.sum(x[:n] ** 2) if n > 1 else jnp.sum(x)
    x = jnp.arange(4.0)
    np.testing.assert_allclose(tg.grad(f)(x, 3), jax.grad(f)(x, 3))


# ---------------------------------------------------------------- error classes


def test_tapegrad_error_hierarchy():
    assert tg.TapegradError is tg_errors.TapegradError
    assert issubclass(tg.TapegradError, Exception)
    for name in tg_errors.__all__:
        cls = getattr(tg_errors, name)
        assert issubclass(cls, tg.TapegradError), name
    # Each is also the matching built-in, so `except TypeError` / `except RuntimeError` work.
    assert issubclass(tg.NonDifferentiableError, TypeError)
    assert issubclass(tg.ResidualError, RuntimeError)
    assert issubclass(tg_errors.HookError, RuntimeError)
    assert tg.NonDifferentiableError is tg_errors.NonDifferentiableError
    assert tg.ResidualError is tg_errors.ResidualError


def test_raised_residual_error_is_a_tapegrad_error():
    _, vjp_fn = tg.vjp(jnp.sin, X3, retain_residuals=False)
    vjp_fn(jnp.ones(3))
    with pytest.raises(tg.TapegradError) as ei:
        vjp_fn(jnp.ones(3))
    assert isinstance(ei.value, tg.ResidualError)
    assert "retain_residuals=True" in str(ei.value)
