"""Random programs: tapegrad's gradient of a random composition of primitives
equals jax.grad's.

A program is 1-3 inputs whose shapes broadcast to a random base shape (rank
0-3; some dims 1, some leading dims missing), then a list of steps, each a
unary op from a domain-safe set applied to an earlier value, a binary op
combining two earlier values (with broadcasting), or an op along one axis
(keepdims sum/max, centering, flip, cumsum, softmax, roll); the output is a
reduction (sum, mean, max, min, prod, logsumexp) of the last values. Checked in float64 with
tight tolerances, and in float32 with the usual ones. The number of programs
tried is printed in the run's closing summary (see conftest.py); hypothesis.event
records program sizes for --hypothesis-show-statistics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
from conftest import assert_trees_close, enable_x64
from hypothesis import event, given, note, settings
from hypothesis import strategies as st
from jax import lax

import tapegrad as tg

# Unary ops that are defined and smooth (almost) everywhere on the reals, and
# keep values moderate however they are composed.
UNARY = {
    "sin": jnp.sin,
    "cos": jnp.cos,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "atan": jnp.arctan,
    "asinh": jnp.arcsinh,
    "erf": jss.erf,
    "neg": jnp.negative,
    "half": lambda x: x * 0.5,
    "shift": lambda x: x + 1.0,
    "log1p_sq": lambda x: jnp.log1p(x * x),
    "sqrt1p_sq": lambda x: jnp.sqrt(1.0 + x * x),
    "rsqrt1p_sq": lambda x: lax.rsqrt(1.0 + jnp.square(x)),
    "gauss": lambda x: jnp.exp(-x * x),
    "expm1_tanh": lambda x: jnp.expm1(jnp.tanh(x)),
    "cube_tanh": lambda x: jnp.tanh(x) ** 3,
    "abs": jnp.abs,
    "softplus": jax.nn.softplus,
    "cbrt1p": lambda x: jnp.cbrt(1.5 + jnp.cos(x)),
    "stop_grad_mix": lambda x: x * lax.stop_gradient(jnp.cos(x)),
}

BINARY = {
    "add": jnp.add,
    "sub": jnp.subtract,
    "mul": jnp.multiply,
    "div": lambda x, y: x / (1.0 + y * y),
    "max": jnp.maximum,
    "min": jnp.minimum,
    "where": lambda x, y: jnp.where(x > y, jnp.sin(x), y * 0.5),
    "atan2": lambda x, y: jnp.arctan2(x, 2.0 + jnp.cos(y)),
    "pow": lambda x, y: jnp.power(1.0 + x * x, jnp.tanh(y)),
}

# Ops along one axis that keep the value broadcastable to the base shape.
AXIS_OPS = {
    "sum_keepdims": lambda v, a: jnp.sum(v, axis=a, keepdims=True),
    "max_keepdims": lambda v, a: jnp.max(v, axis=a, keepdims=True),
    "center": lambda v, a: v - jnp.mean(v, axis=a, keepdims=True),
    "flip": lambda v, a: jnp.flip(v, axis=a),
    "cumsum": lambda v, a: jnp.cumsum(v, axis=a),
    "softmax": lambda v, a: jax.nn.softmax(v, axis=a),
    "roll": lambda v, a: jnp.roll(v, 1, axis=a),
}


def _dot_last(x, y):
    """A contraction over the last axis (dot_general), kept as a size-1 axis."""
    if x.ndim == 0 or y.ndim == 0 or x.shape[-1] != y.shape[-1]:
        return x * y
    return jnp.einsum("...i,...i->...", x, y)[..., None]


BINARY["dot_last"] = _dot_last

FINAL = {
    "sum": jnp.sum,
    "mean": jnp.mean,
    "sumsq": lambda v: jnp.sum(v * v),
    "max": jnp.max,
    "logsumexp": jss.logsumexp,
    "min": jnp.min,
    "prod": lambda v: jnp.prod(1.0 + 0.5 * jnp.tanh(v)),
}


@st.composite
def programs(draw):
    rank = draw(st.integers(0, 3))
    base = tuple(draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
    n_in = draw(st.integers(1, 3))
    shapes = []
    for _ in range(n_in):
        drop = draw(st.integers(0, rank))  # leading dims left to broadcasting
        shape = tuple(1 if draw(st.booleans()) and draw(st.booleans()) else d for d in base[drop:])
        shapes.append(shape)
    shapes[0] = base  # so the output has the full shape at least once
    n_steps = draw(st.integers(2, 8))
    steps = []
    for k in range(n_steps):
        avail = n_in + k
        kind = draw(st.sampled_from(["u", "u", "b", "b", "a"]))
        if kind == "u":
            steps.append(
                ("u", draw(st.sampled_from(sorted(UNARY))), draw(st.integers(0, avail - 1)))
            )
        elif kind == "b":
            steps.append(
                (
                    "b",
                    draw(st.sampled_from(sorted(BINARY))),
                    draw(st.integers(0, avail - 1)),
                    draw(st.integers(0, avail - 1)),
                )
            )
        else:
            steps.append(
                (
                    "a",
                    draw(st.sampled_from(sorted(AXIS_OPS))),
                    draw(st.integers(0, 2)),
                    draw(st.integers(0, avail - 1)),
                )
            )
    n_final = draw(st.integers(1, 2))
    finals = [draw(st.sampled_from(sorted(FINAL))) for _ in range(n_final)]
    seed = draw(st.integers(0, 2**31 - 1))
    return {"shapes": shapes, "steps": steps, "finals": finals, "seed": seed}


def build(prog):
    """The program as a Python function of its inputs."""

    def f(*xs):
        vals = list(xs)
        for step in prog["steps"]:
            if step[0] == "u":
                vals.append(UNARY[step[1]](vals[step[2]]))
            elif step[0] == "b":
                vals.append(BINARY[step[1]](vals[step[2]], vals[step[3]]))
            else:
                _, name, axis, i = step
                v = vals[i]
                vals.append(AXIS_OPS[name](v, axis % v.ndim) if v.ndim else v * 2.0)
        out = 0.0
        for k, name in enumerate(prog["finals"]):
            out = out + FINAL[name](vals[-1 - k % len(vals)])
        return out

    return f


def inputs(prog, dtype):
    rng = np.random.RandomState(prog["seed"])
    return [jnp.asarray(rng.uniform(-2, 2, size=s), dtype) for s in prog["shapes"]]


_COUNT = {"float64": 0, "float32": 0}


def _check(prog, dtype, rtol, atol):
    note(f"program: {prog}")
    event(f"steps={len(prog['steps'])}")
    event(f"rank={len(prog['shapes'][0])}")
    f = build(prog)
    xs = inputs(prog, dtype)
    argnums = tuple(range(len(xs)))
    got_v, got = tg.value_and_grad(f, argnums=argnums)(*xs)
    want_v, want = jax.value_and_grad(f, argnums=argnums)(*xs)
    _COUNT[dtype] += 1
    assert_trees_close(got_v, want_v, rtol=rtol, atol=atol)
    assert_trees_close(got, want, rtol=rtol, atol=atol)


@settings(max_examples=60)
@given(programs())
def _random_programs_float64(prog):
    with enable_x64():
        # Formulas for the same derivative may differ by a few roundings per op,
        # and a program chains up to 8 ops: allow 1e-9 rather than 1e-10.
        _check(prog, "float64", rtol=1e-9, atol=1e-10)


@settings(max_examples=15)
@given(programs())
def _random_programs_float32(prog):
    with enable_x64(False):
        # Same reason as above, at float32 precision (eps 1.2e-7, up to ~8 ops).
        _check(prog, "float32", rtol=2e-5, atol=2e-5)


def _run_and_report(request, run, dtype):
    before = _COUNT[dtype]
    try:
        run()
    finally:
        n = _COUNT[dtype] - before
        msg = f"test_hypothesis: {n} random {dtype} programs checked against jax.grad"
        print(msg)
        request.node.user_properties.append(("summary", msg))  # printed by conftest
    assert n > 0, "hypothesis ran no program"


def test_random_programs_float64(request):
    _run_and_report(request, _random_programs_float64, "float64")


def test_random_programs_float32(request):
    _run_and_report(request, _random_programs_float32, "float32")


def test_programs_are_built_as_described():
    """The builder itself: a fixed program gives the value computed by hand."""
    prog = {
        "shapes": [(2, 3), (3,)],
        "steps": [("b", "mul", 0, 1), ("u", "sin", 2), ("a", "sum_keepdims", 1, 3)],
        "finals": ["sum"],
        "seed": 0,
    }
    x, y = inputs(prog, "float32")
    want = jnp.sum(jnp.sum(jnp.sin(x * y), axis=1, keepdims=True))
    np.testing.assert_allclose(build(prog)(x, y), want, rtol=1e-6)
