"""compress(bits="auto", budget_bits=...).fit(f, *args): the allocation is the exact
optimum of its model (brute force), gives more bits where rounding moves the gradient
more (and so a smaller gradient error than a uniform width at no more bytes), holds
the bytes it says (live arrays, memory_report) within the budget, and runs eagerly,
under jit, vmap and in scans."""

from __future__ import annotations

import importlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import live_bytes_by_kind, tanh_mlp

import tapegrad as tg
from tapegrad import policies as P

A = importlib.import_module("tapegrad.policies._allocate")


def relu_mlp(ws, x):
    # ReLU as a select (an exact boolean mask; backward linear in the dots' inputs).
    for w in ws[:-1]:
        z = x @ w
        x = jnp.where(z > 0, z, 0.0)
    return jnp.sum((x @ ws[-1]) ** 2) / x.shape[0]


def two_branches(ws, xs):
    # Two tanh outputs; the small one's rounding error reaches the gradient 100x
    # amplified (its loss term is scaled by 100).
    a = jnp.tanh(xs[0] @ ws[0])
    b = jnp.tanh(xs[1] @ ws[1])
    return 100.0 * jnp.sum(a**2) + jnp.sum(b**2)


def rel_err(got, want) -> float:
    num = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(got, want))
    return (num / sum(float(jnp.sum(b**2)) for b in want)) ** 0.5


def mlp_args(width=128, batch=64, layers=4):
    ks = jax.random.split(jax.random.key(0), layers + 1)
    ws = [jax.random.normal(k, (width, width)) / np.sqrt(width) for k in ks[:layers]]
    return ws, jax.random.normal(ks[layers], (batch, width))


def test_bad_arguments_and_a_missing_fit_are_clear_errors():
    with pytest.raises(ValueError, match="budget_bits="):
        P.compress(bits="auto")
    with pytest.raises(ValueError, match="at least 2"):
        P.compress(bits="auto", budget_bits=1.5)
    with pytest.raises(ValueError, match="goes with bits='auto'"):
        P.compress(bits=4, budget_bits=3)
    with pytest.raises(ValueError, match="only compress\\(bits='auto'"):
        P.compress(bits=4).fit(tanh_mlp, *mlp_args())
    with pytest.raises(TypeError, match="BitAllocation"):
        P.compress(bits="auto", allocation={"#1 out0": 4})
    ws, x = mlp_args(32, 8, 2)
    with pytest.raises(ValueError, match=r"no bit allocation yet: call policy = policy.fit"):
        tg.grad(tanh_mlp, policy=P.compress(bits="auto", budget_bits=3))(ws, x)
    fitted = P.compress(bits="auto", budget_bits=3).fit(tanh_mlp, ws, x)
    with pytest.raises(ValueError, match="was not seen by fit"):  # another function
        tg.grad(lambda ws, x: tanh_mlp(ws + ws, x), policy=fitted)(ws, x)


def test_allocation_is_the_optimum_of_its_model():
    # Brute force over every width on small problems: the program finds the least
    # predicted error within the budget.
    rng = np.random.default_rng(0)
    S = A.rounding_variance
    for _ in range(60):
        r = int(rng.integers(2, 6))
        c = np.exp(rng.normal(0, 3, r))
        n = rng.integers(1, 40, r) * 128
        budget = float(rng.uniform(2, 9))
        got = A.allocate(list(c), list(n), budget, [32] * r)
        assert np.dot(got, n) <= budget * n.sum()

        def err(bs):
            return sum(ci * S(b) for ci, b in zip(c, bs))

        fits = [bs for bs in itertools.product((2, 4, 8, 32), repeat=r)]
        best = min(err(bs) for bs in fits if np.dot(bs, n) <= budget * n.sum())
        assert err(got) <= best * (1 + 1e-9), (got, c, n, budget)
    # By hand: equal sizes, one residual 100x as sensitive, 3 bits a value: it gets 4.
    assert A.allocate([100.0, 1.0], [256, 256], 3.0, [32, 32]) == [4, 2]
    assert A.allocate([0.0, 0.0], [256, 256], 8.0, [32, 32]) == [2, 2]  # nothing to buy


def test_sensitive_residual_gets_more_bits_and_a_smaller_error_than_uniform():
    ks = jax.random.split(jax.random.key(1), 4)
    ws = (jax.random.normal(ks[0], (128, 128)) / 11, jax.random.normal(ks[1], (256, 256)) / 16)
    xs = (jax.random.normal(ks[2], (64, 128)), jax.random.normal(ks[3], (64, 256)))
    fitted = P.compress(bits="auto", budget_bits=4).fit(two_branches, ws, xs)
    alloc = fitted.allocation
    a, b = alloc.rows  # the two tanh outputs (the dots' inputs are the function's own)
    assert (a.shape, b.shape) == ((64, 128), (64, 256))
    # a's error reaches the gradient 100x amplified: ~10^4 x the squared error of b
    # (twice a's size, so ~2x a's own error unamplified).
    assert a.sensitivity > 1000 * b.sensitivity
    assert (a.bits, b.bits) == (8, 2)  # 8 * 1/3 + 2 * 2/3 = 4 bits a value
    assert alloc.average_bits == 4

    ref = jax.grad(two_branches)(ws, xs)

    def mse(policy_of):
        def one(k):
            g = tg.grad(two_branches, policy=policy_of(k))(ws, xs)
            return sum(jnp.sum((u - v) ** 2) for u, v in zip(g, ref))

        return float(jnp.mean(jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(2), 8))))

    auto = mse(lambda k: P.compress(bits="auto", allocation=alloc, key=k))
    uniform = mse(lambda k: P.compress(bits=4, key=k))  # 4 bits a value too
    assert auto < uniform / 10, (auto, uniform)
    # The model's prediction, sum_r c_r S(b_r), is the error measured.
    assert 0.5 < auto / alloc.predicted_error < 2, (auto, alloc.predicted_error)
    held_auto = tg.memory_report(two_branches, policy=fitted)(ws, xs).beyond_inputs_bytes
    held_uniform = tg.memory_report(two_branches, policy=P.compress(bits=4))(ws, xs)
    assert held_auto <= held_uniform.beyond_inputs_bytes


def held_beyond_inputs(f, args, policy) -> int:
    before = live_bytes_by_kind()
    out, vjp_fn = tg.vjp(f, *args, policy=policy)
    jax.block_until_ready(out)
    grown = sum(live_bytes_by_kind().values()) - sum(before.values()) - out.nbytes
    vjp_fn(jnp.ones_like(out))
    return grown


@pytest.mark.parametrize("budget", [2.5, 3.0, 5.0])
def test_bytes_held_respect_the_budget_and_match_the_report(budget):
    ws, x = mlp_args()
    fitted = P.compress(bits="auto", budget_bits=budget).fit(tanh_mlp, ws, x, argnums=(0, 1))
    alloc = fitted.allocation
    assert len(alloc.rows) == 4 and alloc.average_bits <= budget
    saved = held_beyond_inputs(tanh_mlp, (ws, x), P.save())
    held = held_beyond_inputs(tanh_mlp, (ws, x), fitted)
    values = sum(r.values for r in alloc.rows)
    assert saved == 4 * values  # the four tanh outputs, float32
    # Per 128 values: 16 * bits bytes of codes and a bfloat16 min and scale.
    want = sum(r.values // 128 * (16 * r.bits + 4) for r in alloc.rows)
    assert held == want
    assert held <= budget / 32 * saved + 4 * values // 128
    rep = tg.memory_report(tanh_mlp, argnums=(0, 1), policy=fitted)(ws, x)
    assert rep.beyond_inputs_bytes == held
    assert rep.bits == alloc.bits and rep.average_bits == pytest.approx(alloc.average_bits)
    # Each tanh row shows its own width; the text and HTML reports carry them.
    rows = {r.index: r.bits for r in rep.records if r.primitive == "tanh"}
    assert rows == {int(n[1:].split()[0]): str(b) for n, b in alloc.bits.items()}
    text, html = str(rep), rep._repr_html_()
    assert f"bits: {alloc.average_bits:.2f} a value on average (budget {budget:g})" in text
    head = next(line for line in text.splitlines() if "primitive" in line)
    assert head.split()[-2:] == ["bits", "source"]
    assert 'data-key="average_bits"' in html
    assert f"compress {rows[min(rows)]} bits" in html


def test_gradients_close_to_jax_grad_eagerly_and_under_jit():
    ws, x = mlp_args(64, 32)
    ref = jax.grad(relu_mlp)(ws, x)
    for budget, tol in ((6.0, 0.05), (3.0, 0.5)):  # the low-bit tests': 8 and 2 bits
        fitted = P.compress(bits="auto", budget_bits=budget, key=3).fit(relu_mlp, ws, x)
        eager = tg.grad(relu_mlp, policy=fitted)(ws, x)
        jitted = jax.jit(tg.grad(relu_mlp, policy=fitted))(ws, x)
        assert 0 < rel_err(eager, ref) < tol, (budget, rel_err(eager, ref))
        for a, b in zip(eager, jitted):  # the same noise, eagerly and compiled
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_vmap_over_examples():
    ws, x = mlp_args(64, 16, 3)
    fitted = P.compress(bits="auto", budget_bits=5).fit(relu_mlp, ws, x[:1], argnums=1)
    per_example = jax.vmap(tg.grad(relu_mlp, argnums=1, policy=fitted), (None, 0))
    got = per_example(ws, x[:, None])
    want = jax.vmap(jax.grad(relu_mlp, argnums=1), (None, 0))(ws, x[:, None])
    assert 0 < rel_err([got], [want]) < 0.05


def rnn(w, xs):
    def step(h, xt):
        h = jnp.tanh(h @ w + xt)
        return h, h

    _, hs = jax.lax.scan(step, jnp.zeros((8, 64)), xs)
    return jnp.sum(hs**2)


def test_residuals_inside_a_scan_body_and_a_scan_of_gradients():
    ks = jax.random.split(jax.random.key(0), 2)
    w = jax.random.normal(ks[0], (64, 64)) / 8
    xs = jax.random.normal(ks[1], (6, 8, 64))
    fitted = P.compress(bits="auto", budget_bits=6).fit(rnn, w, xs)
    alloc = fitted.allocation
    inside = [r for r in alloc.rows if "/" in r.name]  # named by the loop and the record
    assert {r.primitive for r in inside} == {"dot_general", "tanh"}
    assert all(r.values == 6 * np.prod(r.shape) for r in inside)  # x the trip count
    ref = jax.grad(rnn)(w, xs)
    # (Eagerly a step's carry input shares the step before's packed output, under jit it
    # is packed on its own: the noise differs, both are close.) The low-bit tests' tanh
    # bound at 4 bits: tanh reads 1 - y**2 off its rounded output.
    for g in (tg.grad(rnn, policy=fitted)(w, xs), jax.jit(tg.grad(rnn, policy=fitted))(w, xs)):
        assert 0 < rel_err([g], [ref]) < 0.25
    rep = tg.memory_report(rnn, policy=fitted)(w, xs)
    assert rep.bits == alloc.bits
    body = {r.index: r.bits for top in rep.records for r in top.body}
    tanh = next(r for r in alloc.rows if r.primitive == "tanh")
    assert body[int(tanh.name.split("/#")[1].split()[0])] == str(tanh.bits)

    # tg.grad of the fitted policy inside a scan over batches, as a training loop runs.
    batches = jnp.stack([xs, xs[::-1]])

    def loop(w, batches):
        def body(c, b):
            return c, tg.grad(rnn, policy=fitted)(w, b)

        return jax.lax.scan(body, None, batches)[1]

    got = jax.jit(loop)(w, batches)
    want = jax.vmap(jax.grad(rnn), (None, 0))(w, batches)
    assert 0 < rel_err([got], [want]) < 0.25
    np.testing.assert_allclose(got[0], jax.jit(tg.grad(rnn, policy=fitted))(w, xs), rtol=1e-5)
