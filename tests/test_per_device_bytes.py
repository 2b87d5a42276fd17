"""Per-device bytes (issue 15, item 5): for values sharded over a mesh, memory_report and
the budget planner count what one device holds (the shard), since that is what must fit.

Runs in a subprocess with 8 CPU devices (the flag must be set before jax starts), on an
Auto and an Explicit mesh. Oracle: the bytes of device 0's shards among
``jax.live_arrays()``, and jax.grad for the gradients.
"""

from __future__ import annotations

from conftest import run_on_8_cpu_devices

_SCRIPT = """
import gc
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import tapegrad as tg


def loss(w1, w2, x):
    h = x
    for _ in range(4):
        h = jnp.tanh(jnp.tanh(h @ w1) @ w2)
    return jnp.mean(h**2)


def dev0_bytes():
    d0 = jax.devices()[0]
    return sum(
        s.data.nbytes for a in jax.live_arrays() for s in a.addressable_shards if s.device == d0
    )


def held_on_dev0(vjp, *args):
    gc.collect()
    before = dev0_bytes()
    out, vjp_fn = vjp(loss, *args)
    jax.block_until_ready(out)
    gc.collect()
    held = dev0_bytes() - before - out.nbytes
    del out, vjp_fn
    return held


rng = np.random.RandomState(0)
W1 = np.float32(rng.standard_normal((32, 64)) * 0.2)
W2 = np.float32(rng.standard_normal((64, 32)) * 0.2)
X = np.float32(rng.standard_normal((256, 32)))
WHOLE = tg.memory_report(loss, argnums=(0, 1, 2))(W1, W2, X)  # one device, unsharded
assert WHOLE.devices == 1 and "per device" not in str(WHOLE)
for kind in (AxisType.Auto, AxisType.Explicit):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    rep = NamedSharding(mesh, P())
    w1, w2 = jax.device_put(W1, rep), jax.device_put(W2, rep)
    x = jax.device_put(X, NamedSharding(mesh, P("data", None)))
    with jax.set_mesh(mesh):
        r = tg.memory_report(loss, argnums=(0, 1, 2))(w1, w2, x)
        assert r.devices == 8, r.devices
        assert "per device" in str(r), str(r)
        held_on_dev0(tg.vjp, w1, w2, x)  # warm-up: one-time constants
        held = held_on_dev0(tg.vjp, w1, w2, x)
        # The report counts device 0's shards: the activations are batch-sharded 8 ways.
        assert r.beyond_inputs_bytes == held, (r.beyond_inputs_bytes, held)
        assert r.beyond_inputs_bytes * 8 == WHOLE.beyond_inputs_bytes, (
            r.beyond_inputs_bytes, WHOLE.beyond_inputs_bytes)
        want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(w1, w2, x)
        if kind == AxisType.Explicit:
            # Types carry the sharding: the tape's residuals and the planner count shards,
            # so a budget of one device's bytes is met without recomputing anything, and
            # half of it recomputes (a budget read as global bytes would be 8x too tight).
            tape = tg.trace(loss, argnums=(0, 1, 2))(w1, w2, x)
            assert tape.saved_bytes == r.residual_bytes, (tape.saved_bytes, r.residual_bytes)
            for budget, recomputes in ((r.beyond_inputs_bytes, False),
                                       (r.beyond_inputs_bytes // 2, True)):
                pol = tg.policies.budget(bytes=budget)
                got = jax.jit(tg.grad(loss, argnums=(0, 1, 2), policy=pol))(w1, w2, x)
                assert pol.last["peak_bytes"] <= budget, (pol.last, budget)
                assert (pol.last["recompute_flops"] > 0) == recomputes, (budget, pol.last)
                for g, w in zip(got, want):
                    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-7)
                    assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)
    print("OK", kind)
"""


def test_memory_report_and_budget_count_one_devices_shards():
    proc = run_on_8_cpu_devices(_SCRIPT)
    assert proc.returncode == 0 and proc.stdout.count("OK") == 2, (
        f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    )
