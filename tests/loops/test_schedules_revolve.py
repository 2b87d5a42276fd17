"""Binomial (revolve) loop checkpointing, ``scan_checkpoint(snapshots=s)``, and the budget's
choice among loop schedules: gradients against jax, body runs counted by a callback and
compared with the optimum from an independent dynamic program, carries and backward's peak
by `jax.live_arrays`."""

from __future__ import annotations

import dataclasses
import functools
import gc

import jax
import jax.numpy as jnp
import pytest
from conftest import assert_trees_close
from jax import lax

import tapegrad as tg
from tapegrad.engine.loops.revolve import binomial_steps, revolve_plan
from tapegrad.engine.loops.saves import loop_bytes, schedule_costs


@functools.cache
def optimal_runs(n: int, s: int) -> int:
    """Fewest body runs (each step's forward, a recorded one included) that reverse ``n``
    steps from a stored carry with ``s`` snapshots held at once, that one included, when a
    step's backward needs its forward run just before. One snapshot: step t re-runs from
    the start, t + 1 runs. More: advance m steps to the first snapshot, reverse the last
    n - m steps with s - 1, then the first m with s again (the one at m is free)."""
    if n == 1:
        return 1
    if s == 1:
        return n * (n + 1) // 2
    return min(m + optimal_runs(n - m, s - 1) + optimal_runs(m, s) for m in range(1, n))


def _args(T: int, B: int = 2, D: int = 3, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 3)
    w = jax.random.normal(k[0], (D, D)) / D**0.5
    h0 = jax.random.normal(k[1], (B, D))
    xs = jax.random.normal(k[2], (T, B, D))
    return w, h0, xs


def _policy(s: int, **kw):
    return tg.policies.scan_checkpoint(snapshots=s, min_length=1, **kw)


def test_the_dynamic_program_is_griewanks_formula():
    """Re-runs = r·T − C(s + r, r − 1) for the least r with C(s + r, s) >= T."""
    for s in (1, 2, 3, 4):
        for T in range(2, 41):
            r = next(r for r in range(T) if binomial_steps(s, r) >= T)
            assert optimal_runs(T, s) - T == r * T - binomial_steps(s + 1, r - 1), (T, s)


_RUNS = [0]


def _count(_):
    _RUNS[0] += 1


@functools.cache
def _counted_loss(T: int):
    """An RNN loss over T steps (a reverse scan for odd T) whose body counts its runs, and
    jax.grad's gradients of it."""

    def loss(w, h0, xs):
        def body(h, x):
            jax.debug.callback(_count, x)
            h = jnp.tanh(h @ w + x)
            return h, jnp.sin(h).sum(-1)

        h, ys = lax.scan(body, h0, xs, reverse=T % 2 == 1)
        return jnp.mean(h**2) + jnp.mean(ys * jnp.arange(1.0, T + 1)[:, None])

    want = jax.grad(loss, argnums=(0, 1, 2))(*_args(T))
    jax.effects_barrier()
    return loss, want


@pytest.mark.parametrize("s", [1, 2, 3, 8])
@pytest.mark.parametrize("T", [1, 2, 3, 7, 64, 100])
def test_gradients_and_steps_rerun_are_revolves(T, s):
    """Eager (odd s) or jitted, forward or reverse (odd T): gradients equal jax.grad and
    the body runs T + the optimum's re-runs times, counted by a callback."""
    loss, want = _counted_loss(T)
    pol = _policy(s)
    args = _args(T)
    (rec,) = [r for r in tg.trace(loss, policy=pol)(*args).records if r.primitive == "scan"]
    want_runs = optimal_runs(T, s)
    costs = schedule_costs(rec)
    assert rec.snapshots == s and costs is not None
    assert costs.recomputed == want_runs - T
    assert costs.peak_carries <= s + 1  # the snapshots and the carry in hand
    g = tg.grad(loss, argnums=(0, 1, 2), policy=pol)
    jax.effects_barrier()
    _RUNS[0] = 0
    got = (jax.jit(g) if s % 2 == 0 else g)(*args)
    jax.effects_barrier()
    assert _RUNS[0] == want_runs, (_RUNS[0], want_runs)
    assert_trees_close(got, want, rtol=2e-5, atol=1e-6)


def test_carries_of_every_kind_and_nested_scans():
    """A PRNG-key carry, an integer carry and a scan inside the body."""
    w, h0, xs = _args(5)

    def loss(w, h0, xs):
        def body(c, x):
            h, key, i = c
            key, sub = jax.random.split(key)
            g, _ = lax.scan(lambda g, xx: (jnp.sin(g * xx), g.sum()), h, jnp.stack([x, 2 * x]))
            h = jnp.tanh(h @ w + g + 0.01 * jax.random.normal(sub, h.shape))
            return (h, key, i + 1), jnp.sin(h).sum(-1)

        (h, _, i), ys = lax.scan(body, (h0, jax.random.key(3), 0), xs, reverse=True)
        return jnp.sum(h**2) + jnp.sum(ys) + i

    got = tg.grad(loss, argnums=(0, 1, 2), policy=_policy(2))(w, h0, xs)
    assert_trees_close(got, jax.grad(loss, argnums=(0, 1, 2))(w, h0, xs), rtol=2e-5, atol=1e-6)


def test_under_offload_eagerly_and_its_vjp_under_jit():
    """Eagerly under a policy other than save() the steps run as a Python loop (the policy
    sees concrete steps); the same forward's vjp also runs under jax.jit."""
    w, h0, xs = _args(6)

    def loss(w, h0, xs):
        h, ys = lax.scan(lambda h, x: (jnp.tanh(h @ w + x), jnp.sum(h * x)), h0, xs)
        return jnp.sum(h**2) + jnp.sum(ys)

    want = jax.grad(loss, argnums=(0, 1, 2))(w, h0, xs)
    pol = _policy(2, base=tg.policies.offload())
    got = tg.grad(loss, argnums=(0, 1, 2), policy=pol)(w, h0, xs)
    assert_trees_close(got, want, rtol=2e-5, atol=1e-6)
    _, vjp_fn = tg.vjp(loss, w, h0, xs, policy=pol)
    assert_trees_close(jax.jit(vjp_fn)(jnp.float32(1.0)), want, rtol=2e-5, atol=1e-6)


def test_second_order_and_vmap_match_jax():
    w, h0, xs = _args(6)

    def loss(w, h0, xs):
        h, ys = lax.scan(lambda h, x: (jnp.tanh(h @ w + x), jnp.sum(h)), h0, xs)
        return jnp.sum(h**2) + jnp.sum(ys)

    pol = _policy(2)
    got = tg.grad(lambda w: jnp.sum(tg.grad(loss, policy=pol)(w, h0, xs) ** 2))(w)
    want = jax.grad(lambda w: jnp.sum(jax.grad(loss)(w, h0, xs) ** 2))(w)
    assert_trees_close(got, want, rtol=1e-4, atol=1e-5)
    ws = jnp.stack([w, 0.5 * w])
    got = jax.vmap(tg.grad(loss, policy=pol), (0, None, None))(ws, h0, xs)
    assert_trees_close(got, jax.vmap(jax.grad(loss), (0, None, None))(ws, h0, xs), rtol=2e-5)


def test_plan_and_arguments():
    plan = revolve_plan(7, 2)  # β(2, 2) = 6 < 7 <= β(2, 3) = 10: r = 3, 3·7 - C(5, 3) = 11
    assert plan.recomputed == 11 and plan.spine == (0, 4) and plan.slots == 2
    long = revolve_plan(10_000, 10)
    assert long.recomputed == 7 * 10_000 - binomial_steps(11, 6)  # 57,624
    assert long.slots == 10 and len(long.spine) == 10
    with pytest.raises(ValueError, match="snapshots must be a positive int"):
        tg.policies.scan_checkpoint(snapshots=0)
    with pytest.raises(ValueError, match="snapshots= picks its own"):
        tg.policies.scan_checkpoint(every=4, snapshots=3)
    assert "snapshots=3" in repr(tg.policies.scan_checkpoint(snapshots=3))


# ------------------------------------------------------------------ memory


def _live_device_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


class _PeakSpy:
    """A `save()`-like policy that measures live bytes whenever backward unpacks."""

    def __init__(self):
        self.peak = 0

    def pack(self, value, info):
        return value

    def unpack(self, packed, info):
        self.peak = max(self.peak, _live_device_bytes())
        return packed


def _measure(f, args, pol, spy):
    gc.collect()
    gc.freeze()  # later collections only look at what this run makes (fast)
    try:
        before = _live_device_bytes()
        out, vjp_fn = tg.vjp(f, *args, policy=pol, retain_residuals=False)
        after_fwd = _live_device_bytes()
        got = vjp_fn(jnp.float32(1.0))
    finally:
        gc.unfreeze()
    return after_fwd - before - out.nbytes, spy.peak - after_fwd, got


def test_carries_held_are_the_snapshots():
    """Eagerly (a Python loop of steps under a non-`save` policy): forward keeps the
    spine's snapshots and the last step; backward holds at most s snapshots, the carry in
    hand and one step's residuals (with a leak of the spine's snapshots, 8 more carries,
    the peak bound fails)."""
    T, B, D, s = 64, 64, 8, 8
    w, h0, xs = _args(T, B, D)
    carry = B * D * 4

    def f(w, h0):
        h, ys = lax.scan(lambda h, x: (jnp.tanh(h @ w + x), jnp.sin(h).sum(-1)), h0, xs)
        return jnp.sum(h) + jnp.sum(ys)

    spy = _PeakSpy()
    pol = _policy(s, base=spy)
    (rec,) = [r for r in tg.trace(f, policy=pol)(w, h0).records if r.primitive == "scan"]
    costs, lb = schedule_costs(rec), loop_bytes(rec)
    assert costs is not None and (costs.carries, costs.steps, costs.peak_carries) == (s, 1, s + 1)
    held, peak, got = _measure(f, (w, h0), pol, spy)
    # the first snapshot is h0 itself, the caller's array
    assert lb.total - carry - 64 <= held <= lb.total, (held, lb.total)
    want_peak = dataclasses.replace(lb, steps=1, checkpoints=costs.peak_carries - s).total
    # + the ys' cotangent (T x B), a step's slice of xs and of it, a few step temporaries
    other = T * B * 4 + (B * D + B) * 4 + 4 * carry
    assert peak <= want_peak + other, (peak, want_peak, other)
    assert_trees_close(got, jax.grad(f, argnums=(0, 1))(w, h0), rtol=2e-5, atol=1e-5)


def test_memory_report_shows_revolve():
    w, h0, xs = _args(1000, 8, 32)

    def f(w, h0):
        h, ys = lax.scan(lambda h, x: (jnp.tanh(h @ w + x), jnp.sum(h)), h0, xs)
        return jnp.sum(h) + jnp.sum(ys)

    text = str(tg.memory_report(f, policy=tg.policies.scan_checkpoint(snapshots=10))(w, h0))
    rerun = 4 * 1000 - binomial_steps(11, 3)  # β(10, 3) = 286 < 1000 <= β(10, 4) = 1001
    assert "carries kept (revolve, 10 snapshots): 10,240 B" in text
    assert f"keeps 10 carries + 1 steps; peak 11 carries + 1 steps; re-runs {rerun:,}" in text


# ------------------------------------------------------------------ the budget's choice


def _wide_body_loss(xs):
    """Each step keeps several activations of the carry's size: residuals dominate."""

    def f(w, h0):
        def body(h, x):
            a = jnp.tanh(h @ w + x)
            b = jnp.tanh(a * 1.5 + h)
            c = jnp.sin(b) * a
            return jnp.tanh(c + b), jnp.sum(c, -1)

        h, ys = lax.scan(body, h0, xs)
        return jnp.mean(h**2) + jnp.mean(ys)

    return f


@pytest.mark.parametrize("steps_worth", [4, 12])
def test_budget_chooses_a_schedule_that_fits(steps_worth):
    T, B, D = 48, 64, 8
    w, h0, xs = _args(T, B, D)
    f = _wide_body_loss(xs)
    (rec,) = [r for r in tg.trace(f)(w, h0).records if r.primitive == "scan"]
    lb = loop_bytes(rec)
    budget = steps_worth * lb.step
    spy = _PeakSpy()
    pol = tg.policies.budget(budget, base=spy)
    (rec,) = [r for r in tg.trace(f, policy=pol)(w, h0).records if r.primitive == "scan"]
    assert rec.schedule or rec.snapshots  # every step (48 steps' worth) does not fit
    costs = schedule_costs(rec)
    assert costs is not None
    pred = dataclasses.replace(lb, steps=costs.peak_steps, checkpoints=costs.peak_carries)
    assert pred.total <= budget
    held, peak, got = _measure(f, (w, h0), pol, spy)
    assert held <= budget
    # backward's residuals and carries beyond forward's, and the cotangents of a step
    assert held + peak <= budget + T * B * 4 + 8 * B * D * 4, (held, peak, budget)
    assert_trees_close(got, jax.grad(f, argnums=(0, 1))(w, h0), rtol=2e-5, atol=1e-5)
    # a schedule re-running fewer steps than the one chosen does not fit
    for p in tg.policies.loops.loop_plans(rec):
        assert p.recomputed >= costs.recomputed or p.peak_bytes > budget, p


def test_a_loose_budget_keeps_every_step():
    T, B, D = 48, 64, 8
    w, h0, xs = _args(T, B, D)
    f = _wide_body_loss(xs)
    (rec,) = [r for r in tg.trace(f)(w, h0).records if r.primitive == "scan"]
    pol = tg.policies.budget(loop_bytes(rec).total)
    (rec,) = [r for r in tg.trace(f, policy=pol)(w, h0).records if r.primitive == "scan"]
    assert (rec.schedule, rec.snapshots) == (0, 0)
    assert_trees_close(
        tg.grad(f, argnums=(0, 1), policy=pol)(w, h0),
        jax.grad(f, argnums=(0, 1))(w, h0),
        rtol=2e-5,
        atol=1e-6,
    )
