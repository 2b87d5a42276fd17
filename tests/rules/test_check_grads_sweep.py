"""Every rule in the registry through a `jax.test_util.check_grads`-style check, in
reverse mode, at orders 1 and 2, with tapegrad computing the derivatives.

For each case (a small function that reaches one rule) and each dtype it supports:

* order 1: ``tg.vjp(f, *args)`` on a random cotangent vs ``jax.vjp``;
* order 2: ``h(*args) = vjp(f, *args)[1](f(*args))`` (what ``check_grads`` differentiates
  at order 2), differentiated by ``tg.vjp`` of the tapegrad ``h`` (tg of tg) and by
  ``jax.vjp`` of the tapegrad ``h`` (jax of tg), both vs ``jax.vjp`` of jax's ``h``;
* in float64 / complex128 also ``jax.test_util.check_vjp`` (float64 central finite
  differences in a random direction) with ``tg.vjp`` as the VJP, at both orders.

Inputs stay away from non-differentiable points; the ``*_at_*`` cases sit exactly on
them (abs at 0, pow at 0, ties of max, where at its boundary, ...) and are compared with
jax only (finite differences mean nothing there). ``test_sweep_covers_the_registry``
fails when a rule is added to ``tapegrad.rules.RULES`` with no case here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from conftest import enable_x64
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import tapegrad as tg
from tapegrad.rules import RULES

REAL = ("float32", "float64")
CPLX = ("complex64", "complex128")
ALL = REAL + CPLX


@dataclass(frozen=True)
class Case:
    """``fn(*args)`` reaches ``rule``; ``args`` are drawn per dtype from ``shapes`` and
    ``domain`` (``(lo, hi)``, or ``("signed", lo, hi)`` for magnitudes in [lo, hi) with
    random signs), or given by ``make(dtype)``."""

    rule: str
    name: str
    fn: Callable
    shapes: tuple = ((3,),)
    domain: tuple = (-1.0, 1.0)
    dtypes: tuple = REAL
    make: Callable | None = None
    order: int = 2
    fd: bool = True  # finite differences (False at non-differentiable points)
    rtol: float = 1.0  # multiplier on the default tolerances
    oracle: Callable | None = None  # what jax differentiates, where it cannot do ``fn``
    batch: bool = True  # False: run alone, eagerly (a case that breaks the batch's trace)
    xfail: str = ""  # a known tapegrad bug: the case must fail (strict)

    @property
    def id(self) -> str:
        return f"{self.rule}:{self.name}"


def _draw(shape, dtype, domain, seed):
    rng = np.random.RandomState(seed)

    def real():
        if domain[0] == "signed":
            _, lo, hi = domain
            mag = rng.uniform(lo, hi, size=shape)
            return mag * np.where(rng.rand(*shape) < 0.5, -1.0, 1.0)
        return rng.uniform(domain[0], domain[1], size=shape)

    if jnp.issubdtype(dtype, jnp.complexfloating):
        return jnp.asarray(real() + 1j * real(), dtype)
    return jnp.asarray(real(), dtype)


def _args(case: Case, dtype):
    if case.make is not None:
        return tuple(case.make(jnp.dtype(dtype)))
    return tuple(_draw(s, jnp.dtype(dtype), case.domain, k) for k, s in enumerate(case.shapes))


# ---------------------------------------------------------------------------
# The cases. Integer operands (indices, exponents) are closed over, so every
# argument is differentiated.

C = Case
_IDX = jnp.array([[2], [0], [2]], jnp.int32)  # a repeated index: scatter's overwrite rule
_UIDX = jnp.array([[2], [0]], jnp.int32)
_SDN = lax.ScatterDimensionNumbers(
    update_window_dims=(), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
)
_GDN = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))


def _pool(x, kind="max", init=None):
    op, ident = {"max": (lax.max, -jnp.inf), "min": (lax.min, jnp.inf), "add": (lax.add, 0.0)}[kind]
    return lax.reduce_window(
        x, ident if init is None else init, op, (1, 2), (1, 1), ((0, 0), (1, 0))
    )


@jax.custom_jvp
def _softclip(x):
    return jnp.tanh(x) * 2


@_softclip.defjvp
def _softclip_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    y = _softclip(x)
    return y, (2 - y * y / 2) * t


def _closure_custom_jvp(x, y):
    # The JVP rule closes over the traced ``y``: differentiated with respect to y, that
    # path has no tangent in the rule (jax.grad fails too): tapegrad raises.
    @jax.custom_jvp
    def g(x):
        return jnp.sin(x) * y

    @g.defjvp
    def g_jvp(p, t):
        return g(p[0]), jnp.cos(p[0]) * y * t[0]

    return g(x)


def _closure_over_inner_value(x):
    # The rule closes over a value computed inside the function that does not depend on
    # x (a traced constant): eagerly the tape is recorded from a run and the rule split.
    return _closure_custom_jvp(x, jnp.cos(jnp.arange(3.0, dtype=x.dtype)) + 1.5)


@jax.custom_jvp
def _noisy(x):
    # An effect in the primal keeps the generic custom_jvp_call record (not split).
    jax.debug.callback(lambda v: None, x)
    return jnp.sin(x) * 2


@_noisy.defjvp
def _noisy_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _noisy(x), 2 * jnp.cos(x) * t


@jax.custom_vjp
def _cube(x):
    return x**3


_cube.defvjp(lambda x: (x**3, x), lambda x, g: (3 * x * x * g,))


def _pad_cases():
    """pad: every dtype, empty / negative / interior padding, the pad value differentiated."""
    cfgs = {
        "interior": ((1, 2, 1), (0, 1, 0)),
        "negative": ((-1, 0, 0), (-1, 0, 2)),
        "crop_all": ((-2, 0, 0), (0, 0, 0)),
        "mixed": ((2, -1, 1), (-2, 1, 1)),
    }
    out = [
        C("pad", f"{k}", lambda x, v, c=c: lax.pad(x, v, c), ((2, 3), ()), dtypes=ALL)
        for k, c in cfgs.items()
    ]
    out.append(
        C("pad", "scalar_empty_config", lambda x, v: lax.pad(x, v, ()), ((), ()), dtypes=ALL)
    )
    out.append(C("pad", "empty_operand", lambda x, v: lax.pad(x, v, ((1, 1, 1),)), ((0,), ())))
    out.append(
        C("pad", "const_value", lambda x: lax.pad(x, np.array(0, x.dtype), ((1, -1, 1),)), ((3,),))
    )
    for dt in ("bfloat16", "float16"):
        for k, c in cfgs.items():
            out.append(
                C(
                    "pad",
                    f"{dt}_{k}",
                    lambda x, v, c=c, dt=dt: lax.pad(x.astype(dt), v.astype(dt), c).astype(x.dtype),
                    ((2, 3), ()),
                    fd=False,
                    rtol=3e4,  # half precision inside; compared with jax doing the same
                )
            )
        out.append(
            C(
                "pad",
                f"{dt}_scalar_empty_config",
                lambda x, dt=dt: lax.pad(x.astype(dt), np.array(0, dt), ()).astype(x.dtype) * x,
                ((),),
                fd=False,
            )
        )
    ints = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    for k, c in cfgs.items():
        out.append(
            C(
                "pad",
                f"int32_{k}",
                lambda x, c=c: lax.pad(ints, np.int32(7), c).astype(x.dtype) * lax.pad(x, 0.0, c),
                ((2, 3),),
            )
        )
    return out


def _special_makers():
    """Inputs exactly at the points where a derivative needs a convention."""

    def at(*vals):
        return lambda dt: tuple(jnp.asarray(v, dt) for v in vals)

    s = []
    s.append(C("abs", "at_zero", jnp.abs, make=at([0.0, 1.0, -2.0]), dtypes=ALL, fd=False))
    for n in (0, 1, 2, 3, -1, -2):
        s.append(
            C(
                "integer_pow",
                f"at_zero_n{n}",
                lambda x, n=n: lax.integer_pow(x, n),
                make=at([0.0, 1.5, -0.5]),
                dtypes=ALL,
                fd=False,
            )
        )
    for y in (0.0, 1.0, 2.0, 0.5, -1.0):
        s.append(
            C("pow", f"at_zero_y{y}", lax.pow, make=at([0.0, 2.0], [y, y]), dtypes=ALL, fd=False)
        )
    for n in (0, 1, 2, -1):
        s.append(
            C(
                "pow",
                f"at_zero_int_exponent{n}",
                lambda x, n=n: lax.pow(x, jnp.full(x.shape, n, jnp.int32)),
                make=at([0.0, 2.0, -1.5]),
                dtypes=ALL,
                fd=False,
            )
        )
    s.append(C("max", "at_ties", jnp.maximum, make=at([1.0, 0.0, 2.0], [1.0, 0.0, 1.0]), fd=False))
    s.append(C("min", "at_ties", jnp.minimum, make=at([1.0, 0.0, 2.0], [1.0, 0.0, 1.0]), fd=False))
    s.append(
        C(
            "select_n",
            "where_at_boundary",
            lambda x: jnp.where(x > 0, x * x, jnp.sin(x)),
            make=at([0.0, 1.0, -1.0]),
            fd=False,
        )
    )
    s.append(
        C(
            "select_n",
            "where_nan_branch",
            lambda x: jnp.where(x > 0, jnp.sqrt(jnp.where(x > 0, x, 1.0)), 0.0),
            make=at([0.0, 4.0, -1.0]),
            fd=False,
        )
    )
    s.append(
        C("reduce_max", "at_ties", lambda x: jnp.max(x, 0), make=at([2.0, 2.0, 1.0]), fd=False)
    )
    s.append(
        C(
            "clamp",
            "at_bounds",
            lambda x: lax.clamp(-1.0, x, 1.0),
            make=at([-1.0, 1.0, 0.5]),
            fd=False,
        )
    )
    return s


CASES: list[Case] = [
    # --- linear elementwise
    C("neg", "neg", jnp.negative, dtypes=ALL),
    C("add", "add", jnp.add, ((3,), (3,)), dtypes=ALL),
    C("add_any", "jvp_sum", lambda x: jax.jvp(lambda a: a * a, (x,), (x,))[1] + x, dtypes=ALL),
    C("sub", "sub", jnp.subtract, ((3,), (3,)), dtypes=ALL),
    C(
        "convert_element_type",
        "to_complex",
        lambda x: lax.convert_element_type(x, jnp.result_type(x, jnp.complex64)) * (1 + 2j),
    ),
    C(
        "convert_element_type",
        "half_roundtrip",
        lambda x: x.astype(jnp.float16).astype(x.dtype) * x,
        fd=False,  # float16 steps are far wider than the finite-difference step
    ),
    C("copy", "copy", lambda x: jnp.copy(x) * x, dtypes=ALL),
    # placement: linear in the value (one device here; tests/test_placement.py has meshes)
    C("device_put", "to_device", lambda x: jax.device_put(x, jax.devices()[0]) * x, dtypes=ALL),
    C(
        "optimization_barrier",
        "pair",
        lambda x: jnp.prod(jnp.stack(lax.optimization_barrier((jnp.sin(x), x * x)))) * x,
        dtypes=ALL,
    ),
    C(
        "sharding_constraint",
        "single_device",
        lambda x: (
            lax.with_sharding_constraint(
                jnp.sin(x), jax.sharding.SingleDeviceSharding(jax.devices()[0])
            )
            * x
        ),
        dtypes=ALL,
    ),
    C(
        "reduce_precision",
        "bf16_bits",
        lambda x: lax.reduce_precision(x * x, exponent_bits=8, mantissa_bits=7),
        fd=False,
    ),
    C("real", "real", lambda z: jnp.real(z) ** 2, dtypes=CPLX),
    C("imag", "imag", lambda z: jnp.imag(z) ** 2 * jnp.real(z), dtypes=CPLX),
    C("complex", "complex", lambda x, y: lax.complex(x, y * y) ** 2, ((3,), (3,))),
    C("conj", "complex", lambda z: jnp.conj(z) * z, dtypes=CPLX),
    C("conj", "real_input", lambda x: lax.conj(x) * (1 + 2j)),
    # --- products, quotients, extrema
    C("mul", "mul", jnp.multiply, ((3,), (3,)), dtypes=ALL),
    C("div", "div", jnp.divide, ((3,), (3,)), ("signed", 0.5, 2.0), dtypes=ALL),
    C("max", "max", jnp.maximum, ((3,), (3,))),
    C("min", "min", jnp.minimum, ((3,), (3,))),
    C("pow", "pow", lax.pow, ((3,), (3,)), (0.5, 2.0), dtypes=ALL),
    C(
        "pow",
        "int_exponent",
        lambda x: x ** jnp.array([1, 2, -3]),
        ((3,),),
        (0.5, 2.0),
        dtypes=ALL,
    ),
    C("integer_pow", "cube", lambda x: x**3, dtypes=ALL),
    C("integer_pow", "inverse_square", lambda x: x**-2, ((3,),), ("signed", 0.5, 2.0), dtypes=ALL),
    C("square", "square", jnp.square, dtypes=ALL),
    # --- roots, exponentials, logs
    C("sqrt", "sqrt", jnp.sqrt, domain=(0.5, 2.0), dtypes=ALL),
    C("rsqrt", "rsqrt", lax.rsqrt, domain=(0.5, 2.0), dtypes=ALL),
    C("cbrt", "cbrt", jnp.cbrt, domain=("signed", 0.5, 2.0)),
    C("exp", "exp", jnp.exp, dtypes=ALL),
    C("exp2", "exp2", jnp.exp2, dtypes=ALL),
    C("expm1", "expm1", jnp.expm1, dtypes=ALL),
    C("log", "log", jnp.log, domain=(0.5, 2.0), dtypes=ALL),
    C("log1p", "log1p", jnp.log1p, domain=(0.0, 1.0), dtypes=ALL),
    C("tanh", "tanh", jnp.tanh, dtypes=ALL),
    C("logistic", "logistic", jax.nn.sigmoid, dtypes=ALL),
    # --- trigonometric, hyperbolic
    C("sin", "sin", jnp.sin, dtypes=ALL),
    C("cos", "cos", jnp.cos, dtypes=ALL),
    C("tan", "tan", jnp.tan, dtypes=ALL),
    C("asin", "asin", jnp.arcsin, domain=(-0.8, 0.8), dtypes=ALL),
    C("acos", "acos", jnp.arccos, domain=(-0.8, 0.8), dtypes=ALL),
    C("atan", "atan", jnp.arctan, dtypes=ALL),
    C("atan2", "atan2", jnp.arctan2, ((3,), (3,)), ("signed", 0.5, 2.0)),
    C("sinh", "sinh", jnp.sinh, dtypes=ALL),
    C("cosh", "cosh", jnp.cosh, dtypes=ALL),
    C("asinh", "asinh", jnp.arcsinh, dtypes=ALL),
    C("acosh", "acosh", jnp.arccosh, domain=(1.5, 3.0), dtypes=ALL),
    C("atanh", "atanh", jnp.arctanh, domain=(-0.8, 0.8), dtypes=ALL),
    C("erf", "erf", jax.scipy.special.erf),
    C("erfc", "erfc", jax.scipy.special.erfc),
    C("erf_inv", "erf_inv", jax.scipy.special.erfinv, domain=(-0.8, 0.8)),
    # --- piecewise
    C("abs", "abs", jnp.abs, domain=("signed", 0.2, 2.0), dtypes=ALL),
    C(
        "clamp",
        "clamp",
        lambda lo, x, hi: lax.clamp(lo, x, hi),
        make=lambda dt: (
            jnp.asarray([-0.5, -0.4, -0.6], dt),
            jnp.asarray([-0.9, 0.1, 0.8], dt),
            jnp.asarray([0.5, 0.7, 0.6], dt),
        ),
    ),
    C("select_n", "where", lambda x, y: jnp.where(x > 0, x * y, jnp.sin(y)), ((3,), (3,))),
    C(
        "select_n",
        "select_n_3way",
        lambda x: lax.select_n(jnp.array([0, 1, 2], jnp.int32), x, x * x, jnp.exp(x)),
        dtypes=ALL,
    ),
    # --- structural
    C(
        "broadcast_in_dim",
        "broadcast",
        lambda x: lax.broadcast_in_dim(x, (2, 3, 4), (1, 2)),
        ((3, 1),),
        dtypes=ALL,
    ),
    C("reshape", "reshape", lambda x: x.reshape(3, 2) * x.reshape(3, 2), ((2, 3),), dtypes=ALL),
    C(
        "reshape",
        "dimensions",
        lambda x: lax.reshape(x, (6,), dimensions=(1, 0)),
        ((2, 3),),
        dtypes=ALL,
    ),
    C("squeeze", "squeeze", lambda x: jnp.squeeze(x, 1) ** 2, ((3, 1),), dtypes=ALL),
    C("transpose", "transpose", lambda x: x.T**2, ((2, 3),), dtypes=ALL),
    C("reduce_sum", "sum", lambda x: jnp.sum(x * x, 1), ((2, 3),), dtypes=ALL),
    C("name", "checkpoint_name", lambda x: checkpoint_name(x * x, "h") * x),
    # --- indexing
    C("rev", "rev", lambda x: lax.rev(x, (0,)) * x, dtypes=ALL),
    C("slice", "strided", lambda x: x[1::2, ::2] ** 2, ((4, 5),), dtypes=ALL),
    C("slice", "unit", lambda x: lax.slice(x, (1,), (3,)) ** 2, ((4,),), dtypes=ALL),
    C(
        "dynamic_slice",
        "dynamic_slice",
        lambda x: lax.dynamic_slice(x, (jnp.int32(1),), (2,)) ** 2,
        ((4,),),
        dtypes=ALL,
    ),
    C(
        "dynamic_update_slice",
        "dus",
        lambda x, u: lax.dynamic_update_slice(x, u * u, (jnp.int32(1),)) * x,
        ((4,), (2,)),
        dtypes=ALL,
    ),
    C("concatenate", "concat", lambda x, y: jnp.concatenate([x, y * y]), ((2,), (3,)), dtypes=ALL),
    C("split", "split", lambda x: lax.split(x, (1, 3), axis=0)[1] ** 2, ((4,),), dtypes=ALL),
    *_pad_cases(),
    C(
        "gather",
        "take",
        lambda x: lax.gather(x, _IDX, _GDN, (1, 2), mode="clip") ** 2,
        ((3, 2),),
        dtypes=ALL,
    ),
    C(
        "scatter-add",
        "add",
        lambda x, u: lax.scatter_add(x, _IDX, u * u, _SDN) * x,
        ((4,), (3,)),
        dtypes=ALL,
    ),
    C(
        "scatter-sub",
        "sub",
        lambda x, u: lax.scatter_sub(x, _IDX, u * u, _SDN) * x,
        ((4,), (3,)),
        dtypes=ALL,
    ),
    C(
        "scatter",
        "overwrite_repeated",
        lambda x, u: lax.scatter(x, _IDX, u * u, _SDN) * x,
        ((4,), (3,)),
        dtypes=ALL,
    ),
    C(
        "scatter",
        "overwrite_unique",
        lambda x, u: lax.scatter(x, _UIDX, u * u, _SDN, unique_indices=True) * x,
        ((4,), (2,)),
        dtypes=ALL,
    ),
    C(
        "scatter-mul",
        "mul",
        lambda x, u: lax.scatter_mul(x, _UIDX, u, _SDN, unique_indices=True),
        ((4,), (2,)),
        dtypes=ALL,
    ),
    C(
        "scatter-min",
        "min",
        lambda x, u: lax.scatter_min(x, _IDX, u, _SDN),
        ((4,), (3,)),
    ),
    C(
        "scatter-max",
        "max",
        lambda x, u: lax.scatter_max(x, _IDX, u, _SDN),
        ((4,), (3,)),
    ),
    C(
        "select_and_gather_add",
        "maxpool_jvp",
        lambda x, t: jax.jvp(_pool, (x,), (t,))[1] * x[:, :3],
        ((2, 3), (2, 3)),
        order=2,
    ),
    C("stack", "stack", lambda x, y: lax.stack((x, y * y), 0), ((3,), (3,)), dtypes=ALL),
    C("unstack", "unstack", lambda x: lax.unstack(x, 0)[1] ** 2, ((2, 3),), dtypes=ALL),
    # --- reductions
    C("reduce_max", "max", lambda x: jnp.max(x, 1), ((2, 3),)),
    C("reduce_min", "min", lambda x: jnp.min(x, 0), ((2, 3),)),
    C("reduce_prod", "prod", lambda x: jnp.prod(x, 1), ((2, 3),), dtypes=ALL),
    C("cumsum", "cumsum", lambda x: jnp.cumsum(x * x), ((4,),), dtypes=ALL),
    C("cumprod", "cumprod", lambda x: lax.cumprod(x, reverse=True), ((4,),), dtypes=ALL),
    C("cumlogsumexp", "cumlogsumexp", lambda x: lax.cumlogsumexp(x), ((4,),)),
    C("cummax", "cummax", lambda x: lax.cummax(x), ((4,),)),
    C("cummin", "cummin", lambda x: lax.cummin(x, reverse=True), ((4,),)),
    C("sort", "sort", lambda x: jnp.sort(x) * jnp.arange(1.0, 5.0), ((4,),)),
    C("sort", "multi_operand", lambda x, y: lax.sort((x, y), num_keys=1)[1] ** 2, ((4,), (4,))),
    # --- linalg, convolution, windows
    C("dot_general", "matmul", jnp.matmul, ((2, 3), (3, 2)), dtypes=ALL),
    C(
        "dot_general",
        "batched",
        lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
        ((2, 2, 3), (2, 3, 2)),
        dtypes=ALL,
    ),
    C(
        "conv_general_dilated",
        "conv1d",
        lambda x, w: lax.conv_general_dilated(x, w, (1,), ((1, 0),), rhs_dilation=(2,)),
        ((1, 2, 5), (3, 2, 2)),
        dtypes=ALL,
    ),
    C("reduce_window_sum", "sum", lambda x: _pool(x, "add"), ((2, 3),)),
    C("reduce_window_max", "max", lambda x: _pool(x, "max"), ((2, 3),)),
    C("reduce_window_min", "min", lambda x: _pool(x, "min"), ((2, 3),)),
    # jax has no reverse mode for a reduce_window whose init is not the identity; where
    # the init never wins (positive inputs, init 0) the derivative is max pooling's.
    C(
        "reduce_window",
        "generic_max",
        lambda x: _pool(x, "max", 0.0),
        ((2, 3),),
        (0.1, 1.0),
        oracle=lambda x: _pool(x, "max"),
    ),
    # --- calls with a sub-program
    C("custom_jvp_rule", "user_rule", lambda x: _softclip(x) * x),
    C("custom_jvp_rule", "relu", lambda x: jax.nn.relu(x) * x, domain=("signed", 0.2, 1.0)),
    C("custom_jvp_call", "effectful", lambda x: _noisy(x) * x),
    C(
        "custom_jvp_rule",
        "closes_over_inner_value",
        _closure_over_inner_value,
        ((3,),),
        batch=False,
        order=1,
    ),
    C("custom_vjp_call", "custom_vjp", lambda x: _cube(x) * x),
    *_special_makers(),
]

# Registry entries no case above reaches, and why; each has its own test below.
NOT_SWEPT = {
    "copy_p": "no primitive is named copy_p: lax.copy_p's name is 'copy' (swept)",
    "expand_dims": "jax 0.10 has no expand_dims primitive: lax.expand_dims binds broadcast_in_dim",
    "remat2": "jax.checkpoint calls are inlined into checkpoint regions at trace time",
    "checkpoint": "the remat spelling of older jax; inlined like remat2",
    "while": "no reverse mode (jax neither): an error rule",
}


# ---------------------------------------------------------------------------
# The check. Per dtype, every case's derivatives are computed inside one `jax.jit`
# (compiled once, with XLA's cheap CPU settings): eagerly, each new primitive/shape/
# dtype costs a compile, and the sweep would take minutes instead of seconds. tapegrad's
# interpreter and rules run the same under jit; `test_eager_*` below cover eager values.

_BASE_TOL = {
    "float32": (2e-5, 2e-6),
    "complex64": (2e-5, 2e-6),
    "float64": (1e-10, 1e-12),
    "complex128": (1e-10, 1e-12),
}
_FD_DTYPES = ("float64", "complex128")
_FD_EPS = 1e-4
# XLA's cheapest CPU compile (these small programs run in microseconds anyway); fusion
# emitters off alone makes compiling the sweep ~3x faster.
_FAST_COMPILE = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}


def _supported(options: dict) -> dict:
    """The options this XLA accepts (newer ones dropped ``xla_cpu_use_fusion_emitters``)."""
    keep = {}
    for k, v in options.items():
        try:
            jax.jit(lambda x: x + 1, compiler_options={k: v}).lower(1.0).compile()
        except Exception:
            continue
        keep[k] = v
    return keep


_FAST_COMPILE = _supported(_FAST_COMPILE)
_CHUNK = 16  # cases per compiled program: compile time grows faster than linearly
# jax.vjp of tapegrad's order-2 function as well (jax.grad of tg.grad) for these rules
# and the special points; the others check tg of tg.
_JAX_OF_TG = {"abs", "pow", "integer_pow", "pad", "custom_jvp_rule", "custom_vjp_call", "sort"}


def _tol(case: Case, dtype) -> dict:
    rtol, atol = _BASE_TOL[jnp.dtype(dtype).name]
    return dict(rtol=rtol * case.rtol, atol=atol * case.rtol)


def _rand_like(tree, seed):
    rng = np.random.RandomState(seed)

    def one(x):
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            return np.zeros(x.shape, jax.dtypes.float0)
        v = rng.uniform(-1, 1, x.shape)
        if jnp.issubdtype(x.dtype, jnp.complexfloating):
            v = v + 1j * rng.uniform(-1, 1, x.shape)
        return np.asarray(v, x.dtype)

    return jax.tree_util.tree_map(one, tree)


def _second(vjp, f):
    """``check_grads``' order-2 function: the VJP of ``f`` applied to ``f``'s output."""

    def h(*args):
        out, back = vjp(f, *args)
        return back(out)

    return h


def _shift(args, v, eps):
    return tuple(a + eps * t for a, t in zip(args, v))


def _fd(f, args, v, ct):
    """What ``jax.test_util.check_vjp`` compares: the central difference of ``f`` along
    ``v`` (paired with ``ct``) and tapegrad's VJP of ``ct`` (paired with ``v``)."""
    plus, minus = f(*_shift(args, v, _FD_EPS)), f(*_shift(args, v, -_FD_EPS))
    jvp = jax.tree_util.tree_map(lambda a, b: (a - b) / (2 * _FD_EPS), plus, minus)
    back = tg.vjp(f, *args)[1](jax.tree_util.tree_map(jnp.conj, ct))
    return jvp, jax.tree_util.tree_map(jnp.conj, back)


def _derivatives(case: Case, args, dtype) -> dict:
    """Everything the check compares, for one case (traceable: run under jit)."""
    f, g = case.fn, case.oracle or case.fn
    out_j, back_j = jax.vjp(g, *args)
    ct = _rand_like(jax.eval_shape(g, *args), 1)
    out_t, back_t = tg.vjp(f, *args)
    r = {"primal": (out_t, out_j), "order 1: tg.vjp vs jax.vjp": (back_t(ct), back_j(ct))}
    fd = case.fd and dtype in _FD_DTYPES
    v = _rand_like(jax.eval_shape(lambda *a: a, *args), 3)
    if fd:
        r["fd1"] = (v, ct, *_fd(f, args, v, ct))
    if case.order >= 2:
        h_t, h_j = _second(tg.vjp, f), _second(jax.vjp, g)
        ct2 = _rand_like(jax.eval_shape(h_j, *args), 2)
        want_out, back_want = jax.vjp(h_j, *args)
        want = back_want(ct2)
        got_out, back_tt = tg.vjp(h_t, *args)
        r["order 2 primal"] = (got_out, want_out)
        r["order 2: tg.vjp of tg.vjp vs jax"] = (back_tt(ct2), want)
        if case.rule in _JAX_OF_TG or case.make is not None:
            r["order 2: jax.vjp of tg.vjp vs jax"] = (jax.vjp(h_t, *args)[1](ct2), want)
        if fd:
            r["fd2"] = (v, ct2, *_fd(h_t, args, v, ct2))
    return r


@functools.cache
def _batch(dtype) -> dict:
    """case id -> `_derivatives` (as numpy) or the exception it raised, for every batched
    case of ``dtype``. One compile for all; a case that fails to trace or compile is
    retried alone, so it fails only its own test."""
    cases = [c for c in CASES if dtype in c.dtypes and c.batch]
    with enable_x64(dtype in _FD_DTYPES):
        args = {c.id: _args(c, dtype) for c in cases}

        def run(cases, args):
            out, errors = {}, {}
            for c in cases:
                try:
                    out[c.id] = _derivatives(c, args[c.id], dtype)
                except Exception as e:  # reported by the case's own test
                    errors[c.id] = e
            return out, errors

        def jitted(cases):
            errors: dict = {}

            def values(args):
                out, errs = run(cases, args)
                errors.update(errs)
                return out

            fn = jax.jit(values, compiler_options=_FAST_COMPILE)
            out = jax.tree_util.tree_map(np.asarray, fn({c.id: args[c.id] for c in cases}))
            return {**out, **errors}

        results: dict = {}
        for k in range(0, len(cases), _CHUNK):
            chunk = cases[k : k + _CHUNK]
            try:
                results.update(jitted(chunk))
            except Exception:
                for c in chunk:
                    try:
                        results.update(jitted([c]))
                    except Exception as e:
                        results[c.id] = e
        return results


def _close(got, want, err, **tol):
    gl, gt = jax.tree_util.tree_flatten(got)
    wl, wt = jax.tree_util.tree_flatten(want)
    assert gt == wt, f"{err}: structure {gt} != {wt}"
    for k, (g, w) in enumerate(zip(gl, wl)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (
            f"{err} leaf {k}: {g.shape} {g.dtype} vs jax {w.shape} {w.dtype}"
        )
        np.testing.assert_allclose(g, w, err_msg=f"{err} leaf {k}", equal_nan=True, **tol)


def _inner(xs, ys) -> float:
    pairs = zip(jax.tree_util.tree_leaves(xs), jax.tree_util.tree_leaves(ys))
    return sum(float(np.real(np.vdot(np.ravel(x), np.ravel(y)))) for x, y in pairs)


def _compare(case: Case, dtype, r: dict) -> None:
    tol = _tol(case, dtype)
    for key, value in r.items():
        if key.startswith("fd"):
            v, ct, jvp, back = value
            got, want = _inner(v, back), _inner(jvp, ct)
            # jax.test_util.check_vjp's float64 tolerance
            np.testing.assert_allclose(
                got, want, rtol=1e-5, atol=1e-5, err_msg=f"order {key[2]}: finite differences"
            )
        else:
            _close(*value, key, **tol)


def _params():
    for case in CASES:
        for dt in case.dtypes:
            marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
            yield pytest.param(case, dt, id=f"{case.id}-{dt}", marks=marks)


@pytest.mark.parametrize("case,dtype", list(_params()))
def test_check_grads(case, dtype):
    if case.batch:
        r = _batch(dtype)[case.id]
    else:
        with enable_x64(dtype in _FD_DTYPES):
            r = _derivatives(case, _args(case, dtype), dtype)
    if isinstance(r, Exception):
        raise r
    _compare(case, dtype, r)


# ---------------------------------------------------------------------------
# Eagerly, with Python scalars: the values jax.grad gives at the special points.


@pytest.mark.parametrize("y", [0.0, 1.0, 2.0, 0.5, -1.0])
def test_eager_pow_at_zero_python_scalars(y):
    f = lambda x, y: x**y
    for x in (0.0, 2.0):
        _close(tg.grad(f, (0, 1))(x, y), jax.grad(f, (0, 1))(x, y), f"pow({x}, {y})", rtol=1e-6)


@pytest.mark.parametrize("n", [0, 1, 2, 3, -1, -2])
def test_eager_integer_pow_at_zero(n):
    f = lambda x: x**n
    for x in (0.0, jnp.float32(0.0), 1.5):
        _close(tg.grad(f)(x), jax.grad(f)(x), f"d/dx x**{n} at {x}", rtol=1e-6)
        _close(tg.grad(tg.grad(f))(x), jax.grad(jax.grad(f))(x), f"d2 x**{n} at {x}", rtol=1e-6)
    g = lambda x: x ** jnp.int32(n)  # pow with an integer exponent array
    _close(tg.grad(g)(0.0), jax.grad(g)(0.0), f"pow(0, int {n})", rtol=1e-6)


def test_eager_abs_complex_second_order():
    # Issue 13: a real loss of tg.grad(abs) differentiated again was 77% off.
    z = jnp.complex64(1.0 + 2.0j)

    def loss(grad):
        return lambda z: jnp.real(grad(jnp.abs)(z)) * 3 + jnp.imag(grad(jnp.abs)(z)) * 2

    want = jax.grad(loss(jax.grad))(z)
    _close(tg.grad(loss(tg.grad))(z), want, "tg of tg", rtol=1e-6)
    _close(jax.grad(loss(tg.grad))(z), want, "jax of tg", rtol=1e-6)


# ---------------------------------------------------------------------------
# Coverage of the registry, and that each case reaches its rule


def test_sweep_covers_the_registry():
    swept = {c.rule for c in CASES}
    assert not (swept - set(RULES)), f"cases for unknown rules: {sorted(swept - set(RULES))}"
    missing = set(RULES) - swept - set(NOT_SWEPT)
    assert not missing, f"rules with no check_grads case: {sorted(missing)}"
    assert not (set(NOT_SWEPT) & swept)


def _records(tape):
    for r in tape.records:
        yield r
        for body in r.bodies:
            yield from _records(body)


@pytest.mark.parametrize("case", [c for c in CASES if c.make is None], ids=lambda c: c.id)
def test_case_reaches_its_rule(case):
    with enable_x64(case.dtypes[0] in _FD_DTYPES):
        args = _args(case, case.dtypes[0])
        tape = tg.trace(case.fn)(*args)
    kinds = {(r.primitive, r.rule) for r in _records(tape)}
    assert any(p == case.rule and k not in ("none", "fallback") for p, k in kinds), kinds


def test_checkpoint_rules_are_inlined():
    x = jnp.arange(3.0)
    f = jax.checkpoint(lambda x: jnp.sin(x) * x)
    tape = tg.trace(f)(x)
    assert not any(r.primitive in ("remat2", "checkpoint") for r in _records(tape))
    _compare(
        C("remat2", "inlined", f),
        "float32",
        _derivatives(C("remat2", "inlined", f), (x,), "float32"),
    )


def test_unreachable_names_are_unreachable():
    x = jnp.ones((2, 3))
    assert lax.copy_p.name == "copy"
    for f in (lambda x: lax.expand_dims(x, (0,)), lambda x: jnp.expand_dims(x, 1)):
        eqns = jax.make_jaxpr(f)(x).jaxpr.eqns
        assert eqns and all(e.primitive.name not in ("expand_dims", "copy_p") for e in eqns)


def test_while_has_no_reverse_mode_like_jax():
    def f(x):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x))[1]

    with pytest.raises(ValueError, match="Reverse-mode differentiation does not work"):
        jax.vjp(f, 1.0)[1](1.0)
    with pytest.raises(tg.errors.ReverseModeError, match="while_loop"):
        tg.vjp(f, 1.0)[1](1.0)


def test_a_rule_closing_over_a_differentiated_value_raises():
    x, y = jnp.array([0.3, 0.5, 0.7]), jnp.array([1.0, 2.0, 3.0])
    with pytest.raises(tg.errors.ReverseModeError, match="closes over") as e:
        tg.grad(lambda x, y: jnp.sum(_closure_custom_jvp(x, y)), argnums=1)(x, y)
    assert "test_check_grads_sweep.py" in str(e.value)  # the user's line
    # Not differentiated with respect to y: the rule's own derivative, recorded eagerly.
    g = tg.grad(lambda x, y: jnp.sum(_closure_custom_jvp(x, y)))(x, y)
    np.testing.assert_allclose(g, jnp.cos(x) * y, rtol=1e-6)
    with pytest.raises(tg.errors.ReverseModeError, match="only eagerly"):  # jax raises too
        jax.jit(tg.grad(lambda x, y: jnp.sum(_closure_custom_jvp(x, y)), argnums=1))(x, y)
    # Under jit, y not differentiated is a value of the enclosing jit, alive in backward.
    g = jax.jit(tg.grad(lambda x, y: jnp.sum(_closure_custom_jvp(x, y))))(x, y)
    np.testing.assert_allclose(g, jnp.cos(x) * y, rtol=1e-6)
