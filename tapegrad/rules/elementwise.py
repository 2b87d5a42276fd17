"""Elementwise primitives: a derivative table, one line per input.

Rules save the least that backward needs: exp, tanh, logistic, sqrt, rsqrt,
cbrt, tan and erf_inv save their *output* (the derivative is cheapest from
it, and the output is usually saved by the next record anyway); add, sub,
neg save nothing; mul saves only the operand the other side needs. Rules whose
derivative is a comparison (max, min, clamp, select_n's bool predicate) keep
bit-packed masks (rules/_bits.py), 1 bit per element, not their float operands.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from tapegrad.core.tape import Var
from tapegrad.rules._bits import mask_aval, pack_mask, packs, unpack_mask
from tapegrad.rules._registry import Rule, deflinear, defnondiff, defrule, defvjp


def _bind(rec, ins):
    out = rec.prim.bind(*ins, **rec.bind_params)
    return list(out) if rec.prim.multiple_results else [out]


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


# max / min: d/dx is 1 where x alone is the result, 1/2 where x and y tie, else 0 (jax's
# rule). Two bit-packed masks say all of it: x == ans and y == ans (both False at a NaN).


def _derives(rec) -> bool:
    return any(s.kind == "aux" for s in rec.saves)


def _tie_masks(rec, ins):
    (ans,) = _bind(rec, ins)
    if not _derives(rec):
        return [ans], [None, None]
    x, y = ins
    return [ans], [pack_mask(jnp.equal(x, ans)), pack_mask(jnp.equal(y, ans))]


def _out_masks(n):
    def avals(p, in_avals, out_avals, active):
        o = out_avals[0]
        return [mask_aval(o.shape, getattr(o, "sharding", None))] * n

    return avals


def _share(mine, other, g):
    return jnp.where(mine, jnp.where(other, 0.5, 1.0), 0.0).astype(g.dtype)


def _tie_ct(i, op):
    def ct(g, r, p):
        shape = r.out_avals[0].shape
        if r.aux and r.aux[0] is not None:
            a, b = unpack_mask(r.aux[0], shape), unpack_mask(r.aux[1], shape)
        else:  # the operands are kept anyway (`share_operands`)
            x, y = r.x
            ans = op(x, y)
            a, b = jnp.equal(x, ans), jnp.equal(y, ans)
        return g * (_share(a, b, g) if i == 0 else _share(b, a, g))

    return ("a0 a1", ct)


def _operands(*idx):
    return lambda p, in_avals, out_avals, active: tuple(("in", i) for i in idx)


for _name, _op in (("max", jnp.maximum), ("min", jnp.minimum)):
    defvjp(
        _name,
        _tie_ct(0, _op),
        _tie_ct(1, _op),
        derive=_tie_masks,
        aux_avals=_out_masks(2),
        plain=_operands(0, 1),
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


# clamp(lo, x, hi): each operand's cotangent is g where a comparison holds (jax's
# rule), so each active operand keeps one bit-packed mask (aux k for operand k), not
# lo, x and hi.


_CLAMP_MASKS = (
    lambda lo, x, hi: jnp.greater(lo, x) & jnp.less(lo, hi),  # lo is the result
    lambda lo, x, hi: jnp.greater(x, lo) & jnp.less(x, hi),  # x is
    lambda lo, x, hi: jnp.less(hi, x),  # hi is
)


def _clamp_derive(rec, ins):
    (y,) = _bind(rec, ins)
    aux: list = [None, None, None]
    for s in rec.saves:
        if s.kind == "aux":
            aux[s.index] = pack_mask(jnp.broadcast_to(_CLAMP_MASKS[s.index](*ins), y.shape))
    return [y], aux


def _clamp_ct(k):
    def ct(g, r, p):
        shape = r.out_avals[0].shape
        if k < len(r.aux) and r.aux[k] is not None:
            mask = unpack_mask(r.aux[k], shape)
        else:  # the operands are kept anyway (`share_operands`)
            mask = jnp.broadcast_to(_CLAMP_MASKS[k](*r.x), shape)
        return jnp.where(mask, g, jnp.zeros((), g.dtype))

    return (f"a{k}", ct)


defvjp(
    "clamp",
    _clamp_ct(0),
    _clamp_ct(1),
    _clamp_ct(2),
    derive=_clamp_derive,
    aux_avals=_out_masks(3),
    plain=_operands(0, 1, 2),
)


# select_n(which, *cases): case i's cotangent is g where ``which`` picks it. A bool
# predicate large enough to pack is kept bit-packed (aux 0); an integer or small one
# is kept as it is (input 0, shared with any other record keeping it).


def _packs_predicate(which) -> bool:
    return (
        isinstance(which, Var)
        and np.dtype(which.dtype) == np.bool_
        and packs(tuple(which.shape), which.sharding)
    )


def _select_saves(p, in_avals, out_avals, active):
    if not any(active[1:]):
        return ()
    return (("aux", 0),) if _packs_predicate(in_avals[0]) else (("in", 0),)


def _select_avals(p, in_avals, out_avals, active):
    w = in_avals[0]
    return [mask_aval(tuple(w.shape), getattr(w, "sharding", None))]


def _select_derive(rec, ins):
    (y,) = _bind(rec, ins)
    if any(s.kind == "aux" for s in rec.saves):
        return [y], [pack_mask(ins[0])]
    return [y], [None]


def _select_vjp(p, r, cts, active):
    g = cts[0]
    if r.aux and r.aux[0] is not None:
        which = unpack_mask(r.aux[0], r.in_avals[0].shape)
    else:
        which = jnp.asarray(r.x[0])  # a literal predicate arrives as a Python bool/int
    out: list = [None]
    for i, a in enumerate(active[1:]):
        if not a:
            out.append(None)
            continue
        if which.dtype == jnp.bool_:
            take = which if i == 1 else ~which
        else:
            take = which == i
        out.append(jnp.where(take, g, jnp.zeros((), g.dtype)))
    return out


defrule(
    Rule(
        "select_n",
        _select_saves,
        _select_vjp,
        derive=_select_derive,
        aux_avals=_select_avals,
        plain=_operands(0),
    )
)

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
