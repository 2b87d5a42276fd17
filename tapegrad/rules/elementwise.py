"""Elementwise primitives: a derivative table, one line per input.

Rules save the least that backward needs: exp, tanh, logistic, sqrt, rsqrt,
cbrt, tan and erf_inv save their *output* (the derivative is cheapest from
it, and the output is usually saved by the next record anyway); add, sub,
neg save nothing; mul saves only the operand the other side needs.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from tapegrad.rules._registry import deflinear, defnondiff, defvjp

# Linear: no residuals.
deflinear("neg", lambda g, r, p: -g)
deflinear("add", lambda g, r, p: g, lambda g, r, p: g)
deflinear("add_any", lambda g, r, p: g, lambda g, r, p: g)
deflinear("sub", lambda g, r, p: g, lambda g, r, p: -g)


def _convert_ct(g, r, p):
    # The interpreter casts to the input dtype; a complex cotangent of a real input
    # keeps its real part (jax's transpose binds convert_element_type, which does that).
    if jnp.iscomplexobj(g) and not jnp.issubdtype(r.in_avals[0].dtype, jnp.complexfloating):
        return lax.real(g)
    return g


deflinear("convert_element_type", _convert_ct)
deflinear("copy", lambda g, r, p: g)
deflinear("copy_p", lambda g, r, p: g)
deflinear(
    "reduce_precision",
    lambda g, r, p: lax.reduce_precision(
        g, exponent_bits=p["exponent_bits"], mantissa_bits=p["mantissa_bits"]
    ),
)
deflinear("real", lambda g, r, p: lax.complex(g, jnp.zeros_like(g)))
deflinear("imag", lambda g, r, p: lax.complex(jnp.zeros_like(g), -g))
deflinear("complex", lambda g, r, p: lax.real(g), lambda g, r, p: -lax.imag(g))
# conj of a real input has a complex output: its transpose keeps the real part.
deflinear(
    "conj",
    lambda g, r, p: (
        lax.conj(g) if jnp.issubdtype(p["input_dtype"], jnp.complexfloating) else lax.real(g)
    ),
)

# Products and quotients.
defvjp("mul", ("x1", lambda g, r, p: g * r.x[1]), ("x0", lambda g, r, p: g * r.x[0]))
defvjp("div", ("x1", lambda g, r, p: g / r.x[1]), ("y0 x1", lambda g, r, p: -g * r.y[0] / r.x[1]))


def _balanced(a, ans, b):
    # Where both operands equal the max/min, each gets half (as in jax).
    return jnp.where(a == ans, jnp.where(b == ans, 0.5, 1.0), 0.0).astype(ans.dtype)


defvjp(
    "max",
    ("x0 x1", lambda g, r, p: g * _balanced(r.x[0], jnp.maximum(r.x[0], r.x[1]), r.x[1])),
    ("x0 x1", lambda g, r, p: g * _balanced(r.x[1], jnp.maximum(r.x[0], r.x[1]), r.x[0])),
)
defvjp(
    "min",
    ("x0 x1", lambda g, r, p: g * _balanced(r.x[0], jnp.minimum(r.x[0], r.x[1]), r.x[1])),
    ("x0 x1", lambda g, r, p: g * _balanced(r.x[1], jnp.minimum(r.x[0], r.x[1]), r.x[0])),
)


def _pow_dx(g, r, p):
    # d/dx x**y = y * x**(y-1), in the output's dtype. As in jax, an integer exponent
    # defines it as 0 where y == 0 (so d/dx x**0 = 0 at x == 0); a float exponent does
    # not (0 * 0**-1 is nan at x == y == 0).
    x, y = jnp.asarray(r.x[0]), jnp.asarray(r.x[1])
    dt = r.out_avals[0].dtype
    xc, yc = lax.convert_element_type(x, dt), lax.convert_element_type(y, dt)
    if jnp.issubdtype(y.dtype, jnp.integer):
        shape = jnp.broadcast_shapes(xc.shape, yc.shape)
        xc, yc = jnp.broadcast_to(xc, shape), jnp.broadcast_to(yc, shape)
        jac = jnp.where(yc == 0, jnp.zeros_like(yc), _replace_zero(yc) * lax.pow(xc, yc - 1))
    else:
        jac = yc * lax.pow(xc, yc - 1)
    return g * jac


def _pow_dy(g, r, p):
    # d/dy x**y = log(x) * x**y, with log(1) in place of log(0) (so pow(0, y) gets 0).
    x = jnp.asarray(r.x[0])
    y_dtype = r.in_avals[1].dtype
    return lax.convert_element_type(g * (jnp.log(_replace_zero(x)) * r.y[0]), y_dtype)


def _replace_zero(x):
    return jnp.where(x == 0, jnp.ones_like(x), x)


defvjp("pow", ("x0 x1", _pow_dx), ("x0 y0", _pow_dy))


def _integer_pow(g, r, p):
    # jax's rule, case by case: x**0 has derivative 0 and x**1 derivative 1 everywhere
    # (no 0 * 0**-1 at x == 0).
    n, x = p["y"], jnp.asarray(r.x[0])
    if n == 0:
        return jnp.zeros_like(g)
    if n == 1:
        return g
    return g * (n * (x if n == 2 else lax.integer_pow(x, n - 1)))


defvjp("integer_pow", ("x0", _integer_pow))
defvjp("square", ("x0", lambda g, r, p: g * (2 * r.x[0])))

# Roots and exponentials: from the output.
defvjp("sqrt", ("y0", lambda g, r, p: g * (0.5 / r.y[0])))
defvjp("rsqrt", ("y0", lambda g, r, p: g * (-0.5 * r.y[0] * r.y[0] * r.y[0])))
defvjp("cbrt", ("y0", lambda g, r, p: g / (3 * r.y[0] * r.y[0])))
defvjp("exp", ("y0", lambda g, r, p: g * r.y[0]))
defvjp("exp2", ("y0", lambda g, r, p: g * (r.y[0] * math.log(2))))
defvjp("expm1", ("y0", lambda g, r, p: g * (r.y[0] + 1)))
defvjp("log", ("x0", lambda g, r, p: g / r.x[0]))
defvjp("log1p", ("x0", lambda g, r, p: g / (1 + r.x[0])))
defvjp("tanh", ("y0", lambda g, r, p: g * (1 - r.y[0] * r.y[0])))
defvjp("logistic", ("y0", lambda g, r, p: g * (r.y[0] * (1 - r.y[0]))))

# Trigonometric and hyperbolic.
defvjp("sin", ("x0", lambda g, r, p: g * jnp.cos(r.x[0])))
defvjp("cos", ("x0", lambda g, r, p: -g * jnp.sin(r.x[0])))
defvjp("tan", ("y0", lambda g, r, p: g * (1 + r.y[0] * r.y[0])))
defvjp("asin", ("x0", lambda g, r, p: g * lax.rsqrt(1 - r.x[0] * r.x[0])))
defvjp("acos", ("x0", lambda g, r, p: -g * lax.rsqrt(1 - r.x[0] * r.x[0])))
defvjp("atan", ("x0", lambda g, r, p: g / (1 + r.x[0] * r.x[0])))
defvjp(
    "atan2",
    ("x0 x1", lambda g, r, p: g * r.x[1] / (r.x[0] * r.x[0] + r.x[1] * r.x[1])),
    ("x0 x1", lambda g, r, p: -g * r.x[0] / (r.x[0] * r.x[0] + r.x[1] * r.x[1])),
)
defvjp("sinh", ("x0", lambda g, r, p: g * jnp.cosh(r.x[0])))
defvjp("cosh", ("x0", lambda g, r, p: g * jnp.sinh(r.x[0])))
defvjp("asinh", ("x0", lambda g, r, p: g * lax.rsqrt(r.x[0] * r.x[0] + 1)))
defvjp("acosh", ("x0", lambda g, r, p: g * lax.rsqrt((r.x[0] - 1) * (r.x[0] + 1))))
defvjp("atanh", ("x0", lambda g, r, p: g / (1 - r.x[0] * r.x[0])))

# Error functions.
_TWO_OVER_SQRT_PI = 2 / math.sqrt(math.pi)
defvjp("erf", ("x0", lambda g, r, p: g * (_TWO_OVER_SQRT_PI * jnp.exp(-r.x[0] * r.x[0]))))
defvjp("erfc", ("x0", lambda g, r, p: g * (-_TWO_OVER_SQRT_PI * jnp.exp(-r.x[0] * r.x[0]))))
defvjp("erf_inv", ("y0", lambda g, r, p: g * (math.sqrt(math.pi) / 2 * jnp.exp(r.y[0] * r.y[0]))))

# Piecewise.


def _abs(g, r, p):
    x = jnp.asarray(r.x[0])
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        # d|z| = real(conj(z) / |z| * dz): the transpose of real() makes g complex, then
        # it is multiplied by conj(z) / |z| (with |z| := 1 at z == 0, as in jax, so the
        # derivative there is 0). Written with differentiable ops: higher orders follow.
        mag = lax.convert_element_type(lax.abs(x), x.dtype)
        return lax.complex(g, jnp.zeros_like(g)) * (lax.conj(x) / _replace_zero(mag))
    # d|x| = g where x >= 0, else -g (jax's convention: +g at x == 0, not sign(0) == 0).
    return jnp.where(x >= 0, g, -g)


defvjp("abs", ("x0", _abs))


def _clamp_lo(g, r, p):
    lo, x, hi = r.x
    return jnp.where((lo > x) & (lo < hi), g, 0)


def _clamp_x(g, r, p):
    lo, x, hi = r.x
    return jnp.where((x > lo) & (x < hi), g, 0)


def _clamp_hi(g, r, p):
    lo, x, hi = r.x
    return jnp.where(hi < x, g, 0)


defvjp("clamp", ("x0 x1 x2", _clamp_lo), ("x0 x1 x2", _clamp_x), ("x0 x1 x2", _clamp_hi))


def _select_case(i):
    def ct(g, r, p):
        which = jnp.asarray(r.x[0])  # a literal predicate arrives as a Python bool/int
        if which.dtype == jnp.bool_:
            take = which if i == 1 else ~which
        else:
            take = which == i
        return jnp.where(take, g, jnp.zeros((), g.dtype))

    return ("x0", ct)


def _select_n(*cases):
    return defvjp("select_n", None, *cases)


_select_n(*[_select_case(i) for i in range(16)])

# No cotangent: rounding, sign, comparisons, integer and bit ops, RNG.
defnondiff(
    "sign",
    "floor",
    "ceil",
    "round",
    "is_finite",
    "stop_gradient",
    "nextafter",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "and",
    "or",
    "not",
    "xor",
    "shift_left",
    "shift_right_logical",
    "shift_right_arithmetic",
    "population_count",
    "clz",
    "rem_int",
    "argmax",
    "argmin",
    "iota",
    "random_bits",
    "random_seed",
    "random_wrap",
    "random_unwrap",
    "threefry2x32",
    "bitcast_convert_type",
)
