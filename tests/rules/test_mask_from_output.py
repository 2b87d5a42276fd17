"""A mask read off a kept output (`custom_jvp._plain`, `_rebuild.rebuilt_records`).

``jax.nn.relu``'s mask ``x > 0`` is ``relu(x) > 0``, NaN included (``relu(nan)`` is
NaN, and both comparisons are False there): where the next matmul keeps relu's output
for its weight gradient, relu keeps nothing of its own under an exact policy. Under a
lossy one that output is rounded, and the mask must stay, unless the rounding keeps
zeros zero and positives positive (`compress(bits=...)`'s zero-exact codes).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import held_after_forward

import tapegrad as tg
from tapegrad.rules._registry import RULES

SIZES = (16, 32, 32, 4)
BATCH = 8
F32, U8 = np.dtype(np.float32), np.dtype(np.uint8)
# float32 values at relu's kink and beyond: zeros of both signs, the smallest denormals,
# infinities, NaN
EDGES = [0.0, -0.0, 1e-45, -1e-45, np.inf, -np.inf, np.nan, 1.0, -1.0]


def mlp(p, x):
    h = x
    for i in range(3):
        h = h @ p[f"w{i}"] + p[f"b{i}"]
        if i < 2:
            h = jax.nn.relu(h)
    return jnp.sum(h**2)


def params():
    ks = jax.random.split(jax.random.key(0), 3)
    dims = zip(ks, SIZES[:-1], SIZES[1:])
    p = {f"w{i}": jax.random.normal(k, (a, b)) / np.sqrt(a) for i, (k, a, b) in enumerate(dims)}
    return p | {f"b{i}": jnp.zeros((b,)) for i, b in enumerate(SIZES[1:])}


def batch():
    """Row 0 is zeros: the first relu's inputs are exactly 0 there (the zero bias)."""
    x = jax.random.normal(jax.random.key(1), (BATCH, SIZES[0]))
    return x.at[0].set(0.0)


def edge_input():
    """relu's inputs directly: each edge value in every column, then random values."""
    h = jax.random.normal(jax.random.key(2), (3 * len(EDGES), SIZES[1]))
    return h.at[: len(EDGES)].set(jnp.asarray(EDGES)[:, None])


def relu_dot(h, w):
    """relu whose output the matmul keeps for ``w``'s gradient."""
    return jnp.sum(jax.nn.relu(h) @ w)


def _relus(tape):
    return [r for r in tape.records if r.params.get("name") == "relu"]


def _saves(rec):
    return [(s.kind, s.index, np.dtype(s.dtype)) for s in rec.saves]


def _equal(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # NaN == NaN here


def _equal_but_rounding(got, want):
    """Zeros where ``want`` has zeros (relu's mask, exactly) and the same values up to
    float32 rounding elsewhere (1e-6 of the leaf's largest magnitude). Bit-for-bit
    equality with eager `jax.grad` is not a property of a correct gradient: jax's own
    eager and jitted gradients of `mlp` differ in the last bits on some CPUs (13 of 512
    elements of a weight's gradient on an AMD EPYC), and tapegrad's one compiled call
    matches the jitted one there; a wrong mask differs by far more."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_array_equal(a == 0, b == 0)
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.abs(b).max()))


def _vjp_grad(f, argnums=(0, 1), policy=None):
    """Gradients through `tg.vjp`, which plans the tape (eager `tg.grad` under save()
    runs forward and backward as one compiled call, holding nothing between them)."""

    def grad(*args):
        out, vjp_fn = tg.vjp(f, *args, policy=policy)
        cts = vjp_fn(jnp.ones_like(out))
        return tuple(cts[i] for i in argnums)

    return grad


@contextlib.contextmanager
def masks_kept():
    """relu without its output form (the behaviour before `custom_jvp._plain`): it keeps
    its packed mask wherever it is. To compare against."""
    rule = RULES["custom_jvp_rule"]
    RULES["custom_jvp_rule"] = dataclasses.replace(rule, plain=None)
    tg.clear_caches()  # tapes are cached by structure
    try:
        yield
    finally:
        RULES["custom_jvp_rule"] = rule
        tg.clear_caches()


def test_relu_reads_its_mask_off_the_output_the_next_matmul_keeps():
    p, x = params(), batch()
    tape = tg.trace(mlp, argnums=(0, 1))(p, x)
    relus = _relus(tape)
    assert len(relus) == 2
    for r in relus:
        assert _saves(r) == [("out", 0, F32)]
        nxt = next(q for q in tape.records if q.index > r.index and q.primitive == "dot_general")
        assert r.outputs[0] in [nxt.inputs[s.index] for s in nxt.saves if s.kind == "in"]
    want = jax.grad(mlp, argnums=(0, 1))(p, x)
    saved = _vjp_grad(mlp)(p, x)
    _equal_but_rounding(saved, want)
    _equal_but_rounding(tg.grad(mlp, argnums=(0, 1))(p, x), want)
    _equal(jax.jit(_vjp_grad(mlp))(p, x), jax.jit(jax.grad(mlp, argnums=(0, 1)))(p, x))
    # offload is exact too: the output it moves and brings back is the output
    _equal(_vjp_grad(mlp, policy=tg.policies.offload())(p, x), saved)


def test_edge_values_give_jax_gradients():
    """0, -0.0, denormals, infinities, NaN: the mask read off relu's output is jax's."""
    h, w = edge_input(), params()["w1"]
    (r,) = _relus(tg.trace(relu_dot, argnums=(0, 1))(h, w))
    assert _saves(r) == [("out", 0, F32)]
    want = jax.grad(relu_dot, argnums=(0, 1))(h, w)
    _equal(_vjp_grad(relu_dot)(h, w), want)
    _equal(jax.jit(_vjp_grad(relu_dot))(h, w), jax.jit(jax.grad(relu_dot, argnums=(0, 1)))(h, w))
    # h's cotangent is 0 exactly where h > 0 is False (NaN rows included), g @ w.T elsewhere
    dh = np.asarray(want[0])
    assert np.all(dh[~(np.asarray(h) > 0)] == 0) and np.all(np.isfinite(dh))


def test_held_bytes_drop_by_exactly_the_masks():
    p, x = params(), batch()
    with masks_kept():
        before = held_after_forward(tg.vjp, mlp, p, x)
        report_before = tg.memory_report(mlp, argnums=(0, 1))(p, x).beyond_inputs_bytes
        tape = tg.trace(mlp, argnums=(0, 1))(p, x)
        masks = sum(s.nbytes for r in _relus(tape) for s in r.saves)
    assert masks == 2 * BATCH * 32 // 8  # two 8x32 masks, a bit an element
    after = held_after_forward(tg.vjp, mlp, p, x)
    assert before - after == masks
    report = tg.memory_report(mlp, argnums=(0, 1))(p, x).beyond_inputs_bytes
    assert (report_before, report) == (before, after)


def test_a_relu_whose_output_nobody_keeps_keeps_its_mask():
    """Input gradient only: the matmuls keep their (constant) weights, not relu's output."""
    p, x = params(), batch()
    tape = tg.trace(mlp, argnums=1)(p, x)
    assert [_saves(r) for r in _relus(tape)] == [[("aux", 0, U8)]] * 2
    _equal(_vjp_grad(mlp, argnums=(1,))(p, x)[0], jax.grad(mlp, argnums=1)(p, x))
    h, w = edge_input(), params()["w1"]
    (r,) = _relus(tg.trace(relu_dot, argnums=0)(h, w))
    assert _saves(r) == [("aux", 0, U8)]
    _equal(_vjp_grad(relu_dot, argnums=(0,))(h, w)[0], jax.grad(relu_dot)(h, w))


def test_a_relu_whose_output_is_a_tape_output():
    p, h = params(), edge_input()

    def both(w, h):  # relu's output returned and fed to the next matmul
        a = jax.nn.relu(h)
        return a, a @ w

    def alone(w, h):  # returned only: the caller holds it, no record keeps it
        return jax.nn.relu(h), jnp.sum(h) * w

    ((r,),) = [_relus(tg.trace(both, argnums=(0, 1))(p["w1"], h))]
    assert _saves(r) == [("out", 0, F32)]
    ((r,),) = [_relus(tg.trace(alone, argnums=(0, 1))(p["w1"], h))]
    assert _saves(r) == [("aux", 0, U8)]
    for f in (both, alone):
        out, vjp_fn = tg.vjp(f, p["w1"], h)
        want_out, want_fn = jax.vjp(f, p["w1"], h)
        cts = jax.tree.map(lambda o: jnp.cos(jnp.nan_to_num(o)) + 1.0, want_out)
        _equal(out, want_out)
        _equal(vjp_fn(cts), want_fn(cts))


def test_a_lossy_policy_keeps_the_mask():
    """compress(bfloat16) and compress("int8") round relu's output: small positives may
    round to 0, so the mask stays, and the gradient is the mask-keeping one, bit for bit.
    (Low-bit codes keep zeros zero and positives positive: tests/policies/
    test_compress_zero_exact.py.)"""
    p, x = params(), batch()
    for policy in (tg.policies.compress(jnp.bfloat16), tg.policies.compress("int8")):
        with masks_kept():
            want = _vjp_grad(mlp, policy=policy)(p, x)
        tape = tg.trace(mlp, argnums=(0, 1), policy=policy)(p, x)
        assert [_saves(r) for r in _relus(tape)] == [[("aux", 0, U8)]] * 2
        _equal(_vjp_grad(mlp, policy=policy)(p, x), want)


def test_a_lossy_policy_that_keeps_the_output_unchanged_reads_the_mask_off_it():
    """compress(bfloat16) keeps a bfloat16 output as it is (`keeps_exact`)."""
    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params())
    x = batch().astype(jnp.bfloat16)
    policy = tg.policies.compress(jnp.bfloat16)
    tape = tg.trace(mlp, argnums=(0, 1), policy=policy)(p, x)
    assert [_saves(r) for r in _relus(tape)] == [[("out", 0, np.dtype(jnp.bfloat16))]] * 2
    _equal(_vjp_grad(mlp, policy=policy)(p, x), _vjp_grad(mlp)(p, x))


def test_vmap_of_per_example_gradients():
    p, x = params(), batch()

    def one(p, x):
        return mlp(p, x[None])

    want = jax.vmap(jax.grad(one), in_axes=(None, 0))(p, x)
    got = jax.vmap(lambda p, x: _vjp_grad(one, argnums=(0,))(p, x)[0], in_axes=(None, 0))(p, x)
    _equal(got, want)
    h, w = edge_input(), params()["w1"]
    want = jax.vmap(jax.grad(relu_dot, argnums=(0, 1)), in_axes=(0, None))(h[:, None], w)
    _equal(jax.vmap(_vjp_grad(relu_dot), in_axes=(0, None))(h[:, None], w), want)


def test_max_by_hand_keeps_its_masks():
    """``jnp.maximum(h, 0.)`` is not relu: its derivative is 1/2 at h == 0 (a tie), 0
    below, and its output is 0 at both, so its masks are not a function of its output."""

    def f(h, w):  # sin: max's operand is not kept or rebuilt anyway (an input would be)
        return jnp.sum(jnp.maximum(jnp.sin(h), 0.0) @ w)

    h, w = edge_input(), params()["w1"]
    (mx,) = [r for r in tg.trace(f, argnums=(0, 1))(h, w).records if r.primitive == "max"]
    assert [s.kind for s in mx.saves] == ["aux", "aux"]
    _equal(_vjp_grad(f)(h, w), jax.grad(f, argnums=(0, 1))(h, w))


@pytest.mark.parametrize("slope", [0.01, -0.5])
def test_leaky_relu_keeps_its_mask(slope):
    """leaky_relu's mask ``h >= 0`` is not its output's sign: a negative slope flips it,
    and a positive one underflows -1e-45 to -0.0 (and ``-0.0 >= 0``)."""

    def f(h, w):
        return jnp.sum(jax.nn.leaky_relu(h, slope) @ w)

    h, w = edge_input(), params()["w1"]
    tape = tg.trace(f, argnums=(0, 1))(h, w)
    (sel,) = [r for r in tape.records if r.primitive == "select_n"]
    assert "out" not in [s.kind for s in sel.saves]
    _equal(_vjp_grad(f)(h, w), jax.grad(f, argnums=(0, 1))(h, w))


@pytest.mark.parametrize("op", ["max", "clamp"])
def test_a_mask_is_never_read_off_a_rounded_operand(op):
    """The same holds for an input form: ``max(h, 0.)``'s operand ``h``, kept (rounded) by
    ``sin(h)`` under compress(bits=2), is not where its masks come from. sin's cotangent
    is 0 here (``0 * ...``), so the gradient is jax's exactly when the masks are exact."""
    clip = {"max": lambda h: jnp.maximum(h, 0.0), "clamp": lambda h: jax.lax.clamp(-0.5, h, 0.5)}

    def f(x):
        h = jnp.sin(x)
        return jnp.sum(clip[op](h) * 3.0) + 0.0 * jnp.sum(jnp.sin(h))

    x = jax.random.normal(jax.random.key(3), (16, 256))
    policy = tg.policies.compress(bits=2, key=jax.random.key(5))
    (rec,) = [r for r in tg.trace(f, policy=policy)(x).records if r.primitive == op]
    assert [s.kind for s in rec.saves] == ["aux"] * len(rec.saves)
    (rec,) = [r for r in tg.trace(f)(x).records if r.primitive == op]  # exact: h is kept
    assert [s.kind for s in rec.saves] == ["in"]
    want = jax.grad(f)(x)
    _equal(_vjp_grad(f, argnums=(0,), policy=policy)(x)[0], want)
    _equal(tg.grad(f, policy=policy)(x), want)
    _equal(jax.jit(tg.grad(f, policy=policy))(x), jax.jit(jax.grad(f))(x))


@pytest.mark.parametrize("op", ["max", "clamp", "relu"])
def test_a_loop_body_never_reads_a_mask_off_a_rounded_value(op):
    """Inside a scan body as at the top: the body's records keep their masks under a
    policy that rounds the value they would read them off (compress(bits=2)), and
    switch to that value under save(), where it comes back unchanged; relu switches
    under both (its output's codes keep zeros zero, positives positive)."""
    clip = {
        "max": lambda h: jnp.maximum(h, 0.0),
        "clamp": lambda h: jax.lax.clamp(-0.5, h, 0.5),
        "relu": jax.nn.relu,
    }

    def f(xs):
        def step(c, x):
            h = 2.0 * x  # keeps nothing: the gradient is exact when the masks are
            y = clip[op](h)
            # sin(h) keeps h, the matmul keeps y (relu's output): both rounded under
            # compress, and neither gets a cotangent
            return c + jnp.sum(y * 3.0), 0.0 * (jnp.sum(jnp.sin(h)) + jnp.sum(y @ y.T))

        c, zs = jax.lax.scan(step, 0.0, xs)
        return c + jnp.sum(zs)

    xs = jax.random.normal(jax.random.key(3), (4, 16, 64))
    policy = tg.policies.compress(bits=2, key=jax.random.key(5))
    prim = "custom_jvp_rule" if op == "relu" else op

    def body_saves(tape):
        (loop,) = [r for r in tape.records if r.bodies]
        (rec,) = [r for r in loop.bodies[0].records if r.primitive == prim]
        return [s.kind for s in rec.saves]

    # relu alone reads its mask off its output's codes, which keep zeros and positives
    rounded = {"out"} if op == "relu" else {"aux"}
    assert set(body_saves(tg.trace(f, policy=policy)(xs))) == rounded
    assert "aux" not in body_saves(tg.trace(f)(xs))  # save(): off the kept value
    want = jax.grad(f)(xs)
    _equal(tg.grad(f, policy=policy)(xs), want)
    _equal(jax.jit(tg.grad(f, policy=policy))(xs), jax.jit(jax.grad(f))(xs))
    _equal(tg.grad(f)(xs), want)


def _pool(window, stride, padding):
    def pool(h):
        return jax.lax.reduce_window(
            h, -jnp.inf, jax.lax.max, (1, *window, 1), (1, *stride, 1), padding
        )

    return pool


def _pool_input():
    """relu's inputs at the edges (each edge value in whole windows and beside others,
    ties of equal values), then random values: (4, 6, 6, 3)."""
    z = jax.random.normal(jax.random.key(4), (4, 6, 6, 3))
    edges = jnp.asarray(EDGES, jnp.float32)
    z = z.at[0, :3, :3, 0].set(edges.reshape(3, 3))
    z = z.at[1].set(jnp.tile(edges[:, None, None], (1, 1, 3))[:6].reshape(6, 1, 3))
    z = z.at[2, :, :, 1].set(0.5)  # ties everywhere
    return z.at[3, :2, :2, :].set(-0.0)


@pytest.mark.parametrize(
    "window, stride, padding",
    [((2, 2), (2, 2), "VALID"), ((3, 3), (2, 2), "SAME"), ((3, 2), (2, 1), "VALID")],
)
def test_relu_before_a_max_pool_keeps_no_mask(window, stride, padding):
    """The pool keeps whether each picked element is positive, 1 bit per output, and
    relu keeps nothing (`_rebuild._relu_into_pool`): the gradient is jax.grad's, bit for
    bit, at relu's kink, with NaN, infinities, ties and overlapping windows, under
    save() and (for the input's gradient, which reads only masks and w) under lossy
    policies."""
    pool = _pool(window, stride, padding)

    def f(z, w):
        return jnp.sum(pool(jax.nn.relu(z)) @ w)

    z, w = _pool_input(), jax.random.normal(jax.random.key(5), (3, 2))
    want = jax.grad(f, argnums=(0, 1))(z, w)
    _equal(_vjp_grad(f)(z, w), want)
    _equal(tg.grad(f, argnums=(0, 1))(z, w), want)
    _equal(jax.jit(tg.grad(f, argnums=(0, 1)))(z, w), jax.jit(jax.grad(f, argnums=(0, 1)))(z, w))
    for policy in (tg.policies.compress(bits=2), tg.policies.compress("int8")):
        _equal(tg.grad(f, argnums=(0, 1), policy=policy)(z, w)[0], want[0])
    rows = list(tg.memory_report(f, argnums=(0, 1))(z, w).rows())
    assert not [r for r in rows if r.primitive == "custom_jvp_rule"]  # relu keeps nothing
    (row,) = [r for r in rows if r.primitive == "reduce_window_max"]
    assert row.saves.startswith("aux0,aux1")
    one = lambda z, w: f(z[None], w)  # noqa: E731  (vmap of per-example gradients)
    _equal(
        jax.vmap(tg.grad(one, argnums=(0, 1)), in_axes=(0, None))(z, w),
        jax.vmap(jax.grad(one, argnums=(0, 1)), in_axes=(0, None))(z, w),
    )


def test_relu_keeps_its_mask_before_a_pool_as_large_as_its_input_or_read_twice():
    def same(z):  # stride 1, SAME: as many outputs as inputs, no bits to save
        return jnp.sum(jnp.sin(_pool((3, 3), (1, 1), "SAME")(jax.nn.relu(z))))

    def twice(z):  # relu's output read by the pool and by the sum
        h = jax.nn.relu(z)
        return jnp.sum(jnp.sin(_pool((2, 2), (2, 2), "VALID")(h))) + jnp.sum(h * 2.0)

    z = _pool_input()
    for fn in (same, twice):
        rows = tg.memory_report(fn)(z).rows()
        assert [r.saves for r in rows if r.primitive == "custom_jvp_rule"] == ["aux0"]
        _equal(tg.grad(fn)(z), jax.grad(fn)(z))
