"""A budget taken from `memory_report`'s own figure is feasible on a sharded mesh, Auto
axes as Explicit ones ("One truth about a backward pass", item 3): the planner sizes a
value by the shard one device holds, as the report measures it. On Explicit axes the
value's type says; on Auto axes, eagerly, `tapegrad.engine.placement` asks XLA where
each op puts its result; under jit, downstream of a ``with_sharding_constraint``.

A 6-layer residual MLP on a 2x2 ("data", "model") mesh of CPU devices, weights sharded
over "model" (by column or by row: the latter contracts a sharded dimension), the batch
over "data". For each: save()'s predicted peak equals the report's, a budget at the
report's peak is met (``pol.last["peak_bytes"]`` <= it), and the gradient is
jax.grad's. Runs in a subprocess: the device count must be set before jax starts.
"""

from __future__ import annotations

from conftest import run_on_8_cpu_devices

_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
import tapegrad as tg

L, B, D = 6, 16, 8
DEVS = np.array(jax.devices()[:4]).reshape(2, 2)
RNG = np.random.RandomState(0)
WS = [np.float32(RNG.standard_normal((D, D)) * 0.3) for _ in range(L)]
X = np.float32(RNG.standard_normal((B, D)))


def case(kind, wspec, constrain):
    mesh = Mesh(DEVS, ("data", "model"), axis_types=(kind, kind))
    wsh, xsh = NamedSharding(mesh, wspec), NamedSharding(mesh, P("data", None))
    ws = [jax.device_put(w, wsh) for w in WS]
    x = jax.device_put(X, xsh)
    # Explicit axes: contracting a sharded dimension needs the result's sharding.
    out = xsh if kind == AxisType.Explicit and wspec == P("model", None) else None

    def loss(ws, x):
        if constrain:  # what jit can know of an Auto-mesh argument: what the program says
            ws = [jax.lax.with_sharding_constraint(w, wsh) for w in ws]
            x = jax.lax.with_sharding_constraint(x, xsh)
        h = x
        for w in ws:
            h = h + jnp.tanh(jnp.matmul(h, w, out_sharding=out))
        return jnp.mean(h**2)

    with jax.set_mesh(mesh):  # Explicit axes need it; Auto axes run the same with it
        check(loss, ws, x, kind, constrain)
    print("OK", kind, wspec, constrain)


def check(loss, ws, x, kind, constrain):
    rep = tg.memory_report(loss, argnums=0)(ws, x)
    assert rep.devices == 4, rep.devices
    peak = rep.peak_beyond_inputs_bytes
    want = jax.grad(loss)(ws, x)
    # Eagerly always; under jit where the types (Explicit) or constraints (Auto) say.
    for jit in (False,) if kind == AxisType.Auto and not constrain else (False, True):
        wrap = jax.jit if jit else (lambda f: f)
        save = tg.policies.budget(bytes=1 << 30)
        wrap(tg.grad(loss, policy=save))(ws, x)
        assert save.last["peak_bytes"] == peak, (kind, jit, save.last["peak_bytes"], peak)
        for budget in (peak, peak + 64):
            pol = tg.policies.budget(bytes=budget)
            got = wrap(tg.grad(loss, policy=pol))(ws, x)
            assert pol.last["peak_bytes"] <= peak, (kind, jit, pol.last, peak)
            for g, w in zip(got, want):
                np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-6)
    print("peak", peak)


for wspec in (P(None, "model"), P("model", None)):
    case(AxisType.Auto, wspec, False)
    case(AxisType.Explicit, wspec, False)
case(AxisType.Auto, P(None, "model"), True)
"""


def test_budget_at_reports_peak_is_feasible_on_auto_and_explicit_meshes():
    proc = run_on_8_cpu_devices(_SCRIPT)
    assert proc.returncode == 0 and proc.stdout.count("OK") == 5, (
        f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    )
