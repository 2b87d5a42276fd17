"""Every built-in policy on a (2, 4) mesh of 8 CPU devices, Explicit and Auto axes, eager
and jitted: gradients match jax.grad's values and shardings, and packed residuals
(int8 values, block codes, low-bit words, mins and scales) keep the sharding of the
value they stand for. One subprocess per mesh kind (8 devices need XLA_FLAGS set before
jax is imported), the convention of tests/test_composition.py."""

from __future__ import annotations

import subprocess
import textwrap

import pytest
from conftest import run_on_8_cpu_devices

_BODY = """
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
import tapegrad as tg
from tapegrad import policies as pol
from tapegrad.policies._groups import from_groups
from tapegrad.core.residual_policy import packs_inputs

assert jax.device_count() == 8, jax.devices()
kind = AxisType.Explicit if KIND == "explicit" else AxisType.Auto
mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind, kind))


def loss(p, x):
    h = jnp.tanh(x @ p["w1"])                   # (16@data, 32@model): rows are sharded
    h = jax.nn.relu(h @ p["w2"])               # (16@data, 32)
    s = jnp.sin(x[:, :, None] * p["v"])        # (16@data, 16, 3): rows of 48
    def step(c, _):                             # a loop: residuals packed per step
        c = jnp.tanh(c * p["a"] + 0.1)
        return c, jnp.sin(c)
    c, ys = jax.lax.scan(step, h, None, length=5)
    return jnp.mean((c @ p["w3"]) ** 2) + jnp.mean(ys**2) + jnp.mean(s**2)


rng = np.random.RandomState(0)
def put(a, spec):
    return jax.device_put(np.float32(a), NamedSharding(mesh, spec))
p = {"w1": put(rng.randn(16, 32) * 0.3, P(None, "model")), "w2": put(rng.randn(32, 32) * 0.3, P()),
     "w3": put(rng.randn(32, 8) * 0.3, P()), "a": put(rng.randn(32), P()),
     "v": put(rng.randn(3), P())}
x = put(rng.randn(16, 16), P("data", None))


class Cycle:
    # One run covers several modes: residuals take them in turn. (Not `route`: its
    # packed values carry the policy object, which a scan cannot stack.)

    inputs = True

    def __init__(self, policies):
        self.policies, self.picked = policies, {}

    def _pick(self, info):
        key = (tuple(r.index for r in info.loops), info.record.index, info.saved.ref)
        n = len(self.picked) % len(self.policies)
        return self.picked.setdefault(key, self.policies[n])

    def pack(self, value, info):
        policy = self._pick(info)
        return value if info.is_input and not packs_inputs(policy) else policy.pack(value, info)

    def unpack(self, packed, info):
        policy = self._pick(info)
        return packed if info.is_input and not packs_inputs(policy) else policy.unpack(packed, info)


def cycle(*policies):
    return lambda: Cycle(policies)


C = pol.compress
RUNS = {  # name -> (policy factory, max relative error per gradient leaf)
    # (Separate runs: a loop shares a residual between steps under the policy of one
    # of its keys, so a mix of save and offload in one loop body does not unpack.)
    "save": (pol.save, 1e-5),
    "offload": (pol.offload, 1e-5),
    "hooks": (lambda: pol.hooks(jnp.copy, lambda a: a), 1e-5),
    "casts_int8": (cycle(C(jnp.bfloat16), C(jnp.float16), C(jnp.float8_e4m3fn), C("int8"),
                         C("int8", axis=-1), C("int8", block_size=None),
                         C("int8", inputs=True)), 0.3),
    "bits8": (cycle(C(bits=8), C(bits=8, group=16, inputs=True)), 0.05),
    # 2 and 4 bits: rounding noise of a fair fraction of each value, and a bias where
    # backward is nonlinear in a residual (tanh's 1 - y**2): values are tested on one
    # device (test_compress_lowbit.py); here, shardings and finite values.
    "bits2_4": (cycle(C(bits=2), C(bits=4, group=16)), np.inf),
    "budget": (lambda: pol.budget(20_000, base=C(bits=8)), 0.05),
    "scan_checkpoint": (lambda: pol.scan_checkpoint(every=2, base=C("int8")), 0.05),
}

with jax.set_mesh(mesh):
    want = jax.grad(loss, argnums=(0, 1))(p, x)
for name, (make, tol) in RUNS.items():
    for mode in ("eager", "jit"):
        policy = make()
        f = tg.grad(loss, argnums=(0, 1), policy=policy)
        if mode == "jit":
            f = jax.jit(f)
        with jax.set_mesh(mesh):
            got = f(p, x)
        for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
            where = f"{name}/{mode}{jax.tree_util.keystr(path)}"
            assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (
                where, g.sharding.spec, w.sharding.spec)
            g, w = np.asarray(g), np.asarray(w)
            err = np.abs(g - w).max() / np.abs(w).max()
            assert np.all(np.isfinite(g)) and err <= tol, (where, err, tol)

# Packed residuals: sharded like their value, the low-bit error bound holds per value.
a = put(rng.randn(16, 64), P("data", "model"))
b = put(rng.randn(8, 6, 40), P("data", None, None))
for value in (a, b):
    info = tg.ResidualInfo(None, None, value.shape, np.dtype(value.dtype))
    spec = tuple(value.sharding.spec) + (None,) * (value.ndim - len(value.sharding.spec))
    for policy in (C("int8"), C(bits=2), C(bits=4, group=16)):
        for mode in ("eager", "jit"):
            with jax.set_mesh(mesh):
                packed = (jax.jit(policy.pack, static_argnums=1)(value, info) if mode == "jit"
                          else policy.pack(value, info))
                back = policy.unpack(packed, info)
            where = f"{policy!r}/{mode}/{value.shape}"
            assert back.sharding.is_equivalent_to(value.sharding, value.ndim), where
            def axes(spec):
                return {a for e in spec if e for a in (e if isinstance(e, tuple) else (e,))}
            leaves = [leaf for leaf in jax.tree.leaves(packed) if leaf.ndim]  # not int8's top scale
            for leaf in leaves:
                got = tuple(leaf.sharding.spec) + (None,) * (leaf.ndim - len(leaf.sharding.spec))
                if KIND == "explicit" or mode == "eager":
                    # Rows (8@data, 240) and (16@data, 64@model): groups stay inside a shard.
                    n = 1 if value.ndim == 3 else value.ndim
                    assert got[:n] == spec[:n], (where, leaf.shape, got, spec)
                else:
                    # Auto axes under jit: the policy cannot see the sharding, rows are the last
                    # dimension and XLA places the groups; leading dimensions keep theirs ...
                    assert got[: value.ndim - 1] == spec[: value.ndim - 1], (where, got, spec)
            # ... and the payload (int8 values, bit-packed words) is split over every mesh
            # axis the value is: no device holds more than its share.
            payload = max(leaves, key=lambda leaf: leaf.nbytes)
            assert axes(payload.sharding.spec) == axes(spec), (where, payload.sharding.spec, spec)
            if hasattr(packed, "layout"):
                lay = packed.layout
                scale = np.asarray(from_groups(jnp.broadcast_to(
                    packed.scale.astype(jnp.float32)[..., None], lay.grouped_shape), lay))
                err = np.abs(np.asarray(back) - np.asarray(value))
                assert np.all(err <= scale * (1 + 1e-6)), (where, (err / scale).max())
print("OK")
"""


def _run(kind: str) -> subprocess.CompletedProcess:
    return run_on_8_cpu_devices(f"KIND = {kind!r}\n" + textwrap.dedent(_BODY), timeout=600)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_every_policy_keeps_shardings_subprocess(kind):
    proc = _run(kind)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
        f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    )
