"""Free rebuilds run as one compiled call eagerly (`Segment.compiled`,
`_interpret.run_compiled_segment`): backward holds the segment's inputs and outputs,
never a draw's random bits or floats, so rebuilding a dropout mask from its key lowers
the bytes held between forward and backward without raising backward's peak."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from conftest import assert_trees_close, rand

import tapegrad as tg
from tapegrad.engine import fused as _fused
from tapegrad.engine import interpret as _interpret
from tapegrad.engine import rebuild as _rebuild
from tapegrad.planner.measure import measured_peak

RATE = 0.25


def dropout(key, h):
    keep = jax.random.bernoulli(key, 1 - RATE, h.shape)
    return jnp.where(keep, h / (1 - RATE), 0.0)


def mlp(ws, x, key, act=jnp.tanh):
    h = x
    for i, w in enumerate(ws):
        h = dropout(jax.random.fold_in(key, i), act(h @ w))
    return jnp.sum(h**2)


def weights(depth=4, width=64):
    return [rand((width, width), seed=i + 1) / 8 for i in range(depth)]


def _vjp_grad(ws, x, key):
    out, vjp_fn = tg.vjp(mlp, ws, x, key)
    return vjp_fn(jnp.ones_like(out))[:2]


@pytest.fixture
def traced_runs(monkeypatch):
    """Counts the records `run_segment` traces (inside a compiled segment) and runs
    concretely (record by record)."""
    counts = {"traced": 0, "eager": 0}
    run = _interpret._run

    def counting(rec, ins):
        traced = any(isinstance(v, jax.core.Tracer) for v in ins)
        counts["traced" if traced else "eager"] += 1
        return run(rec, ins)

    monkeypatch.setattr(_interpret, "_run", counting)
    return counts


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
def test_eager_gradients_equal_jax_and_segments_run_compiled(make_key, traced_runs):
    ws, x, key = weights(), rand((32, 64), seed=0), make_key(7)
    tape = tg.trace(mlp, argnums=(0, 1))(ws, x, key)
    assert len(tape.segments) == 4 and all(s.compiled for s in tape.segments)
    tg.clear_caches()
    want = jax.grad(mlp, argnums=(0, 1))(ws, x, key)
    assert_trees_close(_vjp_grad(ws, x, key), want, rtol=1e-6, atol=1e-6)
    assert_trees_close(tg.grad(mlp, argnums=(0, 1))(ws, x, key), want, rtol=1e-6, atol=1e-6)
    # Forward runs record by record; no segment record ran outside a compiled call.
    n_fwd = len(tape.records)
    assert traced_runs["traced"] > 0
    assert traced_runs["eager"] == 2 * n_fwd, traced_runs


def test_under_jit_and_vmap_segments_are_traced_inline(traced_runs):
    ws, x = weights(), rand((32, 64), seed=0)
    keys = jax.vmap(jax.random.key)(jnp.arange(3))
    tg.clear_caches()
    got = jax.jit(_vjp_grad)(ws, x, keys[0])
    assert_trees_close(got, jax.grad(mlp, argnums=(0, 1))(ws, x, keys[0]), rtol=1e-6, atol=1e-6)
    got = jax.vmap(_vjp_grad, (None, None, 0))(ws, x, keys)
    want = jax.vmap(jax.grad(mlp, argnums=(0, 1)), (None, None, 0))(ws, x, keys)
    assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
    assert len(_fused._SEGMENTS) == 0  # already traced: no compiled call of its own


def test_compiled_once_across_calls_and_layers(traced_runs):
    ws, key = weights(), jax.random.key(7)
    tg.clear_caches()
    _vjp_grad(ws, rand((32, 64), seed=0), key)
    first, entries = traced_runs["traced"], len(_fused._SEGMENTS)
    # Layers whose rebuilds differ only in their values' ids share one executable (the
    # first layer's lists the scalars CSE shares with the others in another order).
    tape = tg.trace(mlp, argnums=(0, 1))(ws, rand((32, 64), seed=0), key)
    assert 1 <= entries < len(tape.segments) == 4
    assert first < sum(len(s.records) for s in tape.segments)
    for seed in (1, 2):  # new values, new key: the same structure, nothing traced again
        _vjp_grad(ws, rand((32, 64), seed=seed), jax.random.key(seed))
    assert traced_runs["traced"] == first
    assert len(_fused._SEGMENTS) == entries


@pytest.mark.parametrize("act", [jnp.tanh, jax.nn.relu], ids=["tanh", "relu"])
def test_backward_peak_is_not_above_keeping_the_mask(monkeypatch, act):
    # Measured from live arrays over an eager forward and backward (and equal to the
    # report's model of it). A 256x64 batch: the draw's u32 bits alone (64 KiB) are 32
    # times a packed mask.
    ws, x, key = weights(), rand((256, 64), seed=0), jax.random.key(7)
    f = functools.partial(mlp, act=act)
    rebuilt = measured_peak(f, (ws, x, key), None, argnums=(0, 1))
    assert rebuilt == tg.memory_report(f, argnums=(0, 1))(ws, x, key).peak_beyond_inputs_bytes
    monkeypatch.setattr(_interpret, "run_compiled_segment", lambda *_: None)
    op_by_op = measured_peak(f, (ws, x, key), None, argnums=(0, 1))
    monkeypatch.undo()
    monkeypatch.setattr(_rebuild, "RANDOM", frozenset())  # masks kept, packed
    tg.clear_caches()
    masked = measured_peak(f, (ws, x, key), None, argnums=(0, 1))
    monkeypatch.undo()
    tg.clear_caches()
    # Run record by record, the rebuild holds the bits and floats: the compiled call does not.
    assert rebuilt <= masked and rebuilt < op_by_op, (rebuilt, masked, op_by_op)


def layer_norm_loss(p, x):
    mu = jnp.mean(x, -1, keepdims=True)
    xc = x - mu
    h = xc * jax.lax.rsqrt(jnp.mean(xc**2, -1, keepdims=True) + 1e-5) * p["g"] + p["b"]
    return jnp.sum(jnp.tanh(h @ p["w"]) ** 2)


def _record_by_record(monkeypatch, fn):
    monkeypatch.setattr(_interpret, "run_compiled_segment", lambda *_: None)
    try:
        return fn()
    finally:
        monkeypatch.undo()


def test_a_rebuilt_draw_gives_the_very_bits_of_record_by_record():
    # Integer ops and comparisons: compiled or not, the same mask, the same gradients.
    ws, x, key = weights(), rand((32, 64), seed=0), jax.random.key(7)
    compiled = _vjp_grad(ws, x, key)
    with pytest.MonkeyPatch.context() as mp:
        by_record = _record_by_record(mp, lambda: _vjp_grad(ws, x, key))
    for a, b in zip(jax.tree.leaves(compiled), jax.tree.leaves(by_record)):
        assert jnp.array_equal(a, b)


def test_a_float_rebuild_runs_record_by_record():
    # A layer norm's output, rebuilt from what its backward keeps: compiled, XLA could
    # fuse ``* g + b`` into one rounding and rebuild a value forward never computed.
    p = {"g": 1.0 + rand((64,), seed=1) / 8, "b": rand((64,), seed=2) / 8}
    p["w"] = rand((64, 64), seed=3) / 8
    x = rand((256, 64), seed=0)
    tape = tg.trace(layer_norm_loss, argnums=(0, 1))(p, x)
    assert tape.segments and not any(s.compiled for s in tape.segments)
    out, vjp_fn = tg.vjp(layer_norm_loss, p, x)
    want = jax.grad(layer_norm_loss, argnums=(0, 1))(p, x)
    assert_trees_close(vjp_fn(jnp.ones_like(out)), want, rtol=1e-4, atol=1e-4)
