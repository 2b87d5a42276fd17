"""Dropout keeps the key, not the mask (issue 16): under an exact policy, a mask drawn
from a kept key is rebuilt in backward (`_rebuild.rebuilt_records`), and ``select_n``
keeps its predicate operand, rebuilt, instead of a bit-packed copy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, rand
from conftest import held_after_forward as _held

import tapegrad as tg
from tapegrad.engine import rebuild as _rebuild

RATE = 0.25
KEYS = {"typed": jax.random.key, "raw": jax.random.PRNGKey}


def dropout(key, h):
    keep = jax.random.bernoulli(key, 1 - RATE, h.shape)
    return jnp.where(keep, h / (1 - RATE), 0.0)


def mlp(p, x, key):
    k1, k2 = jax.random.split(key)
    h = dropout(k1, jnp.tanh(x @ p["w1"]))
    h = dropout(k2, jnp.tanh(h @ p["w2"]))
    return jnp.sum(h**2)


def params():
    return {"w1": rand((32, 64), seed=1) / 6, "w2": rand((64, 64), seed=2) / 8}


def _masks(tape) -> list:
    return [s for r in tape.records for s in r.saves if s.kind == "aux"]


@pytest.mark.parametrize("kind", sorted(KEYS))
def test_no_mask_is_kept_and_the_draw_is_rebuilt(kind):
    p, x, key = params(), rand((16, 32), seed=0), KEYS[kind](3)
    tape = tg.trace(mlp, argnums=(0, 1))(p, x, key)
    assert _masks(tape) == []
    bits = [r for r in tape.records if r.primitive == "random_bits"]
    assert len(bits) == 2 and all(r.decision == "recompute" for r in bits)
    kept, _ = tape.residual_keys()
    # Beside the inputs: tanh's float outputs, and the split keys (a few bytes each; raw,
    # as the two keys wrapped for the draws).
    inputs = {v.id for v in tape.inputs}
    held = sorted((str(v.dtype), v.shape) for k, v in kept.items() if k not in inputs)
    keys = [("key<fry>", (2,))] if kind == "typed" else [("key<fry>", ())] * 2
    assert held == sorted([("float32", (16, 64))] * 2 + keys)
    # Under a lossy policy too: compress hands the keys back unchanged (it rounds floats
    # only), so the draws are rebuilt from them and no mask is kept.
    lossy = tg.trace(mlp, argnums=(0, 1), policy=tg.policies.compress(jnp.bfloat16))(p, x, key)
    assert _masks(lossy) == []
    bits = [r for r in lossy.records if r.primitive == "random_bits"]
    assert len(bits) == 2 and all(r.decision == "recompute" for r in bits)
    # A policy that changes what it is given (hooks) rebuilds nothing: the masks stay packed.
    hooks = tg.policies.hooks(lambda v: v, lambda v: v)
    lossy = tg.trace(mlp, argnums=(0, 1), policy=hooks)(p, x, key)
    assert [np.dtype(s.dtype) for s in _masks(lossy)] == [np.uint8, np.uint8]


@pytest.mark.parametrize("kind", sorted(KEYS))
def test_gradients_equal_jax_everywhere(kind):
    p, x, key = params(), rand((16, 32), seed=0), KEYS[kind](3)
    want = jax.grad(mlp, argnums=(0, 1))(p, x, key)
    out, vjp_fn = tg.vjp(mlp, p, x, key)
    assert_trees_close(vjp_fn(jnp.ones_like(out))[:2], want, rtol=1e-6, atol=1e-6)
    assert_trees_close(tg.grad(mlp, argnums=(0, 1))(p, x, key), want, rtol=1e-6, atol=1e-6)
    assert_trees_close(jax.jit(tg.grad(mlp, argnums=(0, 1)))(p, x, key), want, rtol=1e-6, atol=1e-6)
    # offload: eager tg.grad runs forward and backward apart, rebuilding the masks
    got = tg.grad(mlp, argnums=(0, 1), policy=tg.policies.offload())(p, x, key)
    assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
    keys = jax.vmap(KEYS[kind])(jnp.arange(3))

    def vjp_grad(p, x, key):  # tg.vjp plans with the rebuilds; fused tg.grad does not
        out, vjp_fn = tg.vjp(mlp, p, x, key)
        return vjp_fn(jnp.ones_like(out))[0]

    assert_trees_close(jax.jit(vjp_grad)(p, x, key), want[0], rtol=1e-6, atol=1e-6)
    assert_trees_close(
        jax.vmap(vjp_grad, (None, None, 0))(p, x, keys),
        jax.vmap(jax.grad(mlp), (None, None, 0))(p, x, keys),
        rtol=1e-6,
        atol=1e-6,
    )
    assert_trees_close(
        jax.vmap(tg.grad(mlp, argnums=0), (None, None, 0))(p, x, keys),
        jax.vmap(jax.grad(mlp, argnums=0), (None, None, 0))(p, x, keys),
        rtol=1e-6,
        atol=1e-6,
    )

    def hess(g):
        return g(lambda x: jnp.sum(g(mlp, argnums=1)(p, x, key) ** 2))(x)

    assert_trees_close(hess(tg.grad), hess(jax.grad), rtol=1e-5, atol=1e-6)


def test_between_forward_and_backward_no_mask_is_held(monkeypatch):
    p, x, key = params(), rand((16, 32), seed=0), jax.random.key(3)
    vjp = lambda p, x: tg.vjp(mlp, p, x, key)  # noqa: E731
    rebuilt = _held(vjp, p, x)
    monkeypatch.setattr(_rebuild, "RANDOM", frozenset())
    tg.clear_caches()
    masked = _held(vjp, p, x)
    tape = tg.trace(mlp, argnums=(0, 1))(p, x, key)
    masks = sum(s.nbytes for s in _masks(tape))
    assert masks == 2 * 16 * 64 // 8  # packed, a bit an element
    monkeypatch.undo()
    tg.clear_caches()
    # Without the draw rebuilt: the two packed masks, and both dropouts' outputs (the
    # second matmul's operand, the square's), which a select_n keeping a mask of its own
    # cannot rebuild; with it, they are rebuilt from tanh's kept outputs and the two split
    # keys, kept instead (8 bytes each).
    assert masked - rebuilt == masks + 2 * 16 * 64 * 4 - 2 * 8, (masked, rebuilt)
    tape = tg.trace(mlp, argnums=(0, 1))(p, x, key)
    kept, _ = tape.residual_keys()
    inputs = {v.id for v in tape.inputs}
    assert rebuilt == sum(v.nbytes for k, v in kept.items() if k not in inputs)


def test_each_dropout_rebuilds_its_own_mask_from_its_own_key():
    # The split keys are kept (a few bytes); the two dropouts share CSE-merged zeros,
    # which each segment computes for itself rather than joining them into one.
    p, x, key = params(), rand((16, 32), seed=0), jax.random.key(3)
    tape = tg.trace(mlp, argnums=(0, 1))(p, x, key)
    (split,) = [r for r in tape.records if r.primitive == "random_split"]
    assert split.decision == "save"
    bits = [r.index for r in tape.records if r.primitive == "random_bits"]
    assert [sum(b in s.records for b in bits) for s in tape.segments] == [1, 1]


def mlp_unstacked(p, x, key):
    k1, k2 = jnp.unstack(jax.random.split(key))
    h = dropout(k1, jnp.tanh(x @ p["w1"]))
    h = dropout(k2, jnp.tanh(h @ p["w2"]))
    return jnp.sum(h**2)


@pytest.mark.parametrize("kind", sorted(KEYS))
def test_keys_unstacked_from_a_split_rebuild_their_masks(kind):
    # jax 0.11 unpacks ``k1, k2 = split(key)`` with an ``unstack`` record (0.10: a slice
    # and a squeeze each); jnp.unstack makes the same record under both.
    p, x, key = params(), rand((16, 32), seed=0), KEYS[kind](3)
    tape = tg.trace(mlp_unstacked, argnums=(0, 1))(p, x, key)
    assert "unstack" in {r.primitive for r in tape.records}
    assert _masks(tape) == []
    bits = [r.index for r in tape.records if r.primitive == "random_bits"]
    assert [sum(b in s.records for b in bits) for s in tape.segments] == [1, 1]
    assert_trees_close(
        tg.grad(mlp_unstacked, argnums=(0, 1))(p, x, key),
        jax.grad(mlp_unstacked, argnums=(0, 1))(p, x, key),
    )


def test_a_key_made_from_a_value_nobody_keeps_is_itself_kept():
    # The seed comes from a reduction of x that no record keeps; the key is a few bytes,
    # kept as it is (not rebuilt), and the mask is rebuilt from it.
    def f(w, x):
        seed = jax.lax.stop_gradient(jnp.sum(x)).astype(jnp.uint32)
        return jnp.sum(dropout(jax.random.key(seed), jnp.tanh(x @ w)) ** 2)

    w, x = params()["w1"], rand((16, 32), seed=0)
    tape = tg.trace(f, argnums=(0, 1))(w, x)
    assert _masks(tape) == []
    (seed,) = [r for r in tape.records if r.primitive == "random_seed"]
    assert seed.decision == "save"
    kept, _ = tape.residual_keys()
    assert seed.outputs[0].id in kept
    want = jax.grad(f, argnums=(0, 1))(w, x)
    out, vjp_fn = tg.vjp(f, w, x)
    assert_trees_close(vjp_fn(jnp.ones_like(out)), want, rtol=1e-6, atol=1e-6)


def test_a_mask_not_rebuildable_for_free_stays_packed():
    # A normal draw goes through erf_inv, not a cheap op: its sign is kept as a mask.
    def f(x, key):
        keep = jax.random.normal(key, x.shape) > 0.0
        return jnp.sum(jnp.where(keep, jnp.tanh(x), 0.0) ** 2)

    x, key = rand((16, 32), seed=0), jax.random.key(1)
    tape = tg.trace(f, argnums=0)(x, key)
    assert [np.dtype(s.dtype) for s in _masks(tape)] == [np.uint8]
    out, vjp_fn = tg.vjp(f, x, key)
    assert_trees_close(vjp_fn(jnp.ones_like(out))[0], jax.grad(f)(x, key))


def test_the_budget_planner_keeps_the_packed_mask():
    # Its peak counts the transient of rebuilding a draw (bits, floats: more than the
    # packed mask); fixed ahead of it, that would raise the least peak it can reach.
    p, x, key = params(), rand((16, 32), seed=0), jax.random.key(3)
    pol = tg.policies.budget(bytes=1 << 30)
    tape = tg.trace(mlp, argnums=(0, 1), policy=pol)(p, x, key)
    assert len(_masks(tape)) == 2
    want = jax.grad(mlp, argnums=(0, 1))(p, x, key)
    out, vjp_fn = tg.vjp(mlp, p, x, key, policy=pol)
    assert_trees_close(vjp_fn(jnp.ones_like(out))[:2], want, rtol=1e-6, atol=1e-6)


def test_a_slice_of_a_larger_draw_is_not_rebuilt():
    # Rebuilding the whole draw to free a mask of a quarter of it costs more than it frees.
    def f(x, key):
        keep = jax.random.bernoulli(key, 0.5, (16, 4 * x.shape[1]))[:, : x.shape[1]]
        return jnp.sum(jnp.where(keep, jnp.tanh(x), 0.0) ** 2)

    x, key = rand((16, 32), seed=0), jax.random.key(1)
    tape = tg.trace(f, argnums=0)(x, key)
    assert all(r.decision == "save" for r in tape.records if r.primitive == "random_bits")
    assert len(_masks(tape)) == 1
    out, vjp_fn = tg.vjp(f, x, key)
    assert_trees_close(vjp_fn(jnp.ones_like(out))[0], jax.grad(f)(x, key))


def test_dropout_in_a_scan_body():
    # Loop bodies are planned record by record (`_plan_bodies`), without rebuilds: the
    # body keeps its packed mask per step. Gradients are exact all the same.
    def f(w, x, key):
        def step(h, i):
            h = dropout(jax.random.fold_in(key, i), jnp.tanh(h @ w))
            return h, None

        h, _ = jax.lax.scan(step, x, jnp.arange(3))
        return jnp.sum(h**2)

    w, x = params()["w2"], rand((16, 64), seed=0)
    for key in (jax.random.key(5), jax.random.PRNGKey(5)):
        want = jax.grad(f, argnums=(0, 1))(w, x, key)
        out, vjp_fn = tg.vjp(f, w, x, key)
        assert_trees_close(vjp_fn(jnp.ones_like(out))[:2], want, rtol=1e-6, atol=1e-6)
        assert_trees_close(jax.jit(tg.grad(f, argnums=(0, 1)))(w, x, key), want, rtol=1e-6)
