"""tapegrad's reduction, cumulative-reduction and sort rules against jax.

Each primitive is checked in float32 and float64: ``tg.vjp`` (random
cotangent) against ``jax.vjp`` for several shapes/axes at once (one function
returning a tuple), ``tg.grad`` of a nonlinear scalar loss against
``jax.grad``, and its records run tapegrad's own rule (not the fallback).
Most comparisons run inside one `jax.jit` per case (tapegrad and jax side by
side), which keeps the file fast and checks that the rules work on tracers;
`test_eager` repeats one case per primitive without jit; then second order
(``tg.grad(tg.grad)``) and `jax.vmap`.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from numpy.testing import assert_allclose

import tapegrad as tg

# ---------------------------------------------------------------------------
# Helpers


@contextlib.contextmanager
def _x64(on):
    old = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", on)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", old)


@pytest.fixture
def x64():
    with _x64(True):
        yield


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
    """The float dtype of a case; float64 cases run with x64 enabled, restored after."""
    with _x64(request.param == "float64"):
        yield np.dtype(request.param)


def randn(shape, dtype, seed=0, scale=1.0, zeros=()):
    """Normal values; ``zeros``: index tuples set to exactly 0 (set in numpy, not
    with eager jax ops, which would each compile)."""
    x = (scale * np.random.RandomState(seed).standard_normal(shape)).astype(dtype)
    for z in zeros:
        x[z] = 0
    return jnp.asarray(x)


def ties(shape, dtype, seed=0):
    """Values on a coarse grid: many exact ties."""
    rng = np.random.RandomState(seed)
    return jnp.asarray(np.round(rng.standard_normal(shape) * 1.5).astype(dtype))


def _close(actual, expected, dtype):
    rtol = 2e-5 if np.dtype(dtype) == np.float32 else 1e-10
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
        scale = max(1.0, float(np.max(np.abs(e)))) if e.size else 1.0
        assert_allclose(a, e, rtol=rtol, atol=rtol * scale)


def assert_rule(f, args, prims):
    """Every record of a primitive in ``prims`` that takes part in backward uses
    tapegrad's own rule, and there is at least one."""
    tape = tg.trace(f)(*args)
    recs = [r for r in tape.records if r.primitive in prims and r.in_backward]
    assert recs, f"none of {prims} in backward:\n{tape}"
    for r in recs:
        assert r.rule == "rule", f"{r.primitive} uses {r.rule}: {r}"
    return tape


def _loss(f):
    def loss(*args):
        return sum(jnp.sum(jnp.sin(y) * y) for y in jax.tree_util.tree_leaves(f(*args)))

    return loss


def check(f, *args, prims=(), jit=True, grad=False, seed=1):
    """tg.vjp == jax.vjp (random cotangent) for every argument of ``f``; with
    ``grad``, also tg.grad == jax.grad of a nonlinear scalar loss of ``f``.

    Both sides run in one `jax.jit` (one compile per case); with ``jit=False``
    tapegrad runs eagerly and only the jax reference is jitted.
    """
    dt = jnp.result_type(args[0])
    outs, tree = jax.tree_util.tree_flatten(jax.eval_shape(f, *args))
    ct = tree.unflatten([randn(o.shape, o.dtype, seed=seed + i) for i, o in enumerate(outs)])
    argnums = tuple(range(len(args)))

    def tg_side(args, ct):
        out, fn = tg.vjp(f, *args)
        return (out, fn(ct)) + ((tg.grad(_loss(f), argnums)(*args),) if grad else ())

    def jax_side(args, ct):
        out, fn = jax.vjp(f, *args)
        return (out, fn(ct)) + ((jax.grad(_loss(f), argnums)(*args),) if grad else ())

    if jit:
        got, want = jax.jit(lambda a, c: (tg_side(a, c), jax_side(a, c)))(args, ct)
    else:
        got, want = tg_side(args, ct), jax.jit(jax_side)(args, ct)
    _close(got, want, dt)
    if prims:
        assert_rule(f, args, prims)
    return got[:2]


# ---------------------------------------------------------------------------
# reduce_max / reduce_min


@pytest.mark.parametrize("op", [jnp.max, jnp.min], ids=["max", "min"])
def test_reduce_chooser(op, dtype):
    v, t, tie = randn((7,), dtype), randn((3, 4, 5), dtype, seed=2), ties((4, 3, 5), dtype)

    def f(v, t, tie):
        # Ties: jax splits the cotangent equally among tied extrema; so must we.
        return (
            op(v),
            op(t, axis=1),
            op(t, axis=(0, 2)),
            op(t, axis=-1),
            op(tie),
            op(tie, axis=1),
            op(tie, axis=(0, 2)),
        )

    check(f, v, t, tie, grad=True, prims=("reduce_max" if op is jnp.max else "reduce_min",))


@pytest.mark.parametrize("op", [jnp.max, jnp.min], ids=["max", "min"])
def test_reduce_chooser_all_tied(op):
    g = tg.grad(lambda x: op(x))(jnp.full((3, 4), 2.0))
    assert_allclose(np.asarray(g), np.full((3, 4), 1 / 12), rtol=1e-6)


def test_reduce_max_saves_a_mask():
    tape = tg.trace(lambda x: jnp.max(x, axis=0))(jnp.ones((5, 3)))
    (rec,) = [r for r in tape.records if r.primitive == "reduce_max"]
    assert [(s.kind, s.dtype) for s in rec.saves] == [("aux", np.dtype(bool))]


# ---------------------------------------------------------------------------
# reduce_prod


def test_reduce_prod(dtype):
    v, t, u = randn((6,), dtype) + 0.5, randn((3, 4, 5), dtype, 2) + 0.5, randn((4, 1), dtype, 3)
    f = lambda v, t, u: (
        jnp.prod(v),
        jnp.prod(t, axis=1),
        jnp.prod(t, axis=(0, 2)),
        jnp.prod(u, axis=1),
    )
    check(f, v, t, u, grad=True, prims=("reduce_prod",))


def test_reduce_prod_zeros(dtype):
    # Rows with exactly one zero, two, three, all zeros; and a matrix reduced both
    # ways, whose rows/columns have none, one or several zeros.
    zeros = [(i, j) for i, z in enumerate([[2], [1, 4], [0, 2, 5], range(6)]) for j in z]
    rows = randn((4, 6), dtype, zeros=zeros)
    m = randn((4, 5), dtype, zeros=[(1, 2), (2, 0), (2, 3)])
    f = lambda rows, m: (jnp.prod(rows, axis=1), jnp.prod(m, axis=1), jnp.prod(m, axis=0))
    check(f, rows, m, prims=("reduce_prod",))


# ---------------------------------------------------------------------------
# Cumulative reductions


CUM = {
    "cumsum": lax.cumsum,
    "cumprod": lax.cumprod,
    "cumlogsumexp": lax.cumlogsumexp,
    "cummax": lax.cummax,
    "cummin": lax.cummin,
}


@pytest.mark.parametrize("name", sorted(CUM))
def test_cumulative(name):
    op = CUM[name]
    v, t = randn((9,), np.float32), randn((3, 5, 4), np.float32, 2)
    f = lambda v, t: (op(v, axis=0, reverse=True), op(t, axis=1), op(t, axis=2, reverse=True))
    check(f, v, t, prims=(name,))


@pytest.mark.parametrize("name", sorted(CUM))
def test_cumulative_float64(name, x64):
    op = CUM[name]
    check(
        lambda m: op(m, axis=0, reverse=True), randn((6, 3), np.float64), grad=True, prims=(name,)
    )


def test_cumprod_zeros():
    dtype = np.float32
    vs = [
        randn((8,), dtype, seed=i, zeros=[(j,) for j in z])
        for i, z in enumerate([[3], [2, 6], [0, 1, 7]])
    ]
    m = randn((3, 6), dtype, zeros=[(0, 2), (2, 1), (2, 4)])
    f = lambda m, *vs: (
        (jnp.cumprod(m, axis=1), lax.cumprod(m, axis=1, reverse=True))
        + tuple(lax.cumprod(v, reverse=r) for v in vs for r in (False, True))
    )
    check(f, m, *vs, prims=("cumprod",))


def test_cumlogsumexp_large_values():
    # Neither the forward nor the cotangent may overflow for large inputs.
    x = randn((3, 12), np.float32, scale=300.0)
    f = lambda x: (lax.cumlogsumexp(x, axis=1), lax.cumlogsumexp(x, axis=1, reverse=True))
    _, (ct,) = check(f, x)
    assert np.all(np.isfinite(np.asarray(ct)))


def test_cummax_ties():
    # Equal split among the tied running maxima seen so far (reduce_max's rule):
    # y = [1, 3, 3, 3, 3]; y[2], y[3] are shared by x[1], x[2]; y[4] by x[1], x[2], x[4].
    x = jnp.array([1.0, 3.0, 3.0, 2.0, 3.0])
    want = np.array([1, 1 + 1 / 2 + 1 / 2 + 1 / 3, 1 / 2 + 1 / 2 + 1 / 3, 0, 1 / 3])

    @jax.jit
    def grads(x):
        return (
            tg.grad(lambda x: lax.cummax(x).sum())(x),
            tg.grad(lambda x: lax.cummax(x[::-1], reverse=True).sum())(x),
            tg.grad(lambda x: lax.cummin(-x).sum())(x),
        )

    fwd, rev, mn = grads(x)
    assert_allclose(np.asarray(fwd), want, rtol=1e-6)
    assert_allclose(np.asarray(rev), want, rtol=1e-6)
    assert_allclose(np.asarray(mn), -want, rtol=1e-6)


def test_cumchooser_ties_plateau_totals():
    # jax splits ties by its scan tree, so only each plateau's total agrees.
    x = ties((40,), np.float32, seed=3)
    ct = randn((40,), np.float32, seed=4)
    ops = (lax.cummax, lax.cummin)
    results = jax.jit(
        lambda x, ct: [(tg.vjp(op, x)[1](ct)[0], jax.vjp(op, x)[1](ct)[0]) for op in ops]
    )(x, ct)
    for op, (got, want) in zip(ops, results):
        y = np.asarray(op(x))
        plateau = np.cumsum(np.r_[True, y[1:] != y[:-1]])
        tot = lambda v: np.bincount(plateau, weights=np.asarray(v, np.float64))
        assert_allclose(tot(got), tot(want), rtol=1e-5, atol=1e-5)
        assert np.all(np.asarray(got)[np.asarray(x) != y] == 0)  # only elements equal to y


def test_cummax_saves_int8_code():
    tape = tg.trace(lambda x: lax.cummax(x, axis=1))(jnp.ones((3, 300)))
    (rec,) = [r for r in tape.records if r.primitive == "cummax"]
    assert [(s.kind, s.dtype) for s in rec.saves] == [("aux", np.dtype(np.int8))]


# ---------------------------------------------------------------------------
# sort


def test_sort(dtype):
    v, m, t = randn((9,), dtype), ties((4, 6), dtype), randn((2, 3, 5), dtype, 2)
    f = lambda v, m, t: (
        jnp.sort(v),
        jnp.sort(m, axis=1),
        jnp.sort(m, axis=0),
        jnp.sort(t, axis=1),
        jnp.sort(m, axis=1, descending=True),
    )
    check(f, v, m, t, grad=True, prims=("sort",))


def test_sort_multiple_operands(dtype):
    k = ties((3, 8), dtype, seed=1)
    v = randn((3, 8), dtype, seed=2)

    def f(k, v):
        # Two float operands, one key: both get cotangents through the permutation.
        a = lax.sort((k, v), dimension=1, num_keys=1)
        # Two keys (ties in the first broken by the second), an integer payload.
        i = lax.broadcasted_iota(jnp.int32, k.shape, 1)
        sk, sv, si = lax.sort((k, v, i), dimension=1, num_keys=2)
        return a, sk * sv + si.astype(k.dtype)

    check(f, k, v, prims=("sort",))
    # Only the (non-key) payload differentiated.
    check(lambda v: lax.sort((k, v), num_keys=1)[1], v, prims=("sort",))


def test_argsort_is_not_differentiated():
    x = randn((3, 7), np.float32)
    f = lambda x: jnp.take_along_axis(x, jnp.argsort(x, axis=1), axis=1) ** 2
    check(f, x)
    tape = tg.trace(f)(x)
    assert all(not r.in_backward for r in tape.records if r.primitive == "sort")


def test_sort_saves_narrow_permutation():
    tape = tg.trace(lambda x: jnp.sort(x, axis=1))(jnp.ones((3, 200)))
    (rec,) = [r for r in tape.records if r.primitive == "sort"]
    assert [(s.kind, s.dtype) for s in rec.saves] == [("aux", np.dtype(np.int16))]


def test_median():
    check(lambda x: jnp.median(x, axis=1), randn((4, 7), np.float32), prims=("sort",))


# ---------------------------------------------------------------------------
# Non-differentiable reductions


def test_boolean_reductions():
    x = randn((4, 5), np.float32)

    def f(x):
        anyp = jnp.any(x > 0, axis=1, keepdims=True)
        allp = jnp.all(x > -1, axis=1, keepdims=True)
        xor = lax.reduce(x > 0.5, False, lax.bitwise_xor, (1,))[:, None]
        return jnp.where(anyp & allp, x, 2 * x) * jnp.where(xor, 3.0, 1.0)

    check(f, x)
    tape = tg.trace(f)(x)
    names = {r.primitive for r in tape.records}
    assert {"reduce_or", "reduce_and", "reduce_xor"} <= names
    assert not tape.fallback_records


# ---------------------------------------------------------------------------
# Without jit, second order, vmap


EAGER = {
    "reduce_max": lambda x: jnp.max(x, axis=1),
    "reduce_min": lambda x: jnp.min(x),
    "reduce_prod": lambda x: jnp.prod(x.at[0, 1].set(0), axis=1),
    "cumsum": lambda x: jnp.cumsum(x, axis=1),
    "cumprod": lambda x: lax.cumprod(x, axis=1, reverse=True),
    "cumlogsumexp": lambda x: lax.cumlogsumexp(x, axis=0),
    "cummax": lambda x: lax.cummax(x, axis=1),
    "cummin": lambda x: lax.cummin(x, axis=0, reverse=True),
    "sort": lambda x: jnp.sort(x, axis=0),
}


@pytest.mark.parametrize("prim", sorted(EAGER))
def test_eager(prim):
    check(EAGER[prim], randn((3, 4), np.float32), prims=(prim,), jit=False)


SECOND = {
    "reduce_max": lambda x: jnp.sum(jnp.max(x, axis=1) ** 3),
    "reduce_prod": lambda x: jnp.sum(jnp.prod(x, axis=1) ** 2) + jnp.prod(x.at[0, 0].set(0)),
    "cumprod": lambda x: jnp.sum(jnp.cumprod(x, axis=1) ** 2),
    "cumlogsumexp": lambda x: jnp.sum(lax.cumlogsumexp(x, axis=1, reverse=True) ** 2),
    "cummax": lambda x: jnp.sum(lax.cummax(x, axis=1) ** 3),
    "sort": lambda x: jnp.sum(jnp.sort(x, axis=1) ** 3 * jnp.arange(5.0, dtype=x.dtype)),
}


@pytest.mark.parametrize("prim", sorted(SECOND))
def test_second_order(prim):
    f = SECOND[prim]
    x, v = randn((3, 5), np.float32, seed=2), randn((3, 5), np.float32, seed=3)
    got, want = jax.jit(
        lambda x: (
            tg.grad(lambda x: jnp.sum(tg.grad(f)(x) * v))(x),
            jax.grad(lambda x: jnp.sum(jax.grad(f)(x) * v))(x),
        )
    )(x)
    _close(got, want, np.float32)


def test_second_order_float64(x64):
    f = lambda x: sum(SECOND[p](x) for p in ("reduce_prod", "cumlogsumexp", "sort"))
    x, v = randn((3, 5), np.float64, seed=2), randn((3, 5), np.float64, seed=3)
    got, want = jax.jit(
        lambda x: (
            tg.grad(lambda x: jnp.sum(tg.grad(f)(x) * v))(x),
            jax.grad(lambda x: jnp.sum(jax.grad(f)(x) * v))(x),
        )
    )(x)
    _close(got, want, np.float64)


def test_second_order_eager():
    f = SECOND["reduce_max"]
    x, v = randn((3, 5), np.float32, seed=2), randn((3, 5), np.float32, seed=3)
    got = tg.grad(lambda x: jnp.sum(tg.grad(f)(x) * v))(x)
    want = jax.grad(lambda x: jnp.sum(jax.grad(f)(x) * v))(x)
    _close(got, want, np.float32)


def test_vmap():
    f = lambda x: sum(SECOND[p](x) for p in ("reduce_max", "cummax", "sort"))
    xs = randn((4, 3, 5), np.float32, seed=7)
    got, want = jax.jit(lambda xs: (jax.vmap(tg.grad(f))(xs), jax.vmap(jax.grad(f))(xs)))(xs)
    _close(got, want, np.float32)
    # Without jit: the rules run on batch tracers holding concrete arrays.
    f = SECOND["sort"]
    _close(jax.vmap(tg.grad(f))(xs), jax.jit(jax.vmap(jax.grad(f)))(xs), np.float32)
