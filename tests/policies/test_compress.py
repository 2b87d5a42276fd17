"""compress("int8"): round-trip error bounds against a numpy reference, bytes as the
report counts them, gradient error within the bound the quantization noise implies,
and the same results eagerly and under jax.jit."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tanh_mlp as mlp

import tapegrad as tg
from tapegrad import policies as P

C = importlib.import_module("tapegrad.policies.compress")  # P.compress is the function
B = C.DEFAULT_BLOCK_SIZE
STEP = 2 ** (1 / 16)  # the block-scale grid's ratio


def info_for(x):
    return tg.ResidualInfo(None, None, tuple(x.shape), np.dtype(x.dtype))


def roundtrip(policy, x):
    info = info_for(x)
    packed = policy.pack(x, info)
    return packed, policy.unpack(packed, info)


def numpy_blocks(a, block):
    flat = np.asarray(a, np.float64).reshape(-1)
    pad = -flat.size % block
    return np.concatenate([flat, np.zeros(pad)]).reshape(-1, block)


SHAPES = [(64, 48), (7, 13), (3, 5, 40), (1000,)]  # whole blocks, a short last block, 3-d


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: np.dtype(d).name
)
def test_blockwise_error_is_at_most_half_a_block_scale(shape, dtype):
    rng = np.random.RandomState(0)
    # Rows of very different magnitude: one scale per tensor would drown the small ones.
    a = rng.standard_normal(shape) * np.logspace(-3, 2, shape[-1])
    x = jnp.asarray(a, dtype)
    packed, back = roundtrip(P.compress("int8"), x)
    assert isinstance(packed, C.Int8Blocks) and packed.block_size == B
    assert packed.q.dtype == jnp.int8 and packed.q.shape == x.shape
    assert packed.code.dtype == jnp.uint8 and packed.code.shape == (-(-x.size // B),)
    assert back.dtype == x.dtype and back.shape == x.shape

    xs = numpy_blocks(x.astype(jnp.float32), B)
    scale = np.asarray(C.block_scales(packed), np.float64)
    amax = np.abs(xs).max(axis=1)
    # Never clipped: the stored scale covers the block's absmax ...
    assert np.all(scale * 127 >= amax * (1 - 1e-6))
    # ... and is the block's own, within one grid step (above 2^-16 of the largest).
    fine = amax >= amax.max() * 2**-15
    assert np.all(scale[fine] * 127 <= amax[fine] * STEP * (1 + 1e-6))
    # Rounding to nearest: at most half a step per element, plus the dtype's own rounding.
    err = np.abs(numpy_blocks(np.asarray(back, np.float64), B) - xs)
    eps = float(jnp.finfo(dtype).eps)
    excess = err - (scale[:, None] / 2 + np.abs(xs) * eps + 1e-30)
    assert np.all(excess <= 0), excess.max()
    q = numpy_blocks(packed.q, B)
    # The codes themselves, computed as the quantizer does (float32, ties to even).
    want = np.round(xs.astype(np.float32) / scale.astype(np.float32)[:, None])
    np.testing.assert_array_equal(q, np.clip(want, -127, 127))


@pytest.mark.parametrize("axis", [None, -1, 0])
def test_per_tensor_and_per_channel_error_is_at_most_half_a_scale(axis):
    rng = np.random.RandomState(1)
    x = jnp.asarray(
        rng.standard_normal((40, 6)) * np.array([1e-2, 1, 3, 10, 0.5, 100]), jnp.float32
    )
    policy = (
        P.compress("int8", axis=axis) if axis is not None else P.compress("int8", block_size=None)
    )
    packed, back = roundtrip(policy, x)
    assert isinstance(packed, C.Int8)
    a = np.asarray(x, np.float64)
    amax = np.abs(a).max(
        axis=None if axis is None else tuple(i for i in range(2) if i != axis % 2),
        keepdims=axis is not None,
    )
    scale = np.asarray(packed.scale, np.float64)
    assert np.all(scale * 127 >= amax) and np.all(scale * 127 <= amax * (1 + 2**-7))
    assert np.all(np.abs(np.asarray(back, np.float64) - a) <= scale / 2 * (1 + 1e-6))


def test_zeros_small_tensors_and_float64():
    z = jnp.zeros((50,), jnp.float32)
    packed, back = roundtrip(P.compress("int8"), z)
    np.testing.assert_array_equal(back, z)
    small = jnp.linspace(-1.0, 1.0, B)  # one block or less: a single per-tensor scale
    packed, back = roundtrip(P.compress("int8"), small)
    assert isinstance(packed, C.Int8)
    assert float(jnp.max(jnp.abs(back - small))) <= float(packed.scale) / 2 * (1 + 1e-6)
    with jax.enable_x64(True):
        x = jnp.asarray(np.random.RandomState(2).standard_normal(300), jnp.float64)
        # Jitted: one compile rather than one per float64 op.
        packed, back = jax.jit(lambda x: roundtrip(P.compress("int8"), x))(x)
        assert back.dtype == jnp.float64 and packed.scale.dtype == jnp.float64
        scale = np.repeat(np.asarray(C.block_scales(packed)), B)[:300]
        assert np.all(np.abs(np.asarray(back) - np.asarray(x)) <= scale / 2 * (1 + 1e-12))


def test_bad_block_size_is_a_clear_error():
    with pytest.raises(ValueError, match="not both"):
        P.compress("int8", axis=-1, block_size=32)
    with pytest.raises(ValueError, match="positive int"):
        P.compress("int8", block_size=0)
    with pytest.raises(ValueError, match="'int8' only"):
        P.compress(jnp.bfloat16, block_size=32)
    assert repr(P.compress("int8")) == "compress('int8')"
    assert repr(P.compress("int8", block_size=None)) == "compress('int8', block_size=None)"


@pytest.fixture(scope="module")
def model():
    ks = jax.random.split(jax.random.key(0), 5)
    ws = [jax.random.normal(k, (64, 64)) / 8 for k in ks[:4]]
    return ws, jax.random.normal(ks[4], (32, 64))


def test_report_counts_q_codes_and_scale(model):
    ws, x = model
    full = tg.memory_report(mlp, policy=P.save())(ws, x)
    seen = []

    def note(info):
        seen.append(int(np.prod(info.shape)))
        return P.compress("int8", inputs=True)  # every residual, the weights too

    i8 = tg.memory_report(mlp, policy=P.route(note))(ws, x)
    # Per residual of n float32 values: n int8 values, ceil(n / B) one-byte codes and
    # one float32 tensor scale.
    assert len(seen) == 8 and all(n > B for n in seen)
    assert i8.residual_bytes == sum(n + -(-n // B) + 4 for n in seen)
    assert full.residual_bytes == 4 * sum(seen)
    assert 0.25 < i8.residual_bytes / full.residual_bytes <= 0.25 * (1 + 1 / B) + 0.001
    assert sum(r.compressed_bytes for r in i8.records) == i8.residual_bytes
    # The independent count: the packed leaves' own nbytes.
    packed = P.compress("int8").pack(ws[0], info_for(ws[0]))
    assert sum(leaf.nbytes for leaf in jax.tree.leaves(packed)) == 64 * 64 + 64 * 64 // B + 4


class Recorder:
    """Wraps a policy; notes each residual's relative RMS rounding error s/sqrt(12)."""

    inputs = True  # see the weights too (a custom policy is not given inputs otherwise)

    def __init__(self, policy):
        self.policy, self.eps2 = policy, []

    def pack(self, v, info):
        p = self.policy.pack(v, info)
        if isinstance(p, C.Int8Blocks):
            s = np.repeat(np.asarray(C.block_scales(p), np.float64), p.block_size)[: v.size]
        else:
            s = np.broadcast_to(np.asarray(p.scale, np.float64), v.shape).reshape(-1)
        self.eps2.append(np.sum(s**2) / 12 / np.sum(np.asarray(v, np.float64) ** 2))
        return p

    def unpack(self, p, info):
        return self.policy.unpack(p, info)


def rel_err(g, ref):
    num = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(g, ref))
    return (num / sum(float(jnp.sum(b**2)) for b in ref)) ** 0.5


def test_gradient_error_within_the_rounding_noise_bound(model):
    # Rounding adds independent zero-mean noise of RMS s/sqrt(12) per element, so
    # residual r is off by eps_r = ||s/sqrt(12)|| / ||r|| relative; to first order the
    # gradient error is a sum of those perturbations pushed through backward, whose
    # maps here do not amplify (|tanh'| <= 1, weights ~ N(0, 1/64)): independent
    # terms add in quadrature, so rel. error <= sqrt(sum_r eps_r^2).
    ws, x = model
    ref = jax.grad(mlp)(ws, x)
    errs = {}
    for name, policy in [
        ("blocks", P.compress("int8", inputs=True)),
        ("tensor", P.compress("int8", block_size=None, inputs=True)),
    ]:
        rec = Recorder(policy)
        errs[name] = rel_err(tg.grad(mlp, policy=rec)(ws, x), ref)
        bound = float(np.sqrt(np.sum(rec.eps2)))
        assert 0 < errs[name] <= bound, (name, errs[name], bound)
    assert errs["blocks"] < 0.8 * errs["tensor"]  # blocks of 16 really are finer


def test_same_under_jit_and_eagerly(model):
    ws, x = model
    policy = P.compress("int8")
    info = info_for(ws[1])
    eager = policy.pack(ws[1], info)
    jitted = jax.jit(lambda w: policy.pack(w, info))(ws[1])
    np.testing.assert_array_equal(eager.q, jitted.q)
    np.testing.assert_array_equal(eager.code, jitted.code)
    np.testing.assert_array_equal(
        policy.unpack(eager, info), jax.jit(lambda p: policy.unpack(p, info))(jitted)
    )
    g_eager = tg.grad(mlp, policy=policy)(ws, x)
    g_jit = jax.jit(tg.grad(mlp, policy=policy))(ws, x)
    for a, b in zip(g_eager, g_jit):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
    assert rel_err(g_jit, jax.grad(mlp)(ws, x)) > 0
