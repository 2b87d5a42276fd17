"""Nested (multi-level) loop checkpoint schedules and reverse scans: gradients against
jax, carries kept and backward's peak by `jax.live_arrays`, forward steps re-run counted
by a callback in the body and compared with the schedule's formula."""

from __future__ import annotations

import dataclasses
import gc

import jax
import jax.numpy as jnp
import pytest
from conftest import assert_trees_close
from jax import lax

import tapegrad as tg
from tapegrad.engine.loops.saves import loop_bytes, schedule_costs
from tapegrad.policies.loops import balanced_levels, halving_levels

SCHEDULES = {
    "sqrt": dict(every="sqrt"),
    "sqrt2": dict(every="sqrt", levels=2),
    "log": dict(every="log"),
    "k3x3": dict(every=3, levels=3),
}


def _policy(name: str, **kw):
    return tg.policies.scan_checkpoint(min_length=2, **SCHEDULES[name], **kw)


def rnn(w, h0, xs, reverse=False):
    """A tanh RNN returning its last carry and its per-step outputs (ys)."""

    def body(h, x):
        h = jnp.tanh(h @ w + x)
        return h, jnp.sin(h).sum(-1)

    return lax.scan(body, h0, xs, reverse=reverse)


def _args(T: int, B: int = 2, D: int = 3, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 3)
    w = jax.random.normal(k[0], (D, D)) / D**0.5
    h0 = jax.random.normal(k[1], (B, D))
    xs = jax.random.normal(k[2], (T, B, D))
    return w, h0, xs


def _cotangent(out, seed: int = 1):
    leaves, tree = jax.tree.flatten(out)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return tree.unflatten([jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


# Every T, every schedule, both directions, eager and under jit, with ys outputs.
CASES = [
    (1, "sqrt2", False, False),
    (2, "log", True, True),
    (7, "sqrt", True, False),
    (7, "k3x3", False, True),
    (64, "sqrt2", True, True),
    (64, "log", False, False),
    (100, "k3x3", True, False),
    (100, "sqrt", False, True),
]


@pytest.mark.parametrize("T,name,reverse,jit", CASES)
def test_vjp_matches_jax(T, name, reverse, jit):
    args = _args(T)

    def f(w, h0, xs):
        return rnn(w, h0, xs, reverse)

    out, vjp_fn = tg.vjp(f, *args, policy=_policy(name))
    want_out, want_vjp = jax.vjp(f, *args)
    assert_trees_close(out, want_out, rtol=1e-5, atol=1e-6)
    ct = _cotangent(want_out)
    got = (jax.jit(vjp_fn) if jit else vjp_fn)(ct)
    assert_trees_close(got, want_vjp(ct), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("reverse", [False, True])
def test_grad_under_jit_matches_jax_grad(reverse):
    args = _args(30)

    def loss(w, h0, xs):
        h, ys = rnn(w, h0, xs, reverse)
        return jnp.mean(h**2) + jnp.mean(ys * jnp.arange(1.0, 31.0)[:, None])

    g = jax.jit(tg.grad(loss, argnums=(0, 1, 2), policy=_policy("sqrt2")))
    assert_trees_close(g(*args), jax.grad(loss, argnums=(0, 1, 2))(*args), rtol=2e-5, atol=1e-6)


def test_second_order_matches_jax():
    args = _args(7)

    def loss(w, h0, xs):
        h, ys = rnn(w, h0, xs, True)
        return jnp.sum(h**2) + jnp.sum(ys)

    pol = _policy("sqrt2")
    got = tg.grad(lambda w: jnp.sum(tg.grad(loss, policy=pol)(w, *args[1:]) ** 2))(args[0])
    want = jax.grad(lambda w: jnp.sum(jax.grad(loss)(w, *args[1:]) ** 2))(args[0])
    assert_trees_close(got, want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ the schedules


def test_levels_on_the_tape():
    def scan_rec(T, **kw):
        tape = tg.trace(rnn, policy=tg.policies.scan_checkpoint(**kw))(*_args(T))
        (rec,) = [r for r in tape.records if r.primitive == "scan"]
        return rec.schedule, rec.inner_schedule

    assert scan_rec(1000, levels=2) == (100, (10,))  # ceil(T^(2/3)), ceil(T^(1/3))
    assert scan_rec(30) == (6, ())  # one level: ceil(sqrt(30))
    assert scan_rec(64, every="log") == (32, (16, 8, 4, 2))
    assert scan_rec(64, every=16, levels=3) == (16, (7, 3))  # 16^(2/3), 16^(1/3) rounded up
    assert balanced_levels(10**6, 2) == (10**4, 100)
    assert halving_levels(5) == (4, 2)


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="levels must be a positive int"):
        tg.policies.scan_checkpoint(levels=0)
    with pytest.raises(ValueError, match="every='log' picks its own levels"):
        tg.policies.scan_checkpoint("log", levels=2)
    with pytest.raises(ValueError, match="'sqrt' or 'log'"):
        tg.policies.scan_checkpoint("cube")


def _schedule_formula(T: int, levels: tuple[int, ...]) -> tuple[int, int]:
    """(carries kept after forward, forward steps re-run in backward), derived by hand:
    a level of k steps keeps T // k carries and re-runs each full segment once (with the
    next level inside it); the remainder goes to the next level."""
    levels = tuple(k for k in levels if k < T)
    if not levels:
        return 0, 0
    k, inner = levels[0], levels[1:]
    n, r = divmod(T, k)
    c_rem, rerun_rem = _schedule_formula(r, inner)
    _, rerun_seg = _schedule_formula(k, inner)
    return n + c_rem, rerun_rem + n * (k + rerun_seg)


@pytest.mark.parametrize(
    "T,name,reverse,want_rerun",
    [
        (64, "sqrt", False, 64),  # k=8: 8 segments of 8 re-run once
        (64, "sqrt2", True, 128),  # (16, 4): 4 x (16 + 4 x 4)
        (64, "log", False, 5 * 64),  # 32, 16, 8, 4, 2: every level re-runs all 64 steps
        (100, "k3x3", True, None),
    ],
)
def test_forward_steps_rerun_match_the_formula(T, name, reverse, want_rerun):
    runs = [0]

    def count():
        runs[0] += 1

    def loss(w, h0, xs):
        def body(h, x):
            jax.debug.callback(count)
            h = jnp.tanh(h @ w + x)
            return h, h.sum()

        h, ys = lax.scan(body, h0, xs, reverse=reverse)
        return jnp.sum(h) + jnp.sum(ys)

    pol = _policy(name)
    args = _args(T)
    (rec,) = [r for r in tg.trace(loss, policy=pol)(*args).records if r.primitive == "scan"]
    levels = (rec.schedule, *rec.inner_schedule)
    carries, rerun = _schedule_formula(T, levels)
    costs = schedule_costs(rec)
    assert costs is not None and (costs.carries, costs.recomputed) == (carries, rerun)
    if want_rerun is not None:
        assert rerun == want_rerun
    g = tg.grad(loss, argnums=(0, 1, 2), policy=pol)(*args)
    jax.effects_barrier()
    assert runs[0] == T + rerun  # the forward, then what backward re-runs
    runs[0] = 0
    assert_trees_close(g, jax.grad(loss, argnums=(0, 1, 2))(*args), rtol=2e-5, atol=1e-5)


# ------------------------------------------------------------------ memory


def _live_device_bytes() -> int:
    gc.collect()  # cycles among the interpreter's objects would hold arrays until then
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


class _PeakSpy:
    """A `save()`-like policy that measures live device bytes whenever backward unpacks a
    residual (eagerly a non-`save` policy sees concrete steps one at a time)."""

    def __init__(self, every: int = 1):
        self.peak, self.every, self.calls = 0, every, 0

    def pack(self, value, info):
        return value

    def unpack(self, packed, info):
        self.calls += 1
        if self.calls % self.every == 0:  # sampling is slow with many live arrays
            self.peak = max(self.peak, _live_device_bytes())
        return packed


@pytest.mark.parametrize("name,reverse", [("sqrt", False), ("sqrt2", False), ("sqrt2", True)])
def test_carries_kept_and_backward_peak_match_the_schedule(name, reverse):
    T, B, D = 64, 64, 8  # a wide carry, a small weight: residuals dominate the bytes
    w, h0, xs = _args(T, B, D)
    carry = B * D * 4

    def f(w, h0):
        h, ys = rnn(w, h0, xs, reverse)
        return jnp.sum(h) + jnp.sum(ys)

    spy = _PeakSpy()
    pol = _policy(name, base=spy)
    (rec,) = [r for r in tg.trace(f, policy=pol)(w, h0).records if r.primitive == "scan"]
    costs = schedule_costs(rec)
    assert costs is not None
    lb = loop_bytes(rec)
    gc.collect()
    gc.freeze()  # later collections only look at what this test makes (fast)
    try:
        before = _live_device_bytes()
        out, vjp_fn = tg.vjp(f, w, h0, policy=pol)
        after_fwd = _live_device_bytes()
        got = vjp_fn(jnp.float32(1.0))
    finally:
        gc.unfreeze()
    # forward keeps exactly the schedule's carries (and the last level's remainder steps)
    held = after_fwd - before - out.nbytes
    want_held = dataclasses.replace(lb, steps=costs.steps, checkpoints=costs.carries).total
    assert want_held <= held <= want_held + 64, (held, want_held)
    assert held <= 0.13 * lb.step * T  # keeping every step: T steps' residuals

    # backward's peak: the schedule's (inner carries, one innermost segment's residuals),
    # plus the innermost segment's slice of xs and of the ys' cotangent, the ys' cotangent
    # itself (T x B), and a few step-sized cotangents and temporaries. Outer levels hand
    # their segments on as windows: no copy of an outer segment's inputs.
    peak = spy.peak - after_fwd
    extra = costs.peak_carries - costs.carries
    want_peak = dataclasses.replace(lb, steps=costs.peak_steps, checkpoints=extra).total
    other = costs.levels[-1] * (B * D + B) * 4 + T * B * 4 + 16 * carry
    assert want_peak <= peak <= want_peak + other, (peak, want_peak, other)
    assert peak < 0.6 * lb.step * T  # keeping every step: T steps' residuals

    want = jax.vjp(f, w, h0)[1](jnp.float32(1.0))
    assert_trees_close(got, want, rtol=2e-5, atol=1e-5)


def test_retained_steps_do_not_keep_their_input_slices():
    """Keep-every-step under a non-`save` policy (eagerly: a Python loop of steps whose
    stores `vjp_fn` retains): backward hands each step its slice of xs (``x @ u`` needs it
    for u's cotangent) and takes it back, so backward's peak stays well under the T
    slices (it held all of them, 157 KB here, before)."""
    T, B, D = 64, 64, 8
    k = jax.random.split(jax.random.key(0), 3)
    w, u = jax.random.normal(k[0], (D, D)) / 3, jax.random.normal(k[1], (D, D)) / 3
    xs = jax.random.normal(k[2], (T, B, D))

    def f(w, u):
        def body(h, x):
            h = jnp.tanh(h @ w + x @ u)
            return h, jnp.sum(h, -1)

        h, ys = lax.scan(body, jnp.zeros((B, D)), xs)
        return jnp.mean(h**2) + jnp.mean(ys)

    spy = _PeakSpy(every=8)  # the slices pile up to the last step: late samples see them
    gc.collect()
    gc.freeze()
    try:
        out, vjp_fn = tg.vjp(f, w, u, policy=spy)
        after_fwd = _live_device_bytes()
        got = vjp_fn(jnp.float32(1.0))
    finally:
        gc.unfreeze()
    assert spy.peak - after_fwd < 0.4 * T * B * D * 4, (spy.peak - after_fwd, T * B * D * 4)
    assert_trees_close(got, jax.grad(f, argnums=(0, 1))(w, u), rtol=2e-5, atol=1e-6)
    assert_trees_close(vjp_fn(jnp.float32(1.0)), got, rtol=0, atol=0)  # retained


def test_memory_report_shows_the_schedule():
    w, h0, xs = _args(1000, 8, 32)

    def f(w, h0):
        h, ys = rnn(w, h0, xs)
        return jnp.sum(h) + jnp.sum(ys)

    rep = tg.memory_report(f, policy=tg.policies.scan_checkpoint(levels=2))(w, h0)
    text = str(rep)
    assert "carries kept every 100/10 steps: 10,240 B" in text
    assert "keeps 10 carries + 0 steps; peak 20 carries + 10 steps; re-runs 2,000 steps" in text
    one = str(tg.memory_report(f, policy=tg.policies.scan_checkpoint())(w, h0))
    assert "keeps 31 carries + 8 steps; peak 31 carries + 32 steps; re-runs 992 steps" in one
