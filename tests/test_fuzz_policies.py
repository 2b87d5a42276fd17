"""Fuzzing: random programs, random residual policies, random (and wrong) inputs.

A program is a few float32 inputs of a random base shape (rank 0-3, dims 1-4,
some broadcast), then 2-8 steps drawn from the primitive set -- unary
elementwise ops, broadcasting binary ops, matmuls with a fresh weight input,
reductions, transposes, reshapes, slices, concatenations -- and a scalar loss.
The programs come from tests/_fuzz_programs.py (shared with bench/fuzz.py). The checks:

1. tapegrad's gradient equals jax.grad's (policy save()).
2. No residual policy changes the gradient: save / offload / hooks(identity) /
   selective(NEVER) within float32 rounding; compress(bfloat16) / compress("int8")
   within their quantisation error (2^-8 and 1/254 of a residual's range, a few
   ops deep: 3% and 6% of the gradient's scale). Programs checked under
   compression use smooth ops only: a quantised residual may flip a comparison
   (abs, max, where), which moves the gradient by design, not by a bug.
3. No input -- wrong dtypes, shapes, containers, NaN/Inf/huge values, bad argnums --
   makes tapegrad fail with anything but a `tg.TapegradError` or jax's own error
   (an exception from jax's code, or the type jax.grad raises for the same call);
   when both succeed on finite inputs, the gradients agree.

The number of programs tried is printed in the run's closing summary (conftest.py).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _fuzz_programs import (
    COMPRESSING,
    POLICIES,
    POLICY_TOL,
    HypothesisDraw,
    build,
    generate,
    inputs,
    max_err,
    scale,
)
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import tapegrad as tg

pytestmark = pytest.mark.filterwarnings("ignore:tapegrad anomaly detection is enabled")

COUNT = {"programs": 0, "policy_runs": 0, "inputs": 0, "input_errors": 0}
# A long fuzzing run: TAPEGRAD_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz_policies.py
N_EXAMPLES = int(os.environ.get("TAPEGRAD_FUZZ_EXAMPLES", "50"))
SETTINGS = dict(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)


# ---------------------------------------------------------------- programs


@st.composite
def programs(draw, smooth: bool = False):
    """A program as data (tests/_fuzz_programs.py), drawn by hypothesis."""
    return generate(HypothesisDraw(draw), smooth)


# ---------------------------------------------------------------- 1 + 2: gradients and policies


@st.composite
def program_and_policy(draw):
    name = draw(st.sampled_from(sorted(POLICIES)))
    return draw(programs(smooth=name in COMPRESSING)), name


@settings(max_examples=N_EXAMPLES, **SETTINGS)
@given(program_and_policy())
def _programs_and_policies(case):
    prog, name = case
    note(f"program: {prog}\npolicy: {name}")
    event(f"policy={name}")
    f, xs = build(prog), inputs(prog)
    argnums = tuple(range(len(xs)))
    want = jax.grad(f, argnums=argnums)(*xs)
    got = tg.grad(f, argnums=argnums)(*xs)
    COUNT["programs"] += 1
    sc = scale(want)
    assert max_err(got, want) <= 1e-4 * sc, (got, want)
    with_policy = tg.grad(f, argnums=argnums, policy=POLICIES[name])(*xs)
    COUNT["policy_runs"] += 1
    err = max_err(with_policy, got)
    assert err <= POLICY_TOL[name] * scale(got), (
        f"{name}: error {err:.3g} at scale {scale(got):.3g}"
    )


# ---------------------------------------------------------------- 3: any input


def _mutate(draw, x):
    kind = draw(st.sampled_from(["none", "dtype", "values", "shape", "container"]))
    event(f"mutation={kind}")
    if kind == "dtype":
        dt = draw(st.sampled_from(["float16", "bfloat16", "float64", "int32", "bool", "complex64"]))
        return np.asarray(x).astype(dt) if dt != "bfloat16" else x.astype(jnp.bfloat16)
    if kind == "values":
        special = draw(st.sampled_from([np.nan, np.inf, -np.inf, 0.0, 1e30, -1e-30]))
        a = np.array(x)
        if a.ndim == 0:
            return jnp.asarray(special, jnp.float32)
        a.reshape(-1)[draw(st.integers(0, a.size - 1))] = special
        return jnp.asarray(a)
    if kind == "shape":
        how = draw(st.sampled_from(["add_dim", "drop_dim", "grow", "scalar"]))
        a = np.asarray(x)
        if how == "add_dim":
            return jnp.asarray(a[None].repeat(2, 0))
        if how == "drop_dim" and a.ndim:
            return jnp.asarray(a.reshape(-1)[: max(1, a.size // 2)])
        if how == "grow":
            return jnp.asarray(np.resize(a, tuple(d + 1 for d in a.shape)))
        return jnp.asarray(1.5, jnp.float32)
    if kind == "container":
        how = draw(st.sampled_from(["numpy", "list", "python_scalar", "tuple_pair", "string"]))
        a = np.asarray(x)
        if how == "numpy":
            return a
        if how == "list":
            return a.tolist()
        if how == "python_scalar":
            return float(a.reshape(-1)[0]) if a.size else 0.0
        if how == "tuple_pair":
            return (x, x)
        return "not an array"
    return x


def _outcome(thunk):
    try:
        return "ok", jax.block_until_ready(thunk())
    except Exception as e:  # noqa: BLE001 -- classifying exceptions is the point
        return "raised", e


def _is_jax_error(e: BaseException) -> bool:
    return type(e).__module__.split(".")[0] in ("jax", "jaxlib")


@settings(max_examples=N_EXAMPLES, **SETTINGS)
@given(st.data())
def _any_input(data):
    prog = data.draw(programs())
    f, xs = build(prog), inputs(prog)
    xs = [_mutate(data.draw, x) for x in xs]
    n = len(xs)
    argnums = data.draw(
        st.sampled_from([0, tuple(range(n)), -1, n, (n - 1, 0) if n > 1 else (0,), (0, 0)])
    )
    name = data.draw(st.sampled_from(sorted(POLICIES)))
    anomaly = data.draw(st.booleans())
    note(f"program: {prog}\ninputs: {xs}\nargnums={argnums} policy={name} anomaly={anomaly}")
    j_status, j = _outcome(lambda: jax.grad(f, argnums=argnums)(*xs))
    t_status, t = _outcome(
        lambda: tg.grad(f, argnums=argnums, policy=POLICIES[name], anomaly=anomaly)(*xs)
    )
    COUNT["inputs"] += 1
    event(f"jax={j_status} tapegrad={t_status}")
    if t_status == "raised":
        COUNT["input_errors"] += 1
        same_as_jax = j_status == "raised" and isinstance(t, type(j))
        # jax.grad crashes on a repeated argnum (a TypeError from inside its code);
        # tapegrad says what is wrong, with jax's error type for a bad argument.
        clear_argnums = isinstance(t, (TypeError, ValueError)) and "argnums" in str(t)
        assert (
            isinstance(t, tg.TapegradError) or _is_jax_error(t) or same_as_jax or clear_argnums
        ), f"tapegrad raised {type(t).__name__}: {t}\n(jax: {j_status} {type(j).__name__})"
        return
    if anomaly or name in COMPRESSING:
        return  # anomaly mode may refuse what jax computes; compression is checked above
    assert j_status == "ok", f"tapegrad returned a gradient where jax.grad raised {j!r}"
    finite = all(
        np.all(np.isfinite(np.asarray(x)))
        for x in jax.tree.leaves(xs)
        if np.issubdtype(np.asarray(x).dtype, np.number)
    )
    dts = {np.asarray(x).dtype for x in jax.tree.leaves(xs)}
    if finite and not dts & {np.dtype(jnp.bfloat16), np.dtype(np.float16)}:
        assert max_err(t, j) <= 1e-4 * scale(j), (t, j)


# ---------------------------------------------------------------- the tests


def test_random_programs_and_policies(request):
    before = dict(COUNT)
    try:
        _programs_and_policies()
    finally:
        n = COUNT["programs"] - before["programs"]
        msg = (
            f"test_fuzz_policies: {n} random programs checked against jax.grad, each also "
            f"under one random residual policy ({COUNT['policy_runs'] - before['policy_runs']} "
            "policy runs)"
        )
        print(msg)
        request.node.user_properties.append(("summary", msg))
    assert n > 0


def test_random_inputs_never_crash(request):
    before = dict(COUNT)
    try:
        _any_input()
    finally:
        n = COUNT["inputs"] - before["inputs"]
        msg = (
            f"test_fuzz_policies: {n} random programs called with random inputs "
            f"({COUNT['input_errors'] - before['input_errors']} raised a TapegradError or "
            "jax's error, the rest matched jax.grad)"
        )
        print(msg)
        request.node.user_properties.append(("summary", msg))
    assert n > 0


def test_the_builder_is_what_it_says():
    prog = {
        "shapes": [(2, 3)],
        "steps": [("mm", 0, 1), ("u", "sin", 2), ("r", "sum", 3, 0, False)],
        "loss": "sumsq",
        "seed": 0,
        "smooth": True,
    }
    prog["shapes"].append((3, 2))
    x, w = inputs(prog)
    want = jnp.sum(jnp.sum(jnp.sin(x @ w), axis=0) ** 2)
    np.testing.assert_allclose(build(prog)(x, w), want, rtol=1e-6)


@pytest.mark.parametrize(
    "x",
    [np.array([1.0, -2.0], np.float32), np.float32(-1.5), 2.5],
    ids=["numpy", "np_scalar", "py"],
)
def test_offload_of_a_non_jax_array_input(x):
    """Was a known bug (excluded from the fuzz): offload of a numpy or Python input."""
    f = lambda x: jnp.sum(jnp.abs(x))  # noqa: E731  (abs saves its input)
    np.testing.assert_array_equal(tg.grad(f, policy=tg.policies.offload())(x), jax.grad(f)(x))


def test_duplicate_argnums():
    """Was a known bug (excluded from the fuzz): now a clear ValueError naming argnums,
    where jax.grad fails with a TypeError from inside its own code."""
    f = lambda x, y: jnp.sum(x * 3.0 + y)  # noqa: E731
    with pytest.raises(ValueError, match=r"argnums=\(0, 0\) names an argument twice"):
        tg.grad(f, argnums=(0, 0))(jnp.ones(2), 1.0)
    with pytest.raises(TypeError):
        jax.grad(f, argnums=(0, 0))(jnp.ones(2), 1.0)


def test_programs_are_the_shared_generators():
    """The in-suite fuzz draws its programs with the generator bench/fuzz.py uses."""
    import random

    from _fuzz_programs import RandomDraw

    a = generate(RandomDraw(random.Random(3)))
    assert a == generate(RandomDraw(random.Random(3)))
    f, xs = build(a), inputs(a)
    assert jnp.shape(f(*xs)) == ()
