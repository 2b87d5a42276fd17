"""Offload's prefetch depth: from the cost model (`planner.cost.prefetch_depth`), followed by
backward (residuals come back that many records early) and by the budget planner's
timeline (predicted peak = peak measured from live arrays at depths above 1)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.planner import estimate, joint
from tapegrad.planner.cost import MAX_PREFETCH, CostModel, prefetch_depth
from tapegrad.planner.measure import measured_peak

P = tg.policies


def mlp(ws, x):
    h = x
    for w in ws:
        h = jnp.tanh(h @ w)
    return jnp.sum(h**2)


@pytest.fixture(scope="module")
def model():
    ks = jax.random.split(jax.random.key(0), 9)
    return [jax.random.normal(k, (64, 64)) / 8 for k in ks[:8]], jax.random.normal(ks[8], (32, 64))


def costs(h2d: float) -> CostModel:
    return CostModel(flops_per_s=5e10, d2h_bytes_per_s=5e9, h2d_bytes_per_s=h2d,
                     compress_bytes_per_s=2e9)  # fmt: skip


COSTS = costs(5e9)


def test_depth_from_the_cost_model(model):
    """By hand, backward order sum, pow, tanh8, dot8, tanh7, dot7, ...: a dot's copy
    (its 32x64 f32 input, 8 KiB, plus its 8 KiB output: 3.3 us at 5e9 B/s) is not
    covered by the tanh before it (2 * 2,048 flops = 0.08 us) but is by that tanh
    and the dot before it (2 * 2*32*64*64 flops = 10.5 us): depth 2. At 5e8 B/s
    (33 us) even 8 records do not cover it: the cap. At 1e12 B/s one record does."""
    tape = tg.trace(mlp, argnums=0)(*model)
    assert prefetch_depth(tape, costs(5e9)) == 2
    assert prefetch_depth(tape, costs(5e8)) == MAX_PREFETCH
    assert prefetch_depth(tape, costs(1e12)) == 1


def offload_peak(tape, k: int) -> int:
    """The planner's predicted device peak with every activation offloaded, copies
    brought back ``k`` records ahead."""
    tl = joint.timeline(tape, prefetch=k)
    opts = joint.options(tl, ("offload",), COSTS)
    return joint.evaluate(tl, opts, np.where(opts.valid[:, 1], 1, 0))[0]


def test_backward_brings_copies_back_k_records_ahead(model):
    """The device peak measured from live arrays under offload(prefetch=k) is the one the
    planner predicts for depth k, and it grows with k (copies come back earlier)."""
    ws, x = model
    want = jax.grad(mlp)(ws, x)
    tape = tg.trace(mlp, argnums=0, policy=P.offload())(ws, x)
    peaks = []
    for k in (0, 1, 3):
        pol = P.offload(prefetch=k)
        chex.assert_trees_all_close(tg.grad(mlp, policy=pol)(ws, x), want, rtol=1e-5, atol=1e-5)
        peaks.append(measured_peak(mlp, (ws, x), pol))
        assert peaks[-1] == offload_peak(tape, k), k
    assert peaks[0] < peaks[1] < peaks[2], peaks


def test_budget_plans_with_the_depth_backward_uses(model):
    """A budget with offload at a slow copy rate: at a loose budget it plans at the cost
    model's depth (8), at a tight one, where 8 records of copies do not fit, shallower.
    Either way the predicted peak is the one measured from live arrays: the plan and
    backward agree on when copies come back."""
    ws, x = model
    want = jax.grad(mlp)(ws, x)
    full = estimate(tg.trace(mlp, argnums=0)(ws, x))[0]
    depths = []
    for frac in (0.9, 0.6):
        pol = P.budget(int(full * frac), allow=("save", "offload"), costs=costs(5e8))
        chex.assert_trees_all_close(tg.grad(mlp, policy=pol)(ws, x), want, rtol=1e-5, atol=1e-5)
        assert pol.last["mechanisms"].get("offload", 0) > 0
        predicted = pol.last["peak_bytes"]
        assert predicted <= pol.bytes
        assert measured_peak(mlp, (ws, x), pol) == predicted, frac
        depths.append(pol.prefetch)
    assert depths[0] == MAX_PREFETCH and depths[1] < MAX_PREFETCH, depths
    assert P.offload().prefetch == "auto"


def test_bad_prefetch_is_rejected():
    with pytest.raises(ValueError, match="prefetch"):
        P.offload(prefetch=-1)
    with pytest.raises(ValueError, match="prefetch"):
        P.offload(prefetch="soon")


def _depends(jaxpr, roots) -> set:
    """Variables of ``jaxpr`` (top level) computed from any of ``roots``."""
    seen = set(roots)
    for eqn in jaxpr.eqns:
        if any(not hasattr(v, "val") and v in seen for v in eqn.invars):  # skip literals
            seen.update(eqn.outvars)
    return seen


@pytest.mark.parametrize("which", ["offload", "offload, prefetch=0", "budget"])
def test_copies_back_follow_backward_under_jit(model, which):
    """Under jit a host -> device copy with no input from backward is hoisted by XLA: on an
    H100 every copy back ran at the start of backward, one after the other, none beside
    compute, and the device held them all (bench/budget_gpu.py). Each copy back must
    depend on the cotangent, so that it starts where backward asks for it."""
    ws, x = model
    if which == "budget":
        save = tg.memory_report(mlp, policy=P.save())(ws, x).beyond_inputs_bytes
        policy = P.budget(bytes=save // 4, allow=("save", "offload"), costs=COSTS)
    else:
        policy = P.offload(prefetch=0) if "prefetch" in which else P.offload()

    def step(ws, x, ct):
        _, vjp_fn = tg.vjp(mlp, ws, x, policy=policy)
        return vjp_fn(ct)

    jaxpr = jax.make_jaxpr(step)(ws, x, jnp.float32(1.0)).jaxpr
    after_ct = _depends(jaxpr, [jaxpr.invars[-1]])
    host, device = jax.memory.Space.Host, jax.memory.Space.Device
    back = [
        e
        for e in jaxpr.eqns
        if e.primitive.name == "device_put"
        and e.invars[0].aval.memory_space == host
        and e.outvars[0].aval.memory_space == device
    ]
    assert len(back) >= 5  # the activations that moved (the budget keeps 2 of 8)
    assert all(e.outvars[0] in after_ct for e in back)
    grads = jax.jit(step)(ws, x, jnp.float32(1.0))
    saved = jax.jit(lambda ws, x, ct: tg.vjp(mlp, ws, x, policy=P.save())[1](ct))
    chex.assert_trees_all_close(grads, saved(ws, x, jnp.float32(1.0)), rtol=1e-6, atol=1e-7)
    # jax's own gradient, to float32 matmul noise (jit vs eager differ by as much)
    ref = jax.jit(jax.grad(mlp, argnums=(0, 1)))(ws, x)
    chex.assert_trees_all_close(grads, ref, rtol=2e-3, atol=1e-5)
