"""Many eager calls with a constant that changes every call (issue 14).

A learning-rate or temperature schedule closes a new Python float over the loss on
every step. Constants are arguments of what tapegrad compiles, never cache keys: the
caches stay bounded, nothing is compiled again, live arrays return to their baseline
after each backward, and every gradient uses its own call's constant (a stale one
baked into a compiled program would be a wrong gradient, compared here with jax.grad).
"""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, rand

import tapegrad as tg
from tapegrad.core import caches as _caches
from tapegrad.engine import fused as _fused
from tapegrad.engine import interpret as _interpret
from tapegrad.engine import trace as _trace
from tapegrad.rules import _linear

POLICIES = {
    "save": lambda: tg.policies.save(),
    "offload": lambda: tg.policies.offload(),
    "bf16": lambda: tg.policies.compress(jnp.bfloat16),
}


def _loss(params, x, c):
    """An MLP with a closed-over scale and a relu (a custom_jvp call: the per-record path).

    No scan here: an eager scan under save() traces and compiles its body on every call
    whatever its constants (jax's eager lax.scan of a new closure), which would only
    make this test slow; `_loss_fused` has one (compiled once there).
    """
    h = jnp.tanh(x @ params["w1"] * c + 0.1)
    h = jax.nn.relu(h @ params["w2"] - c * 0.5)
    return jnp.sum((h * (1.0 - 0.1 * c)) ** 2) + jnp.sum(jnp.exp(-c * h))


def _loss_fused(params, x, c):
    """Without a custom_jvp call: eager grad runs it as one compiled program."""
    h = jnp.tanh(x @ params["w1"] * c + 0.1)

    def step(carry, row):
        return carry * (1.0 - 0.1 * c) + jnp.sin(row) * c, None

    carry, _ = jax.lax.scan(step, jnp.zeros(h.shape[1:]), h @ params["w2"])
    return jnp.sum(carry**2) + jnp.sum(jnp.exp(-c * h))


LOSSES = {"mixed": _loss, "fused": _loss_fused}


def _params(n: int, seed: int) -> dict:
    return {"w1": rand((n, n), seed=seed), "w2": rand((n, n), seed=seed + 1)}


def _compiled() -> int:
    """Executables behind tapegrad's caches (a jitted function counts each it compiled)."""
    n = sum(f._cache_size() for f in _interpret._RULE_JIT.values())
    n += sum(f._cache_size() for f in _fused._COMPILED.values())
    for lin in _linear._LINEAR.values():
        n += sum(f._cache_size() for f in lin.jitted.values())
    return n


def _live() -> int:
    gc.collect()
    return len(jax.live_arrays())


def _grad(policy: str, c: float, loss=_loss):
    return tg.grad(lambda p, x: loss(p, x, c), policy=POLICIES[policy]())


@pytest.mark.parametrize(
    "policy,loss", [("save", "fused"), ("save", "mixed"), ("offload", "mixed")]
)
def test_a_changed_constant_compiles_nothing(policy, loss):
    """Fails when a literal's value keys a cache: each new constant compiled a program."""
    p, x = _params(6, 0), rand((5, 6), seed=2)
    for _ in range(_fused._COMPILE_AT):  # the fused path compiles at the third sighting
        _grad(policy, 0.5, LOSSES[loss])(p, x)
    entries, compiled = _compiling_caches(), _compiled()
    for k in range(5):
        _grad(policy, 0.3 + 0.1 * k, LOSSES[loss])(p, x)
    assert _compiling_caches() == entries
    assert _compiled() == compiled
    # Tapes hold no compiled code and no arrays: a literal inside a loop body keys its
    # tape by value (a rebuilt tape, nothing compiled); the cache stays bounded.
    assert len(_trace._TAPES) <= _trace._TAPES.max_entries


def _compiling_caches() -> dict:
    return {k: v for k, v in _caches.cache_info().items() if k != "trace.tapes"}


def test_short_soak_is_flat():
    """300 calls: two shapes, three policies, a new constant each call."""
    data = {n: (_params(n, n), rand((4, n), seed=n + 7)) for n in (4, 7)}
    schedule = [(n, pol) for n in data for pol in POLICIES]

    def call(i: int) -> None:
        n, pol = schedule[i % len(schedule)]
        g = _grad(pol, 1.0 / (1.0 + 0.01 * i))(*data[n])
        jax.block_until_ready(g)
        del g

    for i in range(3 * len(schedule)):  # warm-up: every structure compiled
        call(i)
    base_live, base_entries, base_compiled = _live(), _caches.cache_info(), _compiled()
    grew = []
    for i in range(3 * len(schedule), 300):
        call(i)
        # Back to the baseline at once, not at the next garbage collection: nothing the
        # call made is kept alive by a reference cycle.
        grew.append(len(jax.live_arrays()) - base_live)
    assert max(grew) <= 0, f"live arrays over the baseline after a call: {max(grew)}"
    assert _live() <= base_live
    assert _caches.cache_info() == base_entries
    assert _compiled() == base_compiled


def test_cache_sizes_do_not_grow_with_distinct_constants():
    p, x = _params(5, 3), rand((3, 5), seed=4)
    sizes = []
    for k in range(40):
        _grad("save" if k % 2 else "bf16", 0.25 + k / 64)(p, x)
        sizes.append(sum(_caches.cache_info().values()))
    assert len(set(sizes[6:])) == 1, sizes  # after warm-up no cache grows
    for name, cache in _caches._REGISTRY.items():
        assert len(cache) <= cache.max_entries, name
        if cache.max_bytes is not None:
            assert cache.nbytes <= cache.max_bytes, name


@pytest.mark.parametrize(
    "policy,loss", [("save", "fused"), ("save", "mixed"), ("offload", "mixed"), ("bf16", "mixed")]
)
def test_gradients_use_each_calls_constant(policy, loss):
    p, x = _params(6, 5), rand((5, 6), seed=6)
    tol = {"rtol": 3e-2, "atol": 3e-2} if policy == "bf16" else {}
    # Enough calls of one structure that the fused program is compiled and then reused.
    for c in (0.5, 0.5, 0.5, 1.5, -0.75, 0.0, 2.0):
        got = _grad(policy, c, LOSSES[loss])(p, x)
        want = jax.grad(lambda p, x: LOSSES[loss](p, x, c))(p, x)
        assert_trees_close(got, want, **tol)


def test_a_literal_in_a_rule_is_its_calls_value():
    """The per-rule compiled path (a policy that is not plain save): pow, div, max and
    where with a changing literal operand, against jax.grad."""

    def f(x, c):
        y = x**c + c / (x + 2.0) + jnp.maximum(x, c) + jnp.where(x > c, x * c, -x)
        return jnp.sum(y * jnp.float32(c))

    x = rand((7,), low=0.5, high=2.0, seed=8)
    for c in (1.5, 1.5, 2.5, 0.7, 3.0):
        got = tg.grad(lambda x: f(x, c), policy=tg.policies.offload())(x)
        assert_trees_close(got, jax.grad(lambda x: f(x, c))(x))


def test_clear_caches_empties_every_cache():
    p, x = _params(4, 9), rand((3, 4), seed=10)
    for pol in POLICIES:
        for _ in range(3):
            _grad(pol, 0.5)(p, x)
    for _ in range(3):
        _grad("save", 0.5, _loss_fused)(p, x)
    info = _caches.cache_info()
    for name in ("interpret.rule_jit", "fused.compiled", "custom_jvp.linear"):
        assert info[name] > 0, name
    tg.clear_caches()
    assert set(_caches.cache_info().values()) == {0}
    assert _compiled() == 0
    assert set(_caches.cache_bytes().values()) == {0}
    # Still right afterwards (cached afresh).
    assert_trees_close(_grad("save", 0.5)(p, x), jax.grad(lambda p, x: _loss(p, x, 0.5))(p, x))


def test_bounded_cache_evicts_by_entries_and_bytes():
    c = _caches.BoundedCache("test.bounded", max_entries=3, max_bytes=100)
    try:
        for k in range(5):
            c.put(k, str(k), nbytes=10)
        assert len(c) == 3 and c.get(0) is None and c.get(4) == "4"
        c.get(2)  # most recently used: survives the next eviction
        c.put("big", "b", nbytes=85)
        assert c.get(2) == "2" and c.get("big") == "b" and c.nbytes <= 100
        assert c.get(3) is None and c.get(4) is None
        c.put("huge", "h", nbytes=101)  # bigger than the whole budget: not kept
        assert c.get("huge") is None
        np.testing.assert_equal(_caches.array_bytes({"a": np.ones(3), "b": [jnp.ones(2)]}), 32)
        c.clear()
        assert len(c) == 0 and c.nbytes == 0
    finally:
        _caches._REGISTRY.pop("test.bounded", None)
