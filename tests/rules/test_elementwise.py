"""Every elementwise rule in `tapegrad/rules/elementwise.py` against jax.

Each primitive is reached through the jnp/lax function a user would write, at
shapes (), (3,), (2, 3, 4), in float32 and float64, on inputs inside the
function's domain. ``tg.grad(lambda x: sum(f(x) * c))`` is compared with
``jax.grad`` and ``tg.vjp`` with ``jax.vjp`` on a random cotangent. A separate
test checks that each primitive really reaches its tapegrad rule (not the
fallback), so a passing comparison exercises the rule under test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
import pytest
from conftest import assert_grads_match, assert_vjp_match, enable_x64, rand, tols
from jax import lax

import tapegrad as tg

SHAPES = [(), (3,), (2, 3, 4)]
DTYPES = ["float32", "float64"]


def _draw(shape, dtype, domain, seed):
    """Inputs in ``domain``: ``(low, high)``, or ``("signed", low, high)`` for
    magnitudes in [low, high) with random signs (keeps away from zero)."""
    if domain[0] == "signed":
        _, lo, hi = domain
        rng = np.random.RandomState(seed)
        mag = rng.uniform(lo, hi, size=shape)
        sign = np.where(rng.rand(*shape) < 0.5, -1.0, 1.0)
        return jnp.asarray(mag * sign, dtype=dtype)
    return rand(shape, dtype, domain[0], domain[1], seed)


# name -> (primitive on the tape, function, input domain)
UNARY = {
    "neg": ("neg", jnp.negative, (-2, 2)),
    "square": ("square", jnp.square, (-2, 2)),
    "sqrt": ("sqrt", jnp.sqrt, (0.5, 3)),
    "rsqrt": ("rsqrt", lax.rsqrt, (0.5, 3)),
    "cbrt": ("cbrt", jnp.cbrt, ("signed", 0.3, 3)),
    "exp": ("exp", jnp.exp, (-2, 2)),
    "exp2": ("exp2", jnp.exp2, (-2, 2)),
    "expm1": ("expm1", jnp.expm1, (-2, 2)),
    "log": ("log", jnp.log, (0.5, 3)),
    "log1p": ("log1p", jnp.log1p, (-0.5, 2)),
    "tanh": ("tanh", jnp.tanh, (-2, 2)),
    "logistic": ("logistic", jax.nn.sigmoid, (-3, 3)),
    "sin": ("sin", jnp.sin, (-3, 3)),
    "cos": ("cos", jnp.cos, (-3, 3)),
    "tan": ("tan", jnp.tan, (-1.2, 1.2)),
    "asin": ("asin", jnp.arcsin, (-0.9, 0.9)),
    "acos": ("acos", jnp.arccos, (-0.9, 0.9)),
    "atan": ("atan", jnp.arctan, (-3, 3)),
    "sinh": ("sinh", jnp.sinh, (-2, 2)),
    "cosh": ("cosh", jnp.cosh, (-2, 2)),
    "asinh": ("asinh", jnp.arcsinh, (-3, 3)),
    "acosh": ("acosh", jnp.arccosh, (1.2, 3)),
    "atanh": ("atanh", jnp.arctanh, (-0.9, 0.9)),
    "erf": ("erf", jss.erf, (-2, 2)),
    "erfc": ("erfc", jss.erfc, (-2, 2)),
    "erf_inv": ("erf_inv", jss.erfinv, (-0.9, 0.9)),
    "abs": ("abs", jnp.abs, ("signed", 0.1, 2)),
    "sign": ("sign", jnp.sign, ("signed", 0.1, 2)),
    "floor": ("floor", jnp.floor, (-3, 3)),
    "ceil": ("ceil", jnp.ceil, (-3, 3)),
    "round": ("round", jnp.round, (-3, 3)),
    "stop_gradient": ("stop_gradient", lambda x: lax.stop_gradient(x) * x, (-2, 2)),
    "copy": ("copy", lambda x: jnp.copy(x) * x, (-2, 2)),
    "reduce_precision": (
        "reduce_precision",
        lambda x: lax.reduce_precision(x, exponent_bits=5, mantissa_bits=10),
        (-2, 2),
    ),
    "integer_pow_0": ("integer_pow", lambda x: lax.integer_pow(x, 0), (-2, 2)),
    "integer_pow_1": ("integer_pow", lambda x: lax.integer_pow(x, 1), (-2, 2)),
    "integer_pow_2": ("integer_pow", lambda x: x**2, (-2, 2)),
    "integer_pow_3": ("integer_pow", lambda x: x**3, (-2, 2)),
    "integer_pow_-2": ("integer_pow", lambda x: x**-2, ("signed", 0.5, 2)),
    "integer_pow_5": ("integer_pow", lambda x: lax.integer_pow(x, 5), (-1.5, 1.5)),
    "pow_const_exponent": ("pow", lambda x: jnp.power(x, 1.7), (0.5, 2)),
    "pow_const_base": ("pow", lambda x: jnp.power(2.5, x), (-2, 2)),
    "max_const": ("max", lambda x: jnp.maximum(x, 0.25), (-2, 2)),
    "min_const": ("min", lambda x: jnp.minimum(0.25, x), (-2, 2)),
    "clip": ("max", lambda x: jnp.clip(x, -0.5, 0.5), (-2, 2)),
    "clamp_scalar_bounds": ("clamp", lambda x: lax.clamp(-0.5, x, 0.5), (-2, 2)),
    "where_const": ("select_n", lambda x: jnp.where(x > 0, x, 0.1 * x), (-2, 2)),
}

# Float64 keeps these exact; in float32 tapegrad's formula (from the output, or
# a different but equivalent expression) may round differently from jax's.
F32_LOOSE = {
    # d/dx x**1.7 = 1.7 * x**0.7 vs jax's 1.7 * x**1.7 / x: two roundings apart.
    "pow_const_exponent": (1e-5, 1e-5),
}


def _call(x_dtype):
    """Context for a dtype: float64 needs jax_enable_x64."""
    return enable_x64(x_dtype == "float64")


def _check_rule_used(fn, x, prim):
    tape = tg.trace(fn)(x)
    recs = [r for r in tape.records if r.primitive == prim]
    assert recs, f"{prim} not on the tape: {[r.primitive for r in tape.records]}"
    return recs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_grad(name, shape, dtype):
    prim, fn, domain = UNARY[name]
    with _call(dtype):
        x = _draw(shape, dtype, domain, seed=1)
        c = rand(shape, dtype, -1, 1, seed=2)
        rtol, atol = F32_LOOSE.get(name, tols(dtype)) if dtype == "float32" else tols(dtype)
        _check_rule_used(fn, x, prim)
        assert_grads_match(lambda x: jnp.sum(fn(x) * c), x, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 4)], ids=str)  # () and (3,): test_unary_grad
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_vjp(name, shape, dtype):
    prim, fn, domain = UNARY[name]
    with _call(dtype):
        x = _draw(shape, dtype, domain, seed=3)
        rtol, atol = F32_LOOSE.get(name, tols(dtype)) if dtype == "float32" else tols(dtype)
        assert_vjp_match(fn, x, seed=4, rtol=rtol, atol=atol)


# Primitives a tapegrad rule handles (every one in elementwise.py, minus the
# nondifferentiable ones, which must not be in backward at all).
NONDIFF_NAMES = {"sign", "floor", "ceil", "round", "stop_gradient"}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_reaches_its_rule(name):
    prim, fn, domain = UNARY[name]
    x = _draw((3,), "float32", domain, seed=5)
    recs = _check_rule_used(fn, x, prim)
    if name in NONDIFF_NAMES:
        assert all(r.rule == "none" for r in recs), [(r.primitive, r.rule) for r in recs]
    else:
        assert any(r.rule == "rule" for r in recs), [(r.primitive, r.rule) for r in recs]


# ---------------------------------------------------------------------------
# Binary primitives, both operands differentiated.

BINARY = {
    "add": ("add", jnp.add, (-2, 2), (-2, 2)),
    "sub": ("sub", jnp.subtract, (-2, 2), (-2, 2)),
    "mul": ("mul", jnp.multiply, (-2, 2), (-2, 2)),
    "div": ("div", jnp.divide, (-2, 2), ("signed", 0.5, 2)),
    "max": ("max", jnp.maximum, (-2, 2), (-2, 2)),
    "min": ("min", jnp.minimum, (-2, 2), (-2, 2)),
    "pow": ("pow", jnp.power, (0.5, 2), (-2, 2)),
    "atan2": ("atan2", jnp.arctan2, (-2, 2), (-2, 2)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_grad(name, shape, dtype):
    prim, fn, dx, dy = BINARY[name]
    with _call(dtype):
        x = _draw(shape, dtype, dx, seed=6)
        y = _draw(shape, dtype, dy, seed=7)
        c = rand(shape, dtype, -1, 1, seed=8)
        tape = tg.trace(fn)(x, y)
        assert any(r.primitive == prim and r.rule == "rule" for r in tape.records)
        # pow in float32: tapegrad's y * x**(y-1) vs jax's y * x**y / x round differently.
        rtol, atol = (1e-5, 1e-5) if (name == "pow" and dtype == "float32") else tols(dtype)
        assert_grads_match(
            lambda x, y: jnp.sum(fn(x, y) * c), x, y, argnums=(0, 1), rtol=rtol, atol=atol
        )
        assert_grads_match(
            lambda x, y: jnp.sum(fn(x, y) * c), x, y, argnums=1, rtol=rtol, atol=atol
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_vjp(name, dtype):
    prim, fn, dx, dy = BINARY[name]
    with _call(dtype):
        x = _draw((2, 3, 4), dtype, dx, seed=9)
        y = _draw((2, 3, 4), dtype, dy, seed=10)
        rtol, atol = (1e-5, 1e-5) if (name == "pow" and dtype == "float32") else tols(dtype)
        assert_vjp_match(fn, x, y, seed=11, rtol=rtol, atol=atol)


# Broadcasting: with a Python scalar (a literal on the tape), a 0-d array, and
# size-1 / missing leading dimensions.
BROADCASTS = {
    "mul_py_scalar": (lambda x, y: x * 2.0, (2, 3, 4), (2, 3, 4)),
    "py_scalar_div": (lambda x, y: 3.0 / (x + 3.0), (2, 3, 4), (2, 3, 4)),
    "add_leading": (lambda x, y: x + y[None], (2, 3, 4), (3, 4)),
    "add_rank_promote": (lambda x, y: x + y, (2, 3, 4), (4,)),
    "mul_size1": (lambda x, y: x * y, (2, 3, 4), (2, 1, 4)),
    "mul_size1_both": (lambda x, y: x * y, (2, 1, 4), (1, 3, 1)),
    "sub_scalar_array": (lambda x, y: x - y, (2, 3, 4), ()),
    "div_by_size1": (lambda x, y: x / (y * y + 1.0), (2, 3, 4), (1, 3, 1)),
    "max_size1": (lambda x, y: jnp.maximum(x, y), (2, 3, 4), (1, 3, 4)),
    "min_scalar": (lambda x, y: jnp.minimum(x, y), (3,), ()),
    "pow_size1": (lambda x, y: jnp.power(x * x + 0.5, y), (2, 3, 4), (2, 3, 1)),
    "atan2_scalar": (lambda x, y: jnp.arctan2(x, y + 3.0), (2, 3, 4), ()),
    "where_size1": (lambda x, y: jnp.where(x > 0, x, y), (2, 3, 4), (1, 1, 4)),
    "clamp_array_bounds": (lambda x, y: lax.clamp(y - 1.0, x, y + 0.5), (2, 3), (2, 3)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(BROADCASTS))
def test_broadcasting(name, dtype):
    fn, sx, sy = BROADCASTS[name]
    with _call(dtype):
        x = rand(sx, dtype, -2, 2, seed=12)
        y = rand(sy, dtype, -2, 2, seed=13)
        out_shape = jnp.broadcast_shapes(sx, sy)
        c = rand(out_shape, dtype, -1, 1, seed=14)
        rtol, atol = (1e-5, 1e-5) if (name == "pow_size1" and dtype == "float32") else tols(dtype)
        assert_grads_match(
            lambda x, y: jnp.sum(fn(x, y) * c), x, y, argnums=(0, 1), rtol=rtol, atol=atol
        )
        assert_vjp_match(fn, x, y, seed=15, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------
# Ties and edges: jax's conventions must be reproduced exactly.


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [jnp.maximum, jnp.minimum], ids=["max", "min"])
def test_max_min_ties(op, dtype):
    with _call(dtype):
        x = jnp.asarray([1.0, -2.0, 0.0, 3.0, 0.5], dtype)
        y = jnp.asarray([1.0, -1.0, 0.0, 2.0, 0.5], dtype)  # ties at 0, 2, 4
        c = jnp.asarray([1.0, 2.0, 3.0, 4.0, 5.0], dtype)
        gx, gy = assert_grads_match(lambda x, y: jnp.sum(op(x, y) * c), x, y, argnums=(0, 1))
        # jax splits a tie evenly between the two operands.
        np.testing.assert_allclose(np.asarray(gx)[[0, 2, 4]], [0.5, 1.5, 2.5])
        np.testing.assert_allclose(np.asarray(gy)[[0, 2, 4]], [0.5, 1.5, 2.5])
        # Same operand on both sides, and against a constant at the tie.
        assert_grads_match(lambda x: jnp.sum(op(x, x) * c), x)
        assert_grads_match(lambda x: jnp.sum(op(x, 0.0) * c), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_clamp_at_bounds(dtype):
    with _call(dtype):
        x = jnp.asarray([-1.0, -0.5, 0.0, 0.5, 1.0], dtype)
        lo = jnp.asarray(-0.5, dtype)
        hi = jnp.asarray(0.5, dtype)
        f = lambda lo, x, hi: jnp.sum(lax.clamp(lo, x, hi) * jnp.arange(1.0, 6.0, dtype=dtype))
        # jax.grad itself fails for scalar bounds that are differentiated (its clamp
        # JVP builds a select of mismatched shapes), so only x is differentiated here.
        assert_grads_match(f, lo, x, hi, argnums=1)
        # Array bounds, ties with x.
        lo_a = jnp.asarray([-2.0, -0.5, 0.0, 0.5, 2.0], dtype)
        hi_a = lo_a + jnp.asarray([1.0, 0.0, 0.5, 0.0, 1.0], dtype)
        assert_grads_match(f, lo_a, x, hi_a, argnums=(0, 1, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_pow_edges(dtype):
    """x**y at x == 0 and y == 0 follow jax's conventions."""
    with _call(dtype):
        x = jnp.asarray([0.0, 0.0, 1.5, 2.0], dtype)
        y = jnp.asarray([0.0, 2.0, 0.0, 3.0], dtype)
        # jax: d/dx is y * x**(y-1), nan at x == y == 0 for a float exponent.
        g = assert_grads_match(lambda x, y: jnp.sum(jnp.power(x, y)), x, y, argnums=(0, 1))
        assert np.isnan(np.asarray(g[0])[0])
        # An integer exponent: jax defines d/dx as 0 where y == 0.
        n = jnp.asarray([0, 1, 0, 3], jnp.int32)
        g = assert_grads_match(lambda x: jnp.sum(lax.pow(x, n)), x)
        assert np.isfinite(np.asarray(g)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 2, 3, -2])
def test_integer_pow_at_zero_and_one(n, dtype):
    with _call(dtype):
        x = jnp.asarray([1.0, -1.0, 2.0], dtype) if n < 0 else jnp.asarray([0.0, 1.0, -1.0], dtype)
        assert_grads_match(lambda x: jnp.sum(lax.integer_pow(x, n)), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_abs_sign_at_zero(dtype):
    with _call(dtype):
        x = jnp.asarray([0.0, -1.0, 2.0], dtype)
        assert_grads_match(lambda x: jnp.sum(jnp.abs(x)), x)
        assert_grads_match(lambda x: jnp.sum(jnp.sign(x) * x), x)


# ---------------------------------------------------------------------------
# select_n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_where(shape, dtype):
    with _call(dtype):
        x = rand(shape, dtype, -2, 2, seed=16)
        y = rand(shape, dtype, -2, 2, seed=17)
        c = rand(shape, dtype, -1, 1, seed=18)
        f = lambda x, y: jnp.sum(jnp.where(x > y, jnp.sin(x), y * y) * c)
        assert_grads_match(f, x, y, argnums=(0, 1))
        assert_vjp_match(lambda x, y: jnp.where(x > 0.0, x, y), x, y, seed=19)


@pytest.mark.parametrize("dtype", DTYPES)
def test_select_n_three_cases(dtype):
    with _call(dtype):
        which = jnp.asarray([[0, 1, 2, 1], [2, 2, 0, 1]], jnp.int32)
        a, b, c = (rand((2, 4), dtype, -2, 2, seed=s) for s in (20, 21, 22))
        w = rand((2, 4), dtype, -1, 1, seed=23)
        f = lambda a, b, c: jnp.sum(lax.select_n(which, a, b * b, jnp.exp(c)) * w)
        tape = tg.trace(f)(a, b, c)
        assert any(r.primitive == "select_n" and r.rule == "rule" for r in tape.records)
        assert_grads_match(f, a, b, c, argnums=(0, 1, 2))
        assert_vjp_match(lambda a, b, c: lax.select_n(which, a, b, c), a, b, c, seed=24)
        # A scalar predicate (bool) picks one whole operand.
        g = lambda a, b: jnp.sum(lax.select_n(jnp.asarray(True), a, b) * w)
        assert_grads_match(g, a, b, argnums=(0, 1))


# ---------------------------------------------------------------------------
# Dtype conversions


def test_convert_f32_f64_f32(x64):
    x = rand((2, 3, 4), "float32", -2, 2, seed=25)
    c = rand((2, 3, 4), "float64", -1, 1, seed=26)
    f = lambda x: jnp.sum(jnp.sin(x.astype(jnp.float64) * c).astype(jnp.float32))
    tape = tg.trace(f)(x)
    assert any(r.primitive == "convert_element_type" and r.rule == "rule" for r in tape.records)
    g = assert_grads_match(f, x)
    assert g.dtype == jnp.float32
    assert_vjp_match(lambda x: x.astype(jnp.float64).astype(jnp.float32) * 3.0, x, seed=27)
    # An f64 input through f32 and back.
    y = rand((3,), "float64", -2, 2, seed=28)
    assert_grads_match(
        lambda y: jnp.sum(jnp.exp(y.astype(jnp.float32)).astype(jnp.float64) * y),
        y,
        rtol=1e-6,
        atol=1e-7,
    )  # the f32 hop rounds: compare at f32 accuracy


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_convert_f32_bf16(shape):
    x = rand(shape, "float32", -2, 2, seed=29)
    c = rand(shape, "float32", -1, 1, seed=30)
    f = lambda x: jnp.sum(jnp.tanh(x.astype(jnp.bfloat16)).astype(jnp.float32) * c)
    # Both sides compute tanh's derivative in bfloat16, by different but
    # equivalent formulas (tapegrad: g*(1-y*y), jax: (g+g*y)*(1-y)), so they
    # differ by bfloat16 rounding (eps 2**-8): compare at bfloat16 accuracy.
    assert_grads_match(f, x, rtol=1e-2, atol=1e-2)
    assert_vjp_match(lambda x: x.astype(jnp.bfloat16), x, seed=31, rtol=0, atol=0)


def test_convert_f32_bf16_vjp_dtype():
    x = rand((3,), "float32", -2, 2, seed=32)
    _, vjp = tg.vjp(lambda x: x.astype(jnp.bfloat16) * 2, x)
    (ct,) = vjp(jnp.ones((3,), jnp.bfloat16))
    assert ct.dtype == jnp.float32


# ---------------------------------------------------------------------------
# Record.saves, as documented in elementwise.py / structural.py


def _saves(tape, prim):
    recs = [r for r in tape.records if r.primitive == prim]
    assert len(recs) == 1, [r.primitive for r in tape.records]
    return [(s.kind, s.index) for s in recs[0].saves]


@pytest.mark.parametrize(
    "prim,fn",
    [
        ("exp", jnp.exp),
        ("tanh", jnp.tanh),
        ("logistic", jax.nn.sigmoid),
        ("sqrt", jnp.sqrt),
        ("rsqrt", lax.rsqrt),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_saves_output(prim, fn):
    x = rand((4, 5), "float32", 0.5, 2, seed=33)
    tape = tg.trace(lambda x: jnp.sum(fn(x)))(x)
    assert _saves(tape, prim) == [("out", 0)]


@pytest.mark.parametrize(
    "prim,fn",
    [
        ("add", lambda x: x + jnp.sin(x)),
        ("sub", lambda x: x - jnp.sin(x)),
        ("neg", lambda x: -x),
        ("reshape", lambda x: x.reshape(5, 4)),
        ("transpose", lambda x: x.T),
        ("broadcast_in_dim", lambda x: jnp.broadcast_to(x, (3, 4, 5))),
        ("reduce_sum", lambda x: jnp.sum(x, axis=0)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_saves_nothing(prim, fn):
    x = rand((4, 5), "float32", -1, 1, seed=34)
    tape = tg.trace(lambda x: jnp.sum(jnp.sin(fn(x))))(x)
    rec = [r for r in tape.records if r.primitive == prim]
    assert rec and all(r.rule == "rule" for r in rec)
    assert all(r.saves == () for r in rec), [(r.primitive, r.saves) for r in rec]


def test_mul_saves_only_what_the_other_side_needs():
    x = rand((4, 5), "float32", -1, 1, seed=35)
    w = rand((4, 5), "float32", -1, 1, seed=36)
    f = lambda x, w: jnp.sum(x * w)
    assert sorted(_saves(tg.trace(f)(x, w), "mul")) == [("in", 0), ("in", 1)]
    # Only x differentiated: its cotangent g * w needs w (input 1) alone.
    assert _saves(tg.trace(f, argnums=0)(x, w), "mul") == [("in", 1)]
    # Only w differentiated: needs x (input 0) alone.
    assert _saves(tg.trace(f, argnums=1)(x, w), "mul") == [("in", 0)]
    # A literal operand is never saved: x * 2.0 saves nothing.
    assert _saves(tg.trace(lambda x: jnp.sum(x * 2.0))(x), "mul") == []


def test_saved_shapes_and_dtypes():
    x = rand((4, 5), "float32", 0.5, 2, seed=37)
    tape = tg.trace(lambda x: jnp.sum(jnp.exp(x)))(x)
    (s,) = [r for r in tape.records if r.primitive == "exp"][0].saves
    assert s.shape == (4, 5) and s.dtype == np.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_chain_of_elementwise(dtype):
    """Many rules in one function: cotangents accumulate across uses."""
    with _call(dtype):
        x = rand((2, 3, 4), dtype, 0.2, 0.9, seed=38)

        def f(x):
            a = jnp.exp(x) * jnp.tanh(x) + jnp.sqrt(x)
            b = jnp.arcsin(x) / (1 + jnp.square(x)) - jnp.log1p(x) ** 3
            return jnp.sum(jax.nn.sigmoid(a * b) + jnp.cbrt(a) * jss.erf(b) + jnp.arctan2(a, b))

        assert_grads_match(f, x)


# lax binary ops accept a rank-0 operand next to an array without an explicit
# broadcast (jnp.clip's jaxpr does this): the scalar's cotangent must be summed.
LAX_SCALAR = {
    "add": lambda s, x: lax.add(s, x),
    "sub": lambda s, x: lax.sub(s, x),
    "mul": lambda s, x: lax.mul(s, x),
    "div_by_scalar": lambda s, x: lax.div(x, s),
    "scalar_div": lambda s, x: lax.div(s, x),
    "max": lambda s, x: lax.max(s, x),
    "min": lambda s, x: lax.min(x, s),
    "pow_scalar_exponent": lambda s, x: lax.pow(x, s),
    "pow_scalar_base": lambda s, x: lax.pow(s, x),
    "atan2": lambda s, x: lax.atan2(s, x),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(LAX_SCALAR))
def test_lax_scalar_operand(name, dtype):
    fn = LAX_SCALAR[name]
    with _call(dtype):
        s = jnp.asarray(0.7, dtype)
        x = rand((2, 3), dtype, 0.2, 1.5, seed=39)
        eqn = jax.make_jaxpr(fn)(s, x).jaxpr.eqns[-1]
        assert {v.aval.shape for v in eqn.invars} == {(), (2, 3)}  # really unbroadcast
        rtol, atol = (1e-5, 1e-5) if dtype == "float32" else tols(dtype)  # pow/div: see above
        assert_grads_match(
            lambda s, x: jnp.sum(jnp.sin(fn(s, x))), s, x, argnums=(0, 1), rtol=rtol, atol=atol
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_convert_to_int_and_back(dtype):
    """A float -> int cast cuts the derivative; int -> float starts a constant."""
    with _call(dtype):
        x = rand((2, 3), dtype, -3, 3, seed=40)
        f = lambda x: jnp.sum(x.astype(jnp.int32) * x + jnp.round(x).astype(dtype) * jnp.sin(x))
        assert_grads_match(f, x)
