"""Backward's schedule (`engine.backward_schedule`) is what the interpreter does, and
what memory_report and the planner count.

The interpreter's own unpacks, recomputations, rule runs and releases (tapped through
`engine.interpret._TAP`) happen in exactly the schedule's order, on straight-line code,
a prefetching offload, checkpoint segments, a budget's plan, a scan and a cond. The
report's and the planner's figures for a plan are read off the same schedule: the
planner's predicted peak is memory_report's for the plan it chose.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import tapegrad as tg
from tapegrad.core.residual_policy import resolve_prefetch
from tapegrad.engine import interpret
from tapegrad.engine.backward_schedule import Recompute, Release, Run, Unpack, schedule
from tapegrad.policies import ResidualPolicy


class _Logged(ResidualPolicy):
    """A non-plain policy (identity pack/unpack): backward unpacks through it."""

    def pack(self, x, info):
        return x

    def unpack(self, x, info):
        return x


def _mlp(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w)
    return jnp.sum(x * x)


def _ckpt_mlp(ws, x):
    for w in ws:
        x = tg.checkpoint(lambda x, w: jnp.sin(jnp.tanh(x @ w)))(x, w)
    return jnp.sum(x)


def _scan(ws, x):
    def body(h, w):
        h = jnp.tanh(h @ w)
        return h, jnp.sum(h)

    h, ys = lax.scan(body, x, jnp.stack(ws))
    return jnp.sum(h) + jnp.sum(ys)


def _cond(ws, x):
    y = x @ ws[0]
    y = lax.cond(jnp.sum(y) > 0, jnp.sin, lambda v: v * v, y)
    return jnp.sum(jnp.exp(y @ ws[1]))


def _args(n=3, width=6):
    ks = jax.random.split(jax.random.PRNGKey(0), n + 1)
    ws = [jax.random.normal(k, (width, width)) / width for k in ks[:n]]
    return ws, jax.random.normal(ks[n], (4, width))


def _expected(tape, prefetch):
    """The schedule's events, as the tap writes them."""
    out = []
    for st in schedule(tape, prefetch).steps:
        for ev in st.events:
            if type(ev) is Unpack:
                out.append(("unpack", ev.key))
            elif type(ev) is Recompute:
                out.append(("recompute", ev.segment.id))
            elif type(ev) is Run:
                out.append(("run", ev.record.index))
            elif type(ev) is Release:
                out.append(("release", ev.key))
    return out


def _tapped(f, policy, args):
    """The top-level tape's backward as the interpreter ran it (the tap's events from
    the outermost backward: nested bodies' backward runs inside a record's ``run``)."""
    tape = tg.trace(f, argnums=(0, 1), policy=policy)(*args)
    out, res = interpret.forward(tape, list(jax.tree.leaves(args)), policy)
    log: list = []
    interpret._TAP = log
    try:
        interpret.backward(tape, res, [jnp.ones_like(out[0])])
    finally:
        interpret._TAP = None
    return tape, res, log


def _top_level(log, tape):
    """The tap's events of the top-level tape (a body's backward taps its own)."""
    return [(kind, key) for t, kind, key in log if t is tape]


@pytest.mark.parametrize(
    "f, policy",
    [
        (_mlp, _Logged()),
        (_mlp, tg.policies.offload(prefetch=2)),
        (_ckpt_mlp, _Logged()),
        (_scan, _Logged()),
        (_cond, _Logged()),
    ],
    ids=["mlp", "offload_prefetch", "checkpoint", "scan", "cond"],
)
def test_interpreter_executes_the_schedule(f, policy):
    args = _args()
    tape, res, log = _tapped(f, policy, args)
    prefetch = resolve_prefetch(policy, tape)
    want = _expected(tape, prefetch)
    assert _top_level(log, tape) == want
    assert any(e[0] == "unpack" for e in want) and any(e[0] == "release" for e in want)
    if f is _ckpt_mlp:
        assert any(e[0] == "recompute" for e in want)
    if prefetch:  # offload brings the next records' residuals back ahead of them
        assert any(ev.early for st in schedule(tape, prefetch).steps for ev in st.prefetch)


def test_every_kept_value_is_released_once_and_backward_drops_it():
    """Each residual key the schedule counts is released exactly once; with
    ``retain=False`` backward drops every packed value at its release."""
    for f in (_mlp, _ckpt_mlp, _scan, _cond):
        args = _args()
        tape = tg.trace(f, argnums=(0, 1), policy=_Logged())(*args)
        out, res = interpret.forward(tape, list(jax.tree.leaves(args)), _Logged())
        sched = schedule(tape)
        released = [ev.key for st in sched.steps for ev in st.events if type(ev) is Release]
        assert len(released) == len(set(released))
        assert set(released) == set(sched.uses)
        assert set(res.store) <= set(sched.uses)
        interpret.backward(tape, res, [jnp.ones_like(out[0])], retain=False)
        assert res.store == {}


@pytest.mark.parametrize(
    "f, frac",
    [(_mlp, 1.0), (_mlp, 0.75), (_mlp, 0.5), (_cond, 1.0), (_cond, 0.75)],
    ids=["mlp-save", "mlp-75%", "mlp-50%", "cond-save", "cond-75%"],
)
def test_planner_peak_is_the_reports_for_its_plan(f, frac):
    """A budget's chosen plan: the peak the planner predicted is the one memory_report
    counts for it (both read the one schedule), within the budget, and the gradient
    is jax's."""
    ws, x = _args(n=6, width=32)
    save = tg.memory_report(f, argnums=(0, 1))(ws, x).peak_beyond_inputs_bytes
    pol = tg.policies.budget(bytes=int(save * frac))
    rep = tg.memory_report(f, argnums=(0, 1), policy=pol)(ws, x)
    assert rep.planned_peak_bytes == rep.measured_device_peak_bytes
    assert rep.peak_beyond_inputs_bytes <= pol.bytes
    g = tg.grad(f, argnums=(0, 1), policy=pol)(ws, x)
    want = jax.grad(f, argnums=(0, 1))(ws, x)
    for a, e in zip(jax.tree.leaves(g), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, e, rtol=2e-5, atol=1e-6)


@jax.custom_vjp
def _sin_x(x):
    return jnp.sin(x) * x


def _sin_x_fwd(x):
    return _sin_x(x), (jnp.cos(x), x)


def _sin_x_bwd(r, g):
    c, x = r
    return ((c * x + jnp.sin(x)) * g,)


_sin_x.defvjp(_sin_x_fwd, _sin_x_bwd)


def _cvjp_mlp(ws, x):
    for w in ws:
        x = _sin_x(x @ w)
    return jnp.sum(x**2)


def test_a_recomputed_custom_vjp_residual_is_counted_while_held():
    """Recomputing a custom_vjp's record remakes its residuals (derived values), which
    backward holds until its rule runs. The planner once counted only the segment's
    outputs: at 40% of save() it predicted 7,168 B and the run held 8,192 B, over the
    7,372 B budget. Counted from the one schedule, plan and run agree, within budget."""
    k = jax.random.PRNGKey(0)
    ws = [jax.random.normal(jax.random.fold_in(k, i), (32, 32)) / 6 for i in range(6)]
    x = jax.random.normal(k, (8, 32))
    save = tg.memory_report(_cvjp_mlp, argnums=(0,))(ws, x).peak_beyond_inputs_bytes
    pol = tg.policies.budget(bytes=int(save * 0.4))
    rep = tg.memory_report(_cvjp_mlp, argnums=(0,), policy=pol)(ws, x)
    assert rep.planned_peak_bytes == rep.measured_device_peak_bytes
    assert rep.peak_beyond_inputs_bytes <= pol.bytes
    g = tg.grad(_cvjp_mlp, policy=pol)(ws, x)
    for a, e in zip(g, jax.grad(_cvjp_mlp)(ws, x)):
        np.testing.assert_allclose(a, e, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(8))
def test_random_programs_a_budget_at_saves_peak_is_met(seed):
    """On random programs (`_fuzz_programs`, fixed seeds): a budget of save()'s own
    peak is feasible and gives jax's gradient; at 60% of it, either the plan's peak,
    predicted and measured alike, is within the budget, or the BudgetError names a
    smallest peak no higher than save()'s."""
    import random
    import re

    from _fuzz_programs import RandomDraw, build, generate, inputs

    prog = generate(RandomDraw(random.Random(seed)))
    f, xs = build(prog), inputs(prog)
    nums = tuple(range(len(xs)))
    save = tg.memory_report(f, argnums=nums)(*xs).peak_beyond_inputs_bytes
    want = jax.grad(f, argnums=nums)(*xs)
    at_save = tg.policies.budget(bytes=max(save, 1))
    got = tg.grad(f, argnums=nums, policy=at_save)(*xs)
    for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, e, rtol=2e-5, atol=1e-6)
    pol = tg.policies.budget(bytes=max(int(save * 0.6), 1))
    try:
        rep = tg.memory_report(f, argnums=nums, policy=pol)(*xs)
    except tg.policies.BudgetError as e:
        least = int(
            re.search(r"smallest peak among the plans tried is ([\d,]+)", str(e))[1].replace(
                ",", ""
            )
        )
        assert least <= save, str(e)
    else:
        assert rep.peak_beyond_inputs_bytes <= pol.bytes
        assert rep.planned_peak_bytes in (None, rep.measured_device_peak_bytes)


@jax.custom_vjp
def _layer(x, w):
    return jnp.tanh(w @ x)


def _layer_fwd(x, w):
    y = jnp.tanh(w @ x)
    t = 2.0 * y
    # its output, an operand, one array twice and a constant: jaxopt's and equinox's
    # solvers keep residuals like these
    return y, (y, w, x, t, t, 1.0)


def _layer_bwd(r, g):
    y, w, x, t, t2, c = r
    dy = g * (1.0 - (t * t2) / 4.0) * c
    return w.T @ dy, jnp.outer(dy, x)


_layer.defvjp(_layer_fwd, _layer_bwd)


def _aliased(x0, w):
    y = _layer(jnp.cos(x0), w)
    return jnp.sum(jnp.sin(y) * y)


def test_a_custom_vjp_residual_that_is_its_output_or_operand_is_one_value():
    """A custom_vjp's residual that is the call's output (also kept by the next record),
    one of its operands, another residual or a constant is the very array of that value
    when run: the planner counts it once (or not at all), as memory_report measures, so
    a budget at save()'s own peak is met and predicted as run (jaxopt's fixed point: 60
    B planned for 44 B held, before)."""
    x0, w = jnp.linspace(-1.0, 1.0, 16), jnp.eye(16) * 0.5 + 0.01
    save = tg.memory_report(_aliased, argnums=(0, 1))(x0, w)
    # beyond the inputs: y (the output, kept by sin and mul too), cos(x0), t and sin(y)
    assert save.peak_beyond_inputs_bytes == 4 * 64
    pol = tg.policies.budget(bytes=save.peak_beyond_inputs_bytes)
    rep = tg.memory_report(_aliased, argnums=(0, 1), policy=pol)(x0, w)
    assert rep.planned_peak_bytes == rep.measured_device_peak_bytes
    assert rep.peak_beyond_inputs_bytes <= pol.bytes
    want = jax.grad(_aliased, argnums=(0, 1))(x0, w)
    for p in (None, pol):
        got = tg.grad(_aliased, argnums=(0, 1), policy=p)(x0, w)
        for a, e in zip(got, want):
            np.testing.assert_allclose(a, e, rtol=2e-5, atol=1e-6)


@jax.custom_vjp
def _scaled(x, c, flag):
    return jnp.where(flag, x * c, x)


def _scaled_fwd(x, c, flag):
    return _scaled(x, c, flag), (c, c, flag)


def _scaled_bwd(r, g):
    c, c2, flag = r
    return jnp.where(flag, g * c * c2 / c2, g), jnp.zeros_like(c), None


_scaled.defvjp(_scaled_fwd, _scaled_bwd)


_ON = jnp.array([True, True, False, True])  # closed over: one of the tape's constants


def _literal_kept(x):
    # a literal and a constant handed back as they are, then kept by a custom_vjp as its
    # operands (one twice): diffrax's adjoints keep stop_gradient'ed flags and step
    # sizes like these
    c = jax.lax.stop_gradient(jnp.float32(2.0))
    flag = jax.lax.stop_gradient(_ON)
    return jnp.sum(jnp.sin(_scaled(jnp.cos(x), c, flag)))


def test_a_kept_literal_is_no_residual():
    """A literal or a constant that a record hands back as it is (`stop_gradient(2.0)`)
    is the tape's own, no array backward holds: the planner and memory_report count none
    of it (the planner counted a kept literal twice; the report, a literal's numpy
    array and the constant), so they agree with each other and with what `del vjp_fn`
    frees."""
    x = jnp.linspace(-1.0, 1.0, 4)
    rep = tg.memory_report(_literal_kept)(x)
    assert rep.peak_beyond_inputs_bytes == 16  # sin's input, all that backward holds
    pol = tg.policies.budget(bytes=rep.peak_beyond_inputs_bytes)
    with pytest.warns(UserWarning, match="save\\(\\) keeps 16 B"):  # the planner's figure too
        planned = tg.memory_report(_literal_kept, policy=pol)(x)
    assert planned.planned_peak_bytes == planned.measured_device_peak_bytes == 16
    want = jax.grad(_literal_kept)(x)
    for p in (None, pol):
        np.testing.assert_allclose(tg.grad(_literal_kept, policy=p)(x), want, rtol=1e-6)
