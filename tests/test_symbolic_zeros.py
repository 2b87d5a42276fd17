"""Structurally zero cotangents are "no cotangent" (jax's symbolic ``Zero``), decided when
the tape is built: a value that only a zero cotangent would reach is not differentiated,
keeps nothing for backward, and its record's rule never runs -- which matters for rules
that must never see a cotangent (equinox's ``nondifferentiable_backward``, optimistix's
implicit solves). And branches nested in traced branches run their backward once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

import tapegrad as tg

# A primitive like equinox's nondifferentiable_backward: identity forward, linear in its
# tangent, and a transpose that raises on any cotangent (safe in jax only because a
# symbolic zero never reaches it).
nobwd_p = Primitive("test_no_backward")
nobwd_p.def_impl(lambda x: x)
nobwd_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(nobwd_p, lambda ctx, x: [x])
ad.primitive_jvps[nobwd_p] = lambda p, t: (nobwd_p.bind(p[0]), nobwd_p.bind(t[0]))


def _transpose_raises(ct, x):
    raise RuntimeError("Unexpected cotangent: this value must not be differentiated.")


ad.primitive_transposes[nobwd_p] = _transpose_raises


@jax.custom_jvp
def scaled(x, s):
    """``sin(x) * s``, whose rule says ``s`` has no derivative (like a solver's state)."""
    return jnp.sin(x) * s


@scaled.defjvp
def _scaled_jvp(primals, tangents):
    x, s = primals
    dx, _ = tangents
    return scaled(x, s), jnp.cos(x) * s * dx


def loss(x):
    s = nobwd_p.bind(jnp.exp(x))  # differentiable dtype, active, never differentiated
    return jnp.sum(scaled(x, s) ** 2)


X = jnp.linspace(0.1, 1.0, 6)


def test_a_rule_that_reads_no_tangent_of_an_input_gives_it_no_cotangent():
    want = jax.grad(loss)(X)
    assert_trees_close(tg.grad(loss)(X), want, 1e-6, 1e-6)
    assert_trees_close(jax.jit(tg.grad(loss))(X), want, 1e-6, 1e-6)
    assert_trees_close(tg.vjp(loss, X)[1](1.0)[0], want, 1e-6, 1e-6)


def test_what_only_a_zero_cotangent_reaches_keeps_nothing():
    tape = tg.trace(loss)(X)
    by_name = {r.primitive: r for r in tape.records}
    for name in ("test_no_backward", "exp"):
        assert by_name[name].saves == () and not any(by_name[name].active), by_name[name]
    # exp's output (its own residual) is not kept: the tape keeps what sin, the rule and
    # the square read, 3 arrays of 6 floats (x, the rule's cos(x) * s and the square's input)
    assert tape.saved_bytes <= 3 * X.nbytes


def test_records_with_only_zero_cotangents_unpack_nothing():
    packed, unpacked = [], []

    def pack(x):
        packed.append(x.shape)
        return x

    def unpack(x):
        unpacked.append(x.shape)
        return x

    with tg.saved_tensors_hooks(pack, unpack):
        g = tg.grad(loss)(X)
    assert_trees_close(g, jax.grad(loss)(X), 1e-6, 1e-6)
    assert len(unpacked) == len(packed)  # each kept value once, none for the exp/no-backward
    kept = tg.trace(loss)(X).residual_keys()[0]
    assert len(packed) <= len(kept)


def test_an_output_left_out_gives_no_cotangent_but_a_zero_array_is_one():
    # Of a rule with two outputs only the first is differentiated: the input only the
    # second's tangent reads gets no cotangent. A zero *array* passed for the second is a
    # cotangent, as in jax: the raising transpose is reached in both.
    @jax.custom_jvp
    def two(x, s):
        return jnp.sin(x), s * 2.0

    @two.defjvp
    def _two_jvp(primals, tangents):
        x, s = primals
        dx, ds = tangents
        return two(x, s), (jnp.cos(x) * dx, ds * 2.0)

    def f(x):
        a, b = two(x, nobwd_p.bind(x * 3.0))
        return jnp.sum(a), b

    first = lambda x: f(x)[0]
    assert_trees_close(tg.grad(first)(X), jax.grad(first)(X), 1e-6, 1e-6)
    assert_trees_close(jax.jit(tg.grad(first))(X), jnp.cos(X), 1e-6, 1e-6)
    cts = (jnp.float32(1.0), jnp.zeros_like(X))
    with pytest.raises(RuntimeError, match="Unexpected cotangent"):
        jax.vjp(f, X)[1](cts)
    with pytest.raises(RuntimeError, match="Unexpected cotangent"):
        tg.vjp(f, X)[1](cts)


def test_a_branch_operand_no_branch_differentiates_keeps_nothing():
    def f(x):
        y = jnp.exp(x)  # an operand both branches read only through a non-differentiable op
        out = lax.cond(
            x[0] > 0,
            lambda a, b: jnp.sin(a) + jnp.floor(b),
            lambda a, b: jnp.cos(a) * jnp.round(b),
            x,
            y,
        )
        return jnp.sum(out)

    for xs in (X, -X):
        want = jax.grad(f)(xs)
        assert_trees_close(tg.grad(f)(xs), want, 1e-6, 1e-6)
        assert_trees_close(jax.jit(tg.grad(f))(xs), want, 1e-6, 1e-6)
    rec = next(r for r in tg.trace(f)(X).records if r.primitive == "exp")
    assert rec.saves == () and not any(rec.active)


def test_a_scan_const_its_body_does_not_differentiate_keeps_nothing():
    def f(x):
        c = jnp.tanh(x)  # read by the body only through floor

        def body(h, _):
            return jnp.sin(h) + jnp.floor(c), None

        h, _ = lax.scan(body, x, None, length=4)
        return jnp.sum(h)

    assert_trees_close(tg.grad(f)(X), jax.grad(f)(X), 1e-6, 1e-6)
    assert_trees_close(jax.jit(tg.grad(f))(X), jax.grad(f)(X), 1e-6, 1e-6)
    rec = next(r for r in tg.trace(f)(X).records if r.primitive == "tanh")
    assert rec.saves == () and not any(rec.active)


def test_a_scan_carry_its_body_does_not_read_still_passes_its_final_cotangent():
    # c' = w * x_t ignores c: the initial carry gets no cotangent, but the final carry's
    # cotangent still reaches w and xs at the last step.
    def f(c0, w, xs):
        c, _ = lax.scan(lambda c, x: (w * x, None), c0, xs)
        return jnp.sum(c**2)

    args = (jnp.ones(3), jnp.full(3, 0.5), jnp.arange(12.0).reshape(4, 3))
    for argnums in (0, 1, 2, (0, 1, 2)):
        want = jax.grad(f, argnums)(*args)
        assert_trees_close(tg.grad(f, argnums)(*args), want, 1e-6, 1e-6)
        assert_trees_close(jax.jit(tg.grad(f, argnums))(*args), want, 1e-6, 1e-6)


def _nested(x):
    """A traced branch holding a branch whose index is a constant of the program (so it
    is concrete when the tape is replayed under jit) and a traced one inside it."""

    def inner(x):
        y = lax.cond(jnp.array(True), lambda y: jnp.sin(y) * y, lambda y: y, x)
        return lax.cond(y.sum() < 10, lambda z: jnp.tanh(z) ** 2, jnp.cos, y)

    return jnp.sum(lax.cond(x.sum() > 0, inner, lambda x: x * 3.0, x))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_nested_branches_under_jit_run_backward_once(sign):
    x = sign * X
    want = jax.grad(_nested)(x)
    assert_trees_close(jax.jit(tg.grad(_nested))(x), want, 1e-6, 1e-6)
    assert_trees_close(tg.grad(_nested)(x), want, 1e-6, 1e-6)
    # retained residuals: vjp_fn twice, under jit
    out, vjp_fn = jax.jit(lambda x: tg.vjp(_nested, x))(x)
    for _ in range(2):
        assert_trees_close(vjp_fn(jnp.float32(1.0))[0], want, 1e-6, 1e-6)


def test_the_diffrax_pattern_a_loop_under_custom_vjp_holding_nested_branches():
    # diffrax's RecursiveCheckpointAdjoint: a while loop under custom_vjp whose body (an
    # ODE step) holds conds holding conds; jax.jit(tg.grad) runs each branch once.
    def step(y):
        return lax.cond(
            jnp.array(True),
            lambda y: lax.cond(jnp.sum(y) > 0, lambda y: y + 0.1 * jnp.tanh(y), jnp.sin, y),
            lambda y: y,
            y,
        )

    @jax.custom_vjp
    def solve(y0):
        return lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, step(c[1])), (0, y0))[1]

    def solve_fwd(y0):
        return solve(y0), y0

    def solve_bwd(y0, ct):
        return (jax.vjp(lambda y: lax.fori_loop(0, 5, lambda i, y: step(y), y), y0)[1](ct)[0],)

    solve.defvjp(solve_fwd, solve_bwd)

    def f(x):
        y = solve(lax.cond(x.sum() > 0, lambda x: _nested(x) * x, jnp.cos, x))
        return jnp.sum(y**2)

    want = jax.jit(jax.grad(f))(X)
    assert_trees_close(jax.jit(tg.grad(f))(X), want, 1e-5, 1e-5)
    assert_trees_close(tg.grad(f)(X), want, 1e-5, 1e-5)
    np.testing.assert_allclose(np.asarray(tg.grad(f)(X)), np.asarray(want), rtol=1e-5)


def test_a_python_residual_of_a_custom_vjp_passes_any_policy_unchanged():
    # equinox's checkpointed while_loop keeps Python bools (a filter spec) as residuals:
    # no policy moves or compresses them, and bwd gets them back as they were.
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    def fwd(x):
        return jnp.sin(x), (x, True)

    def bwd(res, g):
        x, flag = res
        assert flag is True, flag
        return (jnp.cos(x) * g,)

    f.defvjp(fwd, bwd)
    loss = lambda x: jnp.sum(f(x) ** 2)
    want = jax.grad(loss)(X)
    for policy in (tg.policies.offload(), tg.policies.compress(jnp.bfloat16)):
        assert_trees_close(tg.grad(loss, policy=policy)(X), want, 1e-2, 1e-2)
