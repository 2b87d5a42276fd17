"""tapegrad's indexing/layout rules against jax.grad / jax.vjp.

Every case checks, in float32 and float64:
  * tg.vjp with a random cotangent == jax.vjp,
  * tg.grad of a nonlinear scalar reduction == jax.grad,
  * the records of the primitives under test run tapegrad's own rule, not the
    fallback (and the whole tape has no fallback record).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import tapegrad as tg

INDEXING_PRIMS = {
    "rev",
    "slice",
    "dynamic_slice",
    "dynamic_update_slice",
    "concatenate",
    "split",
    "pad",
    "gather",
    "scatter",
    "scatter-add",
    "scatter-sub",
    "scatter-mul",
    "scatter-min",
    "scatter-max",
    "select_and_gather_add",
    "stack",
    "unstack",
}


@contextlib.contextmanager
def precision(dtype):
    """Enable x64 for float64 cases only, and restore the previous setting."""
    old = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", dtype == "float64")
    try:
        yield np.dtype(dtype)
    finally:
        jax.config.update("jax_enable_x64", old)


def tols(dtype):
    return (
        dict(rtol=1e-5, atol=1e-5)
        if np.dtype(dtype) == np.float32
        else dict(rtol=1e-10, atol=1e-10)
    )


def rand(rng, shape, dtype):
    # numpy, not jnp: jax.jit and tapegrad take numpy arrays, and it skips a compile.
    return rng.standard_normal(shape).astype(dtype)


def assert_rules(f, *args, expect=(), argnums=None):
    """No record of `f`'s tape uses the fallback; each primitive in `expect`
    appears in backward with tapegrad's own rule."""
    tape = tg.trace(f, argnums=argnums)(*args)
    seen = set()
    for rec in tape.records:
        if rec.primitive in INDEXING_PRIMS and rec.in_backward:
            assert rec.rule == "rule", f"{rec.primitive} used {rec.rule}: {rec}"
            seen.add(rec.primitive)
    assert not tape.fallback_records, f"fallback records: {tape.fallback_records}"
    missing = set(expect) - seen
    assert not missing, f"expected {missing} in backward; tape:\n{tape}"
    return tape


FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def fast_jit(f):
    """`jax.jit(f)`, compiled with FAST_COMPILE on first call."""
    jitted = jax.jit(f)

    def call(*args):
        return jitted.lower(*args).compile(compiler_options=FAST_COMPILE)(*args)

    return call


def _compare(f, x, ct):
    """jax's and tapegrad's (output, vjp(ct), grad of a nonlinear scalar) of `f` at `x`."""
    out, jax_vjp = jax.vjp(f, x)
    tout, tg_vjp = tg.vjp(f, x)
    w = jnp.cos(jnp.arange(np.size(out), dtype=out.dtype)).reshape(np.shape(out))

    def scalar(x):
        return jnp.sum(jnp.sin(f(x)) * w)

    return ((out, jax_vjp(ct)[0], jax.grad(scalar)(x)), (tout, tg_vjp(ct)[0], tg.grad(scalar)(x)))


def check(fs, xs, dtype, expect=(), seed=0, jit=True):
    """tg.vjp / tg.grad of each `fs[i]` at `xs[i]` against jax, plus the no-fallback check.

    All pairs run in one jitted program (one compile per case: fast, and the
    rules run on tracers); ``jit=False`` runs them eagerly.
    """
    rng = np.random.default_rng(seed)
    cts = [rand(rng, jax.eval_shape(f, x).shape, dtype) for f, x in zip(fs, xs)]

    def run(xs, cts):
        return [_compare(f, x, ct) for f, x, ct in zip(fs, xs, cts)]

    if jit:
        # Cheap XLA settings: these programs run once, so compile time is what counts.
        results = fast_jit(run)(xs, cts)
    else:
        results = run(xs, cts)
    for f, x, (want, got) in zip(fs, xs, results):
        for w, g in zip(want, got):
            assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
            np.testing.assert_allclose(g, w, equal_nan=True, **tols(dtype))
        assert_rules(f, x, expect=expect)


DTYPES = ["float32", "float64"]

# (name, function builder taking the input shape, shapes, primitives expected in backward)
IDIOMS = [
    ("x[1:3]", lambda s: lambda x: x[1:3], [(5,), (4, 6), (3, 2, 4)], {"slice"}),
    ("x[::2]", lambda s: lambda x: x[::2], [(5,), (4, 6), (1, 3)], {"slice"}),
    ("x[1:-1:2,::3]", lambda s: lambda x: x[1:-1:2, ::3], [(5, 7), (6, 4, 2)], {"slice"}),
    ("x[5:1] empty", lambda s: lambda x: x[5:1] * 2.0, [(6,), (6, 2)], {"slice"}),
    ("x[1]", lambda s: lambda x: x[1], [(3,), (4, 6)], {"slice"}),
    ("x[::-1]", lambda s: lambda x: x[::-1], [(5,), (4, 6)], {"rev"}),
    ("x[idx]", lambda s: lambda x: x[np.array([2, 0, 2, -1])], [(5,), (4, 6)], {"gather"}),
    (
        "x[:, idx]",
        lambda s: lambda x: x[:, np.array([[1, 1], [0, 3]])],
        [(3, 4), (2, 5, 3)],
        {"gather"},
    ),
    (
        "x[i0, :, i1]",
        lambda s: lambda x: x[np.array([0, 1, 1]), :, np.array([2, 0, 2])],
        [(2, 3, 4)],
        {"gather"},
    ),
    (
        "x[dyn int]",
        lambda s: lambda x: x[jnp.argmax(x.reshape(-1)[:2])],
        [(4,), (4, 6)],
        {"dynamic_slice"},
    ),
    (
        "x.at[idx].set(v)",
        lambda s: lambda x: x.at[np.array([2, 0])].set(jnp.sin(x[1:3]) * 2.0),
        [(5,), (4, 6)],
        {"scatter"},
    ),
    (
        "x.at[dup].set(v)",
        lambda s: lambda x: x.at[np.array([2, 0, 2, 2])].set(jnp.exp(x[:4])),
        [(5,), (4, 6)],
        {"scatter"},
    ),
    ("x.at[1:3].set(0)", lambda s: lambda x: x.at[1:3].set(0.0), [(5,), (4, 6)], {"scatter"}),
    (
        "x.at[idx].add(v)",
        lambda s: lambda x: x.at[np.array([2, 0])].add(x[1:3] ** 2),
        [(5,), (4, 6)],
        {"scatter-add"},
    ),
    (
        "x.at[dup].add(v)",
        lambda s: (
            lambda x: x.at[np.array([2, 0, 2, 2, 9])].add(
                jnp.exp(x[:1]) * jnp.ones(5)[(slice(None),) + (None,) * (len(s) - 1)]
            )
        ),
        [(5,), (4, 6)],
        {"scatter-add"},
    ),
    (
        "x.at[idx].subtract(v)",
        lambda s: lambda x: x.at[np.array([1, 1])].subtract(x[2:4] ** 2),
        [(5,), (4, 3)],
        {"scatter-sub"},
    ),
    (
        "x.at[idx].multiply(v) unique",
        lambda s: lambda x: x.at[np.array([3, 0])].multiply(x[1:3] ** 2, unique_indices=True),
        [(5,), (4, 6)],
        {"scatter-mul"},
    ),
    (
        "x.at[dup].multiply(c)",
        lambda s: lambda x: x.at[np.array([3, 0, 3])].multiply(2.5),
        [(5,), (4, 6)],
        {"scatter-mul"},
    ),
    (
        "x.at[dup].max(v)",
        lambda s: lambda x: x.at[np.array([3, 0, 3])].max(jnp.sin(x[1:4] * 3.0)),
        [(5,), (4, 6)],
        {"scatter-max"},
    ),
    (
        "x.at[dup].min(v) ties",
        lambda s: lambda x: x.at[np.array([1, 0, 1])].min(x[np.array([1, 2, 1])]),
        [(5,), (4, 6)],
        {"scatter-min"},
    ),
    (
        "take_along_axis",
        lambda s: (
            lambda x: jnp.take_along_axis(
                x, np.array([[0, 3, 1], [2, 2, 0], [1, 0, 3]])[: s[0]], axis=1
            )
        ),
        [(3, 4), (2, 4)],
        {"gather"},
    ),
    (
        "take_along_axis fill",
        lambda s: (
            lambda x: jnp.take_along_axis(
                x, np.array([[0, 9], [-1, 2]]), axis=1, mode="fill", fill_value=0.0
            )
        ),
        [(2, 4)],
        {"gather"},
    ),
    (
        "take clip",
        lambda s: lambda x: jnp.take(x, np.array([1, 9, -7, 0]), axis=0, mode="clip"),
        [(5,), (4, 6)],
        {"gather"},
    ),
    (
        "take fill",
        lambda s: (
            lambda x: jnp.take(x, np.array([1, 9, -7, 0]), axis=0, mode="fill", fill_value=0.5)
        ),
        [(5,), (4, 6)],
        {"gather"},
    ),
    (
        "at.get fill nan",
        lambda s: lambda x: x.at[np.array([1, 9, 1])].get(mode="fill"),
        [(5,), (4, 6)],
        {"gather"},
    ),
    (
        "at.set clip dup",
        lambda s: lambda x: x.at[np.array([1, 9, 1])].set(jnp.sin(x[:3]), mode="clip"),
        [(5,), (4, 6)],
        {"scatter"},
    ),
    (
        "at.set drop",
        lambda s: lambda x: x.at[np.array([1, 9, 0])].set(jnp.sin(x[:3]), mode="drop"),
        [(5,), (4, 6)],
        {"scatter"},
    ),
    ("roll", lambda s: lambda x: jnp.roll(x, 2, axis=-1), [(5,), (4, 6)], {"slice", "concatenate"}),
    (
        "roll dynamic",
        lambda s: lambda x: jnp.roll(x, jnp.argmax(x.reshape(-1)[:3]) + 1, axis=0),
        [(5,), (4, 6)],
        {"concatenate", "dynamic_slice"},
    ),
    ("flip", lambda s: lambda x: jnp.flip(x), [(5,), (4, 6)], {"rev"}),
    (
        "concatenate",
        lambda s: lambda x: jnp.concatenate([x, x**2, x[:1]], axis=0),
        [(5,), (4, 6)],
        {"concatenate"},
    ),
    (
        "concatenate axis1",
        lambda s: lambda x: jnp.concatenate([x[:, :0], 2 * x, x], axis=1),
        [(4, 6), (1, 3, 2)],
        {"concatenate"},
    ),
    ("split one used", lambda s: lambda x: jnp.split(x, 2, axis=0)[1], [(4,), (4, 6)], {"split"}),
    (
        "split uneven",
        lambda s: (
            lambda x: jnp.stack(
                [a.sum() * (i + 1) for i, a in enumerate(jnp.split(x, [1, 3], axis=-1))]
            )
        ),
        [(5,), (4, 6)],
        {"split"},
    ),
    (
        "stack",
        lambda s: lambda x: jnp.stack([x, 2 * x, x**2], axis=-1),
        [(), (5,), (4, 6)],
        {"stack"},
    ),
    (
        "unstack",
        lambda s: lambda x: jnp.unstack(x)[1] * jnp.unstack(x, axis=-1)[0].sum(),
        [(3,), (4, 6)],
        {"unstack"},
    ),
    ("pad constant", lambda s: lambda x: jnp.pad(x, [(1, 2)] * len(s)), [(5,), (4, 6)], {"pad"}),
    (
        "pad constant value",
        lambda s: lambda x: jnp.pad(x, [(0, 2)] * len(s), constant_values=3.0),
        [(5,), (4, 6)],
        {"pad"},
    ),
    (
        "pad edge",
        lambda s: lambda x: jnp.pad(x, [(2, 1)] * len(s), mode="edge"),
        [(5,), (4, 6)],
        {"concatenate"},
    ),
    (
        "pad reflect",
        lambda s: lambda x: jnp.pad(x, [(2, 1)] * len(s), mode="reflect"),
        [(5,), (4, 6)],
        {"rev", "concatenate"},
    ),
    (
        "pad symmetric",
        lambda s: lambda x: jnp.pad(x, [(2, 3)] * len(s), mode="symmetric"),
        [(5,), (4, 6)],
        {"rev", "concatenate"},
    ),
    (
        "pad wrap",
        lambda s: lambda x: jnp.pad(x, [(2, 1)] * len(s), mode="wrap"),
        [(5,), (4, 6)],
        {"concatenate"},
    ),
    (
        "where(size=) indices",
        lambda s: lambda x: x.reshape(-1)[jnp.where(x.reshape(-1) > 0, size=3)],
        [(6,), (3, 4)],
        {"gather"},
    ),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,make,shapes,prims", IDIOMS, ids=[c[0] for c in IDIOMS])
def test_jnp_idioms(name, make, shapes, prims, dtype):
    with precision(dtype) as dt:
        rng = np.random.default_rng(1)
        if dt == np.float64:
            shapes = shapes[-1:]  # every shape in float32, the largest in float64
        check([make(s) for s in shapes], [rand(rng, s, dt) for s in shapes], dt, expect=prims)


# Direct lax primitives, including edge cases jnp does not produce.
LAX_CASES = [
    ("rev multi", lambda x: lax.rev(x, (0, 2)), (3, 2, 4), {"rev"}),
    ("slice strided", lambda x: lax.slice(x, (1, 0), (6, 5), (2, 3)), (7, 5), {"slice"}),
    ("slice strided exact end", lambda x: lax.slice(x, (0, 1), (5, 5), (2, 2)), (5, 5), {"slice"}),
    ("slice strides ones", lambda x: lax.slice(x, (1,), (3,), (1,)), (4,), {"slice"}),
    ("dynamic_slice", lambda x: lax.dynamic_slice(x, (1, 2), (2, 3)), (4, 6), {"dynamic_slice"}),
    (
        "dynamic_slice clamped",
        lambda x: lax.dynamic_slice(x, (jnp.argmax(x[:, 0]) + 7, -3), (3, 2)),
        (4, 6),
        {"dynamic_slice"},
    ),
    (
        "dynamic_update_slice",
        lambda x: lax.dynamic_update_slice(x, jnp.sin(x[:2, 1:4]), (1, 2)),
        (4, 6),
        {"dynamic_update_slice"},
    ),
    (
        "dynamic_update_slice clamped",
        lambda x: lax.dynamic_update_slice(x, x[:2, :3] ** 2, (jnp.argmin(x[:, 0]) + 5, 4)),
        (4, 6),
        {"dynamic_update_slice"},
    ),
    (
        "concatenate 4",
        lambda x: lax.concatenate([x, x * 2, x[:1], jnp.sin(x)], 0),
        (3, 2),
        {"concatenate"},
    ),
    (
        "split",
        lambda x: lax.split(x, (1, 0, 3), axis=1)[2] * lax.split(x, (2, 2), axis=1)[0][:, :1],
        (2, 4),
        {"split"},
    ),
    (
        "pad interior",
        lambda x: lax.pad(x, jnp.float32(0).astype(x.dtype), ((1, 2, 1), (0, 1, 2))),
        (3, 4),
        {"pad"},
    ),
    ("pad negative", lambda x: lax.pad(x, x[0, 0] * 2, ((-1, 2, 0), (1, -2, 0))), (4, 5), {"pad"}),
    (
        "pad negative interior",
        lambda x: lax.pad(x, jnp.sum(x) / 3, ((-2, -1, 2), (3, -4, 1))),
        (4, 5),
        {"pad"},
    ),
    (
        "gather promise",
        lambda x: x.at[np.array([[0, 1], [2, 2]])].get(mode="promise_in_bounds"),
        (3, 2),
        {"gather"},
    ),
    (
        "scatter unique_indices",
        lambda x: x.at[np.array([2, 0])].set(x[1:3] ** 2, unique_indices=True),
        (4, 3),
        {"scatter"},
    ),
    (
        "maxpool jvp (select_and_gather_add)",
        lambda x: jax.jvp(
            lambda y: lax.reduce_window(y, -jnp.inf, lax.max, (2, 2), (1, 2), "VALID"),
            (jnp.cos(x),),
            (jnp.sin(x),),
        )[1],
        (5, 6),
        {"select_and_gather_add"},
    ),
    (
        "minpool jvp padded",
        lambda x: jax.jvp(
            lambda y: lax.reduce_window(y, jnp.inf, lax.min, (3, 2), (2, 1), "SAME"),
            (jnp.cos(x),),
            (x**2,),
        )[1],
        (5, 4),
        {"select_and_gather_add"},
    ),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,f,shape,prims", LAX_CASES, ids=[c[0] for c in LAX_CASES])
def test_lax_primitives(name, f, shape, prims, dtype):
    with precision(dtype) as dt:
        check([f], [rand(np.random.default_rng(2), shape, dt)], dt, expect=prims)


EAGER = ["x.at[dup].set(v)", "take fill"]


@pytest.mark.parametrize("name", EAGER)
def test_eager(name):
    """The same checks without jit: the rules run on concrete arrays."""
    _, make, shapes, prims = next(c for c in IDIOMS if c[0] == name)
    rng = np.random.default_rng(8)
    shape = shapes[-1]
    check([make(shape)], [rand(rng, shape, np.float32)], np.float32, expect=prims, jit=False)


@pytest.mark.parametrize("name", ["pad negative interior"])
def test_eager_lax(name):
    _, f, shape, prims = next(c for c in LAX_CASES if c[0] == name)
    check(
        [f],
        [rand(np.random.default_rng(9), shape, np.float32)],
        np.float32,
        expect=prims,
        jit=False,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_pad_padding_value_only(dtype):
    """Only the padding value is differentiated (jax 0.10's own pad transpose fails here:
    it sums the operand's cotangent, which it did not compute)."""
    with precision(dtype) as dt:
        rng = np.random.default_rng(10)
        operand = rand(rng, (2, 3), dt)
        config = ((1, -1, 1), (2, 0, 1))

        def f(v):
            return lax.pad(operand, v, config)

        v = jnp.asarray(0.3, dt)
        out, vjp_fn = tg.vjp(f, v)
        g = rand(rng, out.shape, dt)
        mask = lax.pad(jnp.zeros((2, 3), dt), jnp.asarray(1, dt), config)
        np.testing.assert_allclose(vjp_fn(g)[0], jnp.sum(g * mask), **tols(dt))
        assert_rules(f, v, expect={"pad"})


@pytest.mark.parametrize("dtype", DTYPES)
def test_indices_as_arguments(dtype):
    """Integer indices passed as arguments: no cotangent, saved as the record's input."""
    with precision(dtype) as dt:
        rng = np.random.default_rng(3)
        x, v = rand(rng, (5, 3), dt), rand(rng, (4, 3), dt)
        idx = jnp.array([4, 1, 4, 0])
        fs = {
            "gather": lambda x, v, i: jnp.sum(jnp.sin(x[i]) * v),
            "scatter-add": lambda x, v, i: jnp.sum(jnp.sin(x.at[i].add(v**2))),
            "scatter": lambda x, v, i: jnp.sum(jnp.sin(x.at[i].set(v**2))),
            "dynamic_slice": lambda x, v, i: jnp.sum(
                jnp.sin(lax.dynamic_slice_in_dim(x, i[1], 2)) ** 2
            ),
            "dynamic_update_slice": lambda x, v, i: jnp.sum(
                jnp.sin(lax.dynamic_update_slice_in_dim(x, v[:2] * x[:2], i[1], 0)) ** 2
            ),
        }
        both = fast_jit(
            lambda x, v, i: [
                (jax.grad(f, argnums=(0, 1))(x, v, i), tg.grad(f, argnums=(0, 1))(x, v, i))
                for f in fs.values()
            ]
        )
        for want, got in both(x, v, idx):
            for a, b in zip(got, want):
                np.testing.assert_allclose(a, b, **tols(dt))
        for prim, f in fs.items():
            tape = assert_rules(f, x, v, idx, expect={prim}, argnums=(0, 1))
            for rec in tape.records:
                if rec.primitive == prim and rec.in_backward:
                    assert not rec.active[1 if prim != "dynamic_update_slice" else 2]
                    idx_pos = 1 if prim in ("gather", "scatter", "scatter-add") else None
                    if idx_pos is not None:
                        assert [s.ref for s in rec.saves] == [("in", idx_pos)]


def _records(f, *args, argnums=None):
    return {
        rec.primitive: rec for rec in tg.trace(f, argnums=argnums)(*args).records if rec.in_backward
    }


def test_saves_are_minimal():
    x = jnp.ones((4, 6))
    v = jnp.ones((2, 6))
    i = jnp.array([3, 1])
    # Linear layout ops save nothing.
    for f, prim in [
        (lambda x: x[1:3:2], "slice"),
        (lambda x: x[::-1], "rev"),
        (lambda x: jnp.pad(x, 1), "pad"),
        (lambda x: jnp.concatenate([x, x]), "concatenate"),
        (lambda x: jnp.split(x, 2)[0], "split"),
    ]:
        assert _records(f, x)[prim].saves == ()
    # gather keeps only the indices.
    assert [s.ref for s in _records(lambda x, i: x[i], x, i, argnums=0)["gather"].saves] == [
        ("in", 1)
    ]
    # scatter-add: the operand's cotangent needs nothing, the updates' needs the indices.
    assert _records(lambda x, v, i: x.at[i].add(v), x, v, i, argnums=0)["scatter-add"].saves == ()
    assert [
        s.ref
        for s in _records(lambda x, v, i: x.at[i].add(v), x, v, i, argnums=1)["scatter-add"].saves
    ] == [("in", 1)]
    # dynamic_slice keeps its start indices only.
    rec = _records(lambda x, i: lax.dynamic_slice(x, (i[0], i[1]), (2, 2)), x, i, argnums=0)[
        "dynamic_slice"
    ]
    assert {s.ref for s in rec.saves} <= {("in", 1), ("in", 2)}


def test_scatter_mul_nonunique_updates_raises_like_jax():
    x = jnp.arange(1.0, 6.0)

    def f(x):
        return jnp.sum(x.at[np.array([1, 1])].multiply(x[:2]))

    with pytest.raises(NotImplementedError):
        jax.grad(f)(x)
    with pytest.raises(NotImplementedError):
        tg.grad(f)(x)


def test_where_single_argument_is_nondifferentiable():
    x = jnp.array([0.5, -1.0, 2.0, 3.0])

    def f(x):
        return jnp.sum(jnp.where(x > 0, size=3)[0].astype(x.dtype)) * 1.0

    np.testing.assert_array_equal(fast_jit(tg.grad(f))(x), np.zeros_like(x))
    tape = tg.trace(f)(x)
    assert not tape.fallback_records
    assert all(not rec.in_backward for rec in tape.records)


# Higher order, jit, vmap.
SECOND_ORDER = [
    ("gather", lambda x: jnp.sum(jnp.sin(x[np.array([2, 0, 2])]) ** 3)),
    (
        "take clip",
        lambda x: jnp.sum(jnp.sin(jnp.take(x, np.array([1, 9, -9]), axis=1, mode="clip")) ** 3),
    ),
    ("scatter dup", lambda x: jnp.sum(jnp.sin(x.at[np.array([2, 0, 2])].set(jnp.cos(x[1]))) ** 2)),
    ("scatter-add", lambda x: jnp.sum(jnp.sin(x.at[np.array([2, 0, 2])].add(x[1] ** 2)) ** 2)),
    ("scatter-max", lambda x: jnp.sum(jnp.sin(x.at[np.array([2, 0, 2])].max(jnp.cos(x[1]))) ** 2)),
    (
        "dynamic_update_slice",
        lambda x: jnp.sum(
            jnp.sin(lax.dynamic_update_slice(x, x[:2, :3] ** 2, (jnp.argmax(x[:, 0]), 5))) ** 2
        ),
    ),
    ("pad", lambda x: jnp.sum(jnp.sin(lax.pad(x, x[0, 0] * 3, ((-1, 2, 1), (2, -3, 2)))) ** 2)),
    (
        "pad reflect + roll",
        lambda x: jnp.sum(jnp.sin(jnp.roll(jnp.pad(x, 2, mode="reflect"), 3, 1)) ** 2 * x[0, 0]),
    ),
    (
        "concat/split",
        lambda x: jnp.sum(jnp.sin(jnp.split(jnp.concatenate([x, x**2], 1), 3, axis=1)[1]) ** 2),
    ),
]


@pytest.mark.parametrize("name,f", SECOND_ORDER, ids=[c[0] for c in SECOND_ORDER])
def test_grad_of_grad(name, f):
    x = jnp.asarray(np.random.default_rng(4).standard_normal((4, 6)), jnp.float32)

    def h_jax(x):
        return jnp.sum(jnp.cos(jax.grad(f)(x)))

    def h_tg(x):
        return jnp.sum(jnp.cos(tg.grad(f)(x)))

    np.testing.assert_allclose(
        fast_jit(tg.grad(h_tg))(x), fast_jit(jax.grad(h_jax))(x), rtol=1e-4, atol=1e-4
    )
    # The backward pass of the inner grad is itself taped with tapegrad's rules.
    assert not tg.trace(h_tg)(x).fallback_records


def test_grad_grad_scalar():
    base = jnp.asarray(np.random.default_rng(5).standard_normal((4, 6)), jnp.float32)
    idx = np.array([3, 0, 3, 1])

    def f(s):
        y = jnp.sin(s * base)
        y = y.at[idx].add(y[1:2] * s)[idx[:2]]
        return jnp.sum(jnp.pad(y, ((1, 0), (2, 1)), mode="edge")[::2, ::-1] ** 2)

    s = jnp.float32(0.7)
    np.testing.assert_allclose(
        fast_jit(tg.grad(tg.grad(f)))(s), fast_jit(jax.grad(jax.grad(f)))(s), rtol=1e-4
    )


def test_jit_of_grad():
    x = jnp.asarray(np.random.default_rng(6).standard_normal((4, 6)), jnp.float32)

    def f(x):
        y = x.at[np.array([2, 0, 2])].set(jnp.cos(x[1]))
        y = jnp.concatenate([y[:, ::2], jnp.take(y, np.array([5, 7]), axis=1, mode="clip")], 1)
        return jnp.sum(
            jnp.sin(jnp.pad(y, 1))
            * lax.dynamic_slice_in_dim(jnp.roll(x, 1, 0), jnp.argmax(x[:, 0]), 1, 1)[:1].sum()
        )

    np.testing.assert_allclose(
        fast_jit(tg.grad(f))(x), fast_jit(jax.grad(f))(x), rtol=1e-5, atol=1e-6
    )


def test_vmap_of_grad():
    rng = np.random.default_rng(7)
    xs = jnp.asarray(rng.standard_normal((3, 4, 6)), jnp.float32)
    idxs = jnp.array([[0, 3, 0], [1, 1, 2], [3, 2, 1]])
    starts = jnp.array([0, 2, 5])

    def f(x, i, s):
        y = x.at[i].set(jnp.sin(x[:3]) * 2.0)
        y = y.at[i].add(x[i] ** 2)
        y = lax.dynamic_update_slice(y, lax.dynamic_slice(x, (1, s), (2, 2)) ** 2, (s, 1))
        return jnp.sum(jnp.cos(jnp.pad(y[::-1, 1::2], ((0, 1), (1, 0)))))

    # Batched operand, indices and start indices: the rules run on batch tracers.
    want = fast_jit(jax.vmap(jax.grad(f)))(xs, idxs, starts)
    got = fast_jit(jax.vmap(tg.grad(f)))(xs, idxs, starts)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Batched operand only, unbatched indices.
    want = fast_jit(jax.vmap(jax.grad(f), in_axes=(0, None, None)))(xs, idxs[0], starts[1])
    got = fast_jit(jax.vmap(tg.grad(f), in_axes=(0, None, None)))(xs, idxs[0], starts[1])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_grad_of_vmap_batching_dims():
    """tg.grad through jax.vmap: gather/scatter records carry operand_batching_dims."""
    rng = np.random.default_rng(11)
    xs = jnp.asarray(rng.standard_normal((3, 5, 2)), jnp.float32)
    idxs = jnp.array([[0, 3, 0], [1, 1, 2], [4, 2, 9]])
    starts = jnp.array([0, 2, 5])

    def f(x, i, s):
        y = x.at[i].set(jnp.sin(x[:3]) * 2.0)
        y = y.at[i].add(x[i] ** 2)
        y = y.at[i].max(x[i] * 0.5)
        y = lax.dynamic_update_slice(y, lax.dynamic_slice(x, (s, 0), (2, 2)) ** 2, (s, 1))
        return jnp.sum(jnp.cos(y))

    def g(xs):
        return jnp.sum(jnp.sin(jax.vmap(f)(xs, idxs, starts)))

    np.testing.assert_allclose(
        fast_jit(tg.grad(g))(xs), fast_jit(jax.grad(g))(xs), rtol=1e-5, atol=1e-5
    )
    assert_rules(g, xs, expect={"gather", "scatter", "scatter-add", "scatter-max"})


def test_x64_restored():
    before = bool(jax.config.jax_enable_x64)
    with precision("float64"):
        assert jnp.zeros(1, jnp.float64).dtype == np.float64
    assert bool(jax.config.jax_enable_x64) == before


def test_all_indexing_primitives_registered():
    assert INDEXING_PRIMS <= set(tg.rules.RULES)
