"""The budget planner with the low-bit formats (``max_error="4-bit"`` / ``"2-bit"``):
`compress(bits=...)` as two more per-residual mechanisms, below int8 in bytes and in
precision. Oracles: the packed bytes `compress` stores, live arrays, jax.grad (the
mean gradient over many rounding keys), and the planner's own timeline."""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.engine.checkpoint import plan_recompute
from tapegrad.planner import joint
from tapegrad.planner.cost import CostModel, compressed_nbytes
from tapegrad.planner.measure import measured_peak
from tapegrad.policies._lowbit import LowBit
from tests.conftest import run_on_8_cpu_devices
from tests.policies.test_planner_joint import ALL, COSTS, mlp, save_peak

P = tg.policies


def normed(ws, x):
    """Divides by a residual in backward (the rsqrt's output, the mean's divisor)."""
    for w in ws:
        m = jnp.mean(x, axis=-1, keepdims=True)
        x = jnp.tanh(((x - m) * jax.lax.rsqrt(jnp.mean((x - m) ** 2, -1, keepdims=True))) @ w)
        x = jnp.log1p(x**2)  # log1p keeps its input for a division in backward
    return jnp.sum(x)


@pytest.fixture(scope="module")
def model():
    ks = jax.random.split(jax.random.key(0), 5)
    ws = [jax.random.normal(k, (128, 128)) / 11 for k in ks[:4]]
    return ws, jax.random.normal(ks[4], (64, 128))


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("shape", [(64, 128), (3, 5, 200), (7,), (64, 130)])
def test_planned_bytes_are_what_compress_stores(bits, shape):
    from tapegrad.core.tape import Saved

    x = jax.random.normal(jax.random.key(1), shape)
    s = Saved("out", 0, x.shape, x.dtype)
    packed = P.compress(bits=bits).pack(x, P.ResidualInfo(None, s, x.shape, x.dtype))
    want = sum(leaf.nbytes for leaf in jax.tree.leaves(packed))
    got = compressed_nbytes(f"{bits}-bit", x.shape, x.dtype, x.nbytes)
    if isinstance(packed, LowBit):
        assert got == want < x.nbytes
    else:  # a few values: compress keeps them, and the planner offers no low-bit option
        assert got >= x.nbytes


@pytest.mark.parametrize("allow", [("save", "compress"), ("save", "recompute", "compress")])
@pytest.mark.parametrize("max_error", ["4-bit", "2-bit"])
def test_predicted_peak_is_measured(model, max_error, allow):
    full = save_peak(mlp, model)
    used = set()
    fits = 0
    for frac in (0.6, 0.5, 0.4, 0.3, 0.22, 0.18):
        pol = P.budget(int(full * frac), allow=allow, max_error=max_error, costs=COSTS, key=3)
        try:
            tg.grad(mlp, policy=pol)(*model)
        except P.BudgetError:
            continue
        fits += 1
        used |= set(pol.last["mechanisms"])
        predicted = pol.last["peak_bytes"]
        assert predicted <= pol.bytes
        assert measured_peak(mlp, model, pol) == predicted
    assert max_error in used and fits >= 3


def test_a_budget_int8_cannot_meet_is_met_with_two_bits(model):
    full = save_peak(mlp, model)
    b = int(full * 0.34)  # 2-bit reaches ~0.32 of it here, int8 ~0.44
    with pytest.raises(P.BudgetError):
        tg.grad(mlp, policy=P.budget(b, allow=("save", "compress"), max_error="int8"))(*model)
    pol = P.budget(b, allow=("save", "compress"), max_error="2-bit", costs=COSTS)
    tg.grad(mlp, policy=pol)(*model)
    assert pol.last["mechanisms"].get("2-bit", 0) > 0
    assert measured_peak(mlp, model, pol) <= b


def linear(ws, x):
    h = x
    for w in ws:
        h = h @ w
    return jnp.sum(h**2)


def test_mean_gradient_over_keys_is_jax_grad(model):
    """Stochastic rounding is unbiased, and every rounded residual here enters the
    gradient linearly (the dots' inputs, the square's), each rounded with its own noise:
    the gradient averaged over rounding keys tends to jax.grad's, its error shrinking
    like 1/sqrt(keys). (Through a nonlinear backward, tanh's ``1 - y**2``, the rounding
    adds a bias of its variance: that is `compress(bits=...)`'s documented error.)"""
    ws, x = model
    ws = ws[:3]
    full = save_peak(linear, (ws, x))
    want = jax.grad(linear)(ws, x)

    @jax.jit
    @jax.vmap
    def grads(key):
        pol = P.budget(int(full * 0.45), allow=("save", "compress"), max_error="2-bit", key=key)
        return tg.grad(linear, policy=pol)(ws, x)

    def err(n, first):
        keys = jax.random.split(jax.random.key(first), n)
        mean = [jnp.mean(a, 0) for a in grads(keys)]
        return max(float(jnp.abs(m - w).max() / jnp.abs(w).max()) for m, w in zip(mean, want))

    one, many = err(1, 5), err(256, 7)
    assert one > 0.02  # a single key does round: the test can fail
    assert many < one / 5  # ~1/sqrt(256) = 1/16 of it, with room for noise


def test_low_bit_never_rounds_a_divisor_or_a_recomputed_segments_input():
    ks = jax.random.split(jax.random.key(2), 4)
    ws = [jax.random.normal(k, (96, 96)) / 10 for k in ks[:3]]
    args = (ws, jax.random.normal(ks[3], (48, 96)))
    full = save_peak(normed, args)
    dear = CostModel(1e8, 5e9, 5e9, 2e9)  # recompute dear: compression is worth its time
    allow = ("save", "recompute", "compress")
    # the tanhs recomputed (binding), so there are segments whose inputs count
    tanhs = tg.selective(
        lambda r: (
            tg.CheckpointPolicy.NEVER if r.primitive == "tanh" else tg.CheckpointPolicy.PREFER_SAVE
        )
    )
    seen = 0
    for frac in (0.6, 0.45, 0.4):
        pol = P.budget(int(full * frac), tanhs, allow=allow, max_error="2-bit", costs=dear, key=1)
        planned = plan_recompute(tg.trace(normed, argnums=0)(*args), pol)
        tl = joint.timeline(planned)
        poles = joint.pole_keys(planned)
        seg_inputs = {v.id for seg in planned.segments for v in seg.inputs}
        assert poles and seg_inputs and tl.exact == poles | seg_inputs
        # the options never offer low bits for them, and do for the others
        opts = joint.options(tl, pol.mechanisms, dear)
        low = [joint.COLUMNS.index(m) for m in ("4-bit", "2-bit")]
        for k, key in enumerate(tl.keys):
            if key in tl.exact:
                assert not opts.valid[k, low].any(), key
        assert opts.valid[:, low].any()
        lowbit = {k for k, (m, *_) in pol.last["residuals"].items() if m in ("4-bit", "2-bit")}
        seen += bool(lowbit)
        assert not lowbit & tl.exact
    assert seen >= 1


def test_max_error_names_the_low_bit_classes():
    with pytest.raises(ValueError, match="'4-bit' or '2-bit'"):
        P.budget(1 << 20, allow=ALL, max_error="int4")
    assert P.budget(1 << 20, allow=ALL, max_error="2-bit").mechanisms == (
        "offload",
        "bf16",
        "int8",
        "4-bit",
        "2-bit",
    )


def test_sharded_low_bit_bytes_are_per_device():
    """On an Explicit mesh the planner counts one device's packed bytes (the groups
    never cross a shard): an eighth of the unsharded figure, and what compress stores
    on each device."""
    code = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        from jax.sharding import AxisType, NamedSharding, PartitionSpec as PS
        import tapegrad as tg
        from tapegrad.core.tape import Saved
        from tapegrad.planner.cost import compressed_nbytes

        mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
        with jax.set_mesh(mesh):
            x = jax.device_put(jnp.ones((64, 256)), NamedSharding(mesh, PS("data")))
            s = jax.typeof(x).sharding
            for bits in (4, 2):
                whole = compressed_nbytes(f"{bits}-bit", x.shape, x.dtype, x.nbytes)
                mine = compressed_nbytes(f"{bits}-bit", x.shape, x.dtype, x.nbytes // 8, s)
                saved = Saved("out", 0, x.shape, x.dtype)
                info = tg.policies.ResidualInfo(None, saved, x.shape, x.dtype)
                packed = tg.policies.compress(bits=bits).pack(x, info)
                per_dev = sum(
                    sh.data.nbytes for leaf in jax.tree.leaves(packed)
                    for sh in leaf.addressable_shards if sh.device == jax.devices()[0]
                )
                assert whole == 8 * mine == 8 * per_dev, (bits, whole, mine, per_dev)
        print("ok")
        """
    )
    r = run_on_8_cpu_devices(code)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_calibrate_measures_low_bit():
    c = P.calibrate(force=True, size=128, mbytes=1, repeats=2)
    assert c.lowbit_bytes_per_s is not None and c.lowbit_bytes_per_s > 0
    assert c.mechanism_s("2-bit", 1 << 20) == (1 << 20) / c.lowbit_bytes_per_s
    d = CostModel(5e10, 5e9, 5e9, 2e9)  # not measured: a fifth of compress's rate
    assert d.mechanism_s("4-bit", 10**6) == pytest.approx(5 * d.mechanism_s("int8", 10**6))
    assert np.isfinite(d.lowbit_s(1))
