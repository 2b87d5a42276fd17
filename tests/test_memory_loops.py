"""Residual bytes of loops and branches: the tape's count (one step's residuals × the trip
count, a cond's branches summed), and `tg.memory_report`'s, read off the arrays a real run
keeps and checked against `jax.live_arrays()` between `tg.vjp`'s forward and backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import live_bytes_by_kind
from jax import lax

import tapegrad as tg
from tapegrad import policies as P
from tapegrad.engine.loops.saves import loop_residual_bytes, step_residual_bytes

T, B, D = 200, 8, 32
ACT = B * D * 4  # one step's activation h: f32[8, 32]


def rnn(w, u, h0, xs):
    def step(h, x):
        h = jnp.tanh(h @ w + x @ u)
        return h, None

    h, _ = lax.scan(step, h0, xs)
    return jnp.sum(h**2)


def rnn_cond(w, u, h0, xs):
    """The RNN with a data-dependent branch in its step."""

    def step(h, x):
        z = h @ w + x @ u
        h = lax.cond(jnp.sum(z) > 0, lambda z: jnp.tanh(z), lambda z: jnp.sin(z) * 0.5, z)
        return h, jnp.sum(h)

    h, ys = lax.scan(step, h0, xs)
    return jnp.sum(h**2) + jnp.sum(ys)


@pytest.fixture(scope="module")
def args():
    k = jax.random.split(jax.random.key(0), 4)
    w = jax.random.normal(k[0], (D, D)) / 6
    u = jax.random.normal(k[1], (D, D)) / 6
    h0 = jax.random.normal(k[2], (B, D))
    xs = jax.random.normal(k[3], (T, B, D))
    return w, u, h0, xs


def held_by_vjp(f, args, policy):
    """Bytes by memory kind that `tg.vjp`'s forward leaves alive (its output excluded):
    the residuals ``vjp_fn`` holds. The inputs exist before the baseline."""
    before = live_bytes_by_kind()
    out, vjp_fn = tg.vjp(f, *args, policy=policy)
    jax.block_until_ready(out)
    after = live_bytes_by_kind()
    grown = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    grown["device"] = grown.get("device", 0) - out.nbytes
    vjp_fn(jnp.ones_like(out))  # backward still works off what was held
    return grown


def loop_row(rep):
    (row,) = [r for r in rep.records if r.body]
    return row


# ------------------------------------------------------------------ the tape's count


def test_tape_counts_per_step_residuals_times_the_trip_count(args):
    tape = tg.trace(rnn, argnums=(0, 1, 2, 3))(*args)
    (scan,) = [r for r in tape.records if r.bodies]
    # per step: the carry h that dot_general(h, w) saves for dw, and tanh's output; but
    # step t's h is step t-1's tanh output: kept once, the first step's h besides
    assert step_residual_bytes(scan) == 2 * ACT
    assert loop_residual_bytes(scan) == ACT * T + ACT
    kept = tape.residual_vars()
    assert kept[("body", scan.index)] == ACT * T + ACT
    # the consts (w, u) and the scanned xs are kept once, by the scan record itself
    assert {str(s) for s in scan.saves} >= {"in0", "in1", "in3"}
    assert tape.saved_bytes == sum(kept.values())
    straight = [k for k in kept if not (type(k) is tuple and k[0] == "body")]
    assert tape.saved_bytes - ACT * (T + 1) == sum(kept[k] for k in straight)


def test_tape_count_is_what_a_traced_program_holds(args):
    """Under jit the scan's residuals are stacked outputs: the tape's count of them is
    what jax.vjp of the same function keeps, to within the last carry and the inputs."""
    tape = tg.trace(rnn, argnums=(0, 1, 2, 3))(*args)
    _, vjp_fn = jax.vjp(rnn, *args)
    arg_ids = {id(a) for a in args}
    jax_bytes = sum(
        x.nbytes for x in jax.tree.leaves(vjp_fn) if hasattr(x, "nbytes") and id(x) not in arg_ids
    )
    input_ids = {v.id for v in tape.inputs}
    ours = sum(n for k, n in tape.residual_vars().items() if k not in input_ids)
    assert ours >= ACT * T
    assert ours <= jax_bytes + 2 * ACT  # not more than jax keeps, beyond a step or so


def test_cond_counts_every_branch_under_a_trace(args):
    tape = tg.trace(rnn_cond, argnums=(0, 1, 2, 3))(*args)
    (scan,) = [r for r in tape.records if r.bodies]
    (cond,) = [r for r in scan.bodies[0].records if r.bodies]
    assert cond.trip_count == 1 and len(cond.bodies) == 2
    # tanh saves its output, sin its input (the cond's operand: kept once, by the cond),
    # mul by 0.5 nothing: the union over branches is tanh's output
    assert loop_residual_bytes(cond) == ACT
    assert scan.bodies[0].residual_vars()[("body", cond.index)] == ACT
    assert loop_residual_bytes(scan) == T * step_residual_bytes(scan)
    assert step_residual_bytes(scan) >= ACT + ACT  # the cond's union + its operand z


def test_nested_loops_multiply():
    def f(w, xs):
        def outer(h, x):
            def inner(g, _):
                return jnp.tanh(g @ w), None

            g, _ = lax.scan(inner, h + x, None, length=5)
            return g, None

        h, _ = lax.scan(outer, jnp.zeros((2, 4)), xs)
        return jnp.sum(h)

    w, xs = jnp.eye(4) * 0.5, jnp.ones((3, 2, 4))
    tape = tg.trace(f, argnums=(0, 1))(w, xs)
    (outer,) = [r for r in tape.records if r.bodies]
    (inner,) = [r for r in outer.bodies[0].records if r.bodies]
    # g for dw and tanh's output, 5 steps: g is the step before's tanh output but once
    assert loop_residual_bytes(inner) == 5 * 32 + 32
    assert loop_residual_bytes(outer) == 3 * step_residual_bytes(outer)
    assert step_residual_bytes(outer) >= loop_residual_bytes(inner)
    rep = tg.memory_report(f, argnums=(0, 1))(w, xs)
    (row,) = [r for r in rep.records if r.body]
    (inner_row,) = [r for r in row.body if r.body]
    assert inner_row.steps == 3 and all(x.steps == 15 for x in inner_row.body)
    assert inner_row.body_bytes == 3 * loop_residual_bytes(inner)
    held = held_by_vjp(f, (w, xs), P.save())
    assert held["device"] <= rep.residual_bytes - rep.input_bytes <= held["device"] + 64


# ------------------------------------------------------------------ memory_report


def test_rnn_report_agrees_with_live_arrays_under_save(args):
    rep = tg.memory_report(rnn, argnums=(0, 1, 2, 3))(*args)
    held = held_by_vjp(rnn, args, P.save())
    measured = rep.residual_bytes - rep.input_bytes
    assert held.get("pinned_host", 0) == rep.host_bytes == 0
    assert held["device"] <= measured <= held["device"] + 3 * ACT
    row = loop_row(rep)
    assert row.primitive == "scan" and row.steps == 1
    dot, tanh = row.body
    assert (dot.primitive, tanh.primitive) == ("dot_general", "tanh")
    # one activation per step, T steps, indented one level; the carry dot_general saves
    # is the step before's tanh output, counted there: dot_general holds only h0
    assert (tanh.steps, tanh.step_bytes, tanh.bytes, tanh.depth) == (T, ACT, T * ACT, 1)
    assert (dot.steps, dot.bytes, dot.depth) == (T, ACT, 1)
    assert row.body_bytes == (T + 1) * ACT
    assert rep.residual_bytes == tg.trace(rnn, argnums=(0, 1, 2, 3))(*args).saved_bytes
    assert rep.peak_bytes >= rep.residual_bytes


def test_rnn_report_under_offload_keeps_the_steps_on_host(args):
    rep = tg.memory_report(rnn, argnums=(0, 1, 2, 3), policy=P.offload())(*args)
    assert rep.host_bytes >= T * B * D * 4
    # the inputs (w, u, xs) stay where the caller holds them; nothing else on device
    assert rep.device_bytes - rep.input_bytes <= ACT
    row = loop_row(rep)
    assert [r.host_bytes for r in row.body] == [ACT, T * ACT]  # h0 once, then tanh's outputs
    assert all(r.device_bytes == 0 for r in row.body)
    held = held_by_vjp(rnn, args, P.offload())
    assert held.get("pinned_host", 0) == rep.host_bytes
    assert held.get("device", 0) <= rep.device_bytes
    # backward unpacks the record's own saves and one step's residuals on top
    assert rep.peak_bytes >= rep.residual_bytes + 2 * ACT
    assert ("bwd 0 step", rep.peak_bytes) in rep.timeline


def test_report_peak_covers_what_backward_holds(args):
    """Sampled from inside backward (an unpack hook, once per residual per step): the live
    bytes never exceed the report's peak by more than the cotangents in flight."""
    samples = []

    def sample(a):
        samples.append(sum(b.nbytes for b in jax.live_arrays()))
        return a

    pol = P.hooks(lambda a: a, sample)
    rep = tg.memory_report(rnn, argnums=(0, 1, 2, 3), policy=pol)(*args)
    base = sum(b.nbytes for b in jax.live_arrays())
    tg.grad(rnn, argnums=(0, 1, 2, 3), policy=pol)(*args)
    measured = max(samples) - base
    # cotangents: dxs (T steps, stacked at the end), dw, du, the carry's: a few on top
    assert measured <= rep.peak_bytes - rep.input_bytes + T * ACT + 8 * ACT
    assert rep.peak_bytes - rep.input_bytes >= T * ACT


@pytest.mark.parametrize("base", [P.save(), P.offload()], ids=repr)
def test_checkpointed_scan_counts_its_carries_and_last_steps(args, base):
    every = 16
    pol = P.scan_checkpoint(every=every, base=base)
    tape = tg.trace(rnn, argnums=(0, 1, 2, 3), policy=pol)(*args)
    (scan,) = [r for r in tape.records if r.bodies]
    assert scan.schedule == every
    n, r = T // every, T % every
    # a carry per full segment, and the last r steps' residuals (h0 of them once)
    assert loop_residual_bytes(scan) == n * ACT + r * ACT + ACT
    assert "carries every 16: 12 × 1,024 B + last 8 steps" in str(tape)
    rep = tg.memory_report(rnn, argnums=(0, 1, 2, 3), policy=pol)(*args)
    held = held_by_vjp(rnn, args, pol)
    measured = rep.residual_bytes - rep.input_bytes
    total = held.get("device", 0) + held.get("pinned_host", 0)
    assert total <= measured <= total + 2 * ACT
    row = loop_row(rep)
    assert row.checkpoint_bytes == n * ACT and all(x.steps == r for x in row.body)
    assert f"carries kept every {every} steps: {n * ACT:,} B" in str(rep)
    # backward recomputes one segment's residuals at a time, on top of what is kept
    assert rep.peak_bytes >= rep.residual_bytes + every * ACT


@pytest.mark.parametrize("policy", [P.save(), P.offload()], ids=repr)
def test_cond_inside_the_loop_agrees_with_live_arrays(args, policy):
    rep = tg.memory_report(rnn_cond, argnums=(0, 1, 2, 3), policy=policy)(*args)
    held = held_by_vjp(rnn_cond, args, policy)
    measured = rep.residual_bytes - rep.input_bytes
    total = held.get("device", 0) + held.get("pinned_host", 0)
    assert total <= measured <= total + 3 * ACT
    row = loop_row(rep)
    (cond,) = [r for r in row.body if r.primitive == "cond"]
    branches = {r.branch for r in cond.body}
    if policy is P.save() or repr(policy) == "save()":
        # one lax.scan: the cond is a lax.switch holding the union (zeros where not taken)
        assert branches == {1} and all(r.steps == T for r in cond.body)
    else:
        # a Python loop: each step ran one branch and holds only its residuals
        (tanh,) = cond.body
        assert 0 < tanh.steps < T and tanh.bytes == tanh.steps * ACT


def test_top_level_cond_report_holds_the_branch_taken():
    def f(x, w):
        y = x @ w
        return lax.cond(
            jnp.sum(y) > 0, lambda y: jnp.sum(jnp.tanh(y)), lambda y: jnp.sum(jnp.exp(y)), y
        )

    x, w = jnp.ones((4, 8)), jnp.full((8, 8), 0.1)
    tape = tg.trace(f, argnums=(0, 1))(x, w)
    (cond,) = [r for r in tape.records if r.bodies]
    assert loop_residual_bytes(cond) == 2 * 4 * 8 * 4  # tanh's and exp's outputs: both
    rep = tg.memory_report(f, argnums=(0, 1))(x, w)
    (row,) = [r for r in rep.records if r.body]
    assert [(r.primitive, r.branch) for r in row.body] == [("tanh", 1)]  # sum > 0
    held = held_by_vjp(f, (x, w), P.save())
    assert held["device"] == rep.residual_bytes - rep.input_bytes
    text = str(rep)
    assert "cond branch 1:" in text and "cond branch 0" not in text


def freed_by_del_vjp(f, x, policy=None, jit: bool = False) -> dict[str, int]:
    """Bytes by memory kind that ``del vjp_fn`` frees after `tg.vjp`'s forward (eagerly,
    or of a jitted ``tg.vjp``): what ``vjp_fn`` holds."""
    run = lambda x: tg.vjp(f, x, policy=policy)  # noqa: E731
    out, vjp_fn = jax.jit(run)(x) if jit else run(x)
    jax.block_until_ready(out)
    held = live_bytes_by_kind()
    del vjp_fn
    after = live_bytes_by_kind()
    return {k: held.get(k, 0) - after.get(k, 0) for k in set(held) | set(after)}


def _switch3(x):
    """Branch ``argmax(x) - 2`` (clamped): the input picks each of the three."""
    return lax.switch(jnp.argmax(x) - 2, [jnp.exp, jnp.sin, lambda x: x * x], x).sum()


def _cond_in_scan(x):
    def step(c, a):
        return lax.cond(a > 2, jnp.sin, jnp.exp, c * a), None

    return lax.scan(step, 1.0, x)[0]


def _nested_cond(x):
    inner = lambda x: lax.cond(x[0] > 0, jnp.tanh, jnp.exp, x)  # noqa: E731
    return lax.cond(jnp.sum(x) > 1, inner, jnp.sin, x).sum()


XS = jnp.arange(1.0, 5.0)
COND_PROGRAMS = {
    "cond-taken": (lambda x: lax.cond(jnp.sum(x) > 1, jnp.exp, lambda x: x * x, x).sum(), XS),
    "cond-not-taken": (lambda x: lax.cond(jnp.sum(x) > 99, jnp.exp, jnp.tanh, x).sum(), XS),
    "switch-0": (_switch3, XS[::-1]),
    "switch-1": (_switch3, jnp.array([1.0, 2.0, 3.0, 9.0, 4.0])),
    "switch-2": (_switch3, jnp.array([1.0, 2.0, 3.0, 4.0, 9.0])),
    "nested": (_nested_cond, XS),
    "in-scan": (_cond_in_scan, jnp.arange(1.0, 9.0)),
}
# save() runs a scan as one lax.scan (the cond inside is a traced switch); any other
# policy runs its steps as a Python loop, where each step's cond runs concretely.
IDENTITY = P.hooks(lambda a: a, lambda a: a)


@pytest.mark.parametrize("policy", [P.save(), IDENTITY], ids=["save", "identity-hooks"])
@pytest.mark.parametrize("name", list(COND_PROGRAMS))
def test_cond_report_is_what_del_vjp_fn_frees(name, policy):
    """Eagerly a cond reads its index on the host to run the branch taken. Read with
    ``int()``, jax left a second array aliasing the saved index's buffer alive with it:
    ``jax.live_arrays()`` counted 4 B per cond run (per step in a loop) that the report
    did not."""
    f, x = COND_PROGRAMS[name]
    rep = tg.memory_report(f, policy=policy)(x)
    freed = freed_by_del_vjp(f, x, policy)
    assert freed.get("device", 0) == rep.device_bytes - rep.input_bytes
    assert freed.get("device", 0) == rep.beyond_inputs_bytes > 0
    assert jnp.allclose(tg.grad(f, policy=policy)(x), jax.grad(f)(x), rtol=1e-6)


@pytest.mark.parametrize("name", ["cond-taken", "cond-not-taken", "switch-1", "nested"])
def test_traced_cond_holds_what_the_tape_counts(name):
    """Under jit a cond is a lax.switch keeping every branch's residuals (zeros for the
    ones not taken) and its operand, which leave the jitted call as new arrays: the
    tape's count, inputs included, is what ``del vjp_fn`` frees."""
    f, x = COND_PROGRAMS[name]
    tape = tg.trace(f)(x)
    assert freed_by_del_vjp(f, x, jit=True).get("device", 0) == tape.saved_bytes


def test_report_notes_backward_it_cannot_see():
    def f(x):
        # no rule: the fallback runs jax.vjp (on sin(x) + 1, which backward cannot rebuild)
        y = jax.scipy.special.gammaln(jnp.sin(x) + 1)

        def step(c, _):
            return jnp.tanh(c) + 0 * jax.scipy.special.gammaln(c * c + 1), None

        y, _ = lax.scan(step, y, None, length=3)
        return jnp.sum(y)

    rep = tg.memory_report(f)(jnp.linspace(-1, 1, 8))
    assert len(rep.notes) == 2
    top, inner = rep.notes
    assert top.startswith("backward of lgamma #2 at test_memory_loops.py:")
    # lgamma's jax.vjp keeps digamma(x): one f32[8] made inside backward, not zero
    assert "runs jax.vjp: it makes about 32 B of residuals," in top
    assert inner.startswith("backward of lgamma #3 (in #3's body) at test_memory_loops.py:")
    assert [(u.index, u.bytes, u.steps) for u in rep.unseen] == [(2, 32, 1), (3, 32, 3)]
    text = str(rep)
    assert all(len(line) <= 100 for line in text.splitlines())
    assert text.count("note: backward of lgamma") == 2
    assert "from jax.vjp&#x27;s residual shapes" in rep._repr_html_()
    steps = [s for s, _ in rep.timeline]
    i = steps.index("bwd 2 jax.vjp")  # a transient on top of what is live there
    assert rep.timeline[i][1] == rep.timeline[i - 1][1] + 32 <= rep.peak_bytes
    clean = tg.memory_report(lambda x: jnp.sum(jnp.tanh(x)))(jnp.ones(3))
    assert clean.notes == () and clean.unseen == ()
