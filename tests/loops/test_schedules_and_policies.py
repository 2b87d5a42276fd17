"""Loop records and the residual policies: what each step keeps, where, and when it is
recomputed. Every figure is checked against jax (`jax.grad`, `jax.vjp`'s live arrays)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, live_bytes_by_kind
from jax import lax

import tapegrad as tg

B, D = 8, 32


def rnn(w, u, xs, h0):
    def body(h, x):
        h = jnp.tanh(h @ w + x @ u)
        return h, jnp.sin(h).sum()

    h, ys = lax.scan(body, h0, xs)
    return jnp.mean(h**2) + jnp.mean(ys)


def rnn_args(T: int, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 4)
    w = jax.random.normal(k[0], (D, D)) / D**0.5
    u = jax.random.normal(k[1], (D, D)) / D**0.5
    xs = jax.random.normal(k[2], (T, B, D))
    h0 = 0.1 * jax.random.normal(k[3], (B, D))
    return w, u, xs, h0


ARGNUMS = (0, 1, 2, 3)


@pytest.mark.parametrize("T", [1, 7, 16, 30])
@pytest.mark.parametrize("every", ["sqrt", 3])
@pytest.mark.parametrize("base", ["save", "offload"])
@pytest.mark.parametrize("jit", [False, True])
def test_scan_checkpoint_matches_jax(T, every, base, jit):
    args = rnn_args(T)
    pol = tg.policies.scan_checkpoint(
        every, base=tg.policies.offload() if base == "offload" else None, min_length=2
    )
    g = tg.grad(rnn, argnums=ARGNUMS, policy=pol)
    got = (jax.jit(g) if jit else g)(*args)
    want = jax.grad(rnn, argnums=ARGNUMS)(*args)
    assert_trees_close(got, want, rtol=2e-5, atol=1e-6)


def test_scan_checkpoint_schedule_on_the_tape():
    args = rnn_args(30)
    tape = tg.trace(rnn, policy=tg.policies.scan_checkpoint("sqrt"))(*args)
    (scan,) = [r for r in tape.records if r.primitive == "scan"]
    assert scan.schedule == 6  # ceil(sqrt(30))
    assert tg.trace(rnn)(*args).records[0].schedule == 0


def _held(fn):
    """Bytes by memory kind of the arrays ``fn()`` leaves alive, and its result."""
    before = live_bytes_by_kind()
    out = fn()
    after = live_bytes_by_kind()
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}, out


def test_sqrt_schedule_keeps_about_sqrt_T_steps():
    T = 2500
    args = rnn_args(T)
    step = B * D * 4
    held, (out, vjp_fn) = _held(
        lambda: tg.vjp(rnn, *args, policy=tg.policies.scan_checkpoint("sqrt"))
    )
    # 50 carries kept (one per 50-step segment), nothing per step.
    assert held["device"] <= 60 * step, held["device"] / step
    got = vjp_fn(jnp.float32(1.0))
    want = jax.vjp(rnn, *args)[1](jnp.float32(1.0))
    assert_trees_close(got, want, rtol=2e-5, atol=1e-6)


def test_rnn_save_holds_at_most_0_6_of_jax():
    args = rnn_args(200)
    jax_held, jax_res = _held(lambda: jax.vjp(rnn, *args))
    tg_held, tg_res = _held(lambda: tg.vjp(rnn, *args))
    assert tg_held["device"] <= 0.6 * jax_held["device"], (tg_held, jax_held)
    del jax_res, tg_res


def test_rnn_offload_moves_each_step_to_host():
    T = 200
    args = rnn_args(T)
    jax_held, jax_res = _held(lambda: jax.vjp(rnn, *args))
    held, (out, vjp_fn) = _held(lambda: tg.vjp(rnn, *args, policy=tg.policies.offload()))
    assert held.get("device", 0) <= 0.1 * jax_held["device"], (held, jax_held)
    assert held.get("pinned_host", 0) >= T * B * D * 4  # at least the per-step activations
    got = vjp_fn(jnp.float32(1.0))
    assert_trees_close(got, jax_res[1](jnp.float32(1.0)), rtol=2e-5, atol=1e-6)


def test_policy_sees_each_step_with_its_loop():
    T = 5
    args = rnn_args(T)
    seen = []

    class Spy:
        def pack(self, value, info):
            seen.append(
                (info, isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer))
            )
            return value

        def unpack(self, packed, info):
            return packed

    got = tg.grad(rnn, argnums=ARGNUMS, policy=Spy())(*args)
    assert_trees_close(got, jax.grad(rnn, argnums=ARGNUMS)(*args), rtol=2e-5, atol=1e-6)
    in_loop = [(i, concrete) for i, concrete in seen if i.in_loop]
    assert in_loop and all(concrete for _, concrete in in_loop)  # eagerly: concrete steps
    tanh_packs = [i for i, _ in in_loop if i.primitive == "tanh"]
    assert len(tanh_packs) == T  # once per step, one step's shape
    assert all(i.shape == (B, D) and i.trip_count == T for i in tanh_packs)
    assert all(i.loops[0].primitive == "scan" for i in tanh_packs)


def test_selective_recompute_inside_the_body():
    P = tg.CheckpointPolicy
    sac = tg.selective(lambda rec: P.ALWAYS if rec.primitive == "dot_general" else P.NEVER)
    args = rnn_args(9)
    tape = tg.trace(rnn, policy=sac)(*args)
    body = tape.records[0].bodies[0]
    assert any(r.decision == "recompute" for r in body.records)
    for jit in (False, True):
        g = tg.grad(rnn, argnums=ARGNUMS, policy=sac)
        got = (jax.jit(g) if jit else g)(*args)
        assert_trees_close(got, jax.grad(rnn, argnums=ARGNUMS)(*args), rtol=2e-5, atol=1e-6)


def nan_rnn(w, xs, h):
    def body(h, x):
        y = jnp.log(x) + h @ w
        return jnp.tanh(y), y.sum()

    h, ys = lax.scan(body, h, xs)
    return h.sum() + ys.sum()


def sqrt_rnn(w, xs, h):
    def body(h, x):
        y = jnp.sqrt(x) * jnp.zeros_like(h) + h @ w
        return y, y.sum()

    h, ys = lax.scan(body, h, xs)
    return h.sum() + ys.sum()


@pytest.mark.filterwarnings("ignore:tapegrad anomaly detection")
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("policy", [None, "offload"])
def test_anomaly_names_body_line_and_step_forward(jit, policy):
    xs = jnp.ones((6, 3)).at[3, 1].set(-1.0)
    pol = tg.policies.offload() if policy else None
    with pytest.raises(Exception) as e:
        g = tg.grad(nan_rnn, policy=pol, anomaly=True)
        jax.block_until_ready((jax.jit(g) if jit else g)(jnp.eye(3), xs, jnp.ones(3)))
    msg = str(e.value)
    assert f":{nan_rnn.__code__.co_firstlineno + 2} " in msg and "'log'" in msg
    assert re.search(r"step 3 \(from 0\) of 6 of 'scan'", msg), msg


@pytest.mark.filterwarnings("ignore:tapegrad anomaly detection")
@pytest.mark.parametrize("jit", [False, True])
def test_anomaly_names_body_line_and_step_backward(jit):
    xs = jnp.ones((6, 3)).at[2, 1].set(0.0)
    with pytest.raises(Exception) as e:
        g = tg.grad(sqrt_rnn, argnums=1, anomaly=True)
        jax.block_until_ready((jax.jit(g) if jit else g)(jnp.eye(3), xs, jnp.ones(3)))
    msg = str(e.value)
    line = sqrt_rnn.__code__.co_firstlineno + 2
    assert "backward of 'sqrt'" in msg and f":{line} " in msg
    assert re.search(r"step 2 \(from 0\) of 6 of 'scan'", msg), msg


def test_carry_saved_once_per_step():
    # h is both tanh's output (saved) and the next step's dot_general input (saved):
    # eagerly under save() the stack holds it once.
    args = rnn_args(50)
    held, res = _held(lambda: tg.vjp(rnn, *args))
    per_step = B * D * 4
    assert held["device"] <= 50 * per_step * 1.05 + 4096, held["device"] / per_step
    np.testing.assert_allclose(res[0], rnn(*args), rtol=2e-5)


def test_budget_schedules_a_scan_that_does_not_fit():
    T = 400
    args = rnn_args(T)
    step = B * D * 4
    pol = tg.policies.budget(bytes=100 * step)
    (scan,) = [r for r in tg.trace(rnn, policy=pol)(*args).records if r.primitive == "scan"]
    assert 0 < scan.schedule < T
    held, (out, vjp_fn) = _held(lambda: tg.vjp(rnn, *args, policy=pol))
    assert held["device"] <= 100 * step, held["device"] / step
    got = vjp_fn(jnp.float32(1.0))
    assert_trees_close(got, jax.vjp(rnn, *args)[1](jnp.float32(1.0)), rtol=2e-5, atol=1e-6)
    # a budget that holds every step keeps every step
    roomy = tg.policies.budget(bytes=10 * T * step)
    assert tg.trace(rnn, policy=roomy)(*args).records[0].schedule == 0
