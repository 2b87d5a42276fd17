"""Loops and branches are records with bodies, not opaque fallbacks.

A ``scan`` record owns its body tape (``Record.bodies``) and its ``trip_count``; a
``cond`` / ``switch`` record owns one tape per branch. What that buys, checked here:
forward runs once (no re-run of the loop inside backward), tracing does not unroll,
the printed tape shows the body, per-step residuals are held (and offloaded) the way
the policy says and no more than ``jax.vjp`` holds, and anomaly detection names the
body's line and the step.
"""

from __future__ import annotations

import gc
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rand
from jax import lax

import tapegrad as tg
from tapegrad import policies as P

THIS_FILE = os.path.basename(__file__)


def line_of(marker: str) -> int:
    """The line number of the source line ending with ``marker``."""
    with open(__file__) as fh:
        for i, line in enumerate(fh, 1):
            if line.rstrip().endswith(marker):
                return i
    raise AssertionError(marker)


def all_records(tape):
    """Every record of a tape and, recursively, of its records' bodies."""
    for r in tape.records:
        yield r
        for body in r.bodies:
            yield from all_records(body)


def rnn(w, u, xs, h0):
    def step(h, x):
        h = jnp.tanh(h @ w + x @ u)  # RNN-STEP
        return h, h

    h, ys = lax.scan(step, h0, xs)
    return jnp.sum(ys) + jnp.sum(h)


def rnn_args(T, B=2, D=4, DIN=3, dtype="float32"):
    s = 1.0 / np.sqrt(D)  # keeps h @ w in tanh's live range at any width
    return (
        rand((D, D), dtype, -s, s, seed=1),
        rand((DIN, D), dtype, -s, s, seed=2),
        rand((T, B, DIN), dtype, -1, 1, seed=3),
        rand((B, D), dtype, -0.5, 0.5, seed=4),
    )


# ---------------------------------------------------------------------------
# Records and bodies


def test_scan_record_owns_its_body():
    T = 6
    tape = tg.trace(rnn)(*rnn_args(T))
    scans = [r for r in tape.records if r.primitive == "scan"]
    assert len(scans) == 1, tape
    (scan,) = scans
    assert len(scan.bodies) == 1, scan
    (body,) = scan.bodies
    assert isinstance(body, tg.Tape)
    prims = [r.primitive for r in body.records]
    assert "tanh" in prims and "dot_general" in prims, prims
    assert scan.trip_count == T
    fallbacks = [r for r in all_records(tape) if r.rule == "fallback"]
    assert not fallbacks, fallbacks
    # The body's records are the step's, at the step's source line.
    tanh = next(r for r in body.records if r.primitive == "tanh")
    assert tanh.source.endswith("(rnn.<locals>.step)"), tanh.source


def test_fori_loop_and_lax_map_are_scans_with_bodies():
    w = rand((3, 3), "float32", -0.5, 0.5, seed=5)
    f = lambda w: jnp.sum(lax.fori_loop(0, 4, lambda i, h: jnp.sin(h @ w), jnp.ones((2, 3))))
    g = lambda w: jnp.sum(lax.map(lambda x: jnp.tanh(x @ w), jnp.ones((5, 2, 3))))
    for fn, n in ((f, 4), (g, 5)):
        tape = tg.trace(fn)(w)
        (scan,) = [r for r in tape.records if r.primitive == "scan"]
        assert scan.trip_count == n and len(scan.bodies) == 1
        assert not [r for r in all_records(tape) if r.rule == "fallback"]


def test_cond_record_has_one_body_per_branch():
    x = rand((3,), "float32", -1, 1, seed=6)
    f = lambda x: jnp.sum(lax.cond(jnp.sum(x) > 0, jnp.sin, lambda z: z * z, x))
    tape = tg.trace(f)(x)
    conds = [r for r in tape.records if r.primitive == "cond"]
    assert len(conds) == 1, tape
    assert len(conds[0].bodies) == 2
    assert {r.primitive for b in conds[0].bodies for r in b.records} >= {"sin", "mul"}
    assert not [r for r in all_records(tape) if r.rule == "fallback"]


def test_switch_with_three_branches_has_three_bodies():
    x = rand((3,), "float32", -1, 1, seed=7)
    branches = [jnp.sin, jnp.cos, lambda z: jnp.exp(z) * 0.5]
    f = lambda x, i: jnp.sum(lax.switch(i, branches, x))
    tape = tg.trace(f, argnums=0)(x, 1)
    (cond,) = [r for r in tape.records if r.primitive == "cond"]
    assert len(cond.bodies) == 3
    assert not [r for r in all_records(tape) if r.rule == "fallback"]


def test_cond_inside_scan_body_is_nested():
    def f(w, xs, h0):
        def step(h, x):
            h = lax.cond(jnp.sum(x) > 0, lambda h: jnp.tanh(h @ w), lambda h: jnp.sin(h), h)
            return h, None

        return jnp.sum(lax.scan(step, h0, xs)[0])

    w, _, xs, h0 = rnn_args(5, DIN=4)
    tape = tg.trace(f)(w, xs, h0)
    (scan,) = [r for r in tape.records if r.primitive == "scan"]
    (body,) = scan.bodies
    (cond,) = [r for r in body.records if r.primitive == "cond"]
    assert len(cond.bodies) == 2
    assert not [r for r in all_records(tape) if r.rule == "fallback"]


# ---------------------------------------------------------------------------
# Forward runs once


def counting_rnn(counter):
    def f(w, u, xs, h0):
        def step(h, x):
            h = jnp.tanh(h @ w + x @ u)
            jax.debug.callback(counter, h)
            return h, h

        h, ys = lax.scan(step, h0, xs)
        return jnp.sum(ys) + jnp.sum(h)

    return f


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_forward_runs_once_under_save(jit):
    """A debug callback in a 7-step body fires 7 times in one tg.grad call, as in
    jax.grad: backward uses the saved per-step residuals, it does not re-run the loop."""
    T = 7
    args = rnn_args(T)
    calls = {"tg": 0, "jax": 0}

    def count(which):
        def cb(h):
            assert np.shape(h) == (2, 4)
            calls[which] += 1

        return cb

    g = tg.grad(counting_rnn(count("tg")), argnums=(0, 1), policy=P.save())
    got = (jax.jit(g) if jit else g)(*args)
    jax.block_until_ready(got)
    jax.effects_barrier()
    want_g = jax.grad(counting_rnn(count("jax")), argnums=(0, 1))
    want = (jax.jit(want_g) if jit else want_g)(*args)
    jax.block_until_ready(want)
    jax.effects_barrier()
    assert calls["jax"] == T, calls
    assert calls["tg"] == T, calls
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Tracing does not unroll; the printed tape shows the body


def _trace_time(T: int, repeat: int = 3) -> float:
    args = rnn_args(T)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        tg.trace(rnn)(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def test_tracing_does_not_unroll():
    small = tg.trace(rnn)(*rnn_args(10))
    big = tg.trace(rnn)(*rnn_args(10_000))
    assert len(big.records) == len(small.records)
    assert len(str(big)) <= 2 * len(str(small)), (len(str(big)), len(str(small)))
    (scan,) = [r for r in big.records if r.primitive == "scan"]
    assert len(scan.bodies[0].records) == len(
        next(r for r in small.records if r.primitive == "scan").bodies[0].records
    )
    _trace_time(10)  # warm caches
    t_small, t_big = _trace_time(10), _trace_time(10_000)
    assert t_big < 5 * t_small + 1.0, (t_big, t_small)


@pytest.mark.parametrize("T", [10, 10_000])
def test_printed_tape_shows_body_and_trip_count(T):
    text = str(tg.trace(rnn)(*rnn_args(T)))
    # The body's records are printed (not "jaxpr=…"), with the step's source line.
    assert "tanh" in text and "dot_general" in text, text
    assert f".py:{line_of('# RNN-STEP')}" in text, text
    # The trip count appears (allowing digit grouping: 10,000 / 10_000 / 10 000).
    digits = re.sub(r"(?<=\d)[,_ \u202f](?=\d{3})", "", text)
    assert re.search(rf"(?<!\d){T}(?!\d)", digits), text


# ---------------------------------------------------------------------------
# Residual bytes held between forward and backward


def live_bytes_by_kind() -> dict[str, int]:
    """Bytes of the live jax arrays by memory kind (None counted as device), after gc."""
    gc.collect()
    out: dict[str, int] = {}
    for a in jax.live_arrays():
        k = a.sharding.memory_kind or "device"
        out[k] = out.get(k, 0) + a.nbytes
    return out


def held(make_vjp) -> dict[str, int]:
    """New live bytes by kind after ``make_vjp()`` returns ``(out, vjp_fn)``, the
    output itself excluded: what vjp_fn holds for backward."""
    before = live_bytes_by_kind()
    out, vjp_fn = make_vjp()
    jax.block_until_ready(out)
    after = live_bytes_by_kind()
    grown = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    grown["device"] = grown.get("device", 0) - out.nbytes
    del vjp_fn
    return grown


MEM_T, MEM_B, MEM_D, MEM_DIN = 200, 8, 32, 4
ACTIVATIONS = MEM_T * MEM_B * MEM_D * 4  # one h per step, float32


@pytest.fixture(scope="module")
def mem_args():
    return rnn_args(MEM_T, B=MEM_B, D=MEM_D, DIN=MEM_DIN)


def test_save_holds_no_more_than_jax(mem_args):
    jax_bytes = held(lambda: jax.vjp(rnn, *mem_args))
    tg_bytes = held(lambda: tg.vjp(rnn, *mem_args, policy=P.save()))
    assert jax_bytes["device"] >= ACTIVATIONS  # the oracle keeps per-step activations
    assert tg_bytes["device"] <= jax_bytes["device"], (tg_bytes, jax_bytes)
    # save() really keeps per-step residuals (it does not re-run the loop in backward)
    assert tg_bytes["device"] >= ACTIVATIONS, tg_bytes


def test_offload_moves_per_step_residuals_to_host(mem_args):
    jax_bytes = held(lambda: jax.vjp(rnn, *mem_args))
    tg_bytes = held(lambda: tg.vjp(rnn, *mem_args, policy=P.offload()))
    assert tg_bytes["device"] <= 0.1 * jax_bytes["device"], (tg_bytes, jax_bytes)
    assert tg_bytes.get("pinned_host", 0) >= ACTIVATIONS, tg_bytes


def test_offload_gradient_matches_after_holding(mem_args):
    out, vjp_fn = tg.vjp(rnn, *mem_args, policy=P.offload())
    got = vjp_fn(jnp.ones_like(out))
    want = jax.vjp(rnn, *mem_args)[1](jnp.ones_like(out))
    for a, b in zip(got, want):
        scale = float(jnp.max(jnp.abs(b)))  # 200 steps summed: compare at the gradient's scale
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6 * scale)


# ---------------------------------------------------------------------------
# Anomaly detection names the body's line and the step


def log_rnn(w, xs, h0):
    def step(h, x):
        y = jnp.log(x)  # BODY-NAN
        h = jnp.tanh(h @ w + y)
        return h, h

    h, ys = lax.scan(step, h0, xs)
    return jnp.sum(ys) + jnp.sum(h)


@pytest.mark.filterwarnings("ignore:tapegrad anomaly detection is enabled")
def test_anomaly_names_body_line_and_step():
    w = rand((3, 3), "float32", -0.5, 0.5, seed=8)
    xs = np.array(rand((6, 2, 3), "float32", 0.5, 1.5, seed=9))
    xs[3] = -1.0  # NaN from log at step 3 (counting from 0)
    xs = jnp.asarray(xs)
    h0 = rand((2, 3), "float32", -0.5, 0.5, seed=10)
    assert np.isnan(np.asarray(jax.grad(log_rnn)(w, xs, h0))).any()  # the NaN is real
    with tg.detect_anomaly():
        with pytest.raises(tg.AnomalyError) as info:
            tg.grad(log_rnn)(w, xs, h0)
    msg = str(info.value)
    assert f"{THIS_FILE}:{line_of('# BODY-NAN')}" in msg, msg
    assert re.search(r"step\D{0,3}3\b", msg), msg
    assert "log" in msg, msg
