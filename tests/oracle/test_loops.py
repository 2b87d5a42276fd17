"""Loops and branches vs jax: gradients through ``lax.scan`` / ``fori_loop`` /
``lax.map`` / ``cond`` / ``switch`` equal ``jax.grad`` / ``jax.vjp``.

Every program is differentiated eagerly, under ``jax.jit``, per example under
``jax.vmap``, and (the RNN and a cond-in-scan) twice; the RNN and the
cond-in-scan also under every residual policy. These hold whether a loop record
is differentiated by a fallback (``jax.vjp`` of the whole primitive) or by
sub-tapes run by tapegrad's own interpreter (``Record.bodies``): the structure
itself is checked in ``test_loop_structure.py``.

Tolerances: float32 rtol 2e-5 / atol 1e-6 (a loop sums its per-step terms in
another order than jax may), float64 rtol 1e-10 / atol 1e-12; lossy policies
(bfloat16, int8) compare relative norms.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_vjp_match, enable_x64, rand
from jax import lax

import tapegrad as tg
from tapegrad import policies as P

THIS_FILE = os.path.basename(__file__)
CP = tg.CheckpointPolicy


def tol_of(dtype) -> tuple[float, float]:
    dt = jnp.dtype(dtype)
    if dt == jnp.float64:
        return 1e-10, 1e-12
    if dt == jnp.float32:
        return 2e-5, 1e-6
    return 2e-2, 2e-2  # float16 / bfloat16


def assert_close(got, want, scale: float = 1.0) -> None:
    """Same structure, shapes and dtypes; each float leaf within its own dtype's
    tolerance (``scale`` times it); float0 leaves (integer inputs) only by shape."""
    chex.assert_trees_all_equal_structs(got, want)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        w_np = np.asarray(w)
        if w_np.dtype == jax.dtypes.float0:
            continue
        rtol, atol = tol_of(w_np.dtype)
        np.testing.assert_allclose(
            np.asarray(g, np.float64),
            w_np.astype(np.float64),
            rtol=rtol * scale,
            atol=atol * scale,
        )


def rel_err(got, want) -> float:
    """Largest relative (Frobenius) error over the leaves."""
    errs = []
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        errs.append(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))
    return max(errs)


def oracle_grad(fn, argnums):
    """The oracle: ``jax.grad`` under ``jax.jit`` (one compile, where eager jax.grad of a
    loop compiles forward, linearization and transpose separately)."""
    return jax.jit(jax.grad(fn, argnums=argnums))


# ---------------------------------------------------------------------------
# Building blocks


def rnn(w, u, xs, h0):
    """Elman RNN: h = tanh(h @ w + x @ u); loss uses every step's output and the final h."""

    def step(h, x):
        h = jnp.tanh(h @ w + x @ u)
        return h, h

    h, ys = lax.scan(step, h0, xs)
    return jnp.sum(ys) + jnp.sum(h)


def rnn_outputs(w, u, xs, h0):
    """The RNN's raw outputs (ys, final h), for vjp with a random cotangent."""

    def step(h, x):
        h = jnp.tanh(h @ w + x @ u)
        return h, h * 2.0

    h, ys = lax.scan(step, h0, xs)
    return ys, h


def gru(p, xs, h0):
    """GRU cell; the carry is a dict holding h and a running sum of outputs."""

    def step(c, x):
        h = c["h"]
        z = jax.nn.sigmoid(x @ p["wz"] + h @ p["uz"])
        r = jax.nn.sigmoid(x @ p["wr"] + h @ p["ur"])
        n = jnp.tanh(x @ p["wn"] + (r * h) @ p["un"])
        h = (1.0 - z) * n + z * h
        return {"h": h, "acc": c["acc"] + jnp.sum(h * h, axis=-1)}, None

    c, _ = lax.scan(step, {"h": h0, "acc": jnp.zeros(h0.shape[:1], h0.dtype)}, xs)
    return jnp.sum(c["acc"]) + jnp.sum(jnp.sin(c["h"]))


def lstm(p, xs, hc0):
    """LSTM cell with a tuple carry (h, c)."""

    def step(hc, x):
        h, c = hc
        gates = x @ p["wx"] + h @ p["wh"] + p["b"]
        i, f, g, o = jnp.split(gates, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    (h, c), ys = lax.scan(step, hc0, xs)
    return jnp.sum(ys**2) + jnp.sum(c * h)


def layer_stack(ws, x):
    """Scan over layers: stacked weights ws[L, d, d] are the scanned xs."""
    h, _ = lax.scan(lambda h, w: (h + jnp.tanh(h @ w), None), x, ws)
    return jnp.sum(h**2)


def nested(w, xs, h0):
    """A scan whose body is a scan: xs[outer, inner, batch, d]."""

    def outer(h, xc):
        def inner(h, x):
            h = jnp.tanh(h @ w + x)
            return h, jnp.sum(h * x)

        h, s = lax.scan(inner, h, xc)
        return h * 0.9, jnp.sum(s)

    h, ss = lax.scan(outer, h0, xs)
    return jnp.sum(ss * jnp.arange(1.0, ss.shape[0] + 1, dtype=ss.dtype)) + jnp.sum(h**2)


def rnn_scan_kwargs(**kw):
    def f(w, xs, h0):
        def step(h, x):
            h = jnp.tanh(h @ w + x)
            return h, jnp.sin(h)

        h, ys = lax.scan(step, h0, xs, **kw)
        steps = jnp.arange(1.0, ys.shape[0] + 1, dtype=ys.dtype)[:, None, None]
        return jnp.sum(ys * steps) + jnp.sum(h**2)  # weights make the order matter

    return f


def scan_length_no_xs(w, h0):
    h, ys = lax.scan(lambda h, _: (jnp.tanh(h @ w) + 0.1, h), h0, None, length=6)
    return jnp.sum(ys**2) + jnp.sum(h)


def scan_pytree_xs(w, xs, h0):
    def step(h, x):
        a, (b, s) = x["a"], x["bs"]
        h = jnp.tanh(h @ w + a * b) * s
        return h, {"y": h, "n": jnp.sum(h)}

    h, ys = lax.scan(step, h0, xs)
    return jnp.sum(ys["y"] ** 2) + jnp.sum(ys["n"]) + jnp.sum(h)


def scan_ys_none(w, xs, h0):
    h, ys = lax.scan(lambda h, x: (jnp.tanh(h @ w + x), None), h0, xs)
    assert ys is None
    return jnp.sum(h**2)


def fori(w, h0):
    return jnp.sum(lax.fori_loop(0, 5, lambda i, h: jnp.tanh(h @ w) + 0.1 * i, h0) ** 2)


def lax_map(w, xs):
    return jnp.sum(lax.map(lambda x: jnp.sin(jnp.tanh(x @ w)) ** 2, xs))


def lax_map_batched(w, xs):
    return jnp.sum(lax.map(lambda x: jnp.sin(jnp.tanh(x @ w)) ** 2, xs, batch_size=2))


def cond_in_scan(w, xs, h0):
    """A data-dependent cond in the body: the predicate is the sign of sum(x_t)."""

    def step(h, x):
        h = lax.cond(
            jnp.sum(x) > 0,
            lambda h: jnp.tanh(h @ w + x),
            lambda h: jnp.sin(h) * x + h @ w * 0.5,
            h,
        )
        return h, h

    h, ys = lax.scan(step, h0, xs)
    return jnp.sum(ys) + jnp.sum(h**2)


def switch_in_scan(w, xs, h0):
    def step(h, x):
        i = jnp.clip(jnp.floor(jnp.sum(x) + 1.5), 0, 2).astype(jnp.int32)
        h = lax.switch(
            i,
            [
                lambda h: jnp.tanh(h @ w + x),
                lambda h: h * jnp.cos(x),
                lambda h: jnp.exp(-(h**2)) @ w,
            ],
            h,
        )
        return h, jnp.sum(h)

    h, ys = lax.scan(step, h0, xs)
    return jnp.sum(ys) + jnp.sum(h**2)


def scan_in_cond(w, xs, h0):
    def run(h0):
        h, ys = lax.scan(lambda h, x: (jnp.tanh(h @ w + x), h), h0, xs)
        return h + jnp.sum(ys, axis=0)

    out = lax.cond(jnp.sum(h0) > 0, run, lambda h0: jnp.sin(h0 @ w), h0)
    return jnp.sum(out**2)


def cond_mixed_dtypes(x, s, n, flag):
    """cond operands: a float array, a float16 scalar, an int32 and a bool."""

    def yes(x, s, n, flag):
        return jnp.sin(x) * s.astype(x.dtype) * n.astype(x.dtype), s * 2

    def no(x, s, n, flag):
        return jnp.where(flag, x**2, x) + n.astype(x.dtype), s * s

    a, b = lax.cond(n > 2, yes, no, x, s, n, flag)
    return jnp.sum(a) + b.astype(x.dtype)


def cond_one_branch_uses(x, y, p):
    """y is used by one branch only: its gradient is zero when the other one runs."""
    return jnp.sum(lax.cond(p > 0, lambda x, y: jnp.sin(x), lambda x, y: x * y, x, y))


def int_carry(w, xs, h0):
    """An integer step counter in the carry."""

    def step(c, x):
        h, i = c
        h = jnp.tanh(h @ w + x) * (1.0 + 0.1 * i.astype(h.dtype))
        return (h, i + 1), h * i.astype(h.dtype)

    (h, i), ys = lax.scan(step, (h0, jnp.int32(0)), xs)
    return jnp.sum(ys) + jnp.sum(h) * i.astype(h.dtype)


def key_carry(w, xs, h0, key):
    """A PRNG key in the carry: split each step, normal noise added."""

    def step(c, x):
        h, k = c
        k, sub = jax.random.split(k)
        h = jnp.tanh(h @ w + x + 0.1 * jax.random.normal(sub, h.shape, h.dtype))
        return (h, k), h

    (h, _), ys = lax.scan(step, (h0, key), xs)
    return jnp.sum(ys**2) + jnp.sum(h)


def closure_values(w, xs, h0):
    """Values derived from differentiated inputs, closed over by the body."""
    w2 = jnp.sin(w) * 0.5
    b = jnp.mean(xs, axis=0)

    def step(h, x):
        return jnp.tanh(h @ w2 + x * b), jnp.sum(h * b)

    h, ys = lax.scan(step, h0, xs)
    return jnp.sum(ys) + jnp.sum(h**2)


def relu_body(w, xs, h0):
    h, ys = lax.scan(lambda h, x: (jax.nn.relu(h @ w + x) * 0.9, jnp.sum(h)), h0, xs)
    return jnp.sum(ys) + jnp.sum(h**2)


def checkpoint_body(w, xs, h0):
    @jax.checkpoint
    def step(h, x):
        h = jnp.tanh(jnp.sin(h @ w) + x)
        return h, h

    h, ys = lax.scan(step, h0, xs)
    return jnp.sum(ys**2) + jnp.sum(h)


def checkpoint_policy_body(w, xs, h0):
    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.dots_saveable)
    def step(h, x):
        h = jnp.tanh(jnp.sin(h @ w) + x)
        return h, h

    h, ys = lax.scan(step, h0, xs)
    return jnp.sum(ys**2) + jnp.sum(h)


class Cube(tg.Function):
    """x ** 3 with a hand-written backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3.0 * x * x * g


def function_body(w, xs, h0):
    h, ys = lax.scan(lambda h, x: (jnp.tanh(Cube.apply(h @ w) + x), h), h0, xs)
    return jnp.sum(ys**2) + jnp.sum(h)


def named_body(w, xs, h0):
    def step(h, x):
        h = tg.name(jnp.tanh(h @ w + x), "h")
        return h, tg.name(h * 2.0, "y")

    h, ys = lax.scan(step, h0, xs)
    return jnp.sum(ys) + jnp.sum(h**2)


def _double(g):
    return g * 2.0


def hooked_body(w, xs, h0):
    def step(h, x):
        a = tg.hook(h @ w, _double)  # backward doubles the cotangent of h @ w
        h = jnp.tanh(a + x)
        return h, h

    h, ys = lax.scan(step, h0, xs)
    return jnp.sum(ys) + jnp.sum(h**2)


# ---------------------------------------------------------------------------
# The programs: arguments, what is differentiated, how examples are batched.

T, B, D, DIN = 5, 2, 3, 2


@dataclass(frozen=True)
class Program:
    fn: Callable
    make: Callable  # dtype -> args
    argnums: tuple[int, ...]
    in_axes: tuple  # for per-example gradients: 0 = batched (a leading axis of 2), None = shared


def _w(dtype, d=D, seed=1, scale=0.6):
    return rand((d, d), dtype, -scale, scale, seed=seed)


def _xs(dtype, *shape, seed=2):
    return rand(shape or (T, B, D), dtype, -1, 1, seed=seed)


def _h0(dtype, seed=3):
    return rand((B, D), dtype, -0.5, 0.5, seed=seed)


def _sign_mixed_xs(dtype):
    """Per-step x whose sum changes sign: steps 0, 2, 3 positive, 1 and 4 negative."""
    xs = np.array(rand((T, B, D), dtype, -0.3, 0.3, seed=4), np.float64)
    for t, s in enumerate([1, -1, 1, 1, -1]):
        xs[t] += s * 0.5
    return jnp.asarray(xs, dtype)


def _gru_params(dtype):
    return {
        k: rand((DIN if k.startswith("w") else D, D), dtype, -0.6, 0.6, seed=10 + i)
        for i, k in enumerate(["wz", "uz", "wr", "ur", "wn", "un"])
    }


def _lstm_params(dtype):
    return {
        "wx": rand((DIN, 4 * D), dtype, -0.6, 0.6, seed=20),
        "wh": rand((D, 4 * D), dtype, -0.6, 0.6, seed=21),
        "b": rand((4 * D,), dtype, -0.1, 0.1, seed=22),
    }


PROGRAMS: dict[str, Program] = {
    "rnn": Program(
        rnn,
        lambda dt: (_w(dt), rand((DIN, D), dt, -0.6, 0.6, seed=5), _xs(dt, T, B, DIN), _h0(dt)),
        (0, 1, 2, 3),
        (None, None, 0, 0),
    ),
    "gru_dict_carry": Program(
        gru, lambda dt: (_gru_params(dt), _xs(dt, T, B, DIN), _h0(dt)), (0, 1, 2), (None, 0, 0)
    ),
    "lstm_tuple_carry": Program(
        lstm,
        lambda dt: (_lstm_params(dt), _xs(dt, T, B, DIN), (_h0(dt), _h0(dt, seed=6))),
        (0, 1, 2),
        (None, 0, 0),
    ),
    "layer_stack": Program(
        layer_stack,
        lambda dt: (rand((4, D, D), dt, -0.5, 0.5, seed=7), rand((B, D), dt, -1, 1, seed=8)),
        (0, 1),
        (None, 0),
    ),
    "nested_scan": Program(
        nested, lambda dt: (_w(dt), _xs(dt, 3, 2, B, D), _h0(dt)), (0, 1, 2), (None, 0, 0)
    ),
    "reverse": Program(
        rnn_scan_kwargs(reverse=True),
        lambda dt: (_w(dt), _xs(dt), _h0(dt)),
        (0, 1, 2),
        (None, 0, 0),
    ),
    "unroll2_len7": Program(
        rnn_scan_kwargs(unroll=2),
        lambda dt: (_w(dt), _xs(dt, 7, B, D), _h0(dt)),
        (0, 1, 2),
        (None, 0, 0),
    ),
    "unroll3_len7_reverse": Program(
        rnn_scan_kwargs(unroll=3, reverse=True),
        lambda dt: (_w(dt), _xs(dt, 7, B, D), _h0(dt)),
        (0, 1, 2),
        (None, 0, 0),
    ),
    "length_no_xs": Program(scan_length_no_xs, lambda dt: (_w(dt), _h0(dt)), (0, 1), (None, 0)),
    "pytree_xs": Program(
        scan_pytree_xs,
        lambda dt: (
            _w(dt),
            {
                "a": _xs(dt),
                "bs": (rand((T, D), dt, 0.5, 1.5, seed=9), rand((T,), dt, 0.5, 1.5, seed=10)),
            },
            _h0(dt),
        ),
        (0, 1, 2),
        (None, 0, 0),
    ),
    "ys_none": Program(
        scan_ys_none, lambda dt: (_w(dt), _xs(dt), _h0(dt)), (0, 1, 2), (None, 0, 0)
    ),
    "fori_loop": Program(fori, lambda dt: (_w(dt), _h0(dt)), (0, 1), (None, 0)),
    "lax_map": Program(lax_map, lambda dt: (_w(dt), _xs(dt)), (0, 1), (None, 0)),
    "lax_map_batch_size": Program(
        lax_map_batched, lambda dt: (_w(dt), _xs(dt, 6, B, D)), (0, 1), (None, 0)
    ),
    "cond_in_scan": Program(
        cond_in_scan, lambda dt: (_w(dt), _sign_mixed_xs(dt), _h0(dt)), (0, 1, 2), (None, 0, 0)
    ),
    "switch_in_scan": Program(
        switch_in_scan, lambda dt: (_w(dt), _sign_mixed_xs(dt), _h0(dt)), (0, 1, 2), (None, 0, 0)
    ),
    "scan_in_cond_true": Program(
        scan_in_cond, lambda dt: (_w(dt), _xs(dt), jnp.abs(_h0(dt))), (0, 1, 2), (None, 0, None)
    ),
    "scan_in_cond_false": Program(
        scan_in_cond, lambda dt: (_w(dt), _xs(dt), -jnp.abs(_h0(dt))), (0, 1, 2), (None, 0, None)
    ),
    "cond_mixed_dtypes_true": Program(
        cond_mixed_dtypes,
        lambda dt: (
            _xs(dt, 4),
            jnp.asarray(0.75, jnp.float16),
            jnp.asarray(3, jnp.int32),
            jnp.asarray(True),
        ),
        (0, 1),
        (0, None, None, None),
    ),
    "cond_mixed_dtypes_false": Program(
        cond_mixed_dtypes,
        lambda dt: (
            _xs(dt, 4),
            jnp.asarray(0.75, jnp.float16),
            jnp.asarray(1, jnp.int32),
            jnp.asarray(True),
        ),
        (0, 1),
        (0, None, None, None),
    ),
    "cond_one_branch_uses_taken": Program(
        cond_one_branch_uses,
        lambda dt: (_xs(dt, 4), _xs(dt, 4, seed=5), jnp.asarray(-1.0, dt)),
        (0, 1),
        (0, 0, None),
    ),
    "cond_one_branch_uses_not_taken": Program(
        cond_one_branch_uses,
        lambda dt: (_xs(dt, 4), _xs(dt, 4, seed=5), jnp.asarray(1.0, dt)),
        (0, 1),
        (0, 0, None),
    ),
    "int_carry": Program(int_carry, lambda dt: (_w(dt), _xs(dt), _h0(dt)), (0, 1, 2), (None, 0, 0)),
    "key_carry": Program(
        key_carry,
        lambda dt: (_w(dt), _xs(dt), _h0(dt), jax.random.key(7)),
        (0, 1, 2),
        (None, 0, 0, None),
    ),
    "raw_key_carry": Program(
        key_carry,
        lambda dt: (_w(dt), _xs(dt), _h0(dt), jax.random.PRNGKey(7)),
        (0, 1, 2),
        (None, 0, 0, None),
    ),
    "closure_values": Program(
        closure_values, lambda dt: (_w(dt), _xs(dt), _h0(dt)), (0, 1, 2), (None, 0, 0)
    ),
    "relu_body": Program(relu_body, lambda dt: (_w(dt), _xs(dt), _h0(dt)), (0, 1, 2), (None, 0, 0)),
    "checkpoint_body": Program(
        checkpoint_body, lambda dt: (_w(dt), _xs(dt), _h0(dt)), (0, 1, 2), (None, 0, 0)
    ),
    "checkpoint_policy_body": Program(
        checkpoint_policy_body, lambda dt: (_w(dt), _xs(dt), _h0(dt)), (0, 1, 2), (None, 0, 0)
    ),
    "function_body": Program(
        function_body, lambda dt: (_w(dt), _xs(dt), _h0(dt)), (0, 1, 2), (None, 0, 0)
    ),
    "named_body": Program(
        named_body, lambda dt: (_w(dt), _xs(dt), _h0(dt)), (0, 1, 2), (None, 0, 0)
    ),
    "hooked_body": Program(
        hooked_body, lambda dt: (_w(dt), _xs(dt), _h0(dt)), (0, 1, 2), (None, 0, 0)
    ),
}

NAMES = sorted(PROGRAMS)
# Variants of another program (a second predicate value, a raw uint32 key, a checkpoint
# policy, lax.map's batch_size, unroll without reverse) run eagerly only, to keep the
# file fast: their jit and vmap paths are the same as the program they vary.
EAGER_ONLY = {
    "checkpoint_policy_body",
    "lax_map_batch_size",
    "raw_key_carry",
    "scan_in_cond_false",
    "unroll2_len7",
}
TRACED_NAMES = [n for n in NAMES if n not in EAGER_ONLY]


def _second_example(x, seed):
    """Another example like ``x``: floats changed, integers/bools/keys kept."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return (x * 0.7 + rand(x.shape, x.dtype, -0.2, 0.2, seed=seed)).astype(x.dtype)
    return x


def batched_args(args, in_axes):
    """Stack each batched argument with a second, different example (leading axis 2)."""
    out = []
    for k, (a, ax) in enumerate(zip(args, in_axes)):
        if ax is None:
            out.append(a)
        else:
            out.append(
                jax.tree_util.tree_map(lambda x, k=k: jnp.stack([x, _second_example(x, 90 + k)]), a)
            )
    return tuple(out)


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
    """float32, and float64 with x64 enabled for this test only."""
    with enable_x64(request.param == "float64"):
        yield request.param


# ---------------------------------------------------------------------------
# Eager, jit, vmap


# float64 eagerly (tight tolerance), float32 under jit and vmap; the policy tests
# below run the RNN and the cond-in-scan eagerly in float32 too.
@pytest.mark.parametrize("name", NAMES)
def test_grad_eager(name):
    with enable_x64():
        prog = PROGRAMS[name]
        args = prog.make("float64")
        got = tg.grad(prog.fn, argnums=prog.argnums)(*args)
        want = oracle_grad(prog.fn, prog.argnums)(*args)
        assert_close(got, want)


@pytest.mark.parametrize("name", ["lstm_tuple_carry", "key_carry", "nested_scan"])
def test_grad_eager_float32(name):
    prog = PROGRAMS[name]
    args = prog.make("float32")
    got = tg.grad(prog.fn, argnums=prog.argnums)(*args)
    want = oracle_grad(prog.fn, prog.argnums)(*args)
    assert_close(got, want)


@pytest.mark.parametrize("name", TRACED_NAMES)
def test_grad_under_jit_and_per_example_vmap(name):
    """``jax.jit(tg.grad(f))`` and per-example ``jax.vmap(tg.grad(f), in_axes)`` (under
    jit: one compile) vs ``jax.vmap(jax.grad(f))``; example 0 of the batch is the
    unbatched call, so one oracle checks both."""
    prog = PROGRAMS[name]
    args = prog.make("float32")
    batched = batched_args(args, prog.in_axes)
    tg_grad = tg.grad(prog.fn, argnums=prog.argnums)
    want = jax.jit(jax.vmap(jax.grad(prog.fn, argnums=prog.argnums), in_axes=prog.in_axes))(
        *batched
    )
    got = jax.jit(jax.vmap(tg_grad, in_axes=prog.in_axes))(*batched)
    assert_close(got, want)
    got_jit = jax.jit(tg_grad)(*args)
    assert_close(got_jit, jax.tree_util.tree_map(lambda a: a[0], want))
    # The two examples really differ (a batched argument is not broadcast by mistake).
    for leaf in jax.tree_util.tree_leaves(want):
        if leaf.dtype != jax.dtypes.float0 and float(jnp.max(jnp.abs(leaf[0] - leaf[1]))) > 0:
            break
    else:
        raise AssertionError("the per-example gradients are all equal")


def test_rnn_vjp_random_cotangent(dtype):
    w, u, xs, h0 = PROGRAMS["rnn"].make(dtype)
    assert_vjp_match(rnn_outputs, w, u, xs, h0, seed=5)


def test_cond_in_scan_takes_both_branches():
    """The oracle programs are meaningful: the predicate really changes over the steps."""
    xs = _sign_mixed_xs("float32")
    preds = np.asarray(jnp.sum(xs, axis=(1, 2)) > 0)
    assert preds.any() and not preds.all()
    idx = np.clip(np.floor(np.asarray(jnp.sum(xs, axis=(1, 2))) + 1.5), 0, 2).astype(int)
    assert len(set(idx.tolist())) >= 2


# ---------------------------------------------------------------------------
# Second order


def _grad_of_grad_cases():
    def rnn_w(dt):
        w, u, xs, h0 = PROGRAMS["rnn"].make(dt)
        return (lambda w: rnn(w, u, xs, h0)), w

    def rnn_xs(dt):
        w, u, xs, h0 = PROGRAMS["rnn"].make(dt)
        return (lambda xs: rnn(w, u, xs, h0)), xs

    def cond_scan_w(dt):
        w, xs, h0 = PROGRAMS["cond_in_scan"].make(dt)
        return (lambda w: cond_in_scan(w, xs, h0)), w

    def cond_scan_h0(dt):
        w, xs, h0 = PROGRAMS["cond_in_scan"].make(dt)
        return (lambda h0: cond_in_scan(w, xs, h0)), h0

    return {
        "rnn_w": rnn_w,
        "rnn_xs": rnn_xs,
        "cond_in_scan_w": cond_scan_w,
        "cond_in_scan_h0": cond_scan_h0,
    }


GG = _grad_of_grad_cases()


def _sum_sq(tree):
    return sum(jnp.sum(jnp.sin(x) * x) for x in jax.tree_util.tree_leaves(tree))


GG_CASES = [
    ("rnn_w", "sum"),  # the plain form: tg.grad(lambda x: tg.grad(f)(x).sum())
    ("rnn_xs", "tg_tg"),
    ("rnn_w", "jit_tg_tg"),
    ("rnn_xs", "tg_jax"),  # tapegrad over jax's own transposed scan
    ("cond_in_scan_w", "tg_tg"),
    ("cond_in_scan_h0", "sum"),
    ("rnn_w", "jax_tg"),
]


@pytest.mark.parametrize("case,how", GG_CASES, ids=[f"{c}-{h}" for c, h in GG_CASES])
def test_grad_of_grad(case, how):
    """Second order (float64): tapegrad over tapegrad (eager and jit), mixed with
    jax.grad, and the plain ``tg.grad(lambda x: tg.grad(f)(x).sum())`` form."""
    with enable_x64():
        f, x = GG[case]("float64")
        outer = (
            (lambda g: lambda x: g(x).sum())
            if how == "sum"
            else (lambda g: lambda x: _sum_sq(g(x)))
        )
        want = jax.jit(jax.grad(outer(jax.grad(f))))(x)
        inner = jax.grad(f) if how == "tg_jax" else tg.grad(f)
        if how in ("sum", "tg_tg", "tg_jax"):
            got = tg.grad(outer(inner))(x)
        elif how == "jax_tg":
            got = jax.grad(outer(inner))(x)
        else:
            got = jax.jit(tg.grad(outer(inner)))(x)
        assert_close(got, want)


# ---------------------------------------------------------------------------
# Policies


def _selective():
    return tg.selective(lambda r: CP.ALWAYS if r.primitive == "dot_general" else CP.NEVER)


# name -> (policy factory, lossy). Lossy policies compare relative norms (below).
POLICIES: dict[str, tuple[Callable, float | None]] = {
    "save": (P.save, None),
    "offload": (P.offload, None),
    "offload_inputs": (lambda: P.offload(inputs=True), None),  # the inputs moved too
    "compress_bf16": (lambda: P.compress(jnp.bfloat16), 3e-2),
    "compress_int8": (lambda: P.compress("int8"), 1e-1),
    "selective": (_selective, None),
    "selective_offload": (
        lambda: tg.selective(
            lambda r: CP.ALWAYS if r.primitive == "tanh" else CP.NEVER, base=P.offload()
        ),
        None,
    ),
    # Small, and above both programs' least peak (cond_in_scan's: 144 B, the scan's
    # per-step residuals, which the planner counts since 2026-12-02).
    "budget_small": (lambda: P.budget(bytes=160), None),
}

POLICY_PROGRAMS = ["rnn", "cond_in_scan"]


def _check_policy_result(got, want, lossy):
    if lossy is None:
        assert_close(got, want)
    else:
        err = rel_err(got, want)
        assert err < lossy, err


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("name", POLICY_PROGRAMS)
def test_policies(name, policy):
    prog = PROGRAMS[name]
    make, lossy = POLICIES[policy]
    args = prog.make("float32")
    got = tg.grad(prog.fn, argnums=prog.argnums, policy=make())(*args)
    want = oracle_grad(prog.fn, prog.argnums)(*args)
    _check_policy_result(got, want, lossy)


JIT_POLICIES = ["offload", "compress_bf16", "budget_small"]


@pytest.mark.parametrize("policy", JIT_POLICIES)
@pytest.mark.parametrize("name", POLICY_PROGRAMS)
def test_policies_under_jit(name, policy):
    prog = PROGRAMS[name]
    make, lossy = POLICIES[policy]
    args = prog.make("float32")
    got = jax.jit(tg.grad(prog.fn, argnums=prog.argnums, policy=make()))(*args)
    want = oracle_grad(prog.fn, prog.argnums)(*args)
    _check_policy_result(got, want, lossy)


@pytest.mark.parametrize("policy", ["offload", "compress_int8"])
@pytest.mark.parametrize("name", POLICY_PROGRAMS)
def test_policies_vjp_then_backward_later(name, policy):
    """``tg.vjp`` packs residuals in forward; ``vjp_fn`` unpacks them after the call."""
    prog = PROGRAMS[name]
    make, lossy = POLICIES[policy]
    args = prog.make("float32")
    out, vjp_fn = tg.vjp(prog.fn, *args, policy=make())
    want_out, want_vjp = jax.vjp(prog.fn, *args)
    assert_close(out, want_out)
    ct = jnp.asarray(1.5, out.dtype)
    got = [vjp_fn(ct)[i] for i in prog.argnums]
    want = [want_vjp(ct)[i] for i in prog.argnums]
    _check_policy_result(got, want, lossy)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", POLICY_PROGRAMS)
def test_saved_tensors_hooks_identity(name, jit):
    """PyTorch's saved_tensors_hooks with an identity pair: the same gradient, and
    pack and unpack are both called."""
    prog = PROGRAMS[name]
    args = prog.make("float32")
    calls = {"pack": 0, "unpack": 0}

    def pack(a):
        calls["pack"] += 1
        return a

    def unpack(a):
        calls["unpack"] += 1
        return a

    g = tg.grad(prog.fn, argnums=prog.argnums)
    with tg.saved_tensors_hooks(pack, unpack):
        got = (jax.jit(g) if jit else g)(*args)
    want = oracle_grad(prog.fn, prog.argnums)(*args)
    assert_close(got, want)
    assert calls["pack"] > 0 and calls["unpack"] > 0, calls


def test_saved_tensors_hooks_identity_vjp_outside_scope():
    """Residuals packed inside the hooks' scope are unpacked by them after it closes."""
    prog = PROGRAMS["rnn"]
    args = prog.make("float32")
    seen = []
    with tg.saved_tensors_hooks(lambda a: (seen.append(1), a)[1], lambda a: a):
        out, vjp_fn = tg.vjp(prog.fn, *args)
    got = vjp_fn(jnp.float32(1.0))
    want = jax.vjp(prog.fn, *args)[1](jnp.float32(1.0))
    assert_close(got, want)
    assert seen


def test_compress_really_changes_the_gradient():
    """Lossy policies are not silently ignored inside loops: int8 residuals change
    the RNN's gradient (slightly), save() does not."""
    prog = PROGRAMS["rnn"]
    args = prog.make("float32")
    want = oracle_grad(prog.fn, (0, 1))(*args)
    got = tg.grad(prog.fn, argnums=(0, 1), policy=P.compress("int8"))(*args)
    assert rel_err(got, want) > 0


# ---------------------------------------------------------------------------
# Hooks and names inside a body


def _double_ct_oracle(x):
    return x


_double_ct_oracle = jax.custom_vjp(_double_ct_oracle)
_double_ct_oracle.defvjp(lambda x: (x, None), lambda _, g: (2.0 * g,))


def hooked_body_oracle(w, xs, h0):
    """`hooked_body` with tg.hook replaced by a hand-written jax.custom_vjp."""

    def step(h, x):
        a = _double_ct_oracle(h @ w)
        h = jnp.tanh(a + x)
        return h, h

    h, ys = lax.scan(step, h0, xs)
    return jnp.sum(ys) + jnp.sum(h**2)


def unhooked_body(w, xs, h0):
    def step(h, x):
        h = jnp.tanh(h @ w + x)
        return h, h

    h, ys = lax.scan(step, h0, xs)
    return jnp.sum(ys) + jnp.sum(h**2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_hook_in_body_sees_and_scales_cotangents(jit):
    args = PROGRAMS["hooked_body"].make("float32")
    g = tg.grad(hooked_body, argnums=(0, 1, 2))
    got = (jax.jit(g) if jit else g)(*args)
    want = oracle_grad(hooked_body_oracle, (0, 1, 2))(*args)
    assert_close(got, want)
    plain = oracle_grad(unhooked_body, (0, 1, 2))(*args)
    assert rel_err(got, plain) > 0.1  # the hook really acted, at every step


def test_observing_hook_in_body_sees_every_step():
    """An observe=True hook inside a T-step body sees T cotangents per backward, the
    ones jax sees."""
    seen_tg, seen_jax = [], []

    def body_with(seen):
        def f(w, xs, h0):
            def step(h, x):
                h = tg.hook(jnp.tanh(h @ w + x), lambda g: seen.append(np.asarray(g)), observe=True)
                return h, h

            h, ys = lax.scan(step, h0, xs)
            return jnp.sum(ys) + jnp.sum(h**2)

        return f

    args = PROGRAMS["hooked_body"].make("float32")
    got = tg.grad(body_with(seen_tg), argnums=(0, 1, 2))(*args)
    want = jax.grad(body_with(seen_jax), argnums=(0, 1, 2))(*args)
    jax.effects_barrier()
    assert_close(got, want)
    assert len(seen_tg) == len(seen_jax) == T
    for a, b in zip(seen_tg, seen_jax):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def test_name_in_body_with_names_policy():
    """tg.name inside a body, with jax.checkpoint's save_only_these_names on the body."""
    with enable_x64():
        w, xs, h0 = PROGRAMS["named_body"].make("float64")

        def f(w, xs, h0):
            step = jax.checkpoint(
                lambda h, x: (tg.name(jnp.tanh(jnp.sin(h @ w) + x), "h"), jnp.sum(h)),
                policy=jax.checkpoint_policies.save_only_these_names("h"),
            )
            h, ys = lax.scan(step, h0, xs)
            return jnp.sum(ys) + jnp.sum(h**2)

        assert_close(tg.grad(f, argnums=(0, 1, 2))(w, xs, h0), oracle_grad(f, (0, 1, 2))(w, xs, h0))


# ---------------------------------------------------------------------------
# while_loop with a dynamic trip count


def while_rnn(w, x):
    def body(c):
        h, i = c
        return h + jnp.tanh(h @ w) + 0.5, i + 1  # grows: the loop ends after a few steps

    h, n = lax.while_loop(lambda c: jnp.sum(c[0]) < 10.0, body, (x, 0))  # WHILE-LINE
    return jnp.sum(h) * n


def _line_of(marker: str) -> int:
    with open(__file__) as fh:
        for i, line in enumerate(fh, 1):
            if line.rstrip().endswith(marker):
                return i
    raise AssertionError(marker)


@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_while_loop_dynamic_trip_count_raises(argnums, jit):
    w = _w("float32", seed=11, scale=0.3)
    x = rand((B, D), "float32", 0.1, 0.5, seed=12)
    with pytest.raises(ValueError, match="while_loop"):  # jax refuses too
        jax.grad(while_rnn, argnums=argnums)(w, x)
    g = tg.grad(while_rnn, argnums=argnums)
    with pytest.raises(tg.errors.ReverseModeError) as info:
        (jax.jit(g) if jit else g)(w, x)
    msg = str(info.value)
    assert "while" in msg
    assert f"{THIS_FILE}:{_line_of('# WHILE-LINE')}" in msg, msg


def test_while_loop_forward_still_works():
    """Forward of the same function: plain, under tapegrad's trace when the loop is
    off the differentiated path, and value_and_grad of another argument."""
    w = _w("float32", seed=11, scale=0.3)
    x = rand((B, D), "float32", 0.1, 0.5, seed=12)
    y = jax.jit(while_rnn)(w, x)
    assert np.isfinite(float(y))

    def f(w, x, v):
        return while_rnn(w, x) * jnp.sum(jnp.sin(v))

    v = rand((3,), "float32", -1, 1, seed=13)
    tape = tg.trace(f, argnums=2)(w, x, v)
    whiles = [r for r in tape.records if r.primitive == "while"]
    assert len(whiles) == 1 and not whiles[0].in_backward
    val, gv = tg.value_and_grad(f, argnums=2)(w, x, v)
    want_val, want_gv = jax.value_and_grad(f, argnums=2)(w, x, v)
    assert_close((val, gv), (want_val, want_gv))
