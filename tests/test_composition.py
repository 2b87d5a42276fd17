"""tapegrad's transforms composed with jax's (jit, vmap, grad, jacfwd, sharding) and themselves.

Every test compares with jax's own autodiff on the same function and inputs.
"""

from __future__ import annotations

import subprocess
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_on_8_cpu_devices

import tapegrad as tg

RTOL, ATOL = 2e-5, 2e-6


def assert_trees_close(actual, expected, rtol=RTOL, atol=ATOL):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert np.shape(a) == np.shape(e)
        assert jnp.result_type(a) == jnp.result_type(e)
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


# ---------------------------------------------------------------- test functions


def f_sin_tanh(x):
    return jnp.sum(jnp.sin(x) * jnp.tanh(x))


def f_exp_poly(x):
    return jnp.sum(jnp.exp(0.3 * x) * (x**3 - 2.0 * x**2 + 0.5))


def f_matmul(x):
    m = jnp.outer(x, x) + jnp.eye(x.shape[0])
    return jnp.sum(jnp.tanh(m @ x) ** 2) / x.shape[0]


VECTOR_FUNS = [f_sin_tanh, f_exp_poly, f_matmul]
X = jnp.linspace(-1.3, 1.1, 5, dtype=jnp.float32)


def _normal(rng, shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype=jnp.float32)


def mlp_params(seed=0, d_in=3, d_hidden=8, d_out=2):
    # numpy, not jax.random: eager jax.random compiles several programs per call.
    rng = np.random.RandomState(seed)
    return {
        "w1": _normal(rng, (d_in, d_hidden), 1 / np.sqrt(d_in)),
        "b1": _normal(rng, (d_hidden,), 0.1),
        "w2": _normal(rng, (d_hidden, d_out), 1 / np.sqrt(d_hidden)),
    }


def mlp_loss(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def mlp_batch(seed=1, n=6, d_in=3, d_out=2):
    rng = np.random.RandomState(seed)
    return _normal(rng, (n, d_in)), _normal(rng, (n, d_out))


# ---------------------------------------------------------------- jit / vmap of tg.grad


@pytest.mark.parametrize("f", VECTOR_FUNS, ids=lambda f: f.__name__)
def test_jit_of_grad(f):
    got = jax.jit(tg.grad(f))(X)
    assert_trees_close(got, jax.jit(jax.grad(f))(X))


def test_jit_of_grad_pytree_params():
    p = mlp_params()
    x, y = mlp_batch()
    got = jax.jit(tg.grad(mlp_loss))(p, x, y)
    assert_trees_close(got, jax.jit(jax.grad(mlp_loss))(p, x, y))


def test_jit_of_grad_argnums_tuple():
    p = mlp_params()
    x, y = mlp_batch()
    got = jax.jit(tg.grad(mlp_loss, argnums=(0, 1)))(p, x, y)
    want = jax.jit(jax.grad(mlp_loss, argnums=(0, 1)))(p, x, y)
    assert isinstance(got, tuple) and len(got) == 2
    assert_trees_close(got, want)


def test_vmap_of_grad_per_example_mlp():
    p = mlp_params()
    x, y = mlp_batch(n=7)
    got = jax.vmap(tg.grad(mlp_loss), in_axes=(None, 0, 0))(p, x, y)
    want = jax.jit(jax.vmap(jax.grad(mlp_loss), in_axes=(None, 0, 0)))(p, x, y)
    assert got["w1"].shape == (7, 3, 8)
    assert_trees_close(got, want)
    # Per-example gradients really differ per example (vmap did not broadcast one gradient).
    assert not np.allclose(got["w2"][0], got["w2"][1])


def test_jit_of_vmap_of_grad():
    p = mlp_params()
    x, y = mlp_batch(n=4)
    got = jax.jit(jax.vmap(tg.grad(mlp_loss), in_axes=(None, 0, 0)))(p, x, y)
    want = jax.jit(jax.vmap(jax.grad(mlp_loss), in_axes=(None, 0, 0)))(p, x, y)
    assert_trees_close(got, want)


# ---------------------------------------------------------------- higher order

SCALAR_FUNS = {
    "sin": jnp.sin,
    "tanh": jnp.tanh,
    "exp": jnp.exp,
    "poly": lambda x: 3.0 * x**4 - 2.0 * x**3 + x - 7.0,
    "sin_times_cube": lambda x: jnp.sin(x) * x**3,
    "exp_tanh_product": lambda x: jnp.exp(0.5 * x) * jnp.tanh(x) * (1.0 + x**2),
    "log1p_sq": lambda x: jnp.log1p(x * x),
    "quotient": lambda x: jnp.sin(x) / (2.0 + jnp.cos(x)),
}


@pytest.mark.parametrize("name", sorted(SCALAR_FUNS))
def test_grad_of_grad(name):
    f = SCALAR_FUNS[name]
    gg = tg.grad(tg.grad(f))
    jgg = jax.jit(jax.grad(jax.grad(f)))
    for x0 in (-1.3, 0.2, 0.7, 2.1):
        np.testing.assert_allclose(gg(jnp.float32(x0)), jgg(jnp.float32(x0)), rtol=1e-4, atol=1e-5)


def test_grad_of_grad_of_grad():
    f = SCALAR_FUNS["sin_times_cube"]
    for x0 in (-0.9, 0.4, 1.7):
        np.testing.assert_allclose(
            tg.grad(tg.grad(tg.grad(f)))(x0),
            jax.grad(jax.grad(jax.grad(f)))(x0),
            rtol=1e-4,
            atol=1e-4,
        )


def test_grad_of_grad_mixed_partial():
    f = lambda x, y: jnp.sin(x * y) * y**2 + jnp.exp(x) * y
    got = tg.grad(tg.grad(f, argnums=1), argnums=0)(0.3, -1.2)
    want = jax.grad(jax.grad(f, argnums=1), argnums=0)(0.3, -1.2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_grad_of_grad_vector_input():
    # d/dx sum(grad f(x)) for a vector-valued gradient.
    got = tg.grad(lambda x: jnp.sum(tg.grad(f_sin_tanh)(x)))(X)
    want = jax.jit(jax.grad(lambda x: jnp.sum(jax.grad(f_sin_tanh)(x))))(X)
    assert_trees_close(got, want, rtol=1e-4, atol=1e-5)


def _check_hessian(got, f):
    want = jax.jit(jax.hessian(f))(X)
    assert got.shape == (5, 5)
    assert_trees_close(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got, got.T, rtol=1e-4, atol=1e-5)


def test_jacfwd_of_grad_is_hessian_eager():
    _check_hessian(jax.jacfwd(tg.grad(f_sin_tanh))(X), f_sin_tanh)


@pytest.mark.parametrize("f", VECTOR_FUNS, ids=lambda f: f.__name__)
def test_jacfwd_of_grad_is_hessian_jit(f):
    # Under jit to keep the suite fast: eager jacfwd compiles every primitive op by op.
    _check_hessian(jax.jit(jax.jacfwd(tg.grad(f)))(X), f)


def test_jax_grad_of_function_calling_tg_grad():
    def inner(x):
        return jnp.sum(tg.grad(f_exp_poly)(x) ** 2)

    def inner_ref(x):
        return jnp.sum(jax.grad(f_exp_poly)(x) ** 2)

    assert_trees_close(jax.grad(inner)(X), jax.jit(jax.grad(inner_ref))(X), rtol=1e-4, atol=1e-5)


def test_jax_grad_of_tg_grad_closure_over_params():
    # Meta-learning shape: one tg.grad inner step, outer jax.grad through it.
    p = mlp_params()
    x, y = mlp_batch()

    def outer(p, inner_grad):
        g = inner_grad(mlp_loss)(p, x, y)
        p2 = jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
        return mlp_loss(p2, x, y)

    got = jax.jit(jax.grad(lambda p: outer(p, tg.grad)))(p)
    want = jax.jit(jax.grad(lambda p: outer(p, jax.grad)))(p)
    assert_trees_close(got, want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- tg.grad of jax transforms


@pytest.mark.parametrize("f", VECTOR_FUNS, ids=lambda f: f.__name__)
def test_grad_of_jit(f):
    assert_trees_close(tg.grad(jax.jit(f))(X), jax.jit(jax.grad(f))(X))


def test_grad_of_nested_jit():
    f = jax.jit(lambda x: jnp.sum(jax.jit(jnp.sin)(x) * jax.jit(lambda z: z**2)(x)))
    assert_trees_close(tg.grad(f)(X), jax.jit(jax.grad(f))(X))


def test_grad_of_vmap():
    def per_row(r, w):
        return jnp.tanh(r @ w) ** 2

    def f(w, xs):
        return jnp.sum(jax.vmap(per_row, in_axes=(0, None))(xs, w))

    w = jnp.linspace(-0.5, 0.5, 12).reshape(4, 3)
    xs = jnp.arange(20.0).reshape(5, 4) / 20.0
    got = tg.grad(f, argnums=(0, 1))(w, xs)
    want = jax.jit(jax.grad(f, argnums=(0, 1)))(w, xs)
    assert_trees_close(got, want)


def test_grad_of_vmapped_scalar_function():
    f = SCALAR_FUNS["exp_tanh_product"]
    g = lambda x: jnp.sum(jax.vmap(f)(x))
    assert_trees_close(tg.grad(g)(X), jax.jit(jax.vmap(jax.grad(f)))(X))


# ---------------------------------------------------------------- vjp


def pytree_fun(x, y):
    return {"a": jnp.sin(x) * y, "b": (x @ y, jnp.exp(x) - y**2)}


def test_vjp_pytree_output_matches_jax_and_can_be_called_twice():
    x = jnp.linspace(-1.0, 1.0, 4)
    y = jnp.linspace(0.5, 2.0, 4)
    out, vjp_fn = tg.vjp(pytree_fun, x, y)
    jout, jvjp_fn = jax.vjp(pytree_fun, x, y)
    assert_trees_close(out, jout)

    ct1 = jax.tree.map(lambda o: jnp.ones_like(o), jout)
    ct2 = {"a": jnp.arange(4.0), "b": (jnp.float32(-2.0), jnp.linspace(1.0, 3.0, 4))}
    first = vjp_fn(ct1)
    assert isinstance(first, tuple) and len(first) == 2
    assert_trees_close(first, jvjp_fn(ct1))
    # Default retain_residuals=True: calling again (with another cotangent) works.
    assert_trees_close(vjp_fn(ct2), jvjp_fn(ct2))
    assert_trees_close(vjp_fn(ct1), first)


def test_vjp_has_aux_pytree_primals():
    def f(p, x):
        loss = mlp_loss(p, x, jnp.zeros((x.shape[0], 2)))
        return loss, {"n": x.shape[0], "mean": jnp.mean(x)}

    p = mlp_params()
    x, _ = mlp_batch()
    out, vjp_fn, aux = tg.vjp(f, p, x, has_aux=True)
    jout, jvjp_fn, jaux = jax.vjp(f, p, x, has_aux=True)
    assert_trees_close(out, jout)
    assert aux["n"] == jaux["n"]
    np.testing.assert_allclose(aux["mean"], jaux["mean"], rtol=RTOL)
    assert_trees_close(vjp_fn(jnp.float32(1.5)), jvjp_fn(jnp.float32(1.5)))


def test_vjp_without_retained_residuals_raises_on_second_call():
    x = jnp.linspace(-1.0, 1.0, 4)
    y = jnp.linspace(0.5, 2.0, 4)
    out, vjp_fn = tg.vjp(pytree_fun, x, y, retain_residuals=False)
    ct = jax.tree.map(jnp.ones_like, out)
    _, jvjp_fn = jax.vjp(pytree_fun, x, y)
    assert_trees_close(vjp_fn(ct), jvjp_fn(ct))  # the first call works
    with pytest.raises(tg.ResidualError) as ei:
        vjp_fn(ct)
    err = ei.value
    assert isinstance(err, RuntimeError)
    assert isinstance(err, tg.TapegradError)
    msg = str(err)
    assert "retain_residuals=True" in msg  # says how to fix it
    assert "second time" in msg or "more than once" in msg


def test_jit_of_vjp_fn():
    f = lambda x: jnp.tanh(x) * jnp.sin(2.0 * x)
    x = jnp.linspace(-1.0, 1.0, 6)
    ct = jnp.linspace(1.0, 2.0, 6)
    got = jax.jit(lambda x: tg.vjp(f, x)[1](ct))(x)
    want = jax.vjp(f, x)[1](ct)
    assert isinstance(got, tuple) and len(got) == 1
    assert_trees_close(got, want)


def test_jit_of_vjp_fn_pytree():
    x = jnp.linspace(-1.0, 1.0, 4)
    y = jnp.linspace(0.5, 2.0, 4)
    ct = {"a": jnp.arange(4.0), "b": (jnp.float32(0.5), jnp.ones(4))}
    got = jax.jit(lambda x, y: tg.vjp(pytree_fun, x, y)[1](ct))(x, y)
    assert_trees_close(got, jax.vjp(pytree_fun, x, y)[1](ct))


def test_vmap_of_vjp_fn():
    # Batched cotangents: rows of a Jacobian, as jax.jacrev does.
    f = lambda x: jnp.sin(x) * jnp.sum(x**2)
    x = jnp.linspace(-1.0, 1.0, 4)
    _, vjp_fn = tg.vjp(f, x)
    (jac,) = jax.vmap(vjp_fn)(jnp.eye(4))
    assert_trees_close(jac, jax.jit(jax.jacrev(f))(x), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------- value_and_grad / has_aux under jit


def test_value_and_grad_has_aux_under_jit():
    def loss_with_aux(p, x, y):
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        pred = h @ p["w2"]
        loss = jnp.mean((pred - y) ** 2)
        return loss, {"pred": pred, "hidden_norm": jnp.linalg.norm(h)}

    p = mlp_params()
    x, y = mlp_batch()
    (v, aux), g = jax.jit(tg.value_and_grad(loss_with_aux, has_aux=True))(p, x, y)
    (jv, jaux), jg = jax.jit(jax.value_and_grad(loss_with_aux, has_aux=True))(p, x, y)
    assert_trees_close(v, jv)
    assert_trees_close(aux, jaux)
    assert_trees_close(g, jg)


def test_grad_has_aux_under_jit_argnums():
    f = lambda a, b: (jnp.sum(jnp.sin(a) * b), (a.shape[0], jnp.max(b)))
    a, b = jnp.linspace(0.0, 1.0, 3), jnp.linspace(1.0, 2.0, 3)
    (ga, gb), aux = jax.jit(tg.grad(f, argnums=(0, 1), has_aux=True))(a, b)
    (ja, jb), jaux = jax.jit(jax.grad(f, argnums=(0, 1), has_aux=True))(a, b)
    assert_trees_close((ga, gb), (ja, jb))
    assert aux[0] == jaux[0] == 3
    np.testing.assert_allclose(aux[1], jaux[1])


# ---------------------------------------------------------------- sharded inputs (8 CPU devices)

_SHARDED_PRELUDE = """
import os, sys
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import tapegrad as tg

assert jax.device_count() == 8, jax.devices()

def loss(p, x):
    h = jnp.tanh(x @ p["w1"])
    return jnp.mean((h @ p["w2"]) ** 2) + 0.01 * jnp.sum(p["w1"] ** 2)

def check(mesh):
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("d", None))
    rng = np.random.RandomState(0)
    p = {"w1": jax.device_put(np.float32(rng.standard_normal((4, 6)) * 0.5), rep),
         "w2": jax.device_put(np.float32(rng.standard_normal((6, 2)) * 0.5), rep)}
    x = jax.device_put(np.float32(rng.standard_normal((32, 4))), rows)
    got = jax.jit(tg.grad(loss, argnums=(0, 1)))(p, x)
    want = jax.jit(jax.grad(loss, argnums=(0, 1)))(p, x)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert isinstance(g.sharding, NamedSharding), g.sharding
        assert g.sharding.mesh.shape == mesh.shape, g.sharding
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-6)
    # The gradient w.r.t. the row-sharded input stays sharded over the mesh.
    assert got[1].sharding.spec[0] == "d", got[1].sharding
"""


def _run_sharded(body: str) -> subprocess.CompletedProcess:
    return run_on_8_cpu_devices(textwrap.dedent(_SHARDED_PRELUDE) + textwrap.dedent(body))


def test_jit_grad_with_sharded_inputs_subprocess():
    proc = _run_sharded("""
        mesh = Mesh(np.array(jax.devices()), ("d",))
        check(mesh)
        print("OK")
    """)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
        f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    )


def test_grad_with_explicit_sharding_mesh_subprocess():
    # Under Explicit axes sharding is part of the type: the backward dot_generals
    # contract sharded dimensions and must name their output sharding, and
    # reduce_sum's transpose must give the cotangent back its operand's sharding.
    # Checked against jax.grad (values and output shardings), jitted and eager.
    proc = _run_sharded("""
        mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
        check(mesh)

        def model(p, x):
            h = jnp.tanh(x @ p["w1"] + p["b1"])                 # broadcast_in_dim, add
            mu = jnp.mean(h, -1, keepdims=True)                   # reduce_sum
            h = (h - mu) * jax.lax.rsqrt(jnp.mean((h - mu) ** 2, -1, keepdims=True) + 1e-5)
            z = h @ p["w2"]                          # contracts h's sharded axis in "cols"
            s = jax.nn.softmax(z, axis=-1)                        # reduce_max, exp, custom_jvp
            t = jnp.where(z > 0, z, 0.1 * z)                      # select_n
            u = jnp.sum(s * t, axis=0) + jnp.max(z, axis=0)      # reduces the batch axis
            return jnp.mean(u ** 2) + jnp.sum(jnp.sin(h)) / h.size + 0.01 * jnp.sum(p["w1"] ** 2)

        def put(a, spec):
            return jax.device_put(np.float32(a), NamedSharding(mesh, spec))

        rng = np.random.RandomState(1)
        cases = {  # name -> (w1, b1, x) specs; w2 replicated
            "rows": (P(), P(), P("d", None)),
            "cols": (P(None, "d"), P("d"), P()),
        }
        for name, (s_w1, s_b1, s_x) in cases.items():
            p = {"w1": put(rng.randn(4, 16) * 0.5, s_w1), "b1": put(rng.randn(16) * 0.1, s_b1),
                 "w2": put(rng.randn(16, 3) * 0.5, P())}
            x = put(rng.randn(32, 4), s_x)
            for mode in ("jit", "eager"):
                tg_f, jax_f = tg.grad(model, argnums=(0, 1)), jax.grad(model, argnums=(0, 1))
                if mode == "jit":
                    tg_f, jax_f = jax.jit(tg_f), jax.jit(jax_f)
                with jax.set_mesh(mesh):  # eager ops on Explicit axes need the mesh set
                    got, want = tg_f(p, x), jax_f(p, x)
                leaves = jax.tree_util.tree_leaves_with_path(got)
                for (path, g), w in zip(leaves, jax.tree.leaves(want)):
                    where = f"{name}/{mode}{jax.tree_util.keystr(path)}"
                    assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (
                        where, g.sharding.spec, w.sharding.spec)
                    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6,
                                               err_msg=where)
        # A sharded dimension really was contracted and kept in the gradient.
        assert jax.typeof(got[0]["w1"]).sharding.spec[1] == "d", got[0]["w1"].sharding
        # jnp.sum over every axis of a row-sharded array: the cotangent keeps the rows sharded.
        xr = put(rng.randn(32, 4), P("d", None))
        with jax.set_mesh(mesh):  # the cotangent is a constant: jit needs the mesh to place it
            g = jax.jit(tg.grad(lambda a: jnp.sum(a)))(xr)
            w = jax.jit(jax.grad(lambda a: jnp.sum(a)))(xr)
        assert g.sharding.is_equivalent_to(w.sharding, 2), (g.sharding, w.sharding)
        assert g.sharding.is_equivalent_to(xr.sharding, 2), g.sharding
        np.testing.assert_array_equal(np.asarray(g), np.ones((32, 4), np.float32))
        print("OK")
    """)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
        f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    )
