"""tapegrad's convolution and windowed-reduction rules against jax.

Each case checks, in float32 and float64, that ``tg.vjp`` (random cotangent)
equals ``jax.vjp`` for every operand, and that the primitive under test runs
tapegrad's own rule (not the fallback). Comparisons run tapegrad and jax
side by side inside one `jax.jit` per case (fast, and the rules see
tracers); `test_eager_*` and the conv net also run tapegrad without jit.
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


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
    """The float dtype of a case; float64 cases run with x64 enabled, restored after."""
    with _x64(request.param == "float64"):
        yield np.dtype(request.param)


def randn(shape, dtype, seed=0):
    return jnp.asarray(np.random.RandomState(seed).standard_normal(shape).astype(dtype))


def ties(shape, dtype, seed=0):
    """Values on a coarse grid: many exact ties inside pooling windows."""
    rng = np.random.RandomState(seed)
    return jnp.asarray(np.round(rng.standard_normal(shape)).astype(dtype))


def _close(actual, expected, dtype, rtol=None):
    if rtol is None:
        rtol = 1e-4 if np.dtype(dtype) == np.float32 else 1e-10
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
        finite = np.abs(e[np.isfinite(e)])  # a pooling window of padding alone gives -inf
        scale = max(1.0, float(finite.max())) if finite.size else 1.0
        assert_allclose(a, e, rtol=rtol, atol=rtol * scale)


def assert_rule(f, args, prims):
    """Each record of a primitive in ``prims`` in backward uses tapegrad's rule."""
    tape = tg.trace(f)(*args)
    recs = [r for r in tape.records if r.primitive in prims and r.in_backward]
    assert recs, f"none of {prims} in backward:\n{tape}"
    for r in recs:
        assert r.rule == "rule", f"{r.primitive} uses {r.rule}: {r}"
    return tape


def check(f, *args, prims=(), jit=True, seed=1, ref=None):
    """tg.vjp(f) == jax.vjp(ref or f) on a random cotangent, for every argument."""
    ref = f if ref is None else ref
    dt = jnp.result_type(args[0])
    outs, tree = jax.tree_util.tree_flatten(jax.eval_shape(f, *args))
    ct = tree.unflatten([randn(o.shape, o.dtype, seed=seed + i) for i, o in enumerate(outs)])

    def tg_side(args, ct):
        out, fn = tg.vjp(f, *args)
        return out, fn(ct)

    def jax_side(args, ct):
        out, fn = jax.vjp(ref, *args)
        return out, fn(ct)

    if jit:
        got, want = jax.jit(lambda a, c: (tg_side(a, c), jax_side(a, c)))(args, ct)
    else:
        got, want = tg_side(args, ct), jax.jit(jax_side)(args, ct)
    _close(got, want, dt)
    if prims:
        assert_rule(f, args, prims)
    return got


# ---------------------------------------------------------------------------
# conv_general_dilated

NCHW = ("NCHW", "OIHW", "NCHW")

CONV = {
    # name: (lhs shape, rhs shape, conv_general_dilated kwargs)
    "valid": ((2, 3, 7, 6), (4, 3, 3, 2), dict(window_strides=(1, 1), padding="VALID")),
    "same_stride2": ((2, 3, 8, 7), (4, 3, 3, 3), dict(window_strides=(2, 2), padding="SAME")),
    "uneven_stride": ((1, 2, 10, 8), (2, 2, 3, 3), dict(window_strides=(3, 2), padding="VALID")),
    "pad_rhs_dilation": (
        (2, 3, 9, 8),
        (4, 3, 3, 2),
        dict(window_strides=(2, 1), padding=((1, 2), (0, 1)), rhs_dilation=(2, 1)),
    ),
    "lhs_dilation": (
        (2, 3, 5, 4),
        (4, 3, 3, 3),
        dict(window_strides=(1, 1), padding=((2, 2), (1, 1)), lhs_dilation=(2, 2)),
    ),
    "feature_groups": (
        (2, 4, 6, 6),
        (6, 2, 3, 3),
        dict(window_strides=(1, 1), padding="SAME", feature_group_count=2),
    ),
    "depthwise": (
        (2, 3, 6, 5),
        (6, 1, 3, 3),
        dict(window_strides=(2, 1), padding="SAME", feature_group_count=3),
    ),
    "batch_groups": (
        (4, 3, 6, 6),
        (4, 3, 3, 3),
        dict(window_strides=(1, 1), padding="VALID", batch_group_count=2),
    ),
    "everything": (
        (2, 4, 7, 6),
        (4, 2, 2, 3),
        dict(
            window_strides=(2, 1),
            padding=((1, 0), (2, 1)),
            lhs_dilation=(1, 2),
            rhs_dilation=(2, 1),
            feature_group_count=2,
        ),
    ),
    "nhwc": (
        (2, 7, 6, 3),
        (3, 3, 3, 4),
        dict(window_strides=(2, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")),
    ),
    "1d": (
        (2, 9, 3),
        (3, 3, 4),
        dict(
            window_strides=(2,),
            padding=((1, 1),),
            rhs_dilation=(2,),
            dimension_numbers=("NWC", "WIO", "NWC"),
        ),
    ),
    "3d": ((1, 2, 4, 5, 4), (3, 2, 2, 3, 2), dict(window_strides=(1, 2, 1), padding="SAME")),
}


def _conv(name):
    _, _, kw = CONV[name]
    kw = dict(kw)
    if "dimension_numbers" not in kw and len(CONV[name][0]) == 4:
        kw["dimension_numbers"] = NCHW
    return lambda x, w: lax.conv_general_dilated(x, w, **kw)


@pytest.mark.parametrize("name", sorted(CONV))
def test_conv(name, dtype):
    xs, ws, _ = CONV[name]
    check(_conv(name), randn(xs, dtype), randn(ws, dtype, seed=1), prims=("conv_general_dilated",))


def test_conv_saves_only_the_other_operand():
    x, w = jnp.ones((2, 3, 6, 6)), jnp.ones((4, 3, 3, 3))
    f = _conv("valid")
    for argnums, saved in [(0, [("in", 1)]), (1, [("in", 0)]), (None, [("in", 1), ("in", 0)])]:
        tape = tg.trace(f, argnums=argnums)(x, w)
        (rec,) = [r for r in tape.records if r.primitive == "conv_general_dilated"]
        assert [(s.kind, s.index) for s in rec.saves] == saved


def test_jnp_convolutions(dtype):
    a, b = randn((11,), dtype), randn((4,), dtype, seed=1)
    x, w = randn((2, 6, 6, 3), dtype, seed=2), randn((3, 3, 3, 5), dtype, seed=3)

    def f(a, b, x, w):
        return (
            jnp.convolve(a, b, mode="full"),
            jnp.convolve(a, b, mode="same"),
            jnp.correlate(a, b, mode="valid"),
            lax.conv_transpose(x, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")),
        )

    check(f, a, b, x, w, prims=("conv_general_dilated",))


def test_conv_preferred_element_type():
    x, w = randn((2, 3, 6, 6), np.float32), randn((4, 3, 3, 3), np.float32, seed=1)
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    f = lambda x, w: lax.conv_general_dilated(
        x, w, (1, 1), "SAME", preferred_element_type=jnp.float32
    )
    both = lambda x, w: (tg.vjp(f, x, w)[1](f(x, w)), jax.vjp(f, x, w)[1](f(x, w)))
    got, want = jax.jit(both)(x, w)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype == jnp.bfloat16
        assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), rtol=2e-2, atol=0.5)


# ---------------------------------------------------------------------------
# Windowed reductions

WINDOWS = [
    # (input shape, window, strides, padding, base_dilation, window_dilation)
    ((2, 6, 6, 3), (1, 2, 2, 1), (1, 2, 2, 1), "VALID", None, None),
    ((2, 7, 6, 3), (1, 3, 3, 1), (1, 2, 2, 1), "SAME", None, None),
    ((2, 3, 9, 8), (1, 1, 3, 2), (1, 1, 2, 3), ((0, 0), (0, 0), (1, 2), (0, 1)), None, None),
    (
        (2, 3, 9, 8),
        (1, 1, 2, 2),
        (1, 1, 1, 2),
        ((0, 0), (0, 0), (1, 1), (0, 0)),
        None,
        (1, 1, 2, 3),
    ),
    (
        (2, 3, 5, 4),
        (1, 1, 3, 2),
        (1, 1, 2, 1),
        ((0, 0), (0, 0), (1, 1), (2, 0)),
        (1, 1, 2, 2),
        None,
    ),
    ((11,), (4,), (3,), ((2, 1),), None, None),
]


def _pools(init, op, windows=WINDOWS):
    def f(*xs):
        return tuple(
            lax.reduce_window(x, init, op, w, s, p, base_dilation=bd, window_dilation=wd)
            for x, (_, w, s, p, bd, wd) in zip(xs, windows)
        )

    return f


def _window_inputs(dtype, make=randn, windows=WINDOWS):
    return [make(w[0], dtype, seed=i) for i, w in enumerate(windows)]


def _pool_by_slices(x, init, reduce, w, s, p, bd, wd):
    """Pooling written as a max/min over the stacked strided window slices (a
    reference jax can differentiate where its own max-pool VJP is missing,
    e.g. with window dilation; equal to it when no window has ties)."""
    bd, wd = bd or (1,) * x.ndim, wd or (1,) * x.ndim
    xp = lax.pad(x, jnp.asarray(init, x.dtype), [(lo, hi, b - 1) for (lo, hi), b in zip(p, bd)])
    span = [(k - 1) * d + 1 for k, d in zip(w, wd)]
    out = [(n - sp) // st + 1 for n, sp, st in zip(xp.shape, span, s)]
    parts = []
    for off in np.ndindex(*w):
        start = [o * d for o, d in zip(off, wd)]
        limit = [a + (n - 1) * st + 1 for a, n, st in zip(start, out, s)]
        parts.append(lax.slice(xp, start, limit, s))
    return reduce(jnp.stack(parts), axis=0)


def _pools_ref(init, op, reduce):
    # jax's own pooling VJP where it has one, the slice-based reference elsewhere.
    def f(*xs):
        return tuple(
            lax.reduce_window(x, init, op, w, s, p, base_dilation=bd, window_dilation=wd)
            if wd is None
            else _pool_by_slices(x, init, reduce, w, s, p, bd, wd)
            for x, (_, w, s, p, bd, wd) in zip(xs, WINDOWS)
        )

    return f


def test_reduce_window_sum(dtype):
    check(_pools(0.0, lax.add), *_window_inputs(dtype), prims=("reduce_window_sum",))


@pytest.mark.parametrize("kind", ["max", "min"])
def test_reduce_window_chooser(kind, dtype):
    init, op, red = (-jnp.inf, lax.max, jnp.max) if kind == "max" else (jnp.inf, lax.min, jnp.min)
    check(
        _pools(init, op),
        *_window_inputs(dtype),
        ref=_pools_ref(init, op, red),
        prims=(f"reduce_window_{kind}",),
    )


def test_reduce_window_chooser_ties():
    # Ties go to the first element of the window in row-major order, as in jax.
    windows = [w for w in WINDOWS if w[5] is None]  # jax has no VJP with window dilation
    mx, mn = _pools(-jnp.inf, lax.max, windows), _pools(jnp.inf, lax.min, windows)
    check(lambda *xs: mx(*xs) + mn(*xs), *_window_inputs(np.float32, ties, windows))
    for init, op in [(-jnp.inf, lax.max), (jnp.inf, lax.min)]:
        g = tg.grad(lambda x: lax.reduce_window(x, init, op, (2, 2), (1, 1), "VALID").sum())(
            jnp.ones((3, 3))
        )
        assert_allclose(np.asarray(g), [[1, 1, 0], [1, 1, 0], [0, 0, 0]])


def test_max_pool_saves_packed_choice():
    x = jnp.ones((2, 8, 8, 3))
    tape = tg.trace(
        lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
    )(x)
    (rec,) = [r for r in tape.records if r.primitive == "reduce_window_max"]
    # the index into a 9-element window in 4 bits, two to a byte along the 3 channels
    assert [(s.kind, s.shape, s.dtype) for s in rec.saves] == [("aux", (2, 4, 4, 2), np.uint8)]
    tape = tg.trace(
        lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
    )(x)
    assert all(not r.saves for r in tape.records if r.primitive == "reduce_window_sum")


# The generic primitive: a non-identity init value, or a computation jax does
# not recognise. jax cannot reverse-differentiate it, so the references are
# equivalent programs built from the specialised primitives.


def test_reduce_window_generic_max_relu(dtype):
    # init 0: max-pooling fused with a ReLU. (No input is exactly 0, so the
    # reference's tie between an element and 0 never arises.)
    x = randn((2, 7, 6, 3), dtype)
    kw = dict(window_dimensions=(1, 3, 3, 1), window_strides=(1, 2, 2, 1), padding="SAME")
    f = lambda x: lax.reduce_window(x, 0.0, lax.max, **kw)
    ref = lambda x: jnp.maximum(lax.reduce_window(x, -jnp.inf, lax.max, **kw), 0.0)
    check(f, x, ref=ref, prims=("reduce_window",))


def test_reduce_window_generic_add_and_custom_max(dtype):
    x = randn((2, 3, 9, 8), dtype)
    kw = dict(
        window_dimensions=(1, 1, 3, 2),
        window_strides=(1, 1, 2, 1),
        padding=((0, 0), (0, 0), (1, 1), (0, 1)),
    )
    mx = lambda a, b: lax.max(a, b)  # not lax.max itself: jax keeps the generic primitive
    f = lambda x: (
        lax.reduce_window(x, 1.0, lax.add, **kw),
        lax.reduce_window(x, -jnp.inf, mx, **kw),
        lax.reduce_window(x, jnp.inf, lambda a, b: lax.min(b, a), **kw),
    )
    ref = lambda x: (
        lax.reduce_window(x, 0.0, lax.add, **kw) + 1.0 + _pad_count(x, kw),
        lax.reduce_window(x, -jnp.inf, lax.max, **kw),
        lax.reduce_window(x, jnp.inf, lax.min, **kw),
    )
    check(f, x, ref=ref, prims=("reduce_window",))
    tape = tg.trace(f)(x)
    assert {r.primitive for r in tape.records if r.in_backward} == {"reduce_window"}


def _pad_count(x, kw):
    # The padding holds the init value too: each window adds 1.0 per padded slot.
    ones = jnp.zeros(x.shape, x.dtype)
    return lax.reduce_window(ones, 1.0, lax.add, **kw) - 1.0


def test_reduce_window_generic_unsupported():
    x = randn((6,), np.float32) + 2
    f = lambda x: lax.reduce_window(x, 1.0, lax.mul, (2,), (1,), "VALID").sum()
    with pytest.raises(Exception) as jax_error:  # noqa: B017 (whatever jax raises, ...)
        jax.grad(f)(x)
    with pytest.raises(type(jax_error.value)):  # ... tapegrad raises too, from the fallback
        tg.grad(f)(x)
    # An init value being differentiated is refused.
    g = lambda x, c: lax.reduce_window(x, c, lambda a, b: lax.max(a, b), (2,), (1,), "VALID").sum()
    with pytest.raises(NotImplementedError, match="init value"):
        tg.grad(g, argnums=(0, 1))(x, jnp.float32(0.0))


# ---------------------------------------------------------------------------
# A small conv net, without jit, under jit, second order, vmap


def _init_net(dtype):
    ks = [
        randn(s, dtype, seed=i) * 0.3
        for i, s in enumerate([(3, 3, 3, 8), (8,), (3, 3, 4, 8), (8 * 2 * 2, 5)])
    ]
    return dict(w1=ks[0], b1=ks[1], w2=ks[2], dense=ks[3])


def _net(params, x):
    dn = ("NHWC", "HWIO", "NHWC")
    h = lax.conv_general_dilated(x, params["w1"], (1, 1), "SAME", dimension_numbers=dn)
    h = jax.nn.relu(h + params["b1"])
    h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")  # max pool
    h = lax.conv_general_dilated(
        h, params["w2"], (2, 2), ((1, 1), (1, 1)), dimension_numbers=dn, feature_group_count=2
    )
    h = jnp.tanh(h)
    h = lax.reduce_window(h, 0.0, lax.add, (1, 2, 2, 1), (1, 1, 1, 1), "SAME") / 4  # avg pool
    logits = h.reshape(h.shape[0], -1) @ params["dense"]
    return jnp.mean(jax.nn.logsumexp(logits, axis=1) - logits[:, 0])


def test_conv_net(dtype):
    params, x = _init_net(dtype), randn((2, 8, 8, 3), dtype, seed=9)
    got, want = jax.jit(lambda p, x: (tg.grad(_net)(p, x), jax.grad(_net)(p, x)))(params, x)
    _close(got, want, dtype)
    assert_rule(
        _net, (params, x), ("conv_general_dilated", "reduce_window_max", "reduce_window_sum")
    )


def test_eager_conv_net():
    params, x = _init_net(np.float32), randn((2, 8, 8, 3), np.float32, seed=9)
    got = tg.value_and_grad(_net, argnums=(0, 1))(params, x)
    want = jax.jit(jax.value_and_grad(_net, argnums=(0, 1)))(params, x)
    _close(got, want, np.float32)


@pytest.mark.parametrize("name", ["feature_groups", "everything", "batch_groups"])
def test_eager_conv(name):
    xs, ws, _ = CONV[name]
    check(_conv(name), randn(xs, np.float32), randn(ws, np.float32, seed=1), jit=False)


def test_second_order(dtype):
    x, w = randn((2, 6, 6, 4), dtype), randn((3, 3, 2, 4), dtype, seed=1) * 0.5
    vx, vw = randn(x.shape, dtype, seed=2), randn(w.shape, dtype, seed=3)
    dn = ("NHWC", "HWIO", "NHWC")

    def f(x, w, generic):
        h = jnp.tanh(
            lax.conv_general_dilated(
                x,
                w,
                (2, 1),
                "SAME",
                rhs_dilation=(1, 2),
                dimension_numbers=dn,
                feature_group_count=2,
            )
        )
        m = lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 1, 1, 1), "SAME")
        s = lax.reduce_window(h * h, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        win = ((1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        if generic:  # the generic primitive (init 0); jax cannot differentiate it
            r = lax.reduce_window(h, 0.0, lax.max, *win)
        else:
            r = jnp.maximum(lax.reduce_window(h, -jnp.inf, lax.max, *win), 0.0)
        return jnp.sum(m**3) + jnp.sum(s**2) + jnp.sum(r**3)

    def hvp(grad, generic):
        fn = lambda x, w: f(x, w, generic)
        return lambda x, w: grad(
            lambda x, w: sum(jnp.vdot(g, v) for g, v in zip(grad(fn, (0, 1))(x, w), (vx, vw))),
            (0, 1),
        )(x, w)

    got, want = jax.jit(lambda x, w: (hvp(tg.grad, True)(x, w), hvp(jax.grad, False)(x, w)))(x, w)
    _close(got, want, dtype)


def test_second_order_eager():
    x, w = randn((1, 5, 5, 2), np.float32), randn((2, 2, 2, 3), np.float32, seed=1)
    dn = ("NHWC", "HWIO", "NHWC")
    f = lambda x, w: jnp.sum(
        jnp.tanh(lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn))
    )
    got = tg.grad(lambda w: jnp.sum(tg.grad(f)(x, w) ** 2))(w)
    want = jax.jit(jax.grad(lambda w: jnp.sum(jax.grad(f)(x, w) ** 2)))(w)
    _close(got, want, np.float32)


def test_vmap():
    params, xs = _init_net(np.float32), randn((3, 2, 8, 8, 3), np.float32, seed=9)
    got, want = jax.jit(
        lambda p, xs: (
            jax.vmap(tg.grad(_net), (None, 0))(p, xs),
            jax.vmap(jax.grad(_net), (None, 0))(p, xs),
        )
    )(params, xs)
    _close(got, want, np.float32)
