"""Eager grad as one compiled call (tapegrad/engine/fused.py): same answers as jax.grad, and
no jit-like staleness — the function is traced every call, so a changed global array,
Python constant or branch is seen at once."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, rand

import tapegrad as tg
from tapegrad.engine import fused as _fused


@pytest.fixture
def compile_at_once(monkeypatch):
    """Compile a structure at its first sighting; count the compiled calls made."""
    monkeypatch.setattr(_fused, "_COMPILE_AT", 1)
    monkeypatch.setattr(_fused, "_SEEN", {})
    monkeypatch.setattr(_fused, "_COMPILED", {})
    calls = []
    real = _fused.run_grad

    def spy(*a, **k):
        out = real(*a, **k)
        calls.append(out is not None)
        return out

    monkeypatch.setattr("tapegrad.api.transforms.run_grad", spy)
    return calls


def _mlp(ws, x):
    h = x
    for w in ws:
        h = jnp.tanh(h @ w + 0.5)
    return jnp.mean(h**2)


def test_fused_grad_equals_jax_grad(compile_at_once):
    ws = [rand((8, 8), seed=i) for i in range(3)]
    x = rand((4, 8), seed=9)
    for _ in range(3):
        got = tg.grad(_mlp, argnums=(0, 1))(ws, x)
        assert_trees_close(got, jax.grad(_mlp, argnums=(0, 1))(ws, x))
        v, g = tg.value_and_grad(_mlp)(ws, x)
        wv, wg = jax.value_and_grad(_mlp)(ws, x)
        assert_trees_close((v, g), (wv, wg))
    assert compile_at_once and all(compile_at_once)


def test_fused_grad_sees_a_changed_global_array(compile_at_once):
    state = {"w": rand((5, 5), seed=1)}

    def f(x):
        return jnp.sum(jnp.sin(x @ state["w"]))

    x = rand((3, 5), seed=2)
    for seed in range(4):  # a new closed-over array every call: never a stale constant
        state["w"] = rand((5, 5), seed=seed + 10)
        assert_trees_close(tg.grad(f)(x), jax.grad(f)(x))
    assert all(compile_at_once)


def test_fused_grad_sees_changed_python_constants_and_branches(compile_at_once):
    cfg = {"scale": 2.0, "branch": True}

    def f(x):
        y = jnp.exp(x) * cfg["scale"] if cfg["branch"] else jnp.cos(x) - cfg["scale"]
        return jnp.sum(y * y)

    x = rand((6,), seed=3)
    for scale, branch in [(2.0, True), (3.0, True), (-0.0, True), (0.0, True), (3.0, False)]:
        cfg.update(scale=scale, branch=branch)
        assert_trees_close(tg.grad(f)(x), jax.grad(f)(x))
    assert all(compile_at_once)


def test_fused_grad_with_aux_and_intermediates(compile_at_once):
    def f(x):
        h = tg.name(jnp.tanh(x), "h")
        return jnp.sum(h**3), {"h": h, "n": 3}

    x = rand((4,), seed=4)
    for _ in range(2):
        (g, inter), aux = tg.grad(f, has_aux=True, intermediates=("h",))(x)
        want_g, want_aux = jax.grad(f, has_aux=True)(x)
        assert_trees_close(g, want_g)
        assert_trees_close(inter["h"], 3 * jnp.tanh(x) ** 2)  # d sum(h^3) / dh
        assert type(aux["n"]) is int and aux["n"] == 3
        assert_trees_close(aux["h"], want_aux["h"])
    assert all(compile_at_once)


def test_user_python_in_backward_keeps_the_per_record_path(compile_at_once):
    """A custom_jvp rule (jax.nn.relu), a tg.hook and a saved-tensor hook are user code
    that runs eagerly on concrete arrays, once per call: never cached in a compiled call."""
    seen = []

    def f(x):
        h = tg.hook(jnp.sin(x), lambda ct: seen.append(type(ct)) or ct)
        return jnp.sum(jax.nn.relu(h) ** 2)

    x = rand((5,), low=-1.0, high=1.0, seed=5)
    for k in range(3):
        want = jax.grad(lambda x: jnp.sum(jax.nn.relu(jnp.sin(x)) ** 2))(x)
        assert_trees_close(tg.grad(f)(x), want)
        assert len(seen) == k + 1 and not issubclass(seen[-1], jax.core.Tracer)
    packed = []
    with tg.saved_tensors_hooks(lambda a: packed.append(1) or a, lambda a: a):
        for _ in range(3):
            tg.grad(lambda x: jnp.sum(jnp.exp(x)))(x)
    assert len(packed) == 3
    assert not any(compile_at_once)


def test_fused_grad_is_not_used_under_a_trace(compile_at_once):
    x = rand((4,), seed=6)
    f = lambda x: jnp.sum(jnp.tanh(x) ** 2)  # noqa: E731
    assert_trees_close(jax.jit(tg.grad(f))(x), jax.grad(f)(x))
    assert_trees_close(jax.vmap(tg.grad(f))(x[None]), jax.vmap(jax.grad(f))(x[None]))
    assert not any(compile_at_once)


def test_grad_key_holds_no_literal_values(compile_at_once):
    """Literals are arguments of the compiled call, not part of its key: one program
    serves 0.0, -0.0 and 1.0, and each call sees its own value (the sign of zero too)."""

    def tape_of(c):
        return tg.trace(lambda x: jnp.sum(x * c))(jnp.ones(3))

    keys = [_fused.grad_key(tape_of(c)) for c in (0.0, -0.0, 1.0)]
    assert None not in keys
    assert len(set(keys)) == 1
    x = rand((3,), seed=1)
    for c in (0.0, -0.0, 1.0, 2.5):
        got = tg.grad(lambda x: jnp.sum(x * c))(x)
        want = jax.grad(lambda x: jnp.sum(x * c))(x)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
        assert_trees_close(got, want)
    assert all(compile_at_once) and len(_fused._COMPILED) == 1


@pytest.mark.parametrize("transform", ["grad", "value_and_grad", "vjp"])
def test_untraced_aux_leaves_come_back_as_jax_returns_them(transform):
    """A Python int, float, bool or complex, a numpy array or scalar, and a closed-over
    array in aux come back as the objects the function returned, like jax's."""
    arr, nparr = jnp.arange(3.0), np.ones(2)

    def f(x):
        aux = {
            "i": 3,
            "f": 2.5,
            "b": True,
            "c": 1 + 2j,
            "np": nparr,
            "np64": np.float64(2.0),
            "npi": np.int32(4),
            "arr": arr,
            "traced": x * 2,
        }
        return jnp.sum(x**2), aux

    x = rand((3,), seed=7)
    if transform == "grad":
        got, want = tg.grad(f, has_aux=True)(x)[1], jax.grad(f, has_aux=True)(x)[1]
    elif transform == "value_and_grad":
        got = tg.value_and_grad(f, has_aux=True)(x)[0][1]
        want = jax.value_and_grad(f, has_aux=True)(x)[0][1]
    else:
        got, want = tg.vjp(f, x, has_aux=True)[2], jax.vjp(f, x, has_aux=True)[2]
    assert set(got) == set(want)
    for k in want:
        assert type(got[k]) is type(want[k]), (k, type(got[k]), type(want[k]))
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
    assert got["np"] is nparr and got["arr"] is arr


def test_untraced_primal_output_comes_back_as_returned():
    x = rand((2,), seed=8)
    out, _ = tg.vjp(lambda x: (3.0, 2), x)
    want, _ = jax.vjp(lambda x: (3.0, 2), x)
    assert [type(o) for o in out] == [type(o) for o in want] == [float, int]
    v, _ = tg.value_and_grad(lambda x: 3.0)(1.0)
    assert type(v) is type(jax.value_and_grad(lambda x: 3.0)(1.0)[0])


def test_fused_control_flow_sees_changed_constants_in_its_body(compile_at_once):
    """scan / cond bodies are keyed by structure: a Python constant or global array
    read inside a body changes the key (or keeps the per-record path), never goes stale."""
    cfg = {"decay": 0.9, "w": rand((4,), seed=11)}

    def f(xs):
        def step(c, r):
            return c * cfg["decay"] + jnp.sum(jnp.sin(r) * cfg["w"]) * c, None

        out = jax.lax.scan(step, 1.0, xs)[0]
        return jax.lax.cond(out > 0, lambda o: o**2, lambda o: -o * cfg["decay"], out)

    xs = rand((5, 4), seed=12)
    for decay, seed in [(0.9, 11), (0.9, 11), (0.5, 11), (0.5, 13), (-0.7, 13)]:
        cfg.update(decay=decay, w=rand((4,), seed=seed))
        assert_trees_close(tg.grad(f)(xs), jax.grad(f)(xs))
    assert compile_at_once and all(compile_at_once)


def test_record_keys_are_computed_once_and_follow_a_redefined_rule(monkeypatch):
    """A cached tape hands the same (immutable) records to every call, so each record's
    key is computed once; redefining a primitive's rule must still give a new key, or a
    program compiled with the old rule would be reused."""
    from tapegrad.rules import _registry

    tape = tg.trace(lambda x: jnp.sum(jnp.sin(x) * 2.0))(jnp.ones(3))
    computed = []
    real = _fused._compute_record_key

    def count(rec, rule):
        computed.append(rec.primitive)
        return real(rec, rule)

    monkeypatch.setattr(_fused, "_compute_record_key", count)
    first = _fused.grad_key(tape)
    n = len(computed)
    assert first is not None and n == len(tape.records)
    assert _fused.grad_key(tape) == first and len(computed) == n  # all from the memo
    old = _registry.RULES["sin"]
    new = dataclasses.replace(old, vjp=lambda *a: old.vjp(*a))  # the same maths, a new rule
    monkeypatch.setitem(_registry.RULES, "sin", new)
    again = _fused.grad_key(tape)
    assert again != first and computed[n:] == ["sin"]
    x = rand((3,), seed=2)
    f = lambda x: jnp.sum(jnp.sin(x) * 2.0)  # noqa: E731
    assert_trees_close(tg.grad(f)(x), jax.grad(f)(x))


def _scaled_relu(scale):
    """relu whose JVP rule scales the tangent: same primal, a rule of one's own."""

    @jax.custom_jvp
    def f(x):
        return jnp.maximum(x, 0.0)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return f(x), jnp.where(x > 0, scale * t, 0.0)

    return f


def test_custom_jvp_calls_take_the_fused_path_keyed_by_their_rule(compile_at_once):
    """A custom_jvp call is expanded at trace time into jaxprs (its rule's primal and
    transposed linear part), so it is keyed by their structure: jax.nn.relu, inside a
    scan too, runs as one compiled call, and two rules with one primal never share one."""

    def stack(ws, x):
        def step(h, w):
            return h + jax.nn.relu(h @ w), None

        return jnp.sum(jax.lax.scan(step, x, ws)[0] ** 2)

    ws, x = rand((3, 6, 6), seed=1) / 3, rand((4, 6), seed=2)
    for _ in range(2):
        assert_trees_close(
            tg.grad(stack, argnums=(0, 1))(ws, x), jax.grad(stack, argnums=(0, 1))(ws, x)
        )
    assert compile_at_once == [True, True]
    for scale in (1.0, 3.0, 3.0):
        g = _scaled_relu(scale)
        f = lambda x, g=g: jnp.sum(g(x * 2.0) ** 2)  # noqa: E731
        assert_trees_close(tg.grad(f)(x), jax.grad(f)(x))
    assert all(compile_at_once)
    assert len(_fused._COMPILED) == 3  # the scan, and one per rule


def test_random_keys_take_the_fused_path_and_a_new_key_is_seen(compile_at_once):
    """A dropout's PRNG key (an extended dtype) is an argument of the compiled call like
    any array: the gradient is jax.grad's (its zeros, the dropped units, exactly), and
    a different key, passed in or made from a changed seed inside the function, gives
    jax.grad's for that key."""

    def same(got, want):
        assert_trees_close(got, want)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a == 0, b == 0), got, want)

    def dropout(ws, x, key, rate=0.25):
        h = x
        for i, w in enumerate(ws):
            h = jax.nn.relu(h @ w)
            keep = jax.random.bernoulli(jax.random.fold_in(key, i), 1 - rate, h.shape)
            h = jnp.where(keep, h / (1 - rate), 0.0)
        return jnp.mean(h**2)

    ws, x = [rand((8, 8), seed=i) for i in range(3)], rand((4, 8), seed=9)
    for seed in (0, 0, 1):
        key = jax.random.key(seed)
        got = tg.grad(dropout, argnums=(0, 1))(ws, x, key)
        same(got, jax.grad(dropout, argnums=(0, 1))(ws, x, key))
    for seed in (3, 4):

        def inner(ws, x, seed=seed):
            return dropout(ws, x, jax.random.PRNGKey(seed))

        same(tg.grad(inner)(ws, x), jax.grad(inner)(ws, x))
    assert len(compile_at_once) == 5 and all(compile_at_once)
