"""``custom_jvp`` calls against jax: differentiated by their JVP rule, linearized and
transposed at trace time (tapegrad/rules/custom_jvp.py).

Every gradient is compared with ``jax.grad`` on the same function (float32 rtol 2e-5,
float64 rtol 1e-10), eagerly, under ``jax.jit``, ``jax.vmap``, second order and with
residual policies. The structure tests check that the records keep the rule's
residuals (``relu``: a bool mask) and compare the bytes kept with ``jax.vjp``'s.
"""

from __future__ import annotations

from functools import partial

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import tapegrad as tg
from tests.conftest import assert_trees_close, enable_x64, rand

RTOL = {"float32": 2e-5, "float64": 1e-10}
ATOL = {"float32": 1e-6, "float64": 1e-12}


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
    """The float dtype of a case; float64 cases run with x64 enabled, restored after."""
    with enable_x64(request.param == "float64"):
        yield request.param


def check_grad(f, *args, argnums=0, rtol=None, atol=None):
    """tg.grad == jax.grad, at the dtype of the first argument; returns tapegrad's."""
    dt = str(jnp.result_type(args[0]))
    got = tg.grad(f, argnums=argnums)(*args)
    want = jax.grad(f, argnums=argnums)(*args)
    assert_trees_close(got, want, rtol=rtol or RTOL[dt], atol=atol or ATOL[dt])
    return got


def records_of(f, *args, argnums=0):
    return tg.trace(f, argnums=argnums)(*args).records


# ---------------------------------------------------------------------------
# custom_jvp functions


@jax.custom_jvp
def twice_slope(x):
    """Primal: x. Rule: tangent 2 t (the rule, not the primal, defines the derivative)."""
    return x


twice_slope.defjvp(lambda p, t: (p[0], 2.0 * t[0]))


@jax.custom_jvp
def odd_sin(x):
    return jnp.sin(x)


@odd_sin.defjvp
def _odd_sin_jvp(p, t):
    (x,), (tx,) = p, t
    return odd_sin(x), (3.0 * jnp.cos(x) + 1.0) * tx  # not cos(x)


@jax.custom_jvp
def two_in_two_out(x, y):
    return x * y, jnp.sin(x) + y


@two_in_two_out.defjvp
def _two_jvp(p, t):
    (x, y), (tx, ty) = p, t
    return two_in_two_out(x, y), (10.0 * y * tx + x * ty, jnp.cos(x) * tx + 3.0 * ty)


@partial(jax.custom_jvp, nondiff_argnums=(0,))
def power(n, x):
    return x**n


@power.defjvp
def _power_jvp(n, p, t):
    (x,), (tx,) = p, t
    return power(n, x), 1.5 * n * x ** (n - 1) * tx


_W = np.array([1.0, -2.0, 3.0, 0.5, 2.0])


@jax.custom_jvp
def closes_over(x):
    return jnp.asarray(_W, x.dtype) * jnp.sin(x)


closes_over.defjvp(
    lambda p, t: (closes_over(p[0]), 2.0 * jnp.asarray(_W, p[0].dtype) * jnp.cos(p[0]) * t[0])
)


@jax.custom_jvp
def sym_mul(x, y):
    return x * y


def _sym_mul_jvp(p, t):
    (x, y), (tx, ty) = p, t
    out = jnp.zeros_like(x)
    if type(tx) is not jax.custom_derivatives.SymbolicZero:
        out = out + 2.0 * y * tx
    if type(ty) is not jax.custom_derivatives.SymbolicZero:
        out = out + 3.0 * x * ty
    return sym_mul(x, y), out


sym_mul.defjvp(_sym_mul_jvp, symbolic_zeros=True)


@jax.custom_jvp
def square(x):
    return x * x


# Residual: the input (written t * x * 2: with 2 * x * t the residual would be 2 * x).
square.defjvp(lambda p, t: (square(p[0]), t[0] * p[0] * 2.0))


@jax.custom_jvp
def my_exp(x):
    return jnp.exp(x)


@my_exp.defjvp
def _my_exp_jvp(p, t):
    ans = my_exp(p[0])
    return ans, ans * t[0]  # residual: the output


@jax.custom_jvp
def outer_of_inner(x):
    return jax.nn.relu(jnp.sin(x))


@outer_of_inner.defjvp
def _ooi_jvp(p, t):
    (x,), (tx,) = p, t
    # A rule that itself calls custom_jvp functions (relu, softplus) on primals and tangents'
    # coefficients: nested custom_jvp inside a custom_jvp rule.
    return outer_of_inner(x), jax.nn.softplus(x) * jax.nn.relu(jnp.cos(x)) * tx


# ---------------------------------------------------------------------------
# Gradients against jax.grad

X5 = (5,)


def _x(dtype, seed=0, shape=X5):
    return rand(shape, dtype, -2.0, 2.0, seed=seed)


UNARY = {
    "relu": jax.nn.relu,
    "relu6": lambda x: jax.nn.relu6(3.0 * x),
    "leaky_relu": jax.nn.leaky_relu,
    "gelu_erf": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": jax.nn.gelu,
    "softplus": jax.nn.softplus,
    "silu": jax.nn.silu,
    "softmax": jax.nn.softmax,
    "logaddexp": lambda x: jnp.logaddexp(x, 0.5 * x),
    "twice_slope": twice_slope,
    "odd_sin": odd_sin,
    "power": partial(power, 3),
    "closes_over": closes_over,
    "square": square,
    "my_exp": my_exp,
    "outer_of_inner": outer_of_inner,
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_grad_matches_jax(name, dtype):
    act = UNARY[name]
    x = _x(dtype, seed=1)
    check_grad(lambda x: jnp.sum(act(x) * jnp.cos(x)), x)


@pytest.mark.parametrize("name", ["relu", "relu6", "leaky_relu", "softplus", "twice_slope"])
def test_grad_at_kinks(name, dtype):
    # relu at exactly 0 (jax's rule: 0), relu6 at 0 and 6, ...: the rule's value, not
    # the primal's (max's derivative at a tie is 1/2).
    x = jnp.asarray([0.0, -0.0, 2.0, 6.0, -1.0], dtype)
    act = UNARY[name]
    g = check_grad(lambda x: jnp.sum(act(x)), x)
    if name == "relu":
        np.testing.assert_array_equal(np.asarray(g), [0.0, 0.0, 1.0, 1.0, 0.0])


def test_the_rule_defines_the_derivative():
    x = _x("float32", seed=2)
    g = check_grad(lambda x: jnp.sum(twice_slope(x)), x)
    np.testing.assert_array_equal(np.asarray(g), np.full(X5, 2.0, np.float32))
    g = check_grad(lambda x: jnp.sum(odd_sin(x) * x), x)
    honest = jax.grad(lambda x: jnp.sum(jnp.sin(x) * x))(x)
    assert not np.allclose(g, honest)


@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
def test_two_inputs_two_outputs(argnums, dtype):
    x, y = _x(dtype, 3), _x(dtype, 4)

    def f(x, y):
        a, b = two_in_two_out(x, y)
        return jnp.sum(a**2 + jnp.sin(b) * x)

    check_grad(f, x, y, argnums=argnums)


@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
def test_symbolic_zeros(argnums, dtype):
    x, y = _x(dtype, 5), _x(dtype, 6)
    check_grad(lambda x, y: jnp.sum(jnp.tanh(sym_mul(x, y))), x, y, argnums=argnums)


def test_vjp_and_value_match_jax(dtype):
    x, y = _x(dtype, 7), _x(dtype, 8)
    f = lambda x, y: two_in_two_out(jax.nn.softplus(x), jax.nn.relu(y))  # noqa: E731
    out, vjp_fn = tg.vjp(f, x, y)
    want_out, want_vjp = jax.vjp(f, x, y)
    ct = (_x(dtype, 9), _x(dtype, 10))
    assert_trees_close(out, want_out, rtol=RTOL[dtype], atol=ATOL[dtype])
    assert_trees_close(vjp_fn(ct), want_vjp(ct), rtol=RTOL[dtype], atol=ATOL[dtype])


# ---------------------------------------------------------------------------
# Under transformations


def _loss(x):
    h = jax.nn.relu(x) * twice_slope(jnp.sin(x))
    return jnp.sum(jax.nn.softplus(h) * odd_sin(x) + square(h))


def test_under_jit(dtype):
    x = _x(dtype, 11)
    got = jax.jit(tg.grad(_loss))(x)
    assert_trees_close(got, jax.grad(_loss)(x), rtol=RTOL[dtype], atol=ATOL[dtype])


def test_under_vmap(dtype):
    xs = rand((3, 5), dtype, -2.0, 2.0, seed=12)
    got = jax.vmap(tg.grad(_loss))(xs)
    assert_trees_close(got, jax.vmap(jax.grad(_loss))(xs), rtol=RTOL[dtype], atol=ATOL[dtype])
    got = tg.grad(lambda xs: jnp.sum(jax.vmap(_loss)(xs)))(xs)  # vmap inside: batched rules
    assert_trees_close(got, jax.grad(lambda xs: jnp.sum(jax.vmap(_loss)(xs)))(xs))


SECOND_ORDER = {
    "relu_cubed": lambda x: jnp.sum(jax.nn.relu(x) ** 3),
    "softplus": lambda x: jnp.sum(jax.nn.softplus(x) ** 2),
    "softmax": lambda x: jnp.sum(jax.nn.softmax(x) * jnp.sin(x)),
    # jax differentiates the rule's primal output as written (here: x) at the outer level.
    "twice_slope": lambda x: jnp.sum(twice_slope(x) ** 2),
    "odd_sin": lambda x: jnp.sum(odd_sin(x) * x),
    "outer_of_inner": lambda x: jnp.sum(outer_of_inner(x) ** 2),
    "loss": _loss,
}


@pytest.mark.parametrize("name", sorted(SECOND_ORDER))
def test_grad_of_grad(name, dtype):
    f = SECOND_ORDER[name]
    x = _x(dtype, 13)

    def gsum(grad):
        return lambda x: jnp.sum(jnp.sin(grad(f)(x)))

    want = jax.grad(gsum(jax.grad))(x)
    assert_trees_close(tg.grad(gsum(tg.grad))(x), want, rtol=RTOL[dtype], atol=ATOL[dtype])
    # Mixed: jax differentiating tapegrad's gradient.
    assert_trees_close(jax.grad(gsum(tg.grad))(x), want, rtol=RTOL[dtype], atol=ATOL[dtype])


def test_under_checkpoint(dtype):
    x = _x(dtype, 14)
    f = lambda x: jnp.sum(jax.checkpoint(_loss)(x) * x)  # noqa: E731
    check_grad(f, x)
    names = jax.checkpoint_policies.save_only_these_names("h")
    body = lambda x: jax.nn.relu(checkpoint_name(x * 2.0, "h")) * x  # noqa: E731
    check_grad(lambda x: jnp.sum(jax.checkpoint(body, policy=names)(x)), x)


def test_in_a_scan(dtype):
    w = rand((5, 5), dtype, -1.0, 1.0, seed=15)
    x = _x(dtype, 16)

    def f(w, x):
        h, _ = lax.scan(
            lambda c, _: (jax.nn.relu(c @ w) + jax.nn.softplus(c), None), x, None, length=3
        )
        return jnp.sum(h**2)

    check_grad(f, w, x, argnums=(0, 1))


def test_closing_over_a_traced_value_keeps_the_generic_rule():
    # The rule closes over `w`, a tracer of the enclosing jit: it cannot be split outside
    # that trace, so the call keeps the generic custom_jvp rule (jax.vjp in backward).
    def f(x, w):
        @jax.custom_jvp
        def h(x):
            return w * jnp.sin(x)

        h.defjvp(lambda p, t: (h(p[0]), 3.0 * w * t[0]))
        return jnp.sum(h(x) ** 2)

    x, w = _x("float32", 17), _x("float32", 18)
    assert_trees_close(jax.jit(tg.grad(f))(x, w), jax.jit(jax.grad(f))(x, w))
    assert_trees_close(tg.grad(f)(x, w), jax.grad(f)(x, w))


# ---------------------------------------------------------------------------
# Residual policies


def _mlp_loss(ws, x):
    h = x
    for w in ws:
        h = jax.nn.softplus(jax.nn.relu(h @ w) - 0.1)
    return jnp.sum(h**2)


def _mlp_args(dtype="float32", width=16, depth=3, batch=4):
    ws = [rand((width, width), dtype, -0.5, 0.5, seed=20 + i) for i in range(depth)]
    return ws, rand((batch, width), dtype, -1.0, 1.0, seed=30)


@pytest.mark.parametrize(
    "policy, rtol",
    [
        (lambda: tg.policies.offload(), 2e-5),
        # bfloat16 keeps 8 mantissa bits of every float residual.
        (lambda: tg.policies.compress(jnp.bfloat16), 5e-2),
    ],
    ids=["offload", "compress_bf16"],
)
def test_policies(policy, rtol):
    ws, x = _mlp_args()
    got = tg.grad(_mlp_loss, argnums=(0, 1), policy=policy())(ws, x)
    want = jax.grad(_mlp_loss, argnums=(0, 1))(ws, x)
    assert_trees_close(got, want, rtol=rtol, atol=rtol)
    got = jax.jit(tg.grad(_mlp_loss, argnums=(0, 1), policy=policy()))(ws, x)
    assert_trees_close(got, want, rtol=rtol, atol=rtol)


def test_saved_tensors_hooks_see_every_residual_once():
    ws, x = _mlp_args()
    packed, unpacked = [], []

    def pack(a):
        packed.append((a.shape, a.dtype))
        return a

    def unpack(a):
        unpacked.append(a.shape)
        return a

    with tg.saved_tensors_hooks(pack, unpack):
        got = tg.grad(_mlp_loss, argnums=(0, 1))(ws, x)
    assert_trees_close(got, jax.grad(_mlp_loss, argnums=(0, 1))(ws, x))
    tape = tg.trace(_mlp_loss, argnums=(0, 1))(ws, x)
    assert len(packed) == len(tape.residual_vars()) == len(unpacked)
    # relu's masks went through the hooks like any other residual.
    assert sum(dt == jnp.bool_ for _, dt in packed) == len(ws)


# ---------------------------------------------------------------------------
# Structure: what the records keep


def _relu_mlp(ws, x):
    h = x
    for w in ws:
        h = jax.nn.relu(h @ w)
    return jnp.sum(h)


def _relu_records(tape):
    return [r for r in tape.records if r.params.get("name") == "relu"]


def test_relu_records_keep_a_packed_mask():
    """Each relu keeps its own mask, bit-packed (32 bools a row in 4 bytes), where the next
    matmul keeps relu's output only as a rounded value (`compress("int8")`): a mask read
    off that output would be wrong where small positives round to 0."""
    ws, x = _mlp_args(width=32, depth=4, batch=8)
    policy = tg.policies.compress("int8")
    tape = tg.trace(_relu_mlp, argnums=(0, 1), policy=policy)(ws, x)
    relus = _relu_records(tape)
    assert len(relus) == len(ws)
    assert not any(r.rule in ("custom_jvp", "fallback") for r in tape.records)
    for r in relus:
        assert r.primitive == "custom_jvp_rule" and r.rule == "linearized"
        assert [(s.kind, s.shape, s.dtype) for s in r.saves] == [
            ("aux", (8, 4), np.dtype(np.uint8))
        ]


def test_relu_reads_its_mask_off_a_kept_output():
    """Under save() the mask (x > 0 == relu(x) > 0) is read off relu's output where the
    next matmul keeps that output anyway (`custom_jvp._plain`, `_rebuild.rebuilt_records`)."""
    ws, x = _mlp_args(width=32, depth=4, batch=8)
    tape = tg.trace(_relu_mlp, argnums=(0, 1))(ws, x)
    relus = _relu_records(tape)
    for r in relus[:-1]:
        assert [(s.kind, s.shape, s.dtype) for s in r.saves] == [
            ("out", (8, 32), np.dtype("float32"))
        ]
        nxt = next(q for q in tape.records if q.index > r.index and q.primitive == "dot_general")
        assert r.outputs[0] in [nxt.inputs[s.index] for s in nxt.saves if s.kind == "in"]
    # the last relu's output is only summed: nobody keeps it, its own mask is smaller
    assert [(s.kind, s.shape, s.dtype) for s in relus[-1].saves] == [
        ("aux", (8, 4), np.dtype(np.uint8))
    ]
    f = lambda ws, x: _relu_mlp(ws, x)  # noqa: E731
    out, vjp_fn = tg.vjp(f, ws, x)
    chex.assert_trees_all_close(vjp_fn(1.0), jax.vjp(f, ws, x)[1](1.0), rtol=1e-5)


def test_residuals_that_are_inputs_or_outputs_are_shared():
    x = _x("float32", 40)
    # square's rule reads its input, my_exp's its output: saved as those values, so the
    # next records saving the same values add nothing.
    tape = tg.trace(lambda x: jnp.sum(jnp.sin(square(x)) + jnp.sin(x) * my_exp(x)))(x)
    (sq,) = [r for r in tape.records if r.params.get("name") == "square"]
    (ex,) = [r for r in tape.records if r.params.get("name") == "my_exp"]
    assert [s.kind for s in sq.saves] == ["in"] and [s.kind for s in ex.saves] == ["out"]
    sin_x = next(r for r in tape.records if r.primitive == "sin" and r.inputs[0] is sq.inputs[0])
    assert sq.residual_key(sq.saves[0]) == sin_x.residual_key(sin_x.saves[0])
    # relu's zeros (input-independent) are recomputed in backward, never kept.
    tape = tg.trace(lambda x: jnp.sum(jax.nn.relu(x)))(x)
    assert tape.saved_bytes == x.size  # one bool per element


def test_an_inactive_call_keeps_nothing_and_runs_the_call():
    x, y = _x("float32", 41), _x("float32", 42)
    f = lambda x, y: jnp.sum(jax.nn.relu(y) * x)  # noqa: E731
    tape = tg.trace(f, argnums=0)(x, y)
    (r,) = _relu_records(tape)
    assert r.rule == "none" and not r.saves
    check_grad(f, x, y)


def test_relu_mlp_keeps_less_than_jax_vjp():
    """8 layers, 256 wide, batch 128, weights differentiated (the DESIGN.md measurement).

    jax.vjp keeps 34 activations' worth: every layer's input (8), the weights (16), a
    float32 zeros array (8) and a bool mask (2) per relu. tapegrad keeps the inputs, the
    weights and the masks: 26, a ratio of 0.765. The 0.6 asked for is out of reach here:
    the weights and the layer inputs (24 of jax's 34, kept by any reverse mode) already
    make 0.706. On the per-activation residuals (all but the weights) the ratio is
    10 / 18 = 0.56.
    """
    key = jax.random.PRNGKey(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (256, 256)) * 0.1 for i in range(8)]
    x = jax.random.normal(key, (128, 256))
    _, f_vjp = jax.vjp(_relu_mlp, ws, x)
    jax_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(f_vjp))
    tape = tg.trace(_relu_mlp, argnums=(0, 1))(ws, x)
    w_bytes = sum(w.nbytes for w in ws)
    ratio = tape.saved_bytes / jax_bytes
    act_ratio = (tape.saved_bytes - w_bytes) / (jax_bytes - w_bytes)
    assert ratio <= 0.77, ratio
    assert act_ratio <= 0.6, act_ratio
    assert_trees_close(
        tg.grad(_relu_mlp, argnums=(0, 1))(ws, x),
        jax.grad(_relu_mlp, argnums=(0, 1))(ws, x),
        rtol=2e-5,
        atol=1e-5,
    )
