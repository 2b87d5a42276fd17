"""`tg.hook`: cotangent hooks (PyTorch's ``register_hook``, seed 004).

The oracle for what a hook sees is `jax.vjp` of the rest of the function at the
hooked value; the oracle for a replacement is the chain rule done by hand:
upstream vjp applied to the replaced cotangent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, rand

import tapegrad as tg
from tapegrad.rules.control import custom_vjp_name

GRADS = {"tg.grad": tg.grad, "jax.grad": jax.grad}


def upstream(x):
    return jnp.tanh(x) * 2.0


def downstream(h):
    return jnp.sum(jnp.sin(h) * jnp.arange(1.0, 1.0 + h.shape[-1]))


def _cotangent_at_h(x):
    """The cotangent of ``h = upstream(x)`` in ``downstream(h)``: what a hook on h sees."""
    return jax.grad(downstream)(upstream(x))


def _grad_through(x, ct):
    """d/dx when h's cotangent is replaced by ``ct``."""
    _, vjp_fn = jax.vjp(upstream, x)
    return vjp_fn(ct)[0]


@pytest.mark.parametrize("grad", GRADS.values(), ids=GRADS.keys())
def test_observing_hook_sees_the_cotangent_eagerly_with_concrete_arrays(grad):
    x = rand((4,), seed=1)
    seen = []
    f = lambda x: downstream(tg.hook(upstream(x), seen.append))
    got = grad(f)(x)
    assert_trees_close(got, jax.grad(lambda x: downstream(upstream(x)))(x))  # identity
    assert len(seen) == 1 and isinstance(seen[0], jax.Array)
    assert not isinstance(seen[0], jax.core.Tracer)
    assert_trees_close(seen[0], _cotangent_at_h(x))
    grad(f)(x)
    assert len(seen) == 2  # called on every backward


def test_hook_is_identity_in_forward():
    x = rand((4,), seed=2)
    calls = []
    y = tg.hook(x, calls.append)
    assert_trees_close(y, x)
    assert calls == []


@pytest.mark.parametrize("mode", ["tg.grad", "jax.grad", "jit tg.grad", "jit jax.grad", "vmap"])
def test_replacing_hook_clips_the_gradient(mode):
    x = rand((5,), seed=3, low=-2, high=2)
    clip = lambda g: jnp.clip(g, -0.5, 0.5)
    f = lambda x: downstream(tg.hook(upstream(x), clip))
    want = _grad_through(x, clip(_cotangent_at_h(x)))
    if mode == "vmap":
        xs = jnp.stack([x, -x])
        got = jax.vmap(jax.grad(f))(xs)
        want = jnp.stack([want, _grad_through(-x, clip(_cotangent_at_h(-x)))])
    else:
        g = GRADS[mode.removeprefix("jit ")](f)
        got = jax.jit(g)(x) if mode.startswith("jit") else g(x)
    assert_trees_close(got, want)
    assert not np.allclose(want, jax.grad(lambda x: downstream(upstream(x)))(x))  # it did clip


def test_hook_returning_none_keeps_the_cotangent():
    x = rand((3,), seed=4)
    f = lambda x: downstream(tg.hook(upstream(x), lambda g: None))
    assert_trees_close(tg.grad(f)(x), jax.grad(lambda x: downstream(upstream(x)))(x))


@pytest.mark.parametrize("grad", GRADS.values(), ids=GRADS.keys())
def test_observe_hook_sees_concrete_values_on_every_call_under_jit(grad):
    x = rand((4,), seed=5)
    seen = []
    f = lambda x: downstream(
        tg.hook(upstream(x), lambda g: seen.append(np.asarray(g)), observe=True)
    )
    g = jax.jit(grad(f))
    g(x)
    g(x + 1.0)
    jax.effects_barrier()
    assert len(seen) == 2
    np.testing.assert_allclose(seen[0], _cotangent_at_h(x), rtol=1e-6)
    np.testing.assert_allclose(seen[1], _cotangent_at_h(x + 1.0), rtol=1e-6)


def test_observe_hook_ignores_its_result_and_works_eagerly():
    x = rand((4,), seed=6)
    seen = []

    def fn(g):
        seen.append(np.asarray(g))
        return g * 0  # ignored: an observer cannot replace

    f = lambda x: downstream(tg.hook(upstream(x), fn, observe=True))
    assert_trees_close(tg.grad(f)(x), jax.grad(lambda x: downstream(upstream(x)))(x))
    jax.effects_barrier()
    assert len(seen) == 1


def test_plain_hook_under_jit_runs_once_at_trace_time_with_tracers():
    # The documented difference: without observe=True, jit calls the hook while tracing.
    x = rand((4,), seed=7)
    seen = []
    g = jax.jit(tg.grad(lambda x: downstream(tg.hook(upstream(x), seen.append))))
    g(x)
    g(x + 1.0)
    assert len(seen) == 1 and isinstance(seen[0], jax.core.Tracer)


def test_hooks_run_in_backward_order():
    x = rand((3,), seed=8)
    order = []

    def f(x):
        a = tg.hook(jnp.sin(x), lambda g: order.append("a"))
        b = tg.hook(a * 2.0, lambda g: order.append("b"))
        return jnp.sum(b**2)

    tg.grad(f)(x)
    jax.grad(f)(x)
    assert order == ["b", "a", "b", "a"]


@pytest.mark.parametrize("grad", GRADS.values(), ids=GRADS.keys())
def test_hook_on_a_pytree(grad):
    x = rand((3,), seed=9)
    seen = []

    def fn(ct):
        seen.append(ct)
        return {"s": ct["s"] * 2.0, "c": ct["c"]}

    def f(x):
        d = tg.hook({"s": jnp.sin(x), "c": jnp.cos(x)}, fn)
        return jnp.sum(d["s"] * 3.0 + d["c"] ** 2)

    got = grad(f)(x)
    want = jax.grad(lambda x: jnp.sum(jnp.sin(x) * 6.0 + jnp.cos(x) ** 2))(x)
    assert_trees_close(got, want)
    assert set(seen[0]) == {"s", "c"}
    assert_trees_close(seen[0]["s"], jnp.full(3, 3.0))


@pytest.mark.parametrize(
    "outer,inner", [(tg.grad, tg.grad), (jax.grad, jax.grad)], ids=["tg-tg", "jax-jax"]
)
def test_double_backward_through_a_jax_op_hook(outer, inner):
    x = jnp.float32(0.7)
    f = lambda x: jnp.sin(tg.hook(x * x, lambda g: g * 3.0))
    ref = lambda x: 3.0 * jnp.cos(x * x) * 2 * x  # the first derivative with the hook's 3x
    assert_trees_close(inner(f)(x), ref(x))
    assert_trees_close(outer(inner(f))(x), jax.grad(ref)(x))


def test_hook_on_integer_values_is_never_called():
    calls = []
    f = lambda x: jnp.sum(x * tg.hook(jnp.arange(3), calls.append))
    assert_trees_close(tg.grad(f)(rand((3,))), jnp.arange(3.0))
    assert_trees_close(jax.grad(f)(rand((3,))), jnp.arange(3.0))
    assert calls == []


def test_hook_record_on_the_tape_is_named_and_saves_nothing():
    def clip_it(g):
        return jnp.clip(g, -1, 1)

    tape = tg.trace(lambda x: jnp.sum(tg.hook(jnp.sin(x), clip_it)))(rand((3,)))
    rec = next(r for r in tape.records if r.primitive == "custom_vjp_call")
    assert custom_vjp_name(rec.params) == "hook(clip_it)"
    assert rec.saves == ()


def test_hook_errors():
    x = rand((3,))
    with pytest.raises(TypeError, match=r"tg\.hook\(y, fn\): fn must be callable"):
        tg.hook(x, "not a function")

    def shrink(g):
        return g[:2]

    with pytest.raises(
        tg.HookError,
        match=r"hook shrink returned a cotangent of shape \(2,\) for a "
        r"value of shape \(3,\)",
    ):
        tg.grad(lambda x: jnp.sum(tg.hook(jnp.sin(x), shrink)))(x)

    def as_tuple(g):
        return (g, g)

    with pytest.raises(tg.HookError, match="hook as_tuple returned a value with structure"):
        jax.grad(lambda x: jnp.sum(tg.hook(jnp.sin(x), as_tuple)))(x)
