"""What `compress(bits=...)` rounds, by how backward reads each value.

Zero-exact codes (`_lowbit.pack_lowbit(positive=True)`): relu reads its mask off its
output kept as codes, instead of keeping the mask as well, because the codes keep zeros
zero and positives positive. Values some record divides by, whichever record keeps them
first, and the inputs of recomputed segments stay exact.

Oracles: jax.grad (the input gradient reads only masks and exact weights, so it is
jax's; the weight gradient reads rounded values, so its mean over keys converges to
jax's), and the codes' own contract checked on edge values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapegrad as tg
from tapegrad.policies._lowbit import key_words, lowbit_layout, pack_lowbit, unpack_lowbit

F32 = np.dtype(np.float32)
# relu outputs at the edges: zeros of both signs, float32 denormals, the smallest normal,
# tiny and huge positives
EDGES = [0.0, -0.0, 1e-45, 1e-40, 1.2e-38, 1e-30, 1e-3, 1.0, 1e30]


def round_trip(x, bits, key=0, group=128):
    lay = lowbit_layout(x, bits, group)
    packed = pack_lowbit(x, key_words(key), np.uint32(7), bits=bits, lay=lay, positive=True)
    return unpack_lowbit(packed, x.dtype)


def relu_values():
    """Non-negative values: exact zeros, edge values, a group of zeros only, a group with
    one positive, and relu of normals."""
    x = jax.nn.relu(jax.random.normal(jax.random.key(0), (6, 128)))
    x = x.at[0, : len(EDGES)].set(jnp.asarray(EDGES, jnp.float32))
    x = x.at[1].set(0.0)
    x = x.at[2].set(0.0).at[2, 5].set(0.3)
    x = x.at[3].set(0.0).at[3, 9].set(1e-40)
    return x


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_codes_keep_zeros_zero_and_positives_positive(bits):
    x = relu_values()
    positive = np.asarray(x > 0)  # XLA's comparison, as relu's mask: denormals are 0 on CPU
    for key in range(8):
        y = np.asarray(round_trip(x, bits, key))
        np.testing.assert_array_equal(y > 0, positive)
        np.testing.assert_array_equal(y[~positive], 0.0)
    # within one step of the value: the range of the group's positives over 2**bits - 2
    xs = np.asarray(x, np.float64)
    pos = xs > 0
    lo = np.where(pos, xs, np.inf).min(axis=1, keepdims=True)
    hi = xs.max(axis=1, keepdims=True)
    lo = np.where(np.isfinite(lo), lo, 0.0)
    # the group's range widened by low rounded down to bfloat16, the step rounded up
    step = (hi - lo * (1 - 2**-7)) / (2**bits - 2) * (1 + 2**-7) + 2**-125
    np.testing.assert_array_less(np.abs(y - xs), np.broadcast_to(step, xs.shape))


@pytest.mark.parametrize("bits", [2, 4])
def test_codes_are_unbiased(bits):
    """The mean over keys converges to the value, its error shrinking like 1/sqrt(keys)."""
    x = jax.nn.relu(jax.random.normal(jax.random.key(1), (4, 128)))

    def mean_error(keys):
        ys = jax.vmap(lambda k: round_trip(x, bits, k))(
            jnp.asarray(np.arange(keys, dtype=np.uint32))
        )
        return float(jnp.abs(ys.mean(0) - x).max())

    few, many = mean_error(64), mean_error(4096)
    assert many < few / 4  # sqrt(64) = 8 in expectation; 4 leaves room for the max


def test_a_nan_or_inf_is_never_rounded_away():
    """A NaN (relu(nan) is nan) makes its group decode to NaN where it and the group's
    positives were; an inf makes the group's positives NaN: never zeros only."""
    x = jnp.zeros((2, 128)).at[0, 3].set(jnp.nan).at[1, 4].set(jnp.inf).at[1, 7].set(2.0)
    y = np.asarray(round_trip(x, 2))
    assert np.isnan(y[0, 3]) and np.isnan(y[1, 4]) and np.isnan(y[1, 7])
    assert (y[0, :3] == 0).all() and (y[1, :4] == 0).all()


def layers(h, w1, w2):
    return jnp.sum(jax.nn.relu(h @ w1) @ w2)


def layer_args():
    ks = jax.random.split(jax.random.key(2), 3)
    h = jax.random.normal(ks[0], (64, 32)).at[0].set(0.0)  # a row at relu's kink
    return h, jax.random.normal(ks[1], (32, 256)) / 6, jax.random.normal(ks[2], (256, 8))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_relu_reads_its_mask_off_the_codes(bits):
    """relu keeps nothing of its own (its output, kept by the next matmul, serves); the
    input gradient (masks and exact weights only) is jax.grad's, eagerly and under jit."""
    args = layer_args()
    policy = tg.policies.compress(bits=bits, key=3)
    tape = tg.trace(layers, argnums=(0, 2), policy=policy)(*args)
    (relu,) = [r for r in tape.records if r.params.get("name") == "relu"]
    assert [(s.kind, s.index, s.reads_positive) for s in relu.saves] == [("out", 0, True)]
    want = jax.grad(layers, argnums=(0, 2))(*args)
    for g in (tg.grad, lambda *a, **k: jax.jit(tg.grad(*a, **k))):
        gh, gw = g(layers, argnums=(0, 2), policy=policy)(*args)
        np.testing.assert_allclose(gh, want[0], rtol=1e-6, atol=1e-6)
        assert float(jnp.abs(gw - want[1]).max()) > 0  # rounded, not kept exact
    rep = tg.memory_report(layers, argnums=(0, 2), policy=policy)(*args)
    lay = lowbit_layout(jnp.zeros((64, 256)), bits, 128)
    from tapegrad.policies._lowbit import packed_nbytes

    assert rep.beyond_inputs_bytes == packed_nbytes(lay, bits, F32)  # no mask beside it


def test_weight_gradient_mean_converges_to_jax():
    args = layer_args()
    want = jax.grad(layers, argnums=2)(*args)

    def mean_error(keys):
        gs = [
            tg.grad(layers, argnums=2, policy=tg.policies.compress(bits=2, key=k))(*args)
            for k in range(keys)
        ]
        return float(jnp.linalg.norm(sum(gs) / keys - want) / jnp.linalg.norm(want))

    few, many = mean_error(4), mean_error(64)
    assert many < few / 2.5  # 4 = sqrt(16) in expectation


def test_a_value_kept_first_by_a_matmul_and_then_read_through_a_pole_stays_exact():
    """The value is packed once, with its first saver's info (the matmul's): the log
    that divides by it later is asked too (`ResidualInfo.readers`)."""

    def f(x, w):
        h = jnp.sin(x) * 0.2 + 0.25
        return jnp.sum(h @ w) + jnp.sum(jnp.log(h))

    x = jax.random.normal(jax.random.key(4), (64, 128))
    w = jax.random.normal(jax.random.key(5), (128, 16))
    want = jax.grad(f, argnums=(0, 1))(x, w)
    got = tg.grad(f, argnums=(0, 1), policy=tg.policies.compress(bits=2))(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_relu_in_a_scan_body_reads_its_mask_off_the_codes():
    def f(h, ws):
        def step(h, w):  # the body's second matmul keeps relu's output
            return jax.nn.relu(h @ w[0]) @ w[1], None

        h, _ = jax.lax.scan(step, h, ws)
        return jnp.sum(h)

    h = jax.random.normal(jax.random.key(6), (16, 32)).at[0].set(0.0)
    ws = jax.random.normal(jax.random.key(7), (3, 2, 32, 32)) / 5
    want = jax.grad(f, argnums=(0, 1))(h, ws)
    pol = lambda k: tg.policies.compress(bits=2, key=k)  # noqa: E731
    got = [tg.grad(f, argnums=(0, 1), policy=pol(k))(h, ws) for k in range(16)]
    # relu keeps no mask in the body: only the codes of its output
    rep = tg.memory_report(f, argnums=(0, 1), policy=pol(0))(h, ws)
    body = [r for row in rep.rows() for r in [row] if r.primitive == "custom_jvp_rule"]
    assert body and all("aux" not in str(r.saves) for r in body)
    # every key's gradient is a gradient with exact masks: the mean converges
    mean = jax.tree.map(lambda *a: sum(a) / len(a), *got)
    one = got[0]
    for m, o, w in zip(mean, one, want):
        assert float(jnp.linalg.norm(m - w)) < float(jnp.linalg.norm(o - w)) / 2


def test_bits_auto_fits_and_packs_the_same_residuals():
    args = layer_args()
    policy = tg.policies.compress(bits="auto", budget_bits=3, key=0).fit(
        layers, *args, argnums=(0, 2)
    )
    names = [row.name for row in policy.allocation.rows]
    assert any(n.endswith("out0") for n in names)  # relu's output, its first saver
    gh, _ = tg.grad(layers, argnums=(0, 2), policy=policy)(*args)
    np.testing.assert_allclose(gh, jax.grad(layers)(*args), rtol=1e-6, atol=1e-6)


_SHARDED = """
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
import tapegrad as tg

def loss(p, x):
    return jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"]) ** 2)

rng = np.random.RandomState(0)
for kind in (AxisType.Explicit, AxisType.Auto):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind, kind))
    put = lambda a, spec: jax.device_put(np.float32(a), NamedSharding(mesh, spec))
    p = {"w1": put(rng.randn(16, 256) * 0.3, P(None, "model")),
         "w2": put(rng.randn(256, 8) * 0.3, P())}
    x = put(rng.randn(64, 16), P("data", None))
    policy = tg.policies.compress(bits=2, key=1)
    with jax.set_mesh(mesh):
        tape = tg.trace(loss, policy=policy)(p, x)
        (relu,) = [r for r in tape.records if r.params.get("name") == "relu"]
        assert [(s.kind, s.reads_positive) for s in relu.saves] == [("out", True)], relu.saves
        eager = (tg.grad(loss, policy=policy)(p, x), jax.grad(loss)(p, x))
        jit = (jax.jit(tg.grad(loss, policy=policy))(p, x), jax.jit(jax.grad(loss))(p, x))
        for g, want in (eager, jit):
            for k in g:
                assert g[k].sharding.is_equivalent_to(want[k].sharding, g[k].ndim), (kind, k)
                err = float(jnp.linalg.norm(g[k] - want[k]) / jnp.linalg.norm(want[k]))
                assert np.isfinite(err) and err < 0.5, (kind, k, err)
print("OK")
"""


def test_zero_exact_codes_keep_shardings_on_8_devices():
    """Explicit and Auto meshes, eagerly and under jit: relu reads its mask off the codes,
    and the gradients have jax.grad's shardings."""
    from conftest import run_on_8_cpu_devices

    out = run_on_8_cpu_devices(_SHARDED)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_a_recomputed_segments_input_is_not_rounded():
    """Backward re-runs the checkpointed block from its input: rounded, every recomputed
    tanh would carry the rounding. Kept exact, the block's residuals are recomputed
    exactly and nothing else is kept, so the gradient is jax.grad's."""

    def f(x, w):
        h = x @ w
        return jnp.sum(tg.checkpoint(lambda h: jnp.tanh(jnp.tanh(h) * 2.0))(h))

    x = jax.random.normal(jax.random.key(8), (32, 64))
    w = jax.random.normal(jax.random.key(9), (64, 128)) / 8
    want = jax.grad(f, argnums=(0, 1))(x, w)
    for g in (tg.grad, lambda *a, **k: jax.jit(tg.grad(*a, **k))):
        got = g(f, argnums=(0, 1), policy=tg.policies.compress(bits=2))(x, w)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_a_budget_over_low_bit_compression_recomputes_from_exact_inputs():
    """`budget(bytes, base=compress(bits=8))` re-runs a scan from its input: the error is
    compress's own (~1.4%), not that of a scan re-run from a rounded carry (8% before)."""

    def f(p, x):
        h = jax.nn.relu(jnp.tanh(x @ p["w1"]) @ p["w2"])
        s = jnp.sin(x[:, :, None] * p["v"])

        def step(c, _):
            c = jnp.tanh(c * p["a"] + 0.1)
            return c, jnp.sin(c)

        c, ys = jax.lax.scan(step, h, None, length=5)
        return (
            jnp.mean((c @ p["w3"]) ** 2) + jnp.mean(ys**2) + jnp.mean(s**2) + jnp.mean(h @ p["w3"])
        )

    rng = np.random.RandomState(0)
    p = {
        "w1": rng.randn(16, 32) * 0.3,
        "w2": rng.randn(32, 32) * 0.3,
        "w3": rng.randn(32, 8) * 0.3,
        "a": rng.randn(32),
        "v": rng.randn(3),
    }
    p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p)
    x = jnp.asarray(rng.randn(16, 16), jnp.float32)
    want = jax.grad(f, argnums=(0, 1))(p, x)
    policy = tg.policies.budget(20_000, base=tg.policies.compress(bits=8))
    rep = tg.memory_report(f, argnums=(0, 1), policy=policy)(p, x)
    assert any(row.saves == "(segment input)" for row in rep.rows())  # the plan recomputes
    got = tg.grad(f, argnums=(0, 1), policy=policy)(p, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        err = float(jnp.abs(a - b).max() / jnp.abs(b).max())
        assert err < 0.03, err
